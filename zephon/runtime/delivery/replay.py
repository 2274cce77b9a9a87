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
NOT_DETERMINISTIC = (
    "Some operator is not deterministic (randomness not from (seed, lane, epoch), iteration over "
    "sets, time-based decisions) or its carry state was not restored"
)
#: Why a replay diverges after a resume with changed operators (``allow_changes=True``).
CHANGED_RECORDS = (
    "The changed operators make other records of what was in flight at the checkpoint than the "
    "old ones did (a filter that now drops other records, a map that changes lengths before a "
    "packer), so what was delivered before it cannot be told apart on the epoch path; only "
    "changes that keep the in-flight records (the same records, other payloads) resume there. "
    "Resume with the checkpoint's operators and change them at a later checkpoint"
)


class ReplayFilter:
    """Swallows records of lane ``lane_id`` up to ``target``; ``expect`` is the checkpoint's
    ``(count, digest)`` of the lane's retained deliveries, ``seen`` what is already accounted for
    (records skipped at the source); ``cause`` what a divergence means, when the usual cause (a
    non-deterministic operator) is not the likely one.

    ``lenient`` (the monotone path after a resume with changed operators, whose records need not
    be the ones delivered): records are swallowed while they sort at or below the cursor, which
    closes every offset below it as delivery did, without checking count and digest; the first
    record above it is not swallowed (``past``), and the stream may end first."""

    def __init__(
        self,
        lane_id: int,
        target: SampleCursor,
        expect: tuple[int, int],
        *,
        monotone: bool,
        seen: tuple[int, int] = (0, 0),
        cause: str | None = None,
        lenient: bool = False,
    ):
        self.lane_id = lane_id
        self.target = target
        self.expect = expect
        self.monotone = monotone
        self.count, self.digest = seen
        self.swallowed = 0
        self.cause = cause or NOT_DETERMINISTIC
        self.lenient = lenient and monotone

    def past(self, cursor: SampleCursor) -> bool:
        """Whether a lenient replay is over before the record at ``cursor`` (it sorts above)."""
        return self.lenient and cursor > self.target

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
        if (self.count, self.digest) != self.expect and not self.lenient:
            raise self.diverged(
                f"the replay cursor was met after {self.count} records, but the checkpoint "
                f"recorded {self.expect[0]} (or different ones) before it"
            )
        return True

    def diverged(self, why: str) -> ReplayDivergenceError:
        """The error for a replay that cannot reach the checkpoint's position."""
        return ReplayDivergenceError(
            f"replay of lane {self.lane_id} to cursor {self.target!r} diverged: {why}. "
            f"{self.cause}; the stream was not resumed."
        )
