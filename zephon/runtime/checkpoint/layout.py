"""Which chunk positions each lane takes, over the re-lanings of a job.

A job starts with N lanes: lane g takes positions g, g+N, g+2N, ... as its local chunks 0, 1,
2, ... Resuming on N' lanes closes that *generation*: each old lane g keeps its local chunks below
``ends[g]`` (delivered, or still in flight and finished under its own identity), and every
position no old lane kept goes, in increasing order, to the next generation, whose lane h takes
the h-th, (h+N')-th, ... of them. A generation is its lane count and its ends, O(N) numbers
whatever the step or the size of the data; the positions themselves are never listed.

A lane of generation i seeds its operators from lane number ``N_0 + ... + N_(i-1) + g``, so no two
lanes of a job's history share a seed, and lanes of the first generation keep their own number.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any

from zephon.types import SampleCursor


def lane_total(size: int | None, lane: int, lanes: int) -> int | None:
    """How many of ``size`` indices lane ``lane`` of ``lanes`` takes (None: unbounded)."""
    if size is None:
        return None
    return max(0, -(-(size - lane) // lanes))


class Leftover:
    """The indices of one level that a generation's lanes did not keep, in increasing order:
    ``down(j)`` is the j-th of them, ``up(x)`` the rank of index ``x`` among them (None if kept).

    Index ``x = b * lanes + g`` is kept when ``b < ends[g]``. The leftover indices before block
    ``b`` number ``sum(max(0, b - e) for e in ends)``; beyond the largest end every index is left.
    """

    def __init__(self, lanes: int, ends: list[int], size: int | None):
        self.lanes = lanes
        self.ends = ends
        self._sorted = sorted(ends)
        self._prefix = [0]
        for e in self._sorted:
            self._prefix.append(self._prefix[-1] + e)
        kept = sum(
            e if size is None else min(e, lane_total(size, g, lanes) or 0)
            for g, e in enumerate(ends)
        )
        self.size_after = None if size is None else size - kept

    def _before(self, b: int) -> int:
        """Leftover indices in blocks ``0 .. b-1``."""
        n = bisect.bisect_left(self._sorted, b)  # ends below b
        return n * b - self._prefix[n]

    def down(self, j: int) -> int:
        top = self._sorted[-1]
        base = self._before(top)
        if j >= base:
            b, g = divmod(j - base, self.lanes)
            return (top + b) * self.lanes + g
        lo, hi = self._sorted[0], top  # the block holding it: the first b with _before(b+1) > j
        while lo < hi:
            mid = (lo + hi) // 2
            if self._before(mid + 1) > j:
                hi = mid
            else:
                lo = mid + 1
        r = j - self._before(lo)
        for g, e in enumerate(self.ends):
            if e <= lo:
                if r == 0:
                    return lo * self.lanes + g
                r -= 1
        raise AssertionError("unreachable: the block holds more leftover indices")

    def up(self, x: int) -> int | None:
        b, g = divmod(x, self.lanes)
        if b < self.ends[g]:
            return None
        return self._before(b) + sum(1 for e in self.ends[:g] if e <= b)


class LaneGeometry:
    """The chunk positions lane ``lane`` of a generation takes: its k-th local chunk is
    ``position(k)``; ``total`` local chunks (None when the source is unbounded)."""

    def __init__(self, lane: int, lanes: int, size: int | None, maps: tuple[Leftover, ...] = ()):
        self.lane = lane
        self.lanes = lanes
        self.total = lane_total(size, lane, lanes)
        self._maps = maps  # from this generation's level down to positions

    def position(self, local_index: int) -> int:
        x = self.lane + local_index * self.lanes
        for level in self._maps:
            x = level.down(x)
        return x

    def local_index(self, position: int) -> int | None:
        """The local index of chunk ``position``, or None when the lane never takes it."""
        x: int | None = position
        for level in reversed(self._maps):
            x = level.up(x) if x is not None else None
        if x is None:
            return None
        k, rest = divmod(x - self.lane, self.lanes)
        return k if rest == 0 and k >= 0 else None


class Layout:
    """The generations of a job's lanes: ``lanes[i]`` and, for every closed generation, the ends
    its lanes kept. The last generation is the running one; after a re-laning ``taken`` says
    which earlier lanes' runs each of its lanes took over."""

    def __init__(
        self,
        lanes: list[int],
        ends: list[list[int]],
        total_positions: int | None,
        taken: list[list[tuple[int, int]]] | None = None,
    ):
        assert len(ends) == len(lanes) - 1
        self.lanes = lanes
        self.ends = ends
        self.total_positions = total_positions
        #: Per lane of the running generation, the runs ``(generation, lane)`` it took over at
        #: the re-laning that started it, in the order it finishes them; None when the state
        #: was written before it was stored.
        self.taken = taken
        self.sizes: list[int | None] = [total_positions]
        self.maps: list[Leftover] = []
        for n, kept in zip(lanes, ends):
            level = Leftover(n, kept, self.sizes[-1])
            self.maps.append(level)
            self.sizes.append(level.size_after)

    @classmethod
    def fresh(cls, lanes: int, total_positions: int | None) -> Layout:
        return cls([lanes], [], total_positions)

    @classmethod
    def decode(cls, encoded: list[dict[str, Any]], total_positions: int | None) -> Layout:
        """The layout ``encode()`` gave (already checked: ``state.check_layout``)."""
        runs = encoded[-1].get("runs")
        return cls(
            [gen["lanes"] for gen in encoded],
            [list(gen["ends"]) for gen in encoded[:-1]],
            total_positions,
            None if runs is None else [[(g, lane) for g, lane in held] for held in runs],
        )

    @property
    def current(self) -> int:
        """The running generation."""
        return len(self.lanes) - 1

    def geometry(self, gen: int, lane: int) -> LaneGeometry:
        return LaneGeometry(
            lane, self.lanes[gen], self.sizes[gen], tuple(reversed(self.maps[:gen]))
        )

    def seed_lane(self, gen: int, lane: int) -> int:
        """The lane number generation ``gen``'s lane ``lane`` seeds its operators from."""
        return sum(self.lanes[:gen]) + lane

    def holder(self, gen: int, lane: int) -> int:
        """The running generation's lane that finishes a run of lane ``lane`` of generation
        ``gen``: at every re-laning, lane ``h`` hands its runs to new lane ``h % N'``."""
        for n in self.lanes[gen + 1 :]:
            lane %= n
        return lane

    def closed(self, ends: list[int], lanes: int, taken: list[list[tuple[int, int]]]) -> Layout:
        """This layout with the running generation closed at ``ends`` and ``lanes`` new lanes,
        which took over the runs ``taken``."""
        return Layout([*self.lanes, lanes], [*self.ends, ends], self.total_positions, taken)

    def encode(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [
            {"lanes": n, "ends": list(kept)} for n, kept in zip(self.lanes, self.ends)
        ]
        running: dict[str, Any] = {"lanes": self.lanes[-1]}
        if self.taken is not None:
            running["runs"] = [[[g, lane] for g, lane in held] for held in self.taken]
        out.append(running)
        return out


@dataclasses.dataclass
class Run:
    """A stretch of one lane identity's local chunks: ``gen``/``lane`` say whose (its geometry
    and seeds), ``start``..``end`` which (``end`` None: to the lane's end), ``carry`` the
    operators' carry state at ``start``, and ``cursor``/``count``/``digest`` what was delivered
    of it before the checkpoint (since ``held``'s snapshot when there is one), swallowed again
    when it is replayed."""

    gen: int
    lane: int
    start: int
    end: int | None
    carry: list[Any] | None = None
    cursor: SampleCursor | None = None
    count: int = 0
    digest: int = 0
    #: A snapshot to continue from instead of ``start`` (``lanes.snapshots``; None: replay).
    held: dict[str, Any] | None = None
    #: What was consumed of the epoch by position (``checkpoint.progress.EpochProgress``;
    #: kept behind a reordering operator on the epoch path), and what is screened out at fetch
    #: since a resume with changed operators (the same kind; None: nothing).
    progress: Any = None
    screened: Any = None
    #: ``cursor``/``count``/``digest`` were booked by operators changed since (a resume with
    #: ``allow_changes=True`` before this run was replayed): on a plan that keeps cursor order
    #: its replay swallows what sorts at or below the cursor, whatever the records are.
    changed: bool = False

    @property
    def inherited(self) -> bool:
        """Taken over from a lane of an earlier generation (it has an end)."""
        return self.end is not None

    def for_runner(self) -> dict[str, Any]:
        """What the lane's runner needs of it (plain data: it may go to a worker process)."""
        return {
            "gen": self.gen,
            "lane": self.lane,
            "start": self.start,
            "end": self.end,
            "carry": self.carry,
            "held": self.held,
            "screened": None if self.screened is None else self.screened.encode(),
        }
