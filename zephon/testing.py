"""Tools for operator authors: ``check_operator`` finds the bookkeeping mistakes that lose data,
``check_resume`` checks that a whole pipeline resumes exactly from any step."""

from __future__ import annotations

import contextlib
import contextvars
import copy
import itertools
import json
import math
import os
import pickle
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon.ops.base import Operator, OperatorContext
from zephon.runtime.lanes.operator_setup import OperatorSetup
from zephon.types import RecordRun, SampleBatch, SampleRecord

if TYPE_CHECKING:
    from zephon.planner import Pipeline

__all__ = ["check_operator", "check_resume"]


#: The check's set-up operator, while ``check_operator`` checks an operator with ``setup``.
_SET_UP: contextvars.ContextVar[OperatorSetup | None] = contextvars.ContextVar(
    "zephon_check_setup", default=None
)


def _fresh(op: Operator) -> Operator:
    """A copy of ``op`` to run, sharing what its setup loaded, as a lane's copy does."""
    setup = _SET_UP.get()
    return setup.copy(op) if setup is not None else copy.deepcopy(op)


def _run(op: Operator, records: Sequence[SampleRecord], lane_id: int) -> list[SampleRecord]:
    fresh = _fresh(op)
    fresh.start_epoch(lane_id, 0)
    out = _returned(op, "process_many", fresh.process_many(list(records)))
    out += _returned(op, "flush", fresh.flush())  # a generator above has run to its end
    for item in out:
        if not isinstance(item, SampleRecord):
            raise AssertionError(f"{op.name} returned {item!r}, which is not a SampleRecord")
    return out


def _returned(op: Operator, method: str, made: Any) -> list[SampleRecord]:
    """What ``op``'s ``method`` returned, as a list: a list, or a generator's items, as the lane
    runner takes them."""
    if not isinstance(made, Iterable):
        raise AssertionError(
            f"{op.name}: {method}() returned {made!r:.80} instead of a list of SampleRecords"
        )
    return list(made)


def check_operator(op: Operator, records: Sequence[SampleRecord], *, lane_id: int = 0) -> None:
    """Run ``op`` (with flush) twice on ``records`` and raise ``AssertionError`` explaining the
    first broken rule: non-deterministic cursors or payloads, a primary cursor that is not
    unique in the lane, payloads of ``records`` changed in place, a base offset never closed (a
    dropped record without its tombstone), a base offset closed before its last record, output
    out of order despite ``preserves_cursor_order``, or (for ``stateful`` operators) a
    ``carry_state`` that does not survive a round trip into the next epoch; for
    ``maps_payloads`` operators, ``map_payloads`` on the records as one run giving other
    payloads than ``process_many``, or ``process_many`` changing a record's metadata."""
    if any(r.meta.is_tombstone for r in records):
        raise ValueError("check_operator takes real records; operators never receive tombstones")
    with _set_up([op], lane_id) as (set_up,):
        _check_operator(set_up, records, lane_id)


@contextlib.contextmanager
def _set_up(chain: Sequence[Operator], lane_id: int) -> Iterator[list[Operator]]:
    """``chain`` set up once, as a worker sets up its copies, when an operator of it has a
    ``setup`` (torn down at the end): every run inside copies the set-up operators, sharing
    what their setup loaded (``_fresh``)."""
    if not any(op.has_setup for op in chain):
        yield list(chain)
        return
    setup = OperatorSetup(chain, OperatorContext("inline", (lane_id,), 0, 1, os.getpid()))
    token = _SET_UP.set(setup)
    try:
        yield [setup.fresh(j) for j in range(len(chain))]
    finally:
        _SET_UP.reset(token)
        setup.teardown()


def _check_operator(op: Operator, records: Sequence[SampleRecord], lane_id: int) -> None:
    given = [_comparable(r.payload) for r in records]
    if op.maps_payloads:
        _check_payload_mapping(op, records, lane_id)
    first = _run(op, records, lane_id)
    _check_inputs_unchanged(op, records, given)
    second = _run(op, records, lane_id)
    name = op.name

    def cursors(out: list[SampleRecord]) -> list[tuple[bool, object]]:
        return [(r.meta.is_tombstone, r.meta.cursor) for r in out]

    if cursors(first) != cursors(second):
        diff = (
            next(i for i, (a, b) in enumerate(zip(cursors(first), cursors(second))) if a != b)
            if len(first) == len(second)
            else min(len(first), len(second))
        )
        raise AssertionError(
            f"{name}: cursors are not deterministic: two runs on the same records differ at "
            f"output {diff} ({len(first)} vs {len(second)} outputs). Derive randomness from "
            "(seed, lane, epoch) and child indices from emission order."
        )

    for i, (a, b) in enumerate(zip(first, second)):
        if not _same(_comparable(a.payload), _comparable(b.payload)):
            raise AssertionError(
                f"{name}: payloads are not deterministic: two runs on the same records give "
                f"output {i} ({a.meta.cursor!r}) different payloads. Draw randomness from "
                "(seed, lane, epoch) (zephon.ops.base.epoch_rng in start_epoch), never from an "
                "unseeded generator, the time or object ids."
            )

    real = [r for r in first if not r.meta.is_tombstone]
    seen: set[object] = set()
    for rec in real:
        if rec.meta.cursor in seen:
            raise AssertionError(
                f"{name}: primary cursor {rec.meta.cursor!r} is emitted twice; every record of a "
                "lane needs its own cursor (use spawn_child, or cursor.child(start) when packing)"
            )
        seen.add(rec.meta.cursor)

    # An order-preserving operator must emit an offset's closing record last. A reordering one
    # may emit siblings after it (delivery waits for the epoch marker), but never close twice.
    ordered = op.traits.preserves_cursor_order
    closed: dict[tuple[int, int], int] = {}
    for i, rec in enumerate(first):
        for ref in rec.meta.contribution_refs():
            base = ref.base_offset
            if base in closed and not rec.meta.is_tombstone and (ordered or ref.is_last_child):
                raise AssertionError(
                    f"{name}: base offset {base} is closed by output {closed[base]} but output "
                    f"{i} ({rec.meta.cursor!r}) still carries it: only the last record of an "
                    "offset may set is_last_child"
                )
            if ref.is_last_child:
                closed.setdefault(base, i)

    owed = {
        ref.base_offset for r in records for ref in r.meta.contribution_refs() if ref.is_last_child
    }
    missing = sorted(owed - set(closed))
    if missing:
        raise AssertionError(
            f"{name}: base offset(s) {missing[:10]} are never closed: a dropped record needs its "
            "tombstones (zephon.ops.children.tombstones_for_record)"
        )

    if op.traits.preserves_cursor_order:
        for prev, rec in itertools.pairwise(real):
            if rec.meta.cursor < prev.meta.cursor:
                raise AssertionError(
                    f"{name}: claims preserves_cursor_order=True but emits {rec.meta.cursor!r} "
                    f"after {prev.meta.cursor!r}; declare preserves_cursor_order=False"
                )

    if op.emits_received_records:
        received = {r.meta.cursor: r for r in records}
        for i, rec in enumerate(first):
            was = received.get(rec.meta.cursor)
            if not rec.meta.is_tombstone and (
                was is None
                or rec.meta != was.meta
                or not _same(_comparable(rec.payload), _comparable(was.payload))
            ):
                raise AssertionError(
                    f"{name}: sets emits_received_records but output {i} ({rec.meta.cursor!r}) "
                    "is not a record it received, as it received it: a restore rebuilds what "
                    "the operators after it hold without running it. Emit received records "
                    "unchanged, or leave emits_received_records False"
                )

    if not op.traits.stateful and not op.traits.batch_sensitive:
        _check_grouping(op, records, first, lane_id)

    if op.traits.stateful:
        _carry_round_trip(op, records, lane_id)


def _check_inputs_unchanged(op: Operator, records: Sequence[SampleRecord], given: list) -> None:
    """The payloads ``op`` received are as they were (``given``): a source that holds its
    samples (``ListSource``) hands the same objects out again, at the next pass and when a
    resume replays them."""
    for i, (rec, was) in enumerate(zip(records, given)):
        if not _same(_comparable(rec.payload), was):
            raise AssertionError(
                f"{op.name}: changes the payload of input {i} ({rec.meta.cursor!r}) in place; an "
                "in-memory source hands that payload out again at the next pass and at a "
                "resume's replay, changed. Make a new payload ({**payload, ...}, array.copy())"
            )


def _check_grouping(
    op: Operator, records: Sequence[SampleRecord], whole: list[SampleRecord], lane_id: int
) -> None:
    """An operator that keeps no state and is not batch-sensitive gives the same outputs when
    its records come one at a time (as a thread pool's slices, a restore's pieces and a skip's
    calls of one record give them) as in one call (``whole``)."""

    def outputs(out: list[SampleRecord]) -> list[tuple]:
        return [(r.meta.is_tombstone, r.meta.cursor, _comparable(r.payload)) for r in out]

    alone = outputs([rec for r in records for rec in _run(op, [r], lane_id)])
    if not _same(alone, outputs(whole)):
        pairs = enumerate(zip(alone, outputs(whole)))
        i = next((k for k, (a, b) in pairs if not _same(a, b)), None)
        where = f"output {i}" if i is not None else f"{len(alone)} vs {len(whole)} outputs"
        raise AssertionError(
            f"{op.name}: gives other outputs when its records come one at a time than in one "
            f"call ({where}), but does not declare batch_sensitive=True: the runtime cuts "
            "micro-batches into slices for a thread pool (workers=), into pieces on a restore, "
            "and into single records to skip a bad one, so the stream would depend on them. "
            "Declare batch_sensitive=True, or stateful=True for state kept across calls (a "
            "random generator drawn from record after record is such state: seed each "
            "record's draws from its cursor instead)."
        )


def _check_payload_mapping(op: Operator, records: Sequence[SampleRecord], lane_id: int) -> None:
    """``map_payloads`` over the records as runs (root records, consecutive offsets of a chunk)
    gives what ``process_many`` gives them, which keeps every record's metadata."""
    by_record = _run(op, records, lane_id)
    if [r.meta for r in by_record] != [r.meta for r in records]:
        raise AssertionError(
            f"{op.name}: sets maps_payloads but process_many does not return one record per "
            "record with its metadata unchanged (no drops, splits, reordering or new metas)"
        )
    i = 0
    while i < len(records):  # the longest runs the records make, as fetch would read them
        j = i + 1
        if _plain_root(records[i]):  # a run starts here
            while j < len(records) and _follows(records[j - 1], records[j]):
                j += 1
            part = records[i:j]
            cursor = part[0].meta.cursor
            run = RecordRun(
                cursor.chunk_id,
                [r.meta.cursor.sample_id for r in part],
                [r.payload for r in part],
                part[0].meta.lane_id,
                [r.meta.component for r in part],
                cursor.chunk_offset,
            )
            fresh = _fresh(op)
            fresh.start_epoch(lane_id, 0)
            mapped = fresh.map_payloads(run)
            if type(mapped) is not list:  # as the lane runner requires
                raise AssertionError(
                    f"{op.name}: map_payloads returned {type(mapped).__name__}, not a list of "
                    "one payload per record"
                )
            got = [_comparable(p) for p in mapped]
            if not _same(got, [_comparable(r.payload) for r in by_record[i:j]]):
                raise AssertionError(
                    f"{op.name}: map_payloads gives other payloads than process_many for the "
                    f"{j - i} records from {cursor!r} taken as one run"
                )
        i = j


def _plain_root(rec: SampleRecord) -> bool:
    """``rec`` is what a run holds: a root record closing its own offset, with no tags or
    mixture counts."""
    m = rec.meta
    return (
        m.contributors is None
        and not m.tags
        and m.component_sample_counts is None
        and m.component_token_counts is None
        and not m.cursor.lineage
    )


def _follows(prev: SampleRecord, rec: SampleRecord) -> bool:
    """``rec`` is a plain root record that a run holding ``prev`` may hold next."""
    a, b = prev.meta, rec.meta
    return (
        _plain_root(rec)
        and a.lane_id == b.lane_id
        and a.cursor.chunk_id == b.cursor.chunk_id
        and b.cursor.chunk_offset == a.cursor.chunk_offset + 1
    )


def _comparable(value: Any) -> Any:
    """A payload as a comparable value: arrays and tensors by dtype, shape and bytes (an array
    of objects by its items), numpy scalars by their bytes, a NaN equal to a NaN."""
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:  # its bytes are addresses
            return ("ndarray", value.dtype.str, value.shape, _comparable(value.tolist()))
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, np.generic):
        return ("scalar", value.dtype.str, value.tobytes())
    if isinstance(value, float) and math.isnan(value):
        return ("nan",)
    if type(value).__module__.startswith("torch") and hasattr(value, "detach"):
        # A tensor's == is elementwise: by dtype, shape and the bytes of its values instead.
        flat = value.detach().cpu().contiguous().reshape(-1)
        return ("tensor", str(value.dtype), tuple(value.shape), _tensor_bytes(flat))
    if isinstance(value, dict):
        return tuple(sorted((str(k), _comparable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_comparable(v) for v in value)
    if isinstance(value, SampleRecord):
        return ("record", value.meta.cursor, _comparable(value.payload))
    if type(value).__eq__ is object.__eq__ and isinstance(getattr(value, "__dict__", None), dict):
        # Equal only to itself: by its class and attributes instead.
        return ("object", type(value).__qualname__, _comparable(vars(value)))
    return value


def _same(a: Any, b: Any) -> bool:
    """Whether two comparable values (``_comparable``) are equal; where ``==`` gives no single
    truth (a data frame's compares element by element), by their pickles."""
    try:
        return bool(a == b)
    except Exception:
        try:
            return pickle.dumps(a) == pickle.dumps(b)
        except Exception:  # nothing to tell them apart by: no difference to report
            return True


def _tensor_bytes(flat: Any) -> Any:
    """The bytes of a flat CPU tensor's values (its items, for a dtype no byte view takes)."""
    import torch  # loaded already: the value is one of its tensors

    try:
        return flat.view(torch.uint8).numpy().tobytes()
    except (RuntimeError, TypeError):
        return _comparable(flat.tolist())


def _item(item: Any) -> tuple:
    if isinstance(item, SampleBatch):
        return ("batch", tuple(r.meta.cursor for r in item), _comparable(item.payload))
    return ("record", item.meta.cursor, _comparable(item.payload))


def _carry_round_trip(op: Operator, records: Sequence[SampleRecord], lane_id: int) -> None:
    """A stateful operator continued into a second epoch and a fresh copy restored from its
    ``carry_state()`` (through JSON, as in a checkpoint) must emit the same second epoch: one of
    new records, and one that sees the first epoch's records again (what a deduplicating or
    counting operator remembers shows only on records it has seen)."""
    half = len(records) // 2
    first, second = list(records[:half]), list(records[half:])
    for later in (second, first):
        original = _fresh(op)
        original.start_epoch(lane_id, 0)
        original.process_many(first)
        original.flush()
        carry = original.carry_state()
        try:
            saved = json.loads(json.dumps(carry))
        except (TypeError, ValueError) as exc:
            raise AssertionError(f"{op.name}: carry_state() is not JSON data: {exc}") from None
        original.start_epoch(lane_id, 1)
        expected = [*original.process_many(later), *original.flush()]
        restored = _fresh(op)
        if saved is not None:
            restored.restore_carry(saved)
        restored.start_epoch(lane_id, 1)
        got = [*restored.process_many(later), *restored.flush()]
        if not _same([_comparable(r) for r in got], [_comparable(r) for r in expected]):
            what = "returns None" if saved is None else f"returns {str(saved)[:80]}"
            again = "" if later is second else ", on records it saw in the epoch before,"
            raise AssertionError(
                f"{op.name}: a copy restored from carry_state() (which {what}) emits a "
                f"different next epoch{again} than the operator itself: carry_state() must "
                "return everything that survives an epoch, and restore_carry() must restore it"
            )


def check_resume(pipeline: Pipeline, steps: Sequence[int] | None = None) -> None:
    """Run ``pipeline`` to the end, then for each of ``steps`` (default: a spread from the start
    to the end, including the steps around epoch boundaries and right after the first snapshots
    of what the operators hold) take a state there, resume from it through JSON and compare;
    also resume twice in a row across an epoch boundary. Raises
    ``AssertionError`` naming the first item that differs and, when it can tell, the operator
    whose carry state was missing or not restored."""
    full, boundaries, snapshots = _full_run(pipeline)
    n = len(full)
    if steps is None:
        spread = {0, 1, n // 7, n // 3, n // 2, (2 * n) // 3, n - 1, n}
        spread |= {b + d for b in boundaries[:3] for d in (-1, 0, 1)}
        spread |= {s + d for s in snapshots[:3] for d in (0, 1)}  # restores from holdings
        steps = sorted(s for s in spread if 0 <= s <= n)
    for step in steps:
        loader = pipeline.iter()
        head = [_item(next(loader)) for _ in range(step)]
        state = json.loads(json.dumps(loader.state_dict()))
        loader.close()
        tail = [_item(x) for x in pipeline.iter(state=state)]
        _compare(pipeline, full, head + tail, f"resumed at step {step}")
    if boundaries:
        b = boundaries[0]
        first, second = max(0, b - 1), min(n, b + 1)
        loader = pipeline.iter()
        head = [_item(next(loader)) for _ in range(first)]
        again = pipeline.iter(state=json.loads(json.dumps(loader.state_dict())))
        middle = [_item(next(again)) for _ in range(second - first)]
        tail = [_item(x) for x in pipeline.iter(state=json.loads(json.dumps(again.state_dict())))]
        _compare(pipeline, full, head + middle + tail, f"resumed at {first}, then at {second}")


def _full_run(pipeline: Pipeline) -> tuple[list[tuple], list[int], list[int]]:
    """The uninterrupted stream, the steps after which a lane finished an epoch, and those
    after which a lane booked a snapshot of what its operators hold (a restore from there
    rebuilds them from ``holdings()``)."""
    loader = pipeline.iter()
    full: list[tuple] = []
    boundaries: list[int] = []
    snapshots: list[int] = []
    done = [0] * len(loader.lanes)
    held: list[Any] = [None] * len(loader.lanes)
    for item in loader:
        full.append(_item(item))
        for i, lane in enumerate(loader.lanes):
            if lane.book.book.epochs_done != done[i]:
                done[i] = lane.book.book.epochs_done
                boundaries.append(len(full))
            if lane.book.held is not held[i]:
                held[i] = lane.book.held
                if held[i] is not None:
                    snapshots.append(len(full))
    return full, boundaries, snapshots


def _compare(pipeline: Pipeline, full: list[tuple], got: list[tuple], how: str) -> None:
    if _same(got, full):
        return
    pairs = enumerate(zip(full, got))
    i = next((k for k, (a, b) in pairs if not _same(a, b)), min(len(full), len(got)))
    shown = full[i][1] if i < len(full) else "the end of the stream"
    raise AssertionError(
        f"{how}: item {i} differs from the uninterrupted run ({len(got)} vs {len(full)} items; "
        f"expected {shown!r}). {_suspects(pipeline)}"
    )


def _suspects(pipeline: Pipeline) -> str:
    """Stateful operators whose carry state does not survive a round trip on the pipeline's own
    records (the usual cause of a resume that differs)."""
    plan = pipeline.compile()
    source = plan.source
    n_chunks = source.total_chunks()
    if n_chunks == 0:
        return ""
    fetcher: Any = copy.deepcopy(plan.fetch)
    fetcher.bind(source)
    chunk = source.chunk(0)
    records = list(fetcher.fetch(0, chunk.pointers, 0))
    named = []
    with _set_up(plan.chain, 0) as chain:
        for op in chain:
            if op.traits.stateful:
                try:
                    _carry_round_trip(op, records, 0)
                except AssertionError as exc:
                    named.append(str(exc))
            fresh = _fresh(op)
            fresh.start_epoch(0, 0)
            records = [
                r for r in [*fresh.process_many(records), *fresh.flush()] if not r.meta.is_tombstone
            ]
    if not named:
        return "Some operator's output depends on more than its carry state and its input."
    return "Suspect: " + " | ".join(named)
