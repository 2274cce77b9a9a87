"""The kinds of lane a pipeline may run on (``Pipeline(workers=...)``), by name.

A kind is a ``Lane`` implementation and an opener registered here; the planner accepts the
registered names, and ``kinds.open_lanes`` and ``feeds.start_feeds`` open lanes through the
registry only. The built-in kinds (``inline``, ``thread``, ``process``, ``ray``) are registered
at the bottom of this module, as any other kind would be.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from zephon.errors import PlanError
from zephon.plan import Plan
from zephon.runtime.workers import first_reads
from zephon.runtime.workers.fork_server import start_fork_server
from zephon.runtime.workers.inline import open_inline_lanes
from zephon.runtime.workers.lane import Lane
from zephon.runtime.workers.pickled_plan import PlanParcel
from zephon.runtime.workers.processes import ProcessLane
from zephon.runtime.workers.ray_lanes import RayStart, loader_reads_first, open_ray_lanes
from zephon.runtime.workers.threads import open_thread_lanes


class LaneOpener(Protocol):
    """Starts the lanes ``members`` (lane id, ``LaneRunner`` keyword arguments), which share one
    worker (at most ``Plan.processes`` workers per rank), and returns one ``Lane`` per member, in
    order. ``shared`` is what the kind's ``make_shared`` made for this start (None without one)."""

    def __call__(
        self, plan: Plan, members: list[tuple[int, dict]], shared: Any, /
    ) -> Sequence[Lane]: ...


@dataclasses.dataclass(frozen=True)
class LaneKind:
    """How lanes of one kind are started; see ``register_lane_kind``."""

    name: str
    opener: LaneOpener
    setup_in_workers: bool = False
    make_shared: Callable[[Plan], Any] | None = None
    loader_reads_first: Callable[[Plan, int], bool] | None = None
    warm_up: Callable[[Any], None] | None = None

    def shared_for(self, plan: Plan) -> Any:
        """What every opener call of one start of ``plan``'s lanes shares (None without one)."""
        return None if self.make_shared is None else self.make_shared(plan)


_kinds: dict[str, LaneKind] = {}


def register_lane_kind(
    name: str,
    opener: LaneOpener,
    *,
    setup_in_workers: bool = False,
    make_shared: Callable[[Plan], Any] | None = None,
    loader_reads_first: Callable[[Plan, int], bool] | None = None,
    warm_up: Callable[[Any], None] | None = None,
) -> LaneKind:
    """Make ``Pipeline(workers=name)`` run its lanes with ``opener``.

    ``setup_in_workers``: the kind's workers set the operators up themselves (as worker processes
    do with ``lanes.operator_setup.OperatorSetup``); otherwise every lane's runner is handed the
    training process's setup (the ``setup`` runner argument). ``make_shared(plan)``: made once
    per start of many lanes, passed to each opener call (worker processes: the plan, pickled
    once). ``loader_reads_first(plan, n_lanes)``: whether, while the workers start, the loader
    reads the first lanes' first item lists itself (``first_reads``); the workers are then
    opened on a thread, after ``warm_up(shared)`` (worker processes: the fork server's imports).
    A name registered again is refused.
    """
    if not isinstance(name, str) or not name:
        raise PlanError(f"a lane kind's name must be a non-empty str, got {name!r}")
    if name in _kinds:
        raise PlanError(f"a lane kind named {name!r} is registered already; choose another name")
    kind = LaneKind(name, opener, setup_in_workers, make_shared, loader_reads_first, warm_up)
    _kinds[name] = kind
    return kind


def unregister_lane_kind(name: str) -> None:
    """Forget the lane kind ``name`` (a pipeline that names it is refused from then on)."""
    _kinds.pop(name, None)


def lane_kind_names() -> tuple[str, ...]:
    """The names ``Pipeline(workers=...)`` accepts, in the order they were registered."""
    return tuple(_kinds)


def lane_kind(name: str) -> LaneKind:
    """The registered lane kind ``name``; a ``PlanError`` naming the known kinds otherwise."""
    kind = _kinds.get(name) if isinstance(name, str) else None
    if kind is None:
        raise PlanError(
            f"Pipeline workers must be one of {lane_kind_names()}, got {name!r}; a new kind "
            "of lane is registered with zephon.runtime.workers.registry.register_lane_kind"
        )
    return kind


def _boot_fork_server(parcel: PlanParcel) -> None:
    start_fork_server(parcel.preload)


register_lane_kind("inline", open_inline_lanes)
register_lane_kind("thread", open_thread_lanes)
register_lane_kind(
    "process",
    ProcessLane.group,
    setup_in_workers=True,
    make_shared=PlanParcel,
    loader_reads_first=first_reads.applies,
    warm_up=_boot_fork_server,
)
register_lane_kind(
    "ray",
    open_ray_lanes,
    setup_in_workers=True,
    make_shared=RayStart,
    loader_reads_first=loader_reads_first,
)
