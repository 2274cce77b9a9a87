"""Opening lanes where the plan says they run (``Plan.workers``, a kind from ``registry``).

Whatever the kind, only the lane's operator chain moves; delivery and every bit of bookkeeping
stay in the loader's process, so the delivered stream is the same for every kind.
"""

from __future__ import annotations

import functools
from typing import Any

from zephon.plan import Plan
from zephon.runtime.lanes.operator_setup import in_process_setup
from zephon.runtime.workers.lane import Lane
from zephon.runtime.workers.registry import LaneKind, lane_kind

__all__ = ["open_lane", "open_lanes"]


def open_lane(plan: Plan, lane_id: int, **start: Any) -> Lane:
    """Start lane ``lane_id`` on a worker of its own (``start`` goes to ``LaneRunner``)."""
    kind = lane_kind(plan.workers)
    (lane,) = kind.opener(plan, [(lane_id, _with_setup(kind, plan, start))], kind.shared_for(plan))
    return lane


def _with_setup(kind: LaneKind, plan: Plan, start: dict[str, Any]) -> dict[str, Any]:
    """``start`` with the training process's operator setup, for a kind whose workers do not set
    up their own: made when the lane's runner starts, so a thread lane's worker thread runs it,
    never the loop's."""
    if kind.setup_in_workers or not plan.sets_up:
        return start
    return {**start, "setup": functools.partial(in_process_setup, plan, plan.workers)}


def open_lanes(plan: Plan, members: list[tuple[int, dict]], shared: Any = None) -> list[Lane]:
    """Start the lanes ``members`` (lane id, runner start) on ``plan.processes`` workers, each
    running a contiguous block of the lanes (inline lanes all run in the caller's thread). The
    lanes' streams never depend on how many workers there are. ``shared`` is what the kind's
    ``make_shared`` made for this start (made here unless given)."""
    if not members:
        return []
    kind = lane_kind(plan.workers)
    if shared is None:
        shared = kind.shared_for(plan)
    k = max(1, min(plan.processes, len(members)))
    lanes: list[Lane] = []
    size, extra = divmod(len(members), k)
    at = 0
    for w in range(k):
        n = size + (1 if w < extra else 0)
        block = [(lane_id, _with_setup(kind, plan, st)) for lane_id, st in members[at : at + n]]
        at += n
        lanes.extend(kind.opener(plan, block, shared))
    return lanes
