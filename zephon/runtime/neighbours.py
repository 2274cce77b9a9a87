"""The process lanes of one start, seen together: what they send while the loader waits for
another, and the CPUs a finished worker leaves to the others."""

from __future__ import annotations

import weakref
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from zephon.runtime.thread_budget import WIDENED, worker_environment
from zephon.runtime.wire import THREADS

if TYPE_CHECKING:
    from zephon.runtime.process_lanes import ProcessLane


class Neighbours:
    """The process lanes started with one parcel, for one loader, on at most ``processes`` worker
    processes. While ``next()`` waits for one of them, the others' finished item lists are taken
    off their pipes: a worker ahead of the delivery order would otherwise stall on a full pipe (a
    socket buffer holds about 200 KB, an item list of a text pipeline often more) until the
    loader comes round to its lane. A worker that has sent the end of all its lanes leaves its
    CPUs to those still producing (``lane_ended``)."""

    def __init__(self, processes: int, environment: dict[str, str]) -> None:
        self._lanes: list[weakref.ref[ProcessLane]] = []
        self._producing = processes
        self._widened = {name: environment[name] for name in WIDENED}  # what the workers have

    def add(self, lane: ProcessLane) -> None:
        self._lanes.append(weakref.ref(lane))

    def arriving(self, waiting: ProcessLane) -> dict[Connection, ProcessLane]:
        """The other lanes that may still send, by the loader's end of their pipes."""
        lanes = (ref() for ref in list(self._lanes))
        return {
            lane._conn: lane
            for lane in lanes
            if lane is not None and lane is not waiting and lane._may_send()
        }

    def lane_ended(self, lane: ProcessLane) -> None:
        """``lane`` sent its end. When that was its worker's last lane, the workers still
        producing share the CPUs anew (``worker_environment``), in the ``WIDENED`` variables
        the user did not set; a tokenizer with one thread so far starts its pool at the next
        call."""
        shared = lane._worker.shared
        shared.producing -= 1
        if shared.producing:
            return
        self._producing -= 1
        if self._producing < 1:
            return
        wider = worker_environment(self._producing)
        widened = {name: wider[name] for name in WIDENED}
        if widened == self._widened:
            return
        self._widened = widened
        for other in (ref() for ref in list(self._lanes)):
            if other is not None and other._may_send():
                other.tell((THREADS, widened))
