"""Specification of the bin-fill kernels (zephon/_core/binfill.pyx).

Plain-Python reference packers below state the placement rules as literally as possible; hypothesis
feeds the same random streams of add/flush/reset calls to them and to the compiled kernels and the
outputs must match exactly. Invariants are also checked on their own, without the references.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon._core.binfill import BinPacker, FlatPacker

Row = tuple[int, int, int, int, int]  # (item, frag_start, frag_len, bin_id, bin_offset)
Strategy = Literal["best_fit", "first_fit"]
Packer = BinPacker | FlatPacker


def arr(values: Sequence[int]) -> npt.NDArray[np.int64]:
    return np.asarray(values, dtype=np.int64)


def rows_of(placements: npt.NDArray[np.int64]) -> list[Row]:
    assert placements.dtype == np.int64
    assert placements.ndim == 2
    assert placements.shape[1] == 5
    return [(int(a), int(b), int(c), int(d), int(e)) for a, b, c, d, e in placements.tolist()]


def ids_of(ids: npt.NDArray[np.int64]) -> list[int]:
    assert ids.dtype == np.int64
    assert ids.ndim == 1
    return [int(x) for x in ids.tolist()]


# --------------------------------------------------------------------------------------------------
# Reference packers: the packing rules, written out with lists.


class RefBinPacker:
    def __init__(
        self,
        capacity: int,
        max_open_bins: int,
        strategy: Strategy,
        cut_to_fill: bool = False,
        max_segments: int | None = None,
    ) -> None:
        self.capacity = capacity
        self.max_open_bins = max_open_bins
        self.strategy = strategy
        self.cut_to_fill = cut_to_fill
        self.max_segments = max_segments
        self.reset()

    def reset(self) -> None:
        # [bin_id, used, holds a piece of a cut sequence, fragments], in the order the bins were
        # opened
        self.open: list[list[int]] = []
        self.next_id = 0

    def _open_bin(self) -> list[int]:
        b = [self.next_id, 0, 0, 0]
        self.next_id += 1
        self.open.append(b)
        return b

    def _room(self, b: list[int]) -> int:
        return self.capacity - b[1]

    def add(
        self, lengths: Sequence[int], no_cut: Sequence[tuple[int, int, int]] = ()
    ) -> tuple[list[Row], list[int]]:
        cap = self.capacity
        rows: list[Row] = []
        closed: list[int] = []
        for item, length in enumerate(lengths):
            start = 0
            if length > cap:  # whole fragments of a long item fill new bins of their own
                for _ in range(length // cap):
                    rows.append((item, start, cap, self.next_id, 0))
                    closed.append(self.next_id)
                    self.next_id += 1
                    start += cap
                if start == length:
                    continue
            r = length - start
            cut = False
            fits = [b for b in self.open if self._room(b) >= r]
            uncut = [b for b in self.open if not b[2]]
            fullest = min(uncut, key=lambda b: (self._room(b), b[0])) if uncut else None
            head = 0 if fullest is None else self._room(fullest)
            for it, lo, hi in no_cut:  # a cut inside a no-cut range moves back to its start
                if it == item and lo < start + head < hi:
                    head = lo - start
            if not fits and len(self.open) == self.max_open_bins and self.cut_to_fill and head > 0:
                # the bin that would leave is filled with the head of the item first
                assert fullest is not None
                rows.append((item, start, head, fullest[0], fullest[1]))
                self.open = [b for b in self.open if b is not fullest]
                closed.append(fullest[0])
                start += head
                r = length - start
                cut = True
                fits = [b for b in self.open if self._room(b) >= r and not b[2]]
            if fits and self.strategy == "best_fit":
                target = min(fits, key=lambda b: (self._room(b), b[0]))
            elif fits:
                target = min(fits, key=lambda b: b[0])
            else:
                if len(self.open) == self.max_open_bins:
                    fullest = min(self.open, key=lambda b: (self._room(b), b[0]))
                    self.open = [b for b in self.open if b is not fullest]
                    closed.append(fullest[0])
                target = self._open_bin()
            rows.append((item, start, r, target[0], target[1]))
            if cut:
                target[2] = 1
            target[1] += r
            target[3] += r > 0  # an empty item counts as no sequence
            if target[1] == cap or target[3] == self.max_segments:
                self.open = [b for b in self.open if b is not target]
                closed.append(target[0])
        return rows, closed

    def flush(self) -> list[int]:
        ids = sorted(b[0] for b in self.open)
        self.open = []
        return ids

    def open_bin_ids(self) -> list[int]:
        return sorted(b[0] for b in self.open)

    def used(self, bin_id: int) -> int:
        return next(b[1] for b in self.open if b[0] == bin_id)


class RefFlatPacker:
    """Token by token: the token at stream position g goes to bin g // capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.reset()

    def reset(self) -> None:
        self.g = 0  # stream position of the next token
        self.bin_open = False  # a zero-length item can open a bin before any token lands in it

    def add(
        self, lengths: Sequence[int], no_cut: Sequence[tuple[int, int, int]] = ()
    ) -> tuple[list[Row], list[int]]:
        cap = self.capacity
        rows: list[Row] = []
        closed: list[int] = []
        for item, length in enumerate(lengths):
            if length == 0:
                rows.append((item, 0, 0, self.g // cap, self.g % cap))
                self.bin_open = True
                continue
            for t in range(length):
                bin_id, offset = divmod(self.g, cap)
                if t > 0 and rows[-1][3] == bin_id:
                    i, s, n, b, o = rows[-1]
                    rows[-1] = (i, s, n + 1, b, o)
                else:
                    rows.append((item, t, 1, bin_id, offset))
                self.g += 1
                self.bin_open = self.g % cap != 0
                if not self.bin_open:
                    closed.append(bin_id)
        return rows, closed

    def flush(self) -> list[int]:
        if not self.bin_open:
            return []
        bin_id = self.g // self.capacity  # the partial bin; the next token starts a new one
        self.g = (bin_id + 1) * self.capacity
        self.bin_open = False
        return [bin_id]

    def open_bin_ids(self) -> list[int]:
        return [self.g // self.capacity] if self.bin_open else []

    def used(self, bin_id: int) -> int:
        return self.g % self.capacity


# --------------------------------------------------------------------------------------------------
# Invariants, checked on the outputs alone.


class Log:
    """Everything a packer reported over a stream of calls, checked as it arrives."""

    def __init__(self, capacity: int, max_open: int | None) -> None:
        self.capacity = capacity
        self.max_open = max_open
        self.fill: dict[int, int] = defaultdict(int)  # bin id -> tokens placed
        self.open: set[int] = set()
        self.left: set[int] = set()
        self.next_new_id = 0

    def after_add(
        self, packer: Packer, lengths: Sequence[int], rows: list[Row], closed: list[int]
    ) -> None:
        cap = self.capacity
        pieces: dict[int, list[Row]] = defaultdict(list)
        for row in rows:
            item, _, frag_len, bin_id, bin_offset = row
            assert 0 <= item < len(lengths)
            assert frag_len >= 0
            assert bin_id not in self.left, f"{row}: bin {bin_id} already left"
            if bin_id not in self.open:
                assert bin_id == self.next_new_id, f"{row}: bins must be numbered in opening order"
                self.next_new_id += 1
                self.open.add(bin_id)
            assert bin_offset == self.fill[bin_id], f"{row}: fragments must sit back to back"
            self.fill[bin_id] += frag_len
            assert self.fill[bin_id] <= cap, f"{row}: bin {bin_id} overflows"
            if self.fill[bin_id] == cap:
                assert bin_id in closed, f"bin {bin_id} is full but did not leave"
            pieces[item].append(row)
        assert [r[0] for r in rows] == sorted(r[0] for r in rows), "items are placed in order"
        for item, length in enumerate(lengths):
            frags = pieces[item]
            if length == 0:
                assert [(f[1], f[2]) for f in frags] == [(0, 0)]
                continue
            starts = [f[1] for f in frags]
            ends = [f[1] + f[2] for f in frags]
            assert starts[0] == 0 and ends[-1] == length and starts[1:] == ends[:-1]
            assert all(f[2] > 0 for f in frags)
        assert len(set(closed)) == len(closed)
        for bin_id in closed:
            assert bin_id in self.open, f"bin {bin_id} left without being open"
            self.open.discard(bin_id)
            self.left.add(bin_id)
        assert ids_of(packer.open_bin_ids()) == sorted(self.open)
        assert packer.n_open == len(self.open)
        if self.max_open is not None:
            assert len(self.open) <= self.max_open
        for bin_id in self.open:
            assert packer.used(bin_id) == self.fill[bin_id] < cap

    def after_flush(self, flushed: list[int]) -> None:
        assert flushed == sorted(self.open)
        for bin_id in flushed:
            assert self.fill[bin_id] < self.capacity, "a full bin must have left when it filled"
            self.left.add(bin_id)
        self.open.clear()

    def all_bins_left(self) -> None:
        assert not self.open
        assert self.left == set(range(self.next_new_id))


def run_checked(packer: Packer, calls: Sequence[Sequence[int]], max_open: int | None) -> Log:
    log = Log(packer.capacity, max_open)
    for lengths in calls:
        placements, closed = packer.add(arr(lengths))
        log.after_add(packer, lengths, rows_of(placements), ids_of(closed))
    log.after_flush(ids_of(packer.flush()))
    log.all_bins_left()
    return log


# --------------------------------------------------------------------------------------------------
# Random streams of calls.

Op = tuple[str, list[int]]


@st.composite
def streams(draw: st.DrawFn) -> tuple[int, list[Op]]:
    capacity = draw(st.integers(1, 24))
    length = st.one_of(
        st.just(0),
        st.integers(1, capacity),
        st.integers(capacity, 4 * capacity + 1),
        st.sampled_from([capacity, 2 * capacity]),
    )
    ops = draw(
        st.lists(
            st.one_of(
                st.tuples(st.just("add"), st.lists(length, max_size=30)),
                st.tuples(st.sampled_from(["flush", "reset"]), st.just([])),
            ),
            max_size=8,
        )
    )
    return capacity, [*ops, ("add", draw(st.lists(length, max_size=30))), ("flush", [])]


STRATEGIES = st.sampled_from(["best_fit", "first_fit"])


def replay(packer: Packer, ref: RefBinPacker | RefFlatPacker, ops: list[Op]) -> None:
    for step, (op, lengths) in enumerate(ops):
        if op == "add":
            placements, closed = packer.add(arr(lengths))
            assert (rows_of(placements), ids_of(closed)) == ref.add(lengths), f"step {step}"
        elif op == "flush":
            assert ids_of(packer.flush()) == ref.flush(), f"step {step}"
        else:
            packer.reset()
            ref.reset()
        assert ids_of(packer.open_bin_ids()) == ref.open_bin_ids()
        for bin_id in ref.open_bin_ids():
            assert packer.used(bin_id) == ref.used(bin_id)


@settings(max_examples=400, deadline=None)
@given(
    stream=streams(),
    max_open=st.integers(1, 6),
    strategy=STRATEGIES,
    cut=st.booleans(),
    segments=st.sampled_from([None, None, 1, 2, 3]),
)
def test_bin_packer_matches_the_reference(
    stream: tuple[int, list[Op]], max_open: int, strategy: Strategy, cut: bool, segments: int | None
) -> None:
    capacity, ops = stream
    replay(
        BinPacker(capacity, max_open, strategy, cut_to_fill=cut, max_segments=segments),
        RefBinPacker(capacity, max_open, strategy, cut, segments),
        ops,
    )


@st.composite
def no_cut_streams(draw: st.DrawFn) -> tuple[int, list[int], list[tuple[int, int, int]]]:
    """Lengths of at most capacity and, per item, sorted disjoint no-cut ranges inside it."""
    capacity = draw(st.integers(2, 24))
    lengths = draw(st.lists(st.integers(0, capacity), max_size=40))
    no_cut = []
    for item, n in enumerate(lengths):
        bounds = sorted(set(draw(st.lists(st.integers(0, n), max_size=6))))
        no_cut += [(item, lo, hi) for lo, hi in zip(bounds[::2], bounds[1::2])]
    return capacity, lengths, no_cut


@settings(max_examples=300, deadline=None)
@given(stream=no_cut_streams(), max_open=st.integers(1, 5), strategy=STRATEGIES)
def test_cut_to_fill_heads_never_end_inside_a_no_cut_range(
    stream: tuple[int, list[int], list[tuple[int, int, int]]], max_open: int, strategy: Strategy
) -> None:
    capacity, lengths, no_cut = stream
    packer = BinPacker(capacity, max_open, strategy, cut_to_fill=True)
    ref = RefBinPacker(capacity, max_open, strategy, cut_to_fill=True)
    placements, closed = packer.add(arr(lengths), np.array(no_cut, dtype=np.int64).reshape(-1, 3))
    assert (rows_of(placements), ids_of(closed)) == ref.add(lengths, no_cut)
    for item, start, size, _, _ in rows_of(placements):
        for it, lo, hi in no_cut:
            assert not (it == item and lo < start + size < hi and start + size < lengths[item])


def test_a_head_cut_moves_back_to_the_start_of_the_range_it_would_fall_in() -> None:
    packer = BinPacker(10, 1, "best_fit", cut_to_fill=True)
    packer.add(arr([6]))
    placements, closed = packer.add(arr([9]), np.array([[0, 2, 7]], dtype=np.int64))
    assert rows_of(placements) == [(0, 0, 2, 0, 6), (0, 2, 7, 1, 0)]
    assert ids_of(closed) == [0]
    packer = BinPacker(10, 1, "best_fit", cut_to_fill=True)
    packer.add(arr([6]))
    placements, _ = packer.add(arr([9]), np.array([[0, 0, 5]], dtype=np.int64))
    assert rows_of(placements) == [(0, 0, 9, 1, 0)]  # no head outside the range: not cut


def test_no_cut_rows_out_of_order_are_refused_by_row() -> None:
    packer = BinPacker(10, 1, "best_fit", cut_to_fill=True)
    with pytest.raises(ValueError, match="no_cut row 1"):
        packer.add(arr([9, 9]), np.array([[1, 0, 3], [0, 1, 2]], dtype=np.int64))


def test_a_bin_leaves_once_it_holds_max_segments_fragments() -> None:
    packer = BinPacker(100, 4, "best_fit", max_segments=2)
    assert packer.max_segments == 2
    _, closed = packer.add(arr([10, 10, 10]))
    assert ids_of(closed) == [0]  # two fragments: full by count, not by tokens
    assert packer.state() == {"next_id": 2, "bins": ((1, 90, 0, 1),)}
    again = BinPacker(100, 4, "best_fit", max_segments=2)
    again.restore(json.loads(json.dumps(packer.state())))  # as a checkpoint hands it back
    assert rows_of(again.add(arr([5]))[0]) == rows_of(packer.add(arr([5]))[0])
    with pytest.raises(ValueError, match="max_segments"):
        BinPacker(100, 4, max_segments=0)
    with pytest.raises(ValueError, match="fragment count"):
        again.restore({"next_id": 2, "bins": [[1, 90, 0, 2]]})
    with pytest.raises(ValueError, match="does not fit"):
        again.restore({"next_id": 2, "bins": [[1, 90, 0]]})  # a state of an uncapped packer


@settings(max_examples=300, deadline=None)
@given(stream=streams())
def test_flat_packer_matches_the_reference(stream: tuple[int, list[Op]]) -> None:
    capacity, ops = stream
    replay(FlatPacker(capacity), RefFlatPacker(capacity), ops)


@settings(max_examples=300, deadline=None)
@given(stream=streams(), max_open=st.integers(1, 6), strategy=STRATEGIES, cut=st.booleans())
def test_bin_packer_keeps_its_invariants(
    stream: tuple[int, list[Op]], max_open: int, strategy: Strategy, cut: bool
) -> None:
    capacity, ops = stream
    calls = [lengths for op, lengths in ops if op == "add"]
    run_checked(BinPacker(capacity, max_open, strategy, cut_to_fill=cut), calls, max_open)


def test_cut_to_fill_fills_the_leaving_bin_with_the_head_of_the_item() -> None:
    packer = BinPacker(10, 2, "best_fit", cut_to_fill=True)
    assert rows_of(packer.add(arr([7, 6]))[0]) == [(0, 0, 7, 0, 0), (1, 0, 6, 1, 0)]
    rows, closed = packer.add(arr([5]))
    # bin 0 (3 left) takes the head, leaves full; the tail goes where it fits (bin 1)
    assert rows_of(rows) == [(0, 0, 3, 0, 7), (0, 3, 2, 1, 6)]
    assert ids_of(closed) == [0]
    # bin 1 holds a piece of a cut item now: it is never cut into, the new bin 2 may be
    rows, closed = packer.add(arr([9, 8]))
    assert rows_of(rows) == [(0, 0, 9, 2, 0), (1, 0, 1, 2, 9), (1, 1, 7, 3, 0)]
    assert ids_of(closed) == [2]


def test_cut_to_fill_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="cut_to_fill"):
        BinPacker(10, 2, "best_fit", cut_to_fill=1)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(stream=streams())
def test_flat_packer_keeps_its_invariants(stream: tuple[int, list[Op]]) -> None:
    capacity, ops = stream
    calls = [lengths for op, lengths in ops if op == "add"]
    log = run_checked(FlatPacker(capacity), calls, 1)
    # Concatenation: every bin but the last is exactly full.
    bins = sorted(log.fill)
    assert all(log.fill[b] == capacity for b in bins[:-1])


# --------------------------------------------------------------------------------------------------
# The rules, one at a time.


def test_bin_ids_count_up_across_add_calls_and_restart_after_reset() -> None:
    packer = BinPacker(10, 1)
    first, _ = packer.add(arr([6]))
    second, closed = packer.add(arr([6]))
    assert rows_of(first) == [(0, 0, 6, 0, 0)]
    assert rows_of(second) == [(0, 0, 6, 1, 0)]
    assert ids_of(closed) == [0]
    packer.reset()
    assert packer.n_open == 0
    again, _ = packer.add(arr([3]))
    assert rows_of(again) == [(0, 0, 3, 0, 0)]


def test_best_fit_takes_the_tightest_bin_and_the_lowest_id_on_ties() -> None:
    packer = BinPacker(10, 4, "best_fit")
    packer.add(arr([6, 7, 6, 3]))  # rooms: bin0 4, bin1 3 (then 0: full), bin2 4, ...
    assert ids_of(packer.open_bin_ids()) == [0, 2]
    placements, closed = packer.add(arr([4]))
    assert rows_of(placements) == [(0, 0, 4, 0, 6)]
    assert ids_of(closed) == [0]


def test_best_fit_prefers_a_tight_later_bin_over_a_roomy_earlier_one() -> None:
    packer = BinPacker(10, 4, "best_fit")
    packer.add(arr([2, 9]))  # bin0 room 8, bin1 room 1
    placements, closed = packer.add(arr([1]))
    assert rows_of(placements) == [(0, 0, 1, 1, 9)]
    assert ids_of(closed) == [1]


def test_first_fit_takes_the_lowest_id_that_fits() -> None:
    packer = BinPacker(10, 4, "first_fit")
    packer.add(arr([2, 9]))  # bin0 room 8, bin1 room 1
    placements, closed = packer.add(arr([1]))
    assert rows_of(placements) == [(0, 0, 1, 0, 2)]
    assert ids_of(closed) == []


@pytest.mark.parametrize("strategy", ["best_fit", "first_fit"])
def test_at_the_limit_the_fullest_bin_leaves_to_make_room(strategy: Strategy) -> None:
    packer = BinPacker(10, 3, strategy)
    packer.add(arr([5, 8, 8]))  # used 5, 8, 8: bins 1 and 2 are the fullest, 1 has the lower id
    placements, closed = packer.add(arr([6]))
    assert ids_of(closed) == [1]
    assert rows_of(placements) == [(0, 0, 6, 3, 0)]
    assert ids_of(packer.open_bin_ids()) == [0, 2, 3]


def test_a_bin_that_becomes_exactly_full_leaves_at_once() -> None:
    packer = BinPacker(10, 2)
    placements, closed = packer.add(arr([4, 6]))
    assert rows_of(placements) == [(0, 0, 4, 0, 0), (1, 0, 6, 0, 4)]
    assert ids_of(closed) == [0]
    assert packer.n_open == 0


def test_a_long_item_fills_whole_bins_then_its_remainder_is_placed_like_any_item() -> None:
    packer = BinPacker(10, 2)
    packer.add(arr([7]))  # bin0 room 3
    placements, closed = packer.add(arr([23]))
    assert rows_of(placements) == [(0, 0, 10, 1, 0), (0, 10, 10, 2, 0), (0, 20, 3, 0, 7)]
    assert ids_of(closed) == [1, 2, 0]


def test_a_long_item_with_no_remainder_places_nothing_more() -> None:
    packer = BinPacker(10, 1)
    packer.add(arr([7]))  # at the limit, yet bin0 stays: whole fragments never push a bin out
    placements, closed = packer.add(arr([20]))
    assert rows_of(placements) == [(0, 0, 10, 1, 0), (0, 10, 10, 2, 0)]
    assert ids_of(closed) == [1, 2]
    assert ids_of(packer.open_bin_ids()) == [0]


def test_an_item_of_exactly_capacity_is_placed_by_the_normal_rule() -> None:
    packer = BinPacker(10, 1)
    packer.add(arr([3]))  # bin0 open at the limit: a capacity-sized item pushes it out
    placements, closed = packer.add(arr([10]))
    assert rows_of(placements) == [(0, 0, 10, 1, 0)]
    assert ids_of(closed) == [0, 1]


def test_a_zero_length_item_gets_a_placement() -> None:
    packer = BinPacker(10, 2)
    placements, closed = packer.add(arr([0, 4, 0]))
    assert rows_of(placements) == [(0, 0, 0, 0, 0), (1, 0, 4, 0, 0), (2, 0, 0, 0, 4)]
    assert ids_of(closed) == []
    assert packer.used(0) == 4


def test_flush_closes_every_open_bin_in_ascending_id_order() -> None:
    packer = BinPacker(10, 8, "best_fit")
    packer.add(arr([9, 2, 5, 4]))  # rooms 1, 3, 6: kept in room order inside the packer
    assert ids_of(packer.flush()) == [0, 1, 2]
    assert packer.n_open == 0
    assert ids_of(packer.flush()) == []
    placements, _ = packer.add(arr([1]))
    assert rows_of(placements) == [(0, 0, 1, 3, 0)]


def test_used_of_a_bin_that_is_not_open_is_a_key_error() -> None:
    packer = BinPacker(10, 2)
    packer.add(arr([10, 3]))
    assert packer.used(1) == 3
    with pytest.raises(KeyError, match="bin 0 is not open"):
        packer.used(0)
    flat = FlatPacker(4)
    flat.add(arr([5]))
    assert flat.used(1) == 1
    with pytest.raises(KeyError, match="bin 0 is not open"):
        flat.used(0)


def test_packer_properties_report_the_configuration() -> None:
    packer = BinPacker(4096, 64, "first_fit")
    assert (packer.capacity, packer.max_open_bins, packer.strategy) == (4096, 64, "first_fit")
    assert BinPacker(8, 2).strategy == "best_fit"
    assert FlatPacker(16).capacity == 16
    assert "capacity=4096" in repr(packer)


def test_flat_packer_cuts_the_stream_every_capacity_tokens() -> None:
    packer = FlatPacker(4)
    placements, closed = packer.add(arr([3, 6, 0, 1]))
    assert rows_of(placements) == [
        (0, 0, 3, 0, 0),
        (1, 0, 1, 0, 3),
        (1, 1, 4, 1, 0),
        (1, 5, 1, 2, 0),
        (2, 0, 0, 2, 1),
        (3, 0, 1, 2, 1),
    ]
    assert ids_of(closed) == [0, 1]
    assert ids_of(packer.flush()) == [2]
    assert ids_of(packer.flush()) == []
    placements, closed = packer.add(arr([4]))
    assert rows_of(placements) == [(0, 0, 4, 3, 0)]
    assert ids_of(closed) == [3]
    assert packer.n_open == 0


def test_flat_packer_opens_a_bin_for_a_zero_length_item() -> None:
    packer = FlatPacker(4)
    placements, closed = packer.add(arr([0]))
    assert rows_of(placements) == [(0, 0, 0, 0, 0)]
    assert ids_of(closed) == []
    assert packer.n_open == 1
    assert ids_of(packer.flush()) == [0]
    packer.add(arr([0, 4]))
    assert ids_of(packer.open_bin_ids()) == []
    packer.reset()
    placements, _ = packer.add(arr([2]))
    assert rows_of(placements) == [(0, 0, 2, 0, 0)]


@pytest.mark.parametrize("make", [lambda: BinPacker(8, 2), lambda: FlatPacker(8)])
def test_an_empty_add_places_nothing(make: object) -> None:
    assert callable(make)
    packer = make()
    placements, closed = packer.add(arr([]))
    assert placements.shape == (0, 5) and placements.dtype == np.int64
    assert closed.shape == (0,) and closed.dtype == np.int64


@pytest.mark.parametrize("make", [lambda: BinPacker(8, 2), lambda: FlatPacker(8)])
def test_any_int64_buffer_is_accepted_strided_and_read_only(make: object) -> None:
    assert callable(make)
    lengths = np.arange(12, dtype=np.int64)
    lengths.setflags(write=False)
    a, b = make(), make()
    got, got_closed = a.add(lengths[::3])
    want, want_closed = b.add(np.ascontiguousarray(lengths[::3]))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_closed, want_closed)


# --------------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize("make", [lambda: BinPacker(8, 2), lambda: FlatPacker(8)])
def test_a_negative_length_is_rejected_by_index_and_changes_nothing(make: object) -> None:
    assert callable(make)
    packer = make()
    packer.add(arr([3]))
    with pytest.raises(ValueError, match=r"lengths\[2\] is -1"):
        packer.add(arr([5, 0, -1, 4]))
    assert ids_of(packer.open_bin_ids()) == [0]
    assert packer.used(0) == 3
    placements, _ = packer.add(arr([1]))
    assert rows_of(placements) == [(0, 0, 1, 0, 3)]


@pytest.mark.parametrize("make", [lambda: BinPacker(8, 2), lambda: FlatPacker(8)])
@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (np.zeros((2, 2), dtype=np.int64), ValueError),
        (np.zeros(3, dtype=np.int32), ValueError),
        (np.zeros(3, dtype=np.float64), ValueError),
        (np.zeros(3, dtype=np.uint64), ValueError),
        ([1, 2, 3], TypeError),
        (None, TypeError),
    ],
)
def test_lengths_must_be_a_one_dimensional_int64_buffer(
    make: object, bad: object, error: type[Exception]
) -> None:
    assert callable(make)
    packer = make()
    with pytest.raises(error):
        packer.add(bad)
    assert packer.n_open == 0


@pytest.mark.parametrize(
    ("args", "error", "names"),
    [
        ((0, 4), ValueError, "capacity"),
        ((-5, 4), ValueError, "capacity"),
        ((8, 0), ValueError, "max_open_bins"),
        ((8, -1), ValueError, "max_open_bins"),
        ((8, 4, "worst_fit"), ValueError, "strategy"),
        ((8.0, 4), TypeError, "capacity"),
        ((8, True), TypeError, "max_open_bins"),
        (("8", 4), TypeError, "capacity"),
        ((2**63, 4), ValueError, "capacity"),
    ],
)
def test_bin_packer_rejects_bad_arguments_by_name(
    args: tuple[object, ...], error: type[Exception], names: str
) -> None:
    with pytest.raises(error, match=names):
        BinPacker(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize("capacity", [0, -1, 1.5, None])
def test_flat_packer_rejects_a_bad_capacity_by_name(capacity: object) -> None:
    with pytest.raises((ValueError, TypeError), match="capacity"):
        FlatPacker(capacity)  # type: ignore[arg-type]


def test_a_huge_length_makes_few_fragments_with_a_large_capacity() -> None:
    packer = BinPacker(2**62, 2)
    placements, closed = packer.add(arr([2**63 - 1]))
    assert rows_of(placements) == [(0, 0, 2**62, 0, 0), (0, 2**62, 2**62 - 1, 1, 0)]
    assert ids_of(closed) == [0]
    flat = FlatPacker(2**62)
    placements, closed = flat.add(arr([2**63 - 1, 2**63 - 1]))
    assert [r[2] for r in rows_of(placements)] == [2**62, 2**62 - 1, 1, 2**62, 2**62 - 2]
    assert ids_of(closed) == [0, 1, 2]


# --------------------------------------------------------------------------------------------------
# Fill.


def fill_of(strategy: Strategy) -> float:
    lengths = np.random.default_rng(0).integers(1, 512, size=20_000, dtype=np.int64)
    packer = BinPacker(1024, 64, strategy)
    n_bins = 0
    for start in range(0, len(lengths), 4096):
        _, closed = packer.add(lengths[start : start + 4096])
        n_bins += len(closed) + len(packer.flush())
    return float(lengths.sum()) / (n_bins * 1024)


def test_best_fit_fills_uniform_sequences_at_least_98_5_percent() -> None:
    assert fill_of("best_fit") >= 0.985


def test_first_fit_fills_uniform_sequences_at_least_97_5_percent() -> None:
    assert fill_of("first_fit") >= 0.975


def test_best_fit_waste_on_lognormal_lengths_is_within_half_a_percent_of_the_bound() -> None:
    rng = np.random.default_rng(1)
    lengths = np.maximum(rng.lognormal(math.log(600) - 0.5, 1.0, 200_000), 1).astype(np.int64)
    packer = BinPacker(4096, 64)
    _, closed = packer.add(lengths)
    n_bins = len(closed) + len(packer.flush())
    lower_bound = -(-int(lengths.sum()) // 4096)
    assert n_bins <= lower_bound * 1.005


# --------------------------------------------------------------------------------------------------
# Concurrent use: one packer shared by several threads is serialized, never corrupted.

PACKER_HAMMER = """
from zephon._core.binfill import BinPacker, FlatPacker

CAP = 13
CALLS = 80
packer = {make}
records = []  # (lengths or None, placements or None, closed ids), from every thread
refused = []  # calls that raised instead of waiting their turn


def work(t):
    rng = np.random.default_rng(t)
    for i in range(CALLS):
        try:
            if i % 20 == 19:
                records.append((None, None, packer.flush()))
                continue
            lengths = rng.integers(1, 40, size=int(rng.integers(1, 10_000))).astype(np.int64)
            rows, closed = packer.add(lengths)
            records.append((lengths, rows, closed))
            packer.open_bin_ids()
        except RuntimeError as exc:
            refused.append(str(exc))


errors = hammer(4, work)
records.append((None, None, packer.flush()))
problems = []
for lengths, rows, _ in records:
    if lengths is None:
        continue
    items = rows[:, 0]
    if len(rows) and (items.min() < 0 or items.max() >= len(lengths)):
        problems.append("a placement names an item that is not in its call")
    elif not np.array_equal(np.bincount(items, rows[:, 2], minlength=len(lengths)), lengths):
        problems.append("a call's placements do not cover its lengths")
# Over all calls, in whatever order they ran: each bin's fragments sit back to back from 0.
rows = np.concatenate([r for _, r, _ in records if r is not None])
rows = rows[np.lexsort((rows[:, 4], rows[:, 3]))]
bins, offsets, sizes = rows[:, 3], rows[:, 4], rows[:, 2]
first = np.r_[True, bins[1:] != bins[:-1]]
expected_offsets = np.where(first, 0, np.r_[0, offsets[:-1] + sizes[:-1]])
if not np.array_equal(offsets, expected_offsets):
    problems.append("a bin has a gap or an overlap between its fragments")
if ((offsets + sizes) > CAP).any():
    problems.append("a bin holds more than its capacity")
closed_ids = np.concatenate([c for _, _, c in records])
if not np.array_equal(np.sort(closed_ids), np.arange(len(closed_ids))) or len(closed_ids) != len(
    np.unique(bins)
):
    problems.append("bin ids do not leave exactly once each, numbered from 0")
summary = {{"errors": errors[:3], "refused": refused[:3], "problems": problems[:5]}}
print(json.dumps({{**summary, "calls": len(records)}}))
"""


@pytest.mark.parametrize(
    "make", ["FlatPacker(CAP)", "BinPacker(CAP, 64)", "BinPacker(CAP, 8, 'first_fit')"]
)
def test_concurrent_calls_on_one_packer_are_serialized_into_one_valid_packing(
    make: str,
) -> None:
    from threads_kit import run_threads

    summary = run_threads(PACKER_HAMMER.format(make=make))
    assert summary == {"errors": [], "refused": [], "problems": [], "calls": 4 * 80 + 1}
