"""Bookkeeping of one lane at delivery: what has been consumed, and what may be forgotten.

Every chunk the lane starts is entered in its compiled chunk table (one bit per offset) when its
announcement reaches delivery. Delivered records and tombstones close the base offsets of their
closing contributors; on the monotone path a delivered record also closes every offset below its
smallest one (the watermark). A chunk (monotone) or an epoch (epoch path) is evicted once complete
and every earlier one is. At an epoch marker every offset of the epoch must be closed. The
per-record part runs in the compiled ``DeliveryBook``; control items and reports are handled here.
"""

from __future__ import annotations

import json
import logging
import warnings
from typing import Any

import numpy as np

from zephon._core.chunk_table import EVICTED, ChunkTable
from zephon._core.delivery import DeliveryBook, DeliveryCounters
from zephon.compact import pack_ints, unpack_ints
from zephon.errors import CarryStateWarning, ContractViolation, OperatorError
from zephon.plan import Plan
from zephon.runtime.checkpoint.layout import Layout, Run
from zephon.runtime.checkpoint.progress import EpochProgress
from zephon.runtime.delivery.contracts import Violation
from zephon.runtime.delivery.skips import SkipLog
from zephon.runtime.lanes.control import (
    ChunkOpened,
    EpochEnd,
    Holdings,
    OverClose,
    Retired,
    RunStart,
    Skipped,
)
from zephon.runtime.lanes.runner import operator_labels
from zephon.runtime.lanes.snapshots import packed
from zephon.types import SampleCursor, SampleRecord

log = logging.getLogger("zephon")
END_OF_LANE = 1 << 62  # a watermark offset beyond any chunk: closes everything


class LaneBook:
    """The chunk table, watermark, replay window and contract checks of lane ``lane_id``.

    The replay window is what the lane delivered since its first retained chunk (monotone) or
    epoch (epoch path): a count and an order-independent digest of cursors, kept per chunk or per
    epoch so that it shrinks when chunks are evicted and never grows with the run.
    """

    def __init__(self, plan: Plan, lane_id: int, counters: DeliveryCounters, skips: SkipLog):
        self.lane_id = lane_id
        self.skips = skips  # the loader's, shared by its lanes
        self.monotone = plan.eviction_path == "monotone"
        self.per_epoch = plan.epoch_chunks
        self.labels = operator_labels(plan.chain)
        self.counters = counters
        self.table = ChunkTable()
        self.keeps_progress = plan.reorders_epochs  # see ``progress``
        self.book = DeliveryBook(self.table, self.monotone, counters, self.keeps_progress)
        self.found = self.book.violations  # broken contracts, in order, until ``take_violations``
        # What the lane runs, in order (more than its own chunks after a re-laning), and which of
        # them the bookkeeping is in: every run is booked in a chunk table of its own.
        self.runs: list[Run] = [Run(0, lane_id, 0, None)]
        self.run_index = 0
        self.layout = Layout.fresh(plan.lanes, plan.source.total_chunks())
        self.source = plan.source
        # The last snapshot booked in the current epoch (``control.Holdings``), with the epoch's
        # offsets still open then: a checkpoint continues from it.
        self.held: dict[str, Any] | None = None
        self._open_at_held: tuple[Any, Any] | None = None
        self.next_local = 0  # lane-local index of the next chunk to be announced
        self.carry: list[Any] | None = None  # carry state at the start of the retained epoch
        self.suspects: set[str] = set()  # operators seen emitting too many closing contributors
        self.op_stats: list[list[Any]] | None = None  # the runner's (``stats_now``), latest chunk
        # (process id, its source's io_counters), as of the runner's latest chunk
        self.source_io: tuple[str, dict[str, dict[str, int]]] | None = None
        self.opened = False  # a chunk was announced since the loader last looked
        self.carry_warn_bytes = plan.carry_warn_bytes
        self.carry_warned = False
        # The run may screen what was consumed before a resume with changed operators, until
        # its epoch marker (``checkpoint.progress``).
        self.screened: EpochProgress | None = None

    # ----------------------------------------------------------------------------- per record
    def record(self, rec: SampleRecord, delivered: bool = True) -> None:
        """A real record handed over (``delivered``) or swallowed by the replay filter."""
        try:
            self.book.record(rec, delivered)
        except (KeyError, ValueError, IndexError) as exc:
            raise self.invented(rec, exc) from None

    def tombstone(self, tomb: SampleRecord, delivered: bool = True) -> None:
        try:
            self.book.tombstone(tomb, delivered)
        except (KeyError, ValueError, IndexError) as exc:
            raise self.invented(tomb, exc) from None

    def replayed(self, item: Any) -> bool:
        """Book ``item``, handed over before the checkpoint and swallowed now by the replay, as
        its delivery did (a ``Skipped`` was counted then already); True when it is a record."""
        if type(item) is Skipped:
            return False
        if type(item) is not SampleRecord:
            self.control(item)
            return False
        if item.meta.is_tombstone:
            self.tombstone(item, False)
            return False
        self.record(item, False)
        return True

    def deliver(self, items: list[Any]) -> None:
        """Everything a batch hands over, in stream order: records, tombstones, control items."""
        i, n = 0, len(items)
        while i < n:
            try:
                i = self.book.deliver(items, i)  # a control item may start a run's new book
            except (KeyError, ValueError, IndexError) as exc:
                raise self.invented(None, exc) from None
            if i < n:
                self.control(items[i])
                i += 1

    def invented(self, rec: SampleRecord | None, exc: Exception) -> ContractViolation:
        """The error for a record (or, with None, a record of a batch) whose booking raised
        ``exc``: it carries a contributor the lane never announced."""
        what = (
            f"record {rec.meta.cursor!r} (sample_id={rec.meta.cursor.sample_id})"
            if rec
            else ("a record of the batch")
        )
        error = ContractViolation(
            f"{what} carries a contributor the lane never announced ({exc}): an operator made up "
            f"a cursor instead of deriving it with spawn_child/pack_meta; suspects: "
            f"{', '.join(sorted(self.suspects) or self.labels) or 'none'}"
        )
        error.add_context(lane=self.lane_id)
        return error

    # ----------------------------------------------------------------------------- control items
    def control(self, item: Any) -> None:
        kind = type(item)
        if kind is ChunkOpened:
            self.table.open_chunk(item.chunk_id, item.local_index, item.n_offsets, item.epoch)
            self.next_local = item.local_index + 1
            self.opened = True
            if item.skip_below:
                self.table.close_below(item.chunk_id, item.skip_below)
            if item.op_stats is not None:
                self.op_stats = item.op_stats
            if item.source_io is not None:
                self.source_io = item.source_io
        elif kind is EpochEnd:
            self._epoch_end(item)
        elif kind is OverClose:
            self.suspects.add(item.op)
        elif kind is RunStart:
            self._start_run(item)
        elif kind is Holdings:
            self._holdings(item)
        elif kind is Skipped:
            self.skips.book(item, self.lane_id)
        elif kind is Retired:  # booked as if handed over, so that a replay meets it again
            self.record(item.record, False)
        else:
            raise TypeError(f"unknown item in lane {self.lane_id}: {item!r}")

    def _epoch_end(self, marker: EpochEnd) -> None:
        epoch = marker.epoch
        chunk_ids, offsets = self.table.epoch_open_offsets(epoch, 20)
        if len(offsets):
            n_open = self.table.close_epoch(epoch)
            culprits = [op for op, deficit in marker.deficits.items() if deficit > 0]
            shown = ", ".join(f"({c}, {o})" for c, o in zip(chunk_ids.tolist(), offsets.tolist()))
            more = f" and {n_open - len(offsets)} more" if n_open > len(offsets) else ""
            self.found.append(
                (
                    "missing-tombstone",
                    tuple(culprits or self.labels),
                    epoch,
                    f"lane {self.lane_id}, epoch {epoch}: base offsets {shown}{more} were never "
                    "closed: a record was dropped without emitting its tombstones "
                    "(use tombstones_for_record)",
                )
            )
        self.book.note_evicted(self.table.evict_complete_epochs(epoch))
        self.book.epochs_done = epoch + 1
        self.carry = marker.carry
        self._check_carry(marker)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "lane %d: epoch %d done, %d chunk(s) held",
                self.lane_id,
                epoch,
                self.table.n_inflight,
            )
        self.book.window_clear()
        self.book.last_cursor = None
        self.held = None
        self._open_at_held = None
        self.screened = None
        self.book.clear_partial()

    def _holdings(self, marker: Holdings) -> None:
        """A snapshot: what is open in the epoch's chunks now is exactly what the operators hold
        (everything before it was booked), and the replay window starts afresh from it."""
        self.held = {
            "next": marker.next_local,
            "offset": marker.offset,
            "ops": marker.ops,
            "open": None,
        }
        self._open_at_held = self.table.epoch_open_offsets(marker.epoch)
        self.book.window_clear()
        self.book.last_cursor = None

    def held_state(self) -> dict[str, Any] | None:
        """The snapshot as a checkpoint stores it (its open offsets packed on first use)."""
        held = self.held
        if held is None:
            return None
        if held["open"] is None:  # booked from the lane: pack it once, now
            ids, offsets = self._open_at_held  # type: ignore[misc]
            held["open"] = pack_ints(np.stack([ids, offsets], axis=1).ravel())
            held["ops"] = packed(held["ops"], self.labels)
        return held

    def enter(self, run: Run) -> None:
        """Bookkeeping starts ``run``: at its start, or after its snapshot with the chunks before
        it entered again and everything but what the operators held closed."""
        self.restart_at(run.start, run.carry)
        self.held = run.held
        self._open_at_held = None
        self.screened = run.screened
        if run.progress is not None:
            # parts delivered before a snapshot are not replayed: the checkpoint said which
            self.book.restore_partial(run.progress.partly_delivered)
        if run.held is None:
            return
        geometry = self.layout.geometry(run.gen, run.lane)
        epoch = run.start // self.per_epoch
        nxt, read_to = run.held["next"], run.held["offset"]
        ids, offsets = [], []
        still_open = set(map(tuple, unpack_ints(run.held["open"]).reshape(-1, 2).tolist()))
        for k in range(run.start, nxt + (1 if read_to else 0)):
            position = geometry.position(k)
            n = len(self.source.chunk(position))
            self.table.open_chunk(position, k, n, epoch)
            for offset in range(read_to if k == nxt else n):
                if (position, offset) not in still_open:
                    ids.append(position)
                    offsets.append(offset)
        if ids:
            self.table.close_many(np.array(ids, dtype=np.int64), np.array(offsets, dtype=np.int64))
        self.next_local = nxt + (1 if read_to else 0)

    def _start_run(self, marker: RunStart) -> None:
        """The previous run is complete (its last epoch marker, or on the monotone path its end,
        closed every offset); the next one starts in a fresh chunk table, with what of it was
        delivered before the checkpoint booked again (not counted)."""
        self.lane_end()
        if self.table.n_inflight:
            error = ContractViolation(
                f"lane {self.lane_id} left {self.table.n_inflight} chunk(s) of run "
                f"{self.run_index} open when it started the next run: "
                f"{self.table.n_open_offsets} offset(s) were never closed"
            )
            raise error.add_context(lane=self.lane_id)
        run = self.runs[marker.index]
        found = self.found
        self.table = ChunkTable()
        self.book = DeliveryBook(self.table, self.monotone, self.counters, self.keeps_progress)
        self.found = self.book.violations
        self.found.extend(found)
        self.run_index = marker.index
        self.enter(run)
        reported = len(self.found)
        for item in marker.replayed:
            self.replayed(item)
        del self.found[reported:]  # seen (and counted or raised) before the checkpoint

    def _check_carry(self, marker: EpochEnd) -> None:
        """Each operator's carry state is JSON data, as a checkpoint stores it (else an
        ``OperatorError`` naming the operator); warn once when one grows past
        ``carry_warn_bytes``."""
        for label, state in zip(self.labels, marker.carry):
            if state is None:
                continue
            try:
                size = len(json.dumps(state))
            except (TypeError, ValueError) as exc:
                raise OperatorError(
                    f"operator {label!r} returned a carry_state() that is not JSON data at the "
                    f"end of epoch {marker.epoch}: {exc}. Checkpoints store it as JSON: return "
                    "dicts with str keys, lists, str, bool, None and Python numbers (int() or "
                    "float() of a numpy scalar, .tolist() of an array)",
                    operator=label,
                ).add_context(lane=self.lane_id) from None
            if self.carry_warn_bytes and not self.carry_warned and size > self.carry_warn_bytes:
                self.carry_warned = True
                text = (
                    f"operator {label!r} carries {size} bytes of state across epochs (lane "
                    f"{self.lane_id}), more than carry_warn_bytes={self.carry_warn_bytes}; every "
                    "checkpoint stores it. Flush what it holds at the epoch marker, or raise the "
                    "limit in Pipeline(carry_warn_bytes=...)"
                )
                log.warning(text)
                warnings.warn(text, CarryStateWarning, stacklevel=2)

    def lane_end(self) -> None:
        """The lane has no more chunks: on the monotone path everything still open is done."""
        if self.monotone:
            self.table.close_below(END_OF_LANE, 0)
            self.book.note_evicted(self.table.evict_complete_prefix())

    # ----------------------------------------------------------------------------- reports
    def take_violations(self) -> list[Violation]:
        """The contracts broken since the last call, as ``Violation``s (and forget them)."""
        found = [self._violation(raw) for raw in self.found]
        self.found.clear()
        return found

    def _violation(self, raw: tuple) -> Violation:
        kind = raw[0]
        if kind == "missing-tombstone":
            return Violation(kind, raw[1], self.lane_id, raw[2], raw[3])
        if kind == "early-close":
            rec, ref_cursor, state = raw[1], raw[2], raw[3]
            what = "an evicted chunk" if state == EVICTED else "an offset already closed"
            return Violation(
                kind,
                tuple(sorted(self.suspects) or self.labels),
                self.lane_id,
                -1,
                f"record {rec.meta.cursor!r} (sample_id={rec.meta.cursor.sample_id}) carries a "
                f"contributor for base offset {ref_cursor.base_offset} of {what}: an operator "
                "closed that offset before its last record (only the last child may set "
                "is_last_child)",
            )
        cursor, last = raw[1], raw[2]
        return Violation(
            "order",
            tuple(self.labels),
            self.lane_id,
            -1,
            f"record {cursor!r} reached delivery after {last!r}: an operator that claims "
            "preserves_cursor_order=True reorders records",
        )

    # ----------------------------------------------------------------------------- state
    @property
    def last_cursor(self) -> SampleCursor | None:
        """The replay cursor: the last real record delivered (or swallowed) from this lane."""
        return self.book.last_cursor

    def retained_start(self) -> int:
        """Lane-local index of the first retained chunk (monotone) or epoch's first chunk."""
        if self.monotone:
            return self.table.first_local_index if self.table.n_inflight else self.next_local
        return self.book.epochs_done * self.per_epoch

    def progress(self) -> EpochProgress | None:
        """What was consumed of the retained epoch by position, where a checkpoint keeps it."""
        if not self.keeps_progress:
            return None
        chunk_ids, offsets = self.table.epoch_open_offsets(self.book.epochs_done)
        partial = self.book.partial or set()
        start = self.retained_start()  # past the lane's last chunk after its last, partial epoch
        return EpochProgress.of_open(
            start, max(start, self.next_local), chunk_ids, offsets, partial, self.book.unfinished()
        )

    def window(self) -> tuple[SampleCursor | None, int, int]:
        """``(replay cursor, count, digest)`` of the retained window; no cursor when its chunk was
        evicted (nothing to replay)."""
        cursor = self.last_cursor
        if cursor is not None and self.monotone and not self.book.window_len:
            cursor = None
        count, digest = self.book.window_totals()
        return cursor, count, digest

    def restart_at(self, start: int, carry: list[Any] | None) -> None:
        """Restore: the lane restarts at lane-local chunk ``start`` with ``carry``."""
        self.next_local = start
        self.book.epochs_done = start // self.per_epoch
        self.carry = carry
