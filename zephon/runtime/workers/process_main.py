"""The life of a worker process: it loads the plan once, runs its lanes, streams their item lists
to the loader within their credit, and dies with the loader."""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
import signal
import sys
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

from zephon._core.records import RecordRun, SampleBatch, SampleRecord
from zephon.errors import PlanError, ZephonError
from zephon.ops.base import OperatorContext
from zephon.plan import Plan
from zephon.runtime.lanes.control import ChunkOpened
from zephon.runtime.lanes.operator_setup import OperatorSetup
from zephon.runtime.lanes.runner import LaneRunner
from zephon.runtime.workers.blas_threads import limit_loaded_blas
from zephon.runtime.workers.inflight_bytes import has_room
from zephon.runtime.workers.memory_release import give_back_at_most_every, give_back_once_grown
from zephon.runtime.workers.pipe_messages import (
    ACK,
    END,
    HELD,
    READY,
    RELEASED,
    STORAGE,
    THREADS,
    WARNINGS,
    LoaderGone,
    announce_ring,
    body_size,
    encode,
    pickle_error,
    through_ring,
    unpicklable_part,
    write,
)
from zephon.runtime.workers.sent_errors import sendable
from zephon.runtime.workers.shared_ring import MIN_RING_MESSAGE, RingWriter, ring_possible
from zephon.runtime.workers.stopping import exit_outside_operator
from zephon.runtime.workers.worker_warnings import forward_warnings, take_warnings
from zephon.sources.storage_waits import longest_wait

#: A worker process hands freed memory back to the OS as its lane starts a chunk, at most this
#: often: the lists after a give-back fault in again every page they take (64 decoded photos:
#: about 60 MB, a tenth of a second of CPU), which once a second cost a worker making images a
#: tenth of its time ...
GIVE_BACK_SECONDS = 10.0
#: ... and after an item list once it holds this many bytes more than right after it last did
#: and than the lists before it: what a tokenizer took for a micro-batch of large documents
#: (about 60 bytes per character) goes back before the next, instead of staying mapped until the
#: next chunk starts.
GIVE_BACK_GROWTH = 32 << 20
# Exit status of a worker that found itself re-running the main script while starting (EX_CONFIG).
EXIT_MAIN_REIMPORTED = 78
#: A lane waiting on storage this long (at most; less under a short pipeline timeout) tells the
#: loader, so that a timeout names the remote operation rather than blame an operator.
STORAGE_NOTE_SECONDS = 0.5


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


class _Outbox:
    """A lane's end of its pipe, written by the lane's thread and by its storage watch: one
    whole message at a time. It owns the lane's shared ring, made at the first item list large
    enough to use it."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._lock = threading.Lock()
        self.ring: RingWriter | None = None
        self._ring_possible: bool | None = None  # found out at the first large list

    def write(self, message: tuple[tuple, list[Any]]) -> None:
        """``wire.write`` the message; ``LoaderGone`` when the loader closed the pipe."""
        with self._lock:
            write(self.conn, message)

    def carry(self, message: tuple[tuple, list[Any]]) -> tuple[tuple, list[Any]]:
        """An item list's message, its arrays placed in the ring when they are large enough and
        a region is free (the ring is made, and passed to the loader, on first use)."""
        sizes = message[0][2]
        if self.ring is None:
            if sum(sizes) < MIN_RING_MESSAGE:
                return message
            if self._ring_possible is None:
                self._ring_possible = ring_possible(self.conn)
            if not self._ring_possible:
                return message
            ring = RingWriter.for_message(sizes)
            with self._lock:
                announce_ring(self.conn, ring)
            self.ring = ring
        return through_ring(message, self.ring) if self.ring.fits(sizes) else message


def _watch_storage(outbox: _Outbox, timeout: float) -> threading.Event:
    """Tell the loader, through ``outbox``, when the calling thread (a lane's) has waited on a
    remote operation for a while, and when it no longer does, until the event returned is set.
    The loader's timeout then names the operation (``stopping.timed_out``)."""
    lane_thread = threading.get_ident()
    patience = min(STORAGE_NOTE_SECONDS, timeout / 4)
    done = threading.Event()

    def watch() -> None:
        told: int | None = None  # the token of the wait the loader was told of
        while not done.wait(patience / 2):
            wait = longest_wait(lane_thread)
            if wait is not None and wait.waited < patience:
                wait = None
            token = None if wait is None else wait.token
            if token == told:
                continue
            try:
                outbox.write(encode(STORAGE, wait))
            except LoaderGone:
                return
            told = token

    threading.Thread(target=watch, name="zephon-storage-watch", daemon=True).start()
    return done


def _stream(
    outbox: _Outbox, lane_items: Iterator[list], lane_id: int, ahead: tuple[int, int | None]
) -> None:
    """Send the lane's item lists with at most ``prefetch`` not yet taken by the loader, and,
    under ``max_inflight_bytes``, no new one while those hold that many bytes (``ahead``: the
    two). The loader takes lists in the order they were sent, so each acknowledgement frees the
    oldest one's bytes."""
    conn = outbox.conn
    credits, max_bytes = ahead
    unacked: collections.deque[int] = collections.deque()  # body bytes of lists not taken yet
    inflight = acks = 0
    for items in lane_items:
        try:
            message = encode("items", items)
        except Exception as exc:
            what, why = _unpicklable_record(items) or ("records", exc)
            raise ZephonError(
                f"lane {lane_id} produced {what} that cannot be pickled to reach the loader "
                f"({type(why).__name__}: {why}): with workers='process' payloads must be "
                "picklable"
            ) from exc
        if items and type(items[0]) is ChunkOpened:  # what the last chunk took is free again
            give_back_at_most_every(GIVE_BACK_SECONDS)
        told = False
        try:
            while True:
                by_bytes = not has_room(inflight, max_bytes)
                if not (credits == 0 or by_bytes or conn.poll()):
                    break
                if by_bytes and credits and not told:  # the bytes, not the count, hold it
                    outbox.write(encode(HELD, acks))
                    told = True
                if _from_loader(conn.recv(), outbox.ring):
                    credits += 1
                    acks += 1
                    told = False  # still held after this one, the loader hears so again
                    if unacked:
                        inflight -= unacked.popleft()
        except (OSError, EOFError):
            raise LoaderGone from None
        _send_warnings(outbox)
        message = outbox.carry(message)  # after the loader's releases that came meanwhile
        outbox.write(message)
        credits -= 1
        if max_bytes is not None:
            size = body_size(message)
            unacked.append(size)
            inflight += size
        del message  # its buffers are the arrays of ``items``: nothing of them is kept here
        give_back_once_grown(GIVE_BACK_GROWTH)


def _unpicklable_record(items: list) -> tuple[str, Exception] | None:
    """The first record of ``items`` whose payload cannot be pickled, described by its cursor
    and the field that cannot (``payload['image']``), with the error; None if none is found."""
    for item in items:
        if isinstance(item, SampleRecord):
            records = [item]
        elif isinstance(item, RecordRun):
            records = list(item)
        elif isinstance(item, SampleBatch):
            records = list(item.records)
        else:
            continue
        for record in records:
            error = pickle_error(record.payload)
            if error is None:
                continue
            cursor = record.meta.cursor
            found = unpicklable_part(record.payload, "payload")
            where, why = found if found else ("payload", error)
            return f"record {cursor!r} (sample_id={cursor.sample_id}), in its {where},", why
    return None


def _from_loader(message: Any, ring: RingWriter | None) -> bool:
    """Act on a message from the loader: True for an acknowledgement (the loader took an item
    list, and one more may go), with the ``ring`` regions it released; thread variables to set
    (``ProcessGroup.lane_ended``) are set."""
    if message == ACK:
        return True
    kind, value = message
    if kind == RELEASED:
        if ring is not None:
            ring.release(value)
        return True
    if kind == THREADS:
        os.environ.update(value)  # read by the tokenizer at its next encode_batch
    return False


def _send_warnings(outbox: _Outbox) -> None:
    """The warnings raised since the last item list, ahead of what follows them (they take no
    credit: the loader raises them again as it reads them)."""
    found = take_warnings()
    if found:
        outbox.write(encode(WARNINGS, found))


def _send_error(outbox: _Outbox, exc: BaseException) -> None:
    """Send ``exc`` to the loader, as ``sendable`` makes it."""
    error = sendable(exc, lambda e: pickle.loads(pickle.dumps(e, protocol=5)))
    outbox.write(encode("error", error))


def process_main(
    members: list[tuple[Connection, int, dict]],
    ahead: tuple[int, int | None],
    loader_pid: int,
    environment: dict[str, str],
) -> None:
    """A worker process: one lane, or several lanes each on a thread of its own (so that a lane
    blocked sending to the loader never holds up another). The plan is loaded once, for all,
    from the first lane's pipe, where the loader sends it after the start (``ship_plan``)."""
    # Ctrl-C in a terminal reaches the whole process group: the loader's process handles it and
    # stops its workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_loader(loader_pid)
    # Before anything starts a thread pool: pools read these when they are first used. BLAS
    # was loaded with numpy in the fork server, and is told instead.
    os.environ.update(environment)
    limit_loaded_blas(environment)
    forward_warnings()  # the training process shows them, through its own filters
    for conn, _, _ in members:
        _write_or_leave(conn, encode(READY, None))
    lane_ids = [lane_id for _, lane_id, _ in members]
    try:
        plan_bytes = members[0][0].recv_bytes()
    except (EOFError, OSError):  # the loader stopped the lane before sending the plan
        return
    plan = _load_plan(plan_bytes, lane_ids)
    del plan_bytes
    setup = None
    if isinstance(plan, Plan) and plan.sets_up:
        ctx = OperatorContext("process", tuple(lane_ids), plan.rank, plan.world_size, os.getpid())
        try:
            setup = OperatorSetup(plan.chain, ctx)
        except Exception as exc:  # every lane reports it: the loader fails on the first
            plan = exc  # type: ignore[assignment]
    try:
        if len(members) == 1:
            _lane_main(*members[0], plan, ahead, setup)
            return
        threads = [
            threading.Thread(
                target=_lane_main,
                args=(conn, lane_id, start, plan, ahead, setup),
                name=f"zephon-worker-lane-{lane_id}",
                daemon=True,
            )
            for conn, lane_id, start in members
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        if setup is not None:
            setup.teardown()


def _write_or_leave(conn: Connection, message: tuple[tuple, list[Any]]) -> None:
    with contextlib.suppress(LoaderGone):  # the lane's own loop finds the loader gone
        write(conn, message)


def _lane_main(
    conn: Connection,
    lane_id: int,
    start: dict,
    plan: Plan | Exception,
    ahead: tuple[int, int | None],
    setup: OperatorSetup | None = None,
) -> None:
    outbox = _Outbox(conn)
    watching = None
    try:
        if isinstance(plan, Exception):  # the plan could not be loaded, or set up
            raise plan
        if plan.timeout is not None:
            watching = _watch_storage(outbox, plan.timeout)
        runner = LaneRunner(plan, lane_id, setup=setup, **start)
        with contextlib.closing(runner.run()) as lane_items:
            _stream(outbox, lane_items, lane_id, ahead)
        _send_warnings(outbox)
        outbox.write(encode(END, None))
    except LoaderGone:
        return
    except BaseException as exc:
        error = exit_outside_operator(lane_id, exc) if isinstance(exc, SystemExit) else exc
        try:
            _send_warnings(outbox)
            _send_error(outbox, error)
        except LoaderGone:
            return
    finally:
        if watching is not None:
            watching.set()
    # Done or failed: stay until the loader closes its end, so that what we sent is read first
    # and our exit never looks like a death.
    try:
        while True:
            conn.recv()
    except (EOFError, OSError):
        pass
