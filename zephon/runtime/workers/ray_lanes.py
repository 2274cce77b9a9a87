"""Lanes that run on Ray actors (``workers="ray"``), the loader's side: starting one actor per
lane, keeping at most ``prefetch`` ``next`` calls outstanding on it, taking their answers from
Ray's object store in order, and reporting an actor that died or timed out.

Ray is imported when the first Ray lane starts, never by ``import zephon``. The training process
connects first with ``ray.init(address=...)``; otherwise the first start calls ``ray.init()``,
which joins the cluster ``RAY_ADDRESS`` names, or starts a local one.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import time
from typing import Any

from zephon.errors import PlanError, WorkerLostError, ZephonError
from zephon.plan import Plan
from zephon.runtime.workers.inflight_bytes import has_room, item_list_bytes
from zephon.runtime.workers.pickled_plan import unpicklable_culprit
from zephon.runtime.workers.pipe_messages import END
from zephon.runtime.workers.ray_actor import LaneActor
from zephon.runtime.workers.stopping import WorkerLane, closed_error, timed_out
from zephon.runtime.workers.worker_warnings import reraise

_actor_class: Any = None  # LaneActor as a Ray actor class, made once Ray is imported
_forked_connected = False  # this process is a fork of one connected to Ray


def _note_fork() -> None:
    """In a forked child: whether it inherited its parent's Ray connection, which a fork
    cannot share (using it crashes the parent's connection and hangs the child)."""
    global _forked_connected
    ray = sys.modules.get("ray")
    _forked_connected = _forked_connected or (ray is not None and ray.is_initialized())


os.register_at_fork(after_in_child=_note_fork)


def _ray() -> Any:
    """The ``ray`` module, connected (``ray.init()`` on first use when the script did not)."""
    if _forked_connected:
        import multiprocessing as mp

        raise PlanError(
            f"workers='ray' cannot run in process {mp.current_process().name} (pid "
            f"{os.getpid()}), forked from a process connected to Ray (a torch DataLoader "
            "worker, a multiprocessing worker): Ray's connection does not survive a fork. Run "
            "the loader in the connected process (DataLoader num_workers=0; the lanes already "
            "parallelize), or use another workers= inside such a process"
        )
    try:
        import ray
    except ImportError:
        raise PlanError("workers='ray' needs Ray: pip install 'zephon-loader[ray]'") from None
    if not ray.is_initialized():
        ray.init()
    return ray


class RayStart:
    """What every actor of one start receives: the plan, put in Ray's object store once, and the
    actor class with the pipeline's ``ray_options``."""

    def __init__(self, plan: Plan):
        global _actor_class
        ray = _ray()
        try:
            self.plan_ref = ray.put(plan)
        except Exception as exc:
            # Ray pickles with cloudpickle (lambdas travel); its own error dumps the whole plan.
            what, why = unpicklable_culprit(plan, exc, ray.cloudpickle.dumps)
            raise PlanError(
                f"workers='ray' needs a pipeline Ray can serialize, but {what} cannot be "
                f"serialized ({type(why).__name__}: {why}): define operators and the callables "
                "they hold at module level, and open locks, files and connections in "
                "start_epoch or on first use rather than in __init__"
            ) from None
        if _actor_class is None:
            _actor_class = ray.remote(LaneActor)
        # A lane never restarts on its own: its stream is only exact from a checkpoint.
        self.actor_class = _actor_class.options(
            max_restarts=0, max_task_retries=0, **(plan.ray_options or {})
        )


class _RayWorker:
    """Stops a lane's actor: ``stop`` is queued behind the outstanding ``next`` calls (the runner
    closes and the operators' setup is torn down); an actor still busy at the deadline is
    killed (``ray.kill``). Holds the actor handle, never the lane."""

    forcible = True

    def __init__(self, actor: Any):
        self.actor = actor
        self.owner_pid = os.getpid()
        self._stopping: Any = None  # the ObjectRef of the stop call, failed once the actor ends

    def request_stop(self) -> None:
        if os.getpid() != self.owner_pid or self._stopping is not None:
            return
        ray = _connected()
        if ray is not None:
            try:
                self._stopping = self.actor.stop.remote()
            except Exception:  # the actor is gone already
                self._stopping = None

    def wait(self, deadline: float) -> bool:
        ray = _connected()
        if ray is None or self._stopping is None or os.getpid() != self.owner_pid:
            return True
        try:
            ready, _ = ray.wait([self._stopping], timeout=max(0.0, deadline - time.monotonic()))
        except Exception:  # Ray shut down meanwhile: its actors ended with it
            return True
        return bool(ready)

    def terminate(self) -> None:
        ray = _connected()
        if ray is not None and os.getpid() == self.owner_pid:
            with contextlib.suppress(Exception):  # already gone, or Ray shut down meanwhile
                ray.kill(self.actor, no_restart=True)

    kill = terminate


def _connected() -> Any:
    """The ``ray`` module while this process is connected to a cluster, else None."""
    ray = sys.modules.get("ray")
    return ray if ray is not None and ray.is_initialized() else None


class RayLane(WorkerLane):
    """The lane runs on a Ray actor of its own; at most ``prefetch`` item lists are made ahead.

    The item lists come back through Ray's object store (numpy arrays without a copy, read-only
    where Ray maps them from shared memory). An actor that dies is reported by ``next()`` as a
    ``WorkerLostError`` naming the lane, the actor and its node; the plan's ``timeout`` applies
    to every ``next()``, the first one (the actor's placement and start) included.
    """

    _worker: _RayWorker

    def __init__(self, plan: Plan, lane_id: int, start: dict[str, Any], shared: RayStart):
        self.lane_id = lane_id
        self.timeout = plan.timeout
        actor = shared.actor_class.remote(shared.plan_ref, lane_id, start)
        self.actor = actor  # the handle: ray.kill(lane.actor) ends the lane's actor
        self.actor_id: str = actor._actor_id.hex()
        self._where = actor.where.remote()  # answered once the actor runs
        self._prefetch = plan.prefetch
        # ``max_inflight_bytes``: the lists asked for ahead are taken to be as large as the
        # latest one (their answers lie in the object store until ``next()`` gets them).
        self._max_bytes = plan.max_inflight_bytes
        self._latest_bytes = 0
        self._pending: collections.deque[Any] = collections.deque()
        self._ask_ahead()
        self._node: tuple[str, str, int] | None = None  # node id, its address, the actor's pid
        self._ended = False
        self._watch(_RayWorker(actor))

    def queued(self) -> int:
        """Answers of outstanding ``next`` calls that arrived and ``next()`` has not taken."""
        ray = _connected()
        if ray is None or self._closed or not self._pending:
            return 0
        ready, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)
        return len(ready)

    def request_stop(self) -> None:
        """Tell the actor to stop; what it made ahead is dropped from the object store."""
        self._pending.clear()
        super().request_stop()

    def __next__(self) -> list:
        if self._closed:
            raise closed_error(self.lane_id)
        if self._ended:
            raise StopIteration
        import ray  # imported when the lane started

        if not ray.is_initialized():  # ray.get would start a new cluster, without this actor
            self.close()
            raise WorkerLostError(
                f"lane {self.lane_id} (Ray actor {self.actor_id}) cannot go on: this process "
                "disconnected from Ray (ray.shutdown()), which ends the actors it started. "
                "Resume from the last checkpoint (on Ray or with any other workers=)"
            ).add_context(lane=self.lane_id, actor=self.actor_id)
        ref = self._pending[0]
        try:
            kind, value, warned = ray.get(ref, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            assert self.timeout is not None
            raise timed_out(self.lane_id, self._describe(ray), self.timeout) from None
        except ray.exceptions.RayActorError as exc:
            raise self._lost(ray, exc) from None
        except ray.exceptions.RayError as exc:  # e.g. an item list Ray could not deserialize
            self.close()
            raise ZephonError(
                f"lane {self.lane_id} ({self._describe(ray)}) could not hand over its item list: "
                f"{type(exc).__name__}: {exc}"
            ).add_context(lane=self.lane_id, actor=self.actor_id) from None
        self._pending.popleft()
        if self._node is None:  # the actor answered, so it has said where it runs
            self._node = ray.get(self._where)
        reraise(warned)  # here, where the training script's filters apply
        if kind == "error":
            self.close()
            raise value
        if kind == END:
            self._ended = True
            self._pending.clear()
            raise StopIteration
        if self._max_bytes is not None:
            self._latest_bytes = item_list_bytes(value)
        self._ask_ahead()
        return value

    def _ask_ahead(self) -> None:
        """Keep ``prefetch`` ``next`` calls outstanding, fewer when their lists would hold more
        than ``max_inflight_bytes`` (never none: one list larger than the bound still comes)."""
        pending = self._pending
        while len(pending) < self._prefetch and (
            not pending
            or self._max_bytes is None
            or has_room(len(pending) * self._latest_bytes, self._max_bytes)
        ):
            pending.append(self.actor.next.remote())

    def queued_bytes(self) -> int:
        """The payload bytes of the lists asked for ahead, as estimated from the latest one
        (counted only under ``max_inflight_bytes``)."""
        return len(self._pending) * self._latest_bytes

    def _describe(self, ray: Any, dead: bool = False) -> str:
        """``Ray actor <id> on node <id> (<address>), pid <pid>``, or that it never started."""
        if self._node is None:
            ready, _ = ray.wait([self._where], timeout=0)
            with contextlib.suppress(ray.exceptions.RayError):
                self._node = ray.get(ready[0]) if ready else None
        if self._node is not None:
            node, address, pid = self._node
            return f"Ray actor {self.actor_id} on node {node} ({address}), pid {pid}"
        if dead:
            return f"Ray actor {self.actor_id}, before it started on any node"
        return (
            f"Ray actor {self.actor_id}, not started yet: no node of the cluster has room for "
            "it (its ray_options), or it is still starting"
        )

    def _lost(self, ray: Any, exc: Exception) -> WorkerLostError:
        """The error for an actor that died, after stopping the lane."""
        where = self._describe(ray, dead=True)
        self.close()
        lines = str(exc).strip().splitlines()
        reason = lines[-1].rstrip(".") if lines else type(exc).__name__
        error = WorkerLostError(
            f"lane {self.lane_id} ({where}) died: {reason}. The lane cannot go on: resume from "
            "the last checkpoint (on Ray or with any other workers=)"
        )
        error.add_context(lane=self.lane_id, actor=self.actor_id)
        return error


def loader_reads_first(plan: Plan, n_lanes: int) -> bool:
    """Whether the loader reads the first lanes itself while their actors start (each a fresh
    interpreter importing the plan's modules: seconds), as it does for process lanes
    (``first_reads``): where nothing is lost by it, a plan that snapshots its holders, sets no
    operator up (its operators are set up in the actors only) and has no ``timeout``."""
    return plan.timeout is None and plan.restores_holdings and not plan.sets_up


def open_ray_lanes(plan: Plan, members: list[tuple[int, dict]], shared: RayStart) -> list[RayLane]:
    """One Ray actor per lane of ``members`` (lane id, runner start): Ray, not ``processes``,
    decides where each runs (``Pipeline(ray_options=...)``)."""
    return [RayLane(plan, lane_id, start, shared) for lane_id, start in members]
