"""The data-parallel position (rank, world size) of this process.

Asked in order: explicit arguments, an initialized ``torch.distributed`` process group, a JAX
runtime of more than one process, then the ``RANK`` / ``WORLD_SIZE`` environment variables; when
none of them says anything, rank 0 of 1. Only frameworks the program has already imported are
asked (nothing here imports torch or jax), and only through their public API. A source that
answers by halves (``RANK`` without ``WORLD_SIZE``) or fails to answer is a ``PlanError`` saying
how to pass ``rank=`` / ``world_size=``: a host never silently becomes rank 0 of 1.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zephon.errors import PlanError

__all__ = [
    "DataParallelRank",
    "from_device_mesh",
    "rank_from_env",
    "rank_from_jax",
    "rank_from_torch",
    "resolve_rank",
]

_PASS_IT = "pass rank= and world_size= to zephon.Pipeline"


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)``: the arguments, else the first framework or environment that
    knows, else ``(0, 1)``. One argument given is completed only by a framework whose position
    agrees with it: a given data-parallel rank with the job's whole world size (or the other way
    round) would leave lanes that no rank runs, so that is a ``PlanError`` naming both. Raises
    ``PlanError`` unless ``0 <= rank < world_size``."""
    if rank is None or world_size is None:
        where, found = _found_rank()
        r, w = found if found else (0, 1)
        if found and rank is not None and rank != r:
            raise _other_world(f"rank={rank}", where, r, w, "world_size=")
        if found and world_size is not None and world_size != w:
            raise _other_world(f"world_size={world_size}", where, r, w, "rank=")
        rank = r if rank is None else rank
        world_size = w if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise PlanError(
            f"rank must be in [0, world_size): got rank={rank}, world_size={world_size}"
        )
    return rank, world_size


def _found_rank() -> tuple[str, tuple[int, int] | None]:
    """The first framework or environment that knows this process's position, and its answer."""
    for where, ask in (
        ("the torch.distributed process group", rank_from_torch),
        ("the jax runtime", rank_from_jax),
        ("the RANK/WORLD_SIZE environment variables", rank_from_env),
    ):
        found = ask()
        if found:
            return where, found
    return "", None


def _other_world(given: str, where: str, r: int, w: int, missing: str) -> PlanError:
    return PlanError(
        f"{given} was given, but by {where} this process is rank {r} of {w}, another world "
        f"(a data-parallel position inside a larger job?): pass {missing} too (both from "
        "zephon.ranks.from_device_mesh under tensor or pipeline parallelism)"
    )


def rank_from_torch() -> tuple[int, int] | None:
    """The rank of an initialized ``torch.distributed`` default group, if torch is imported."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank(), dist.get_world_size()


def rank_from_jax() -> tuple[int, int] | None:
    """``(jax.process_index(), jax.process_count())`` when jax is imported and runs more than
    one process; None when it is not imported or runs one process (the environment decides)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    count = _ask_jax(jax, "process_count")
    if count <= 1:
        return None
    return _ask_jax(jax, "process_index"), count


def _ask_jax(jax: object, name: str) -> int:
    ask = getattr(jax, name, None)
    if not callable(ask):
        raise PlanError(
            f"jax is imported but has no jax.{name}() to tell this process's rank; {_PASS_IT}"
        )
    try:
        value = ask()
    except Exception as exc:
        raise PlanError(
            f"jax is imported but jax.{name}() failed ({type(exc).__name__}: {exc}), so the rank "
            f"of this process is unknown; {_PASS_IT}"
        ) from exc
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"jax.{name}() returned {value!r}, not an int; {_PASS_IT}")
    return value


def rank_from_env() -> tuple[int, int] | None:
    """``RANK`` / ``WORLD_SIZE`` as ints when both are set; None when neither is."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None and world is None:
        return None
    if rank is None or world is None:
        present, missing = ("RANK", "WORLD_SIZE") if world is None else ("WORLD_SIZE", "RANK")
        raise PlanError(
            f"{present} is set (to {os.environ[present]!r}) but {missing} is not: set both "
            f"environment variables, or {_PASS_IT}"
        )
    try:
        return int(rank), int(world)
    except ValueError as exc:
        raise PlanError(
            f"RANK/WORLD_SIZE environment variables are not integers: {exc}; set them to "
            f"integers, or {_PASS_IT}"
        ) from None


@dataclass(frozen=True)
class DataParallelRank:
    """This process's place among the data-parallel ranks of a parallel mesh: pass ``rank`` and
    ``world_size`` to ``zephon.Pipeline`` and ``group`` to ``job_state(..., group=...)``."""

    rank: int
    world_size: int
    group: Any  # the torch process group of this process's data-parallel peers


def from_device_mesh(mesh: Any, dp_dims: str | Sequence[str] = ("dp",)) -> DataParallelRank:
    """The data-parallel rank of this process in a torch ``DeviceMesh`` whose ``dp_dims`` (names
    of its dimensions, in order) are the data-parallel ones; the others (tensor, pipeline,
    context parallelism) hold ranks that must see the same batches. Call it on every rank of the
    mesh at the same point (with several data-parallel dimensions it creates one process group
    per data-parallel group, a collective call).

    Ranks that differ only along the other dimensions get the same ``rank``, so their pipelines
    deliver identical batches, and ``group`` gathers over the data-parallel peers only.
    """
    import torch.distributed as dist

    names = list(getattr(mesh, "mesh_dim_names", None) or ())
    dims = [dp_dims] if isinstance(dp_dims, str) else list(dp_dims)
    if not names:
        raise PlanError("from_device_mesh needs a DeviceMesh made with mesh_dim_names=")
    unknown = [d for d in dims if d not in names]
    if not dims or unknown or len(set(dims)) != len(dims):
        raise PlanError(
            f"from_device_mesh: dp_dims={dp_dims!r} must name distinct dimensions of the mesh "
            f"(its dimensions: {names})"
        )
    rank, world_size = 0, 1
    for dim in dims:  # the data-parallel coordinates, row-major in the order given
        rank = rank * mesh.size(names.index(dim)) + mesh.get_local_rank(dim)
        world_size *= mesh.size(names.index(dim))
    if len(dims) == 1:
        return DataParallelRank(rank, world_size, mesh.get_group(dims[0]))
    grid = mesh.mesh.permute(
        *[names.index(d) for d in names if d not in dims], *[names.index(d) for d in dims]
    )
    me, group = dist.get_rank(), None
    for others in itertools.product(*(range(n) for n in grid.shape[: len(names) - len(dims)])):
        members = [int(r) for r in grid[others].flatten().tolist()]
        made = dist.new_group(members)  # every rank creates every group, in the same order
        if me in members:
            group = made
    return DataParallelRank(rank, world_size, group)
