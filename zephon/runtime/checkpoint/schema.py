"""The checkpoint schema: a loader's state and a job's, their versions, their fields, and every
field's check. Each stage writes its own part of a state (``state()``) and takes it back
(``restore(part)``); this module says which fields there are and refuses a bad one on load.

A state is plain JSON. Loading checks every field's type and range and the invariants that tie
fields together (a replay cursor exactly when something was delivered in the retained window, a
cursor that belongs to the lane's retained chunks, a finished lane at the end of its chunks), so
that an edited state is refused with ``CheckpointCorruptError`` instead of starting a stream at a
wrong position. Three checks need more than the state and live beside what they check: whether
a state belongs to this pipeline (``format.check_identity``), whether the carry states fit the
operators (``carry_check``), and the retired ids, decoded where they are encoded (``retired``).

A stage that adds a field to a state adds it to ``STATE_FIELDS`` (and ``JOB_FIELDS``) with the
part that writes it, raises ``STATE_VERSION`` and says in ``upgrade`` what an older state means
by its absence, so that every state written before still loads.
"""

from __future__ import annotations

import re
from typing import Any

from zephon.compact import unpack_json
from zephon.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from zephon.runtime.checkpoint.held_check import (
    SnapshotChunks,
    check_held_records,
    check_open_offsets,
)
from zephon.runtime.checkpoint.layout import LaneGeometry, Layout, Leftover, Run, lane_total
from zephon.runtime.checkpoint.progress import EpochProgress
from zephon.types import SampleCursor

STATE_FORMAT = "zephon-loader-state"  # one rank's state
JOB_FORMAT = "zephon-job-state"  # every rank's lanes together (``merge_states``)
# 4: what was done to the run on purpose (``history``, ``skip``, ``retired``); 3: the lane
# history (``layout``) and inherited runs per lane; 2 and 3 are read too (``upgrade``)
STATE_VERSION = 4
READ_VERSIONS = (2, 3, STATE_VERSION)

#: The fields of a rank's state, each with the part of the loader that writes and restores it.
STATE_FIELDS = {
    "format": "the schema: STATE_FORMAT or JOB_FORMAT",
    "version": "the schema: STATE_VERSION",
    "fingerprint": "the plan: the digest of its pipeline description",
    "pipeline": "the plan: its pipeline description (format.check_identity)",
    "rank": "the plan",
    "world_size": "the plan",
    "lanes": "the plan: the job's lane count",
    "layout": "checkpoint.layout.Layout: the lane history, over the re-lanings",
    "next_lane": "the loader: where its round-robin over the lanes stands",
    "served": "the loader: items handed over, in global steps of its world size",
    "lane_states": "delivery.lane_delivery.LaneDelivery, one per lane (LANE_KEYS)",
    "counters": "delivery.totals.RunTotals (COUNTERS)",
    "tag_counts": "delivery.totals.RunTotals",
    "mixture": "delivery.totals.RunTotals",
    "history": "checkpoint.history.RunHistory",
    "skip": "checkpoint.history.RunHistory",
    "retired": "checkpoint.retired.Retirements",
}
#: A job state (``merge_states``) has no rank of its own but the global step it was merged at.
JOB_FIELDS = {
    **{
        k: v
        for k, v in STATE_FIELDS.items()
        if k not in ("rank", "world_size", "next_lane", "served")
    },
    "step": "checkpoint.job.merge_states: the global step of every rank",
}
# Written since states count global steps; a state without them is read the way it was written.
NEWER_STATE_KEYS = frozenset({"served"})
NEWER_JOB_KEYS = frozenset({"step"})
STATE_KEYS = frozenset(STATE_FIELDS) - NEWER_STATE_KEYS
JOB_KEYS = frozenset(JOB_FIELDS) - NEWER_JOB_KEYS

MAX_INT = (1 << 62) - 1  # larger numbers in a state are damage, not positions
# A replay window, and the run it belongs to (``pending`` lists runs of these fields).
RUN_KEYS = frozenset(
    {
        "run",
        "start",
        "cursor",
        "count",
        "digest",
        "carry",
        "held",
        "progress",
        "screened",
        "changed",
    }
)
# Written since runs say what they consumed by position; a window without them says nothing.
NEWER_RUN_KEYS = frozenset({"progress", "screened"})
LANE_KEYS = RUN_KEYS | {"lane", "finished", "delivered", "pending"}
COUNTERS = ("delivered", "tombstones", "evicted", "violations", "max_inflight", "replayed")
_HEX16 = re.compile(r"[0-9a-f]{16}")
MAX_EVENTS = 16  # events kept in a state's history
# The events of a state's history (``checkpoint.history``), by kind, and their fields.
EVENTS = {
    "change": {"event", "step", "changes", "operators"},
    "skip": {"event", "step", "steps"},
    "retire": {"event", "step", "ids"},
}


# ------------------------------------------------------------------------------------ versions
def upgrade(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` (format and version checked) as the current version says the same: a version 2
    state had one generation of lanes and no inherited runs, a version 3 state nothing done to
    the run on purpose."""
    if body["version"] == 2:
        lanes = body.get("lane_states")
        body = {
            **body,
            "version": 3,
            "layout": [{"lanes": body.get("lanes")}],
            "lane_states": [
                {**lane, "held": None, "run": None, "pending": []}
                if isinstance(lane, dict)
                else lane
                for lane in lanes
            ]
            if isinstance(lanes, list)
            else lanes,
        }
    if body["version"] == 3:
        body = {**body, "version": STATE_VERSION, "history": [], "skip": 0, "retired": None}
    lanes = body.get("lane_states")
    if isinstance(lanes, list):
        body = {**body, "lane_states": [_with_changed(_with_progress(lane)) for lane in lanes]}
    return body


def _with_progress(lane: Any) -> Any:
    """A lane state written before runs said what they consumed by position, as one that
    says nothing of it (a state that has the fields is left as it is)."""
    if not isinstance(lane, dict) or "progress" in lane or "screened" in lane:
        return lane
    pending = lane.get("pending")
    return {
        **lane,
        "progress": None,
        "screened": None,
        "pending": [
            {**run, "progress": None, "screened": None}
            if isinstance(run, dict) and not NEWER_RUN_KEYS & set(run)
            else run
            for run in pending
        ]
        if isinstance(pending, list)
        else pending,
    }


def _with_changed(lane: Any) -> Any:
    """A lane state written before windows said whether changed operators booked them, as one
    whose windows the operators that wrote it booked."""
    if not isinstance(lane, dict) or "changed" in lane:
        return lane
    pending = lane.get("pending")
    return {
        **lane,
        "changed": False,
        "pending": [
            {**run, "changed": False} if isinstance(run, dict) and "changed" not in run else run
            for run in pending
        ]
        if isinstance(pending, list)
        else pending,
    }


def check_version(state: dict[str, Any], formats: tuple[str, ...]) -> None:
    """``state`` is one of ``formats`` in a version this Zephon reads."""
    if state.get("format") not in formats:
        raise CheckpointCorruptError(f"not a Zephon loader state (format={state.get('format')!r})")
    if state.get("version") not in READ_VERSIONS:
        raise CheckpointCorruptError(
            f"loader state version {state.get('version')!r} is not known to this Zephon "
            f"(it reads versions {READ_VERSIONS[0]} to {STATE_VERSION})"
        )


def check_keys(body: dict[str, Any]) -> bool:
    """Whether ``body`` (unsealed) is a job state; ``CheckpointCorruptError`` unless it has
    exactly the fields of its format (those written since global steps are counted may be
    missing)."""
    job = body["format"] == JOB_FORMAT
    keys = JOB_KEYS if job else STATE_KEYS
    newer = NEWER_JOB_KEYS if job else NEWER_STATE_KEYS
    if not keys <= set(body) <= keys | newer:
        raise CheckpointCorruptError(
            f"loader state must have exactly the fields {sorted(keys | newer)}, got {sorted(body)}"
        )
    return job


# ------------------------------------------------------------------------------------ scalars
def corrupt(where: str, why: str) -> CheckpointCorruptError:
    """The error for a state whose field ``where`` is wrong, saying ``why``."""
    return CheckpointCorruptError(f"loader state field {where} {why}")


def check_int(value: Any, where: str, low: int = 0, high: int = MAX_INT) -> int:
    """``value`` if it is an int (not a bool) in ``[low, high]``; else the error naming it."""
    if type(value) is not int:
        raise corrupt(where, f"must be an integer, got {value!r}")
    if not low <= value <= high:
        raise corrupt(where, f"must be in [{low}, {high}], got {value}")
    return value


def check_bool(value: Any, where: str) -> bool:
    """``value`` if it is true or false; else the error naming it."""
    if type(value) is not bool:
        raise corrupt(where, f"must be true or false, got {value!r}")
    return value


def encode_cursor(cursor: SampleCursor | None) -> list | None:
    if cursor is None:
        return None
    return [cursor.chunk_id, cursor.chunk_offset, list(cursor.sample_id), list(cursor.lineage)]


def encode_run(run: Run) -> dict[str, Any]:
    """An inherited run as it is stored in a lane's ``pending`` list."""
    return {
        "run": [run.gen, run.lane, run.end],
        "start": run.start,
        "cursor": encode_cursor(run.cursor),
        "count": run.count,
        "digest": f"{run.digest:016x}",
        "carry": run.carry,
        "held": run.held,
        "progress": None if run.progress is None else run.progress.encode(),
        "screened": None if run.screened is None else run.screened.encode(),
        "changed": run.changed,
    }


def decode_cursor(value: Any, where: str = "cursor") -> SampleCursor | None:
    if value is None:
        return None
    if type(value) is not list or len(value) != 4:
        raise corrupt(where, f"must be null or [chunk_id, offset, sample_id, lineage]: {value!r}")
    chunk_id, offset, sample_id, lineage = value
    check_int(chunk_id, f"{where}[0]")
    check_int(offset, f"{where}[1]")
    if type(sample_id) is not list or len(sample_id) != 3:
        raise corrupt(f"{where}[2]", f"must be a list of 3 integers, got {sample_id!r}")
    for i, part in enumerate(sample_id):
        check_int(part, f"{where}[2][{i}]")
    if type(lineage) is not list:
        raise corrupt(f"{where}[3]", f"must be a list of integers, got {lineage!r}")
    for i, part in enumerate(lineage):
        check_int(part, f"{where}[3][{i}]")
    return SampleCursor(chunk_id, offset, tuple(sample_id), tuple(lineage))


def check_window(
    value: dict[str, Any],
    where: str,
    *,
    geometry: LaneGeometry,
    limit: int | None,
    monotone: bool,
    per_epoch: int,
    n_ops: int,
    holdings: bool,
    source: Any = None,
) -> tuple[int, SampleCursor | None, int, int]:
    """``(start, cursor, count, digest)`` of a replay window over ``geometry``'s local chunks
    below ``limit`` (None: unbounded), every field checked (and the carry state's and the
    snapshot's shape: ``holdings`` says whether the plan takes snapshots at all)."""
    end = limit if limit is not None else MAX_INT
    if not monotone and limit is not None:
        end = -(-limit // per_epoch) * per_epoch  # a last, partial epoch ends on a boundary
    start = check_int(value["start"], f"{where}.start", 0, end)
    if not monotone and start % per_epoch:
        raise corrupt(f"{where}.start", f"must start an epoch (a multiple of {per_epoch}): {start}")
    cursor = decode_cursor(value["cursor"], f"{where}.cursor")
    count = check_int(value["count"], f"{where}.count")
    digest = value["digest"]
    if type(digest) is not str or not _HEX16.fullmatch(digest):
        raise corrupt(f"{where}.digest", f"must be 16 lower-case hex digits, got {digest!r}")
    if (cursor is None) != (count == 0):
        raise corrupt(
            where, f"has a replay cursor {value['cursor']!r} with {count} delivered records"
        )
    if cursor is None and int(digest, 16):
        raise corrupt(f"{where}.digest", "must be zero when nothing was delivered")
    held = value["held"]
    if held is not None:
        if not holdings or monotone:
            raise corrupt(f"{where}.held", "must be null: this pipeline restores by replay")
        check_held(held, f"{where}.held", source, geometry, start, limit, per_epoch, n_ops)
    if cursor is not None:
        k = geometry.local_index(cursor.chunk_id)
        last = start + per_epoch - 1 if not monotone else end - 1
        if limit is not None:
            last = min(last, limit - 1)
        if k is None or not start <= k <= last:
            raise corrupt(
                f"{where}.cursor",
                f"names chunk {cursor.chunk_id}, which is not one of the retained chunks of "
                f"lane {geometry.lane} of {geometry.lanes}",
            )
    carry = value["carry"]
    if carry is not None:
        if type(carry) is not list or len(carry) != n_ops:
            raise corrupt(f"{where}.carry", f"must be null or a list of {n_ops} entries")
        for i, part in enumerate(carry):
            if part is not None and type(part) is not dict:
                raise corrupt(f"{where}.carry[{i}]", f"must be null or an object, got {part!r}")
    check_carry_taken(carry, start, where, monotone)
    return start, cursor, count, int(digest, 16)


def check_carry_taken(carry: list | None, start: int, where: str, monotone: bool) -> None:
    """On the epoch path every epoch marker takes the operators' carry states, so a window holds
    them exactly when it starts after the first epoch (``start`` > 0); without them a lane would
    restart its operators afresh in the middle of the run."""
    if not monotone and (carry is None) != (start == 0):
        raise corrupt(
            f"{where}.carry",
            f"must be {'null' if start == 0 else 'the list of carry states'} for a window "
            f"starting at lane chunk {start}",
        )


def check_held(
    held: Any,
    where: str,
    source: Any,
    geometry: LaneGeometry,
    start: int,
    limit: int | None,
    per_epoch: int,
    n_ops: int,
) -> int:
    """A snapshot (``lanes.snapshots``) inside the epoch that starts at ``start``: its next chunk
    (returned), per operator its packed records, digest and state, and the open offsets of the
    chunks before the next one; every part decoded and checked."""
    if type(held) is not dict or set(held) != {"next", "offset", "ops", "open"}:
        raise corrupt(where, "must be null or an object with the fields next, offset, ops, open")
    end = start + per_epoch if limit is None else min(start + per_epoch, limit)
    nxt = check_int(held["next"], f"{where}.next", start, end - 1)
    read_to = check_int(held["offset"], f"{where}.offset")
    if read_to == 0 and nxt == start:
        raise corrupt(where, "is a snapshot of nothing read (next chunk is the epoch's first)")
    if read_to and source is not None and read_to >= len(source.chunk(geometry.position(nxt))):
        raise corrupt(f"{where}.offset", f"{read_to} is past chunk {geometry.position(nxt)}")
    ops = held["ops"]
    if type(ops) is not list or len(ops) != n_ops:
        raise corrupt(f"{where}.ops", f"must be a list of {n_ops} entries")
    chunks = SnapshotChunks(geometry, start, nxt + (1 if read_to else 0), source)
    for i, entry in enumerate(ops):
        if entry is None:
            continue
        at = f"{where}.ops[{i}]"
        if type(entry) is not dict or set(entry) != {"records", "digest", "state"}:
            raise corrupt(at, "must be null or an object with records, digest and state")
        if type(entry["digest"]) is not str or not _HEX16.fullmatch(entry["digest"]):
            raise corrupt(f"{at}.digest", "must be 16 lower-case hex digits")
        check_held_records(entry["records"], f"{at}.records", chunks)
        try:
            state = unpack_json(entry["state"])
        except ValueError as exc:
            raise corrupt(f"{at}.state", str(exc)) from None
        if type(state) is not dict:
            raise corrupt(f"{at}.state", "must hold an object")
    check_open_offsets(held["open"], f"{where}.open", chunks)
    return nxt


def check_progress(
    value: dict[str, Any], where: str, start: int, *, monotone: bool, per_epoch: int, **_: Any
) -> tuple[EpochProgress | None, EpochProgress | None]:
    """A window's ``progress`` and ``screened`` (``checkpoint.progress``), checked: only on
    the epoch path, each null or within the window's epoch."""
    out: list[EpochProgress | None] = []
    for key in ("progress", "screened"):
        part = value[key]
        if part is not None and monotone:
            raise corrupt(f"{where}.{key}", "must be null on the monotone path")
        out.append(
            None if part is None else EpochProgress.decode(part, f"{where}.{key}", start, per_epoch)
        )
    return out[0], out[1]


def check_run(value: dict[str, Any], where: str, layout: Layout, **window: Any) -> Run:
    """An inherited run (``run`` = ``[generation, lane, end]`` of an earlier generation, and its
    window) with every field checked."""
    ident = value["run"]
    if type(ident) is not list or len(ident) != 3 or any(type(part) is not int for part in ident):
        raise corrupt(f"{where}.run", f"must be null or [generation, lane, end], got {ident!r}")
    gen, lane, end = ident
    if not 0 <= gen < layout.current or not 0 <= lane < layout.lanes[gen]:
        raise corrupt(
            f"{where}.run", f"names lane {lane} of generation {gen}, which the layout does not have"
        )
    if end != layout.ends[gen][lane]:
        raise corrupt(
            f"{where}.run",
            f"ends at chunk {end}, but the layout says lane {lane} of generation {gen} kept "
            f"{layout.ends[gen][lane]}",
        )
    geometry = layout.geometry(gen, lane)
    start, cursor, count, digest = check_window(
        value, where, geometry=geometry, limit=end, **window
    )
    if start >= end:
        raise corrupt(f"{where}.start", f"must be below the run's end {end}, got {start}")
    progress, screened = check_progress(value, where, start, **window)
    return Run(
        gen,
        lane,
        start,
        end,
        value["carry"],
        cursor,
        count,
        digest,
        value["held"],
        progress,
        screened,
        check_bool(value["changed"], f"{where}.changed"),
    )


def check_lane_state(
    value: Any,
    where: str,
    *,
    lane_id: int,
    layout: Layout,
    monotone: bool,
    per_epoch: int,
    n_ops: int,
    holdings: bool = False,
    source: Any = None,
) -> dict[str, Any]:
    """A lane's state with every field checked; ``runs`` is what the lane still has to run, in
    order: the inherited runs it is in or has yet to start, then its own chunks. Without
    ``source`` (a state checked on its own) what needs the data is left out."""
    if type(value) is not dict:
        raise corrupt(where, f"must be an object, got {type(value).__name__}")
    if set(value) != LANE_KEYS:
        raise corrupt(
            where, f"must have exactly the fields {sorted(LANE_KEYS)}, got {sorted(value)}"
        )
    if value["lane"] != lane_id or type(value["lane"]) is not int:
        raise corrupt(f"{where}.lane", f"must be {lane_id}, got {value['lane']!r}")
    finished = check_bool(value["finished"], f"{where}.finished")
    check_int(value["delivered"], f"{where}.delivered")
    window: dict[str, Any] = {
        "monotone": monotone,
        "per_epoch": per_epoch,
        "n_ops": n_ops,
        "holdings": holdings,
        "source": source,
    }
    own = layout.geometry(layout.current, lane_id)
    pending = value["pending"]
    if type(pending) is not list:
        raise corrupt(f"{where}.pending", f"must be a list, got {pending!r}")
    runs: list[Run] = []
    if value["run"] is not None:
        if finished:
            raise corrupt(f"{where}.finished", "is true for a lane with an inherited run")
        runs.append(check_run(value, where, layout, **window))
        for i, part in enumerate(pending):
            at = f"{where}.pending[{i}]"
            if type(part) is not dict or set(part) != RUN_KEYS:
                raise corrupt(at, f"must be an object with exactly the fields {sorted(RUN_KEYS)}")
            runs.append(check_run(part, at, layout, **window))
        owners = [(run.gen, run.lane) for run in runs]
        if len(set(owners)) != len(owners):
            raise corrupt(f"{where}.pending", f"holds a run twice: {owners}")
        for gen, lane in owners:
            if layout.holder(gen, lane) != lane_id:
                raise corrupt(
                    f"{where}.run",
                    f"lane {lane} of generation {gen} is finished by lane "
                    f"{layout.holder(gen, lane)}, not by lane {lane_id}",
                )
        _check_runs_left(owners, where, lane_id, layout)
        runs.append(Run(layout.current, lane_id, 0, None))
    else:
        if pending:
            raise corrupt(f"{where}.pending", "must be empty when the lane runs its own chunks")
        start, cursor, count, digest = check_window(
            value, where, geometry=own, limit=own.total, **window
        )
        total = own.total
        # Without the source (``zephon inspect``) a lane's size is unknown, so is its end.
        at_end = start >= total if total is not None else source is None
        if finished and (cursor is not None or not at_end):
            raise corrupt(f"{where}.finished", "is true for a lane that has chunks left")
        carry, held = value["carry"], value["held"]
        progress, screened = check_progress(value, where, start, **window)
        runs.append(
            Run(
                layout.current,
                lane_id,
                start,
                None,
                carry,
                cursor,
                count,
                digest,
                held,
                progress,
                screened,
                check_bool(value["changed"], f"{where}.changed"),
            )
        )
    return {**value, "runs": runs}


def _check_runs_left(
    owners: list[tuple[int, int]], where: str, lane_id: int, layout: Layout
) -> None:
    """A lane finishes the runs it took over in order, so its run and pending ones are the last
    of them: one left out would never be finished, and the samples of its chunks never
    delivered."""
    if layout.taken is None:
        return  # a state written before the runs taken over were stored
    expected = layout.taken[lane_id]
    left = expected[expected.index(owners[0]) :] if owners[0] in expected else None
    if left == owners:
        return
    shown = ", ".join(f"lane {lane} of generation {gen}" for gen, lane in expected)
    lost = [run for run in (left or expected) if run not in owners]
    detail = "; ".join(
        f"the run of lane {lane} of generation {gen} (its chunks up to local chunk "
        f"{layout.ends[gen][lane]}) is missing"
        for gen, lane in lost
    )
    raise corrupt(
        f"{where}.pending",
        f"must hold what lane {lane_id} has left of the runs it took over ({shown}), in order; "
        f"{detail or 'they are out of order'}",
    )


def check_layout(value: Any, lanes: int, total_positions: int | None) -> Layout:
    """The job's lane history, checked: every closed generation's lane count and ends, and the
    running generation's lane count (``lanes``)."""
    if type(value) is not list or not value:
        raise corrupt("layout", f"must be a non-empty list of generations, got {value!r}")
    counts: list[int] = []
    ends: list[list[int]] = []
    taken = None
    size = total_positions
    for i, gen in enumerate(value):
        where = f"layout[{i}]"
        last = i == len(value) - 1
        keys = {"lanes"} if last else {"lanes", "ends"}
        if last and i and type(gen) is dict and "runs" in gen:
            keys = {"lanes", "runs"}  # the runs its lanes took over (not in older states)
        if type(gen) is not dict or set(gen) != keys:
            raise corrupt(where, f"must be an object with exactly the fields {sorted(keys)}")
        n = check_int(gen["lanes"], f"{where}.lanes", 1)
        counts.append(n)
        if last:
            if n != lanes:
                raise corrupt(f"{where}.lanes", f"must be the state's lane count {lanes}, got {n}")
            if "runs" in gen:
                taken = _check_taken(gen["runs"], f"{where}.runs", counts)
            break
        kept = gen["ends"]
        if type(kept) is not list or len(kept) != n:
            raise corrupt(f"{where}.ends", f"must be a list of {n} chunk counts")
        for g, e in enumerate(kept):
            total = lane_total(size, g, n)
            check_int(e, f"{where}.ends[{g}]", 0, MAX_INT if total is None else total)
        ends.append(list(kept))
        size = Leftover(n, kept, size).size_after
    return Layout(counts, ends, total_positions, taken)


def _check_taken(value: Any, where: str, counts: list[int]) -> list[list[tuple[int, int]]]:
    """Per lane of the running generation (``counts[-1]`` of them), the ``[generation, lane]``
    of the runs it took over, each of an earlier generation, none twice."""
    if type(value) is not list or len(value) != counts[-1]:
        raise corrupt(where, f"must be a list of {counts[-1]} lists of runs")
    taken: list[list[tuple[int, int]]] = []
    for h, held in enumerate(value):
        if type(held) is not list:
            raise corrupt(f"{where}[{h}]", f"must be a list of [generation, lane], got {held!r}")
        runs = []
        for run in held:
            if (
                type(run) is not list
                or len(run) != 2
                or any(type(part) is not int for part in run)
                or not 0 <= run[0] < len(counts) - 1
                or not 0 <= run[1] < counts[run[0]]
            ):
                raise corrupt(f"{where}[{h}]", f"names no lane of an earlier generation: {run!r}")
            runs.append((run[0], run[1]))
        taken.append(runs)
    every = [run for runs in taken for run in runs]
    if len(set(every)) != len(every):
        raise corrupt(where, "gives a run to two lanes")
    return taken


def check_turn(next_lane: int, lane_states: list[dict[str, Any]]) -> None:
    """``next_lane`` must be where the round-robin over the lanes stands: every lane that has not
    ended delivered one item more than the lanes at or after ``next_lane``."""
    rounds = {
        lane["delivered"] - (1 if i < next_lane else 0)
        for i, lane in enumerate(lane_states)
        if not lane["finished"]
    }
    if len(rounds) > 1:
        counts = [lane["delivered"] for lane in lane_states]
        raise corrupt("next_lane", f"{next_lane} does not fit the lanes' delivered items {counts}")


def encode_pairs(counts: dict[Any, int]) -> list[list[Any]]:
    """``counts`` as ``[[key, count], ...]``, tuple keys as lists (what JSON makes of them), so a
    state is the same before and after a JSON round trip; ``check_pairs`` reads it back."""
    return [[list(k) if isinstance(k, tuple) else k, v] for k, v in counts.items()]


def check_pairs(value: Any, where: str) -> list[tuple[Any, int]]:
    """``[[key, count], ...]`` with JSON-scalar (or list) keys and non-negative counts."""
    if type(value) is not list:
        raise corrupt(where, f"must be a list of [key, count] pairs, got {value!r}")
    out = []
    for i, pair in enumerate(value):
        if type(pair) is not list or len(pair) != 2:
            raise corrupt(f"{where}[{i}]", f"must be a [key, count] pair, got {pair!r}")
        key, n = pair
        if not _is_component(key) and not (type(key) is list and all(map(_is_component, key))):
            raise corrupt(f"{where}[{i}][0]", f"must be a component name or id, got {key!r}")
        out.append((tuple(key) if isinstance(key, list) else key, check_int(n, f"{where}[{i}][1]")))
    return out


def _is_component(key: Any) -> bool:
    """A component name or id as JSON keeps it (a tuple one is a list of these)."""
    return key is None or (isinstance(key, (str, int)) and not isinstance(key, bool))


# ------------------------------------------------------------------------------------ totals
def check_totals(
    body: dict[str, Any],
) -> tuple[dict[str, int], list[tuple[Any, int]], list[tuple[Any, int]], list[tuple[Any, int]]]:
    """The running totals of a state, checked: counters, tag counts, mixture samples and
    tokens."""
    counters = body["counters"]
    if type(counters) is not dict or set(counters) != set(COUNTERS):
        raise corrupt("counters", f"must have exactly the fields {list(COUNTERS)}")
    values = {name: check_int(counters[name], f"counters.{name}") for name in COUNTERS}
    tag_counts = check_pairs(body["tag_counts"], "tag_counts")
    mixture = body["mixture"]
    if type(mixture) is not dict or set(mixture) != {"samples", "tokens"}:
        raise corrupt("mixture", "must have exactly the fields samples and tokens")
    samples = check_pairs(mixture["samples"], "mixture.samples")
    tokens = check_pairs(mixture["tokens"], "mixture.tokens")
    return values, tag_counts, samples, tokens


# ------------------------------------------------------------------------------------ ranks
def check_rank(body: dict[str, Any], rank: int, world_size: int) -> None:
    """A rank's state resumes only on the rank and world size it was taken with."""
    saved = (body["rank"], body["world_size"])
    if saved != (rank, world_size):
        raise CheckpointMismatchError(
            f"this is the state of rank {saved[0]!r} (world_size={saved[1]!r}); this "
            f"pipeline runs rank {rank} (world_size={world_size}). To resume on "
            "another world size, "
            "merge the states of all ranks with zephon.merge_states()"
        )


def check_lane_list(value: Any, count: int) -> list[Any]:
    """A state's ``lane_states``: a list of ``count`` lane states (each checked by its lane)."""
    if type(value) is not list or len(value) != count:
        raise corrupt("lane_states", f"must be a list of {count} lane states")
    return value


def check_next_lane(value: Any, checked: list[dict[str, Any]]) -> int:
    """A rank's ``next_lane``: one of its lanes (``checked``, in lane order), where its
    round-robin over them stands (``check_turn``)."""
    next_lane = check_int(value, "next_lane", 0, len(checked) - 1)
    check_turn(next_lane, checked)
    return next_lane


def check_job_turn(
    next_lane: int, lane_states: list[Any], checked: list[dict[str, Any]], rank: int
) -> int:
    """How far into its global step a rank of a job state resumes (``next_lane``): its lanes
    (``checked``) are level, or one round apart. Once a lane of the job ended, lanes of the old
    ranks delivered different numbers of items per step: any level is right, and the step is
    whole."""
    if any(type(s) is dict and s.get("finished") is True for s in lane_states):
        return 0
    try:
        check_turn(next_lane, checked)
    except CheckpointCorruptError:
        counts = [s["delivered"] for s in checked]
        raise CheckpointError(
            f"this job state was merged from ranks checkpointed inside a global step (the "
            f"lanes of rank {rank} delivered {counts} items): resume each rank "
            "from its own state on the world size it was taken with, or from a job state "
            "taken right after an optimizer step"
        ) from None
    return next_lane


# ------------------------------------------------------------------------------------ history
def last_skip(history: list[dict[str, Any]]) -> int:
    """The index in ``history`` of the skip event a skip still to be done belongs to: the last
    skip event, past the changes and retirements of the resume that has it still to do (-1 when
    there is none there)."""
    at = len(history) - 1
    while at >= 0 and history[at]["event"] != "skip":
        at -= 1
    return at


def _trailing_skips(history: list[dict[str, Any]]) -> list[int]:
    """The sums of the last 1, 2, ... skip events at the end of ``history`` (from
    ``last_skip``)."""
    sums: list[int] = []
    for event in reversed(history[: last_skip(history) + 1]):
        if event["event"] != "skip":
            break
        sums.append((sums[-1] if sums else 0) + event["steps"])
    return sums


def check_history(value: Any, skip: Any) -> tuple[list[dict[str, Any]], int]:
    """A state's ``history`` and pending ``skip``, every event checked; a pending skip must be
    what the skip events at the end of the history add up to."""
    if type(value) is not list or len(value) > MAX_EVENTS:
        raise corrupt("history", f"must be a list of at most {MAX_EVENTS} events")
    for i, event in enumerate(value):
        where = f"history[{i}]"
        kind = event.get("event") if type(event) is dict else None
        if kind not in EVENTS or set(event) != EVENTS[kind]:
            raise corrupt(where, f"must be an event with the fields of one of {sorted(EVENTS)}")
        check_int(event["step"], f"{where}.step")
        if kind == "skip":
            check_int(event["steps"], f"{where}.steps", 1)
            continue
        if kind == "retire":
            check_int(event["ids"], f"{where}.ids", 1)
            continue
        texts = [event["changes"], event["operators"]]
        if any(type(t) is not list or not all(type(x) is str for x in t) for t in texts):
            raise corrupt(where, "must name its changes and operators as lists of strings")
    steps = check_int(skip, "skip", 0, MAX_INT)
    if steps and steps not in _trailing_skips(value):
        raise corrupt("skip", f"{steps} is not what the last skip events of the history add up to")
    return value, steps
