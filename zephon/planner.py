"""Pipeline -> Plan: validation, the eviction path, ranks and the fingerprint. Nothing runs here."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from zephon.errors import PlanError
from zephon.ops.base import Operator, OpTraits

if TYPE_CHECKING:
    from zephon.runtime.loader import Loader
    from zephon.sources.base import WorkSource

WORKER_KINDS = ("inline", "thread", "process")


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The data-parallel position: arguments, else an initialized torch.distributed group, else
    an initialized JAX runtime, else ``RANK``/``WORLD_SIZE``, else 0 / 1. Never imports torch."""
    if rank is None or world_size is None:
        found = _rank_from_torch() or _rank_from_jax() or _rank_from_env()
        r, w = found if found else (0, 1)
        rank = r if rank is None else rank
        world_size = w if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise PlanError(
            f"rank must be in [0, world_size): got rank={rank}, world_size={world_size}"
        )
    return rank, world_size


def _rank_from_torch() -> tuple[int, int] | None:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank(), dist.get_world_size()


def _rank_from_jax() -> tuple[int, int] | None:
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    try:
        from jax._src import distributed  # only set when jax.distributed.initialize() ran

        if distributed.global_state.client is None:
            return None
        return jax.process_index(), jax.process_count()
    except Exception:
        return None


def _rank_from_env() -> tuple[int, int] | None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        try:
            return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        except ValueError as exc:
            raise PlanError(
                f"RANK/WORLD_SIZE environment variables are not integers: {exc}"
            ) from None
    return None


@dataclasses.dataclass(frozen=True)
class Plan:
    """A validated pipeline: which operator does what, the eviction path, and the fingerprint."""

    source: WorkSource
    fetch: Operator
    chain: tuple[Operator, ...]
    batcher: Operator | None
    eviction_path: str
    path_reason: str
    indexable: bool
    lanes: int
    workers: str
    epoch_chunks: int
    micro_batch: int
    prefetch: int
    deterministic: bool
    strict: bool
    rank: int
    world_size: int
    fingerprint: str
    fingerprint_parts: dict[str, Any]

    def describe(self) -> str:
        """A readable summary: operators, traits, workers, eviction path and why."""
        lines = [
            f"Plan {self.fingerprint[:12]}: {self.lanes} lane(s) x workers={self.workers!r}, "
            f"rank {self.rank}/{self.world_size}, micro-batches of {self.micro_batch}",
            f"  source: {type(self.source).__name__}",
        ]
        for op in (self.fetch, *self.chain, *((self.batcher,) if self.batcher else ())):
            t = op.traits
            flags = [
                "order-preserving" if t.preserves_cursor_order else "reorders",
                "stateful" if t.stateful else "stateless",
            ]
            if t.batch_sensitive:
                flags.append("batch-sensitive")
            if t.preserves_indexability:
                flags.append("indexable")
            where = " (at delivery)" if op.groups_at_delivery else ""
            lines.append(f"  - {op.name}{where}: {', '.join(flags)}, workers={t.workers or 1}")
        lines.append(f"  eviction path: {self.eviction_path} ({self.path_reason})")
        if self.eviction_path == "epoch":
            lines.append(f"  epochs of {self.epoch_chunks} chunks per lane")
        if self.indexable:
            lines.append(
                "  restore skips consumed samples at the source (every operator indexable)"
            )
        return "\n".join(lines)


class Pipeline:
    """A source and a chain of operators: ``fetch`` first, optionally ``batch`` last.

    The delivered stream is a pure function of the definition, the data, ``lanes``,
    ``epoch_chunks``, ``rank`` and ``world_size`` (with ``deterministic=True``).
    """

    def __init__(
        self,
        source: WorkSource,
        ops: Sequence[Operator],
        *,
        lanes: int = 1,
        workers: str = "inline",
        epoch_chunks: int = 8,
        deterministic: bool = True,
        strict: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        prefetch: int = 2,
        micro_batch: int = 256,
    ):
        self.source = source
        self.ops = list(ops)
        self.lanes = lanes
        self.workers = workers
        self.epoch_chunks = epoch_chunks
        self.deterministic = deterministic
        self.strict = strict
        self.rank = rank
        self.world_size = world_size
        self.prefetch = prefetch
        self.micro_batch = micro_batch

    def compile(self) -> Plan:
        """Plan without running anything; errors are ``PlanError`` naming the operator."""
        for name, value in (
            ("lanes", self.lanes),
            ("epoch_chunks", self.epoch_chunks),
            ("prefetch", self.prefetch),
            ("micro_batch", self.micro_batch),
        ):
            if not isinstance(value, int) or value < 1:
                raise PlanError(f"Pipeline {name} must be an int >= 1, got {value!r}")
        if self.workers not in WORKER_KINDS:
            raise PlanError(f"Pipeline workers must be one of {WORKER_KINDS}, got {self.workers!r}")
        ops = self.ops
        if not ops:
            raise PlanError("a pipeline needs at least the fetch operator")
        for i, op in enumerate(ops):
            label = f"operator #{i} ({getattr(op, 'name', type(op).__name__)})"
            if not isinstance(op, Operator):
                raise PlanError(f"{label} is not a zephon.ops.Operator: {op!r}")
            if not isinstance(getattr(op, "traits", None), OpTraits):
                raise PlanError(
                    f"{label} declares no OpTraits: "
                    "set `traits = OpTraits(preserves_cursor_order=...)`"
                )
            if op.consumes_pointers and i != 0:
                raise PlanError(f"{label} reads pointers and must be the first operator")
            if op.groups_at_delivery and i != len(ops) - 1:
                raise PlanError(
                    f"{label} groups records into batches and must be the last operator"
                )
            workers = op.traits.workers or 1
            if self.deterministic and op.traits.stateful and workers > 1:
                raise PlanError(
                    f"{label} is stateful and cannot run with {workers} workers in deterministic "
                    "mode: set workers=1 or deterministic=False"
                )
        if not ops[0].consumes_pointers:
            raise PlanError(f"the first operator must be fetch, got {ops[0].name!r}")
        # Plan-time facts flow downstream: each operator may publish some (``provides()``, e.g.
        # a tokenizer's pad id) and is handed those of the operators before it
        # (``use_upstream_facts(facts)``, which raises PlanError when a fact it needs is missing).
        facts: dict[str, Any] = {}
        for op in ops:
            use = getattr(op, "use_upstream_facts", None)
            if use is not None:
                use(dict(facts))
            provides = getattr(op, "provides", None)
            if provides is not None:
                facts.update(provides())
        fetch_op = ops[0]
        batcher = ops[-1] if len(ops) > 1 and ops[-1].groups_at_delivery else None
        chain = tuple(ops[1 : len(ops) - (1 if batcher else 0)])

        reorder = [op.name for op in chain if not op.traits.preserves_cursor_order]
        stateful = [op.name for op in chain if op.traits.stateful]
        if reorder or stateful:
            path = "epoch"
            why = "; ".join(
                part
                for part in (
                    f"reorders: {', '.join(reorder)}" if reorder else "",
                    f"keeps state: {', '.join(stateful)}" if stateful else "",
                )
                if part
            )
        else:
            path = "monotone"
            why = "every operator preserves cursor order and keeps no state"
        indexable = path == "monotone" and all(op.traits.preserves_indexability for op in chain)

        rank, world_size = resolve_rank(self.rank, self.world_size)
        parts = self._fingerprint_parts(world_size)
        return Plan(
            source=self.source,
            fetch=fetch_op,
            chain=chain,
            batcher=batcher,
            eviction_path=path,
            path_reason=why,
            indexable=indexable,
            lanes=self.lanes,
            workers=self.workers,
            epoch_chunks=self.epoch_chunks,
            micro_batch=self.micro_batch,
            prefetch=self.prefetch,
            deterministic=self.deterministic,
            strict=self.strict,
            rank=rank,
            world_size=world_size,
            fingerprint=_digest(parts),
            fingerprint_parts=parts,
        )

    def _fingerprint_parts(self, world_size: int) -> dict[str, Any]:
        return {
            "source": _digest(self.source.describe()),
            "operators": _digest([op.describe() for op in self.ops]),
            "lanes": self.lanes,
            "epoch_chunks": self.epoch_chunks,
            "micro_batch": self.micro_batch,
            "world_size": world_size,
        }

    @property
    def fingerprint(self) -> str:
        """A stable hex digest of source, operators, parameters, lanes, epochs and world size."""
        return _digest(self._fingerprint_parts(resolve_rank(self.rank, self.world_size)[1]))

    def iter(self, state: dict | None = None) -> Loader:
        """A loader over this pipeline, continuing exactly where ``state`` was taken when given."""
        from zephon.runtime.loader import Loader

        loader = Loader(self.compile())
        if state is not None:
            loader.load_state_dict(state)
        return loader

    def __iter__(self) -> Loader:
        return self.iter()
