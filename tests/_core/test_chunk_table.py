"""The compiled chunk table against a short pure-Python reference of its rules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import pytest
from chunk_table_kit import is_complete, open_offsets
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from zephon._core.chunk_table import (
    BELOW_WATERMARK,
    CLOSED,
    EVICTED,
    OPEN,
    ChunkTable,
)

A = TypeVar("A")
E = TypeVar("E")


def i64(values: npt.ArrayLike) -> npt.NDArray[np.int64]:
    return np.asarray(values, dtype=np.int64)


# ---- the reference model -------------------------------------------------------------------------


@dataclass
class RefChunk:
    chunk_id: int
    local_index: int
    n: int
    epoch: int
    explicit: set[int] = field(default_factory=set)


class Reference:
    """What the chunk table must do, written for obviousness rather than speed.

    An offset is closed when it was closed explicitly (close, close_many, a forced close) or lies
    below the watermark point in (chunk_id, offset) order. Chunks leave from the head only.
    """

    def __init__(self) -> None:
        self.chunks: dict[int, RefChunk] = {}  # inflight, in opening (= id) order
        self.evicted: set[int] = set()
        self.opened: list[int] = []
        self.last_local = -1
        self.last_epoch = -1
        self.watermark: tuple[int, int] | None = None

    # -- helpers
    def below_watermark(self, chunk_id: int, offset: int) -> bool:
        return self.watermark is not None and (chunk_id, offset) < self.watermark

    def is_closed(self, chunk: RefChunk, offset: int) -> bool:
        return offset in chunk.explicit or self.below_watermark(chunk.chunk_id, offset)

    def lookup(self, chunk_id: int) -> RefChunk | None:
        """The inflight chunk, None if evicted, ValueError if never opened. An id between the
        first opened and the last evicted that was skipped counts as evicted: the table keeps
        nothing of the chunks it evicted, so it cannot tell a skipped id from an evicted one
        (its callers ask only about their own lane's ids)."""
        if chunk_id in self.chunks:
            return self.chunks[chunk_id]
        if chunk_id in self.evicted:
            return None
        if self.evicted and self.opened[0] <= chunk_id <= max(self.evicted):
            return None
        raise ValueError(f"chunk {chunk_id} was never opened")

    # -- the API
    def open_chunk(self, chunk_id: int, local_index: int, n: int, epoch: int) -> None:
        if chunk_id < 0 or (self.opened and chunk_id <= self.opened[-1]):
            raise ValueError("chunk id out of order")
        if local_index < 0 or local_index <= self.last_local:
            raise ValueError("local index out of order")
        if n < 0:
            raise ValueError("negative size")
        if epoch < 0 or epoch < self.last_epoch:
            raise ValueError("epoch out of order")
        self.chunks[chunk_id] = RefChunk(chunk_id, local_index, n, epoch)
        self.opened.append(chunk_id)
        self.last_local = local_index
        self.last_epoch = epoch

    def offset_state(self, chunk_id: int, offset: int) -> int:
        chunk = self.lookup(chunk_id)
        if chunk is None:
            if offset < 0:
                raise ValueError("negative offset")
            return EVICTED
        if not 0 <= offset < chunk.n:
            raise ValueError("offset out of range")
        if offset in chunk.explicit:
            return CLOSED
        if self.below_watermark(chunk_id, offset):
            return BELOW_WATERMARK
        return OPEN

    def close(self, chunk_id: int, offset: int) -> int:
        state = self.offset_state(chunk_id, offset)
        if state in (OPEN, BELOW_WATERMARK):
            self.chunks[chunk_id].explicit.add(offset)
        return state

    def close_many(self, pairs: list[tuple[int, int]]) -> int:
        for chunk_id, offset in pairs:  # all-or-nothing: check everything first
            self.offset_state(chunk_id, offset)
        return sum(self.close(chunk_id, offset) == OPEN for chunk_id, offset in pairs)

    def close_below(self, chunk_id: int, offset: int) -> None:
        if chunk_id < 0 or offset < 0:
            raise ValueError("negative watermark")
        if self.watermark is None or (chunk_id, offset) > self.watermark:
            self.watermark = (chunk_id, offset)

    def open_offsets(self, chunk_id: int, limit: int = -1) -> list[int]:
        chunk = self.lookup(chunk_id)
        if chunk is None:
            return []
        found = [o for o in range(chunk.n) if not self.is_closed(chunk, o)]
        return found if limit < 0 else found[:limit]

    def is_complete(self, chunk_id: int) -> bool:
        return not self.open_offsets(chunk_id)

    def close_chunk(self, chunk_id: int) -> list[int]:
        found = self.open_offsets(chunk_id)
        if found:
            self.chunks[chunk_id].explicit.update(found)
        return found

    def epoch_open_offsets(self, epoch: int, limit: int = -1) -> list[tuple[int, int]]:
        found = [
            (c.chunk_id, o)
            for c in self.chunks.values()
            if c.epoch == epoch
            for o in self.open_offsets(c.chunk_id)
        ]
        return found if limit < 0 else found[:limit]

    def close_epoch(self, epoch: int) -> int:
        chunks = [c.chunk_id for c in self.chunks.values() if c.epoch == epoch]
        return sum(len(self.close_chunk(c)) for c in chunks)

    def evict(self, chunk_id: int) -> None:
        assert chunk_id == next(iter(self.chunks)), "eviction happens at the head only"
        del self.chunks[chunk_id]
        self.evicted.add(chunk_id)

    def evict_complete_prefix(self) -> list[int]:
        out = []
        while self.chunks and self.is_complete(head := next(iter(self.chunks))):
            self.evict(head)
            out.append(head)
        return out

    def evict_complete_epochs(self, through_epoch: int) -> list[int]:
        out: list[int] = []
        while self.chunks:
            epoch = next(iter(self.chunks.values())).epoch
            group = [c.chunk_id for c in self.chunks.values() if c.epoch == epoch]
            if epoch > through_epoch or not all(self.is_complete(c) for c in group):
                break
            for c in group:
                self.evict(c)
            out.extend(group)
        return out

    def n_open_offsets(self) -> int:
        return sum(len(self.open_offsets(c)) for c in self.chunks)


# ---- the state machine ---------------------------------------------------------------------------


def agree(actual: Callable[[], A], expected: Callable[[], E]) -> tuple[A, E] | None:
    """Run the reference, then the table; both raise ValueError or neither does."""
    try:
        want = expected()
    except ValueError:
        with pytest.raises(ValueError):
            actual()
        return None
    return actual(), want


class ChunkTableMachine(RuleBasedStateMachine):
    """Random lanes of opens, closes, watermarks, forced closes and both eviction paths."""

    def __init__(self) -> None:
        super().__init__()
        self.table = ChunkTable()
        self.ref = Reference()
        self.baseline_bytes = self.table.bytes_held
        self.next_id = 0
        self.next_local = 0
        self.epoch = 0

    # -- choosing ids: every id this lane opened, a few it never did (no ids inside gaps)
    def chunk_id(self, data: st.DataObject) -> int:
        beyond = self.ref.opened[-1] + 1 if self.ref.opened else 0
        choices = [*self.ref.opened, beyond, beyond + 4, -1]
        if self.ref.watermark is not None:  # where the interesting edges are
            choices += [self.ref.watermark[0]] * 3
        return data.draw(st.sampled_from(choices))

    def size_of(self, chunk_id: int) -> int:
        chunk = self.ref.chunks.get(chunk_id)
        return chunk.n if chunk is not None else 5

    def an_offset(self, data: st.DataObject, chunk_id: int, valid: bool = False) -> int:
        """Any offset, often an edge: the ends, a word boundary, the watermark's offset ± 1."""
        n = self.size_of(chunk_id)
        low, high = (0, n - 1) if valid else (-1, n)
        if high < low:
            return 0  # a chunk without offsets has no valid offset; callers avoid asking
        edges = [low, high, 63, 64]
        if self.ref.watermark is not None and self.ref.watermark[0] == chunk_id:
            edges += [self.ref.watermark[1] + d for d in (-1, 0, 1)]
        edges = [o for o in edges if low <= o <= high]
        return data.draw(st.one_of(st.integers(low, high), st.sampled_from(edges)))

    @initialize(first=st.integers(0, 3))
    def start(self, first: int) -> None:
        self.next_id = first

    @precondition(lambda self: len(self.ref.chunks) < 10)
    @rule(
        chunks=st.lists(
            st.tuples(
                st.integers(1, 3),  # gap to the next chunk id
                st.integers(1, 2),  # gap to the next local index
                st.one_of(st.sampled_from([0, 1, 64]), st.integers(2, 6), st.integers(60, 140)),
                st.sampled_from([0, 0, 1]),  # epoch step
            ),
            min_size=1,
            max_size=3,
        )
    )
    def open_chunks(self, chunks: list[tuple[int, int, int, int]]) -> None:
        for id_gap, local_gap, n, epoch_step in chunks:
            self.epoch += epoch_step
            self.table.open_chunk(self.next_id, self.next_local, n, self.epoch)
            self.ref.open_chunk(self.next_id, self.next_local, n, self.epoch)
            self.next_id += id_gap
            self.next_local += local_gap

    @rule(
        which=st.sampled_from(["id_repeat", "id_negative", "local", "size", "epoch"]),
    )
    def open_chunk_out_of_order(self, which: str) -> None:
        args = {
            "chunk_id": self.next_id,
            "local_index": self.next_local,
            "n": 3,
            "epoch": self.epoch,
        }
        if which == "id_repeat":
            args["chunk_id"] = self.ref.opened[-1] if self.ref.opened else -1
        elif which == "id_negative":
            args["chunk_id"] = -1
        elif which == "local":
            args["local_index"] = self.ref.last_local if self.ref.last_local >= 0 else -1
        elif which == "size":
            args["n"] = -1
        else:
            args["epoch"] = self.epoch - 1
        agree(
            lambda: self.table.open_chunk(*args.values()),
            lambda: self.ref.open_chunk(*args.values()),
        )

    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        chunk_id = self.chunk_id(data)
        offset = self.an_offset(data, chunk_id)
        got = agree(
            lambda: self.table.close(chunk_id, offset), lambda: self.ref.close(chunk_id, offset)
        )
        if got is not None:
            assert got[0] == got[1], (chunk_id, offset)

    @rule(data=st.data())
    def offset_state(self, data: st.DataObject) -> None:
        chunk_id = self.chunk_id(data)
        offset = self.an_offset(data, chunk_id)
        got = agree(
            lambda: self.table.offset_state(chunk_id, offset),
            lambda: self.ref.offset_state(chunk_id, offset),
        )
        if got is not None:
            assert got[0] == got[1], (chunk_id, offset)

    @precondition(lambda self: any(self.size_of(c) > 0 for c in self.ref.opened))
    @rule(data=st.data(), corrupt=st.booleans(), grouped=st.booleans())
    def close_many(self, data: st.DataObject, corrupt: bool, grouped: bool) -> None:
        with_offsets = [c for c in self.ref.opened if self.size_of(c) > 0]
        chunk_ids = data.draw(st.lists(st.sampled_from(with_offsets), max_size=300))
        if grouped:
            chunk_ids.sort()
        pairs = [(c, self.an_offset(data, c, valid=True)) for c in chunk_ids]
        if corrupt:
            at = data.draw(st.integers(0, len(pairs)))
            bad_id = self.chunk_id(data)
            pairs.insert(at, (bad_id, self.an_offset(data, bad_id)))
        got = agree(
            lambda: self.table.close_many(i64([c for c, _ in pairs]), i64([o for _, o in pairs])),
            lambda: self.ref.close_many(pairs),
        )
        if got is not None:
            assert got[0] == got[1]

    @rule(data=st.data())
    def close_below(self, data: st.DataObject) -> None:
        chunk_id = self.chunk_id(data)
        offset = data.draw(st.integers(-1, self.size_of(chunk_id) + 2))
        agree(
            lambda: self.table.close_below(chunk_id, offset),
            lambda: self.ref.close_below(chunk_id, offset),
        )

    @precondition(lambda self: bool(self.ref.chunks))
    @rule(data=st.data())
    def every_offset_state(self, data: st.DataObject) -> None:
        chunk_id = data.draw(st.sampled_from(list(self.ref.chunks)))
        for offset in range(self.ref.chunks[chunk_id].n):
            assert self.table.offset_state(chunk_id, offset) == self.ref.offset_state(
                chunk_id, offset
            ), (chunk_id, offset)

    @rule(epoch_delta=st.integers(-1, 1), limit=st.integers(-1, 150))
    def epoch_open_offsets(self, epoch_delta: int, limit: int) -> None:
        epoch = self.epoch + epoch_delta
        ids, offsets = self.table.epoch_open_offsets(epoch, limit)
        assert ids.dtype == offsets.dtype == np.int64
        assert list(
            zip(ids.tolist(), offsets.tolist(), strict=True)
        ) == self.ref.epoch_open_offsets(epoch, limit)

    @rule(epoch_delta=st.integers(-1, 0))
    def close_epoch(self, epoch_delta: int) -> None:
        epoch = self.epoch + epoch_delta
        assert self.table.close_epoch(epoch) == self.ref.close_epoch(epoch)

    @rule()
    def evict_complete_prefix(self) -> None:
        assert self.table.evict_complete_prefix().tolist() == self.ref.evict_complete_prefix()

    @rule(epoch_delta=st.integers(-2, 1))
    def evict_complete_epochs(self, epoch_delta: int) -> None:
        through = self.epoch + epoch_delta
        got = self.table.evict_complete_epochs(through).tolist()
        assert got == self.ref.evict_complete_epochs(through)

    @rule()
    def drain(self) -> None:
        """Close and evict everything: the table gives all its memory back."""
        beyond = self.ref.opened[-1] + 1 if self.ref.opened else 0
        self.table.close_below(beyond, 0)
        self.ref.close_below(beyond, 0)
        assert self.table.evict_complete_prefix().tolist() == self.ref.evict_complete_prefix()
        assert len(self.table) == 0
        assert self.table.bytes_held == self.baseline_bytes

    @invariant()
    def same_summary(self) -> None:
        ref, table = self.ref, self.table
        inflight = list(ref.chunks.values())
        assert table.n_inflight == len(table) == len(inflight)
        assert table.first_local_index == (inflight[0].local_index if inflight else -1)
        assert table.n_open_offsets == ref.n_open_offsets()
        assert table.watermark == ref.watermark
        for epoch in sorted({c.epoch for c in inflight}):
            ids, offsets = table.epoch_open_offsets(epoch)
            got = list(zip(ids.tolist(), offsets.tolist(), strict=True))
            assert got == ref.epoch_open_offsets(epoch), epoch
        if not inflight:
            assert table.bytes_held == self.baseline_bytes


ChunkTableMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None
)
test_chunk_table_matches_the_reference = ChunkTableMachine.TestCase


# ---- the semantics, spelled out ------------------------------------------------------------------


def table_with(*sizes: int, epochs: list[int] | None = None) -> ChunkTable:
    table = ChunkTable()
    for i, n in enumerate(sizes):
        table.open_chunk(10 + i, i, n, epochs[i] if epochs else 0)
    return table


def test_close_reports_the_state_before_the_call() -> None:
    table = table_with(70)
    assert table.close(10, 65) == OPEN
    assert table.close(10, 65) == CLOSED
    assert table.offset_state(10, 65) == CLOSED
    assert table.offset_state(10, 64) == OPEN
    assert table.n_open_offsets == 69


def test_an_offset_closed_by_the_watermark_reports_below_watermark_then_closed() -> None:
    table = table_with(100)
    table.close_below(10, 80)
    assert table.n_open_offsets == 20
    assert table.offset_state(10, 3) == BELOW_WATERMARK
    assert table.close(10, 3) == BELOW_WATERMARK
    assert table.close(10, 3) == CLOSED  # now closed by a closing contributor as well
    assert table.n_open_offsets == 20
    assert table.close(10, 80) == OPEN  # the watermark's own offset stays open
    assert table.n_open_offsets == 19


def test_an_explicit_close_stays_closed_when_the_watermark_passes_it() -> None:
    table = table_with(100)
    table.close(10, 5)
    table.close_below(10, 50)
    assert table.close(10, 5) == CLOSED
    assert table.n_open_offsets == 50


def test_the_watermark_only_moves_forward() -> None:
    table = table_with(10, 10)
    table.close_below(11, 4)
    table.close_below(10, 9)
    table.close_below(11, 2)
    assert table.watermark == (11, 4)
    assert open_offsets(table, 11) == [4, 5, 6, 7, 8, 9]
    assert is_complete(table, 10)


def test_the_watermark_closes_chunks_opened_after_it_moved() -> None:
    table = table_with(10)
    table.close_below(12, 3)
    table.open_chunk(11, 1, 4, 0)
    table.open_chunk(12, 2, 8, 0)
    assert is_complete(table, 11)
    assert open_offsets(table, 12) == [3, 4, 5, 6, 7]


def test_the_watermark_passes_over_chunks_without_offsets() -> None:
    table = table_with(5, 0, 5, 0, 5)
    table.close_below(12, 1)
    table.close_below(14, 2)
    assert table.n_inflight == 5
    assert table.evict_complete_prefix().tolist() == [10, 11, 12, 13]
    assert open_offsets(table, 14) == [2, 3, 4]


def test_close_below_may_name_the_chunk_size_to_close_the_whole_chunk() -> None:
    table = table_with(64, 5)
    table.close_below(10, 64)
    assert is_complete(table, 10)
    assert not is_complete(table, 11)


def test_a_chunk_without_offsets_is_complete_at_once() -> None:
    table = table_with(0, 3)
    assert is_complete(table, 10)
    assert table.evict_complete_prefix().tolist() == [10]
    assert open_offsets(table, 11) == [0, 1, 2]


def test_monotone_eviction_stops_at_the_first_incomplete_chunk() -> None:
    table = table_with(2, 2, 2)
    table.close_many(i64([10, 10, 12, 12]), i64([0, 1, 0, 1]))
    assert table.evict_complete_prefix().tolist() == [10]
    assert (table.n_inflight, table.first_local_index) == (2, 1)
    table.close_many(i64([11, 11]), i64([0, 1]))
    assert table.evict_complete_prefix().tolist() == [11, 12]
    assert table.close(11, 1) == EVICTED
    assert table.offset_state(11, 0) == EVICTED and is_complete(table, 11)


def test_an_epoch_is_evicted_whole_and_only_after_every_earlier_epoch() -> None:
    table = table_with(1, 1, 1, 1, epochs=[0, 0, 1, 1])
    table.close_many(i64([11, 12, 13]), i64([0, 0, 0]))
    assert table.evict_complete_epochs(1).tolist() == []  # epoch 0 still owes chunk 10
    table.close(10, 0)
    assert table.evict_complete_epochs(0).tolist() == [10, 11]
    assert table.first_local_index == 2
    assert table.evict_complete_epochs(1).tolist() == [12, 13]
    assert table.first_local_index == -1


def test_epoch_markers_name_and_force_close_the_open_offsets() -> None:
    table = table_with(3, 70, 2, epochs=[0, 0, 1])
    table.close_many(i64([10, 10, 11]), i64([0, 2, 1]))
    ids, offsets = table.epoch_open_offsets(0, limit=3)
    assert list(zip(ids.tolist(), offsets.tolist(), strict=True)) == [(10, 1), (11, 0), (11, 2)]
    assert table.epoch_open_offsets(0)[0].size == 1 + 69
    assert table.close_epoch(0) == 70
    assert table.offset_state(11, 69) == CLOSED
    assert table.evict_complete_epochs(0).tolist() == [10, 11]
    assert table.n_open_offsets == 2


def test_close_many_counts_only_newly_closed_and_ignores_evicted_chunks() -> None:
    table = table_with(1, 100)
    table.close(10, 0)
    table.evict_complete_prefix()
    table.close_below(11, 10)
    table.close(11, 50)
    ids = i64([10, 11, 11, 11, 11, 11])
    offsets = i64([0, 5, 50, 51, 51, 99])
    assert table.close_many(ids, offsets) == 2  # 51 and 99; 5 was below the watermark, 50 closed
    assert table.offset_state(11, 5) == CLOSED


def test_close_many_accepts_strided_views() -> None:
    table = table_with(10)
    pairs = i64([[10, 1], [10, 3], [10, 5]])
    assert table.close_many(pairs[:, 0], pairs[:, 1]) == 3
    assert open_offsets(table, 10) == [0, 2, 4, 6, 7, 8, 9]
    # Walked backwards too, and a bad pair in a reversed view is still refused before any mark.
    backwards = i64([[10, 9], [10, 8], [10, 2]])[::-1]
    assert table.close_many(backwards[:, 0], backwards[:, 1]) == 3
    assert open_offsets(table, 10) == [0, 4, 6, 7]
    bad = i64([[10, 12], [10, 0]])[::-1]
    with pytest.raises(ValueError):
        table.close_many(bad[:, 0], bad[:, 1])
    assert open_offsets(table, 10) == [0, 4, 6, 7]


def test_close_many_on_large_inputs_releases_the_gil_and_still_counts() -> None:
    table = table_with(300_000, 300_000)
    offsets = np.arange(300_000, dtype=np.int64)
    ids = np.repeat(i64([10, 11]), 150_000)
    assert table.close_many(ids, np.concatenate([offsets[::2], offsets[1::2]])) == 300_000
    assert table.n_open_offsets == 300_000
    assert table.epoch_open_offsets(0, limit=3)[1].tolist() == [1, 3, 5]


def test_ids_between_evicted_chunks_count_as_evicted() -> None:
    """Documented approximation: the table keeps the evicted id range, not the set."""
    table = ChunkTable()
    table.open_chunk(4, 0, 0, 0)
    table.open_chunk(8, 1, 0, 0)
    table.open_chunk(12, 2, 1, 0)
    table.evict_complete_prefix()
    assert table.offset_state(6, 0) == EVICTED
    assert table.close(6, 0) == EVICTED
    with pytest.raises(ValueError, match="chunk 3 was never opened"):  # below the first chunk
        table.offset_state(3, 0)
    with pytest.raises(ValueError, match="chunk 10 was never opened"):
        table.close(10, 0)


def test_repr_names_the_inflight_range_and_counts() -> None:
    table = table_with(5, 5)
    table.close_below(10, 2)
    text = repr(table)
    assert text.startswith("ChunkTable(")
    assert "inflight_chunks=10..11" in text
    assert "n_open_offsets=8" in text
    assert "watermark=(10, 2)" in text


# ---- bad input -----------------------------------------------------------------------------------


def test_unopened_chunk_ids_are_refused_with_their_id() -> None:
    table = ChunkTable()
    with pytest.raises(ValueError, match="chunk 3 was never opened"):
        table.close(3, 0)
    table.open_chunk(5, 0, 4, 0)
    table.open_chunk(9, 1, 4, 0)
    for method in (table.close, table.offset_state):
        for chunk_id in (2, 7, 10, -1):
            with pytest.raises(ValueError, match=f"chunk {chunk_id} was never opened"):
                method(chunk_id, 0)


def test_offsets_outside_the_chunk_are_refused_with_the_offset() -> None:
    table = table_with(64)
    for offset in (-1, 64, 1 << 40):
        with pytest.raises(ValueError, match=rf"offset {offset} is outside \[0, 64\) of chunk 10"):
            table.close(10, offset)
        with pytest.raises(ValueError, match=f"offset {offset}"):
            table.offset_state(10, offset)
    assert table.n_open_offsets == 64


def test_opens_out_of_order_are_refused() -> None:
    table = table_with(4)
    for args in [(10, 1, 4, 0), (9, 1, 4, 0), (11, 0, 4, 0), (11, 1, -1, 0), (-3, 1, 1, 0)]:
        with pytest.raises(ValueError, match=f"chunk {args[0]}"):
            table.open_chunk(*args)
    table.open_chunk(11, 1, 4, 2)
    with pytest.raises(ValueError, match="epoch 1"):
        table.open_chunk(12, 2, 4, 1)
    assert table.n_inflight == 2


def test_close_below_refuses_negative_points() -> None:
    table = table_with(4)
    with pytest.raises(ValueError, match="chunk -1"):
        table.close_below(-1, 0)
    with pytest.raises(ValueError, match="offset -2"):
        table.close_below(10, -2)
    assert table.watermark is None


@pytest.mark.parametrize("dtype", [np.int32, np.uint64, np.float64])
def test_close_many_refuses_other_dtypes(dtype: type) -> None:
    table = table_with(4)
    with pytest.raises(ValueError, match="dtype"):
        table.close_many(np.array([10], dtype=dtype), i64([0]))
    with pytest.raises(ValueError, match="dtype"):
        table.close_many(i64([10]), np.array([0], dtype=dtype))


def test_close_many_refuses_other_shapes_and_non_buffers() -> None:
    table = table_with(4)
    with pytest.raises(ValueError, match="dimensions"):
        table.close_many(i64([[10]]), i64([[0]]))
    with pytest.raises(ValueError, match="2 chunk ids but 3 offsets"):
        table.close_many(i64([10, 10]), i64([0, 1, 2]))
    bad: Any = [10]
    with pytest.raises(TypeError):
        table.close_many(bad, bad)
    assert table.n_open_offsets == 4


def test_a_bad_pair_in_close_many_changes_nothing() -> None:
    table = table_with(4, 4)
    with pytest.raises(ValueError, match=r"offset 4 is outside \[0, 4\) of chunk 11"):
        table.close_many(i64([10, 10, 11, 11]), i64([0, 1, 2, 4]))
    with pytest.raises(ValueError, match="chunk 12 was never opened"):
        table.close_many(i64([10, 12]), i64([0, 0]))
    assert table.n_open_offsets == 8
    assert open_offsets(table, 10) == [0, 1, 2, 3]


def test_an_evicted_chunk_refuses_negative_offsets_and_ignores_the_others() -> None:
    table = table_with(0)
    table.evict_complete_prefix()
    with pytest.raises(ValueError, match="offset -1 of chunk 10"):
        table.close(10, -1)
    with pytest.raises(ValueError, match="offset -1 of chunk 10"):
        table.close_many(i64([10]), i64([-1]))
    assert table.close_many(i64([10, 10]), i64([0, 2**63 - 1])) == 0
    assert open_offsets(table, 10) == []


# ---- memory --------------------------------------------------------------------------------------


def test_memory_stays_bounded_over_a_long_lane() -> None:
    """100k chunks pass through a window of 8 (+1 opened before the watermark catches up)."""
    table = ChunkTable()
    baseline = table.bytes_held
    window, size = 8, 100
    bitmap = (size + 63) // 64 * 8
    peak_bytes = peak_inflight = 0
    offsets = np.arange(size, dtype=np.int64)
    for chunk_id in range(100_000):
        table.open_chunk(chunk_id, chunk_id, size, chunk_id // 4)
        if chunk_id % 2:
            table.close_many(np.full(size, chunk_id - 1, dtype=np.int64), offsets)
        else:
            table.close_below(max(chunk_id - window + 1, 0), 0)
        table.evict_complete_prefix()
        peak_bytes = max(peak_bytes, table.bytes_held)
        peak_inflight = max(peak_inflight, table.n_inflight)
    assert peak_inflight <= window + 1
    assert peak_bytes <= 2 * baseline + (window + 1) * bitmap
    table.close_below(100_000, 0)
    assert table.evict_complete_prefix().size > 0
    assert table.n_inflight == 0
    assert table.bytes_held == baseline


def test_a_burst_of_inflight_chunks_is_given_back() -> None:
    table = ChunkTable()
    baseline = table.bytes_held
    for chunk_id in range(5000):
        table.open_chunk(chunk_id, chunk_id, 1000, 0)
    assert table.bytes_held > 5000 * 1000 // 8
    table.close_epoch(0)
    assert table.evict_complete_epochs(0).size == 5000
    assert table.bytes_held == baseline


# ---- concurrent use ------------------------------------------------------------------------------

TABLE_HAMMER = """
from zephon._core.chunk_table import OPEN, ChunkTable

N, CHUNKS = 200_000, 4
table = ChunkTable()
for c in range(CHUNKS):
    table.open_chunk(c, c, N, 0)
newly = []  # what each close call reported as newly closed
problems = []
refused = []


def bulk(t):
    # close_many above the size where it releases the GIL, on every chunk at once
    rng = np.random.default_rng(t)
    for _ in range(12):
        ids = rng.integers(0, CHUNKS, 100_000).astype(np.int64)
        ids.sort()
        offs = rng.integers(0, N, 100_000).astype(np.int64)
        try:
            newly.append(table.close_many(ids, offs))
        except RuntimeError as exc:
            refused.append(str(exc))


def single(t):
    rng = np.random.default_rng(t)
    for _ in range(20_000):
        c, off = int(rng.integers(0, CHUNKS)), int(rng.integers(0, N))
        try:
            newly.append(1 if table.close(c, off) == OPEN else 0)
            ids, opened = table.epoch_open_offsets(0, limit=64)
            pairs = list(zip(ids.tolist(), opened.tolist()))
            in_range = all(0 <= i < CHUNKS and 0 <= o < N for i, o in pairs)
            if not (in_range and pairs == sorted(set(pairs))):
                problems.append(f"open offsets are not (chunk, offset) pairs: {pairs[:6]}")
        except RuntimeError as exc:
            refused.append(str(exc))


errors = hammer(4, lambda t: (bulk if t < 2 else single)(t))
open_now = len(table.epoch_open_offsets(0)[1])
if table.n_open_offsets != open_now:
    problems.append(f"n_open_offsets {table.n_open_offsets} != {open_now} open offsets")
closed_now = CHUNKS * N - open_now
if sum(newly) != closed_now:
    problems.append(f"closes reported {sum(newly)} newly closed offsets, {closed_now} are closed")
print(json.dumps({"errors": errors[:3], "refused": refused[:3], "problems": problems[:5]}))
"""


def test_concurrent_closes_and_reads_of_one_table_are_serialized_and_exact() -> None:
    from threads_kit import run_threads

    assert run_threads(TABLE_HAMMER) == {"errors": [], "refused": [], "problems": []}


@given(
    st.integers(1, 200),
    st.lists(st.integers(0, 199), max_size=3),
    st.integers(0, 200),
    st.integers(0, 199),
    st.integers(0, 201),
)
def test_close_span_is_closing_each_offset_when_all_are_open_and_nothing_otherwise(
    n: int, closed: list[int], watermark: int, lo: int, hi: int
) -> None:
    def table() -> ChunkTable:
        t = ChunkTable()
        t.open_chunk(0, 0, n, 0)
        for offset in closed:
            if offset < n:
                t.close(0, offset)
        t.close_below(0, min(watermark, n))
        return t

    def seen(t: ChunkTable) -> tuple:
        return open_offsets(t, 0), t.n_open_offsets, is_complete(t, 0)

    lo, hi = min(lo, n - 1), min(hi, n)
    by_span, one_by_one = table(), table()
    all_open = all(one_by_one.offset_state(0, o) != CLOSED for o in range(lo, hi))
    assert by_span.close_span(0, lo, hi) is all_open
    if all_open:
        for offset in range(lo, hi):
            one_by_one.close(0, offset)
    assert seen(by_span) == seen(one_by_one)
    assert [by_span.offset_state(0, o) for o in range(n)] == [
        one_by_one.offset_state(0, o) for o in range(n)
    ]


def test_close_span_leaves_an_evicted_chunk_and_rejects_offsets_it_never_had() -> None:
    t = ChunkTable()
    t.open_chunk(0, 0, 2, 0)
    t.open_chunk(1, 1, 4, 0)
    t.close_below(0, 2)
    t.evict_complete_prefix()
    assert t.close_span(0, 0, 2) is False
    with pytest.raises(ValueError, match="outside"):
        t.close_span(1, 2, 5)
    with pytest.raises(ValueError, match="negative"):
        t.close_span(1, -1, 2)
    assert open_offsets(t, 1) == [0, 1, 2, 3]
