"""The operator API: what the planner and the lane runner know about an operator, and the two
roles the runtime asks of special operators (the pointer reader in front, the grouper at the
end)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from zephon.errors import OperatorError
from zephon.identity import identify
from zephon.types import RecordRun, SampleRecord
from zephon.validation import check_int

__all__ = [
    "Grouper",
    "OpTraits",
    "Operator",
    "OperatorContext",
    "PointerReader",
    "describe_value",
    "epoch_rng",
    "record_error",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpTraits:
    """What an operator promises; the planner chooses the eviction path and parallelism from it.

    ``preserves_cursor_order`` has no default on purpose: claiming it falsely loses data.
    """

    preserves_cursor_order: bool
    stateful: bool = False
    batch_sensitive: bool = False
    preserves_indexability: bool = False
    workers: int | None = None

    def __post_init__(self) -> None:
        if self.workers is not None:
            check_int(self.workers, "workers", "OpTraits", minimum=1)


@dataclasses.dataclass(frozen=True)
class OperatorContext:
    """Where an operator's ``setup`` runs: the worker kind (``"inline"``, ``"thread"`` or
    ``"process"``), the global lanes this worker runs, the rank and world size, and the process
    id. What setup loads is shared by those lanes."""

    worker: str
    lanes: tuple[int, ...]
    rank: int
    world_size: int
    pid: int


class Operator:
    """Base class of pipeline operators.

    The lane runner calls ``start_epoch`` before each epoch, ``process_many`` on micro-batches of
    real records (never tombstones), and ``flush`` at each epoch marker and at the end of a lane.
    An operator that drops a record must emit that record's tombstones (``tombstones_for_record``).
    """

    name: str = ""
    traits: OpTraits
    #: True only for ``fetch``: it turns pointers into records and must come first.
    consumes_pointers: ClassVar[bool] = False
    #: True only for ``batch``: it groups records at delivery and must come last.
    groups_at_delivery: ClassVar[bool] = False
    #: Tombstone tags whose delivered count ``Loader.stats()`` reports under the tag's name.
    counted_tags: ClassVar[tuple[str, ...]] = ()
    #: The operator turns each payload into one new payload and nothing else: it keeps no state,
    #: changes no metadata and never drops, splits or reorders. The lane runner may then hand it
    #: a run of fetched records (``map_payloads``) instead of a list of records.
    maps_payloads: bool = False
    #: Ratios of two of the counts of ``counters()``, by name (a packer's ``"fill"``: real tokens
    #: over row tokens), which ``Loader.stats()`` gives beside the counts summed over the lanes.
    ratios: ClassVar[Mapping[str, tuple[str, str]]] = {}

    lane_id: int = 0
    epoch: int = 0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("name"):
            cls.name = cls.__name__

    def bind(self, source: Any) -> None:
        """Called on a lane's copy of a pointer-consuming operator with the pipeline's source."""

    def start_epoch(self, lane_id: int, epoch: int) -> None:
        """Called before each epoch of a lane; seeded operators reseed from (seed, lane, epoch)."""
        self.lane_id = lane_id
        self.epoch = epoch

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        raise NotImplementedError(f"{type(self).__name__} must implement process_many (abstract)")

    def map_payloads(self, run: RecordRun) -> list[Any]:
        """For ``maps_payloads`` operators: the new payload of each record of ``run`` (a
        ``RecordRun``: its ``payloads``, and its records when one is needed to name it in an
        error), in order. This default takes them from ``process_many`` on the run's records,
        which such an operator returns one for one with their metadata; override it to skip
        building the records."""
        return [r.payload for r in self.process_many(run.records())]

    def flush(self) -> list[SampleRecord]:
        """Emit whatever the operator still holds; called at every epoch marker and lane end."""
        return []

    def releases_gil(self) -> bool:
        """Whether ``process_many`` spends most of its time outside the GIL (a native
        tokenizer's batch encoder). The lane runner then makes its call on a lane's next read
        on a thread, beside the call on the current read and while that read goes through the
        operators after it, when it is the first operator after ``fetch``, keeps no state and
        gets whole reads: ``process_many`` must then be safe to run on two threads at once,
        and ``counters()`` may count a read early. False by default."""
        return False

    def setup(self, ctx: OperatorContext) -> None:
        """Load what the operator needs and should not carry in the plan (a model, an index):
        called once per worker, in the worker, before its lanes start, on a copy of the
        operator the lanes' copies share what it sets (by reference; it is never pickled).
        ``ctx`` says where it runs. Inline and thread lanes share one setup in the training
        process; each worker process has its own."""

    def teardown(self) -> None:
        """Release what ``setup`` loaded: called once per worker when its lanes stop (on
        ``close()``, at the end, on an error, or when the loader is collected)."""

    @property
    def has_setup(self) -> bool:
        """Whether the operator overrides ``setup`` or ``teardown``."""
        cls = type(self)
        return cls.setup is not Operator.setup or cls.teardown is not Operator.teardown

    def carry_state(self) -> dict | None:
        """Small JSON-able state that survives epochs (and is stored in checkpoints)."""
        return None

    #: The operator emits records exactly as it received them (it only holds, reorders or drops
    #: them), so what an operator after it holds can be rebuilt without it.
    emits_received_records = False

    def holdings(self) -> tuple[list[SampleRecord], dict[str, Any]] | None:
        """What the operator holds right now, so that a restore can rebuild it instead of
        replaying the epoch: the records it holds (each is rebuilt by re-reading its sample and
        running the operators before this one) and small plain state (generator state,
        running totals, where its records sit): JSON types, or numpy arrays and scalars, which
        are stored as lists and numbers. ``None`` (the default): it cannot say, and a
        pipeline with it restores by replaying the epoch. Overriding it needs
        ``restore_holdings``."""
        return None

    def restore_holdings(self, records: list[SampleRecord], state: dict[str, Any]) -> None:
        """Become what ``holdings()`` described; ``records`` come in the order it gave them,
        rebuilt. Called on a fresh operator after ``start_epoch``."""
        raise TypeError(f"{type(self).__name__} overrides holdings() but not restore_holdings()")

    @property
    def describes_holdings(self) -> bool:
        """Whether this operator's ``holdings()`` can describe it (both methods overridden)."""
        cls = type(self)
        return (
            cls.holdings is not Operator.holdings
            and cls.restore_holdings is not Operator.restore_holdings
        )

    def restore_carry(self, state: dict) -> None:
        """Restore what ``carry_state`` returned; called on fresh operators at restore."""

    def counters(self) -> dict[str, int | float]:
        """Counts of this operator's own work since it was made (a packer's rows and their real
        and padded tokens); ``Loader.stats()`` adds them up over the lanes under the operator's
        entry. Read once per chunk a lane opens; none by default."""
        return {}

    def leave_out(self, retired: Callable[[np.ndarray], np.ndarray]) -> bool:
        """From now on, leave retired samples (``Pipeline.iter(retire=...)``) out of the records
        this operator makes of several inputs: ``retired(ids)`` says, per row of an ``(n, 3)``
        int64 array of sample ids, whether that sample is retired. Such a record keeps its
        primary cursor and the other inputs' parts, and each left-out input's closing
        contributors follow it as tombstones; a record of retired samples alone is emitted as
        it is (delivery books it and hands it to no one). Called on a lane's fresh operators
        when the run has retired samples. Return True when the operator does so; the default,
        False, suits operators that never put several samples in one record (for one that does,
        delivery takes a record mixing retired samples with others out whole, with a
        ``RetireWarning``)."""
        return False

    def provides(self) -> dict[str, Any]:
        """Plan-time facts for the operators after this one (e.g. a tokenizer's ``pad_id``)."""
        return {}

    def use_upstream_facts(self, facts: dict[str, Any]) -> None:
        """Called at plan time with the facts the operators before this one provide; raise
        ``PlanError`` when one this operator needs is missing."""

    def use_previous_operator(self, before: Operator | None) -> None:
        """Called on a lane's own copies of the chain as it starts a run, in the chain's order
        (``introduce_neighbours``), with the operator whose records this one takes (None for the
        first, and when the two skip failing records differently): an operator may join that
        one, to be applied by it record by record (``decode_images`` applies the augmentations
        right after it to each image it decodes). The pipeline's own operators are never told."""

    def target_mixture(self) -> tuple[str, dict[Any, float]] | None:
        """``(by, shares)`` when the operator steers the stream's mixture towards target shares
        per component (``by`` is ``"tokens"`` or ``"samples"``), else None; ``Loader.stats()``
        reports the realized shares against the last such target in the chain."""
        return None

    def describe(self) -> dict[str, Any]:
        """The operator's identity for the pipeline fingerprint: class, name, traits and every
        public attribute by ``zephon.identity.identify`` (callables by their code, arrays by
        content); ``PlanError`` naming the parameter when one cannot be identified."""
        params = {
            k: identify(v, where=f"operator {self.name!r} parameter {k!r}")
            for k, v in sorted(vars(self).items())
            if not k.startswith("_") and k not in ("lane_id", "epoch", "name", "traits")
        }
        return {
            "class": f"{type(self).__module__}.{type(self).__qualname__}",
            "name": self.name,
            "traits": dataclasses.asdict(self.traits),
            "params": params,
        }

    def __repr__(self) -> str:
        return f"<{self.name} operator>"


def describe_value(value: Any) -> Any:
    """The JSON-able, process-independent identity of a parameter value: ``identify`` from
    ``zephon.identity`` (kept here for operator authors who describe extra parameters)."""
    return identify(value)


def introduce_neighbours(chain: Sequence[Operator], skips: Sequence[bool]) -> None:
    """Tell each operator of ``chain`` (a lane's copies) which one it takes its records from
    (``Operator.use_previous_operator``), in order; not across two operators that skip failing
    records differently (``skips``), since one that joins the other fails where that one does."""
    before: Operator | None = None
    for op, skip, skip_before in zip(chain, skips, (None, *skips)):
        op.use_previous_operator(before if skip == skip_before else None)
        before = op


def record_error(
    op: Operator, record: SampleRecord, exc: BaseException, *, about: str | None = None
) -> OperatorError:
    """An ``OperatorError`` naming the operator, the record's cursor and its sample id, and with
    ``about`` the part of the record that failed (an image of a list, its file)."""
    cursor = record.meta.cursor
    part = f"{about}: " if about else ""
    return OperatorError(
        f"operator {op.name!r} failed on record {cursor!r} (sample_id={cursor.sample_id}): "
        f"{part}{type(exc).__name__}: {exc}",
        operator=op.name,
        cursor=cursor,
    )


@runtime_checkable
class PointerReader(Protocol):
    """The role of the first operator (``consumes_pointers = True``): it turns a chunk's pointer
    rows into records. Each lane works on its own copy, bound to the pipeline's source."""

    def bind(self, source: Any) -> None:
        """Attach the pipeline's source before the lane's first chunk."""

    def fetch(
        self, chunk_id: int, pointers: np.ndarray, first_offset: int
    ) -> Sequence[SampleRecord]:
        """Records for rows ``first_offset ..`` of chunk ``chunk_id``: the i-th record's cursor is
        ``SampleCursor(chunk_id, first_offset + i, pointer_i, ())``. A list of records, or a
        ``RecordRun`` (the same records, none of them built yet)."""
        ...


@runtime_checkable
class Grouper(Protocol):
    """The role of the last operator (``groups_at_delivery = True``): delivery groups each lane's
    records into batches of ``batch_size`` and hands them over with ``collate``'s payload.
    With ``drop_remainder`` a lane's last short batch is dropped (its records' tombstones close
    their offsets) instead of delivered."""

    batch_size: int
    drop_remainder: bool

    def collate(self, records: Sequence[SampleRecord]) -> Any:
        """The payload of a batch of records (a list, or a ``RecordRun``)."""
        ...


def epoch_rng(seed: int, lane_id: int, epoch: int) -> np.random.Generator:
    """The random generator of a seeded operator for one lane and epoch (never time or id based)."""
    return np.random.default_rng(np.random.SeedSequence([seed, lane_id, epoch]))
