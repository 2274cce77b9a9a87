"""What real jobs set on a packer: rows of one group only (``group_by``), a cap on sequences per
row (``max_segments``), and the concatenate-and-cut strategy that never waits for a fit
(``strategy="wrap"``); each loses no token and resumes exactly."""

from __future__ import annotations

import copy
import tracemalloc
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_packing import STRIDE, assert_every_input_recovered_once, run, token_records

import zephon
from zephon._core.packfill import held_arena_bytes
from zephon.errors import OperatorError
from zephon.ops import batch, fetch, pack_sequences, tokenize
from zephon.ops.packing import GroupedPacker, PackSequences
from zephon.sources import ListSource
from zephon.testing import check_operator, check_resume


def lang_of(i: int) -> str:
    return "de" if i % 3 == 0 else "en"


def grouped_records(lengths: list[int]) -> list:
    records = token_records(lengths)
    for i, rec in enumerate(records):
        rec.payload["lang"] = lang_of(i)
    return records


def rows_groups(out: list) -> list[set[str]]:
    """The groups of the inputs whose tokens each row holds."""
    groups = []
    for rec in out:
        p = rec.payload
        real = p["tokens"][p["segment_ids"] != 0]
        groups.append({lang_of(int(t) // STRIDE) for t in real})
    return groups


@settings(max_examples=60)
@given(
    lengths=st.lists(st.integers(0, 50), max_size=40),
    seq_len=st.integers(1, 24),
    micro=st.integers(1, 9),
    flush_every=st.sampled_from([None, 5, 13]),
    strategy=st.sampled_from(["best_fit", "first_fit", "wrap"]),
)
def test_grouped_rows_hold_one_group_and_lose_no_token(
    lengths, seq_len, micro, flush_every, strategy
):
    op = pack_sequences(seq_len, open_bins=3, strategy=strategy, pad_id=0, group_by="lang")
    out = run(op, grouped_records(lengths), micro=micro, flush_every=flush_every)
    assert all(len(g) <= 1 for g in rows_groups(out))
    assert_every_input_recovered_once(lengths, out)


NUMPY_DOMAIN = 389047  # numpy reports its array allocations to tracemalloc under this domain
ARENA_BYTES = 2 << 20  # zephon._core.packfill's ARENA_BYTES


def test_a_grouped_packer_holds_arenas_that_do_not_grow_with_its_groups():
    # Per-user or per-source groups: thousands of them, each emitting rows. The memory its rows
    # are written into must stay about one packer's, not an arena (about 1.5 MiB) per group.
    n_groups = 3000
    records = token_records([40] * (4 * n_groups))  # at seq_len 64 every input has a row
    for i, rec in enumerate(records):
        rec.payload["lang"] = i % n_groups
    op = copy.deepcopy(pack_sequences(64, open_bins=2, pad_id=0, group_by="lang"))
    assert isinstance(op, GroupedPacker)
    op.start_epoch(0, 0)
    emitted = 0
    tracemalloc.start()
    try:
        for m in range(0, len(records), 256):  # the rows are let go, as a trainer does
            emitted += len(op.process_many(records[m : m + 256]))
        snapshot = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    allocated = sum(
        s.size
        for s in snapshot.filter_traces([tracemalloc.DomainFilter(True, NUMPY_DOMAIN)]).statistics(
            "filename"
        )
    )
    assert emitted == 2 * n_groups and len(op._groups) == n_groups
    assert allocated <= 4 * ARENA_BYTES, f"{allocated / 2**20:.0f} MiB of arrays for {n_groups}"
    held = held_arena_bytes(p._bins() for p in [op.packer, *op._groups.values()])
    assert 0 < held <= 2 * ARENA_BYTES


def test_a_grouped_packer_keeps_nothing_of_the_groups_of_an_ended_epoch():
    # Per-user groups, new ones every epoch: once an epoch has ended its groups hold nothing,
    # and what the packer keeps must not grow with every group it ever saw.
    per_epoch = 1000
    op = copy.deepcopy(pack_sequences(64, open_bins=2, pad_id=0, group_by="lang"))
    assert isinstance(op, GroupedPacker)

    def epoch(e: int) -> int:
        records = token_records([40] * per_epoch)
        for i, rec in enumerate(records):
            rec.payload["lang"] = f"user {e}-{i}"
        op.start_epoch(0, e)
        rows = sum(len(op.process_many(records[m : m + 256])) for m in range(0, per_epoch, 256))
        return rows + len(op.flush())

    rows = epoch(0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        rows += sum(epoch(e) for e in range(1, 4))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 1 << 20, f"{grown / 2**20:.1f} MiB kept for {3 * per_epoch} ended groups"
    assert rows == 4 * per_epoch
    assert op.counters() == {"rows": rows, "real_tokens": 40 * rows, "row_tokens": 64 * rows}


def reference_grouped(template, records, micro: int, flush_every: int | None) -> list:
    """What ``group_by`` is defined as: per micro-batch, each group's inputs (groups in order of
    first appearance) to a plain packer of that group's own; an epoch's end flushes the groups in
    sorted order."""
    out: list = []
    packers: dict = {}
    epoch = flush_every or max(len(records), 1)
    for e, lo in enumerate(range(0, len(records), epoch)):
        part = records[lo : lo + epoch]
        for packer in packers.values():
            packer.start_epoch(0, e)
        for m in range(0, len(part), micro):
            by_group: dict = {}
            for rec in part[m : m + micro]:
                by_group.setdefault(rec.payload["lang"], []).append(rec)
            for group, members in by_group.items():
                if group not in packers:
                    packers[group] = copy.deepcopy(template)
                    packers[group].start_epoch(0, e)
                out += packers[group].process_many(members)
        for group in sorted(packers, key=lambda g: (isinstance(g, str), g)):
            out += packers[group].flush()
    return out


def row_values(rec) -> tuple:
    p = rec.payload
    arrays = tuple(p[k].tolist() for k in ("tokens", "segment_ids", "positions", "mask", "w"))
    return rec.meta.cursor, arrays, [r.cursor for r in rec.contribution_refs()]


@settings(max_examples=60)
@given(
    lengths=st.lists(st.integers(0, 30), max_size=60),
    n_groups=st.integers(1, 12),
    seq_len=st.integers(1, 24),
    micro=st.integers(1, 9),
    flush_every=st.sampled_from([None, 7, 19]),
    strategy=st.sampled_from(["best_fit", "first_fit", "wrap"]),
)
def test_grouped_rows_equal_those_of_a_packer_per_group(
    lengths, n_groups, seq_len, micro, flush_every, strategy
):
    # The groups' fills share their arenas: every row, kept alive to the end, must still hold
    # what a packer of its group's own (arenas of its own) gives, in the same order.
    records = token_records(lengths)
    for i, rec in enumerate(records):
        rec.payload["lang"] = (i * 7) % n_groups if i % 2 else f"g{(i * 5) % n_groups}"
        rec.payload["mask"] = (rec.payload["tokens"] % 2).astype(np.int32)
        rec.payload["w"] = (rec.payload["tokens"] % 5 / 4).astype(np.float32)
    sides = {"mask": -1, "w": 0.5}
    grouped = pack_sequences(
        seq_len, open_bins=3, strategy=strategy, pad_id=0, extra_fields=sides, group_by="lang"
    )
    plain = pack_sequences(seq_len, open_bins=3, strategy=strategy, pad_id=0, extra_fields=sides)
    out = run(grouped, records, micro=micro, flush_every=flush_every)
    expected = reference_grouped(plain, records, micro, flush_every)
    assert [row_values(r) for r in out] == [row_values(r) for r in expected]


def test_two_groups_fill_at_least_98_percent_at_2048():
    lengths = np.random.default_rng(1).integers(1, 1024, size=12_000).tolist()
    op = pack_sequences(2048, open_bins=64, pad_id=0, group_by=lambda p: p["lang"])
    out = run(op, grouped_records(lengths), micro=256, flush_every=4096)
    assert all(len(g) == 1 for g in rows_groups(out))
    assert sum(lengths) / (len(out) * 2048) >= 0.98


@settings(max_examples=60)
@given(
    lengths=st.lists(st.integers(0, 50), max_size=40),
    seq_len=st.integers(1, 40),
    cap=st.integers(1, 4),
    strategy=st.sampled_from(["best_fit", "first_fit"]),
    cut=st.booleans(),
)
def test_no_row_holds_more_than_max_segments(lengths, seq_len, cap, strategy, cut):
    op = pack_sequences(
        seq_len, open_bins=3, strategy=strategy, pad_id=0, max_segments=cap, cut_to_fill=cut
    )
    out = run(op, token_records(lengths), micro=5, flush_every=17)
    assert all(int(rec.payload["segment_ids"].max(initial=0)) <= cap for rec in out)
    assert_every_input_recovered_once(lengths, out)


@pytest.mark.parametrize("strategy", ["best_fit", "first_fit"])
@pytest.mark.parametrize("cut", [False, True])
@pytest.mark.parametrize("flush_every", [None, 6])  # epochs that end with a document
def test_empty_documents_never_make_a_row_of_padding_under_max_segments(strategy, cut, flush_every):
    # Megatron writes an empty document for an empty text. One that counted as a sequence took
    # a row of its own under max_segments=1: a row of padding alone, trained on for nothing.
    lengths = [5, 0, 7, 0, 0, 3, 9, 0, 4, 6, 0, 2, 8, 0, 0, 0, 5, 3]
    op = pack_sequences(
        10, open_bins=3, strategy=strategy, pad_id=0, max_segments=1, cut_to_fill=cut
    )
    out = run(op, token_records(lengths), micro=4, flush_every=flush_every)
    assert [int(rec.payload["segment_ids"].max()) for rec in out] == [1] * len(out)
    assert len(out) == sum(n > 0 for n in lengths)
    assert_every_input_recovered_once(lengths, out)


@pytest.mark.parametrize("strategy", ["best_fit", "first_fit"])
def test_a_cut_to_fill_flush_keeps_the_cap_on_sequences(strategy):
    # Four open bins of one 6-token sequence each: laying them out again at the epoch's end
    # must not put a whole one, the tail of a cut one and another head in one row.
    lengths = [6, 6, 6, 6]
    op = pack_sequences(
        10, open_bins=4, strategy=strategy, pad_id=0, max_segments=2, cut_to_fill=True
    )
    out = run(op, token_records(lengths))
    assert [int(rec.payload["segment_ids"].max()) for rec in out] == [2, 2, 1]
    assert_every_input_recovered_once(lengths, out)


@settings(max_examples=60)
@given(
    lengths=st.lists(st.integers(4, 9), max_size=30),
    cap=st.integers(2, 3),
    open_bins=st.integers(3, 6),
)
def test_no_row_of_a_cut_to_fill_flush_holds_more_than_max_segments(lengths, cap, open_bins):
    # Rows of 10: sequences over half a row keep to bins of their own, and the flush lays
    # those bins out again.
    op = pack_sequences(10, open_bins=open_bins, pad_id=0, max_segments=cap, cut_to_fill=True)
    out = run(op, token_records(lengths), micro=4, flush_every=9)
    assert all(int(rec.payload["segment_ids"].max(initial=0)) <= cap for rec in out)
    assert_every_input_recovered_once(lengths, out)


@settings(max_examples=60)
@given(lengths=st.lists(st.integers(0, 50), max_size=40), seq_len=st.integers(1, 24))
def test_wrap_fills_every_row_but_the_last(lengths, seq_len):
    op = pack_sequences(seq_len, strategy="wrap", pad_id=0)
    assert op.traits.preserves_cursor_order
    out = run(op, token_records(lengths), micro=4)
    fills = [int((rec.payload["segment_ids"] != 0).sum()) for rec in out]
    assert all(f == seq_len for f in fills[:-1])
    assert sum(fills) == sum(lengths)
    assert_every_input_recovered_once(lengths, out)


def test_the_controls_pass_check_operator():
    for op in (
        pack_sequences(12, open_bins=2, pad_id=0, group_by="lang"),
        pack_sequences(12, open_bins=2, pad_id=0, max_segments=2),
        pack_sequences(12, strategy="wrap", pad_id=0),
    ):
        check_operator(op, grouped_records([0, 9, 17, 2, 8, 0, 30, 5]))


def texts(n: int) -> ListSource:
    items = [
        {"text": "ab " * (1 + (i * 7) % 23) + str(i), "lang": "de" if i % 3 else "en"}
        for i in range(n)
    ]
    return ListSource(items, chunk_size=16)


@pytest.mark.parametrize(
    "packer",
    [
        pack_sequences(64, open_bins=3, group_by="lang"),
        pack_sequences(64, open_bins=3, max_segments=3),
        pack_sequences(64, strategy="wrap"),
    ],
    ids=["group_by", "max_segments", "wrap"],
)
def test_pipelines_with_the_controls_resume_exactly(packer):
    pipeline = zephon.Pipeline(
        texts(400), [fetch(), tokenize(), packer, batch(2)], lanes=2, epoch_chunks=3
    )
    check_resume(pipeline)


def test_a_bad_group_names_the_record():
    op = pack_sequences(12, pad_id=0, group_by="lang")
    records = token_records([3, 4])
    records[1].payload["lang"] = 1.5
    records[0].payload["lang"] = "en"
    with pytest.raises(
        OperatorError, match=r"SampleCursor\(0, 1.*group_by must give a str or an int"
    ):
        run(op, records)
    with pytest.raises(OperatorError, match="KeyError"):
        run(op, token_records([3]))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="neither cut_to_fill nor max_segments"):
        pack_sequences(8, strategy="wrap", max_segments=2)
    with pytest.raises(ValueError, match="max_segments"):
        pack_sequences(8, max_segments=0)
    with pytest.raises(TypeError, match="group_by"):
        pack_sequences(8, group_by=3)  # type: ignore[arg-type]


def test_a_packer_without_the_controls_keeps_its_identity():
    plain: Any = pack_sequences(8, pad_id=0)
    assert isinstance(plain, PackSequences)
    assert "max_segments" not in plain.describe()["params"]
    grouped: Any = pack_sequences(8, pad_id=0, group_by="lang")
    assert isinstance(grouped, GroupedPacker)
    assert grouped.describe()["params"]["group_by"] == "lang"
