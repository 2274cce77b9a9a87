"""Where a lane runs: in the caller's thread, a worker thread, or a worker process.

Each kind is an iterator over the lane runner's item lists. Only the lane's operator chain moves;
delivery and every bit of bookkeeping stay in the loader's process, so the delivered stream is the
same for all three kinds.

Stopping is two-phase, so that many lanes stop in the time of one: ``request_stop()`` tells the
worker and never blocks; ``join(deadline)`` waits for it and, past the deadline, terminates and
then kills a worker process. ``close_lanes`` does both for many lanes at once, ``close()`` for
one. No worker holds a reference to its lane, so a lane that becomes unreachable is stopped by
its finalizer at once, without waiting for a cyclic GC pass; finalizers act only in the process
that started the workers, never in a ``fork()``ed child.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import select
import signal
import struct
import sys
import sysconfig
import threading
import time
import types
import weakref
from collections.abc import Generator, Iterable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_any
from typing import Any, Protocol

from zephon.errors import PlanError, ZephonError
from zephon.plan import Plan
from zephon.runtime.blas_threads import limit_loaded_blas
from zephon.runtime.control import ChunkOpened, LaneEnd
from zephon.runtime.lane import LaneRunner
from zephon.runtime.memory import give_back_at_most_every, give_back_once_grown

#: A worker process hands freed memory back to the OS as its lane starts a chunk, at most this
#: often, ...
GIVE_BACK_SECONDS = 1.0
#: ... and after an item list once it holds this many bytes more than right after it last did:
#: what a tokenizer took for a micro-batch of large documents (about 60 bytes per character)
#: goes back before the next, instead of staying mapped until the next chunk starts.
GIVE_BACK_GROWTH = 32 << 20
#: Seconds a worker gets to stop by itself once asked, before a worker process is terminated.
STOP_TIMEOUT = 0.1
_TERMINATE_WAIT = 0.05  # SIGTERM ends a Python process at once unless it handles the signal
_KILL_WAIT = 1.0  # SIGKILL cannot be refused; only a process stuck in the kernel outlasts this
_EXIT_STATUS_WAIT = 1.0  # a dead worker's exit status follows the end of its pipe closely
_POLL_SECONDS = 0.2  # how often the two sides of a thread lane check the other is still there
_WORKER_NAME = "zephon-lane-"
# Exit status of a worker that found itself re-running the main script while starting (EX_CONFIG).
_EXIT_MAIN_REIMPORTED = 78
_ACK = "ack"
_READY = "ready"
_END = "end"  # the runner is exhausted: next() raises StopIteration from now on
_THREADS = "threads"  # from the loader: thread variables to set (other workers have finished)


class _Worker(Protocol):
    """What stopping needs of a worker; held by the lane's finalizer, so never the lane itself."""

    #: Whether ``terminate`` and ``kill`` can end the worker (a process) or not (a thread).
    forcible: bool

    def request_stop(self) -> None: ...

    def wait(self, deadline: float) -> bool: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def _join_workers(workers: list[_Worker], deadline: float) -> bool:
    """Wait until ``deadline`` (``time.monotonic()``) for ``workers`` to stop; terminate the
    worker processes still running, then kill those that outlast it. Whether every worker has
    stopped: a thread still running past the deadline is left to stop by itself."""
    late = [w for w in workers if not w.wait(deadline)]
    running = [w for w in late if w.forcible]
    for escalate, grace in (("terminate", _TERMINATE_WAIT), ("kill", _KILL_WAIT)):
        if not running:
            break
        for worker in running:
            getattr(worker, escalate)()
        later = time.monotonic() + grace
        running = [w for w in running if not w.wait(later)]
    return not running and all(w.forcible for w in late)


def _stop_workers(workers: list[_Worker], timeout: float) -> None:
    """A lane's finalizer: ask every worker to stop, then join them with one deadline."""
    for worker in workers:
        worker.request_stop()
    _join_workers(workers, time.monotonic() + timeout)


class _Lane(Protocol):
    def request_stop(self) -> None: ...

    def _release(self) -> list[_Worker]: ...


def close_lanes(lanes: Iterable[_Lane], timeout: float = STOP_TIMEOUT) -> None:
    """Stop many lanes in the time of one: ask every lane's worker to stop, then wait for all of
    them with a single deadline ``timeout`` seconds away, past which worker processes still
    running are terminated, then killed. Idempotent; a lane may appear more than once.

    The loader's ``close()`` should call this once with all its lanes rather than closing them
    one after the other, which adds up one deadline per busy lane.
    """
    lanes = list(lanes)
    for lane in lanes:
        lane.request_stop()
    workers = [worker for lane in lanes for worker in lane._release()]
    _join_workers(workers, time.monotonic() + timeout)


def _closed_error(lane_id: int) -> ZephonError:
    return ZephonError(f"lane {lane_id} is closed: it delivers nothing after close()")


def _exit_outside_operator(lane_id: int, exc: SystemExit) -> ZephonError:
    # An operator's sys.exit is reported by the lane runner, naming the operator and the record.
    return ZephonError(
        f"lane {lane_id} called sys.exit({exc.code!r}) outside any operator (in the source or "
        "an operator's start_epoch): a lane may not end the training process, raise an "
        "exception instead"
    )


def _timed_out(lane_id: int, where: str, timeout: float) -> ZephonError:
    return ZephonError(
        f"lane {lane_id} ({where}) produced nothing for {timeout:g} s, the pipeline's timeout: "
        "its worker is stuck in an operator or stopped (SIGSTOP, a debugger). If the lane is "
        "only slow, raise Pipeline(timeout=...)"
    )


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
            raise _closed_error(self.lane_id)
        try:
            return next(self._gen)
        except SystemExit as exc:
            raise _exit_outside_operator(self.lane_id, exc) from exc

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

    def _release(self) -> list[_Worker]:
        return []

    def close(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop the lane; idempotent."""
        self.request_stop()


# ------------------------------------------------------------------------------ thread lanes


class _ThreadChannel:
    """What a thread lane and its worker thread share: the bounded queue and the stop flag."""

    def __init__(self, maxsize: int, room: threading.Event | None = None):
        self.queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self.stop = threading.Event()
        self.done = threading.Event()  # the worker thread has left this lane
        self.room = room  # set by the lane when it takes an item list (shared worker threads)

    def put(self, message: tuple) -> bool:
        """Hand ``message`` over unless the lane is stopped first; whether it was handed over."""
        while not self.stop.is_set():
            try:
                self.queue.put(message, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def drain(self) -> None:
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                return


def _thread_main(channel: _ThreadChannel, plan: Plan, lane_id: int, start: dict) -> None:
    """A worker thread's life; it holds the channel, never the lane, so the lane can be freed."""
    try:
        with contextlib.closing(LaneRunner(plan, lane_id, **start).run()) as lane_items:
            for items in lane_items:
                if not channel.put(("items", items)):
                    return
        channel.put((_END, None))
    except SystemExit as exc:
        channel.put(("error", _exit_outside_operator(lane_id, exc)))
    except BaseException as exc:  # delivered to the caller, who re-raises it
        channel.put(("error", exc))


def _thread_group_main(
    members: list[tuple[_ThreadChannel, Plan, int, dict]], room: threading.Event
) -> None:
    """One worker thread for several lanes: it advances whichever lane has room in its queue,
    in lane order, and waits when none has. Each lane's items are what its own runner makes, so
    sharing a thread changes when they are made, never what they are."""
    active = []
    for channel, plan, lane_id, start in members:
        active.append((channel, lane_id, LaneRunner(plan, lane_id, **start).run()))
    try:
        while active:
            progressed = False
            for member in list(active):
                channel, lane_id, lane_items = member
                if channel.stop.is_set() or not channel.queue.full():
                    progressed = True
                    if not _advance(channel, lane_id, lane_items):
                        active.remove(member)
                        lane_items.close()
                        channel.done.set()
            if not progressed:
                room.wait(_POLL_SECONDS)
                room.clear()
    finally:
        for channel, _, lane_items in active:
            lane_items.close()
            channel.done.set()


def _advance(channel: _ThreadChannel, lane_id: int, lane_items: Iterator[list]) -> bool:
    """Hand over the lane's next item list (there is room); False once the lane is done."""
    if channel.stop.is_set():
        return False
    try:
        items = next(lane_items)
    except StopIteration:
        channel.put((_END, None))
        return False
    except SystemExit as exc:
        channel.put(("error", _exit_outside_operator(lane_id, exc)))
        return False
    except BaseException as exc:  # delivered to the caller, who re-raises it
        channel.put(("error", exc))
        return False
    channel.queue.put_nowait(("items", items))  # only this thread puts: the room is still there
    return True


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


class ThreadLane:
    """The lane runs in a worker thread and hands over item lists through a bounded queue.

    Like every kind of lane, an iterator that ends when the lane runner is exhausted.
    """

    def __init__(self, plan: Plan, lane_id: int, **start: Any):
        channel = _ThreadChannel(plan.prefetch)
        thread = threading.Thread(
            target=_thread_main,
            args=(channel, plan, lane_id, start),
            name=f"{_WORKER_NAME}{lane_id}",
            daemon=True,
        )
        self._attach(plan, lane_id, thread, channel)
        thread.start()

    @classmethod
    def group(cls, plan: Plan, members: list[tuple[int, dict]]) -> list[ThreadLane]:
        """Several lanes on one worker thread (which advances whichever has room)."""
        room = threading.Event()
        channels = [_ThreadChannel(plan.prefetch, room) for _ in members]
        thread = threading.Thread(
            target=_thread_group_main,
            args=(
                [(ch, plan, lane_id, start) for ch, (lane_id, start) in zip(channels, members)],
                room,
            ),
            name=f"{_WORKER_NAME}{members[0][0]}",
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
        self._worker = _ThreadWorker(thread, channel)
        self._closed = False
        self._ended = False
        self._finalizer = weakref.finalize(self, _stop_workers, [self._worker], STOP_TIMEOUT)

    def __iter__(self) -> ThreadLane:
        return self

    def queued(self) -> int:
        """Item lists the worker thread finished that ``next()`` has not taken yet."""
        return self._channel.queue.qsize()

    def __next__(self) -> list:
        if self._closed:
            raise _closed_error(self.lane_id)
        if self._ended:
            raise StopIteration
        end = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            wait = _POLL_SECONDS if end is None else min(_POLL_SECONDS, end - time.monotonic())
            try:
                kind, value = self._channel.queue.get(timeout=max(0.0, wait))
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
                    raise _timed_out(self.lane_id, where, self.timeout) from None
        if kind == "error":
            raise value
        if kind == _END:
            self._ended = True
            raise StopIteration
        return value

    def request_stop(self) -> None:
        """Tell the worker thread to stop at its next hand-over; never blocks."""
        self._closed = True
        self._worker.request_stop()

    def join(self, deadline: float) -> bool:
        """Wait until ``deadline`` (``time.monotonic()``) for the thread to end; whether it did.
        A thread busy inside an operator ends by itself once the operator returns."""
        return _join_workers(self._release(), deadline)

    def _release(self) -> list[_Worker]:
        # The lane's worker, once: later calls (and the finalizer) have nothing left to stop.
        return [self._worker] if self._finalizer.detach() is not None else []

    def close(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop the lane, waiting at most ``timeout`` seconds for the thread; idempotent."""
        close_lanes([self], timeout)


# ------------------------------------------------------------------------------ process lanes


def _has_fork_server() -> bool:
    return sys.platform != "win32" and "forkserver" in mp.get_all_start_methods()


def _context(preload: list[str] | None = None) -> Any:
    # forkserver: safe when the parent has threads, and fast because its server has imported what
    # the workers need (zephon, and the plan's modules) before it forks them. The list only counts
    # until the server starts, with the first worker of this process.
    if _has_fork_server():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["zephon", *(preload or [])])
        return ctx
    return mp.get_context("spawn")


_server_started = False  # this process started its fork server (it lives as long as we do)


def fork_server_cold() -> bool:
    """Whether this process has not started its fork server yet, on a platform that has one."""
    return not _server_started and _has_fork_server()


def _nothing() -> None:
    pass


def start_fork_server(preload: list[str]) -> None:
    """Start this process's fork server unless it runs, and return once it forks processes: it
    has imported ``preload`` (what the workers need). Nothing else tells when it is ready, so a
    process that does nothing is started (which starts the server) and joined."""
    global _server_started
    ctx = _context(preload)
    _server_started = True
    probe = ctx.Process(target=_nothing, name="zephon-fork-server-probe")
    probe.start()
    probe.join()


_WALK_DEPTH = 3  # source/operator -> its attributes -> theirs: where tokenizers and readers sit
_WALK_ITEMS = 8  # items looked at per list, tuple or dict (they are usually alike)


def plan_modules(plan: Plan) -> list[str]:
    """The modules whose classes and functions the plan's source and operators hold (a bounded
    walk of their attributes), and those their classes list in ``worker_modules``: what the fork
    server imports once instead of every worker."""
    found: set[str] = set()
    seen: set[int] = set()  # object identities, only to avoid walking an object twice

    def walk(obj: Any, depth: int) -> None:
        if id(obj) in seen or obj is None or type(obj) in _LEAVES:
            return
        seen.add(id(obj))
        owner = (
            obj
            if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType))
            else type(obj)
        )
        found.add(getattr(owner, "__module__", None) or "builtins")
        # A class that imports what it needs lazily (pyarrow for Arrow files) names it here.
        found.update(getattr(owner, "worker_modules", ()))
        if depth == 0:
            return
        if isinstance(obj, (list, tuple)):
            parts: Iterable[Any] = obj[:_WALK_ITEMS]
        elif isinstance(obj, dict):
            parts = list(obj.values())[:_WALK_ITEMS]
        elif isinstance(obj, types.FunctionType):
            parts = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
        else:
            parts = list(getattr(obj, "__dict__", {}).values())
        for part in parts:
            walk(part, depth - 1)

    for top in (plan.source, plan.fetch, *plan.chain, plan.batcher):
        walk(top, _WALK_DEPTH)
    return sorted(m for m in found if m != "zephon" and _installed(m))


_LEAVES = (int, float, bool, str, bytes, bytearray, complex)


def _installed(module: str) -> bool:
    """Whether ``module`` belongs to zephon, the standard library or an installed package
    (imported here already). Your own modules are left to the workers: the fork server would
    run their top-level code before any worker exists, and an error there would stop it."""
    top = module.split(".")[0]
    if top == "zephon":
        return True
    loaded = sys.modules.get(top)
    path = getattr(loaded, "__file__", None)
    if loaded is None or top in ("__main__", "__mp_main__"):
        return False
    if path is None:  # compiled into the interpreter (sys, _thread, ...): nothing to import
        return False
    where = os.path.realpath(path)
    return any(where.startswith(root + os.sep) for root in _library_roots())


def _library_roots() -> list[str]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.update(p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages"))
    return [os.path.realpath(r) for r in roots]


def _filled(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


#: The thread pools of tokenizers and numerical libraries, by the variables that size them.
THREAD_VARIABLES = (
    "RAYON_NUM_THREADS",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
)


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def worker_environment(processes: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables each of ``processes`` worker processes sets before its lanes run, so that
    the workers' own thread pools (an HF tokenizer's, BLAS's) fit the CPUs together: each worker
    gets ``cpus // processes`` threads (at least 1), and a tokenizer runs single-threaded when
    that is 1. A variable the user set in the loader's environment keeps the user's value."""
    environ = dict(os.environ) if environ is None else environ
    threads = max(1, _usable_cpus() // max(1, processes))
    wanted = {name: str(threads) for name in THREAD_VARIABLES}
    wanted["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    return {name: environ.get(name, value) for name, value in wanted.items()}


class _LoaderGone(Exception):
    """The loader closed its end of the pipe: the worker stops."""


def _encode(kind: str, value: Any) -> tuple[tuple, list[Any]]:
    """Pickle protocol 5 with out-of-band buffers (numpy data is not copied into the pickle):
    a header, then the pickle and the buffers, to be sent as one body."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    return (kind, len(data), [r.nbytes for r in raws]), [data, *raws]


def _write(conn: Connection, message: tuple[tuple, list[Any]]) -> None:
    header, parts = message
    try:
        conn.send(header)
        # One body, however many arrays: a message of packed rows holds hundreds of them.
        conn.send_bytes(parts[0] if len(parts) == 1 else b"".join(parts))
    except (OSError, EOFError):
        raise _LoaderGone from None


class MessageStalled(Exception):
    """The rest of a message did not arrive before the deadline (its sender stopped mid-way)."""


def _receive(conn: Connection, patience: float | None = None) -> tuple[str, Any]:
    """One message (``_encode``'s header, then its body). With ``patience``, ``MessageStalled``
    when the body has not arrived that many seconds after the header."""
    kind, size, sizes = conn.recv()  # small: written to the pipe in one piece
    deadline = None if patience is None else time.monotonic() + patience
    data = bytearray(size)
    # Each buffer its own bytearray: writable, so arrays arrive as ordinary writable numpy
    # arrays, and holding one array holds no other.
    buffers = [bytearray(n) for n in sizes]
    _recv_body_into(conn, [data, *buffers], deadline)
    return kind, pickle.loads(data, buffers=buffers)


def _recv_body_into(conn: Connection, parts: list[bytearray], deadline: float | None) -> None:
    """One message of exactly ``sum(map(len, parts))`` bytes into ``parts``, in order, giving up
    at ``deadline``. On POSIX the pipe is read here, in ``Connection``'s framing (a 4-byte
    big-endian length, or -1 and an 8-byte one, then the bytes), scattered into the parts."""
    total = sum(map(len, parts))
    if sys.platform == "win32":
        body = conn.recv_bytes()
        if len(body) != total:
            raise OSError(f"a message of {len(body)} bytes where {total} were announced")
        at = 0
        for part in parts:
            part[:] = body[at : at + len(part)]
            at += len(part)
        return
    fd = conn.fileno()
    head = bytearray(4)
    _read_exactly(fd, [memoryview(head)], deadline)
    (n,) = struct.unpack("!i", head)
    if n == -1:
        head = bytearray(8)
        _read_exactly(fd, [memoryview(head)], deadline)
        (n,) = struct.unpack("!Q", head)
    if n != total:
        raise OSError(f"a message of {n} bytes where {total} were announced")
    _read_exactly(fd, [memoryview(p) for p in parts if len(p)], deadline)


#: The most buffers one ``readv`` may fill.
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16


def _read_exactly(fd: int, views: list[memoryview], deadline: float | None) -> None:
    """Fill ``views`` from ``fd``, in order; without a ``deadline`` as long as that takes."""
    total = sum(map(len, views))
    got = i = 0
    while i < len(views):
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise MessageStalled(f"{got} of {total} bytes arrived")
        n = os.readv(fd, views[i : i + _IOV_MAX])
        if n == 0:
            raise EOFError("the pipe closed inside a message")
        got += n
        while i < len(views) and n >= len(views[i]):
            n -= len(views[i])
            i += 1
        if n:
            views[i] = views[i][n:]


def _loader_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed loader waiting to be reaped is a zombie: gone all the same
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _die_with_loader(loader_pid: int) -> None:
    """Exit as soon as the loader's process is gone, however it died (SIGKILL included)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            # Our parent is the fork server, which exits when the loader dies; the kernel then
            # kills us at once.
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:
            pass  # the watchdog below covers it

    def watch() -> None:  # portable, and covers a spawned worker whose parent is the loader
        while _loader_alive(loader_pid):
            threading.Event().wait(0.25)
        os._exit(1)

    threading.Thread(target=watch, name="zephon-loader-watch", daemon=True).start()


def _load_plan(plan_bytes: bytes, lane_ids: list[int]) -> Plan | PlanError:
    """The plan, loaded once for all the lanes of a worker process, or the error to report."""
    try:
        plan: Plan = pickle.loads(plan_bytes)
        return plan
    except Exception as exc:
        which = ", ".join(map(str, lane_ids))
        error = PlanError(
            f"the worker process of lane(s) {which} could not load the pipeline "
            f"({type(exc).__name__}: {exc}): operators, sources and the callables they hold "
            "must be importable by their module's name in a fresh process"
        )
        error.__cause__ = exc
        return error


def _stream(conn: Connection, lane_items: Iterator[list], lane_id: int, prefetch: int) -> None:
    """Send the lane's item lists with at most ``prefetch`` not yet taken by the loader."""
    credits = prefetch
    for items in lane_items:
        try:
            message = _encode("items", items)
        except Exception as exc:
            raise ZephonError(
                f"lane {lane_id} produced records that cannot be pickled to reach the loader "
                f"({type(exc).__name__}: {exc}): with workers='process' payloads must be "
                "picklable"
            ) from exc
        if items and type(items[0]) is ChunkOpened:  # what the last chunk took is free again
            give_back_at_most_every(GIVE_BACK_SECONDS)
        try:
            while credits == 0 or conn.poll():
                credits += _from_loader(conn.recv())
        except (OSError, EOFError):
            raise _LoaderGone from None
        _write(conn, message)
        credits -= 1
        give_back_once_grown(GIVE_BACK_GROWTH)


def _from_loader(message: Any) -> int:
    """Act on a message from the loader: 1 for an acknowledgement (the loader took an item list,
    and one more may go), 0 for thread variables to set (``Neighbours.lane_ended``)."""
    if message == _ACK:
        return 1
    kind, environment = message
    if kind == _THREADS:
        os.environ.update(environment)  # read by the tokenizer at its next encode_batch
    return 0


def _send_error(conn: Connection, exc: BaseException) -> None:
    try:
        message = _encode("error", exc)
    except Exception as why:
        message = _encode("error", ZephonError(f"{type(exc).__name__}: {exc} (unpicklable: {why})"))
    _write(conn, message)


def _process_main(
    members: list[tuple[Connection, int, dict]],
    plan_bytes: bytes,
    prefetch: int,
    loader_pid: int,
    environment: dict[str, str],
) -> None:
    """A worker process: one lane, or several lanes each on a thread of its own (so that a lane
    blocked sending to the loader never holds up another). The plan is loaded once, for all."""
    # Ctrl-C in a terminal reaches the whole process group: the loader's process handles it and
    # stops its workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_loader(loader_pid)
    # Before anything starts a thread pool: pools read these when they are first used. BLAS
    # was loaded with numpy in the fork server, and is told instead.
    os.environ.update(environment)
    limit_loaded_blas(environment)
    for conn, _, _ in members:
        _write_or_leave(conn, _encode(_READY, None))
    plan = _load_plan(plan_bytes, [lane_id for _, lane_id, _ in members])
    del plan_bytes
    if len(members) == 1:
        _lane_main(*members[0], plan, prefetch)
        return
    threads = [
        threading.Thread(
            target=_lane_main,
            args=(conn, lane_id, start, plan, prefetch),
            name=f"zephon-worker-lane-{lane_id}",
            daemon=True,
        )
        for conn, lane_id, start in members
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _write_or_leave(conn: Connection, message: tuple[tuple, list[Any]]) -> None:
    with contextlib.suppress(_LoaderGone):  # the lane's own loop finds the loader gone
        _write(conn, message)


def _lane_main(
    conn: Connection, lane_id: int, start: dict, plan: Plan | PlanError, prefetch: int
) -> None:
    try:
        if isinstance(plan, PlanError):
            raise plan
        with contextlib.closing(LaneRunner(plan, lane_id, **start).run()) as lane_items:
            _stream(conn, lane_items, lane_id, prefetch)
        _write(conn, _encode(_END, None))
    except _LoaderGone:
        return
    except BaseException as exc:
        error = _exit_outside_operator(lane_id, exc) if isinstance(exc, SystemExit) else exc
        try:
            _send_error(conn, error)
        except _LoaderGone:
            return
    # Done or failed: stay until the loader closes its end, so that what we sent is read first
    # and our exit never looks like a death.
    try:
        while True:
            conn.recv()
    except (EOFError, OSError):
        pass


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


def _unguarded_main() -> str:
    script = getattr(sys.modules.get("__main__"), "__file__", None) or "the main script"
    return (
        f"workers='process' starts each worker process by importing {script} again, and its "
        "module-level code started the pipeline once more. Put the code that runs the pipeline "
        'under `if __name__ == "__main__":` (for example in a main() called from there)'
    )


def _refuse_unguarded_main() -> None:
    """Fail at once in a process that is re-running the main script as it starts as a worker."""
    me = mp.current_process()
    if not getattr(me, "_inheriting", False):  # multiprocessing's own "still bootstrapping" flag
        return
    if me.name.startswith(_WORKER_NAME):
        os._exit(_EXIT_MAIN_REIMPORTED)  # our lane reports it in the loader, once
    raise PlanError(_unguarded_main())  # some other library's worker re-ran the script


def _parts_of(value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [(f"[{k!r}]", v) for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(value)]
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict) and not isinstance(value, (type, types.ModuleType)):
        return [(f".{name}", v) for name, v in attrs.items()]
    return []


def _pickle_error(value: Any) -> Exception | None:
    try:
        pickle.dumps(value, protocol=5)
    except Exception as exc:
        return exc
    return None


def _culprit(value: Any, path: str = "", depth: int = 4) -> tuple[str, Exception] | None:
    """The deepest attribute path (``settings['guard']``) under ``value`` that cannot be pickled."""
    for name, part in _parts_of(value):
        error = _pickle_error(part)
        if error is not None:
            here = f"{path}{name}"
            deeper = _culprit(part, here, depth - 1) if depth > 1 else None
            return deeper or (here, error)
    return None


def _unpicklable_message(plan: Plan, exc: Exception) -> str:
    ops = [plan.fetch, *plan.chain, *((plan.batcher,) if plan.batcher else ())]
    parts: list[tuple[str, Any]] = [(f"the source ({type(plan.source).__name__})", plan.source)]
    parts += [(f"operator {op.name!r} (#{i})", op) for i, op in enumerate(ops)]
    what = "it"
    for label, part in parts:
        error = _pickle_error(part)
        if error is None:
            continue
        found = _culprit(part)
        what, exc = label, error
        if found is not None:
            what, exc = f"{label}, in its attribute {found[0].lstrip('.')},", found[1]
        break
    return (
        f"workers='process' needs a picklable pipeline, but {what} cannot be pickled "
        f"({type(exc).__name__}: {exc}): define operators and the callables they hold at module "
        "level instead of lambdas, closures or local classes, and open locks, files and "
        "connections in start_epoch or on first use rather than in __init__"
    )


class PlanParcel:
    """What every worker process of one ``open_lanes`` call receives: the plan pickled once, the
    modules its fork server preloads and the environment that sizes the workers' thread pools."""

    def __init__(self, plan: Plan):
        _refuse_unguarded_main()
        try:
            self.plan_bytes = pickle.dumps(plan, protocol=5)
        except Exception as exc:
            raise PlanError(_unpicklable_message(plan, exc)) from None
        self.preload = plan_modules(plan)
        self.environment = worker_environment(plan.processes)
        self.neighbours = Neighbours(min(plan.processes, len(plan.rank_lanes)), self.environment)


#: The thread variables a worker may be given more of when other workers have finished: the
#: tokenizer's, whose output does not depend on how many threads encode. BLAS and OpenMP keep
#: their first size, as a reduction's result can depend on how it was split.
WIDENED = ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM")


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
                other.tell((_THREADS, widened))


def _start_process(
    plan: Plan, members: list[tuple[int, dict]], parcel: PlanParcel
) -> tuple[Any, list[Connection]]:
    """Start one worker process for the lanes ``members`` (lane id, runner start); the process
    and the loader's end of each lane's pipe."""
    global _server_started
    ctx = _context(parcel.preload)
    _server_started = True
    pipes = [ctx.Pipe(duplex=True) for _ in members]
    proc = ctx.Process(
        target=_process_main,
        args=(
            [(child, lane_id, start) for (_, child), (lane_id, start) in zip(pipes, members)],
            parcel.plan_bytes,
            plan.prefetch,
            os.getpid(),
            parcel.environment,
        ),
        name=f"{_WORKER_NAME}{members[0][0]}",
        daemon=True,
    )
    try:
        proc.start()
    except BaseException:
        for parent, _ in pipes:
            parent.close()
        raise
    finally:
        for _, child in pipes:
            child.close()
    _started_here.add(proc)
    return proc, [parent for parent, _ in pipes]


class ProcessLane:
    """The lane runs in a worker process; at most ``prefetch`` item lists are in flight.

    The worker dies with the lane: on ``close()``, on an error, when the lane is collected, and
    when the loader's process is killed (the kernel's parent-death signal, and a watchdog). A
    worker that dies is reported by ``next()`` at once, with its exit code or signal. The plan's
    ``timeout`` applies to every ``next()``, the first one (the worker's start-up) included.
    """

    def __init__(self, plan: Plan, lane_id: int, *, parcel: PlanParcel | None = None, **start: Any):
        parcel = parcel or PlanParcel(plan)
        proc, (conn,) = _start_process(plan, [(lane_id, start)], parcel)
        self._attach(plan, lane_id, proc, conn, _SharedProcess(1), parcel.neighbours)

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
            lane._attach(plan, lane_id, proc, conn, shared, parcel.neighbours)
            lanes.append(lane)
        return lanes

    def _attach(
        self,
        plan: Plan,
        lane_id: int,
        proc: Any,
        conn: Connection,
        shared: _SharedProcess,
        neighbours: Neighbours,
    ) -> None:
        self.lane_id = lane_id
        self.timeout = plan.timeout
        self._conn = conn
        self.pid: int = proc.pid
        self._sentinel = proc.sentinel
        self._proc = proc
        self._worker = _ProcessWorker(proc, conn, shared)
        self._ready = False  # the worker said it runs: a death before that is a failed start
        self._waiting: collections.deque[tuple[str, Any]] = collections.deque()  # see queued()
        self._stalled: ZephonError | None = None
        self._closed = False
        self._ended = False
        self._gone = False  # the pipe ended while receiving ahead: next() reports why
        self._finished = False  # the lane's last list (or its end) came: nothing more is made
        self._neighbours = neighbours
        neighbours.add(self)
        self._finalizer = weakref.finalize(self, _stop_workers, [self._worker], STOP_TIMEOUT)

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
        self._receive_arrived()
        return sum(1 for kind, _ in self._waiting if kind == "items")

    def _may_send(self) -> bool:
        """Whether a message may still arrive (the worker neither ended nor failed)."""
        if self._closed or self._ended or self._gone or self._stalled is not None:
            return False
        return not self._waiting or self._waiting[-1][0] == "items"

    def _receive_arrived(self) -> None:
        """Move the messages waiting in the pipe to ``_waiting``."""
        if not self._may_send():
            return
        try:
            while self._conn.poll(0):
                kind, value = _receive(self._conn, self.timeout)
                if self._arrived(kind, value):
                    self._waiting.append((kind, value))
        except MessageStalled:
            self._stalled = self._stall()
        except (EOFError, OSError):
            self._gone = True  # next() reports the lost worker

    def __next__(self) -> list:
        if self._stalled is not None:  # seen by queued(): next() reports it
            raise self._stalled
        if self._closed:
            raise _closed_error(self.lane_id)
        if self._ended:
            raise StopIteration
        if self._waiting:
            kind, value = self._waiting.popleft()
        else:
            kind, value = self._next_message()
        if kind == "error":
            self.close()
            raise value
        if kind == _END:
            self._ended = True
            raise StopIteration
        try:
            self._conn.send(_ACK)
        except OSError:
            raise self._lost() from None
        return value

    def _next_message(self) -> tuple[str, Any]:
        conn = self._conn
        end = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            wait = None if end is None else max(0.0, end - time.monotonic())
            others = self._neighbours.arriving(self)
            ready = wait_for_any([conn, self._sentinel, *others], wait)
            if not ready:
                assert self.timeout is not None
                raise _timed_out(self.lane_id, f"pid {self.pid}", self.timeout)
            if self._sentinel in ready:  # a worker never exits unless stopped: it died
                raise self._lost()
            for other in ready:
                if other in others:
                    others[other]._receive_arrived()
            if conn not in ready:
                continue
            try:
                kind, value = _receive(conn, self.timeout)
            except MessageStalled:
                raise self._stall() from None
            except (EOFError, OSError):
                raise self._lost() from None
            if self._arrived(kind, value):
                return kind, value

    def _arrived(self, kind: str, value: Any) -> bool:
        """A message came off the pipe: whether it is for ``next()`` (the worker's ready signal
        is noted here). After the lane's last list (its end) the worker has nothing more to do
        for it, although the loader may deliver that list much later: its neighbours hear so."""
        if kind == _READY:
            self._ready = True
            return False
        if not self._finished and (
            kind == _END or (kind == "items" and value and type(value[-1]) is LaneEnd)
        ):
            self._finished = True
            self._neighbours.lane_ended(self)
        return True

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
        return _timed_out(self.lane_id, f"pid {self.pid}", self.timeout)

    def _lost(self) -> ZephonError:
        """The error for a worker that died (or dropped its pipe), after stopping the lane."""
        code = self._worker.shared.exitcode
        if code is None:  # not yet reaped by another lane of the same process
            self._proc.join(_EXIT_STATUS_WAIT)
            code = self._proc.exitcode
        self.close()
        if not self._ready and code == _EXIT_MAIN_REIMPORTED:
            return PlanError(
                f"the worker process of lane {self.lane_id} could not start: {_unguarded_main()}"
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

    def request_stop(self) -> None:
        """Tell the worker to stop (closing the loader's end of the pipe); never blocks."""
        self._closed = True
        self._worker.request_stop()

    def join(self, deadline: float) -> bool:
        """Wait until ``deadline`` (``time.monotonic()``) for the worker to exit, then terminate
        and kill it; whether it is gone."""
        return _join_workers(self._release(), deadline)

    def _release(self) -> list[_Worker]:
        # The lane's worker, once: later calls (and the finalizer) have nothing left to stop.
        return [self._worker] if self._finalizer.detach() is not None else []

    def close(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop the lane, giving the worker ``timeout`` seconds before it is terminated;
        idempotent."""
        close_lanes([self], timeout)


LANE_KINDS: dict[str, type[InlineLane | ThreadLane | ProcessLane]] = {
    "inline": InlineLane,
    "thread": ThreadLane,
    "process": ProcessLane,
}


def open_lane(plan: Plan, lane_id: int, **start: Any) -> InlineLane | ThreadLane | ProcessLane:
    """Start lane ``lane_id`` where the plan says lanes run (``start`` goes to ``LaneRunner``)."""
    return LANE_KINDS[plan.workers](plan, lane_id, **start)


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
    if k == len(members):
        if parcel is None:
            return [open_lane(plan, lane_id, **start) for lane_id, start in members]
        return [ProcessLane(plan, lane_id, parcel=parcel, **start) for lane_id, start in members]
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
            lanes.extend(ThreadLane.group(plan, block))
        else:
            lanes.append(open_lane(plan, block[0][0], **block[0][1]))
    return lanes
