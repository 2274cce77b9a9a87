"""Restoring from what the stateful operators hold, instead of replaying their epoch.

When every stateful operator of a plan can describe what it holds (``Operator.holdings``: the
records it holds and small plain state), the lane runner sends a snapshot every
``lane.SNAPSHOT_RECORDS`` samples (between the pieces a micro-batch goes through the operators
in, or at a micro-batch's end when an operator is batch-sensitive; never at an epoch's end):
where to continue reading and, per operator, the cursors of its records
and its state. Delivery keeps the last snapshot it booked, with the offsets of the epoch's
chunks still open then, and counts its replay window from there. A restore re-reads exactly the
held records' samples, runs them through the operators before their holder (which are pure, or
pass records through unchanged), rebuilds the holders and continues; the replay is bounded by the
snapshot spacing, not by the epoch.

A snapshot in a checkpoint is compact: cursors and offsets as zlib-compressed int64 arrays in
base64, each operator's state as compressed JSON, and a digest of the held records' cursors that
the rebuilt records must match.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from zephon._core.cursor import digest_cursors
from zephon._core.records import cursors_of
from zephon.compact import pack_ints, pack_json, unpack_ints, unpack_json
from zephon.errors import OperatorError, ReplayDivergenceError, ZephonError
from zephon.ops.base import Operator
from zephon.types import SampleCursor, SampleRecord

Key = tuple[int, int, tuple[int, ...]]  # a held record: chunk id, offset, lineage
Hook = Callable[[int, str, Callable[[], Any]], Any]  # makes operator i's call of a method


def flat_cursors(cursors: Sequence[SampleCursor]) -> list[int]:
    """Cursors without their sample ids (re-read from the chunk on restore), as one int list:
    per cursor its chunk id, offset, lineage length and lineage."""
    flat: list[int] = []
    for c in cursors:
        flat += (c.chunk_id, c.chunk_offset, len(c.lineage), *c.lineage)
    return flat


def unpack_cursors(text: Any) -> list[Key]:
    flat = unpack_ints(text).tolist()
    out: list[Key] = []
    i = 0
    while i < len(flat):
        if i + 3 > len(flat) or i + 3 + flat[i + 2] > len(flat):
            raise ValueError("packed cursors end inside a cursor")
        n = flat[i + 2]
        out.append((flat[i], flat[i + 1], tuple(flat[i + 3 : i + 3 + n])))
        i += 3 + n
    return out


def snapshot_of(ops: Sequence[Operator], hook: Hook | None = None) -> list[dict[str, Any] | None]:
    """Per operator, what it holds (``None`` for one that keeps no state), raw: the held records'
    cursors as they are (cursors never change). Flattening and digesting them (``flattened``)
    waits until a checkpoint is taken, or until the snapshot leaves a worker process. ``hook``
    (the lane runner's) makes each ``holdings()`` call, naming the operator when it fails."""
    return [
        None if held is None else {"cursors": cursors_of(held[0]), "state": held[1]}
        for held in _holdings(ops, hook)
    ]


def kept_records(ops: Sequence[Operator]) -> list[list[SampleRecord] | None]:
    """Per operator, the records it holds right now (``None`` for one that keeps no state): a
    lane continuing in another process can be given them instead of rebuilding them."""
    # Copies: the operators' own lists change once the lane goes on (or is closed).
    return [None if held is None else list(held[0]) for held in _holdings(ops)]


def _holdings(
    ops: Sequence[Operator], hook: Hook | None = None
) -> list[tuple[list[SampleRecord], Any] | None]:
    """Per operator, ``holdings()`` with its records as a list (``None`` for one without), each
    call made by ``hook(index, "holdings", method)`` when given."""
    out: list[tuple[list[SampleRecord], Any] | None] = []
    for j, op in enumerate(ops):
        if not op.traits.stateful:
            held = None
        else:
            held = op.holdings() if hook is None else hook(j, "holdings", op.holdings)
        if held is None:
            out.append(None)
            continue
        records, state = held
        out.append((records if type(records) is list else list(records), state))
    return out


def flattened(snapshot: list[dict[str, Any] | None]) -> list[dict[str, Any] | None]:
    """A raw snapshot with its cursors as one int list (``flat_cursors``) and their digest."""
    out: list[dict[str, Any] | None] = []
    for entry in snapshot:
        if entry is None or "digest" in entry:
            out.append(entry)
            continue
        cursors = entry["cursors"]
        out.append(
            {
                "cursors": flat_cursors(cursors),
                "digest": f"{digest_cursors(cursors):016x}",
                "state": _plain(entry["state"]),
            }
        )
    return out


def _plain(state: Any) -> Any:
    """``state`` with numpy arrays and scalars as lists and numbers (JSON types)."""
    if isinstance(state, dict):
        return {k: _plain(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [_plain(v) for v in state]
    if isinstance(state, (np.ndarray, np.generic)):
        return state.tolist()
    return state


def packed(
    snapshot: list[dict[str, Any] | None], labels: Sequence[str]
) -> list[dict[str, Any] | None]:
    """A snapshot as a checkpoint stores it: cursors and state compressed. An operator's state
    that is not JSON data is an ``OperatorError`` naming it (``labels``: the chain's names)."""
    out: list[dict[str, Any] | None] = []
    for j, entry in enumerate(flattened(snapshot)):
        label = labels[j] if j < len(labels) else f"#{j}"
        if entry is None:
            out.append(None)
            continue
        try:
            state = pack_json(entry["state"])
        except (TypeError, ValueError) as exc:
            raise OperatorError(
                f"operator {label!r} described what it holds (holdings()) with a state that is "
                f"not JSON data: {exc}. Checkpoints store it as JSON: return dicts with str "
                "keys, lists, str, bool, None, numbers and numpy arrays",
                operator=label,
            ) from None
        out.append(
            {"records": pack_ints(entry["cursors"]), "digest": entry["digest"], "state": state}
        )
    return out


def rebuild(
    ops: list[Operator],
    fetch: Any,
    source: Any,
    held: list[Any],
    lane_id: int,
    kept: list[list[SampleRecord] | None] | None = None,
) -> list[int]:
    """Give each holder among ``ops`` its records back: re-read their samples, run them through
    the operators before it (pure ones; holders before it pass records through unchanged), and
    ``restore_holdings``; or, where ``kept`` (``kept_records`` at the snapshot) has them, those
    records themselves. Returns per operator how many closing contributors it now holds (the
    lane's audit starts from there). ``ReplayDivergenceError`` when a record cannot be rebuilt as
    it was."""
    chunks: dict[int, Any] = {}
    closing = [0] * len(ops)
    for j, entry in enumerate(held):
        if entry is None:
            continue
        mine = kept[j] if kept is not None else None
        if mine is None:
            wanted = unpack_cursors(entry["records"])
            mine = _rebuilt(ops, j, wanted, fetch, source, chunks, lane_id)
        got = f"{digest_cursors([r.meta.cursor for r in mine]):016x}"
        if got != entry["digest"]:
            raise _diverged(lane_id, ops[j], "the rebuilt records are not the ones it held")
        try:
            ops[j].restore_holdings(mine, unpack_json(entry["state"]))
        except ZephonError:
            raise
        except Exception as exc:  # whatever an operator raises on a state it never wrote
            why = f"its state did not restore ({type(exc).__name__}: {exc})"
            raise _diverged(lane_id, ops[j], why) from exc
        closing[j] = sum(
            1 for rec in mine for ref in rec.meta.contribution_refs() if ref.is_last_child
        )
    return closing


def _rebuilt(
    ops: list[Operator],
    j: int,
    wanted: list[Key],
    fetch: Any,
    source: Any,
    chunks: dict[int, Any],
    lane_id: int,
) -> list[SampleRecord]:
    """The records ``wanted`` as operator ``j`` received them: read again and run through the
    pure operators before it."""
    records = _reread(wanted, fetch, source, chunks)
    for op in ops[:j]:
        if records and not op.traits.stateful:
            records = [r for r in op.process_many(records) if not r.meta.is_tombstone]
    by_key = {_key(r.meta.cursor): r for r in records}
    missing = [w for w in wanted if w not in by_key]
    if missing:
        raise _diverged(lane_id, ops[j], f"records {missing[:3]} could not be rebuilt")
    return [by_key[w] for w in wanted]


def _key(cursor: SampleCursor) -> Key:
    return (cursor.chunk_id, cursor.chunk_offset, tuple(cursor.lineage))


def _reread(
    wanted: list[Key], fetch: Any, source: Any, chunks: dict[int, Any]
) -> list[SampleRecord]:
    """The samples behind ``wanted``, read chunk by chunk in one span each."""
    by_chunk: dict[int, set[int]] = {}
    for chunk_id, offset, _ in wanted:
        by_chunk.setdefault(chunk_id, set()).add(offset)
    out: list[SampleRecord] = []
    for chunk_id in sorted(by_chunk):
        offsets = by_chunk[chunk_id]
        if chunk_id not in chunks:
            chunks[chunk_id] = source.chunk(chunk_id).pointers
        pointers = chunks[chunk_id]
        lo, hi = min(offsets), max(offsets) + 1
        if hi > len(pointers):
            raise ValueError(f"chunk {chunk_id} has no offset {hi - 1}")
        try:
            read = list(fetch.fetch(chunk_id, pointers[lo:hi], lo))
        except Exception:
            # A sample between the held ones may be one that failed to read and was skipped
            # (on_error="skip"): read only the held ones, a run of consecutive offsets at a time.
            read = [
                rec
                for start, end in _consecutive(sorted(offsets))
                for rec in fetch.fetch(chunk_id, pointers[start:end], start)
            ]
        out += [r for r in read if r.meta.cursor.chunk_offset in offsets]
    return out


def _consecutive(offsets: list[int]) -> list[tuple[int, int]]:
    """Sorted ``offsets`` as ``(start, end)`` runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for offset in offsets:
        if runs and runs[-1][1] == offset:
            runs[-1] = (runs[-1][0], offset + 1)
        else:
            runs.append((offset, offset + 1))
    return runs


def _diverged(lane_id: int, op: Operator, why: str) -> ReplayDivergenceError:
    return ReplayDivergenceError(
        f"restoring what operator {op.name!r} held on lane {lane_id} failed: {why}. The data or "
        "an operator before it is not what it was when the checkpoint was taken; the stream was "
        "not resumed."
    )
