"""What the tests of reordering operators check instead of ``check_operator``'s "closed before its
last record" rule: on the epoch path (every reordering operator is on it) a closing record may leave
before a sibling, and only a second closing contributor for one base offset is an early close."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Sequence

from zephon.ops.base import Operator
from zephon.types import SampleRecord


def run_once(op: Operator, records: Sequence[SampleRecord]) -> list[SampleRecord]:
    """A fresh copy of ``op`` over ``records`` in one micro-batch, then its flush."""
    fresh = copy.deepcopy(op)
    fresh.start_epoch(0, 0)
    return list(fresh.process_many(list(records))) + list(fresh.flush())


def check_epoch_operator(op: Operator, records: Sequence[SampleRecord]) -> None:
    """Deterministic cursors, unique primary cursors, and every base offset the input owes closed
    exactly once by the output (records and tombstones), none that it does not owe."""
    first = run_once(op, records)
    second = run_once(op, records)
    cursors = [(r.meta.is_tombstone, r.meta.cursor) for r in first]
    assert cursors == [(r.meta.is_tombstone, r.meta.cursor) for r in second], "not deterministic"
    real = [r.meta.cursor for r in first if not r.meta.is_tombstone]
    assert len(set(real)) == len(real), "a primary cursor is emitted twice"
    owed = Counter(
        ref.base_offset for r in records for ref in r.contribution_refs() if ref.is_last_child
    )
    closed = Counter(
        ref.base_offset for r in first for ref in r.contribution_refs() if ref.is_last_child
    )
    assert closed == owed, f"closing contributors in {dict(closed)}, owed {dict(owed)}"
