"""Inline lanes: the lane runs in the caller's thread, one step per ``next()``."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from zephon.plan import Plan
from zephon.runtime.lanes.runner import LaneRunner
from zephon.runtime.workers.lane import STOP_TIMEOUT, Lane, LaneWorker
from zephon.runtime.workers.stopping import closed_error, exit_outside_operator


class InlineLane(Lane):
    """The lane runs in the caller's thread, one step per ``next()``: simplest to debug.

    It cannot time out (``Plan.timeout`` does not apply): nothing else runs to notice a stuck
    operator, and nothing could interrupt it. Stopping it closes the runner in the caller's thread.
    """

    def __init__(self, plan: Plan, lane_id: int, **start: Any):
        self.lane_id = lane_id
        self._gen: Generator[list, None, None] = LaneRunner(plan, lane_id, **start).run()
        self._closed = False

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

    def release(self) -> list[LaneWorker]:
        """No worker: the lane stopped in ``request_stop``."""
        return []

    def join(self, deadline: float) -> bool:
        """Nothing to wait for: the lane stopped in ``request_stop``."""
        return True

    def close(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop the lane; idempotent."""
        self.request_stop()


def open_inline_lanes(plan: Plan, members: list[tuple[int, dict]], shared: None) -> list[Lane]:
    """One inline lane per member (lane id, runner start), all in the caller's thread."""
    return [InlineLane(plan, lane_id, **start) for lane_id, start in members]
