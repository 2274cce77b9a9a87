"""The lane runner: one lane's chunks through its operator chain, as a stream of item lists.

A lane takes the chunk positions dealt to it, announces each chunk, fetches it in
count-based micro-batches, and pushes them through the operators. Control items and tombstones
travel with the records and keep their place: an operator only ever sees runs of real records.
On the epoch path every ``epoch_chunks`` chunks end an epoch: each operator processes what it
has, flushes, and the marker (with carry state) passes on. Where the runner runs (inline, thread,
process) is not its concern.
"""

from __future__ import annotations

import bisect
import copy
import numbers
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from time import perf_counter
from typing import Any

from zephon._core.records import RecordRun, count_closing, expand_runs, next_control
from zephon.errors import FetchError, OperatorError, ZephonError
from zephon.ops.base import Operator, introduce_neighbours, record_error
from zephon.ops.children import tombstone_meta, tombstones_for_record
from zephon.plan import Plan
from zephon.runtime.checkpoint.layout import Layout
from zephon.runtime.checkpoint.progress import EpochProgress
from zephon.runtime.checkpoint.retired import FetchScreen, Retirement
from zephon.runtime.lanes.control import (
    ChunkOpened,
    EpochEnd,
    Holdings,
    LaneEnd,
    OverClose,
    RunStart,
    Skipped,
)
from zephon.runtime.lanes.operator_setup import OperatorSetup, lane_copy
from zephon.runtime.lanes.overlap import NextRead
from zephon.runtime.lanes.retire_screen import screened_out, tombstoned
from zephon.runtime.lanes.snapshots import rebuild, snapshot_of
from zephon.sources.base import sample_origin
from zephon.sources.remote import is_transient
from zephon.sources.source_io import process_key
from zephon.types import ContributorRef, SampleCursor, SampleRecord

#: Samples read between two snapshots of what the stateful operators hold, when the chain has
#: an operator that keeps no state: what a restore replays at most before it delivers again (a
#: snapshot costs about what packing a few dozen sequences does). When no operator is
#: batch-sensitive, the operators from the first stateful one on get a micro-batch in pieces of
#: this many samples (those before it get it whole), so that snapshots fall inside it and a
#: restore re-reads only the piece it needs; otherwise snapshots wait for the end of a
#: micro-batch. A chain of stateful operators alone redoes only their own work on a restore,
#: and snapshots once per micro-batch.
SNAPSHOT_RECORDS = 64


def _split_at(items: list, lo: int, offset: int) -> int:
    """The index in ``items`` (from ``lo``) of the first record from a sample at chunk offset
    ``offset`` or later: items come in cursor order, a control item stays with what precedes it."""
    if next_control(items, lo) == len(items):
        return bisect.bisect_left(items, offset, lo, key=lambda r: r.meta.cursor.chunk_offset)
    for i in range(lo, len(items)):
        item = items[i]
        if type(item) is SampleRecord and item.meta.cursor.chunk_offset >= offset:
            return i
    return len(items)


def _snapshot_spacing(plan: Plan, ops: list[Operator]) -> tuple[int, int, int]:
    """``(spacing, piece, split_at)``: samples between snapshots, the size of the pieces a
    micro-batch goes through the operators in (the micro-batch itself when there are none), and
    the first operator that gets pieces (those before it get a read whole)."""
    mb = plan.micro_batch
    # A restore redoes what the operators that keep no state (a tokenizer) did for the held
    # records and for those after the snapshot: only with such an operator are snapshots this
    # close; a chain of holders alone snapshots once per micro-batch.
    spacing = SNAPSHOT_RECORDS if any(not op.traits.stateful for op in ops) else mb
    holder = next((j for j, op in enumerate(ops) if op.traits.stateful), len(ops))
    in_order = all(op.traits.preserves_cursor_order for op in ops[:holder])
    if plan.restores_holdings and not plan.batch_sensitive and in_order and mb > spacing:
        return spacing, spacing, holder
    return spacing, mb, 0


def operator_labels(ops: tuple[Operator, ...] | list[Operator]) -> list[str]:
    """Names that tell operators apart even when two share a name."""
    names = [op.name for op in ops]
    return [n if names.count(n) == 1 else f"{n}[#{i}]" for i, n in enumerate(names)]


def _error_text(exc: BaseException) -> str:
    """What a skipped record's report says of its error: its type and first line (without the
    record, which the report names), at most 300 characters."""
    text = f"{type(exc).__name__}: {exc}".split("\n", 1)[0]
    cursor = getattr(exc, "cursor", None)
    if isinstance(exc, OperatorError) and cursor is not None:  # ``record_error``'s own text
        text = text.split(f"(sample_id={cursor.sample_id}): ", 1)[-1]
    return text if len(text) <= 300 else text[:297] + "..."


def _failed_operator(exc: BaseException, label: str) -> str:
    """The operator a skipped record's report names: the one the error already names (an
    augmentation ``decode_images`` applied inside itself), else the one that was called."""
    context = exc.__dict__.get("context", {}) if isinstance(exc, ZephonError) else {}
    return context.get("operator") or label


def _caused_by(exc: BaseException, kind: Callable[[BaseException], bool]) -> bool:
    """Whether ``exc`` or an error in its chain of causes is of ``kind``."""
    err: BaseException | None = exc
    while err is not None:
        if kind(err):
            return True
        err = err.__cause__
    return False


def _storage_failed(exc: BaseException) -> bool:
    """The error came from the storage, not from one sample's data (an ``OSError``, or an error
    caused by one): such a read is never skipped, since it may well succeed on the next run."""
    return _caused_by(exc, lambda err: isinstance(err, OSError))


def _outage(exc: BaseException) -> bool:
    """An operator's read from the storage gave up on errors another attempt may not meet (a
    ``decode_images`` URI during an outage): never skipped, since the next run may read it."""
    return _caused_by(exc, is_transient)


class LaneRunner:
    """Runs lane ``lane_id``: its ``runs`` in order, each with fresh operators.

    A run is a stretch of one lane identity's local chunks (``gen``, ``lane``, ``start``, ``end``,
    ``carry``; see ``layout.Run.for_runner``): after a re-laning, first what lanes of an earlier
    generation had in flight, under their identity, then the lane's own chunks. Without ``runs``
    the lane runs its own chunks from local chunk ``start_local`` with ``carry``. ``layout`` is the
    job's lane history (a ``Layout``, or ``Layout.encode()``); ``skip_offset`` starts the first
    chunk at that offset (source-level skip on restore of an indexable plan); ``retired`` the
    samples screened out at fetch (``runtime.retire``). ``overlap=False`` makes the first
    operator's calls in the lane's thread even when it could run ahead (``overlap.NextRead``):
    for a read that stops early.
    """

    def __init__(
        self,
        plan: Plan,
        lane_id: int,
        *,
        start_local: int = 0,
        carry: list[Any] | None = None,
        skip_offset: int = 0,
        runs: list[dict[str, Any]] | None = None,
        layout: Layout | list[dict[str, Any]] | None = None,
        op_stats: list[list[Any]] | None = None,
        setup: OperatorSetup | Callable[[], OperatorSetup | None] | None = None,
        retired: list[Retirement] | None = None,
        overlap: bool = True,
    ):
        self.plan = plan
        self.screen = FetchScreen(retired) if retired else None
        self.lane_id = lane_id
        # The worker's set-up operators, which lanes copy (operator_setup); an inline or thread
        # lane gets the training process's, made on first use in the lane's own thread.
        self.setup = setup() if callable(setup) else setup
        total = plan.source.total_chunks()
        if layout is None:
            self.layout = Layout.fresh(plan.lanes, total)
        elif isinstance(layout, Layout):
            self.layout = layout  # read only: the lanes of a rank share it
        else:
            self.layout = Layout.decode(layout, total)
        self.runs = runs or [
            {"gen": 0, "lane": lane_id, "start": start_local, "end": None, "carry": carry}
        ]
        self.fetch: Any = copy.deepcopy(plan.fetch)
        self.fetch.bind(plan.source)  # the pointer-consuming operator reads from the plan's source
        self.ops: list[Operator] = []
        self.labels = operator_labels(plan.chain)
        self.skip_offset = skip_offset
        self._consumed: EpochProgress | None = None  # what the run takes out at fetch
        self.epoch_path = plan.eviction_path == "epoch"
        self._pools = [
            ThreadPoolExecutor(op.traits.workers, thread_name_prefix=f"zephon-{op.name}")
            if (op.traits.workers or 1) > 1
            and not op.traits.stateful
            and not op.traits.batch_sensitive
            else None
            for op in plan.chain
        ]
        # Operators a run of fetched records goes through as its payload list.
        self._by_payload = [
            op.maps_payloads and pool is None for op, pool in zip(plan.chain, self._pools)
        ]
        # The first operator's call on the next read, made ahead on a thread (``NextRead``).
        self._overlap = overlap
        self._next_read: NextRead | None = None
        # Per operator: whether a record it fails on is skipped (``Pipeline(on_error=...)``).
        self._skips = plan.skip_errors or (False,) * len(plan.chain)
        # Per operator: records in, records out, seconds inside process_many/flush.
        self.op_stats: list[list[float]] = (
            [list(s[:3]) for s in op_stats] if op_stats else [[0, 0, 0.0] for _ in plan.chain]
        )
        # Per operator: what the ``counters()`` of its copies in earlier runs counted.
        self.op_counts: list[dict[str, float]] = [
            dict(s[3]) if len(s) > 3 else {} for s in op_stats or [[] for _ in plan.chain]
        ]

    def stats_now(self) -> list[list[Any]]:
        """Per operator its records in, items out and seconds, then what its ``counters()``
        counted, over every run so far: what ``ChunkOpened`` and ``LaneEnd`` carry."""
        counts = [self._counters(j, op) for j, op in enumerate(self.ops)] or [
            {} for _ in self.op_counts
        ]
        return [
            [*stats, _summed(base, now)]
            for stats, base, now in zip(self.op_stats, self.op_counts, counts)
        ]

    def _counters(self, j: int, op: Operator) -> Mapping[str, Any]:
        """Operator ``j``'s ``counters()``, which must be numbers by name (they are added up over
        runs and lanes): an ``OperatorError`` naming the operator otherwise."""
        counts = self._hook(j, "counters", op.counters)
        if not isinstance(counts, Mapping):
            bad = f"{counts!r:.80}"
        else:
            bad = next((f"{k!r}: {v!r:.80}" for k, v in counts.items() if not _a_count(v)), "")
        if bad:
            raise OperatorError(
                f"operator {self.labels[j]!r} returned counters() that are not all numbers: "
                f"{bad}. counters() gives a dict of counts (ints or floats) by name, which "
                "Loader.stats() adds up over the lanes",
                operator=self.labels[j],
            ).add_context(lane=self.lane_id)
        return counts

    def _fresh(self, j: int, op: Operator) -> Operator:
        """A new copy of chain operator ``j`` for a run: of the set-up one when the worker set
        the chain up (sharing what setup loaded), else of the plan's."""
        if self.setup is not None:
            return self.setup.fresh(j)
        try:
            return lane_copy(op, self.labels[j], f"lane {self.lane_id}")
        except OperatorError as exc:
            raise exc.add_context(lane=self.lane_id) from exc.__cause__

    def _copy(self, op: Operator) -> Operator:
        """A copy of a running operator, to re-run one record on it."""
        return self.setup.copy(op) if self.setup is not None else copy.deepcopy(op)

    def _reset_audit(self) -> None:
        # Closing contributors each operator received and emitted in the current epoch.
        n = len(self.ops)
        self._closing_in = [0] * n
        self._closing_out = [0] * n
        self._over_reported = [False] * n

    def run(self) -> Generator[list, None, None]:
        """Yield lists of items (records, tombstones, control items) in lane order."""
        try:
            yield from self._run()
        finally:
            self.close()

    def _run(self) -> Generator[list, None, None]:
        for index, run in enumerate(self.runs):
            if index:
                yield [RunStart(index)]
            yield from self._run_chunks(run, self.skip_offset if index == 0 else 0)
        yield [LaneEnd(self.stats_now(), self._source_io())]

    def _run_chunks(self, run: dict[str, Any], skip_offset: int) -> Generator[list, None, None]:
        """One run: its chunks through fresh operators (carry state restored), epoch markers on
        the epoch path, a final flush."""
        plan = self.plan
        source = plan.source
        geometry = self.layout.geometry(run["gen"], run["lane"])
        self.seed_lane = self.layout.seed_lane(run["gen"], run["lane"])
        self.op_counts = [row[3] for row in self.stats_now()]  # before the copies go
        self.ops = [self._fresh(j, op) for j, op in enumerate(plan.chain)]
        introduce_neighbours(self.ops, self._skips)
        retired = self.screen.every() if self.screen is not None else None
        if retired is not None:  # rows in flight at a retirement keep their other samples
            for op in self.ops:
                op.leave_out(retired.contains)
        if run["carry"] is not None:
            for j, (op, state) in enumerate(zip(self.ops, run["carry"])):
                if state is not None:
                    self._hook(j, "restore_carry", op.restore_carry, state)
        self._reset_audit()
        stop = geometry.total if run["end"] is None else run["end"]
        per_epoch = plan.epoch_chunks
        mb = plan.micro_batch
        held = run.get("held")
        screened = run.get("screened")
        self._consumed = (  # what ``_read`` takes out
            None
            if screened is None
            else EpochProgress.decode(screened, "screened", run["start"], per_epoch)
        )
        k = start = run["start"] if held is None else held["next"]
        epoch = k // per_epoch
        self._start_epoch(epoch)
        if held is not None:  # continue after a snapshot: the holders get their records back
            self._closing_in = rebuild(
                self.ops, self.fetch, source, held["ops"], self.lane_id, held.get("kept")
            )
        snapshots = plan.restores_holdings
        spacing, piece, split_at = _snapshot_spacing(plan, self.ops)
        since_snapshot = 0
        resumed_at = 0 if held is None else held["offset"]  # inside chunk k: already announced
        ahead = source.read_ahead_chunks()
        first_reads = mb if piece < mb else 0  # records still read a piece at a time
        next_read = self._next_read_for(split_at)
        shape = (run, geometry, stop, mb, piece)  # what places this run's reads
        next_chunk: Any = None  # the chunk the read ahead is in, when it is the next one
        while stop is None or k < stop:
            position = geometry.position(k)
            chunk = next_chunk if next_chunk is not None else source.chunk(position)
            next_chunk = None
            if ahead:  # the source may fetch the data of the lane's next chunks meanwhile
                last = k + 1 + ahead if stop is None else min(stop, k + 1 + ahead)
                source.upcoming([geometry.position(j) for j in range(k + 1, last)])
            n = len(chunk)
            first = skip_offset if k == start else 0
            opened: list = []  # the announcement goes out with the chunk's first read
            if k == start and resumed_at:
                first = resumed_at
            else:
                opened = [
                    ChunkOpened(position, k, n, epoch, first, self.stats_now(), self._source_io())
                ]
            begin = first
            while begin < n:
                end = min(n, (begin // mb + 1) * mb)  # boundaries stay aligned after a skip
                # The first delivery of a run (after a restore: of what follows the snapshot)
                # waits for what the lane reads first: a micro-batch's worth of records is read
                # a piece at a time, so that it waits for a piece, not a whole micro-batch.
                if first_reads > 0:
                    end = min(end, (begin // piece + 1) * piece)
                    first_reads -= end - begin
                fetched = next_read.take((k, begin, end)) if next_read is not None else None
                if fetched is None:
                    fetched = self._read(run, k, position, chunk.pointers[begin:end], begin)
                # The next read: while the first operator works on this one (its call queued
                # behind this one's), or after this one's when the lane makes it itself.
                now = (k, end, chunk, first_reads)
                queued = next_read is not None and next_read.working()
                if next_read is not None and queued:
                    next_chunk = self._start_next(next_read, shape, now)
                records = self._push(0, fetched, split_at)
                if next_read is not None and not queued:
                    next_chunk = self._start_next(next_read, shape, now)
                if piece < mb:  # cut into pieces by cursor below
                    records = expand_runs(records)
                # One item list per read, pieces and snapshots in order: a process lane's
                # ``prefetch`` counts lists, so a list is what a micro-batch makes.
                made, opened = opened, []
                at, taken = begin, 0
                while at < end:
                    cut = min(end, (at // piece + 1) * piece)
                    upto = len(records) if cut == end else _split_at(records, taken, cut)
                    made += self._push(split_at, records[taken:upto])
                    taken = upto
                    # A snapshot once ``spacing`` samples went through since the last, at
                    # the end of a piece; never at the end of an epoch or of the run (a restore
                    # starts there from the epoch marker, or has nothing left).
                    since_snapshot += cut - at
                    allowed = cut < n or ((k + 1) % per_epoch and (stop is None or k + 1 < stop))
                    if snapshots and since_snapshot >= spacing and allowed:
                        where = (k, cut) if cut < n else (k + 1, 0)
                        made.append(
                            Holdings(where[0], where[1], epoch, snapshot_of(self.ops, self._hook))
                        )
                        since_snapshot = 0
                    at = cut
                if made:
                    yield made
                begin = end
            if opened:  # a chunk with nothing left to read
                yield opened
            k += 1
            if self.epoch_path and k % per_epoch == 0:
                yield self._end_epoch(epoch)
                since_snapshot = 0  # the marker is a place to restart from too
                epoch += 1
                if stop is None or k < stop:
                    self._start_epoch(epoch)
        if self.epoch_path:
            if k % per_epoch:  # a last, partial epoch
                yield self._end_epoch(epoch)
        else:
            out = self._flush_all()
            if out:
                yield out

    def _next_read_for(self, split_at: int) -> NextRead | None:
        """The lane's ``NextRead`` when its first operator may run ahead: it releases the GIL
        (``Operator.releases_gil``), keeps no state, gets whole reads (it comes before
        ``split_at``, where the pieces start) as lists of records, and has no pool of its own."""
        if not self._overlap or split_at < 1 or self._pools[0] is not None or self._by_payload[0]:
            return None
        op = self.ops[0]
        if op.traits.stateful or not op.releases_gil():
            return None
        if self._next_read is None:
            self._next_read = NextRead(self.labels[0])
        self._next_read.drop()  # nothing of an earlier run
        return self._next_read

    def _start_next(self, next_read: NextRead, shape: tuple, now: tuple) -> Any:
        """Read what follows ``now`` (a local chunk, where its read ended, the chunk, and the
        records still read a piece at a time) as the loop will, and start the first operator on
        it (``next_read``); not past the run's end (``shape``: the run, its geometry and end,
        the micro-batch and piece) nor into another epoch, whose operators start it first. The
        next chunk, when the read is in it (for the loop to take instead of making it again),
        else None."""
        run, geometry, stop, mb, piece = shape
        k, begin, chunk, first_reads = now
        found = chunk
        if begin == len(chunk):
            k, begin = k + 1, 0
            if (stop is not None and k >= stop) or (
                self.epoch_path and k % self.plan.epoch_chunks == 0
            ):
                return None
            found = self.plan.source.chunk(geometry.position(k))
        end = min(len(found), (begin // mb + 1) * mb)
        if first_reads > 0:  # the first reads still come a piece at a time
            end = min(end, (begin // piece + 1) * piece)
        if end > begin:
            fetched: Any
            try:
                fetched = self._read(run, k, found.position, found.pointers[begin:end], begin)
            except Exception as exc:  # raised when the loop reaches this read
                fetched = exc
            next_read.start((k, begin, end), fetched, self.ops[0])
        return found if found is not chunk else None

    def _read(self, run: dict[str, Any], k: int, position: int, pointers: Any, begin: int) -> list:
        """The items read from ``pointers`` (from offset ``begin`` of local chunk ``k``, at
        ``position``), the samples retired there as tombstones."""
        fetched = self._fetch(position, pointers, begin)
        consumed = self._consumed
        if consumed is not None:  # consumed before a resume with changed operators
            closed = consumed.closed(k, position, begin, begin + len(pointers))
            if closed is not None:
                fetched = screened_out(fetched, closed, begin)
        if self.screen is not None:
            retired = self.screen.ids_for(run["gen"], run["lane"], k)
            if retired is not None:
                fetched = tombstoned(fetched, retired)
        return fetched

    def _source_io(self) -> tuple[str, dict[str, dict[str, int]]] | None:
        """What this process's copy of the source read so far, and which process it is (the
        loader sums one per process)."""
        counts = self.plan.source.io_counters()
        return (process_key(), counts) if counts else None

    def _fetch(self, position: int, pointers: Any, start: int) -> list:
        try:
            read = self.fetch.fetch(position, pointers, start)
            if type(read) is RecordRun:
                return [read] if len(read) else []
            return read
        except Exception as exc:
            rows = self._fetch_rows(position, pointers, start, exc)
            if rows is not None:
                return rows
            if isinstance(exc, ZephonError):
                raise exc.add_context(lane=self.lane_id, chunk=position) from exc.__cause__
            first = pointers[0].tolist() if len(pointers) else None
            raise FetchError(
                f"reading {len(pointers)} samples of chunk {position} failed: "
                f"{type(exc).__name__}: {exc}"
            ).add_context(lane=self.lane_id, chunk=position, pointer=first) from exc

    def _fetch_rows(
        self, position: int, pointers: Any, start: int, failed: Exception
    ) -> list | None:
        """A read that failed, when the plan skips what ``fetch`` fails on: the samples read one
        at a time, those that fail alone skipped (a ``Skipped`` item and the tombstone of the
        sample's offset instead of a record). None, for the read to fail as it is, when no sample
        fails alone, or when the storage did (it may well succeed on the next run)."""
        if not self.plan.skip_fetch_errors or _storage_failed(failed):
            return None
        out: list = []
        skipped = 0
        for i in range(len(pointers)):
            try:
                read = self.fetch.fetch(position, pointers[i : i + 1], start + i)
            except Exception as exc:
                if _storage_failed(exc):
                    return None
                cursor = SampleCursor(position, start + i, tuple(pointers[i].tolist()), ())
                tomb = tombstone_meta(ContributorRef(cursor, True), self.fetch.lane_id)
                out += [
                    Skipped(cursor, self.fetch.name, _error_text(exc)),
                    SampleRecord(tomb, None),
                ]
                skipped += 1
            else:
                out += [read] if type(read) is RecordRun else read
        return out if skipped else None

    def _start_epoch(self, epoch: int) -> None:
        # Seeds come from the identity of the lane whose chunks these are (``seed_lane``), which
        # is the lane itself unless it finishes another lane's run after a re-laning.
        self.fetch.start_epoch(self.seed_lane, epoch)
        for j, op in enumerate(self.ops):
            self._hook(j, "start_epoch", op.start_epoch, self.seed_lane, epoch)

    def _push(self, first_op: int, items: list, stop_op: int | None = None) -> list:
        for j in range(first_op, len(self.ops) if stop_op is None else stop_op):
            if not items:
                break
            items = self._apply(j, items)
        return items

    def _apply(self, j: int, items: list) -> list:
        """Operator ``j`` over runs of real records; everything else keeps its place."""
        if self._by_payload[j] and len(items) == 1 and type(items[0]) is RecordRun:
            return self._call(j, items[0])
        items = expand_runs(items)
        n = len(items)
        stop = next_control(items, 0)
        if stop == n:
            return self._call(j, items)
        out: list = []
        start = 0
        while start < n:
            if stop > start:
                out.extend(self._call(j, items[start:stop]))
            if stop < n:
                out.append(items[stop])
                start = stop + 1
                stop = next_control(items, start) if start < n else n
            else:
                break
        return out

    def _call(self, j: int, records: list[SampleRecord] | RecordRun) -> list:
        """Operator ``j`` over a list of real records, or over a run (``maps_payloads``)."""
        op = self.ops[j]
        began = perf_counter()
        made = None
        if j == 0 and self._next_read is not None and type(records) is list:
            made = self._next_read.result_for(records)
        try:
            if made is not None:  # made ahead, on exactly these records
                out, seconds = made
                began -= seconds
            elif isinstance(records, RecordRun):
                out = op.map_payloads(records)
            elif self._pools[j] is not None and len(records) > 1:
                out = self._pooled(j, records)
            else:  # a list of its own: the runner still needs ``records`` if the call fails
                out = op.process_many(records[:])
            if type(out) is not list and not isinstance(records, RecordRun):
                out = _listed(out)
        except ZephonError as exc:
            if skipped := self._skipped_instead(j, records, began, exc):
                return skipped
            exc.add_context(lane=self.lane_id, operator=self.labels[j])
            raise self._placed(exc) from exc.__cause__
        except Exception as exc:
            if skipped := self._skipped_instead(j, records, began, exc):
                return skipped
            raise self._placed(
                self._locate_error(op, records, exc).add_context(lane=self.lane_id)
            ) from exc
        except SystemExit as exc:  # in a worker it would end the worker, inline the training run
            culprit = self._culprit(op, records, (Exception, SystemExit))
            cursor = None if culprit is None else culprit.meta.cursor
            where = (
                self._micro_batch(records)
                if cursor is None
                else f"record {cursor!r} (sample_id={cursor.sample_id})"
            )
            error = OperatorError(
                f"operator {self.labels[j]!r} called sys.exit({exc.code!r}) on {where}: an "
                "operator must raise an exception, not exit the process",
                operator=self.labels[j],
                cursor=cursor,
            )
            raise self._placed(error.add_context(lane=self.lane_id)) from exc
        stats = self.op_stats[j]
        stats[0] += len(records)
        stats[2] += perf_counter() - began
        if isinstance(records, RecordRun):
            stats[1] += len(records)
            return [self._mapped_run(j, records, out)]
        out = self._emitted(j, "process_many", out)
        stats[1] += len(out)
        return self._audit(j, records, out)

    def _skipped_instead(
        self, j: int, records: list[SampleRecord] | RecordRun, began: float, exc: BaseException
    ) -> list | None:
        """What operator ``j``'s call becomes when it may skip the records that failed alone
        (``_skip_failing``); None, to raise ``exc``, when it may not skip, or the storage failed
        (the next run may read it: never skipped)."""
        if not self._skips[j] or _outage(exc):
            return None
        return self._skip_failing(j, records, began)

    def _skip_failing(
        self, j: int, records: list[SampleRecord] | RecordRun, began: float
    ) -> list | None:
        """Operator ``j`` (which keeps no state) failed on a micro-batch: run it again one record
        at a time, and skip each record it fails on (a ``Skipped`` item, then the record's
        tombstones), so that the others still go through, the same ones on every run. None, for
        the micro-batch to fail as without skipping, when no record fails alone (the records
        only fail together: not a bad record)."""
        op, label = self.ops[j], self.labels[j]
        received = records.records() if isinstance(records, RecordRun) else records
        out: list = []
        emitted: list = []
        for rec in received:
            try:
                got = _listed(op.process_many([rec]))
            except Exception as exc:
                if _outage(exc):
                    return None
                out.append(Skipped(rec.meta.cursor, _failed_operator(exc, label), _error_text(exc)))
                got = tombstones_for_record(rec)
            got = self._emitted(j, "process_many", got)
            out += got
            emitted += got
        if len(emitted) == len(out):
            return None
        stats = self.op_stats[j]
        stats[0] += len(received)
        stats[1] += len(emitted)
        stats[2] += perf_counter() - began
        audited = self._audit(j, received, emitted)
        return out if audited is emitted else [audited[0], *out]

    def _mapped_run(self, j: int, run: RecordRun, payloads: Any) -> RecordRun:
        try:
            mapped = run.with_payloads(payloads)  # a list of one payload per record, or raises
        except (TypeError, ValueError):
            raise OperatorError(
                f"operator {self.labels[j]!r} mapped a run of {len(run)} records starting at "
                f"{run[0].meta.cursor!r} to {payloads!r:.80}: map_payloads must return a list "
                "of one payload per record",
                operator=self.labels[j],
            ).add_context(lane=self.lane_id) from None
        self._closing_in[j] += len(run)  # each record of a run closes its own offset
        self._closing_out[j] += len(run)
        return mapped

    def _pooled(self, j: int, records: list[SampleRecord]) -> list:
        # Contiguous slices on worker threads, results re-emitted in input order. Only for
        # stateless operators that are not batch-sensitive, so the output cannot differ.
        pool = self._pools[j]
        assert pool is not None
        size = -(-len(records) // (self.ops[j].traits.workers or 1))
        parts = [records[i : i + size] for i in range(0, len(records), size)]
        outs = list(pool.map(lambda part: _listed(self.ops[j].process_many(part)), parts))
        if any(type(out) is not list for out in outs):
            return next(out for out in outs if type(out) is not list)  # refused by the caller
        return [rec for out in outs for rec in out]

    def close(self) -> None:
        """Shut down the operator thread pools and the thread of the read ahead."""
        for pool in self._pools:
            if pool is not None:
                pool.shutdown(wait=True)
        if self._next_read is not None:
            self._next_read.close()

    def _audit(self, j: int, received: list[SampleRecord], emitted: list) -> list:
        # A correct operator never emits more closing contributors than it received; one that does
        # closes offsets early, so a marker goes ahead of its output to name it at delivery.
        try:
            self._closing_in[j] += count_closing(received)
            self._closing_out[j] += count_closing(emitted)
        except TypeError as exc:
            raise OperatorError(
                f"operator {self.labels[j]!r} returned something that is not a SampleRecord: {exc}",
                operator=self.labels[j],
            ) from None
        if self._closing_out[j] > self._closing_in[j] and not self._over_reported[j]:
            self._over_reported[j] = True
            return [OverClose(self.labels[j]), *emitted]
        return emitted

    def _placed(self, error: ZephonError) -> ZephonError:
        """``error`` with the file of the sample its cursor names and the sample's place in it,
        where the source can tell (``WorkSource.origin``)."""
        return error.add_context(**sample_origin(self.plan.source, getattr(error, "cursor", None)))

    def _locate_error(
        self, op: Operator, records: Sequence[SampleRecord], exc: Exception
    ) -> OperatorError:
        """The error of ``op``'s call on ``records``, naming the record to blame (``_culprit``).
        Where there is none to name, the error names the micro-batch and says why it names no
        record: nobody should retire or mend an innocent one."""
        culprit = self._culprit(op, records, Exception)
        if culprit is not None:
            return record_error(op, culprit, exc)
        why = (
            "it keeps state, so they were not called again one at a time to find the culprit"
            if op.traits.stateful
            else "each of them went through when called again alone: no record is to blame (they "
            "fail only together, or the failure comes and goes)"
        )
        return OperatorError(
            f"operator {op.name!r} failed on {self._micro_batch(records)}; {why}: "
            f"{type(exc).__name__}: {exc}",
            operator=op.name,
        )

    def _culprit(
        self,
        op: Operator,
        records: Sequence[SampleRecord],
        failures: type[BaseException] | tuple[type[BaseException], ...],
    ) -> SampleRecord | None:
        """The record to blame for ``op``'s failed call on ``records``: the only one, else (an
        operator that keeps no state) the first whose call alone raises one of ``failures``.
        None when no record fails alone, or when ``op`` keeps state and cannot be called
        again."""
        if len(records) == 1:
            return records[0]
        if op.traits.stateful:
            return None
        for rec in records:
            try:
                probe = self._copy(op)
            except Exception:  # it holds what cannot be copied (a lock made in start_epoch):
                probe = op  # it keeps no state, so it may be called itself
            try:
                _listed(probe.process_many([rec]))
            except failures:
                return rec
        return None

    @staticmethod
    def _micro_batch(records: Sequence[SampleRecord]) -> str:
        first, last = records[0].meta.cursor, records[-1].meta.cursor
        return f"a micro-batch of {len(records)} records, {first!r} to {last!r}"

    def _hook(self, j: int, hook: str, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``, operator ``j``'s method ``hook`` other than ``process_many``; an
        error in it is an ``OperatorError`` naming the operator, the method and the lane."""
        label = self.labels[j]
        try:
            return call(*args)
        except ZephonError as exc:
            raise exc.add_context(lane=self.lane_id, operator=label) from exc.__cause__
        except Exception as exc:
            raise OperatorError(
                f"operator {label!r} failed in {hook}(): {type(exc).__name__}: {exc}",
                operator=label,
            ).add_context(lane=self.lane_id) from exc
        except SystemExit as exc:
            raise OperatorError(
                f"operator {label!r} called sys.exit({exc.code!r}) in {hook}(): an operator "
                "must raise an exception, not exit the process",
                operator=label,
            ).add_context(lane=self.lane_id) from exc

    def _emitted(self, j: int, method: str, out: Any) -> list:
        """``out``, what operator ``j``'s ``method`` returned (a generator already made a list by
        ``_listed``), when it is a list; an ``OperatorError`` naming the operator otherwise."""
        if type(out) is list:
            return out
        raise OperatorError(
            f"operator {self.labels[j]!r} returned {out!r:.80} from {method}() instead of a "
            "list of SampleRecords (the records and tombstones it emits; [] for none)",
            operator=self.labels[j],
        ).add_context(lane=self.lane_id)

    def _flush_from(self, j: int) -> list:
        op = self.ops[j]
        flushed = self._emitted(j, "flush", self._hook(j, "flush", lambda: _listed(op.flush())))
        return self._push(j + 1, self._audit(j, [], flushed))

    def _flush_all(self) -> list:
        out: list = []
        for j in range(len(self.ops)):
            out.extend(self._flush_from(j))
        return out

    def _end_epoch(self, epoch: int) -> list:
        out = self._flush_all()
        deficits = {
            label: cin - cout
            for label, cin, cout in zip(self.labels, self._closing_in, self._closing_out)
            if cin != cout
        }
        carry = [self._hook(j, "carry_state", op.carry_state) for j, op in enumerate(self.ops)]
        self._reset_audit()
        out.append(EpochEnd(epoch, carry, deficits))
        return out


def _a_count(value: Any) -> bool:
    """Whether ``value`` is a number, which counts of several lanes add up."""
    return isinstance(value, numbers.Real)


def _listed(out: Any) -> Any:
    """An operator's output as a list: a generator's or a tuple's items (a generator's code runs
    here, inside the call, where its errors are the operator's); what is not iterable as it is,
    for ``LaneRunner._emitted`` to refuse."""
    return list(out) if isinstance(out, Iterable) else out


def _summed(base: dict[str, float], more: Mapping[str, float]) -> dict[str, float]:
    """Two operators' counts added up, name by name."""
    out = dict(base)
    for name, value in more.items():
        out[name] = out.get(name, 0) + value
    return out
