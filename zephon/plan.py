"""A compiled pipeline: which operator does what, the eviction path, and the fingerprint.

``Plan`` is what the runtime runs; it is made by ``Pipeline.compile()`` (``zephon.planner``) and
imports nothing from the runtime.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zephon.ops.base import Grouper, Operator, PointerReader
    from zephon.sources.base import WorkSource


def digest(obj: Any) -> str:
    """The stable hex digest fingerprints are made of (sorted keys, plain JSON)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Plan:
    """A validated pipeline: which operator does what, the eviction path, and the fingerprint."""

    source: WorkSource
    fetch: PointerReader
    chain: tuple[Operator, ...]
    batcher: Grouper | None
    eviction_path: str
    path_reason: str
    indexable: bool
    lanes: int  # the job's lanes, on all ranks together
    workers: str
    epoch_chunks: int
    micro_batch: int
    prefetch: int
    strict: bool
    rank: int
    world_size: int
    fingerprint: str
    fingerprint_parts: dict[str, Any]
    #: Some chain operator's output depends on how records are grouped into micro-batches.
    batch_sensitive: bool = False
    #: Tombstone tags the operators asked to have counted in ``stats()``.
    counted_tags: tuple[str, ...] = ()
    #: Warn once when an operator's carry state grows past this many bytes of JSON (0: never).
    carry_warn_bytes: int = 65536
    #: Seconds a thread or process lane may take to produce its next item list; None: no limit.
    #: Not part of the fingerprint: it changes how long the loader waits, never what it delivers.
    timeout: float | None = None
    #: Worker processes (``workers="process"``) or threads (``"thread"``) running this rank's
    #: lanes; never part of the fingerprint: the stream does not depend on it.
    processes: int = 1
    #: A checkpoint taken with another lane count continues on this one (every sample it delivers
    #: still delivered exactly once, batches differ); False refuses it. Not part of the
    #: fingerprint.
    relane: bool = True
    #: Every stateful operator can describe what it holds, and what it holds can be rebuilt
    #: from re-read samples: lanes send snapshots, and a restore rebuilds the operators instead
    #: of replaying the epoch. Not part of the fingerprint: the stream is the same either way.
    restores_holdings: bool = False
    #: Some chain operator has a ``setup`` or ``teardown``: each worker sets up its own copies
    #: (``runtime.operator_setup``), and the training process never runs a process lane's.
    sets_up: bool = False
    #: ``"carry"``: every lane hands over as many items as the job's shortest lane, so every
    #: rank ends at the same global step; ``"allow"``: every lane runs to its end. Not part of
    #: the fingerprint: it decides where the stream stops, never what comes before.
    uneven_end: str = "allow"
    #: Per chain operator: a record it raises on is skipped (``Pipeline(on_error=...)``) rather
    #: than ending the run. Not part of the fingerprint: the stream is the same until an error.
    skip_errors: tuple[bool, ...] = ()
    #: A sample ``fetch`` cannot read or decode is skipped (never a storage error).
    skip_fetch_errors: bool = False
    #: The most records this rank's loader may skip over the run; None: no limit.
    max_skipped: int | None = None
    #: How each lane's Ray actor is placed (``workers="ray"``): ``ray_options`` as checked by the
    #: planner. Not part of the fingerprint: where a lane runs never changes what it delivers.
    ray_options: dict[str, Any] | None = None
    #: The most payload bytes a thread, process or Ray lane holds ready ahead of the loader (beyond
    #: one list larger than that); None: only ``prefetch`` bounds the read-ahead. Not part of
    #: the fingerprint: it changes when item lists are made, never what they hold.
    max_inflight_bytes: int | None = None

    @property
    def rank_lanes(self) -> range:
        """The global lanes this rank runs: a contiguous block of ``lanes // world_size``."""
        per_rank = self.lanes // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    @property
    def reorders_epochs(self) -> bool:
        """On the epoch path behind an operator that reorders records: where a checkpoint
        keeps what each lane consumed of its epoch by position, and a resume with changed
        operators or retired samples continues the epoch by position."""
        return self.eviction_path == "epoch" and not all(
            op.traits.preserves_cursor_order for op in self.chain
        )

    def describe(self) -> str:
        """A readable summary: operators, traits, workers, eviction path and why."""
        lines = [
            f"Plan {self.fingerprint[:12]}: {self.lanes} lane(s) in the job, workers="
            f"{self.workers!r}; rank {self.rank} of {self.world_size} runs lanes "
            f"{self.rank_lanes.start}..{self.rank_lanes.stop - 1}; micro-batches of "
            f"{self.micro_batch}",
            f"  source: {type(self.source).__name__}",
        ]
        ops: list[Any] = [self.fetch, *self.chain, *((self.batcher,) if self.batcher else ())]
        for op in ops:
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
        elif self.restores_holdings:
            lines.append(
                "  restore rebuilds what the stateful operators hold (snapshots every 64 samples)"
            )
        if self.world_size > 1 and self.uneven_end == "carry":
            lines.append(
                "  even ends: every rank delivers the same global steps (the rest dropped)"
            )
        elif self.world_size > 1:
            lines.append("  uneven ends: ranks may run out of data at different global steps")
        skipping = [
            op.name for op, skip in zip(ops, (self.skip_fetch_errors, *self.skip_errors)) if skip
        ]
        if skipping:
            limit = "no limit" if self.max_skipped is None else f"at most {self.max_skipped}"
            lines.append(f"  skips records that fail in: {', '.join(skipping)} ({limit})")
        if self.workers != "inline":
            lines.append(f"  {self.processes} worker {self.workers}(s) for this rank's lanes")
        if self.ray_options:
            lines.append(f"  each lane's Ray actor placed with {self.ray_options}")
        if self.timeout is not None:
            lines.append(f"  timeout: {self.timeout:g} s for a lane's next item list")
        if self.max_inflight_bytes is not None and self.workers != "inline":
            lines.append(
                f"  read-ahead: at most {self.prefetch} item list(s) and "
                f"{self.max_inflight_bytes:,} payload bytes per lane"
            )
        return "\n".join(lines)
