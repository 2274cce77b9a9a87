"""The final batcher: groups a lane's records into batches at delivery, after the replay filter.

Records wait in the lane's pending batch together with the tombstones and control items that
arrive after them; all of it is booked only when the batch is handed to the training loop, so a
checkpoint never counts records that sit in an undelivered batch. After a hand-over the batcher is
empty, which is why replaying to the replay cursor and batching afresh gives the same batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zephon._core.handover import PendingBatch
from zephon._core.records import JoinedRuns, RecordRun, expand_runs
from zephon.errors import OperatorError
from zephon.ops.base import Grouper
from zephon.runtime.lanes.control import LaneEnd, RunStart, Skipped
from zephon.types import SampleRecord

# Control items the delivery loop must see itself even while a batch is pending (a skipped
# record is admitted, against the limit, as it arrives).
LEAVE_TO_CALLER = (LaneEnd, RunStart, Skipped)


class FinalBatcher(PendingBatch):
    """The pending batch of one lane for a ``Grouper`` (the pipeline's last operator)."""

    def __init__(self, grouper: Grouper):
        self.grouper = grouper
        self.collate = grouper.collate
        self.batch_size = grouper.batch_size
        self.drop_remainder = grouper.drop_remainder
        self.pending: list[Any] = []  # records, and what arrived after the first of them
        self.n_pending = 0  # real records in ``pending``

    @property
    def full(self) -> bool:
        return self.n_pending == self.batch_size

    def add(self, record: SampleRecord) -> None:
        self.pending.append(record)
        self.n_pending += 1

    def hold(self, item: Any) -> None:
        """A tombstone or control item that arrived after a pending record waits with it."""
        self.pending.append(item)

    def take(self) -> tuple[list[Any], Sequence[SampleRecord]]:
        """Empty the pending batch: everything in it (to book) and its real records, as the runs
        they came in when every one of them did (no record is built), else as a list."""
        items, self.pending = self.pending, []
        n, self.n_pending = self.n_pending, 0
        runs = [item for item in items if type(item) is RecordRun]
        if runs and sum(map(len, runs)) == n:
            return items, runs[0] if len(runs) == 1 else JoinedRuns(runs)
        records: list[Any] = expand_runs(items)
        if records is not items or len(items) != n:
            records = [r for r in records if type(r) is SampleRecord and not r.meta.is_tombstone]
        return items, records

    def hand_over(self) -> tuple[list[Any], Sequence[SampleRecord], Any]:
        """Empty the pending batch: everything in it (to book), its real records (as ``take()``
        gives them) and their payload; a failure to collate is an ``OperatorError`` naming the
        first record."""
        items, records = self.take()
        try:
            return items, records, self.collate(records)
        except Exception as exc:
            raise self.collate_failed(records, exc) from exc

    def collate_failed(self, records: Sequence[SampleRecord], exc: Exception) -> OperatorError:
        """The error for a collate of ``records`` that raised ``exc``, naming the first record."""
        grouper: Any = self.grouper
        first = records[0].meta.cursor
        name = getattr(grouper, "name", type(grouper).__name__)
        return OperatorError(
            f"operator {name!r} failed to collate {len(records)} records starting at "
            f"{first!r} (sample_id={first.sample_id}): {type(exc).__name__}: {exc}",
            operator=name,
            cursor=first,
        )
