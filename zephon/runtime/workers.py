"""Where a lane runs: in the caller's thread, a worker thread, or a worker process.

Each kind is an iterator over the lane runner's item lists with ``close()``. Only the lane's
operator chain moves; delivery and every bit of bookkeeping stay in the loader's process, so the
delivered stream is the same for all three kinds.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
import weakref
from collections.abc import Generator
from multiprocessing.connection import Connection
from typing import Any

from zephon.errors import PlanError, ZephonError
from zephon.plan import Plan
from zephon.runtime.lane import LaneRunner

_STOP = "stop"
_ACK = "ack"
_POLL_SECONDS = 0.2


class InlineLane:
    """The lane runs in the caller's thread, one step per ``next()``: simplest to debug."""

    def __init__(self, plan: Plan, lane_id: int, **start: Any):
        self._gen: Generator[list, None, None] = LaneRunner(plan, lane_id, **start).run()

    def __iter__(self) -> InlineLane:
        return self

    def __next__(self) -> list:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()


class ThreadLane:
    """The lane runs in a worker thread and hands over item lists through a bounded queue."""

    def __init__(self, plan: Plan, lane_id: int, **start: Any):
        self.lane_id = lane_id
        self._queue: queue.Queue = queue.Queue(maxsize=plan.prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._work,
            args=(plan, lane_id, start),
            name=f"zephon-lane-{lane_id}",
            daemon=True,
        )
        self._thread.start()

    def _put(self, message: tuple) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(message, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def _work(self, plan: Plan, lane_id: int, start: dict) -> None:
        try:
            for items in LaneRunner(plan, lane_id, **start).run():
                if not self._put(("items", items)):
                    return
        except BaseException as exc:  # delivered to the caller, who re-raises it
            self._put(("error", exc))

    def __iter__(self) -> ThreadLane:
        return self

    def __next__(self) -> list:
        while True:
            try:
                kind, value = self._queue.get(timeout=_POLL_SECONDS)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise ZephonError(f"worker thread of lane {self.lane_id} stopped") from None
        if kind == "error":
            raise value
        return value

    def close(self) -> None:
        self._stop.set()
        while True:  # unblock a worker waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5)


def _context() -> Any:
    # forkserver: safe when the parent has threads, and fast once its server has imported zephon.
    if sys.platform != "win32" and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["zephon"])
        return ctx
    return mp.get_context("spawn")


def _send(conn: Connection, kind: str, value: Any) -> None:
    """Pickle protocol 5 with out-of-band buffers: numpy data goes to the pipe without a copy."""
    buffers: list[pickle.PickleBuffer] = []
    try:
        data = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    except Exception as exc:
        if kind != "error":
            raise
        data = pickle.dumps(ZephonError(f"{type(value).__name__}: {value} (unpicklable: {exc})"))
        buffers = []
    raws = [b.raw() for b in buffers]
    conn.send((kind, len(data), [r.nbytes for r in raws]))
    conn.send_bytes(data)
    for raw in raws:
        conn.send_bytes(raw)


def _receive(conn: Connection) -> tuple[str, Any]:
    kind, size, sizes = conn.recv()
    data = bytearray(size)
    conn.recv_bytes_into(data)
    buffers = []
    for n in sizes:
        buf = bytearray(n)  # writable, so arrays arrive as ordinary writable numpy arrays
        if n:
            conn.recv_bytes_into(buf)
        else:
            conn.recv_bytes()
        buffers.append(buf)
    return kind, pickle.loads(data, buffers=buffers)


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
            pass

    def watch() -> None:  # portable, and covers a spawned worker whose parent is the loader
        while _loader_alive(loader_pid):
            threading.Event().wait(0.25)
        os._exit(1)

    threading.Thread(target=watch, name="zephon-loader-watch", daemon=True).start()


def _process_main(
    conn: Connection, plan_bytes: bytes, lane_id: int, start: dict, prefetch: int, loader_pid: int
) -> None:
    _die_with_loader(loader_pid)
    credits = prefetch
    try:
        plan = pickle.loads(plan_bytes)
        for items in LaneRunner(plan, lane_id, **start).run():
            while credits == 0 or conn.poll():
                if conn.recv() == _STOP:
                    return
                credits += 1
            _send(conn, "items", items)
            credits -= 1
    except (BrokenPipeError, EOFError, ConnectionResetError):
        return  # the loader is gone
    except BaseException as exc:
        try:
            _send(conn, "error", exc)
        except (BrokenPipeError, EOFError, ConnectionResetError):
            return
    # Wait for the loader to stop us so the pipe is not closed under unread data.
    try:
        while conn.recv() != _STOP:
            pass
    except (EOFError, OSError):
        pass


def _shutdown(proc: Any, conn: Connection) -> None:
    with contextlib.suppress(OSError, ValueError):
        conn.send(_STOP)
    proc.join(timeout=2)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=2)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=2)
    conn.close()


class ProcessLane:
    """The lane runs in a worker process; at most ``prefetch`` item lists are in flight.

    The worker dies with the loader: on ``close()``, on an error, when the loader is collected,
    and when the loader's process is killed (the kernel's parent-death signal, and a watchdog).
    """

    def __init__(self, plan: Plan, lane_id: int, **start: Any):
        self.lane_id = lane_id
        try:
            plan_bytes = pickle.dumps(plan, protocol=5)
        except Exception as exc:
            raise PlanError(
                f"workers='process' needs a picklable pipeline ({type(exc).__name__}: {exc}); "
                "define operators and callables at module level instead of lambdas or closures"
            ) from None
        ctx = _context()
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=_process_main,
            args=(child, plan_bytes, lane_id, start, plan.prefetch, os.getpid()),
            name=f"zephon-lane-{lane_id}",
            daemon=True,
        )
        self._proc.start()
        child.close()
        self._finalizer = weakref.finalize(self, _shutdown, self._proc, self._conn)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def __iter__(self) -> ProcessLane:
        return self

    def __next__(self) -> list:
        conn = self._conn
        while not conn.poll(_POLL_SECONDS):
            if not self._proc.is_alive() and not conn.poll():
                code = self._proc.exitcode
                self.close()
                raise ZephonError(
                    f"worker process of lane {self.lane_id} died unexpectedly (exit code {code})"
                )
        try:
            kind, value = _receive(conn)
        except (EOFError, OSError) as exc:
            self.close()
            raise ZephonError(f"lost the worker process of lane {self.lane_id}: {exc}") from None
        if kind == "error":
            self.close()
            raise value
        conn.send(_ACK)
        return value

    def close(self) -> None:
        self._finalizer()


LANE_KINDS: dict[str, type[InlineLane | ThreadLane | ProcessLane]] = {
    "inline": InlineLane,
    "thread": ThreadLane,
    "process": ProcessLane,
}


def open_lane(plan: Plan, lane_id: int, **start: Any) -> InlineLane | ThreadLane | ProcessLane:
    """Start lane ``lane_id`` where the plan says lanes run (``start`` goes to ``LaneRunner``)."""
    return LANE_KINDS[plan.workers](plan, lane_id, **start)
