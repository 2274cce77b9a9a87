"""The compiled delivery bookkeeping (zephon/_core/delivery.pyx): counters, the replay window,
the batch gatherer, and the violations it returns as values instead of calling back."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from chunk_table_kit import is_complete, open_offsets
from hypothesis import given
from hypothesis import strategies as st

from zephon._core.chunk_table import CLOSED, ChunkTable
from zephon._core.delivery import (
    CollateFailed,
    DeliveryBook,
    DeliveryCounters,
    gather,
    hand_over_run,
)
from zephon._core.records import expand_runs, records_for_chunk
from zephon.ops.children import spawn_child, tombstones_for_record
from zephon.runtime.lanes.control import LANE_END, ChunkOpened, LaneEnd, RunStart
from zephon.types import RecordRun, SampleCursor, SampleMeta, SampleRecord


def roots(chunk_id: int, n: int, components: list[Any] | None = None) -> list[SampleRecord]:
    pointers = np.array([[0, 0, chunk_id * 100 + i] for i in range(n)], dtype=np.int64)
    comps = components if components is not None else [0] * n
    return records_for_chunk(chunk_id, pointers, [{"i": i} for i in range(n)], 0, comps)


def make_book(table: ChunkTable, monotone: bool = True) -> DeliveryBook:
    return DeliveryBook(table, monotone, DeliveryCounters())


def early_closes(book: DeliveryBook) -> list[tuple[SampleCursor, int]]:
    return [(v[2], v[3]) for v in book.violations if v[0] == "early-close"]


def order_reports(book: DeliveryBook) -> list[tuple[SampleCursor, SampleCursor]]:
    return [(v[1], v[2]) for v in book.violations if v[0] == "order"]


def naive_mixture(metas: list[SampleMeta]) -> tuple[dict, dict]:
    samples: dict = {}
    tokens: dict = {}
    for meta in metas:
        for comp, n in (meta.component_token_counts or {}).items():
            tokens[comp] = tokens.get(comp, 0) + n
        if meta.component_sample_counts:
            for comp, n in meta.component_sample_counts.items():
                samples[comp] = samples.get(comp, 0) + n
        else:
            samples[meta.component] = samples.get(meta.component, 0) + 1
    return samples, tokens


metas = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", 3]),
        st.none() | st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(1, 5)),
        st.none() | st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(1, 50)),
    ),
    max_size=40,
)


@given(metas)
def test_mixture_counters_equal_counting_record_by_record_in_insertion_order(specs):
    cursor = SampleCursor(0, 0, (0, 0, 0))
    metas_ = [
        SampleMeta(cursor, component=c, component_sample_counts=s, component_token_counts=t)
        for c, s, t in specs
    ]
    counters = DeliveryCounters()
    for meta in metas_:
        counters.count_delivered(meta)
    counters.flush()
    samples, tokens = naive_mixture(metas_)
    assert list(counters.mix_samples.items()) == list(samples.items())
    assert list(counters.mix_tokens.items()) == list(tokens.items())
    assert counters.delivered == len(metas_)


def test_tombstones_with_a_counted_tag_are_counted_per_tag():
    counters = DeliveryCounters()
    counters.counted_tags = frozenset({"mixture_dropped"})
    cursor = SampleCursor(0, 0, (0, 0, 0))
    counters.count_tombstone(SampleMeta(cursor, is_tombstone=True))
    counters.count_tombstone(SampleMeta(cursor, is_tombstone=True, tags={"mixture_dropped"}))
    counters.count_tombstone(SampleMeta(cursor, is_tombstone=True, tags={"other"}))
    assert counters.tombstones == 3
    assert counters.tag_counts == {"mixture_dropped": 1}


def test_a_delivered_batch_closes_its_offsets_and_fills_the_window_per_chunk():
    table = ChunkTable()
    book = make_book(table)
    table.open_chunk(0, 0, 4, 0)
    records = roots(0, 4)
    assert book.deliver(records[:3]) == 3
    assert open_offsets(table, 0) == [3]
    count, digest = book.window_totals()
    assert count == 3
    assert digest == sum(r.meta.cursor.stable_hash for r in records[:3]) % (1 << 64)
    assert book.last_cursor == records[2].meta.cursor
    assert book.counters.delivered == 3


def test_the_window_forgets_a_chunk_when_the_watermark_evicts_it():
    table = ChunkTable()
    book = make_book(table)
    table.open_chunk(0, 0, 2, 0)
    table.open_chunk(1, 1, 2, 0)
    book.deliver([*roots(0, 2), *roots(1, 1)])
    assert (table.n_inflight, table.first_local_index) == (1, 1)
    assert book.window_len == 1
    assert book.window_totals()[0] == 1
    assert book.counters.evicted == 1


def test_delivery_stops_before_a_control_item_and_goes_on_from_there():
    table = ChunkTable()
    book = make_book(table)
    table.open_chunk(0, 0, 2, 0)
    opened = ChunkOpened(1, 1, 2, 0)
    items = [*roots(0, 2), opened, *roots(1, 2)]
    assert book.deliver(items) == 2
    assert (table.n_inflight, book.counters.delivered) == (1, 2)
    table.open_chunk(opened.chunk_id, opened.local_index, opened.n_offsets, opened.epoch)
    assert book.deliver(items, 3) == len(items)
    assert book.counters.delivered == 4


def test_a_tombstone_closes_without_moving_the_replay_cursor():
    table = ChunkTable()
    book = make_book(table, monotone=False)
    table.open_chunk(0, 0, 3, 0)
    first, dropped, last = roots(0, 3)
    book.deliver([first, *tombstones_for_record(dropped), last])
    assert is_complete(table, 0)
    assert book.last_cursor == last.meta.cursor
    assert (book.counters.delivered, book.counters.tombstones) == (2, 1)


def test_closing_an_offset_twice_is_returned_as_a_violation():
    table = ChunkTable()
    book = make_book(table, monotone=False)
    table.open_chunk(0, 0, 2, 0)
    rec = roots(0, 1)[0]
    book.record(rec)
    book.record(rec)
    assert early_closes(book) == [(rec.meta.cursor, CLOSED)]


def test_a_record_behind_the_previous_one_is_reported_on_the_monotone_path():
    table = ChunkTable()
    book = make_book(table)
    table.open_chunk(0, 0, 3, 0)
    a, b, c = roots(0, 3)
    book.deliver([a, c, b])
    assert order_reports(book) == [(b.meta.cursor, c.meta.cursor)]


def test_gather_fills_a_batch_and_keeps_trailing_control_items_with_it():
    records = roots(0, 5)
    tomb = tombstones_for_record(records[4])[0]
    buf: list[Any] = [records[0], tomb, records[1], records[2], records[3]]
    pending: list[Any] = []
    assert gather(buf, 0, pending, 0, 3, (LaneEnd,)) == (4, 3)
    assert pending == buf[:4]


def test_gather_leaves_a_leading_control_item_and_the_lane_end_to_the_caller():
    records = roots(0, 2)
    opened = ChunkOpened(0, 0, 2, 0)
    pending: list[Any] = []
    assert gather([opened, *records], 0, pending, 0, 4, (LaneEnd,)) == (0, 0)
    assert gather([*records, LANE_END], 0, pending, 0, 4, (LaneEnd,)) == (2, 2)
    assert pending == records


def test_gather_leaves_every_type_it_is_told_to_even_behind_pending_records():
    records = roots(0, 2)
    run = RunStart(1)
    pending: list[Any] = []
    assert gather([records[0], run, records[1]], 0, pending, 0, 4, (LaneEnd, RunStart)) == (1, 1)
    opened = ChunkOpened(0, 0, 2, 0)
    assert gather([opened, records[1]], 0, pending, 1, 4, (LaneEnd, RunStart)) == (2, 2)
    assert pending == [records[0], opened, records[1]]


# --- runs of records (RecordRun): the same bookkeeping as their records one by one -----------


@st.composite
def deliveries(draw: st.DrawFn) -> tuple[list[int], list[tuple[int, int, int]], list]:
    """Chunk sizes, the runs delivered (chunk, first offset, length: in order, with gaps), and
    offsets closed before delivery (to provoke early-close violations)."""
    sizes = draw(st.lists(st.integers(1, 9), min_size=1, max_size=4))
    spans = []
    for chunk_id, n in enumerate(sizes):
        offset = draw(st.integers(0, n - 1))
        while offset < n:
            length = draw(st.integers(1, n - offset))
            spans.append((chunk_id, offset, length))
            offset += length + draw(st.integers(0, 2))
    closed = draw(
        st.lists(st.tuples(st.integers(0, len(sizes) - 1), st.integers(0, 8)), max_size=2)
    )
    if draw(st.booleans()):  # out of order: order violations, runs into evicted chunks
        spans = draw(st.permutations(spans))
    return sizes, spans, [(c, o) for c, o in closed if o < sizes[c]]


def _book_of(sizes: list[int], closed: list, monotone: bool) -> DeliveryBook:
    table = ChunkTable()
    for chunk_id, n in enumerate(sizes):
        table.open_chunk(chunk_id, chunk_id, n, 0)
    for chunk_id, offset in closed:
        table.close(chunk_id, offset)
    return make_book(table, monotone)


def _state(book: DeliveryBook) -> tuple:
    book.counters.flush()
    table = book.table
    return (
        table.n_inflight,
        [tuple(column.tolist()) for column in table.epoch_open_offsets(0)],
        table.watermark,
        book.window_totals(),
        book.window_len,
        book.last_cursor,
        None if book.last_cursor is None else book.last_cursor.stable_hash,
        book.counters.delivered,
        book.counters.evicted,
        book.counters.mix_samples,
        book.counters.mix_tokens,
        [(v[0], v[1].meta, v[2], v[3]) if v[0] == "early-close" else v for v in book.violations],
    )


@given(
    deliveries(),
    st.booleans(),
    st.sampled_from(["named", "dataset ids", "one dataset"]),
    st.booleans(),
)
def test_a_run_is_booked_as_its_records_one_by_one(
    drawn: Any, monotone: bool, components: str, counted: bool
) -> None:
    sizes, spans, closed = drawn
    items = []
    for chunk_id, first, length in spans:
        offsets = range(first, first + length)
        ids = [0 if components == "one dataset" else (o // 2) % 3 * 300 for o in offsets]
        pointers = np.array([[d, chunk_id, o] for d, o in zip(ids, offsets)], dtype=np.int64)
        comps = ["web" if o % 3 else "books" for o in offsets] if components == "named" else None
        payloads = [{"i": o} for o in offsets]
        tokens = [o * 7 % 5 for o in offsets] if counted else None  # a pre-tokenized source's
        items.append(RecordRun(chunk_id, pointers, payloads, 0, comps, first, tokens))
    by_run, by_record = _book_of(sizes, closed, monotone), _book_of(sizes, closed, monotone)
    assert by_run.deliver(items) == len(items)
    records = expand_runs(items)
    assert by_record.deliver(records) == len(records)
    assert _state(by_run) == _state(by_record)


def test_a_run_into_a_chunk_never_announced_fails_like_its_first_record() -> None:
    run = RecordRun(5, np.zeros((2, 3), dtype=np.int64), [None, None], 0, [None, None])
    book = make_book(ChunkTable())
    with pytest.raises(ValueError, match="5") as by_run:
        book.deliver([run])
    with pytest.raises(ValueError) as by_record:
        make_book(ChunkTable()).deliver(run.records())
    assert str(by_run.value) == str(by_record.value)


@given(st.lists(st.integers(1, 7), min_size=1, max_size=5), st.integers(1, 6), st.data())
def test_gather_splits_runs_into_the_batches_their_records_make(
    lengths: list[int], batch_size: int, data: st.DataObject
) -> None:
    items: list[Any] = []
    for chunk_id, n in enumerate(lengths):
        pointers = np.array([[0, chunk_id, i] for i in range(n)], dtype=np.int64)
        items.append(RecordRun(chunk_id, pointers, list(range(n)), 0, [None] * n))
        if data.draw(st.booleans()):
            items.append(ChunkOpened(chunk_id + 1, chunk_id + 1, 1, 0))

    def batches(buf: list[Any]) -> list[list]:
        out, pos = [], 0
        while pos < len(buf):
            pending: list[Any] = []
            pos, _ = gather(buf, pos, pending, 0, batch_size, (LaneEnd,))
            if not pending:  # a leading control item: the caller books it
                pos += 1
                continue
            out.append([x if type(x) is ChunkOpened else x.meta for x in expand_runs(pending)])
        return out

    assert batches(list(items)) == batches(expand_runs(items))


def test_an_empty_run_books_nothing() -> None:
    table = ChunkTable()
    table.open_chunk(0, 0, 2, 0)
    book = make_book(table)
    empty = RecordRun(0, np.zeros((0, 3), dtype=np.int64), [], 0, None, 1)
    assert book.deliver([empty]) == 1
    assert open_offsets(table, 0) == [0, 1]
    assert (book.counters.delivered, book.window_totals(), book.last_cursor) == (0, (0, 0), None)


def _chunk_runs(lengths: list[int]) -> tuple[list[int], list[Any]]:
    """One run per chunk (chunk ``k`` holds ``lengths[k]`` records), each a whole chunk."""
    runs: list[Any] = []
    for chunk_id, n in enumerate(lengths):
        pointers = np.array([[chunk_id % 2, chunk_id, i] for i in range(n)], dtype=np.int64)
        runs.append(RecordRun(chunk_id, pointers, [{"i": i} for i in range(n)], 0, None))
    return lengths, runs


def payloads_of_run(records: Any) -> list[Any]:
    return [r.payload for r in records]


def _by_gather(buf: list[Any], pos: int, batch_size: int, book: DeliveryBook) -> Any:
    # What delivery does without the one-call path: gather, then collate and book the batch.
    pending: list[Any] = []
    pos, n = gather(buf, pos, pending, 0, batch_size, (LaneEnd,))
    assert n == batch_size
    records = expand_runs(pending)
    book.deliver(pending)
    return pos, [r.payload for r in records], [r.meta for r in records]


@given(st.lists(st.integers(1, 9), min_size=1, max_size=4), st.integers(1, 5), st.booleans())
def test_handing_over_the_head_of_a_run_is_gather_then_booking(
    lengths: list[int], batch_size: int, monotone: bool
) -> None:
    sizes, runs = _chunk_runs(lengths)
    fast_buf, slow_buf = list(runs), list(runs)
    fast, slow = _book_of(sizes, [], monotone), _book_of(sizes, [], monotone)
    fast_pos = slow_pos = 0
    while fast_pos < len(fast_buf):
        done = hand_over_run(fast_buf, fast_pos, batch_size, payloads_of_run, fast)
        if done is None:  # the rest of this run is shorter than a batch: nothing was touched
            assert len(fast_buf[fast_pos]) < batch_size and _state(fast) == _state(slow)
            fast_pos = slow_pos = fast_pos + 1
            continue
        fast_pos, batch = done
        slow_pos, payloads, metas = _by_gather(slow_buf, slow_pos, batch_size, slow)
        assert fast_pos == slow_pos
        assert batch.payload == payloads  # the collate saw the batch's records
        assert [r.meta for r in batch.records] == metas
        assert _state(fast) == _state(slow)


def test_handing_over_leaves_what_is_not_the_head_of_a_long_enough_run() -> None:
    _, (run,) = _chunk_runs([3])
    book = _book_of([3], [], True)
    opened = ChunkOpened(1, 1, 2, 0)
    for buf, pos, size in (([run], 1, 2), ([opened, run], 0, 2), ([run], 0, 4)):
        before = list(buf)
        assert hand_over_run(buf, pos, size, payloads_of_run, book) is None
        assert buf == before
    assert _state(book) == _state(_book_of([3], [], True))


def test_a_collate_that_raises_books_nothing_and_moves_nothing() -> None:
    _, (run,) = _chunk_runs([5])
    book = _book_of([5], [], True)
    buf = [run]

    def collate(records: Any) -> Any:
        raise KeyError("field 'h'")

    with pytest.raises(CollateFailed) as failed:
        hand_over_run(buf, 0, 2, collate, book)
    assert isinstance(failed.value.__cause__, KeyError)
    assert [r.meta for r in failed.value.records] == [r.meta for r in run.records()[:2]]
    assert buf == [run] and _state(book) == _state(_book_of([5], [], True))


@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(1, 3)), min_size=1, max_size=12),
    st.booleans(),
)
def test_partly_delivered_samples_are_the_ones_with_a_part_delivered_and_not_the_last(
    splits: list[tuple[int, int]], monotone: bool
) -> None:
    # Each (offset, parts) splits that sample into children; all but the last part of each
    # are delivered, so a sample is partly delivered exactly when it has more than one part.
    table = ChunkTable()
    book = make_book(table, monotone=monotone)
    table.open_chunk(0, 0, 6, 0)
    parents = {r.meta.cursor.chunk_offset: r for r in roots(0, 6)}
    expected: set[tuple[int, int]] = set()
    for offset, parts in dict(splits).items():
        for i in range(parts - 1):
            book.record(SampleRecord(spawn_child(parents[offset].meta, i), None))
        if parts > 1:
            expected.add((0, offset))
    if monotone:
        assert book.partial is None  # the monotone path needs no such bookkeeping
    else:
        assert book.partial == expected


def test_partly_delivered_samples_closed_since_are_forgotten_as_the_set_grows() -> None:
    # an epoch that splits more samples than the set keeps: it holds what is open, not all
    table = ChunkTable()
    book = make_book(table, monotone=False)
    n = 20_000
    table.open_chunk(0, 0, n, 0)
    for rec in roots(0, n):
        book.record(SampleRecord(spawn_child(rec.meta, 0), None))
        book.record(SampleRecord(spawn_child(rec.meta, 1, is_last_child=True), None))
    assert book.partial is not None and len(book.partial) <= 8192
    table.open_chunk(1, 1, 3, 0)
    for rec in roots(1, 3):
        book.record(SampleRecord(spawn_child(rec.meta, 0), None))
    assert {(1, 0), (1, 1), (1, 2)} <= book.partial


def test_a_split_sample_closed_by_its_last_part_is_partly_delivered_until_every_part_is() -> None:
    # behind a packer the last part (which closes the sample) can come before an earlier one
    table = ChunkTable()
    book = make_book(table, monotone=False)
    table.open_chunk(0, 0, 2, 0)
    first, second = roots(0, 2)
    book.record(SampleRecord(spawn_child(first.meta, 2, is_last_child=True), None))
    book.record(SampleRecord(spawn_child(first.meta, 0), None))
    assert book.partial is not None
    assert book.unfinished() == {(0, 0)} and (0, 0) in book.partial  # part 1 still held
    book.record(SampleRecord(spawn_child(first.meta, 1), None))
    assert book.unfinished() == set() and (0, 0) not in book.partial
    book.record(SampleRecord(spawn_child(second.meta, 0, is_last_child=True), None))
    assert book.unfinished() == set()  # a single part: whole
