"""Delivery of one lane: bookkeeping (SPEC §3.1–3.2), the replay filter (§3.4), the final batch.

Everything that decides what has been consumed happens here, in the loader's process, at the
moment an item is handed to the training loop: closing contributors and tombstones in the lane's
compiled chunk table, the monotone watermark, eviction, and the contract checks. The per-record
part runs in the compiled ``DeliveryBook`` (a whole batch per call); this module keeps what is
rare or per chunk: control items, epoch markers, the replay filter and the violation reports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zephon._core.chunk_table import EVICTED, ChunkTable
from zephon._core.delivery import DeliveryBook, gather
from zephon._core.records import make_batch
from zephon.errors import ContractViolation, OperatorError, ReplayDivergenceError
from zephon.ops.children import tombstones_for_record
from zephon.runtime.checkpoint import decode_cursor, encode_cursor
from zephon.runtime.control import ChunkOpened, EpochEnd, LaneEnd, OverClose
from zephon.runtime.lane import chunk_position, operator_labels
from zephon.runtime.workers import open_lane
from zephon.types import SampleBatch, SampleCursor, SampleRecord

if TYPE_CHECKING:
    from zephon.runtime.loader import Loader

MASK64 = (1 << 64) - 1
END_OF_LANE = 1 << 62  # a watermark offset beyond any chunk: closes everything


class LaneDelivery:
    """The delivery side of lane ``lane_id``: chunk table, replay cursor and window, replay filter.

    The replay window is what the lane delivered since its first retained chunk (monotone) or
    epoch (epoch path): a count and an order-independent digest of cursors, kept per chunk or per
    epoch (in the compiled ``DeliveryBook``) so that it shrinks when chunks are evicted and never
    grows with the run.
    """

    def __init__(self, loader: Loader, lane_id: int):
        plan = loader.plan
        self.loader = loader
        self.plan = plan
        self.lane_id = lane_id
        self.table = ChunkTable()
        self.monotone = plan.eviction_path == "monotone"
        self.book = DeliveryBook(
            self.table, self.monotone, loader.counts, self._early_close, self._order_violation
        )
        self.per_epoch = plan.epoch_chunks
        self.batch_size = plan.batcher.batch_size if plan.batcher else 0  # type: ignore[attr-defined]
        self.labels = operator_labels(plan.chain)
        self.finished = False
        self.next_local = 0  # lane-local index of the next chunk to be announced
        self.carry: list[Any] | None = None  # carry state at the start of the retained epoch
        self.suspects: set[str] = set()  # operators seen emitting too many closing contributors
        self.pending: list = []
        self.n_pending = 0
        # Replay filter: set on restore until the record at the replay cursor is met again.
        self.replay_target: SampleCursor | None = None
        self.replay_expect = (0, 0)
        self.replay_seen = [0, 0]
        self.restored_state: dict[str, Any] | None = None
        self._items: Any = None  # the lane's item lists; started on first use or by restore
        self._buf: list = []
        self._pos = 0

    @property
    def epochs_done(self) -> int:
        """Epoch path: epochs whose marker has been processed at delivery."""
        return self.book.epochs_done

    @property
    def last_cursor(self) -> SampleCursor | None:
        """The replay cursor: the last real record delivered (or swallowed) from this lane."""
        return self.book.last_cursor

    # ----------------------------------------------------------------------------- restore/state
    def restore(self, state: dict[str, Any]) -> None:
        """Restart at the retained position with fresh operators (carry state restored)."""
        self.restored_state = state
        if state["finished"]:
            self.finished = True
            return
        start = state["start"]
        self.next_local = start
        self.book.epochs_done = start // self.per_epoch
        self.carry = state["carry"]
        cursor = decode_cursor(state["cursor"])
        count, digest = state["count"], int(state["digest"], 16)
        skip = 0
        if cursor is not None:
            if self.plan.indexable and cursor.chunk_id == chunk_position(
                self.plan, self.lane_id, start
            ):
                # Every operator is 1 -> 1 and in order: skip consumed samples before fetch.
                skip = cursor.chunk_offset + 1
                self.book.last_cursor = cursor
                self.book.window_push(cursor.chunk_id, count, digest)
            else:
                self.replay_target = cursor
                self.replay_expect = (count, digest)
        self._items = open_lane(
            self.plan, self.lane_id, start_local=start, carry=self.carry, skip_offset=skip
        )

    def state(self) -> dict[str, Any]:
        """This lane's part of a checkpoint (SPEC §3.3); small and independent of run length."""
        if self.restored_state is not None:
            return self.restored_state
        if self.monotone:
            start = self.table.first_local_index if self.table.n_inflight else self.next_local
        else:
            start = self.epochs_done * self.per_epoch
        cursor = self.last_cursor
        if cursor is not None and self.monotone and not self.book.window_len:
            cursor = None  # its chunk was evicted: nothing to replay
        count, digest = self.book.window_totals()
        return {
            "lane": self.lane_id,
            "finished": self.finished,
            "start": start,
            "cursor": encode_cursor(cursor),
            "count": count,
            "digest": f"{digest:016x}",
            "carry": self.carry,
        }

    def start(self) -> None:
        """Start the lane's runner (worker thread or process) unless it runs already or is done."""
        if self._items is None and not self.finished:
            self._items = open_lane(self.plan, self.lane_id)

    def close(self) -> None:
        """Stop the lane runner (its generator and anything it holds)."""
        if self._items is not None:
            self._items.close()
        self.finished = True

    # ----------------------------------------------------------------------------- delivery
    def _next_item(self) -> Any:
        if self._pos >= len(self._buf):
            self.start()
            self._buf = next(self._items)
            self._pos = 0
        item = self._buf[self._pos]
        self._pos += 1
        return item

    def next_delivery(self) -> SampleRecord | SampleBatch | None:
        """The lane's next record or batch for the training loop, or None when the lane is done."""
        if self.finished:
            return None
        batch_size = self.batch_size
        while True:
            if batch_size and self.replay_target is None:
                # The common case in one C loop: records into the pending batch.
                if self._pos >= len(self._buf):
                    self.start()
                    self._buf = next(self._items)
                    self._pos = 0
                self._pos, self.n_pending = gather(
                    self._buf, self._pos, self.pending, self.n_pending, batch_size, LaneEnd
                )
                if self.n_pending == batch_size:
                    return self._hand_over()
                if self._pos == len(self._buf):
                    continue
                # An item the loop leaves to us (a control item, a tombstone, the lane's end).
            item = self._next_item()
            if type(item) is SampleRecord:
                if item.meta.is_tombstone:
                    if self.n_pending:
                        self.pending.append(item)
                    else:
                        self.book.tombstone(item, self.replay_target is None)
                    continue
                if self.replay_target is not None:
                    self._swallow(item)
                    continue
                if not batch_size:
                    self.book.record(item, True)
                    self.restored_state = None
                    return item
                self.pending.append(item)
                self.n_pending += 1
                if self.n_pending == self.batch_size:
                    return self._hand_over()
                continue
            if type(item) is LaneEnd:
                return self._lane_end()
            if self.n_pending:
                self.pending.append(item)
            else:
                self._control(item)

    def _hand_over(self) -> SampleBatch:
        pending, self.pending = self.pending, []
        if len(pending) == self.n_pending:  # records only, the usual case
            records = pending
        else:
            records = [r for r in pending if type(r) is SampleRecord and not r.meta.is_tombstone]
        self.n_pending = 0
        batcher: Any = self.plan.batcher
        try:
            payload = batcher.collate(records)
        except Exception as exc:
            first = records[0].meta.cursor
            raise OperatorError(
                f"operator {batcher.name!r} failed to collate {len(records)} records starting at "
                f"{first!r} (sample_id={first.sample_id}): {type(exc).__name__}: {exc}",
                operator=batcher.name,
                cursor=first,
            ) from exc
        self.book.deliver(pending, self._control)
        self.restored_state = None
        return make_batch(records, payload)

    def _lane_end(self) -> SampleBatch | None:
        out = None
        if self.n_pending:
            if self.plan.batcher.drop_remainder:  # type: ignore[union-attr]
                pending, self.pending, self.n_pending = self.pending, [], 0
                for item in pending:
                    if type(item) is not SampleRecord:
                        self._control(item)
                        continue
                    for tomb in [item] if item.meta.is_tombstone else tombstones_for_record(item):
                        self.book.tombstone(tomb, True)
            else:
                out = self._hand_over()
        if self.replay_target is not None:
            self._diverged("the lane ended before the replay cursor was met again")
        if self.monotone:
            self.table.close_below(END_OF_LANE, 0)
            self.book.note_evicted(self.table.evict_complete_prefix())
        self.close()  # releases the lane's worker as soon as it is done
        self.restored_state = None
        return out

    # ----------------------------------------------------------------------------- bookkeeping
    def _control(self, item: Any) -> None:
        kind = type(item)
        if kind is ChunkOpened:
            self.table.open_chunk(item.chunk_id, item.local_index, item.n_offsets, item.epoch)
            self.next_local = item.local_index + 1
            if item.skip_below:
                self.table.close_below(item.chunk_id, item.skip_below)
            self.loader.note_inflight()
        elif kind is EpochEnd:
            self._epoch_end(item)
        elif kind is OverClose:
            self.suspects.add(item.op)
        else:
            raise TypeError(f"unknown item in lane {self.lane_id}: {item!r}")

    def _epoch_end(self, marker: EpochEnd) -> None:
        epoch = marker.epoch
        if self.replay_target is not None:
            self._diverged(f"epoch {epoch} ended before the replay cursor was met again")
        chunk_ids, offsets = self.table.epoch_open_offsets(epoch, 20)
        if len(offsets):
            n_open = self.table.close_epoch(epoch)
            culprits = [op for op, deficit in marker.deficits.items() if deficit > 0]
            shown = ", ".join(f"({c}, {o})" for c, o in zip(chunk_ids.tolist(), offsets.tolist()))
            more = f" and {n_open - len(offsets)} more" if n_open > len(offsets) else ""
            self._violation(
                "missing-tombstone",
                culprits or self.labels,
                f"lane {self.lane_id}, epoch {epoch}: base offsets {shown}{more} were never "
                "closed: a record was dropped without emitting its tombstones "
                "(use tombstones_for_record)",
                epoch=epoch,
            )
        self.book.note_evicted(self.table.evict_complete_epochs(epoch))
        self.book.epochs_done = epoch + 1
        self.carry = marker.carry
        self.book.window_clear()
        self.book.last_cursor = None

    # ----------------------------------------------------------------------------- replay filter
    def _swallow(self, rec: SampleRecord) -> None:
        target = self.replay_target
        assert target is not None
        cursor = rec.meta.cursor
        if self.monotone and cursor > target:
            self._diverged(f"record {cursor!r} came where the replay cursor should have been")
        self.book.record(rec, False)
        seen = self.replay_seen
        seen[0] += 1
        seen[1] = (seen[1] + cursor.stable_hash) & MASK64
        if cursor == target:
            if (seen[0], seen[1]) != self.replay_expect:
                self._diverged(
                    f"the replay cursor was met after {seen[0]} records, but the checkpoint "
                    f"recorded {self.replay_expect[0]} (or different ones) before it"
                )
            self.loader.replayed += seen[0]
            self.replay_target = None

    def _diverged(self, why: str) -> None:
        raise ReplayDivergenceError(
            f"replay of lane {self.lane_id} to cursor {self.replay_target!r} diverged: {why}. "
            "Some operator is not deterministic (randomness not from (seed, lane, epoch), "
            "iteration over sets, time-based decisions); the stream was not resumed."
        )

    # ----------------------------------------------------------------------------- violations
    def _early_close(self, rec: SampleRecord, ref_cursor: SampleCursor, state: int) -> None:
        what = "an evicted chunk" if state == EVICTED else "an offset already closed"
        culprits = sorted(self.suspects) or self.labels
        self._violation(
            "early-close",
            culprits,
            f"record {rec.meta.cursor!r} (sample_id={rec.meta.cursor.sample_id}) carries a "
            f"contributor for base offset {ref_cursor.base_offset} of {what}: an operator closed "
            "that offset before its last record (only the last child may set is_last_child)",
        )

    def _order_violation(self, cursor: SampleCursor, last: SampleCursor) -> None:
        self._violation(
            "order",
            self.labels,
            f"record {cursor!r} reached delivery after {last!r}: an operator that claims "
            "preserves_cursor_order=True reorders records",
        )

    def _violation(self, kind: str, operators: list[str], message: str, epoch: int = -1) -> None:
        if self.replay_target is not None:
            return  # seen (and counted or raised) before the checkpoint
        names = ", ".join(operators) if operators else "unknown operator"
        text = f"contract violation ({kind}) by {names}: {message}"
        if self.plan.strict:
            raise ContractViolation(text)
        self.loader.count_violation((kind, tuple(operators), self.lane_id, epoch), text)
