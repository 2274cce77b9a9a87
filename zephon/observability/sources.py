"""What a metric reads: the counters of a loader, a torch dataset, or a dataloader around one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StatsSource:
    """How to read one rank's counters (``stats()``), which rank they are, and the plan they
    are of (None when the source has none: its ``workers`` and ``prefetch`` are unknown)."""

    read: Callable[[], dict[str, Any]]
    rank: int
    world_size: int
    plan: Any = None


def stats_source(source: Any) -> StatsSource:
    """``source`` as a ``StatsSource``: a ``Loader``, anything with a ``stats()`` method and a
    ``pipeline`` (the torch dataset), or a dataloader whose ``dataset`` is one of those."""
    if isinstance(source, StatsSource):
        return source
    target = source
    if not hasattr(target, "stats") and hasattr(target, "dataset"):
        target = target.dataset  # a (Stateful)DataLoader around our dataset
    read = getattr(target, "stats", None)
    if not callable(read):
        raise TypeError(
            "metrics need a zephon Loader, the torch dataset of zephon.integrations.torch, or a "
            f"DataLoader around it; got {type(source).__name__}"
        )
    plan = getattr(target, "plan", None)
    if plan is None and hasattr(target, "pipeline"):
        plan = target.pipeline.compile()
    rank = getattr(plan, "rank", 0)
    world = getattr(plan, "world_size", 1)
    return StatsSource(read, int(rank), int(world), plan)
