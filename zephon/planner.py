"""Pipeline -> Plan: validation, the eviction path, ranks and the fingerprint. Nothing runs here."""

from __future__ import annotations

import json
import operator
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from zephon.compact import pack_json
from zephon.errors import PlanError
from zephon.identity import identify
from zephon.on_error import skip_policy
from zephon.ops.base import Grouper, Operator, OpTraits, PointerReader
from zephon.plan import Plan, digest
from zephon.ranks import resolve_rank
from zephon.runtime.workers.thread_budget import usable_cpus
from zephon.validation import check_bool, check_int, check_seconds

if TYPE_CHECKING:
    from zephon.runtime.loader import Loader
    from zephon.sources.base import WorkSource

#: Why ``Pipeline(deterministic=...)`` warns: the argument never changed what runs.
DEPRECATED_DETERMINISTIC = (
    "Pipeline(deterministic=...) is deprecated and has no effect: every pipeline delivers the "
    "same stream whatever its workers, timing or load (micro-batches are cut by count, stateful "
    "and batch-sensitive operators run on one thread). Remove the argument."
)


UNEVEN_ENDS = ("carry", "allow")


def _worker_count(processes: int | None, rank_lanes: int) -> int:
    """Workers for a rank's lanes: as asked (at most one per lane), else one per lane but no more
    than the CPUs this process may use."""
    if processes is not None:
        return min(processes, rank_lanes)
    return max(1, min(rank_lanes, usable_cpus()))


_HEX = frozenset("0123456789abcdef")


def _abridged(tree: Any, longest: int | None = None) -> Any:
    """``tree`` with long hex digests cut to 12 digits: enough to tell which file or parameter
    changed, at a fraction of the size a checkpoint pays for it per file. With ``longest``, a
    list of more items is kept as its length and digest."""
    if isinstance(tree, dict):
        return {k: _abridged(v, longest) for k, v in tree.items()}
    if isinstance(tree, list):
        if longest is not None and len(tree) > longest:
            return f"{len(tree)} items, sha256 {digest(tree)[:12]}"
        return [_abridged(v, longest) for v in tree]
    if isinstance(tree, str) and len(tree) > 16 and set(tree) <= _HEX:
        return tree[:12]
    return tree


#: The most a checkpoint carries of the described pipeline, packed. A source holding its data (a
#: ``make`` over a list of arrays, thousands of files) would otherwise put all of it in every
#: checkpoint; past this, long lists are kept by length and digest, then nothing is kept.
DESCRIBED_BUDGET = 64 * 1024


def _described(plain: Any, size: int) -> dict[str, str]:
    """The packed description a plan carries for naming what changed, within the budget
    (``size``: the length of ``plain`` as JSON text)."""
    # Past 8 times the budget as text, a description is mostly digests, which barely compress:
    # packing it whole only to throw it away would cost a large source seconds per plan.
    limits = (None, 256, 16) if size <= 8 * DESCRIBED_BUDGET else (256, 16)
    for longest in limits:
        packed = pack_json(_abridged(plain, longest))
        if len(packed) <= DESCRIBED_BUDGET:
            return {"described": packed}
    return {}  # the digests still tell a mismatch; the message names the part, not the field


def _restores_holdings(chain: tuple[Operator, ...]) -> bool:
    """Whether a restore can rebuild every stateful operator from what it holds: each describes
    its holdings, and what each holds can be rebuilt by running re-read samples through the
    operators before it (pure ones that do not depend on micro-batches; stateful ones only if
    they pass records through unchanged)."""
    for j, op in enumerate(chain):
        if not op.traits.stateful:
            continue
        if not op.describes_holdings:
            return False
        for before in chain[:j]:
            if before.traits.stateful and not before.emits_received_records:
                return False
            if not before.traits.stateful and before.traits.batch_sensitive:
                return False
    return True


class _Sizes(NamedTuple):
    """A pipeline's integer arguments, checked, as Python ints."""

    rank: int
    world_size: int
    lanes: int
    epoch_chunks: int
    prefetch: int
    micro_batch: int
    carry_warn_bytes: int
    processes: int | None
    max_inflight_bytes: int | None


def _split_chain(ops: list[Operator]) -> tuple[Any, tuple[Operator, ...], Any]:
    """``(fetch, chain, batcher)``: the first operator, the ones that run inside the lanes, and
    the grouper that ends the pipeline (None without one)."""
    batcher: Any = ops[-1] if len(ops) > 1 and ops[-1].groups_at_delivery else None
    return ops[0], tuple(ops[1 : len(ops) - (1 if batcher else 0)]), batcher


def _indexable(path: str, chain: tuple[Operator, ...], skipping: bool) -> bool:
    """Whether a restore may skip consumed samples at the source instead of replaying them: on
    the monotone path, with every operator 1 -> 1 and nothing skipped (a skipped record makes
    a 1 -> 1 chain drop one, so consumed samples can no longer be counted off the source's
    pointers)."""
    return (
        path == "monotone"
        and all(op.traits.preserves_indexability for op in chain)
        and not skipping
    )


def _eviction_path(chain: tuple[Operator, ...]) -> tuple[str, str]:
    """The eviction path and why: ``"monotone"`` when every operator preserves cursor order and
    keeps no state (a chunk's offsets close in order), else ``"epoch"`` (chunks are evicted per
    epoch), naming the operators that reorder or keep state."""
    reorder = [op.name for op in chain if not op.traits.preserves_cursor_order]
    stateful = [op.name for op in chain if op.traits.stateful]
    if not (reorder or stateful):
        return "monotone", "every operator preserves cursor order and keeps no state"
    why = "; ".join(
        part
        for part in (
            f"reorders: {', '.join(reorder)}" if reorder else "",
            f"keeps state: {', '.join(stateful)}" if stateful else "",
        )
        if part
    )
    return "epoch", why


class Pipeline:
    """A source and a chain of operators: ``fetch`` first, optionally ``batch`` last.

    The delivered stream is a pure function of the definition, the data, ``lanes``,
    ``epoch_chunks``, ``micro_batch``, ``rank`` and ``world_size``; never of ``workers``, timing
    or load. ``deterministic`` is deprecated and changes nothing (see ``DEPRECATED_DETERMINISTIC``).

    ``workers`` is where the lanes run: ``"inline"``, ``"thread"``, ``"process"``, ``"ray"``, or
    another kind registered with ``zephon.runtime.workers.registry.register_lane_kind``.

    ``timeout`` (seconds, off by default) bounds how long a thread, process or Ray lane may take to
    produce its next item list before ``next()`` raises instead of waiting for a stuck or stopped
    worker; inline lanes run in the caller's thread and cannot time out.

    ``relane`` (default True): a checkpoint taken with another lane count continues on this
    pipeline's ``lanes``, every sample it delivers still delivered exactly once but in
    different batches (a warning says so); False makes it a ``CheckpointMismatchError``.

    ``uneven_end`` says what happens at the end of the data, where lanes hold different numbers
    of items: ``"carry"`` (the default with ``world_size > 1`` when every chain operator is
    1 -> 1 and nothing is skipped) makes every lane hand over as many items as the job's
    shortest lane, so every rank delivers the same global steps and none waits alone in a
    collective; a pass's remainder is delivered in the next pass, and what is left at the end
    of the last pass is dropped and counted (``stats()["dropped_at_end"]``). ``"allow"`` (the
    default otherwise) delivers everything, and ranks may then end at different global steps.

    ``on_error`` (``"raise"``, ``"skip"``, or a mapping of operator names to them): with
    ``"skip"`` a record that ``fetch`` or an operator keeping no state fails on is dropped with
    its tombstones, logged and counted (``Loader.skipped()``), and the run goes on; past
    ``max_skipped`` skipped records (None: no limit) the run fails as with ``"raise"``. Neither
    is part of the fingerprint: a checkpoint taken without skipping resumes with it.

    ``ray_options`` (``workers="ray"`` only): how each lane's Ray actor is placed, from
    ``num_cpus``, ``memory``, ``resources``, ``scheduling_strategy`` and ``runtime_env`` (see
    ``docs/distributed.md``); an unknown key is a ``PlanError`` naming it.
    ``max_inflight_bytes`` (None: no byte bound, only ``prefetch`` item lists) bounds the payload
    bytes each thread, process or Ray lane reads ahead of the loader: once the lists it has ready
    hold that many bytes, it makes no more until the loader takes one. A single list larger than
    the bound is still handed over, alone. Not part of the fingerprint: it changes when lists are
    made, never what they hold.
    """

    def __init__(
        self,
        source: WorkSource,
        ops: Sequence[Operator],
        *,
        lanes: int | None = None,
        workers: str = "inline",
        epoch_chunks: int = 8,
        deterministic: bool | None = None,
        strict: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        prefetch: int = 2,
        micro_batch: int = 256,
        carry_warn_bytes: int = 65536,
        timeout: float | None = None,
        processes: int | None = None,
        relane: bool = True,
        uneven_end: str | None = None,
        on_error: str | Mapping[str, str] = "raise",
        max_skipped: int | None = None,
        ray_options: Mapping[str, Any] | None = None,
        max_inflight_bytes: int | None = None,
    ):
        self.source = source
        self.ops = list(ops)
        self.lanes = lanes
        self.workers = workers
        self.epoch_chunks = epoch_chunks
        if deterministic is not None:
            warnings.warn(DEPRECATED_DETERMINISTIC, DeprecationWarning, stacklevel=2)
        self.deterministic = deterministic
        self.strict = strict
        self.rank = rank
        self.world_size = world_size
        self.prefetch = prefetch
        self.micro_batch = micro_batch
        self.carry_warn_bytes = carry_warn_bytes
        self.timeout = timeout
        self.processes = processes
        self.relane = relane
        self.uneven_end = uneven_end
        self.on_error = on_error
        self.max_skipped = max_skipped
        self.ray_options = ray_options
        self.max_inflight_bytes = max_inflight_bytes

    def compile(self, lanes: int | None = None) -> Plan:
        """Plan without running anything; errors are ``PlanError`` naming the operator.

        ``lanes`` is the job's lane count when the pipeline leaves it open (``lanes=None``): a
        restore passes the checkpoint's; a fresh run gets one lane per rank."""
        sizes = self._validate(lanes)
        ops = self._check_operators()
        self._share_facts(ops)
        fetch_op, chain, batcher = _split_chain(ops)
        path, why = _eviction_path(chain)
        skip_fetch, skip_chain = skip_policy(self.on_error, self.max_skipped, fetch_op, chain)
        skipping = skip_fetch or any(skip_chain)
        indexable = _indexable(path, chain, skipping)
        uneven_end = self._uneven_end(chain, indexable, sizes.world_size, skipping)
        parts, described = self._fingerprint_parts(sizes)
        return Plan(
            source=self.source,
            fetch=fetch_op,
            chain=chain,
            batcher=batcher,
            eviction_path=path,
            path_reason=why,
            indexable=indexable,
            lanes=sizes.lanes,
            workers=self.workers,
            epoch_chunks=sizes.epoch_chunks,
            micro_batch=sizes.micro_batch,
            prefetch=sizes.prefetch,
            strict=bool(self.strict),
            rank=sizes.rank,
            world_size=sizes.world_size,
            fingerprint=digest(parts),
            # The trees the digests are made of ride along (outside the fingerprint, compressed),
            # so that a checkpoint of another pipeline can be told apart field by field.
            fingerprint_parts={**parts, **described},
            batch_sensitive=any(op.traits.batch_sensitive for op in chain),
            counted_tags=tuple(dict.fromkeys(tag for op in ops for tag in op.counted_tags)),
            carry_warn_bytes=sizes.carry_warn_bytes,
            processes=_worker_count(sizes.processes, sizes.lanes // sizes.world_size),
            timeout=None if self.timeout is None else float(self.timeout),
            relane=bool(self.relane),
            restores_holdings=path == "epoch" and _restores_holdings(chain),
            sets_up=any(op.has_setup for op in chain),
            uneven_end=uneven_end,
            skip_errors=skip_chain,
            skip_fetch_errors=skip_fetch,
            max_skipped=self.max_skipped,
            ray_options=None if self.ray_options is None else dict(self.ray_options),
            max_inflight_bytes=sizes.max_inflight_bytes,
        )

    def _validate(self, lanes: int | None) -> _Sizes:
        """Every argument of the pipeline checked (``PlanError`` naming it; a bool is not an
        int) and its sizes resolved: the rank from the arguments or the framework, the job's
        lane count from the pipeline, else ``lanes``, else one per rank."""
        for name, value in (("rank", self.rank), ("world_size", self.world_size)):
            if value is not None:
                check_int(value, name, "Pipeline", error=PlanError)
        rank, world_size = resolve_rank(self.rank, self.world_size)
        n_lanes = self.lanes if self.lanes is not None else lanes or world_size

        def size(name: str, value: Any, minimum: int) -> int:
            return check_int(value, name, "Pipeline", minimum=minimum, error=PlanError)

        sizes = _Sizes(
            rank=operator.index(rank),
            world_size=operator.index(world_size),
            lanes=size("lanes", n_lanes, 1),
            epoch_chunks=size("epoch_chunks", self.epoch_chunks, 1),
            prefetch=size("prefetch", self.prefetch, 1),
            micro_batch=size("micro_batch", self.micro_batch, 1),
            carry_warn_bytes=size("carry_warn_bytes", self.carry_warn_bytes, 0),
            processes=None if self.processes is None else size("processes", self.processes, 1),
            max_inflight_bytes=None
            if self.max_inflight_bytes is None
            else size("max_inflight_bytes", self.max_inflight_bytes, 1),
        )
        if sizes.lanes % sizes.world_size and self.lanes is None and lanes:
            raise PlanError(  # a resume: the lane count is the checkpoint's
                f"Pipeline(lanes=None) continues with the checkpoint's {sizes.lanes} lanes, "
                f"which world_size={world_size} ranks cannot share (the job's lane count must "
                f"be a multiple of the number of ranks): pass lanes= a multiple of {world_size} "
                "to re-lane the checkpoint onto them, or resume on a number of ranks that "
                f"divides {sizes.lanes}"
            )
        if sizes.lanes % sizes.world_size:
            raise PlanError(
                f"Pipeline lanes={sizes.lanes} cannot be shared by world_size={world_size} "
                "ranks: the job's lane count must be a multiple of the number of ranks"
            )
        check_bool(self.strict, "strict", "Pipeline", error=PlanError)
        check_bool(self.relane, "relane", "Pipeline", error=PlanError)
        # The runtime's registry of lane kinds, imported when a pipeline is checked, as the
        # loader is when one runs: importing zephon starts no runtime.
        from zephon.runtime.workers.ray_options import check_ray_options
        from zephon.runtime.workers.registry import lane_kind

        lane_kind(self.workers)  # a PlanError naming the registered kinds
        check_ray_options(self.ray_options, self.workers)
        if self.timeout is not None:
            check_seconds(self.timeout, "timeout", "Pipeline", error=PlanError)
        return sizes

    def _check_operators(self) -> list[Operator]:
        """The chain, each operator checked for its place: ``fetch`` (a ``PointerReader``)
        first, a ``Grouper`` only last, neither with a setup (it would never run), declared
        traits, and a stateful operator on one thread."""
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
            if op.consumes_pointers and not isinstance(op, PointerReader):
                raise PlanError(f"{label} reads pointers but lacks bind()/fetch() (PointerReader)")
            if op.groups_at_delivery and i != len(ops) - 1:
                raise PlanError(
                    f"{label} groups records into batches and must be the last operator"
                )
            if op.groups_at_delivery and not isinstance(op, Grouper):
                raise PlanError(
                    f"{label} groups records but lacks batch_size/drop_remainder/collate (Grouper)"
                )
            if (op.consumes_pointers or op.groups_at_delivery) and op.has_setup:
                role = "reads pointers" if op.consumes_pointers else "groups records into batches"
                raise PlanError(
                    f"{label} {role} and defines setup()/teardown(), which run only for the "
                    "operators between the reader and the grouper: load what it needs in an "
                    "operator of the chain"
                )
            self._check_one_thread(op, label)
        if not ops[0].consumes_pointers:
            raise PlanError(f"the first operator must be fetch, got {ops[0].name!r}")
        return ops

    def _check_one_thread(self, op: Operator, label: str) -> None:
        """A stateful operator's calls depend on each other, so it always runs on one thread;
        saying otherwise is refused rather than ignored."""
        workers = op.traits.workers or 1
        if not op.traits.stateful or workers <= 1:
            return
        message = (
            f"{label} is stateful and cannot run with {workers} workers: a stateful "
            "operator always runs on one thread; set workers=1"
        )
        if self.deterministic is not False:
            raise PlanError(message)
        # deterministic=False let this through before it was deprecated: keep it running, and
        # say that the workers are ignored.
        warnings.warn(
            f"{message} (ignored for now because deterministic=False was passed; this "
            "will be a PlanError when the deprecated argument is removed)",
            DeprecationWarning,
            stacklevel=4,
        )

    def _share_facts(self, ops: list[Operator]) -> None:
        """Plan-time facts flow downstream: the source and each operator may publish some
        (``provides()``, e.g. a tokenizer's pad id) and is handed those of the operators before
        it (``use_upstream_facts(facts)``, which raises ``PlanError`` when a fact it needs is
        missing). The source's own target mixture comes first (``source_mixture``: ``(by,
        shares)`` or None), so that an operator correcting the mixture can tell how the source
        draws it; then the facts the source publishes itself (a pre-tokenized source's pad
        id)."""
        facts: dict[str, Any] = {"source_mixture": self.source.target_mixture()}
        facts.update(self.source.provides())
        for op in ops:
            op.use_upstream_facts(dict(facts))
            facts.update(op.provides())

    def _uneven_end(
        self, chain: tuple[Operator, ...], indexable: bool, world_size: int, skipping: bool
    ) -> str:
        """``uneven_end`` resolved: ``"carry"`` needs every lane's item count, which only a plan
        of 1 -> 1 operators knows without running them; one rank waits for no other, so its
        default is ``"allow"``."""
        asked = self.uneven_end
        if asked is None:
            return "carry" if world_size > 1 and indexable else "allow"
        if asked not in UNEVEN_ENDS:
            raise PlanError(f"Pipeline uneven_end must be one of {UNEVEN_ENDS}, got {asked!r}")
        if asked == "carry" and not indexable:
            unknown = [op.name for op in chain if not op.traits.preserves_indexability]
            if skipping:
                unknown.append("on_error='skip'")
            raise PlanError(
                "Pipeline uneven_end='carry' needs to know how many items each lane holds, and "
                f"{', '.join(unknown) or 'the eviction path'} may change the number of records "
                "(filter, split, pack or skip them): use uneven_end='allow' and end the ranks "
                "together with loader.end_together(all_reduce_min) (the torch dataset does it "
                "by itself)"
            )
        return asked

    def _fingerprint_parts(self, sizes: _Sizes) -> tuple[dict[str, Any], dict[str, Any]]:
        """The parts of the pipeline's fingerprint (digests of the source and the operators,
        the sizes that shape the stream), and the described trees behind them."""
        # The job's lane count is part of the stream's identity; the world size is not: the
        # same lanes give the same global steps on any number of ranks. Second: the described
        # source and operators as plain JSON, packed, or nothing when they are not plain JSON.
        source = identify(self.source.describe(), where="the source's describe()")
        operators = [op.describe() for op in self.ops]
        parts = {
            "source": digest(source),
            "operators": digest(operators),
            "lanes": sizes.lanes,
            "epoch_chunks": sizes.epoch_chunks,
            "micro_batch": sizes.micro_batch,
        }
        try:
            tree = {"source": source, "operators": operators}
            text = json.dumps(tree, sort_keys=True, default=str, allow_nan=False)
        except (TypeError, ValueError):
            return parts, {}
        return parts, _described(json.loads(text), len(text))

    @property
    def fingerprint(self) -> str:
        """A stable hex digest of source, operators, parameters, lanes and epochs."""
        return self.compile().fingerprint

    def iter(
        self, state: dict | None = None, *, allow_changes: bool = False, retire: Any = None
    ) -> Loader:
        """A loader over this pipeline, continuing exactly where ``state`` was taken when given:
        a rank's own state, or a job state (``zephon.merge_states``) on any world size that
        divides the job's lane count. A state taken with another lane count than this
        pipeline's ``lanes`` is re-laned onto them (see ``relane``).

        ``allow_changes=True`` resumes a state whose operators changed on purpose (a fixed map,
        a new threshold; never another source): see ``Loader.load_state_dict``. ``retire``:
        sample ids, or a predicate on them, never delivered from here on (``Loader.retire``)."""
        from zephon.runtime.loader import Loader

        lanes = state.get("lanes") if isinstance(state, dict) else None
        loader = Loader(self.compile(lanes if type(lanes) is int and lanes > 0 else None))
        if state is not None:
            loader.load_state_dict(state, allow_changes=allow_changes, retire=retire)
        elif retire is not None:
            loader.retire(retire)
        return loader

    def __iter__(self) -> Loader:
        return self.iter()
