"""Specification of the token fill of packed bins (zephon/_core/packfill.pyx).

A plain-Python reference fill below states the rules as literally as possible; hypothesis drives it
and the compiled ``BinFill`` with the same placement rows (from the real placement kernels, some
of them corrupted) and the outputs must match exactly: the same calls fail, and what succeeds
leaves the same bins, blocks, fragments and items. Bad input is also checked case by case.
"""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from worker_kit import script_env

from zephon._core.binfill import BinPacker, FlatPacker
from zephon._core.packfill import (
    BinFill,
    field_lengths,
    held_arena_bytes,
    payload_fields,
    release_warm_arenas,
    token_lengths,
    warm_arena_bytes,
)
from zephon.types import SampleCursor, SampleMeta, SampleRecord

Row = tuple[int, int, int, int, int]  # (item, frag_start, frag_len, bin_id, bin_offset)


def token_arrays(lengths: Sequence[int], base: int = 0) -> list[npt.NDArray[np.int32]]:
    """Item i holds tokens (base + i) * 1000 + position: every token says where it came from."""
    return [((base + i) * 1000 + np.arange(n)).astype(np.int32) for i, n in enumerate(lengths)]


# --------------------------------------------------------------------------------------------------
# Reference fill: bins as Python lists, every rule checked on a copy before anything changes.


def side_arrays(arrays: list[np.ndarray], side_pads: Sequence[float]) -> list[list[np.ndarray]]:
    """Per side field, per item: values derived from the item's tokens (int32 for an int pad,
    float32 for a float pad), so that a misplaced range shows."""
    out = []
    for k, pad in enumerate(side_pads):
        if isinstance(pad, float):
            out.append([(a / 8.0 + k).astype(np.float32) for a in arrays])
        else:
            out.append([(a * 3 + k).astype(np.int32) for a in arrays])
    return out


class RefBinFill:
    def __init__(self, seq_len: int, pad_id: int = 0, side_pads: Sequence[float] = ()) -> None:
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.side_pads = list(side_pads)
        self.clear()

    def clear(self) -> None:
        # bin_id -> {"tokens", "segments", "positions", "frags": [(start, size, n)], "items"}
        self.bins: dict[int, dict[str, list[Any]]] = {}
        self.max_id = -1

    def write(
        self, rows: list[Row], arrays: list[np.ndarray], items: list[Any], sides: Sequence = ()
    ) -> None:
        if len(arrays) != len(items):
            raise ValueError("one array per item")
        for a in arrays:
            if not (
                isinstance(a, np.ndarray)
                and a.dtype == np.int32
                and a.dtype.isnative
                and a.ndim == 1
                and a.flags.c_contiguous
            ):
                raise TypeError("not a token array")
        if len(sides) != len(self.side_pads):
            raise ValueError("one list per side field")
        for pad, side in zip(self.side_pads, sides):
            dtype = np.float32 if isinstance(pad, float) else np.int32
            if len(side) != len(items):
                raise ValueError("one side array per item")
            for a, tokens in zip(side, arrays):
                if not (
                    isinstance(a, np.ndarray)
                    and a.dtype == dtype
                    and a.dtype.isnative
                    and a.ndim == 1
                    and a.flags.c_contiguous
                ):
                    raise TypeError("not a side array")
                if len(a) != len(tokens):
                    raise ValueError("side array length")
        bins = copy.deepcopy(self.bins)
        max_id = self.max_id
        for item, start, size, bin_id, offset in rows:
            if not 0 <= item < len(items):
                raise ValueError("item")
            n = len(arrays[item])
            if start < 0 or size < 0 or start + size > n:
                raise ValueError("range")
            if bin_id not in bins:
                if bin_id <= max_id:
                    raise ValueError("bin")
                max_id = bin_id
                bins[bin_id] = {k: [] for k in ("tokens", "segments", "positions", "frags")}
                bins[bin_id]["items"] = []
                bins[bin_id]["sides"] = [[] for _ in self.side_pads]
            b = bins[bin_id]
            if offset != len(b["tokens"]) or offset + size > self.seq_len:
                raise ValueError("offset")
            piece = arrays[item][start : start + size].tolist()
            if size:
                segment = (max(b["segments"]) if b["segments"] else 0) + 1
                b["tokens"] += piece
                b["segments"] += [segment] * size
                b["positions"] += list(range(size))
                for values, side in zip(b["sides"], sides):
                    values += side[item][start : start + size].view(np.int32).tolist()
            b["frags"].append((start, size, n))
        # Items are attached after the copy so that they stay the same objects.
        for bin_id, b in bins.items():
            if bin_id in self.bins:
                b["items"] = self.bins[bin_id]["items"]
        for item, _, _, bin_id, _ in rows:
            bins[bin_id]["items"].append(items[item])
        self.bins = bins
        self.max_id = max_id

    def take(self, bin_ids: list[int]) -> tuple[list[np.ndarray], list[list[Any]], list[tuple]]:
        missing = [b for b in bin_ids if b not in self.bins]
        if missing:
            raise KeyError(missing[0])
        if len(set(bin_ids)) != len(bin_ids):
            raise ValueError("twice")
        blocks, items, frags = [], [], []
        for bin_id in bin_ids:
            b = self.bins.pop(bin_id)
            pad = self.seq_len - len(b["tokens"])
            side_rows = [
                values
                + np.full(pad, side_pad, dtype=type(side_pad))
                .astype(np.float32 if isinstance(side_pad, float) else np.int32)
                .view(np.int32)
                .tolist()
                for values, side_pad in zip(b["sides"], self.side_pads)
            ]
            blocks.append(
                np.array(
                    [
                        b["tokens"] + [self.pad_id] * pad,
                        b["segments"] + [0] * pad,
                        b["positions"] + [0] * pad,
                        *side_rows,
                    ],
                    dtype=np.int32,
                )
            )
            items.append(b["items"])
            frags += b["frags"]
        return blocks, items, frags

    def open_bin_ids(self) -> list[int]:
        return sorted(self.bins)

    def used(self, bin_id: int) -> int:
        return len(self.bins[bin_id]["tokens"])


def assert_same_state(fill: BinFill, ref: RefBinFill) -> None:
    assert fill.open_bin_ids().tolist() == ref.open_bin_ids()
    assert fill.n_open == len(ref.bins)
    for bin_id in ref.open_bin_ids():
        assert fill.used(bin_id) == ref.used(bin_id)


def same_outcome(call_fill: Any, call_ref: Any) -> Any:
    """Both calls succeed with equal results, or both raise the same exception type."""
    try:
        expected = call_ref()
    except (ValueError, TypeError, KeyError) as exc:
        with pytest.raises(type(exc)):
            call_fill()
        return None
    return call_fill(), expected


def assert_same_take(got: Any, expected: Any) -> None:
    blocks, items, frags = got
    ref_blocks, ref_items, ref_frags = expected
    assert len(blocks) == len(ref_blocks)
    for block, ref_block in zip(blocks, ref_blocks):
        assert block.dtype == np.int32 and block.shape == ref_block.shape
        assert block.tolist() == ref_block.tolist()
        assert block.flags.owndata or block.base is not None
    assert [[id(x) for x in xs] for xs in items] == [[id(x) for x in xs] for xs in ref_items]
    assert frags.dtype == np.int64 and frags.shape == (len(ref_frags), 3)
    assert [tuple(r) for r in frags.tolist()] == ref_frags


# --------------------------------------------------------------------------------------------------
# Streams: micro-batches placed by a real kernel, sometimes with one placement value corrupted.

corruptions = st.one_of(
    st.none(),
    st.tuples(st.integers(0, 1000), st.integers(0, 4), st.sampled_from([-3, -1, 1, 2, 1 << 40])),
)
micro_batches = st.lists(st.integers(0, 40), max_size=12)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), micro_batches, corruptions),
        st.tuples(st.just("flush"), st.just([]), st.none()),
    ),
    max_size=14,
)


def corrupt(rows: list[Row], how: tuple[int, int, int] | None) -> list[Row]:
    if how is None or not rows:
        return rows
    at, column, delta = how
    at %= len(rows)
    row = list(rows[at])
    row[column] += delta
    return [*rows[:at], tuple(row), *rows[at + 1 :]]  # type: ignore[list-item]


def run_stream(
    kernel: BinPacker | FlatPacker,
    seq_len: int,
    pad_id: int,
    ops: list,
    side_pads: Sequence[float] = (),
    bad_side: int | None = None,
) -> None:
    fill = BinFill(seq_len, pad_id, side_pads)
    ref = RefBinFill(seq_len, pad_id, side_pads)
    base = 0
    for op, lengths, how in ops:
        if op == "flush":
            ids = kernel.flush()
            kernel.reset()
            outcome = same_outcome(partial(fill.take, ids), partial(ref.take, ids.tolist()))
            if outcome is not None:
                assert_same_take(*outcome)
            fill.clear()
            ref.clear()
            assert fill.n_open == 0
            continue
        arrays = token_arrays(lengths, base)
        items = [object() for _ in lengths]
        sides = side_arrays(arrays, side_pads)
        if bad_side is not None and sides and arrays:
            # One side array one value short: the call must fail on both sides, changing nothing.
            column = sides[bad_side % len(sides)]
            column[bad_side % len(column)] = column[bad_side % len(column)][:-1].copy()
        base += len(lengths)
        placements, closed = kernel.add(np.asarray(lengths, dtype=np.int64))
        rows = corrupt([tuple(r) for r in placements.tolist()], how)
        placed = np.array(rows, dtype=np.int64).reshape(-1, 5)
        same_outcome(
            partial(fill.write, placed, arrays, items, sides),
            partial(ref.write, rows, arrays, items, sides),
        )
        assert_same_state(fill, ref)
        ids = closed.tolist()
        outcome = same_outcome(partial(fill.take, closed), partial(ref.take, ids))
        if outcome is not None:
            assert_same_take(*outcome)
        assert_same_state(fill, ref)


@settings(max_examples=150)
@given(
    seq_len=st.integers(1, 24),
    open_bins=st.integers(1, 5),
    strategy=st.sampled_from(["best_fit", "first_fit"]),
    pad_id=st.sampled_from([0, -1, 7]),
    ops=operations,
)
def test_bin_fill_matches_the_reference_behind_a_bin_packer(
    seq_len: int, open_bins: int, strategy: str, pad_id: int, ops: list
) -> None:
    run_stream(BinPacker(seq_len, open_bins, strategy), seq_len, pad_id, ops)  # type: ignore[arg-type]


@settings(max_examples=100)
@given(seq_len=st.integers(1, 24), pad_id=st.sampled_from([0, 5]), ops=operations)
def test_bin_fill_matches_the_reference_behind_a_flat_packer(
    seq_len: int, pad_id: int, ops: list
) -> None:
    run_stream(FlatPacker(seq_len), seq_len, pad_id, ops)


side_pad_lists = st.lists(
    st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([0.0, -1.5, 1e30])), max_size=3
)


@settings(max_examples=120)
@given(
    seq_len=st.integers(1, 24),
    open_bins=st.integers(1, 5),
    strategy=st.sampled_from(["best_fit", "first_fit", "flat"]),
    side_pads=side_pad_lists,
    bad_side=st.one_of(st.none(), st.integers(0, 100)),
    ops=operations,
)
def test_side_fields_are_cut_where_the_tokens_are_cut_and_padded_with_their_value(
    seq_len: int,
    open_bins: int,
    strategy: str,
    side_pads: list[float],
    bad_side: int | None,
    ops: list,
) -> None:
    kernel = (
        FlatPacker(seq_len) if strategy == "flat" else BinPacker(seq_len, open_bins, strategy)  # type: ignore[arg-type]
    )
    run_stream(kernel, seq_len, -1, ops, side_pads, bad_side)


# --------------------------------------------------------------------------------------------------
# The rules one by one.


def test_side_rows_follow_the_positions_row_and_float_rows_hold_float32_bits() -> None:
    fill = BinFill(6, pad_id=-1, side_pads=(-100, 0.5))
    assert fill.side_pads == (-100, 0.5) and fill.side_dtypes == ("int32", "float32")
    arrays = token_arrays([3, 2])
    labels = [np.array([7, 8, 9], np.int32), np.array([5, 6], np.int32)]
    weights = [np.array([0.25, 1, 2], np.float32), np.array([3, 4], np.float32)]
    rows = [(0, 1, 2, 0, 0), (1, 0, 2, 0, 2)]
    fill.write(np.array(rows, dtype=np.int64), arrays, ["a", "b"], [labels, weights])
    (block,), _, _ = fill.take(np.array([0], dtype=np.int64))
    assert block.shape == (5, 6)
    assert block[0].tolist() == [1, 2, 1000, 1001, -1, -1]
    assert block[3].tolist() == [8, 9, 5, 6, -100, -100]
    assert block[4].view(np.float32).tolist() == [1, 2, 3, 4, 0.5, 0.5]


@pytest.mark.parametrize(
    ("sides", "error", "match"),
    [
        ([], ValueError, "0 side fields given, the fill has 1"),
        ([[np.zeros(3, np.int32)], [np.zeros(3, np.int32)]], ValueError, "2 side fields"),
        ([[]], ValueError, r"sides\[0\] has 0 arrays for 1 items"),
        ([[np.zeros(2, np.int32)]], ValueError, r"sides\[0\]\[0\] has 2 values for the 3 tokens"),
        ([[np.zeros(3, np.int64)]], TypeError, r"sides\[0\]\[0\] must be .* int32"),
        ([[np.zeros(3, np.float32)]], TypeError, r"sides\[0\]\[0\]"),
        ([[np.zeros(6, np.int32)[::2]]], TypeError, r"sides\[0\]\[0\]"),
        ([[[0, 0, 0]]], TypeError, r"sides\[0\]\[0\]"),
    ],
)
def test_bad_side_arrays_are_refused_naming_them_and_change_nothing(
    sides: Any, error: type, match: str
) -> None:
    fill = BinFill(8, side_pads=(0,))
    with pytest.raises(error, match=match):
        fill.write(np.array([[0, 0, 3, 0, 0]], dtype=np.int64), token_arrays([3]), [0], sides)
    assert fill.n_open == 0


@pytest.mark.parametrize(
    ("pads", "error"),
    [((True,), TypeError), ((2**31,), ValueError), (("0",), TypeError), ((1e40,), ValueError)],
)
def test_bad_side_padding_values_are_rejected(pads: tuple, error: type) -> None:
    with pytest.raises(error, match=r"side_pads\[0\]"):
        BinFill(8, 0, pads)


def test_field_lengths_checks_the_dtype_of_a_side_field() -> None:
    assert field_lengths([np.zeros(2, np.float32)], "float32").tolist() == [2]
    with pytest.raises(TypeError, match=r"arrays\[0\]"):
        field_lengths([np.zeros(2, np.float64)], "float32")
    with pytest.raises(ValueError, match="dtype"):
        field_lengths([], "int64")  # type: ignore[arg-type]


def test_fragments_sit_back_to_back_with_segments_and_positions_and_padding() -> None:
    fill = BinFill(8, pad_id=-1)
    arrays = token_arrays([3, 0, 2])
    items = ["a", "b", "c"]
    rows = [(0, 0, 3, 0, 0), (1, 0, 0, 0, 3), (2, 0, 2, 0, 3)]
    fill.write(np.array(rows, dtype=np.int64), arrays, items)
    assert fill.used(0) == 5
    (block,), (got_items,), frags = fill.take(np.array([0], dtype=np.int64))
    assert block.tolist() == [
        [0, 1, 2, 2000, 2001, -1, -1, -1],
        [1, 1, 1, 2, 2, 0, 0, 0],  # the empty fragment takes no segment id
        [0, 1, 2, 0, 1, 0, 0, 0],
    ]
    assert got_items == ["a", "b", "c"]
    assert frags.tolist() == [[0, 3, 3], [0, 0, 0], [0, 2, 2]]
    assert fill.n_open == 0


def test_a_bin_stays_open_across_writes_and_blocks_are_never_shared() -> None:
    fill = BinFill(4)
    fill.write(np.array([[0, 0, 2, 0, 0]], dtype=np.int64), token_arrays([2]), ["x"])
    fill.write(np.array([[0, 0, 2, 0, 2]], dtype=np.int64), token_arrays([2], base=5), ["y"])
    fill.write(np.array([[0, 0, 1, 1, 0]], dtype=np.int64), token_arrays([1], base=9), ["z"])
    blocks, items, _ = fill.take(np.array([1, 0], dtype=np.int64))
    assert items == [["z"], ["x", "y"]]
    assert blocks[1][0].tolist() == [0, 1, 5000, 5001]
    assert blocks[1][1].tolist() == [1, 1, 2, 2]
    assert not np.shares_memory(blocks[0], blocks[1])


def test_bins_taken_one_after_another_are_rows_back_to_back_in_one_arena() -> None:
    fill = BinFill(4, side_pads=(0.5,))
    arrays = token_arrays([3, 2, 4])
    rows = np.array([[0, 0, 3, 0, 0], [1, 0, 2, 1, 0], [2, 0, 4, 2, 0]], dtype=np.int64)
    fill.write(rows, arrays, ["a", "b", "c"], side_arrays(arrays, (0.5,)))
    first, _, _ = fill.take(np.array([1], dtype=np.int64))
    later, _, _ = fill.take(np.array([2, 0], dtype=np.int64))
    blocks = first + later
    assert len({id(b.base) for b in blocks}) == 1 and type(blocks[0].base).__name__ == "RowArena"
    for field in range(4):  # each field's rows follow each other in the order the bins left
        starts = [b[field].__array_interface__["data"][0] for b in blocks]
        assert np.diff(starts).tolist() == [4 * 4, 4 * 4]
    assert [b[0].tolist() for b in blocks] == [[1000, 1001, 0, 0], [2000, 2001, 2002, 2003],
                                               [0, 1, 2, 0]]  # fmt: skip
    assert blocks[0][3].view(np.float32).tolist() == [125.0, 125.125, 0.5, 0.5]


def test_memory_a_view_still_holds_is_never_written_again() -> None:
    # Enough bins for many arenas: the first block, still held, keeps its values, and every
    # block taken later is its own memory.
    fill = BinFill(1024)
    fill.write(np.array([[0, 0, 5, 0, 0]], dtype=np.int64), token_arrays([5]), ["first"])
    (kept,), _, _ = fill.take(np.array([0], dtype=np.int64))
    expected = kept.copy()
    for bin_id in range(1, 2000):
        fill.write(
            np.array([[0, 0, 7, bin_id, 0]], dtype=np.int64), token_arrays([7], bin_id), [bin_id]
        )
        (block,), _, _ = fill.take(np.array([bin_id], dtype=np.int64))
        assert not np.shares_memory(block, kept)
        assert block[0, :8].tolist() == [bin_id * 1000 + k for k in range(7)] + [0]
    assert np.array_equal(kept, expected)


def take_one_by_one(fill: BinFill, bin_ids: range) -> list[np.ndarray]:
    """The blocks of bins ``bin_ids``, each holding 3 tokens of its own, taken as they fill."""
    blocks = []
    for bin_id in bin_ids:
        rows = np.array([[0, 0, 3, bin_id, 0]], dtype=np.int64)
        fill.write(rows, token_arrays([3], bin_id), [bin_id])
        blocks += fill.take(np.array([bin_id], dtype=np.int64))[0]
    return blocks


def test_a_new_fill_writes_into_the_arenas_a_dropped_fill_left() -> None:
    # Fresh memory costs a page fault per page: a pipeline built after another one (the next
    # epoch's, an evaluation's) reuses the arenas of the first one's packer.
    release_warm_arenas()
    first = BinFill(1000)
    take_one_by_one(first, range(1))  # a block taken, and let go
    del first
    assert warm_arena_bytes() == 128 * 3 * 1000 * 4  # its arena: 128 bins of 3 rows of 1,000
    second = BinFill(1000)
    (block,) = take_one_by_one(second, range(1))
    assert warm_arena_bytes() == 0  # taken back by the second fill
    assert block[0, :4].tolist() == [0, 1, 2, 0] and not block[1:, 3:].any()
    release_warm_arenas()


def test_an_arena_a_view_still_holds_is_not_written_by_another_fill() -> None:
    release_warm_arenas()
    first = BinFill(1000)
    (held,) = take_one_by_one(first, range(7, 8))
    expected = held.copy()
    del first  # its arena goes on to the next fills, still under the view
    assert warm_arena_bytes() > 0
    later = take_one_by_one(BinFill(1000), range(400))  # a few arenas' worth
    assert not any(np.shares_memory(block, held) for block in later)
    assert np.array_equal(held, expected)
    release_warm_arenas()


def test_the_arenas_kept_for_the_next_fills_are_bounded() -> None:
    release_warm_arenas()
    fills = [BinFill(2048) for _ in range(60)]
    for fill in fills:  # each has an arena of 64 bins of 3 rows of 2,048 tokens (1.5 MiB)
        take_one_by_one(fill, range(1))
    del fill, fills
    assert 40 * (3 << 19) <= warm_arena_bytes() <= 64 << 20
    assert release_warm_arenas() > 0 and warm_arena_bytes() == 0


GC_CYCLE_SCRIPT = """
import gc
import numpy as np
from zephon._core.packfill import BinFill, warm_arena_bytes

def take_one(fill, bin_id):
    rows = np.array([[0, 0, 3, bin_id, 0]], dtype=np.int64)
    fill.write(rows, [np.arange(3, dtype=np.int32) + 7], [bin_id])
    (block,), _, _ = fill.take(np.array([bin_id], dtype=np.int64))
    return block

cycle = []  # made before the fill, so that the collector clears the list before the fill
first = BinFill(1000)
take_one(first, 0)
cycle += [first, cycle]  # the fill is reachable from nothing but a reference cycle
del first, cycle
gc.collect()
assert warm_arena_bytes() > 0  # its arena went on to the next fills
second = BinFill(1000)
blocks = [take_one(second, i) for i in range(200)]
print(blocks[0][0, :4].tolist(), blocks[-1][0, :4].tolist())
"""


def test_a_fill_collected_in_a_reference_cycle_leaves_its_arena_whole() -> None:
    # A fill that dies in a cycle (a packer held by records it made, a lane's chain) passes
    # its arena on to the next fills, which write to it: the collector must not have freed the
    # arena's memory. Arenas are mapped memory here (a low mmap threshold), so a write to a
    # freed one ends the process.
    env = {**script_env(), "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run(
        [sys.executable, "-c", GC_CYCLE_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.split() == ["[7,", "8,", "9,", "0]", "[7,", "8,", "9,", "0]"]


def test_fills_made_with_arenas_of_write_their_rows_one_after_another_in_one_arena() -> None:
    first = BinFill(1000)
    second = BinFill(1000, pad_id=7, arenas_of=first)
    blocks = take_one_by_one(first, range(2)) + take_one_by_one(second, range(3))
    blocks += take_one_by_one(first, range(2, 3))
    assert len({id(b.base) for b in blocks}) == 1
    starts = [b[0].__array_interface__["data"][0] for b in blocks]
    assert np.diff(starts).tolist() == [1000 * 4] * 5
    assert [b[0, :4].tolist() for b in blocks] == [
        [0, 1, 2, 0], [1000, 1001, 1002, 0], [0, 1, 2, 7], [1000, 1001, 1002, 7],
        [2000, 2001, 2002, 7], [2000, 2001, 2002, 0],
    ]  # fmt: skip
    arena = 128 * 3 * 1000 * 4  # 128 bins of 3 rows of 1,000
    assert held_arena_bytes([first]) == held_arena_bytes([first, second]) == arena
    assert held_arena_bytes([first, BinFill(1000)]) == arena  # a fill that took no row: none
    del first  # the arenas stay with the fill that shares them
    (block,) = take_one_by_one(second, range(3, 4))
    assert block[0].__array_interface__["data"][0] == starts[-1] + 1000 * 4


def test_fills_sharing_arenas_never_write_under_a_view() -> None:
    # Ten fills on one set of arenas take bins in turn, each block held by a view: all keep
    # their values, over three arenas (256 bins of 4 rows of 512 tokens each).
    fills = [BinFill(512, side_pads=(1,))]
    fills += [BinFill(512, side_pads=(2,), arenas_of=fills[0]) for _ in range(9)]
    kept = []
    for bin_id in range(60):
        for k, fill in enumerate(fills):
            arrays = token_arrays([3], base=k)
            rows = np.array([[0, 0, 3, bin_id, 0]], dtype=np.int64)
            fill.write(rows, arrays, [k], side_arrays(arrays, fill.side_pads))
            kept += fill.take(np.array([bin_id], dtype=np.int64))[0]
    assert len({id(b.base) for b in kept}) == 3
    assert [b[0, :4].tolist() for b in kept] == [
        [k * 1000, k * 1000 + 1, k * 1000 + 2, 0] for _ in range(60) for k in range(10)
    ]
    assert [int(b[3, -1]) for b in kept] == ([1] + [2] * 9) * 60


def test_a_fill_shares_the_arenas_of_a_fill_of_its_shape_only() -> None:
    with pytest.raises(ValueError, match="arenas_of has seq_len 8 and 0 side fields"):
        BinFill(9, arenas_of=BinFill(8))
    with pytest.raises(ValueError, match="arenas_of has seq_len 8 and 1 side fields"):
        BinFill(8, arenas_of=BinFill(8, side_pads=(0.5,)))
    with pytest.raises(TypeError):
        BinFill(8, arenas_of="fill")  # type: ignore[arg-type]
    BinFill(8, side_pads=(3,), arenas_of=BinFill(8, side_pads=(0.5,)))  # padding may differ


def test_an_item_is_read_when_its_bin_leaves() -> None:
    # The fill holds the item's array, not a copy: what the array holds when the bin is taken is
    # what the block gets (the packers hand over arrays nothing writes to afterwards).
    fill = BinFill(4)
    (array,) = token_arrays([2])
    fill.write(np.array([[0, 0, 2, 0, 0]], dtype=np.int64), [array], ["x"])
    del array  # the fill keeps it alive
    (block,), _, _ = fill.take(np.array([0], dtype=np.int64))
    assert block[0].tolist() == [0, 1, 0, 0]


def test_slots_are_recycled_without_stale_tokens() -> None:
    fill = BinFill(4, pad_id=9)
    for base in range(50):
        fill.write(np.array([[0, 0, 3, base, 0]], dtype=np.int64), token_arrays([3], base), [base])
        (block,), _, _ = fill.take(np.array([base], dtype=np.int64))
        assert block.tolist() == [[base * 1000, base * 1000 + 1, base * 1000 + 2, 9],
                                  [1, 1, 1, 0], [0, 1, 2, 0]]  # fmt: skip


def test_many_bins_opened_by_one_write() -> None:
    # A long item fills thousands of bins in one call: lookups stay correct as _live grows.
    kernel = BinPacker(3, 2)
    lengths = np.array([10_000, 4, 1], dtype=np.int64)
    placements, closed = kernel.add(lengths)
    arrays = token_arrays(lengths.tolist())
    fill = BinFill(3)
    fill.write(placements, arrays, [0, 1, 2])
    blocks, _, _ = fill.take(closed)
    blocks += fill.take(kernel.flush())[0]
    tokens = sorted(t for b in blocks for t, s in zip(b[0].tolist(), b[1].tolist()) if s)
    assert tokens == sorted(np.concatenate(arrays).tolist())


def test_after_clear_bin_ids_start_again() -> None:
    fill = BinFill(4)
    fill.write(np.array([[0, 0, 1, 3, 0]], dtype=np.int64), token_arrays([1]), [0])
    fill.clear()
    assert fill.n_open == 0 and fill.open_bin_ids().tolist() == []
    fill.write(np.array([[0, 0, 1, 0, 0]], dtype=np.int64), token_arrays([1]), [0])
    assert fill.open_bin_ids().tolist() == [0]


@given(
    frags=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4), st.integers(0, 3)), max_size=24)
)
def test_contents_names_each_item_once_in_bin_order_and_rebuilds_the_bins(
    frags: list[tuple[int, int, int]],
) -> None:
    # (bin, item, size): an item may sit in several bins, or twice in one (the slow path).
    seq_len = 12
    arrays = token_arrays([8] * 5)
    items = [object() for _ in arrays]  # identity is what tells items apart
    ids: dict[int, int] = {}  # bins numbered by first use, so they open in ascending order
    used: dict[int, int] = {}
    rows = []
    for b, item, size in frags:
        bin_id = ids.setdefault(b, len(ids))
        if used.get(bin_id, 0) + size > seq_len:
            continue
        rows.append((item, 0, size, bin_id, used.get(bin_id, 0)))
        used[bin_id] = used.get(bin_id, 0) + size
    fill = BinFill(seq_len)
    if rows:
        fill.write(np.array(rows, dtype=np.int64), arrays, items)
    got_rows, got_items = fill.contents()
    in_order = sorted(rows, key=lambda r: r[3])  # stable: a bin's fragments keep their order
    expected_items: list[object] = []
    for r in in_order:
        if not any(items[r[0]] is x for x in expected_items):
            expected_items.append(items[r[0]])
    assert len(got_items) == len(expected_items)
    assert all(a is b for a, b in zip(got_items, expected_items))
    assert [(got_items[r[0]], *r[1:]) for r in got_rows.tolist()] == [
        (items[r[0]], *r[1:]) for r in in_order
    ]
    rebuilt = BinFill(seq_len)
    if len(got_rows):
        by_item = [arrays[next(i for i, x in enumerate(items) if x is it)] for it in got_items]
        rebuilt.write(got_rows, by_item, got_items)
    open_ids = fill.open_bin_ids()
    assert rebuilt.open_bin_ids().tolist() == open_ids.tolist()
    blocks, recs, spans = fill.take(open_ids)
    assert_same_take(rebuilt.take(open_ids), (blocks, recs, [tuple(r) for r in spans.tolist()]))


def test_token_lengths_reads_the_arrays_in_place() -> None:
    assert token_lengths(token_arrays([0, 5, 2])).tolist() == [0, 5, 2]
    assert token_lengths([]).dtype == np.int64


def ref_payload_fields(
    records: list[SampleRecord], field: str, sides: tuple[tuple[str, str], ...]
) -> tuple[list[Any], list[int], list[list[Any]]] | None:
    """The common case ``payload_fields`` reads, stated plainly: dict payloads whose fields are
    1-D, C-contiguous, native arrays of their dtype, the side fields as long as the tokens."""

    def flat(a: Any, dtype: str) -> bool:
        return (
            isinstance(a, np.ndarray)
            and a.ndim == 1
            and a.dtype == np.dtype(dtype)
            and a.dtype.isnative
            and a.flags.c_contiguous
        )

    arrays: list[Any] = []
    lengths: list[int] = []
    per_side: list[list[Any]] = [[] for _ in sides]
    for rec in records:
        payload = rec.payload
        if type(payload) is not dict or not flat(payload.get(field), "int32"):
            return None
        arrays.append(payload[field])
        lengths.append(len(payload[field]))
        for values, (name, dtype) in zip(per_side, sides):
            value: Any = payload.get(name)
            if not flat(value, dtype) or len(value) != lengths[-1]:
                return None
            values.append(value)
    return arrays, lengths, per_side


class _Mapping(dict[str, Any]):
    """A dict subclass: not the common case (its lookups may run Python code)."""


def _odd_values(n: int, dtype: str) -> list[Any]:
    """What a field of ``dtype`` and ``n`` tokens must not hold to be read in place: one value too
    many, the other dtype, or not a flat native array at all."""
    other = "float32" if dtype == "int32" else "int32"
    return [np.arange(n + 1).astype(dtype), np.arange(n).astype(other), *BAD_ARRAYS.values()]


@st.composite
def payload_records(draw: st.DrawFn) -> tuple[list[SampleRecord], tuple[tuple[str, str], ...]]:
    """Records in the common case, then now and then one of them spoilt: a field missing or odd,
    or a payload that is not a plain dict."""
    sides = tuple(
        (name, draw(st.sampled_from(["int32", "float32"])))
        for name in draw(st.lists(st.sampled_from(["mask", "weights"]), unique=True, max_size=2))
    )
    fields = [("tokens", "int32"), *sides]
    payloads: list[Any] = []
    for _ in range(draw(st.integers(0, 6))):
        n = draw(st.integers(0, 4))
        payloads.append({name: np.arange(n).astype(dtype) for name, dtype in fields})
    spoil = draw(st.booleans())
    if payloads and spoil:
        i = draw(st.integers(0, len(payloads) - 1))
        name, dtype = draw(st.sampled_from(fields))
        n = len(payloads[i]["tokens"])
        how = draw(st.sampled_from(["missing", "odd", "mapping", "tuple"]))
        if how == "missing":
            del payloads[i][name]
        elif how == "odd":
            payloads[i][name] = draw(st.sampled_from(_odd_values(n, dtype)))
        elif how == "mapping":
            payloads[i] = _Mapping(payloads[i])
        else:
            payloads[i] = tuple(payloads[i].values())
    records = [
        SampleRecord(SampleMeta(SampleCursor(0, i, (0, 0, 9))), payload)
        for i, payload in enumerate(payloads)
    ]
    return records, sides


@settings(max_examples=300, deadline=None)
@given(payload_records())
def test_payload_fields_reads_exactly_the_common_case(
    case: tuple[list[SampleRecord], tuple[tuple[str, str], ...]],
) -> None:
    records, sides = case
    want = ref_payload_fields(records, "tokens", sides)
    got = payload_fields(records, "tokens", sides)  # type: ignore[arg-type]
    if want is None:
        assert got is None
        return
    assert got is not None
    arrays, lengths, per_side = got
    assert [id(a) for a in arrays] == [id(a) for a in want[0]]  # read in place, not copied
    assert lengths.dtype == np.int64 and lengths.tolist() == want[1]
    assert [[id(a) for a in side] for side in per_side] == [[id(a) for a in s] for s in want[2]]


def test_payload_fields_rejects_what_is_not_a_record_or_a_side_dtype() -> None:
    good = SampleRecord(
        SampleMeta(SampleCursor(0, 0, (0, 0, 9))), {"tokens": np.zeros(2, np.int32)}
    )
    with pytest.raises(TypeError):
        payload_fields([good, {"tokens": np.zeros(2, np.int32)}], "tokens", ())
    with pytest.raises(ValueError, match="dtype"):
        payload_fields([good], "tokens", (("tokens", "int64"),))  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# Bad input: a clear error, and nothing changes.

BAD_ARRAYS = {
    "int64": np.arange(3, dtype=np.int64),
    "uint32": np.arange(3, dtype=np.uint32),
    "float32": np.arange(3, dtype=np.float32),
    "strided": np.arange(6, dtype=np.int32)[::2],
    "2-D": np.arange(6, dtype=np.int32).reshape(2, 3),
    "big-endian": np.arange(3, dtype=">i4"),
    "list": [1, 2, 3],
    "None": None,
}


@pytest.mark.parametrize("bad", list(BAD_ARRAYS.values()), ids=list(BAD_ARRAYS))
def test_an_array_that_is_not_contiguous_native_int32_is_a_type_error_naming_it(bad: Any) -> None:
    arrays: list[Any] = [*token_arrays([3]), bad]
    with pytest.raises(TypeError, match=r"arrays\[1\]"):
        token_lengths(arrays)
    fill = BinFill(8)
    with pytest.raises(TypeError, match=r"arrays\[1\]"):
        fill.write(np.array([[0, 0, 3, 0, 0]], dtype=np.int64), arrays, [0, 1])
    assert fill.n_open == 0


def test_placements_must_be_an_int64_table_of_five_columns() -> None:
    fill = BinFill(8)
    arrays = token_arrays([3])
    with pytest.raises(ValueError, match="dtype"):
        fill.write(np.array([[0, 0, 3, 0, 0]], dtype=np.int32), arrays, [0])
    with pytest.raises(ValueError, match="5 columns"):
        fill.write(np.array([[0, 0, 3, 0]], dtype=np.int64), arrays, [0])
    with pytest.raises(ValueError, match="one per item"):
        fill.write(np.array([[0, 0, 3, 0, 0]], dtype=np.int64), arrays, [0, 1])
    with pytest.raises(TypeError):
        fill.write(np.array([[0, 0, 3, 0, 0]], dtype=np.int64), tuple(arrays), [0])  # type: ignore[arg-type]
    assert fill.n_open == 0


@pytest.mark.parametrize(
    ("row", "why"),
    [
        ((1, 0, 3, 0, 0), "not one of the 1 items"),
        ((-1, 0, 3, 0, 0), "not one of the 1 items"),
        ((0, 1, 3, 0, 0), "outside its item"),
        ((0, -1, 1, 0, 0), "outside its item"),
        ((0, 0, -1, 0, 0), "outside its item"),
        ((0, 0, 1, 1, 1), "filled to 2, not to bin_offset 1"),
        ((0, 0, 1, 8, 1), "filled to 0, not to bin_offset 1"),
        ((0, 0, 3, 1, 2), "past seq_len 4"),
        ((0, 0, 1, 3, 0), "bin 3 is not open"),
        ((0, 0, 1, -5, 0), "bin -5 is not open"),
    ],
)
def test_an_out_of_range_placement_is_a_value_error_naming_the_row(row: Row, why: str) -> None:
    fill = BinFill(4)
    fill.write(np.array([[0, 0, 2, 1, 0]], dtype=np.int64), token_arrays([2]), ["first"])
    rows = np.array([(0, 0, 0, 7, 0), row], dtype=np.int64)  # a good row first: not applied either
    with pytest.raises(ValueError, match=rf"placement row 1 .*{why}"):
        fill.write(rows, token_arrays([3]), ["second"])
    assert fill.open_bin_ids().tolist() == [1]
    assert fill.used(1) == 2
    (_,), (items,), _ = fill.take(np.array([1], dtype=np.int64))
    assert items == ["first"]


def test_a_bin_that_left_cannot_be_written_again() -> None:
    fill = BinFill(4)
    fill.write(np.array([[0, 0, 1, 0, 0]], dtype=np.int64), token_arrays([1]), [0])
    fill.take(np.array([0], dtype=np.int64))
    with pytest.raises(ValueError, match="bin 0 is not open"):
        fill.write(np.array([[0, 0, 1, 0, 1]], dtype=np.int64), token_arrays([1]), [0])


def test_take_of_a_bin_not_open_or_given_twice_changes_nothing() -> None:
    fill = BinFill(4)
    fill.write(np.array([[0, 0, 1, 0, 0], [1, 0, 1, 1, 0]], dtype=np.int64),
               token_arrays([1, 1]), ["a", "b"])  # fmt: skip
    with pytest.raises(KeyError, match="bin 5"):
        fill.take(np.array([0, 5], dtype=np.int64))
    with pytest.raises(ValueError, match="bin 0 is given twice"):
        fill.take(np.array([0, 1, 0], dtype=np.int64))
    with pytest.raises(ValueError, match="dtype"):
        fill.take(np.array([0], dtype=np.int32))
    assert fill.open_bin_ids().tolist() == [0, 1]
    _, items, _ = fill.take(np.array([1, 0], dtype=np.int64))
    assert items == [["b"], ["a"]]
    with pytest.raises(KeyError):
        fill.used(0)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((0,), ValueError),
        ((2**31,), ValueError),
        ((8, 2**31), ValueError),
        ((8, -(2**31) - 1), ValueError),
        ((True,), TypeError),
        ((8, False), TypeError),
        ((8.0,), TypeError),
    ],
)
def test_bad_construction_arguments_are_rejected(args: tuple, error: type) -> None:
    with pytest.raises(error):
        BinFill(*args)


def test_a_bin_fill_does_not_pickle() -> None:
    fill = BinFill(4, pad_id=3)
    assert (fill.seq_len, fill.pad_id) == (4, 3)
    assert "seq_len=4" in repr(fill)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(fill)


# --------------------------------------------------------------------------------------------------
# Concurrent use: a fill written by one thread while others take its bins and read it.

FILL_HAMMER = """
from zephon._core.binfill import FlatPacker
from zephon._core.packfill import BinFill

SEQ = 64
fill = BinFill(SEQ, pad_id=-1)
packer = FlatPacker(SEQ)
closed_bins = queue.Queue()
expected = {}  # bin id -> its tokens, written by the writer before the bin is queued
problems = []
refused = []
done = threading.Event()


def writer():
    rng = np.random.default_rng(0)
    try:
        for call in range(40):
            lengths = rng.integers(1, 200, size=int(rng.integers(1, 3000))).astype(np.int64)
            arrays = [
                (call * 10**6 + i * 1000 + np.arange(n)).astype(np.int32)
                for i, n in enumerate(lengths)
            ]
            rows, closed = packer.add(lengths)
            for item, start, size, bin_id, _ in rows.tolist():
                expected.setdefault(bin_id, []).append(arrays[item][start : start + size])
            try:
                fill.write(rows, arrays, list(range(len(arrays))))
            except RuntimeError as exc:
                refused.append(str(exc))
                return
            closed_bins.put(closed)
        closed_bins.put(packer.flush())
    finally:
        closed_bins.put(None)  # the taker stops even when the writer failed


def next_closed():
    # Poll instead of blocking, so the taker is ready to run whenever the writer lets go of the GIL.
    while True:
        try:
            return closed_bins.get_nowait()
        except queue.Empty:
            pass


def taker():
    try:
        while (ids := next_closed()) is not None:
            try:
                blocks, _, _ = fill.take(ids)
            except RuntimeError as exc:
                refused.append(str(exc))
                continue
            for bin_id, block in zip(ids.tolist(), blocks):
                tokens = np.concatenate(expected.pop(bin_id))
                row = block[0]
                padded = (row[len(tokens) :] == -1).all()
                if not (np.array_equal(row[: len(tokens)], tokens) and padded):
                    problems.append(f"bin {bin_id} does not hold the tokens written to it")
    finally:
        done.set()  # the reader stops even when the taker failed


def reader():
    while not done.is_set():
        try:
            ids = fill.open_bin_ids()
            if (np.diff(ids) <= 0).any():
                problems.append(f"open bin ids out of order: {ids[:8].tolist()}")
            for bin_id in ids[:4].tolist():
                try:
                    if not 0 <= fill.used(bin_id) <= SEQ:
                        problems.append(f"bin {bin_id} reports an impossible fill")
                except KeyError:
                    pass  # taken in the meantime
        except RuntimeError as exc:
            refused.append(str(exc))


errors = hammer(3, lambda t: (writer, taker, reader)[t]())
if expected or fill.n_open:
    problems.append(f"{len(expected)} bins were never handed over")
summary = {"errors": errors[:3], "refused": refused[:3], "problems": problems[:5]}
print(json.dumps(summary))
"""


def test_a_fill_written_taken_and_read_from_several_threads_stays_exact() -> None:
    from threads_kit import run_threads

    assert run_threads(FILL_HAMMER) == {"errors": [], "refused": [], "problems": []}


# Fills on four threads at once, each dropped after 150 bins (two arenas) with one view kept:
# the next fills take those arenas back, and must leave the memory under every view alone.
WARM_HAMMER = """
from zephon._core.packfill import BinFill

def work(t):
    held = []
    for r in range(15):
        fill = BinFill(1000)
        blocks = []
        for b in range(r * 150, r * 150 + 150):
            tokens = np.arange(3, dtype=np.int32) + b * 1000
            fill.write(np.array([[0, 0, 3, b, 0]], dtype=np.int64), [tokens], [b])
            blocks += fill.take(np.array([b], dtype=np.int64))[0]
        held.append((blocks[t * 30], blocks[t * 30].copy()))
        del fill, blocks
    bad = [i for i, (block, copy) in enumerate(held) if not np.array_equal(block, copy)]
    if bad:
        raise AssertionError(f"the memory under views {bad} was written again")

print(json.dumps({"errors": hammer(4, work)}))
"""


def test_fills_on_several_threads_share_warm_arenas_and_never_write_under_a_view() -> None:
    from threads_kit import run_threads

    assert run_threads(WARM_HAMMER) == {"errors": []}


# Fills on four threads at once, all writing into the arenas of one fill and keeping every block:
# each bin gets a row of its own, which nothing writes again while its view lives.
SHARED_HAMMER = """
from zephon._core.packfill import BinFill

first = BinFill(1000)

def work(t):
    fill = BinFill(1000, arenas_of=first)
    held = []
    for b in range(300):
        tokens = np.arange(3, dtype=np.int32) + (t * 1000 + b) * 1000
        fill.write(np.array([[0, 0, 3, b, 0]], dtype=np.int64), [tokens], [b])
        (block,), _, _ = fill.take(np.array([b], dtype=np.int64))
        held.append((block, block.copy()))
    bad = [i for i, (block, copy) in enumerate(held) if not np.array_equal(block, copy)]
    if bad:
        raise AssertionError(f"the memory under views {bad[:5]} was written again")

print(json.dumps({"errors": hammer(4, work)}))
"""


def test_fills_sharing_arenas_on_several_threads_never_write_under_a_view() -> None:
    from threads_kit import run_threads

    assert run_threads(SHARED_HAMMER) == {"errors": []}
