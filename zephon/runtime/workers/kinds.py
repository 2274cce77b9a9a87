"""Where a lane runs: in the caller's thread, a worker thread, or a worker process.

Each kind is an iterator over the lane runner's item lists. Only the lane's operator chain moves;
delivery and every bit of bookkeeping stay in the loader's process, so the delivered stream is the
same for all three kinds.

The inline lane is here; thread lanes are in ``thread_lanes``, process lanes in
``process_lanes`` (the worker's side in ``worker_process``), and how every kind stops in
``stopping``.
"""

from __future__ import annotations

import functools
from collections.abc import Generator
from typing import Any

from zephon.plan import Plan
from zephon.runtime.lanes.operator_setup import in_process_setup
from zephon.runtime.lanes.runner import LaneRunner
from zephon.runtime.workers.pickled_plan import PlanParcel
from zephon.runtime.workers.processes import ProcessLane
from zephon.runtime.workers.stopping import (
    STOP_TIMEOUT,
    LaneWorker,
    closed_error,
    exit_outside_operator,
)
from zephon.runtime.workers.threads import ThreadLane

__all__ = ["LANE_KINDS", "InlineLane", "open_lane", "open_lanes"]


class InlineLane:
    """The lane runs in the caller's thread, one step per ``next()``: simplest to debug.

    It cannot time out (``Plan.timeout`` does not apply): nothing else runs to notice a stuck
    operator, and nothing could interrupt it. Stopping it closes the runner in the caller's thread.
    """

    def __init__(self, plan: Plan, lane_id: int, **start: Any):
        self.lane_id = lane_id
        self._gen: Generator[list, None, None] = LaneRunner(plan, lane_id, **start).run()
        self._closed = False

    def __iter__(self) -> InlineLane:
        return self

    def __next__(self) -> list:
        if self._closed:
            raise closed_error(self.lane_id)
        try:
            return next(self._gen)
        except SystemExit as exc:
            raise exit_outside_operator(self.lane_id, exc) from exc

    def queued(self) -> int:
        """Item lists ready ahead of ``next()``: none, nothing runs ahead of an inline lane."""
        return 0

    def request_stop(self) -> None:
        """Close the runner (and its operator thread pools) now; there is no worker to wait for."""
        self._closed = True
        self._gen.close()

    def join(self, deadline: float) -> bool:
        """Nothing to wait for: the lane stopped in ``request_stop``."""
        return True

    def _release(self) -> list[LaneWorker]:
        return []

    def close(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop the lane; idempotent."""
        self.request_stop()


LANE_KINDS: dict[str, type[InlineLane | ThreadLane | ProcessLane]] = {
    "inline": InlineLane,
    "thread": ThreadLane,
    "process": ProcessLane,
}


def open_lane(plan: Plan, lane_id: int, **start: Any) -> InlineLane | ThreadLane | ProcessLane:
    """Start lane ``lane_id`` where the plan says lanes run (``start`` goes to ``LaneRunner``)."""
    return LANE_KINDS[plan.workers](plan, lane_id, **_with_setup(plan, start))


def _with_setup(plan: Plan, start: dict[str, Any]) -> dict[str, Any]:
    """``start`` with the training process's operator setup, for an inline or thread lane: made
    when the lane's runner starts, so a thread lane's worker thread runs it, never the loop's."""
    if plan.workers == "process" or not plan.sets_up:
        return start
    return {**start, "setup": functools.partial(in_process_setup, plan, plan.workers)}


def open_lanes(
    plan: Plan, members: list[tuple[int, dict]], parcel: PlanParcel | None = None
) -> list[Any]:
    """Start the lanes ``members`` (lane id, runner start) on ``plan.processes`` workers: worker
    processes (``workers="process"``) or threads (``"thread"``), each running a contiguous block
    of the lanes; inline lanes run in the caller's thread. The lanes' streams never depend on
    how many workers there are. Worker processes share one pickle of the plan (``parcel``, made
    here unless given)."""
    if plan.workers == "inline" or not members:
        return [open_lane(plan, lane_id, **start) for lane_id, start in members]
    k = max(1, min(plan.processes, len(members)))
    if plan.workers == "process" and parcel is None:
        parcel = PlanParcel(plan)
    lanes: list[Any] = []
    size, extra = divmod(len(members), k)
    at = 0
    for w in range(k):
        n = size + (1 if w < extra else 0)
        block = members[at : at + n]
        at += n
        if parcel is not None:
            lanes.extend(ProcessLane.group(plan, block, parcel))
        elif n > 1:
            lanes.extend(ThreadLane.group(plan, [(i, _with_setup(plan, st)) for i, st in block]))
        else:
            lanes.append(open_lane(plan, block[0][0], **block[0][1]))
    return lanes
