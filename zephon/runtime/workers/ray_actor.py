"""The life of a Ray lane's actor: it runs one lane's runner and answers each ``next`` call with
the runner's next item list, which travels back through Ray's object store.

The class is plain Python; ``ray_lanes`` makes it an actor when the first Ray lane starts, so
importing this module never imports Ray.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator
from typing import Any

from zephon.ops.base import OperatorContext
from zephon.plan import Plan
from zephon.runtime.lanes.operator_setup import OperatorSetup
from zephon.runtime.lanes.runner import LaneRunner
from zephon.runtime.workers.pipe_messages import END
from zephon.runtime.workers.sent_errors import sendable
from zephon.runtime.workers.stopping import exit_outside_operator
from zephon.runtime.workers.worker_warnings import forward_warnings, take_warnings

#: What one ``next`` call answers: the kind (``"items"``, ``END`` or ``"error"``), the item list
#: or the error, and the warnings raised since the last answer.
Answer = tuple[str, Any, list[tuple[Any, ...]]]


def _picklable(exc: BaseException) -> BaseException:
    """``exc`` as it can travel to the loader (``sendable``). Ray carries it with cloudpickle, as
    it carried the plan: an error class of the training script (``__main__`` here is Ray's
    worker) travels by value and arrives as the script's own class."""
    from ray import cloudpickle

    return sendable(exc, lambda e: cloudpickle.loads(cloudpickle.dumps(e, protocol=5)))


class LaneActor:
    """One lane on a Ray actor. Its operators are set up here (``OperatorSetup``, as in a worker
    process); an error while starting is kept and answered by the first ``next`` call, so that
    the loader raises it as it would from any other kind of lane."""

    def __init__(self, plan: Plan, lane_id: int, start: dict[str, Any]):
        forward_warnings()  # the training process shows them, through its own filters
        self._lane_id = lane_id
        self._setup: OperatorSetup | None = None
        self._items: Generator[list, None, None] | None = None
        self._failed: BaseException | None = None
        try:
            if plan.sets_up:
                ctx = OperatorContext("ray", (lane_id,), plan.rank, plan.world_size, os.getpid())
                self._setup = OperatorSetup(plan.chain, ctx)
            self._items = LaneRunner(plan, lane_id, setup=self._setup, **start).run()
        except Exception as exc:
            self._failed = exc

    def where(self) -> tuple[str, str, int]:
        """The node id, the node's address and the pid the actor runs on (named when it dies)."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def next(self) -> Answer:
        """The runner's next item list; ``END`` once it is exhausted (and for every call after)."""
        if self._failed is not None:
            failed, self._failed = self._failed, None
            return "error", _picklable(failed), take_warnings()
        if self._items is None:
            return END, None, take_warnings()
        try:
            items = next(self._items)
        except StopIteration:
            self._items = None
            return END, None, take_warnings()
        except SystemExit as exc:
            self._items = None
            return "error", exit_outside_operator(self._lane_id, exc), take_warnings()
        except BaseException as exc:  # the loader raises it again
            self._items = None
            return "error", _picklable(exc), take_warnings()
        return "items", items, take_warnings()

    def stop(self) -> None:
        """Close the runner (its operator pools), tear the operators' setup down, and end the
        actor."""
        import ray

        try:
            if self._items is not None:
                with contextlib.suppress(Exception):
                    self._items.close()
            if self._setup is not None:
                self._setup.teardown()
        finally:
            ray.actor.exit_actor()
