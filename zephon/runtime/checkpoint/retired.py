"""Retired samples: ids taken out of a run at a resume (a takedown, a contaminated shard), never
delivered from then on, every other sample still exactly once.

A lane's feed screens each item list as it arrives: a record that carries a retired sample (as
itself, or as one of the contributors of a packed record) is replaced by a ``Retired`` control
item. Delivery books it like a record it handed over (its offsets close, it counts in the replay
window) but hands it to no one. Because a retired record is booked exactly as a delivered one
would be, a later restore replays the same window whether the record was delivered before the
retirement or dropped after it, so checkpoints, re-lanings and world-size changes keep working.

Records read later are screened before the operators too, so that a packer never puts a retired
document into a row with others: from each lane's next epoch on (the epoch path: a replay only
ever covers the epoch a checkpoint is in), or from the chunk after the last one it delivered from
(the monotone path), and from the start for chunks nothing was delivered from, a retired sample
is replaced by its tombstone as it is fetched. Those starting points (``horizons``: per lane
identity, the first lane-local chunk screened) are kept with the ids, one set per retirement, so
that a restore screens exactly where the run did. Before them, in what was in flight at the
resume, an operator that makes one record of several samples (a packer) leaves the retired ones
out of it (``Operator.leave_out``), so that the others' parts are still delivered.

A state keeps the ids, never a predicate: ``retire=`` given as a predicate is evaluated once,
at the resume, over every sample id of the source, and the ids it selects are kept. The ids are
stored sorted, column by column, the index column as differences, zlib-compressed: about 2 to 4
bytes per id when they cluster in shards, at most about 13; at most ``MAX_RETIRED`` of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from zephon.compact import pack_ints, unpack_ints
from zephon.errors import CheckpointError, PlanError
from zephon.runtime.checkpoint.layout import Run
from zephon.runtime.checkpoint.schema import MAX_INT, corrupt

MAX_RETIRED = 1_000_000  # ids a state keeps
MAX_SETS = 16  # retirements a run takes
# What a retirement's ids inflate to at most (the count, then three columns): contiguous ids, a
# whole shard retired, pack far tighter than other packed fields, so their bound is their count.
_MAX_IDS_BYTES = 8 * (1 + 3 * MAX_RETIRED)
Horizons = dict[tuple[int, int], int]  # (generation, lane) -> first lane-local chunk screened
_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 1], dtype=np.uint64)
_ID = np.dtype([("dataset", "<i8"), ("shard", "<i8"), ("index", "<i8")])  # sorts as a triple


def _hashes(rows: np.ndarray) -> np.ndarray:
    """One 64-bit key per ``(dataset_id, shard, index)`` row; equal keys are checked exactly."""
    with np.errstate(over="ignore"):
        return (rows.astype(np.uint64) * _MIX).sum(axis=1, dtype=np.uint64)


def _as_ids(rows: np.ndarray) -> np.ndarray:
    """``(n, 3)`` int64 rows as ``n`` triples that compare (and sort) as a whole."""
    return np.ascontiguousarray(rows, dtype=np.int64).view(_ID).ravel()


class RetiredIds:
    """A set of sample ids (``(dataset_id, shard, index)`` triples), and the screen that takes
    their records out of a lane's item lists. Held as arrays (32 bytes an id), never as Python
    objects: a lane's worker process gets a copy."""

    def __init__(self, rows: np.ndarray):
        rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        if len(rows):
            rows = np.unique(rows, axis=0)  # sorted by dataset, shard, index
        self.rows = rows
        self._sorted = _as_ids(rows)
        self._keys = np.unique(_hashes(rows))

    def contains(self, rows: np.ndarray) -> np.ndarray:
        """Per ``(dataset_id, shard, index)`` row of ``rows``, whether it is retired: a hash
        look-up, and a binary search for the few that hit."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        keys = self._keys
        if not len(keys):
            return np.zeros(len(rows), dtype=bool)
        hashes = _hashes(rows)
        found = keys[np.minimum(np.searchsorted(keys, hashes), len(keys) - 1)] == hashes
        if found.any():
            wanted = _as_ids(rows[found])
            at = np.minimum(np.searchsorted(self._sorted, wanted), len(self._sorted) - 1)
            found[found] = self._sorted[at] == wanted
        return found

    def __len__(self) -> int:
        return len(self.rows)

    def union(self, other: RetiredIds) -> RetiredIds:
        return RetiredIds(np.concatenate([self.rows, other.rows]))

    # ----------------------------------------------------------------------------- state
    def encode(self) -> str:
        """The ids as packed integers: the count, the dataset and shard columns, and the index
        column as differences within each (dataset, shard) run."""
        rows = self.rows
        index = rows[:, 2].copy()
        same = np.zeros(len(rows), dtype=bool)
        if len(rows) > 1:
            same[1:] = (rows[1:, 0] == rows[:-1, 0]) & (rows[1:, 1] == rows[:-1, 1])
            index[1:][same[1:]] = np.diff(rows[:, 2])[same[1:]]
        return pack_ints(np.concatenate([[len(rows)], rows[:, 0], rows[:, 1], index]))

    @classmethod
    def decode(cls, value: Any, where: str = "retired") -> RetiredIds:
        """What ``encode`` made, checked (``CheckpointCorruptError`` otherwise)."""
        try:
            flat = unpack_ints(value, _MAX_IDS_BYTES)
        except ValueError as exc:
            raise corrupt(where, str(exc)) from None
        n = int(flat[0]) if len(flat) else -1
        if n < 1 or n > MAX_RETIRED or len(flat) != 1 + 3 * n:
            raise corrupt(where, f"must hold between 1 and {MAX_RETIRED} sample ids")
        rows = flat[1:].reshape(3, n).T.copy()
        same = np.zeros(n, dtype=bool)
        same[1:] = (rows[1:, 0] == rows[:-1, 0]) & (rows[1:, 1] == rows[:-1, 1])
        starts = np.flatnonzero(~same)
        # Undo the differences run by run: a cumulative sum restarted at each run's first row.
        sums = np.cumsum(rows[:, 2])
        rows[:, 2] = sums - np.repeat(sums[starts] - rows[starts, 2], np.diff([*starts, n]))
        out = cls(rows)
        if len(out) != n:
            raise corrupt(where, "holds a sample id twice")
        return out


def retired_ids(retire: Any, source: Any) -> RetiredIds:
    """``retire=`` as ids: an iterable of ``(dataset_id, shard, index)`` triples, or a predicate
    on such a triple, evaluated here over every sample id of ``source`` (a bounded one)."""
    if callable(retire):
        return RetiredIds(_selected(retire, source))
    if isinstance(retire, (str, bytes)) or not isinstance(retire, Iterable):
        raise PlanError(
            "retire= takes sample ids ((dataset_id, shard, index) triples) or a predicate on "
            f"one, got {retire!r}"
        )
    rows = []
    for sample in retire:
        triple = tuple(sample) if isinstance(sample, (tuple, list, np.ndarray)) else ()
        if len(triple) != 3 or not all(
            isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 0 for x in triple
        ):
            raise PlanError(
                f"retire= sample id {sample!r} is not a (dataset_id, shard, index) triple of "
                "integers >= 0"
            )
        rows.append([int(x) for x in triple])
    ids = RetiredIds(np.array(rows, dtype=np.int64).reshape(-1, 3))
    _check_size(len(ids))
    return ids


def _selected(predicate: Callable[[tuple[int, int, int]], bool], source: Any) -> np.ndarray:
    total = source.total_chunks()
    if total is None:
        raise PlanError(
            "retire= with a predicate needs every sample id of the source, and this source is "
            "unbounded: pass the ids instead"
        )
    picked: list[list[int]] = []
    for position in range(total):
        for row in source.chunk(position).pointers.tolist():
            if predicate(tuple(row)):
                picked.append(row)
                _check_size(len(picked))
    return np.array(picked, dtype=np.int64).reshape(-1, 3)


def _check_size(n: int) -> None:
    if n > MAX_RETIRED:
        raise PlanError(
            f"retire= selects more than {MAX_RETIRED} sample ids, more than a checkpoint keeps; "
            "make a new source without them instead"
        )


# --------------------------------------------------------------------------------- retirements
class Retirement:
    """One ``retire=``: its ids, and from which chunk of each lane identity they are screened at
    fetch (a lane identity not listed: from its first chunk)."""

    def __init__(self, ids: RetiredIds, horizons: Horizons):
        self.ids = ids
        self.horizons = horizons

    def encode(self) -> dict[str, Any]:
        flat = [x for (gen, lane), k in sorted(self.horizons.items()) for x in (gen, lane, k)]
        return {"ids": self.ids.encode(), "from": pack_ints(flat)}

    @classmethod
    def decode(
        cls, value: Any, where: str, known: dict[str, RetiredIds] | None = None
    ) -> Retirement:
        """``value`` (one of a state's ``retired``), checked; ids whose packed text is in
        ``known`` are taken from there instead of decoded again, and ``known`` keeps those
        decoded (the ranks of a job all hold the same ids)."""
        if type(value) is not dict or set(value) != {"ids", "from"}:
            raise corrupt(where, "must be an object with the fields ids and from")
        text = value["ids"]
        ids = known.get(text) if known is not None and type(text) is str else None
        if ids is None:
            ids = RetiredIds.decode(text, f"{where}.ids")
            if known is not None:
                known[text] = ids
        try:
            flat = unpack_ints(value["from"]).tolist()
        except ValueError as exc:
            raise corrupt(f"{where}.from", str(exc)) from None
        if len(flat) % 3 or any(x > MAX_INT for x in flat):
            raise corrupt(f"{where}.from", "must be (generation, lane, chunk) triples")
        horizons = {(g, lane): k for g, lane, k in zip(flat[0::3], flat[1::3], flat[2::3])}
        if len(horizons) * 3 != len(flat):
            raise corrupt(f"{where}.from", "names a lane twice")
        return cls(ids, horizons)


def horizons_of(runs: list[Run], *, monotone: bool, per_epoch: int, geometry: Any) -> Horizons:
    """Where screening at fetch may start for each run a lane still has (``runs``, checked):
    at a run's first retained chunk when nothing of it was delivered, else after what a replay
    of it covers (the epoch; on the monotone path the replay cursor's chunk).
    ``geometry(gen, lane)`` is the run's ``LaneGeometry``."""
    out: Horizons = {}
    for run in runs:
        start = run.start
        if run.cursor is not None or run.held is not None:
            if monotone and run.cursor is not None:
                k = geometry(run.gen, run.lane).local_index(run.cursor.chunk_id)
                start = (start if k is None else k) + 1
            else:
                start += per_epoch
        out[(run.gen, run.lane)] = start
    return out


def decode_retirements(value: Any, known: dict[str, RetiredIds] | None = None) -> list[Retirement]:
    """A state's ``retired``, checked: null, or a list of retirements (``known``: see
    ``Retirement.decode``)."""
    if value is None:
        return []
    if type(value) is not list or not 1 <= len(value) <= MAX_SETS:
        raise corrupt("retired", f"must be null or a list of 1 to {MAX_SETS} retirements")
    return [Retirement.decode(part, f"retired[{i}]", known) for i, part in enumerate(value)]


class Retirements:
    """The retirements of a run, oldest first: a state's ``retired`` (null when there are
    none)."""

    def __init__(self) -> None:
        self.sets: list[Retirement] = []
        self._encoded: list[dict[str, Any]] | None = None  # encoded once, saved often

    def add(self, retirement: Retirement) -> None:
        """Keep one more retirement."""
        self._keep([*self.sets, retirement])

    def state(self) -> list[dict[str, Any]] | None:
        """The ``retired`` field of a state."""
        return self._encoded

    def restore(self, part: Any) -> None:
        """Take the retirements a state's ``retired`` holds, checked."""
        self._keep(decode_retirements(part))

    def _keep(self, sets: list[Retirement]) -> None:
        self.sets = sets
        self._encoded = [r.encode() for r in sets] or None


def merge_retired(values: list[Any], known: dict[str, RetiredIds] | None = None) -> Any:
    """The ``retired`` of a job state from those of its ranks: the same ids, each rank's
    horizons for its own lanes together. The ids the ranks share are decoded once (``known``:
    see ``Retirement.decode``), so merging a thousand ranks costs one decoding of them."""
    first = values[0]
    known = {} if known is None else known
    sets = [decode_retirements(value, known) for value in values]
    if any(
        len(part) != len(sets[0])
        or any(
            a.ids is not b.ids and not np.array_equal(a.ids.rows, b.ids.rows)
            for a, b in zip(part, sets[0])
        )
        for part in sets
    ):
        raise CheckpointError(
            "the states of the ranks retired different samples: they were not taken in one run "
            "of the job"
        )
    if first is None:
        return None
    merged = []
    for i, base in enumerate(sets[0]):
        horizons: Horizons = {}
        for part in sets:
            horizons.update(part[i].horizons)
        merged.append(Retirement(base.ids, horizons).encode())
    return merged


class FetchScreen:
    """What a lane runner screens at fetch: per retirement, its ids from its horizons on."""

    def __init__(self, retirements: list[Retirement]):
        self.retirements = retirements
        self._unions: dict[tuple[int, ...], RetiredIds] = {}

    def ids_for(self, gen: int, lane: int, k: int) -> RetiredIds | None:
        """The ids screened in chunk ``k`` of lane identity ``(gen, lane)`` (None: none)."""
        return self._union(
            tuple(i for i, r in enumerate(self.retirements) if k >= r.horizons.get((gen, lane), 0))
        )

    def every(self) -> RetiredIds | None:
        """Every retired id, wherever it is screened (None: none): what operators that make one
        record of several samples leave out of it (``Operator.leave_out``)."""
        return self._union(tuple(range(len(self.retirements))))

    def _union(self, active: tuple[int, ...]) -> RetiredIds | None:
        if not active:
            return None
        if active not in self._unions:
            self._unions[active] = RetiredIds(
                np.concatenate([self.retirements[i].ids.rows for i in active])
            )
        return self._unions[active]
