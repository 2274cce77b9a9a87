"""Where a loader state sits inside a torchdata ``StatefulDataLoader``'s state: at
``dataset_state`` when the DataLoader runs its dataset itself (``num_workers=0``), in its one
worker's snapshot when a worker process runs it (``num_workers=1``). Plain dicts only: nothing
here imports torch, so ``zephon.skip_steps``, ``zephon.merge_states`` and
``zephon.save_rank_state`` take such states too."""

from __future__ import annotations

from typing import Any

_IN_PROCESS = ("dataset_state",)
_IN_WORKER = ("_snapshot", "_worker_snapshots", "worker_0", "dataset_state")


def dataset_state_path(state: Any) -> tuple[str, ...] | None:
    """The keys leading to the dataset's state in a ``StatefulDataLoader``'s ``state``; None when
    ``state`` is not one (a loader state of its own, for instance)."""
    if not isinstance(state, dict) or "format" in state:
        return None
    for path in (_IN_PROCESS, _IN_WORKER):
        node: Any = state
        for key in path:
            if not isinstance(node, dict) or key not in node:
                break
            node = node[key]
        else:
            if path == _IN_PROCESS or len(state["_snapshot"]["_worker_snapshots"]) == 1:
                return path
    return None


def dataset_state(state: dict[str, Any], path: tuple[str, ...]) -> Any:
    """The dataset's state at ``path`` (``dataset_state_path``) in ``state``."""
    for key in path:
        state = state[key]
    return state


def with_dataset_state(state: dict[str, Any], path: tuple[str, ...], inner: Any) -> dict[str, Any]:
    """A copy of ``state`` holding ``inner`` as the dataset's state at ``path``; the rest shared."""
    key, *rest = path
    return {**state, key: with_dataset_state(state[key], tuple(rest), inner) if rest else inner}


def unwrapped(state: Any) -> Any:
    """The dataset's state in a ``StatefulDataLoader``'s ``state`` (with or without a worker
    process), else ``state`` itself."""
    path = dataset_state_path(state)
    return state if path is None else dataset_state(state, path)
