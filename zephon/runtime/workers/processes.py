"""Lanes that run in a worker process, the loader's side: starting the process, receiving its
item lists (and its neighbours' while waiting), acknowledging them, and reporting a worker that
died, stalled or timed out."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import multiprocessing as mp
import os
import signal
import socket
import time
import weakref
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_any
from typing import Any

from zephon.errors import PlanError, ZephonError
from zephon.plan import Plan
from zephon.runtime.lanes.control import LaneEnd
from zephon.runtime.workers.fork_server import worker_context
from zephon.runtime.workers.main_script import main_script_left_out
from zephon.runtime.workers.pickled_plan import PlanParcel, unguarded_main
from zephon.runtime.workers.pipe_messages import (
    ACK,
    END,
    HELD,
    READY,
    RELEASED,
    RING,
    STORAGE,
    WARNINGS,
    MessageStalled,
    receive,
)
from zephon.runtime.workers.process_group import ProcessGroup
from zephon.runtime.workers.process_main import EXIT_MAIN_REIMPORTED, process_main
from zephon.runtime.workers.shared_ring import RingReader
from zephon.runtime.workers.stopping import (
    WORKER_NAME,
    WorkerLane,
    closed_error,
    timed_out,
)
from zephon.runtime.workers.worker_warnings import reraise
from zephon.sources.storage_waits import StorageWait

_EXIT_STATUS_WAIT = 1.0  # a dead worker's exit status follows the end of its pipe closely

#: The loader's send buffer on the pipe a worker reads its plan from: large enough that the
#: pickled plan (a tokenizer's vocabulary makes it hundreds of kB) is queued at once, so that
#: starting a worker never waits for the worker to read it (the kernel caps it: ``wmem_max``).
PLAN_SEND_BUFFER = 8 << 20


# Worker processes started by this process, forgotten by multiprocessing in a fork()ed child.
_started_here: weakref.WeakSet = weakref.WeakSet()


def _forget_workers_in_forked_child() -> None:
    # multiprocessing's exit handler terminates and joins every process in its set of children;
    # a fork()ed child inherits that set, and would terminate its parent's workers as it exits.
    children = getattr(mp.process, "_children", None)
    if children is not None:
        for proc in list(_started_here):
            children.discard(proc)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers_in_forked_child)


class _SharedProcess:
    """A worker process and how many of its lanes are still open: it is waited for, and forced
    out, only once the last of them stops."""

    def __init__(self, n_lanes: int):
        self.open = n_lanes
        self.producing = n_lanes  # lanes that have not sent their end yet
        self.exitcode: int | None = None  # once reaped (and closed)


class _ProcessWorker:
    """Stops a worker process: closing the loader's end of the pipe makes the worker's next send
    or receive fail (a send blocked on a full pipe at once), and the worker exits. A process that
    runs several lanes exits when the last of them is stopped."""

    forcible = True

    def __init__(self, proc: Any, conn: Connection, shared: _SharedProcess | None = None):
        self.proc = proc
        self.conn = conn
        self.shared = shared or _SharedProcess(1)
        self.owner_pid = os.getpid()
        self.exitcode: int | None = None
        self._stopped = False

    def request_stop(self) -> None:
        if os.getpid() != self.owner_pid:  # a fork()ed child: the worker is its parent's
            return
        self.conn.close()
        if not self._stopped:
            self._stopped = True
            self.shared.open -= 1

    def wait(self, deadline: float) -> bool:
        if os.getpid() != self.owner_pid:
            return True
        if self.shared.open > 0:  # its other lanes keep the process; this lane's thread ends
            return True
        shared = self.shared
        if shared.exitcode is None:
            self.proc.join(max(0.0, deadline - time.monotonic()))
            if self.proc.exitcode is None:
                return False
            shared.exitcode = self.proc.exitcode
            self.proc.close()  # its sentinel's descriptor now, not at collection
        self.exitcode = shared.exitcode
        return True

    def terminate(self) -> None:
        if self._may_force():
            self.proc.terminate()

    def kill(self) -> None:
        if self._may_force():
            self.proc.kill()

    def _may_force(self) -> bool:
        shared = self.shared
        return shared.exitcode is None and shared.open <= 0 and os.getpid() == self.owner_pid


def _how_it_ended(code: int | None) -> str:
    if code is None:
        return "closed its end of the pipe without exiting"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = {
            "SIGKILL": " (often the kernel's out-of-memory killer: see `dmesg`)",
            "SIGSEGV": " (a crash in native code: an extension module or a C library)",
            "SIGBUS": " (a crash in native code: an extension module or a C library)",
            "SIGABRT": " (an abort in native code: an extension module or a C library)",
        }.get(name, "")
        return f"was killed by {name}{why}"
    return f"exited with exit code {code} (os._exit() or a C exit() in an operator or a library)"


def _start_process(
    plan: Plan, members: list[tuple[int, dict]], parcel: PlanParcel
) -> tuple[Any, list[Connection]]:
    """Start one worker process for the lanes ``members`` (lane id, runner start); the process
    and the loader's end of each lane's pipe.

    The plan goes to the worker on its first lane's pipe once it runs (``ship_plan``), not with
    its start: a start that carries more than a pipe holds waits until the worker has booted and
    read it, and the next worker would only start then."""
    ctx = worker_context(parcel.preload)
    pipes = [ctx.Pipe(duplex=True) for _ in members]
    proc = ctx.Process(
        target=process_main,
        args=(
            [(child, lane_id, start) for (_, child), (lane_id, start) in zip(pipes, members)],
            (plan.prefetch, plan.max_inflight_bytes),
            os.getpid(),
            parcel.environment,
        ),
        name=f"{WORKER_NAME}{members[0][0]}",
        daemon=True,
    )
    try:
        with main_script_left_out(not parcel.needs_main):
            proc.start()
    except BaseException:
        for parent, _ in pipes:
            parent.close()
        raise
    finally:
        for _, child in pipes:
            child.close()
    _started_here.add(proc)
    parents = [parent for parent, _ in pipes]
    ship_plan(parents[0], parcel.plan_bytes)
    return proc, parents


def ship_plan(conn: Connection, plan_bytes: bytes) -> None:
    """Send a started worker its pickled plan, queued in the pipe's send buffer (widened to
    ``PLAN_SEND_BUFFER`` where the pipe is a socket) so that this does not wait for the worker
    to read it. A worker that is already gone is left for the lane's ``next()`` to report."""
    _widen_send_buffer(conn)
    with contextlib.suppress(OSError):
        conn.send_bytes(plan_bytes)


def _widen_send_buffer(conn: Connection) -> None:
    """Raise the send buffer of ``conn``'s socket to ``PLAN_SEND_BUFFER`` (a pipe that is no
    socket, as on Windows, is left as it is)."""
    try:
        fd = os.dup(conn.fileno())
    except (OSError, ValueError):
        return
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        os.close(fd)
        return
    with sock, contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, PLAN_SEND_BUFFER)


class ProcessLane(WorkerLane):
    """The lane runs in a worker process; at most ``prefetch`` item lists are in flight.

    The worker dies with the lane: on ``close()``, on an error, when the lane is collected, and
    when the loader's process is killed (the kernel's parent-death signal, and a watchdog). A
    worker that dies is reported by ``next()`` at once, with its exit code or signal. The plan's
    ``timeout`` applies to every ``next()``, the first one (the worker's start-up) included.
    """

    _worker: _ProcessWorker

    def __init__(self, plan: Plan, lane_id: int, *, parcel: PlanParcel | None = None, **start: Any):
        parcel = parcel or PlanParcel(plan)
        proc, (conn,) = _start_process(plan, [(lane_id, start)], parcel)
        self._attach(plan, lane_id, proc, conn, _SharedProcess(1), parcel.group)

    @classmethod
    def group(
        cls, plan: Plan, members: list[tuple[int, dict]], parcel: PlanParcel | None = None
    ) -> list[ProcessLane]:
        """Several lanes in one worker process (each on a thread of its own there)."""
        parcel = parcel or PlanParcel(plan)
        proc, conns = _start_process(plan, members, parcel)
        shared = _SharedProcess(len(members))
        lanes = []
        for (lane_id, _), conn in zip(members, conns):
            lane = cls.__new__(cls)
            lane._attach(plan, lane_id, proc, conn, shared, parcel.group)
            lanes.append(lane)
        return lanes

    def _attach(
        self,
        plan: Plan,
        lane_id: int,
        proc: Any,
        conn: Connection,
        shared: _SharedProcess,
        group: ProcessGroup,
    ) -> None:
        self.lane_id = lane_id
        self.timeout = plan.timeout
        self._conn = conn
        self.pid: int = proc.pid
        self._sentinel = proc.sentinel
        self._proc = proc
        self._ready = False  # the worker said it runs: a death before that is a failed start
        # Messages received ahead of next() (see queued()): kind, value and body bytes.
        self._waiting: collections.deque[tuple[str, Any, int]] = collections.deque()
        self._acks = 0  # item lists taken (and acknowledged)
        self._held_at = -1  # how many acknowledgements the worker had when it last waited on bytes
        self._stalled: ZephonError | None = None
        # What the worker said it waits on (its storage watch, in process_main), and since when.
        self._storage: tuple[StorageWait, float] | None = None
        self._ended = False
        self._gone = False  # the pipe ended while receiving ahead: next() reports why
        self._finished = False  # the lane's last list (or its end) came: nothing more is made
        self._ring: RingReader | None = None  # the worker's shared ring, once it announced one
        self._group = group
        group.add(self)
        self._watch(_ProcessWorker(proc, conn, shared))

    @property
    def connection(self) -> Connection:
        """The loader's end of the lane's pipe."""
        return self._conn

    def leave_worker(self) -> bool:
        """This lane sent its end: True when it was the last producing lane of its worker."""
        shared = self._worker.shared
        shared.producing -= 1
        return not shared.producing

    @property
    def exitcode(self) -> int | None:
        """The worker's exit code once stopped and reaped (negative: killed by that signal)."""
        return self._worker.exitcode

    def __iter__(self) -> ProcessLane:
        return self

    def queued(self) -> int:
        """Item lists the worker finished that ``next()`` has not taken yet. Messages waiting in
        the pipe are received (not acknowledged, so the worker stays ``prefetch`` lists ahead at
        most) and kept in order for ``next()``."""
        self.receive_arrived()
        return sum(1 for kind, _, _ in self._waiting if kind == "items")

    def queued_bytes(self) -> int:
        """The bytes of those lists, as they crossed the pipe (pickle and arrays)."""
        self.receive_arrived()
        return sum(size for kind, _, size in self._waiting if kind == "items")

    def held_by_bytes(self) -> bool:
        """Whether the worker waits because of ``max_inflight_bytes`` since the last list was
        taken: every list it sent is received (``queued``), and it sends no more until the next
        is taken."""
        self.receive_arrived()
        return self._held_at == self._acks

    def may_send(self) -> bool:
        """Whether a message may still arrive (the worker neither ended nor failed)."""
        if self._closed or self._ended or self._gone or self._stalled is not None:
            return False
        return not self._waiting or self._waiting[-1][0] in ("items", WARNINGS)

    def receive_arrived(self) -> None:
        """Move the messages waiting in the pipe to ``_waiting``."""
        if not self.may_send():
            return
        try:
            while self._conn.poll(0):
                kind, value, size = receive(self._conn, self.timeout, self._ring)
                if self._arrived(kind, value):
                    self._waiting.append((kind, value, size))
        except MessageStalled:
            self._stalled = self._stall()
        except (EOFError, OSError):
            self._gone = True  # next() reports the lost worker

    def __next__(self) -> list:
        if self._stalled is not None:  # seen by queued(): next() reports it
            raise self._stalled
        if self._closed:
            raise closed_error(self.lane_id)
        if self._ended:
            raise StopIteration
        while True:
            kind, value, _ = self._waiting.popleft() if self._waiting else self._next_message()
            if kind != WARNINGS:
                break
            reraise(value)  # here, where the training script's filters apply
        if kind == "error":
            self.close()
            raise value
        if kind == END:
            self._ended = True
            raise StopIteration
        released = self._ring.take_released() if self._ring is not None else None
        try:
            self._conn.send((RELEASED, released) if released else ACK)
        except OSError as exc:
            _untraced(exc)
            raise self._lost() from None
        self._acks += 1
        return value

    def request_stop(self) -> None:
        """Tell the worker to stop; never blocks. What was received ahead is dropped, and with it
        the lane's hold on the worker's shared ring (mapped until the last array made on it
        goes)."""
        super().request_stop()
        self._waiting.clear()
        self._ring = None

    def _next_message(self) -> tuple[str, Any, int]:
        conn = self._conn
        end = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            wait = None if end is None else max(0.0, end - time.monotonic())
            others = self._group.arriving(self)
            ready = wait_for_any([conn, self._sentinel, *others], wait)
            if not ready:
                assert self.timeout is not None
                raise timed_out(self.lane_id, f"pid {self.pid}", self.timeout, self._on_storage())
            if self._sentinel in ready:  # a worker never exits unless stopped: it died
                raise self._lost()
            for other in ready:
                if other in others:
                    others[other].receive_arrived()
            if conn not in ready:
                continue
            try:
                kind, value, size = receive(conn, self.timeout, self._ring)
            except MessageStalled as exc:
                _untraced(exc)
                raise self._stall() from None
            except (EOFError, OSError) as exc:
                _untraced(exc)
                raise self._lost() from None
            if self._arrived(kind, value):
                return kind, value, size

    def _arrived(self, kind: str, value: Any) -> bool:
        """A message came off the pipe: whether it is for ``next()`` (the worker's ready signal
        and what it says it waits on are noted here). After the lane's last list (its end) the
        worker has nothing more to do for it, although the loader may deliver that list much
        later: its neighbours hear so."""
        if kind == READY:
            self._ready = True
            return False
        if kind == RING:
            self._ring = value
            return False
        if kind == STORAGE:
            self._storage = None if value is None else (value, time.monotonic() - value.waited)
            return False
        if kind == HELD:
            self._held_at = value
            return False
        self._storage = None  # a list came: the worker is not waiting any more
        if not self._finished and (
            kind == END or (kind == "items" and value and type(value[-1]) is LaneEnd)
        ):
            self._finished = True
            self._group.lane_ended(self)
        return True

    def _on_storage(self) -> StorageWait | None:
        """What the worker waits on now, when it said it waits on storage."""
        if self._storage is None:
            return None
        wait, since = self._storage
        return dataclasses.replace(wait, waited=time.monotonic() - since)

    def tell(self, message: tuple[str, Any]) -> None:
        """Send the worker a message beside the acknowledgements (``_from_loader``); a worker
        that is gone is left for ``next()`` to report."""
        with contextlib.suppress(OSError):
            self._conn.send(message)

    def _stall(self) -> ZephonError:
        """The error for a message that stopped arriving half-way, after stopping the lane (the
        pipe is inside a message: nothing after it can be read)."""
        assert self.timeout is not None  # only a timed receive stalls
        self.close()
        return timed_out(self.lane_id, f"pid {self.pid}", self.timeout)

    def _lost(self) -> ZephonError:
        """The error for a worker that died (or dropped its pipe), after stopping the lane."""
        code = self._worker.shared.exitcode
        if code is None:  # not yet reaped by another lane of the same process
            self._proc.join(_EXIT_STATUS_WAIT)
            code = self._proc.exitcode
        self.close()
        if not self._ready and code == EXIT_MAIN_REIMPORTED:
            return PlanError(
                f"the worker process of lane {self.lane_id} could not start: {unguarded_main()}"
            )
        who = f"the worker process of lane {self.lane_id} (pid {self.pid})"
        if not self._ready:
            return ZephonError(
                f"{who} failed to start: it {_how_it_ended(code)}; its own error, if it printed "
                "one, is above on stderr"
            )
        return ZephonError(
            f"{who} died: it {_how_it_ended(code)}. The lane cannot go on: resume from the last "
            "checkpoint, or run with workers='inline' to debug the failing operator in this process"
        )


def _untraced(exc: BaseException) -> None:
    """Drop the traceback of a failed pipe call before the lane's error replaces it (``exc``
    stays that error's context). The loader keeps that error, and so its context, for as long
    as it lives: with the traceback it would keep the call's frames, whose buffer of the message
    being sent is an export of a ``BytesIO``, which Python 3.13 reports as an ignored
    ``BufferError`` when the garbage collector finds both."""
    exc.__traceback__ = None
