"""The loader: round-robin delivery over the lanes, stats, and the checkpoint state.

A loader owns one ``LaneDelivery`` per lane and hands the training loop one item per lane in turn,
skipping lanes that ended. A state always describes the position after the last item handed
over, whatever happened since (an error, ``close()``, an interrupt): ``state_dict()`` may be
called at any time, from any thread, and waits for a ``next()`` in progress to finish.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Hashable, Iterator
from time import perf_counter
from typing import Any

import numpy as np

from zephon._core.delivery import DeliveryCounters, parse_heritage_key
from zephon._core.handover import NO_LIMIT, LoaderStep
from zephon.errors import (
    CheckpointError,
    ContractViolation,
    PipelineChangeWarning,
    PlanError,
    ZephonError,
)
from zephon.plan import Plan
from zephon.progress import bar
from zephon.runtime.checkpoint.format import check_identity, seal, unseal
from zephon.runtime.checkpoint.history import RunHistory, change_event
from zephon.runtime.checkpoint.job import job_step, rank_served, rank_turn, state_step
from zephon.runtime.checkpoint.layout import Layout
from zephon.runtime.checkpoint.relane import relaned_state
from zephon.runtime.checkpoint.retired import (
    MAX_SETS,
    FetchScreen,
    RetiredIds,
    Retirement,
    Retirements,
    horizons_of,
    retired_ids,
)
from zephon.runtime.checkpoint.schema import (
    JOB_FORMAT,
    STATE_FORMAT,
    STATE_VERSION,
    check_job_turn,
    check_keys,
    check_lane_list,
    check_layout,
    check_next_lane,
    check_rank,
)
from zephon.runtime.delivery.contracts import ContractPolicy
from zephon.runtime.delivery.even_end import lane_items
from zephon.runtime.delivery.lane_delivery import LaneDelivery
from zephon.runtime.delivery.replay import changed_records, merged_records
from zephon.runtime.delivery.skips import SkipLog
from zephon.runtime.delivery.totals import RunTotals
from zephon.runtime.lanes.operator_setup import release_in_process
from zephon.runtime.workers.feeds import close_feeds, start_feeds
from zephon.runtime.workers.trainer_wait import TrainerWait
from zephon.sources.source_io import latest_counters, merge_counters, process_key
from zephon.validation import check_bool

log = logging.getLogger("zephon")


class Loader(LoaderStep):
    """An iterator over what the training loop consumes: ``SampleBatch``es when the pipeline ends
    in a grouper (``batch``), else ``SampleRecord``s. Tombstones are never delivered.

    After an error, ``next()`` keeps raising (the loader does not pretend the stream ended) until
    it is closed; a closed loader raises ``ZephonError`` rather than ending quietly. ``next()``
    itself is compiled (``LoaderStep.__next__``) and calls back into this class for everything
    but the usual step.
    """

    lanes: list[LaneDelivery]
    policy: ContractPolicy

    def __init__(self, plan: Plan):
        self.plan = plan
        self.counts = DeliveryCounters()
        self.counts.counted_tags = frozenset(plan.counted_tags)
        self.policy = ContractPolicy(plan.strict)
        self.totals = RunTotals(self.counts, self.policy)
        self.next_lane = 0
        # ``served`` (the items this rank handed over, in global steps of its world size) less
        # what its lanes delivered: nonzero after a resume from a job state
        self.served_offset = 0
        self.skips = SkipLog(self.counts, plan.max_skipped, plan.source)
        self.dropped_together = 0  # items left when another rank's data ended (end_together)
        self.lanes = [LaneDelivery(plan, lane, self.counts, self.skips) for lane in plan.rank_lanes]
        self.layout = Layout.fresh(plan.lanes, plan.source.total_chunks())
        self.history = RunHistory()  # what was done to the run, the steps still to skip
        self.retired = Retirements()  # samples never delivered (``retire``)
        self._end_evenly()
        self.waits = TrainerWait(self)  # the training loop's waits in next()
        for lane in self.lanes:
            lane.feed.waits = self.waits
        # ``_lock`` (the compiled step's ``StepLock``): one delivery, or one state, at a time.
        self._started = False
        self._closed = False
        self._failure: BaseException | None = None
        self._untrusted: BaseException | None = None  # bookkeeping stopped half-way
        self._before_skip: dict[str, Any] | None = None  # the state while ``skip_steps`` runs

    def _end_evenly(self) -> None:
        """With ``uneven_end="carry"``, every lane stops at the job's shortest lane's items, so
        every rank delivers the same global steps (``runtime.even_end``); a re-laned job's lanes
        run to their ends (``ends_evenly``)."""
        sets = self.retired.sets
        retired = RetiredIds(np.concatenate([r.ids.rows for r in sets])) if sets else None
        carry = self.plan.uneven_end == "carry"
        items = lane_items(self.plan, self.layout, retired) if carry else None
        self._ends_evenly = carry and (items is not None or self.plan.source.total_chunks() is None)
        steps = min(items) if items else NO_LIMIT
        if items and not steps and any(items):
            raise PlanError(
                f"uneven_end='carry': lane {items.index(0)} of {len(items)} holds no item to hand "
                f"over (the data is {self.plan.source.total_chunks()} chunks for {len(items)} "
                "lanes), so no rank would deliver anything; give the source a smaller "
                "chunk_size, use fewer lanes, or pass uneven_end='allow' (and end the ranks "
                "together with end_together)"
            )
        for lane in self.lanes:
            lane.limit = steps
            lane.surplus = items[lane.lane_id] - steps if items else 0
        total = sum(items) if items else 0
        dropped = total - steps * len(items) if items else 0
        if dropped:
            # A few items per lane of a large dataset are nothing; more is worth a warning.
            share = dropped / total
            log.log(
                logging.WARNING if share > 0.01 else logging.INFO,
                "even ends across ranks: every lane hands over %d item(s); %d item(s) at the end "
                "of the data, %.1f%% of the items, are dropped (uneven_end='carry')",
                steps,
                dropped,
                100 * share,
            )

    @property
    def ends_evenly(self) -> bool:
        """Whether this loader ends its rank at the same global step as the job's other ranks by
        itself: ``uneven_end="carry"`` with every lane's item count known (not after a
        re-laning, whose lanes run to their ends), or a stream without end. When False on a job
        of several ranks, end them with ``end_together``."""
        return self._ends_evenly

    # ----------------------------------------------------------------------------- iteration
    def __iter__(self) -> Loader:
        return self

    def end_together(self, all_reduce_min: Callable[[int], Any]) -> Iterator[Any]:
        """This loader's items, up to the first global step some rank of the job has none for,
        so that every rank stops at the same step and none is left waiting in a collective.
        ``all_reduce_min(n)`` is the job's own minimum all-reduce of one integer over its ranks
        (``torch.distributed``, ``mpi4py``, jax, ...): before each item every rank says whether
        it has one (1 or 0), and all stop at the first step where the minimum is 0. Every rank
        must call it, item for item, as it calls ``next()``. What this rank still had then is
        read, booked as delivered and counted in ``stats()["dropped_at_end"]``: no later global
        step could take it (see ``runtime.delivery.even_end``)."""
        if not callable(all_reduce_min):
            raise TypeError(
                "end_together needs a function taking this rank's 1 or 0 and returning the "
                f"minimum over all ranks, got {all_reduce_min!r}"
            )
        return self._until_one_ends(all_reduce_min)

    def _until_one_ends(self, all_reduce_min: Callable[[int], Any]) -> Iterator[Any]:
        fresh = self.served == 0  # the job has handed over nothing yet, on any rank
        yielded = 0
        for item in self:
            if int(all_reduce_min(1)) < 1:
                self._drop_rest(1, nothing_yet=fresh and not yielded)
                return
            yielded += 1
            yield item
        all_reduce_min(0)  # this rank is out: the others learn it at this same step
        if fresh and not yielded:
            log.warning(
                "rank %d has no data: every rank of the job stops at its first step with it "
                "(a dataset with fewer chunks than the job's lanes? give the source a smaller "
                "chunk_size or use fewer lanes)",
                self.plan.rank,
            )

    def _drop_rest(self, fetched: int, nothing_yet: bool = False) -> None:
        """Another rank's data ended: this rank's remaining items are read and handed to no one
        (its lanes then say they finished), and counted. ``nothing_yet``: it ended before the
        job's first step, so the job delivers nothing."""
        self.dropped_together += fetched + sum(1 for _ in self)
        if nothing_yet:
            log.warning(
                "rank %d delivered nothing: some rank had no data, and every rank stops at its "
                "first step with it; %d item(s) of this rank left undelivered (a dataset with "
                "fewer chunks than the job's lanes? give the source a smaller chunk_size or use "
                "fewer lanes)",
                self.plan.rank,
                self.dropped_together,
            )
            return
        log.info(
            "another rank's data ended: %d item(s) of rank %d left undelivered "
            "(stats()['dropped_at_end'])",
            self.dropped_together,
            self.plan.rank,
        )

    # The compiled step's hooks (``LoaderStep``): called by ``next()``, not by a training loop.
    def _start_or_refuse(self) -> None:
        """Before a delivery: refuse one from a failed or closed loader, start the lanes on the
        first."""
        if self._failure is not None:
            raise ZephonError(
                f"this loader failed earlier ({type(self._failure).__name__}: "
                f"{self._failure}); its state_dict() still says where it was"
            ) from self._failure
        if self._closed:
            if all(lane.ended for lane in self.lanes):
                raise StopIteration
            raise ZephonError(
                "this loader was closed; resume from its state_dict() with pipeline.iter()"
            )
        lanes = self.lanes
        self._started = True
        self.waits.begin()
        try:
            self._log_start()
            if self.retired.sets:  # screened at fetch too, from where replays allow it
                for lane in lanes:
                    lane.feed.start_at["retired"] = self.retired.sets
            # every lane's worker starts working at once
            began = perf_counter()
            start_feeds([lane.feed for lane in lanes if not lane.ended], lanes[self.next_lane].feed)
            self.waits.book(perf_counter() - began)
            for lane in lanes:  # a restored lane is back at its position first
                self._catch_up(lane)
            self._skip_steps()
        except BaseException as exc:
            self._fail(exc)
            raise

    def _catch_up(self, lane: LaneDelivery) -> None:
        replay = lane.replay
        shown = (
            None
            if replay is None
            else bar(replay.expect[0] - replay.count, f"zephon: replaying lane {lane.lane_id}")
        )
        if shown is None:
            lane.catch_up()
            return
        with shown:
            lane.catch_up(shown.update)

    def _skip_steps(self) -> None:
        """``skip_steps``: the next ``skip`` global steps' items are handed over to no one,
        booked as delivered, in the order ``next()`` takes them (an item of each lane a step,
        the lanes left filling the steps of those that ended), so the stream goes on where the
        uninterrupted run is that many global steps later."""
        steps = self.history.skip
        if not steps:
            return
        log.info("skipping %d global step(s) before delivering", steps)
        # Until every lane has skipped, the state is the one the skip starts from: a skip that
        # stops half-way (an error, an interrupt) leaves no lanes skipped with the skip to do.
        self._before_skip = self._state()
        lanes = self.lanes
        items = steps * len(lanes)
        while items:
            for _ in lanes:  # the next lane in turn that still has an item
                lane = lanes[self.next_lane]
                self.next_lane = (self.next_lane + 1) % len(lanes)
                if lane.next_delivery() is not None:
                    items -= 1
                    break
            else:
                break  # every lane has ended
        self.history.skip = 0
        self._before_skip = None

    def _note_inflight(self) -> None:
        """A lane announced a chunk: keep the most chunks the lanes held at once."""
        inflight = sum(lane.book.table.n_inflight for lane in self.lanes)
        if inflight > self.totals.max_inflight:
            self.totals.max_inflight = inflight

    def _log_start(self) -> None:
        plan = self.plan
        lanes = plan.rank_lanes
        log.info(
            "starting lanes %d..%d of %d (rank %d of %d), workers=%r, %s eviction path",
            lanes.start,
            lanes.stop - 1,
            plan.lanes,
            plan.rank,
            plan.world_size,
            plan.workers,
            plan.eviction_path,
        )
        for lane in self.lanes:
            if lane.replay is not None:
                log.info(
                    "lane %d: replaying %d record(s) up to %r before delivering",
                    lane.lane_id,
                    lane.replay.expect[0] - lane.replay.count,
                    lane.replay.target,
                )

    def _fail(self, exc: BaseException) -> None:
        """A delivery raised ``exc``: every later ``next()`` refuses, and the lanes stop."""
        if isinstance(exc, ContractViolation):
            self._untrusted = exc
        self._failure = exc
        self._stop_lanes()

    def _stop_lanes(self) -> None:
        close_feeds([lane.feed for lane in self.lanes])
        self._release_source()

    def _release_source(self) -> None:
        """The stream is over or the loader stopped: let the source and the setup go."""
        self.waits.end()  # no step comes after this one
        # This loader reads its source no more, and what the reads kept for later ones (decoded
        # row groups, bytes fetched ahead) would otherwise live as long as the pipeline does.
        # Its inline and thread lanes are done with their operators' setup too.
        release_in_process(self.plan)
        self.plan.source.drop_read_caches()

    def close(self) -> None:
        """Stop every lane's worker. The state still describes the last item handed over."""
        with self._lock:
            self._closed = True
            self._stop_lanes()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------- counters
    @property
    def mix_samples(self) -> dict[Hashable, int]:
        """Delivered samples per mixture component."""
        self.counts.flush()
        return self.counts.mix_samples

    @property
    def mix_tokens(self) -> dict[Hashable, int]:
        """Delivered tokens per mixture component (records that carry token counts)."""
        return self.counts.mix_tokens

    @property
    def replayed(self) -> int:
        """Records swallowed by the replay filter since the first restore of this run."""
        return self.totals.restored_replayed + sum(lane.replayed for lane in self.lanes)

    def stats(self) -> dict[str, Any]:
        """Counters of the run, valid at any time (also after the end and after ``close()``).

        ``delivered``/``tombstones``/``replayed``/``evicted_chunks``/``violations`` count records;
        ``inflight_chunks``/``max_inflight_chunks``/``bytes_held`` the bookkeeping held;
        ``mixture`` is the realized share per component of delivered tokens (of samples when
        nothing carries token counts), ``mixture_samples``/``mixture_tokens`` the counts behind
        it; tombstone tags operators asked to count (e.g. ``mixture_dropped``) appear under their
        own names; ``operators`` gives each chain operator's records in, items out (records and
        tombstones) and seconds spent; ``lanes`` each lane's delivered items, whether it ended,
        the items waiting in its current list (``buffered``), the item lists its worker has
        ready beyond it (``queued``, at most ``prefetch``; 0 for inline lanes) and its replay
        progress after a restore. ``skipped`` counts the records skipped since the run started
        (``Pipeline(on_error="skip")``; the latest are in ``skipped()``). ``dropped_at_end``
        counts the items this rank's lanes left out at the end of the data so that every rank
        delivers the same global steps (``uneven_end="carry"``, or ``end_together``).
        ``mixture_components`` gives per component its delivered ``samples`` and ``tokens``, the
        ``dropped_samples``/``dropped_tokens`` that counted tombstones carried (what
        ``ensure_mixture`` dropped), its realized ``share`` of delivered tokens or samples
        (``share_of``, as the target measures) and its ``target`` share: the last chain
        operator's ``target_mixture()``, else the source's (None without either).
        ``sources`` gives per data set (its dataset root) the bytes read from remote storage
        (``read_bytes``) and the shard cache's ``cache_hits`` and ``cache_misses``: this
        process's reads and each worker process's, as of its lane's latest chunk.
        ``trainer_wait`` says how long the training loop waited inside ``next()`` for item lists
        that were not ready: ``seconds`` in all and ``recent_seconds`` over the last
        ``recent_steps`` of the ``steps`` handed over since the first ``next()``, which was
        ``elapsed`` seconds ago (``runtime.workers.trainer_wait``).

        Safe to call from another thread (a metrics server's): it waits for the step under way."""
        with self._lock:
            return self._stats()

    def _stats(self) -> dict[str, Any]:
        basis = self.mix_tokens if self.mix_tokens else self.mix_samples
        total = sum(basis.values())
        counts = self.counts
        out: dict[str, Any] = {
            "delivered": counts.delivered,
            "tombstones": counts.tombstones,
            "replayed": self.replayed,
            "inflight_chunks": sum(lane.book.table.n_inflight for lane in self.lanes),
            "max_inflight_chunks": self.totals.max_inflight,
            "evicted_chunks": counts.evicted,
            "violations": self.policy.count,
            "mixture": {k: v / total for k, v in basis.items()} if total else {},
            "bytes_held": sum(lane.book.table.bytes_held for lane in self.lanes),
            "eviction_path": self.plan.eviction_path,
            "dropped_at_end": self.dropped_together
            + sum(lane.surplus for lane in self.lanes if lane.cut),
            "skipped": self.skips.count,
            "trainer_wait": self.waits.stats(),
        }
        for tag in self.plan.counted_tags:
            out[tag] = counts.tag_counts.get(tag, 0)
        out["mixture_samples"] = dict(self.mix_samples)
        out["mixture_tokens"] = dict(self.mix_tokens)
        out["mixture_components"] = self._mixture_components()
        out["operators"] = self._operator_stats()
        out["sources"] = self._source_stats()
        out["lanes"] = {
            lane.lane_id: {
                "delivered": lane.delivered,
                "ended": lane.ended,
                "buffered": len(lane.feed.buf) - lane.feed.pos,
                "queued": lane.feed.queued(),
                "replay": None
                if lane.replay is None
                else {"done": lane.replay.count, "of": lane.replay.expect[0]},
            }
            for lane in self.lanes
        }
        return out

    def explain(self) -> str:
        """The bottleneck named in words, with the numbers behind it
        (``zephon.observability.explain``)."""
        from zephon.observability.explain import explain

        return explain(self)

    def skipped(self) -> list[dict[str, Any]]:
        """The latest skipped records (``Pipeline(on_error="skip")``), oldest first, at most
        ``zephon.runtime.delivery.skips.KEEP``: each one's ``lane``, ``cursor``, ``sample_id``,
        where the source says the sample lives (``WorkSource.origin``: a file source's ``file``
        and ``sample_in_file``), the ``operator`` that failed on it and its ``error``. Only those
        handed over since this loader started: a restored run counts the earlier ones
        (``stats()["skipped"]``) but does not list them."""
        return list(self.skips.latest)

    def _mixture_components(self) -> dict[Hashable, dict[str, Any]]:
        """Delivered and dropped samples and tokens, realized and target share, per component."""
        target = self.plan.source.target_mixture()
        for op in self.plan.chain:
            target = op.target_mixture() or target
        by, shares = target if target is not None else (None, {})
        samples, tokens = self.mix_samples, self.mix_tokens
        dropped: dict[tuple[str, Hashable], int] = {}
        for key, n in self.counts.tag_counts.items():
            parsed = parse_heritage_key(key)
            if parsed is not None:
                _, kind, comp = parsed
                dropped[kind, comp] = dropped.get((kind, comp), 0) + n
        share_of = "tokens" if tokens and by != "samples" else "samples"
        basis = tokens if share_of == "tokens" else samples
        total = sum(basis.values())
        names = dict.fromkeys([*shares, *samples, *tokens, *(c for _, c in dropped)])
        return {
            c: {
                "samples": samples.get(c, 0),
                "tokens": tokens.get(c, 0),
                "dropped_samples": dropped.get(("samples", c), 0),
                "dropped_tokens": dropped.get(("tokens", c), 0),
                "share": basis.get(c, 0) / total if total else 0.0,
                "share_of": share_of,
                "target": shares.get(c, 0.0) if target is not None else None,
            }
            for c in names
        }

    def _operator_stats(self) -> dict[str, dict[str, float]]:
        """Per chain operator, summed over this rank's lanes as of each lane's latest chunk: its
        records in, items out and seconds, its own ``counters()`` and their ``ratios``."""
        labels = self.lanes[0].book.labels if self.lanes else []
        totals: list[dict[str, float]] = [
            {"records_in": 0, "items_out": 0, "seconds": 0.0} for _ in labels
        ]
        for lane in self.lanes:
            for total, row in zip(totals, lane.book.op_stats or ()):
                total["records_in"] += row[0]
                total["items_out"] += row[1]
                total["seconds"] += row[2]
                for name, value in (row[3] if len(row) > 3 else {}).items():
                    total[name] = total.get(name, 0) + value
        for op, total in zip(self.plan.chain, totals):
            for name, (part, whole) in op.ratios.items():
                if total.get(whole):
                    total[name] = total.get(part, 0) / total[whole]
        return dict(zip(labels, totals))

    def _source_stats(self) -> dict[str, dict[str, int]]:
        """Per data set, what this process's source and each worker's copy read."""
        here = process_key()
        parts = {here: self.plan.source.io_counters()}
        for lane in self.lanes:
            got = lane.book.source_io
            if got is not None and got[0] != here:  # inline and thread lanes read through ours
                # Lanes sharing a worker share its source: its latest counts are the largest.
                parts[got[0]] = latest_counters(parts.get(got[0], {}), got[1])
        return merge_counters(parts.values())

    @property
    def served(self) -> int:
        """Items this rank's ``next()`` calls handed over since the job started, as if every
        earlier run of the job had had this world size: ``served // (lanes // world_size)`` is
        the global step, whichever of the rank's lanes ended."""
        return self.served_offset + sum(lane.delivered for lane in self.lanes)

    # ----------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """A small JSON-serializable state: the position after the last item handed over.
        ``pipeline.iter(state=...)`` continues exactly from there. Each part comes from the
        stage that keeps it (``runtime.checkpoint.schema.STATE_FIELDS``)."""
        with self._lock:
            if self._before_skip is not None:  # the skip stopped half-way
                return self._before_skip
            if self._untrusted is not None:
                raise CheckpointError(
                    "this loader stopped on a contract violation in the middle of its "
                    f"bookkeeping ({self._untrusted}); a state taken now would be wrong. Resume "
                    "from the last state saved before it"
                )
            return self._state()

    def _state(self) -> dict[str, Any]:
        # ``state_dict`` without the lock (taken by the caller).
        plan = self.plan
        return seal(
            {
                "format": STATE_FORMAT,
                "version": STATE_VERSION,
                "fingerprint": plan.fingerprint,
                "pipeline": plan.fingerprint_parts,
                "rank": plan.rank,
                "world_size": plan.world_size,
                "lanes": plan.lanes,
                "layout": self.layout.encode(),
                "next_lane": self.next_lane,
                "served": self.served,
                "lane_states": [lane.state() for lane in self.lanes],
                **self.totals.state(self.replayed),
                **self.history.state(),
                "retired": self.retired.state(),
            }
        )

    def retire(self, retire: Any) -> None:
        """Never deliver the samples ``retire`` names from now on (before the first ``next()``):
        ``(dataset_id, shard, index)`` triples, or a predicate on one, evaluated now over every
        sample id of the source. They are kept in every later state; see ``runtime.retire``."""
        if self._started:
            raise CheckpointError("retire must be called before the first next()")
        taken = retired_ids(retire, self.plan.source)
        if not len(taken):
            return
        if len(self.retired.sets) == MAX_SETS:
            raise PlanError(
                f"this run has retired samples {MAX_SETS} times, as often as a state keeps; "
                "make a new source without them instead"
            )
        plan = self.plan
        horizons = {}
        for lane in self.lanes:
            if not lane.ended:
                horizons.update(
                    horizons_of(
                        lane.book.runs[lane.book.run_index :],
                        monotone=lane.book.monotone,
                        per_epoch=plan.epoch_chunks,
                        geometry=self.layout.geometry,
                    )
                )
        step = self.served // len(self.lanes)  # the global step, the same on every rank
        self.history.add({"event": "retire", "step": step, "ids": len(taken)})
        self.retired.add(Retirement(taken, horizons))
        self._screen_retired()
        self._end_evenly()  # lanes that lose more samples than others hand over fewer items

    def _screen_retired(self) -> None:
        """Every lane screens the run's retired samples, at delivery and at fetch."""
        sets = self.retired.sets
        union = RetiredIds(np.concatenate([r.ids.rows for r in sets])) if sets else None
        for lane in self.lanes:
            lane.feed.retired = union
            lane.fetch_screen = FetchScreen(sets)

    def load_state_dict(
        self, state: dict[str, Any], *, allow_changes: bool = False, retire: Any = None
    ) -> None:
        """Continue from ``state`` (this rank's own, or a job state from ``merge_states``); only
        before the first ``next()``. Every field is checked: a damaged or edited state raises
        ``CheckpointCorruptError``, a state of another pipeline ``CheckpointMismatchError``, and
        neither starts a stream.

        ``allow_changes=True`` also takes a state whose operators changed (their code or
        parameters; never the source): what was delivered stays delivered, the rest comes from
        the new operators. A ``PipelineChangeWarning`` names each changed operator and the change
        is kept in the state's ``history``. ``retire`` takes samples out from here on, as
        ``retire()`` right after the load does, except that lanes behind an operator that
        reorders records continue their epoch by position (what they consumed taken out at
        fetch), so that retired samples never reach an operator again."""
        if self._started:
            raise CheckpointError("load_state_dict must be called before the first next()")
        body = unseal(state, (STATE_FORMAT, JOB_FORMAT))
        plan = self.plan
        job = check_keys(body)
        relaning = plan.relane and type(body.get("lanes")) is int and body["lanes"] != plan.lanes
        check_bool(allow_changes, "allow_changes", "Loader.load_state_dict")
        changes = check_identity(body, plan, relane=relaning, allow_changes=allow_changes)
        self.history.restore(body)
        announced = self._take_changes(changes, body) if changes else None
        if retire is not None:
            self._by_position()
        self.retired.restore(body["retired"])
        self._screen_retired()
        if relaning:
            body = relaned_state(body, plan)
            job = True
        self.layout = check_layout(body["layout"], plan.lanes, plan.source.total_chunks())
        if self.layout.current or self.retired.sets:
            self._end_evenly()
        if job:
            lane_states = check_lane_list(body["lane_states"], plan.lanes)
            mine = [(f"lane_states[{g}]", lane_states[g]) for g in plan.rank_lanes]
        else:
            check_rank(body, plan.rank, plan.world_size)
            lane_states = check_lane_list(body["lane_states"], len(self.lanes))
            mine = [(f"lane_states[{i}]", s) for i, s in enumerate(lane_states)]
        checked = [lane.restore(s, w, self.layout) for lane, (w, s) in zip(self.lanes, mine)]
        if announced is not None:
            text = announced + self._partly_delivered()
            log.warning(text)
            warnings.warn(text, PipelineChangeWarning, stacklevel=3)
        delivered = sum(s["delivered"] for s in checked)
        if job:
            self.next_lane = rank_turn(checked)
            # a job of one rank may have been merged inside a global step: the rank resumes
            # there, as far into the step as its lanes' items say (unless lanes ended)
            into_step = check_job_turn(self.next_lane, lane_states, checked, plan.rank)
            self.served_offset = job_step(body) * len(self.lanes) + into_step - delivered
        else:
            self.next_lane = check_next_lane(body["next_lane"], checked)
            self.served_offset = rank_served(body) - delivered
        # a job's totals belong to all its ranks: this rank counts afresh
        self.totals.restore(body, counted=not job)
        if retire is not None:
            self.retire(retire)

    def _partly_delivered(self) -> str:
        """After a resume with changed operators: what to add to its announcement about lanes
        that replay (instead of going on by position) because samples were split over several
        records and partly delivered."""
        partly = {lane.lane_id: lane.partly_delivered for lane in self.lanes}
        shown = ", ".join(f"lane {g}: {n}" for g, n in sorted(partly.items()) if n)
        if not shown:
            return ""
        return (
            f". Samples split over several records were partly delivered at the checkpoint "
            f"({shown}): their lanes replay to the checkpoint with the new operators, which must "
            "make records of the same samples there (the resume stops with "
            "ReplayDivergenceError otherwise), and the rest of each such sample is taken by the "
            "position of its parts, so where the new operators cut it at other places a few of "
            "its tokens are delivered twice or not at all"
        )

    def _take_changes(self, changes: list[str], body: dict[str, Any]) -> str:
        """Resume with changed operators (``allow_changes``): keep it in the history, let the
        lanes go on by position or replay to meet the new operators' records, and return what
        the announcement (a ``PipelineChangeWarning``) says."""
        text = (
            "resuming a checkpoint with changed operators (allow_changes=True): "
            + "; ".join(changes)
            + ". What was delivered before the checkpoint stays delivered; everything after it "
            "comes from the new operators"
        )
        old = body["pipeline"].get("operators")
        new = self.plan.fingerprint_parts["operators"]
        self.history.add(change_event(state_step(body), changes, old, new))
        chain = self.plan.chain
        reordering = [op.name for op in chain if not op.traits.preserves_cursor_order]
        cause = changed_records(changes, reordering)
        merges = merged_records([op.name for op in chain if op.traits.stateful])
        for lane in self.lanes:
            lane.cause = cause
            # records reach delivery in cursor order: see ``ReplayFilter``
            lane.lenient = not reordering
            lane.merges = merges
        self._by_position()
        return text

    def _by_position(self) -> None:
        """Behind a reordering operator on the epoch path, lanes continue their epoch by
        position where the state says what they consumed (``checkpoint.progress``)."""
        if self.plan.reorders_epochs:
            for lane in self.lanes:
                lane.by_position = True
