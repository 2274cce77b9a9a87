"""Delivery of one lane: its stages, connected one way.

    lane feed (workers.feeds) -> replay filter -> bookkeeping -> final batcher -> the loader

The feed yields the lane's items; after a restore the replay filter swallows what was delivered
before the checkpoint (``catch_up``, before anything is handed over); bookkeeping records what is
handed over, and only that; the final batcher groups records into batches. Nothing here knows
the loader: the loader asks for the next item, and collects the lane's contract violations and
counts as values.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from zephon._core.cursor import cursors_for_chunk, digest_cursors
from zephon._core.delivery import DeliveryCounters, gather
from zephon._core.handover import LaneOutlet
from zephon._core.records import expand_runs, make_batch
from zephon.errors import CheckpointCorruptError
from zephon.ops.children import tombstones_for_record
from zephon.plan import Plan
from zephon.runtime.checkpoint.carry_check import check_carries
from zephon.runtime.checkpoint.layout import Layout, Run
from zephon.runtime.checkpoint.progress import EpochProgress, after_change
from zephon.runtime.checkpoint.retired import FetchScreen
from zephon.runtime.checkpoint.schema import check_lane_state, encode_cursor, encode_run
from zephon.runtime.delivery.batcher import LEAVE_TO_CALLER, FinalBatcher
from zephon.runtime.delivery.bookkeeping import LaneBook
from zephon.runtime.delivery.replay import ReplayFilter, changed_records, merged_records
from zephon.runtime.delivery.skips import SkipLog
from zephon.runtime.lanes.control import EpochEnd, LaneEnd, Retired, RunStart, Skipped
from zephon.runtime.workers.feeds import LaneFeed
from zephon.types import SampleBatch, SampleCursor, SampleRecord


class LaneDelivery(LaneOutlet):
    """The delivery side of lane ``lane_id``: feed, replay filter, bookkeeping and batcher."""

    feed: LaneFeed
    book: LaneBook
    batcher: FinalBatcher | None

    def __init__(self, plan: Plan, lane_id: int, counters: DeliveryCounters, skips: SkipLog):
        self.plan = plan
        self.lane_id = lane_id
        self.feed = LaneFeed(plan, lane_id)
        self.book = LaneBook(plan, lane_id, counters, skips)
        self.batcher = FinalBatcher(plan.batcher) if plan.batcher is not None else None
        self.replay: ReplayFilter | None = None
        self.replayed = 0  # records the replay filter swallowed before meeting the cursor
        self.ended = False  # the lane's stream ended (not: the lane was closed)
        self.delivered = 0  # items (records or batches) handed over, over the whole run
        self.restored_state: dict[str, Any] | None = None  # until something new is delivered
        # Even ends across ranks: the lane stops at ``limit`` items, leaving ``surplus`` ones.
        self.cut = False
        self.surplus = 0
        self.cause: str | None = None  # what a replay divergence means (``ReplayFilter``)
        # This resume changed operators that keep cursor order: the windows it restores were
        # booked by the old ones (``Run.changed``), and replay leniently (``ReplayFilter``).
        self.lenient = False
        self.merges: str | None = None  # why a lenient replay refuses merged records (same)
        self.in_order = all(op.traits.preserves_cursor_order for op in plan.chain)
        self.fetch_screen = FetchScreen([])  # what the lane's runner screens out at fetch
        # A resume with changed operators or retired samples behind a reordering operator:
        # its runs continue by position where they can (``checkpoint.progress.after_change``).
        self.by_position = False
        self.partly_delivered = 0

    # ----------------------------------------------------------------------------- delivery
    def next_delivery(self) -> SampleRecord | SampleBatch | None:
        """The lane's next record or batch for the training loop, or None when the lane is done.
        (The loader tries the usual step, ``hand_over_head``, before calling this.)"""
        if self.ended:
            return None
        if self.delivered >= self.limit:
            self._cut()
            return None
        if self.replay is not None:
            self.catch_up()
        feed, book, batcher = self.feed, self.book, self.batcher
        while True:
            if batcher is not None:
                if feed.pos >= len(feed.buf):
                    feed.refill()
                if not batcher.n_pending:
                    out = self.hand_over_head()  # the usual case, in one compiled call
                    if out is not None:
                        return out
                # Otherwise in one compiled loop: records into the pending batch.
                feed.pos, batcher.n_pending = gather(
                    feed.buf,
                    feed.pos,
                    batcher.pending,
                    batcher.n_pending,
                    batcher.batch_size,
                    LEAVE_TO_CALLER,
                )
                if batcher.n_pending == batcher.batch_size:
                    return self._hand_over()
                if feed.pos == len(feed.buf):
                    continue
                # An item the loop leaves to us (a control item, a tombstone, the lane's end).
            item = feed.next_item()
            if type(item) is SampleRecord:
                if item.meta.is_tombstone:
                    if batcher is not None and batcher.n_pending:
                        batcher.hold(item)
                    else:
                        book.tombstone(item)
                    continue
                if batcher is None:
                    book.record(item)
                    self.restored_state = None
                    self.delivered += 1
                    return item
                batcher.add(item)
                if batcher.full:
                    return self._hand_over()
                continue
            if type(item) is LaneEnd:
                if item.op_stats is not None:
                    book.op_stats = item.op_stats
                if item.source_io is not None:
                    book.source_io = item.source_io
                return self._lane_end()
            if type(item) is RunStart:
                self._replay_run(item)
            elif type(item) is Skipped:
                book.skips.admit(item, self.lane_id)
            if batcher is not None and batcher.n_pending:
                batcher.hold(item)
            else:
                book.control(item)

    def catch_up(self, on_record: Any = None) -> None:
        """After a restore: swallow what the lane delivered before the checkpoint (booking it
        again), up to the record at the replay cursor. The loader does this for every lane before
        it hands anything over, so a replay that diverges never starts a stream.
        ``on_record()`` is called for each swallowed record (a progress bar)."""
        replay, book = self.replay, self.book
        if replay is None:
            return
        for item in self._until_cursor(replay):
            if book.replayed(item):
                book.found.clear()  # seen (and counted or raised) before the checkpoint
                if on_record is not None:
                    on_record()
        self.replayed += replay.swallowed
        self.replay = None
        if replay.lenient:  # the window the new operators booked replaces the old one's
            self.restored_state = None

    def _replay_run(self, marker: RunStart) -> None:
        """A run taken over from another lane starts: swallow what that lane delivered of it
        before the checkpoint (up to its replay cursor) into ``marker.replayed``, to be booked
        with the marker, in stream order, but not handed over again."""
        run = self.book.runs[marker.index]
        if run.cursor is None:
            return
        replay = self._replay_to(run.cursor, (run.count, run.digest), changed=run.changed)
        marker.replayed = [
            SampleRecord(item.meta, None)  # the payload is not needed to book it
            if type(item) is SampleRecord and not item.meta.is_tombstone
            else item
            for item in self._until_cursor(replay)
        ]
        self.replayed += replay.swallowed

    def _until_cursor(self, replay: ReplayFilter) -> Iterator[Any]:
        """The lane's items up to the record at ``replay``'s cursor (checked by it as they
        pass); ``ReplayDivergenceError`` when the lane, an epoch or a run ends first. A lenient
        replay (``ReplayFilter.lenient``) also stops before a record above the cursor, or at the
        end of the run or lane, leaving that item to delivery."""
        feed, lenient = self.feed, replay.lenient
        while True:
            item = feed.next_item()
            kind = type(item)
            if kind is SampleRecord or kind is Retired:
                # A retired record was booked as delivered: the replay window counts it.
                rec = item.record if kind is Retired else item
                if lenient and not rec.meta.is_tombstone and replay.past(rec.meta.cursor):
                    replay.check_unmerged(f"{rec.meta.cursor!r} came first, above the cursor")
                    feed.pos -= 1
                    return
                yield item
                if not rec.meta.is_tombstone and replay.swallow(rec):
                    return
            elif lenient and (kind is LaneEnd or kind is RunStart or kind is EpochEnd):
                replay.check_unmerged("the replay cursor was not met again")
                feed.pos -= 1
                return
            elif kind is LaneEnd:
                raise replay.diverged("the lane ended before the replay cursor was met again")
            elif kind is EpochEnd:
                raise replay.diverged(
                    f"epoch {item.epoch} ended before the replay cursor was met again"
                )
            elif kind is RunStart:
                raise replay.diverged("the run ended before the replay cursor was met again")
            else:
                yield item

    def _hand_over(self) -> SampleBatch:
        assert self.batcher is not None
        items, records, payload = self.batcher.hand_over()  # a failure to collate books nothing
        self.book.deliver(items)
        self.restored_state = None
        self.delivered += 1
        return make_batch(records, payload)

    def _lane_end(self) -> SampleBatch | None:
        out = None
        batcher = self.batcher
        if batcher is not None and batcher.n_pending:
            if batcher.drop_remainder:
                items, _ = batcher.take()
                for item in expand_runs(items):
                    if type(item) is not SampleRecord:
                        self.book.control(item)
                        continue
                    for tomb in [item] if item.meta.is_tombstone else tombstones_for_record(item):
                        self.book.tombstone(tomb)
            else:
                out = self._hand_over()
        self.book.lane_end()
        self.ended = True
        self.feed.close()  # releases the lane's worker as soon as it is done
        self.restored_state = None
        return out

    def _cut(self) -> None:
        """The lane handed over its ``limit``: it delivers no more, though its chunks go on (its
        state says so: it has not finished)."""
        self.ended = self.cut = True
        self.feed.close()

    def close(self) -> None:
        """Stop the lane's worker; the lane's state still says where it was."""
        self.feed.close()

    # ----------------------------------------------------------------------------- state
    def state(self) -> dict[str, Any]:
        """This lane's part of a checkpoint; small and independent of the run's length."""
        if self.restored_state is not None:
            return self.restored_state
        book = self.book
        cursor, count, digest = book.window()
        run = book.runs[book.run_index]
        return {
            "lane": self.lane_id,
            "finished": self.ended and not self.cut,
            "delivered": self.delivered,
            "start": book.retained_start(),
            "cursor": encode_cursor(cursor),
            "count": count,
            "digest": f"{digest:016x}",
            "carry": book.carry,
            "held": book.held_state(),
            "progress": _encoded(book.progress()),
            "screened": _encoded(book.screened),
            "changed": False,  # booked by the operators running now
            "run": [run.gen, run.lane, run.end] if run.inherited else None,
            "pending": [encode_run(r) for r in book.runs[book.run_index + 1 :] if r.inherited],
        }

    def restore(self, state: Any, where: str, layout: Layout) -> dict[str, Any]:
        """Restart at the retained position with fresh operators (carry state restored); after
        a re-laning, first through the runs taken over from lanes of earlier generations."""
        plan = self.plan
        checked = check_lane_state(
            state,
            where,
            lane_id=self.lane_id,
            layout=layout,
            monotone=self.book.monotone,
            per_epoch=plan.epoch_chunks,
            n_ops=len(plan.chain),
            holdings=plan.restores_holdings,
            source=plan.source,
        )
        check_carries(state, where, plan.chain)
        self.restored_state = state
        self.delivered = checked["delivered"]
        self.cut = False
        if checked["finished"]:
            self.ended = True
            return checked
        if self.delivered >= self.limit:
            self.ended = self.cut = True
            return checked
        runs: list[Run] = checked["runs"]
        if self.by_position:
            runs = [after_change(run) for run in runs]
            self.restored_state = None  # what it says is replaced by the screens
            # runs left to their replay because a sample was partly delivered
            self.partly_delivered = sum(len(r.progress.partial) for r in runs if r.progress)
        if self.lenient:
            # Booked by the old operators: replayed leniently, also from a state taken before
            # they are (``Run.changed``).
            runs = [replace(r, changed=True) if r.cursor is not None else r for r in runs]
            self.restored_state = {
                **state,
                "changed": runs[0].changed,
                "pending": [encode_run(r) for r in runs[1:] if r.inherited],
            }
        first = runs[0]
        self.book.runs = runs
        self.book.layout = layout
        self.book.enter(first)
        skip = 0
        cursor = first.cursor
        if cursor is not None:
            position = layout.geometry(first.gen, first.lane).position(first.start)
            expect = (first.count, first.digest)
            if plan.indexable and cursor.chunk_id == position:
                skip = self._skip_at_source(position, cursor, expect, where, first)
            else:
                self.replay = self._replay_to(cursor, expect, changed=first.changed)
        self.feed.start_at = {
            "runs": [run.for_runner() for run in runs],
            # the rank's one lane history, shared by its lanes: encoded and decoded again per
            # lane, it cost O(lanes) each, O(lanes^2) for a rank of a thousand lanes
            "layout": layout,
            "skip_offset": skip,
        }
        return checked

    def _skip_at_source(
        self, position: int, cursor: SampleCursor, expect: tuple[int, int], where: str, run: Run
    ) -> int:
        """Every operator is 1 -> 1, in order: consumed samples are skipped before fetch. The
        skipped records' cursors are recomputed from the chunk, so the checkpoint's count and
        digest are still checked (without the retired samples the lane screened out at fetch
        there, which it never delivered). Batch-sensitive operators keep their micro-batches:
        the skip stops at a micro-batch boundary and the replay filter swallows the rest."""
        pointers = self.plan.source.chunk(position).pointers
        offset = cursor.chunk_offset
        if (
            offset >= len(pointers)
            or cursor.lineage
            or cursor.sample_id != tuple(pointers[offset].tolist())
        ):
            raise CheckpointCorruptError(
                f"loader state field {where}.cursor {cursor!r} is not a sample of chunk "
                f"{position} of lane {self.lane_id}"
            )
        skip = offset + 1
        if self.plan.batch_sensitive:
            skip -= skip % self.plan.micro_batch
        cursors = cursors_for_chunk(position, pointers[:skip])
        screened = self.fetch_screen.ids_for(run.gen, run.lane, run.start)
        if screened is not None:
            kept = (~screened.contains(pointers[:skip])).tolist()
            cursors = [c for c, keep in zip(cursors, kept) if keep]
        seen = (len(cursors), digest_cursors(cursors))
        self.book.book.window_push(position, *seen)
        if skip == offset + 1:
            # After a change on the monotone path every sample up to the cursor was consumed,
            # whatever the old operators made of it (``ReplayFilter.lenient``).
            if seen != expect and not (run.changed and self.in_order):
                raise CheckpointCorruptError(
                    f"loader state field {where} says lane {self.lane_id} delivered "
                    f"{expect[0]} records of chunk {position} up to {cursor!r}; the chunk holds "
                    f"{skip} (or other ones) up to there"
                )
            self.book.book.last_cursor = cursor
        else:
            self.replay = self._replay_to(cursor, expect, seen, changed=run.changed)
        return skip

    def _replay_to(
        self,
        cursor: SampleCursor,
        expect: tuple[int, int],
        seen: tuple[int, int] = (0, 0),
        *,
        changed: bool,
    ) -> ReplayFilter:
        # What swallows the records this lane delivered before the checkpoint, up to ``cursor``
        # (``seen``: the count and digest of those skipped at the source already; ``changed``:
        # operators changed since booked them, see ``Run.changed``).
        lenient = changed and self.in_order
        cause, merges = self.cause, self.merges
        if lenient and cause is None:  # changed at an earlier resume than this one
            cause = changed_records(["operators changed at an earlier resume"], [])
        if lenient and merges is None:
            merges = merged_records([op.name for op in self.plan.chain if op.traits.stateful])
        return ReplayFilter(
            self.lane_id,
            cursor,
            expect,
            monotone=self.book.monotone,
            seen=seen,
            cause=cause,
            lenient=lenient,
            merges=merges if lenient else None,
        )


def _encoded(progress: EpochProgress | None) -> dict[str, Any] | None:
    return None if progress is None else progress.encode()
