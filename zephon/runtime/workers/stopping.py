"""Every kind of lane's worker: how it is named, stopped, and its failures described.

Stopping is two-phase, so that many lanes stop in the time of one: ``request_stop()`` tells the
worker and never blocks; ``join(deadline)`` waits for it and, past the deadline, terminates and
then kills a worker process. ``close_lanes`` does both for many lanes at once, a lane's
``close()`` for one. No worker holds a reference to its lane, so a lane that becomes unreachable
is stopped by its finalizer at once, without waiting for a cyclic GC pass; finalizers act only in
the process that started the workers, never in a ``fork()``ed child.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable

from zephon.errors import FetchError, ZephonError
from zephon.runtime.workers.lane import STOP_TIMEOUT, Lane, LaneWorker
from zephon.sources.storage_waits import StorageWait

_TERMINATE_WAIT = 0.05  # SIGTERM ends a Python process at once unless it handles the signal
_KILL_WAIT = 1.0  # SIGKILL cannot be refused; only a process stuck in the kernel outlasts this
WORKER_NAME = "zephon-lane-"


def join_workers(workers: list[LaneWorker], deadline: float) -> bool:
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


def stop_workers(workers: list[LaneWorker], timeout: float) -> None:
    """A lane's finalizer: ask every worker to stop, then join them with one deadline."""
    for worker in workers:
        worker.request_stop()
    join_workers(workers, time.monotonic() + timeout)


def close_lanes(lanes: Iterable[Lane], timeout: float = STOP_TIMEOUT) -> None:
    """Stop many lanes in the time of one: ask every lane's worker to stop, then wait for all of
    them with a single deadline ``timeout`` seconds away, past which worker processes still
    running are terminated, then killed. Idempotent; a lane may appear more than once.

    The loader's ``close()`` should call this once with all its lanes rather than closing them
    one after the other, which adds up one deadline per busy lane.
    """
    lanes = list(lanes)
    for lane in lanes:
        lane.request_stop()
    workers = [worker for lane in lanes for worker in lane.release()]
    join_workers(workers, time.monotonic() + timeout)


class WorkerLane(Lane):
    """A lane with a worker of its own (a thread, a process), and how that worker is stopped.
    ``_watch`` is called once as the lane is set up; from then on the worker is stopped by
    ``close()``, by ``close_lanes``, or by the lane's finalizer when the lane is collected
    unclosed (the finalizer holds the worker, never the lane)."""

    _worker: LaneWorker
    _closed: bool

    def _watch(self, worker: LaneWorker) -> None:
        self._worker = worker
        self._closed = False
        self._finalizer = weakref.finalize(self, stop_workers, [worker], STOP_TIMEOUT)

    def request_stop(self) -> None:
        """Tell the worker to stop; never blocks."""
        self._closed = True
        self._worker.request_stop()

    def join(self, deadline: float) -> bool:
        """Wait until ``deadline`` (``time.monotonic()``) for the worker to stop; whether it did.
        A worker process still running then is terminated, then killed; a thread busy inside an
        operator stops by itself once the operator returns."""
        return join_workers(self.release(), deadline)

    def release(self) -> list[LaneWorker]:
        """The lane's worker, once: later calls (and the finalizer) have nothing left to stop."""
        return [self._worker] if self._finalizer.detach() is not None else []

    def close(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop the lane, giving its worker ``timeout`` seconds (then a worker process is
        terminated); idempotent."""
        close_lanes([self], timeout)


def closed_error(lane_id: int) -> ZephonError:
    """The error of ``next()`` on a lane after its ``close()``."""
    return ZephonError(f"lane {lane_id} is closed: it delivers nothing after close()")


def exit_outside_operator(lane_id: int, exc: SystemExit) -> ZephonError:
    """The error for a ``sys.exit`` in a lane's source or an operator's ``start_epoch``."""
    # An operator's sys.exit is reported by the lane runner, naming the operator and the record.
    return ZephonError(
        f"lane {lane_id} called sys.exit({exc.code!r}) outside any operator (in the source or "
        "an operator's start_epoch): a lane may not end the training process, raise an "
        "exception instead"
    )


def timed_out(
    lane_id: int, where: str, timeout: float, storage: StorageWait | None = None
) -> ZephonError:
    """The error for a lane whose worker (``where``) sent nothing within the plan's timeout:
    a FetchError naming the remote operation when the worker was waiting on ``storage``."""
    if storage is not None:
        return FetchError(
            f"lane {lane_id} ({where}) produced nothing for {timeout:g} s, the pipeline's "
            f"timeout, waiting on storage for {storage.waited:.1f} s: {storage.what} (storage "
            f"deadline: {storage.deadline}, not reached yet). Check that the storage endpoint "
            "answers; give the source a timeout= and total_timeout= within the pipeline's "
            "timeout to have storage failures reported by the source, or raise "
            "Pipeline(timeout=...)"
        )
    return ZephonError(
        f"lane {lane_id} ({where}) produced nothing for {timeout:g} s, the pipeline's timeout: "
        "its worker is stuck in an operator or stopped (SIGSTOP, a debugger). If the lane is "
        "only slow, raise Pipeline(timeout=...)"
    )
