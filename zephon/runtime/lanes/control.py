"""Control items: what travels down a lane besides records, keeping its place in the stream.

Tombstones are records (``SampleRecord`` with ``is_tombstone``); the classes here are the rest.
Operators never see control items: the lane runner passes them around the operator chain.
"""

from __future__ import annotations

from typing import Any


class ChunkOpened:
    """A chunk starts: delivery enters it in the lane's chunk table before any record of it."""

    __slots__ = (
        "chunk_id",
        "epoch",
        "local_index",
        "n_offsets",
        "op_stats",
        "skip_below",
        "source_io",
    )

    def __init__(
        self,
        chunk_id: int,
        local_index: int,
        n_offsets: int,
        epoch: int,
        skip_below: int = 0,
        op_stats: list[list[float]] | None = None,
        source_io: tuple[str, dict[str, dict[str, int]]] | None = None,
    ):
        self.chunk_id = chunk_id
        self.local_index = local_index
        self.n_offsets = n_offsets
        self.epoch = epoch
        # Offsets below this were skipped at the source on restore (consumed before the checkpoint).
        self.skip_below = skip_below
        # The lane's operators so far: [records in, records out, seconds] each (for stats()).
        self.op_stats = op_stats
        # (process id, what its copy of the source read so far): ``WorkSource.io_counters``.
        self.source_io = source_io

    def __repr__(self) -> str:
        return f"ChunkOpened({self.chunk_id}, local={self.local_index}, n={self.n_offsets})"


class EpochEnd:
    """Every operator has flushed epoch ``epoch``; carries their carry state for the next epoch and
    each operator's closing-contributor balance (received minus emitted) over the epoch."""

    __slots__ = ("carry", "deficits", "epoch")

    def __init__(self, epoch: int, carry: list[Any], deficits: dict[str, int]):
        self.epoch = epoch
        self.carry = carry
        self.deficits = deficits

    def __repr__(self) -> str:
        return f"EpochEnd({self.epoch})"


class OverClose:
    """Operator ``op`` emitted more closing contributors than it received this epoch: it closes
    offsets too early. Sent ahead of that output so delivery can name the operator."""

    __slots__ = ("op",)

    def __init__(self, op: str):
        self.op = op

    def __repr__(self) -> str:
        return f"OverClose({self.op!r})"


class Holdings:
    """A snapshot between two pieces of a micro-batch (or after one): everything before it in the
    lane's stream has been emitted, and the lane's stateful operators hold what ``ops`` says
    (``lanes.snapshots``); a restore can rebuild them and continue at offset ``offset`` of
    lane-local chunk ``next_local`` of epoch ``epoch``."""

    __slots__ = ("epoch", "next_local", "offset", "ops")

    def __init__(self, next_local: int, offset: int, epoch: int, ops: list[Any]):
        self.next_local = next_local
        self.offset = offset  # > 0: chunk next_local was read up to here (and announced)
        self.epoch = epoch
        self.ops = ops

    def __repr__(self) -> str:
        return f"Holdings(next={self.next_local})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Leaving a worker process: cursors travel as plain ints, not as objects.
        from zephon.runtime.lanes.snapshots import flattened

        return (Holdings, (self.next_local, self.offset, self.epoch, flattened(self.ops)))


class Skipped:
    """The record at ``cursor`` was skipped: operator ``operator`` raised ``error`` (its text) on
    it, and its tombstones follow. Delivery logs and counts it as it is handed over."""

    __slots__ = ("cursor", "error", "operator")

    def __init__(self, cursor: Any, operator: str, error: str):
        self.cursor = cursor
        self.operator = operator
        self.error = error

    def __repr__(self) -> str:
        return f"Skipped({self.cursor!r}, {self.operator!r})"


class RunStart:
    """The lane starts run ``index`` of its program (after a re-laning: the chunks another lane
    had in flight, or its own). Delivery fills ``replayed`` with the items of the run that were
    delivered before the checkpoint (swallowed, booked but not handed over again) and starts the
    run's bookkeeping afresh."""

    __slots__ = ("index", "replayed")

    def __init__(self, index: int):
        self.index = index
        self.replayed: list[Any] = []

    def __repr__(self) -> str:
        return f"RunStart({self.index})"


class Retired:
    """A record that carries a retired sample (``runtime.retire``): booked like a record handed
    over, handed to no one."""

    __slots__ = ("record",)

    def __init__(self, record: Any):
        self.record = record

    def __repr__(self) -> str:
        return f"Retired({self.record.meta.cursor!r})"


class LaneEnd:
    """The lane has no more chunks; everything before it has been emitted. Carries the lane's
    final operator stats and source counters (as ``ChunkOpened``)."""

    __slots__ = ("op_stats", "source_io")

    def __init__(
        self,
        op_stats: list[list[float]] | None = None,
        source_io: tuple[str, dict[str, dict[str, int]]] | None = None,
    ):
        self.op_stats = op_stats
        self.source_io = source_io

    def __repr__(self) -> str:
        return "LaneEnd()"


LANE_END = LaneEnd()
