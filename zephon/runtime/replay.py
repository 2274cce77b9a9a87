"""The replay filter: after a restore, swallow a lane's records until the replay cursor is met.

A restored lane re-runs its retained chunks. Everything it produces up to and including the record
at the replay cursor was delivered before the checkpoint: it is booked again (so the chunk table
ends up as it was) but not handed over. Meeting the cursor after a different count or set of
records, or passing where it should have been, means some operator is not deterministic.
"""

from __future__ import annotations

from zephon.errors import ReplayDivergenceError
from zephon.types import SampleCursor

MASK64 = (1 << 64) - 1


class ReplayFilter:
    """Swallows records of lane ``lane_id`` up to ``target``; ``expect`` is the checkpoint's
    ``(count, digest)`` of the lane's retained deliveries, ``seen`` what is already accounted for
    (records skipped at the source)."""

    def __init__(
        self,
        lane_id: int,
        target: SampleCursor,
        expect: tuple[int, int],
        *,
        monotone: bool,
        seen: tuple[int, int] = (0, 0),
    ):
        self.lane_id = lane_id
        self.target = target
        self.expect = expect
        self.monotone = monotone
        self.count, self.digest = seen
        self.swallowed = 0

    def swallow(self, cursor: SampleCursor) -> bool:
        """Account for a swallowed record; True when it was the one at the replay cursor."""
        target = self.target
        if self.monotone and cursor > target:
            raise self.diverged(f"record {cursor!r} came where the replay cursor should have been")
        self.count += 1
        self.swallowed += 1
        self.digest = (self.digest + cursor.stable_hash) & MASK64
        if cursor != target:
            return False
        if (self.count, self.digest) != self.expect:
            raise self.diverged(
                f"the replay cursor was met after {self.count} records, but the checkpoint "
                f"recorded {self.expect[0]} (or different ones) before it"
            )
        return True

    def diverged(self, why: str) -> ReplayDivergenceError:
        """The error for a replay that cannot reach the checkpoint's position."""
        return ReplayDivergenceError(
            f"replay of lane {self.lane_id} to cursor {self.target!r} diverged: {why}. "
            "Some operator is not deterministic (randomness not from (seed, lane, epoch), "
            "iteration over sets, time-based decisions) or its carry state was not restored; "
            "the stream was not resumed."
        )
