"""Tools for operator authors: ``check_operator`` finds the bookkeeping mistakes that lose data."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence

from zephon.ops.base import Operator
from zephon.types import SampleRecord

__all__ = ["check_operator"]


def _run(op: Operator, records: Sequence[SampleRecord], lane_id: int) -> list[SampleRecord]:
    fresh = copy.deepcopy(op)
    fresh.start_epoch(lane_id, 0)
    out = list(fresh.process_many(list(records))) + list(fresh.flush())
    for item in out:
        if not isinstance(item, SampleRecord):
            raise AssertionError(f"{op.name} returned {item!r}, which is not a SampleRecord")
    return out


def check_operator(op: Operator, records: Sequence[SampleRecord], *, lane_id: int = 0) -> None:
    """Run ``op`` (with flush) twice on ``records`` and raise ``AssertionError`` explaining the
    first broken rule: non-deterministic cursors, a primary cursor that is not unique in the
    lane, a base offset never closed (a dropped record without its tombstone), a base offset
    closed before its last record, or output out of order despite ``preserves_cursor_order``."""
    if any(r.meta.is_tombstone for r in records):
        raise ValueError("check_operator takes real records; operators never receive tombstones")
    first = _run(op, records, lane_id)
    second = _run(op, records, lane_id)
    name = op.name

    def cursors(out: list[SampleRecord]) -> list[tuple[bool, object]]:
        return [(r.meta.is_tombstone, r.meta.cursor) for r in out]

    if cursors(first) != cursors(second):
        diff = (
            next(i for i, (a, b) in enumerate(zip(cursors(first), cursors(second))) if a != b)
            if len(first) == len(second)
            else min(len(first), len(second))
        )
        raise AssertionError(
            f"{name}: cursors are not deterministic: two runs on the same records differ at "
            f"output {diff} ({len(first)} vs {len(second)} outputs). Derive randomness from "
            "(seed, lane, epoch) and child indices from emission order."
        )

    real = [r for r in first if not r.meta.is_tombstone]
    seen: set[object] = set()
    for rec in real:
        if rec.meta.cursor in seen:
            raise AssertionError(
                f"{name}: primary cursor {rec.meta.cursor!r} is emitted twice; every record of a "
                "lane needs its own cursor (use spawn_child, or cursor.child(start) when packing)"
            )
        seen.add(rec.meta.cursor)

    # An order-preserving operator must emit an offset's closing record last. A reordering one
    # may emit siblings after it (delivery waits for the epoch marker), but never close twice.
    ordered = op.traits.preserves_cursor_order
    closed: dict[tuple[int, int], int] = {}
    for i, rec in enumerate(first):
        for ref in rec.meta.contribution_refs():
            base = ref.base_offset
            if base in closed and not rec.meta.is_tombstone and (ordered or ref.is_last_child):
                raise AssertionError(
                    f"{name}: base offset {base} is closed by output {closed[base]} but output "
                    f"{i} ({rec.meta.cursor!r}) still carries it: only the last record of an "
                    "offset may set is_last_child"
                )
            if ref.is_last_child:
                closed.setdefault(base, i)

    owed = {
        ref.base_offset for r in records for ref in r.meta.contribution_refs() if ref.is_last_child
    }
    missing = sorted(owed - set(closed))
    if missing:
        raise AssertionError(
            f"{name}: base offset(s) {missing[:10]} are never closed: a dropped record needs its "
            "tombstones (zephon.ops.children.tombstones_for_record)"
        )

    if op.traits.preserves_cursor_order:
        for prev, rec in itertools.pairwise(real):
            if rec.meta.cursor < prev.meta.cursor:
                raise AssertionError(
                    f"{name}: claims preserves_cursor_order=True but emits {rec.meta.cursor!r} "
                    f"after {prev.meta.cursor!r}; declare preserves_cursor_order=False"
                )
