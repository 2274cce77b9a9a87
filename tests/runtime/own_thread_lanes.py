"""A lane kind written outside the package, against the ``Lane`` interface only: each lane's
runner runs on a thread of its own and hands its item lists over through a bounded queue.
``test_lane_kinds`` registers it as ``workers="own-thread"``."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from zephon.errors import ZephonError
from zephon.plan import Plan
from zephon.runtime.lanes.runner import LaneRunner
from zephon.runtime.workers.lane import STOP_TIMEOUT, Lane, LaneWorker
from zephon.runtime.workers.stopping import close_lanes, closed_error, exit_outside_operator

NAME = "own-thread"
_POLL = 0.05  # how often a blocked side looks at the other (never a synchronisation)


class _Thread:
    """The lane's worker: a thread, stopped by its flag (it cannot be forced)."""

    forcible = False

    def __init__(self, thread: threading.Thread, stop: threading.Event, lists: queue.Queue):
        self.thread, self.stop, self.lists = thread, stop, lists

    def request_stop(self) -> None:
        self.stop.set()
        while not self.lists.empty():  # a thread waiting for room gets it, then sees the flag
            self.lists.get_nowait()

    def wait(self, deadline: float) -> bool:
        self.thread.join(max(0.0, deadline - time.monotonic()))
        return not self.thread.is_alive()

    def terminate(self) -> None:
        pass

    kill = terminate


def _run(plan: Plan, lane_id: int, start: dict, lists: queue.Queue, stop: threading.Event) -> None:
    def hand_over(message: tuple[str, Any]) -> None:
        while not stop.is_set():
            try:
                return lists.put(message, timeout=_POLL)
            except queue.Full:
                continue

    items = LaneRunner(plan, lane_id, **start).run()
    try:
        for item_list in items:
            hand_over(("items", item_list))
            if stop.is_set():
                return
        hand_over(("end", None))
    except SystemExit as exc:
        hand_over(("error", exit_outside_operator(lane_id, exc)))
    except BaseException as exc:
        hand_over(("error", exc))
    finally:
        items.close()


class OwnThreadLane(Lane):
    """Lane ``lane_id`` on a thread of its own, at most ``plan.prefetch`` item lists ahead."""

    def __init__(self, plan: Plan, lane_id: int, start: dict):
        self.lane_id = lane_id
        self._lists: queue.Queue = queue.Queue(maxsize=plan.prefetch)
        self._stop = threading.Event()
        self._ended = False
        thread = threading.Thread(
            target=_run,
            args=(plan, lane_id, start, self._lists, self._stop),
            name=f"zephon-own-thread-{lane_id}",
            daemon=True,
        )
        self._thread = thread
        self._worker = _Thread(thread, self._stop, self._lists)
        self._released = False
        thread.start()

    def __next__(self) -> list:
        if self._stop.is_set():
            raise closed_error(self.lane_id)
        if self._ended:
            raise StopIteration
        while True:
            try:
                kind, value = self._lists.get(timeout=_POLL)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._lists.empty():
                    raise ZephonError(f"lane {self.lane_id}'s thread ended silently") from None
        if kind == "error":
            raise value
        if kind == "end":
            self._ended = True
            raise StopIteration
        return value

    def queued(self) -> int:
        return self._lists.qsize()

    def request_stop(self) -> None:
        self._worker.request_stop()

    def release(self) -> list[LaneWorker]:
        released, self._released = self._released, True
        return [] if released else [self._worker]

    def join(self, deadline: float) -> bool:
        return all(worker.wait(deadline) for worker in self.release())

    def close(self, timeout: float = STOP_TIMEOUT) -> None:
        close_lanes([self], timeout)


def open_own_thread_lanes(
    plan: Plan, members: list[tuple[int, dict]], shared: None
) -> list[OwnThreadLane]:
    """The opener registered for the kind: one lane, and one thread, per member."""
    return [OwnThreadLane(plan, lane_id, start) for lane_id, start in members]
