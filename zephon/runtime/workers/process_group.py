"""The process lanes of one start, seen together: what they send while the loader waits for
another, and the CPUs a finished worker leaves to the others."""

from __future__ import annotations

import weakref
from multiprocessing.connection import Connection
from typing import Any, Protocol

from zephon.runtime.workers.pipe_messages import THREADS
from zephon.runtime.workers.thread_budget import WIDENED, worker_environment


class GroupMember(Protocol):
    """What the group needs of a process lane (``GroupMember``)."""

    @property
    def connection(self) -> Connection: ...

    def may_send(self) -> bool: ...

    def leave_worker(self) -> bool: ...

    def receive_arrived(self) -> None: ...

    def tell(self, message: tuple[str, Any]) -> None: ...


class ProcessGroup:
    """The process lanes started with one parcel, for one loader, on at most ``processes`` worker
    processes. While ``next()`` waits for one of them, the others' finished item lists are taken
    off their pipes: a worker ahead of the delivery order would otherwise stall on a full pipe (a
    socket buffer holds about 200 KB, an item list of a text pipeline often more) until the
    loader comes round to its lane. A worker that has sent the end of all its lanes leaves its
    CPUs to those still producing (``lane_ended``)."""

    def __init__(self, processes: int, environment: dict[str, str]) -> None:
        self._lanes: list[weakref.ref[GroupMember]] = []
        self._producing = processes
        self._widened = {name: environment[name] for name in WIDENED}  # what the workers have

    def add(self, lane: GroupMember) -> None:
        self._lanes.append(weakref.ref(lane))

    def arriving(self, waiting: GroupMember) -> dict[Connection, GroupMember]:
        """The other lanes that may still send, by the loader's end of their pipes."""
        lanes = (ref() for ref in list(self._lanes))
        return {
            lane.connection: lane
            for lane in lanes
            if lane is not None and lane is not waiting and lane.may_send()
        }

    def lane_ended(self, lane: GroupMember) -> None:
        """``lane`` sent its end. When that was its worker's last lane, the workers still
        producing share the CPUs anew (``worker_environment``), in the ``WIDENED`` variables
        the user did not set; a tokenizer with one thread so far starts its pool at the next
        call."""
        if not lane.leave_worker():
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
            if other is not None and other.may_send():
                other.tell((THREADS, widened))
