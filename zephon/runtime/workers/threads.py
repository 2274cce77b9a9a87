"""Lanes that run in a worker thread: one lane per thread, or several lanes sharing one.

The thread hands the lane runner's item lists over through a bounded queue; a thread cannot be
interrupted, so one busy inside an operator stops at its next hand-over.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from zephon.errors import ZephonError
from zephon.plan import Plan
from zephon.runtime.lanes.operator_setup import used
from zephon.runtime.lanes.runner import LaneRunner
from zephon.runtime.workers.inflight_bytes import has_room, item_list_bytes
from zephon.runtime.workers.pipe_messages import END
from zephon.runtime.workers.stopping import (
    WORKER_NAME,
    WorkerLane,
    closed_error,
    exit_outside_operator,
    timed_out,
)
from zephon.sources.storage_waits import longest_wait

_POLL_SECONDS = 0.2  # how often the two sides of a thread lane check the other is still there


class _ThreadChannel:
    """What a thread lane and its worker thread share: the bounded queue, the payload bytes
    queued in it (``Plan.max_inflight_bytes``) and the stop flag."""

    def __init__(
        self, maxsize: int, room: threading.Event | None = None, max_bytes: int | None = None
    ):
        self.queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self.stop = threading.Event()
        self.done = threading.Event()  # the worker thread has left this lane
        self.room = room  # set by the lane when it takes an item list (shared worker threads)
        self.max_bytes = max_bytes
        self.queued_bytes = 0
        self._bytes_changed = threading.Condition()
        #: Set while the worker thread waits because of the byte bound, cleared when the lane
        #: takes a list: once set, what the lane has queued is all it will queue.
        self.held = threading.Event()

    def size_of(self, items: list) -> int:
        """What ``items`` count against the byte bound (nothing is measured without one)."""
        return 0 if self.max_bytes is None else item_list_bytes(items)

    def has_room(self) -> bool:
        """Whether one more item list may be queued now (by count and by bytes)."""
        if self.queue.full():
            return False
        with self._bytes_changed:
            if has_room(self.queued_bytes, self.max_bytes):
                return True
            self.held.set()
            return False

    def put(self, message: tuple, nbytes: int = 0) -> bool:
        """Hand ``message`` (of ``nbytes`` payload bytes) over unless the lane is stopped first;
        whether it was handed over. A list with payload bytes waits while the lane holds its
        byte bound."""
        with self._bytes_changed:
            while nbytes and not has_room(self.queued_bytes, self.max_bytes):
                self.held.set()
                if self.stop.is_set():
                    return False
                self._bytes_changed.wait(_POLL_SECONDS)
            self.queued_bytes += nbytes
        while not self.stop.is_set():
            try:
                self.queue.put((*message, nbytes), timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def put_nowait(self, message: tuple, nbytes: int) -> None:
        """Queue ``message`` now: the caller saw ``has_room`` and is the only one putting."""
        with self._bytes_changed:
            self.queued_bytes += nbytes
        self.queue.put_nowait((*message, nbytes))

    def took(self, nbytes: int) -> None:
        """The lane took a list of ``nbytes`` payload bytes off the queue."""
        if nbytes:
            with self._bytes_changed:
                self.queued_bytes -= nbytes
                self.held.clear()
                self._bytes_changed.notify_all()

    def drain(self) -> None:
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        with self._bytes_changed:
            self.queued_bytes = 0
            self._bytes_changed.notify_all()


def _thread_main(channel: _ThreadChannel, plan: Plan, lane_id: int, start: dict) -> None:
    """A worker thread's life; it holds the channel, never the lane, so the lane can be freed.
    The lane's end or error is handed over once the thread has left the lane's operators, so
    their teardown never runs under it (``OperatorSetup.used``)."""
    try:
        runner = LaneRunner(plan, lane_id, **start)
        with used(runner.setup), contextlib.closing(runner.run()) as lane_items:
            for items in lane_items:
                if not channel.put(("items", items), channel.size_of(items)):
                    return
        channel.put((END, None))
    except SystemExit as exc:
        channel.put(("error", exit_outside_operator(lane_id, exc)))
    except BaseException as exc:  # delivered to the caller, who re-raises it
        channel.put(("error", exc))


class _GroupMember:
    """One lane of a shared worker thread: its channel, its runner's items, and its hold on the
    operators' setup, left when the lane ends, before its end or error is handed over."""

    def __init__(self, channel: _ThreadChannel, lane_id: int, runner: LaneRunner):
        self.channel, self.lane_id = channel, lane_id
        self.lane_items = runner.run()
        self._using = used(runner.setup)
        self._using.__enter__()

    def leave(self) -> None:
        self.lane_items.close()
        self._using.__exit__(None, None, None)


def _thread_group_main(
    members: list[tuple[_ThreadChannel, Plan, int, dict]], room: threading.Event
) -> None:
    """One worker thread for several lanes: it advances whichever lane has room in its queue,
    in lane order, and waits when none has. Each lane's items are what its own runner makes, so
    sharing a thread changes when they are made, never what they are."""
    active: list[_GroupMember] = []
    try:
        for channel, plan, lane_id, start in members:
            active.append(_GroupMember(channel, lane_id, LaneRunner(plan, lane_id, **start)))
        while active:
            progressed = False
            for member in list(active):
                channel = member.channel
                if channel.stop.is_set() or channel.has_room():
                    progressed = True
                    last = _advance(channel, member.lane_id, member.lane_items)
                    if last is not None:
                        active.remove(member)
                        member.leave()
                        if last:
                            channel.put(last)
                        channel.done.set()
            if not progressed:
                room.wait(_POLL_SECONDS)
                room.clear()
    except BaseException as exc:  # a lane's setup failed: every lane of the thread says so
        for member in active:
            member.leave()
        active = []
        for channel, _, _, _ in members:
            channel.put(("error", exc))
    finally:
        for member in active:
            member.leave()
        for channel, _, _, _ in members:
            channel.done.set()


def _advance(channel: _ThreadChannel, lane_id: int, lane_items: Iterator[list]) -> tuple | None:
    """Hand over the lane's next item list (there is room): None while the lane goes on; once
    it is done, the message that ends it (its end or its error), or ``()`` when it was
    stopped."""
    if channel.stop.is_set():
        return ()
    try:
        items = next(lane_items)
    except StopIteration:
        return (END, None)
    except SystemExit as exc:
        return ("error", exit_outside_operator(lane_id, exc))
    except BaseException as exc:  # delivered to the caller, who re-raises it
        return ("error", exc)
    channel.put_nowait(("items", items), channel.size_of(items))
    return None


class _ThreadWorker:
    """Stops a worker thread. A thread cannot be interrupted: one busy inside an operator stops
    at its next hand-over, after the operator returns; until then it is left running."""

    forcible = False

    def __init__(self, thread: threading.Thread, channel: _ThreadChannel):
        self.thread = thread
        self.channel = channel
        self.owner_pid = os.getpid()

    def request_stop(self) -> None:
        if os.getpid() != self.owner_pid:  # a fork()ed child: the thread is not in this process
            return
        self.channel.stop.set()
        self.channel.drain()  # a worker waiting for room in the queue gets it, then sees the flag
        if self.channel.room is not None:
            self.channel.room.set()

    def wait(self, deadline: float) -> bool:
        if os.getpid() != self.owner_pid:
            return True
        if self.channel.room is not None:  # a thread shared with other lanes: this lane only
            return self.channel.done.wait(max(0.0, deadline - time.monotonic()))
        self.thread.join(max(0.0, deadline - time.monotonic()))
        return not self.thread.is_alive()

    def terminate(self) -> None:
        """Nothing more to do: a thread cannot be forced (``forcible`` is False, so the joiner
        never escalates); it stops at its next hand-over, once ``request_stop`` set its flag."""

    kill = terminate


class ThreadLane(WorkerLane):
    """The lane runs in a worker thread and hands over item lists through a bounded queue.

    Like every kind of lane, an iterator that ends when the lane runner is exhausted.
    """

    def __init__(self, plan: Plan, lane_id: int, **start: Any):
        channel = _ThreadChannel(plan.prefetch, max_bytes=plan.max_inflight_bytes)
        thread = threading.Thread(
            target=_thread_main,
            args=(channel, plan, lane_id, start),
            name=f"{WORKER_NAME}{lane_id}",
            daemon=True,
        )
        self._attach(plan, lane_id, thread, channel)
        thread.start()

    @classmethod
    def group(cls, plan: Plan, members: list[tuple[int, dict]]) -> list[ThreadLane]:
        """Several lanes on one worker thread (which advances whichever has room)."""
        room = threading.Event()
        channels = [_ThreadChannel(plan.prefetch, room, plan.max_inflight_bytes) for _ in members]
        thread = threading.Thread(
            target=_thread_group_main,
            args=(
                [(ch, plan, lane_id, start) for ch, (lane_id, start) in zip(channels, members)],
                room,
            ),
            name=f"{WORKER_NAME}{members[0][0]}",
            daemon=True,
        )
        lanes = []
        for channel, (lane_id, _) in zip(channels, members):
            lane = cls.__new__(cls)
            lane._attach(plan, lane_id, thread, channel)
            lanes.append(lane)
        thread.start()
        return lanes

    def _attach(
        self, plan: Plan, lane_id: int, thread: threading.Thread, channel: _ThreadChannel
    ) -> None:
        self.lane_id = lane_id
        self.timeout = plan.timeout
        self._channel = channel
        self._thread = thread
        self._ended = False
        self._watch(_ThreadWorker(thread, channel))

    def __iter__(self) -> ThreadLane:
        return self

    def queued(self) -> int:
        """Item lists the worker thread finished that ``next()`` has not taken yet."""
        return self._channel.queue.qsize()

    def queued_bytes(self) -> int:
        """The payload bytes of those lists (counted only under ``max_inflight_bytes``)."""
        return self._channel.queued_bytes

    def held_by_bytes(self) -> bool:
        """Whether the worker thread waits because of ``max_inflight_bytes`` since the lane last
        took a list (so the lists queued now are all it queues until the next is taken)."""
        return self._channel.held.is_set()

    def __next__(self) -> list:
        if self._closed:
            raise closed_error(self.lane_id)
        if self._ended:
            raise StopIteration
        end = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            wait = _POLL_SECONDS if end is None else min(_POLL_SECONDS, end - time.monotonic())
            try:
                kind, value, nbytes = self._channel.queue.get(timeout=max(0.0, wait))
                self._channel.took(nbytes)
                if self._channel.room is not None:
                    self._channel.room.set()
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._channel.queue.empty():
                    raise ZephonError(
                        f"the worker thread of lane {self.lane_id} ended without handing over "
                        "its lane's end or an error"
                    ) from None
                if end is not None and time.monotonic() >= end:
                    assert self.timeout is not None
                    where = f"thread {self._thread.name}"
                    storage = longest_wait(self._thread.ident)
                    raise timed_out(self.lane_id, where, self.timeout, storage) from None
        if kind == "error":
            raise value
        if kind == END:
            self._ended = True
            raise StopIteration
        return value


def open_thread_lanes(
    plan: Plan, members: list[tuple[int, dict]], shared: None
) -> list[ThreadLane]:
    """The lanes ``members`` (lane id, runner start) on one worker thread: a thread of its own
    for a single lane, one shared thread for several (``ThreadLane.group``)."""
    if len(members) == 1:
        lane_id, start = members[0]
        return [ThreadLane(plan, lane_id, **start)]
    return ThreadLane.group(plan, members)
