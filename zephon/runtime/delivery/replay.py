"""The replay filter: after a restore, swallow a lane's records until the replay cursor is met.

A restored lane re-runs its retained chunks. Everything it produces up to and including the record
at the replay cursor was delivered before the checkpoint: it is booked again (so the chunk table
ends up as it was) but not handed over. Meeting the cursor after a different count or set of
records, or passing where it should have been, means some operator is not deterministic.
"""

from __future__ import annotations

from zephon.errors import ReplayDivergenceError
from zephon.types import SampleCursor, SampleRecord

MASK64 = (1 << 64) - 1
NOT_DETERMINISTIC = (
    "Some operator is not deterministic (randomness not from (seed, lane, epoch), iteration over "
    "sets, time-based decisions) or its carry state was not restored"
)


def changed_records(changes: list[str], reordering: list[str]) -> str:
    """Why a replay diverges after a resume with changed operators (``allow_changes=True``):
    ``changes`` as the warning named them, ``reordering`` the names of the chain's operators
    that reorder records (on the epoch path: what keeps the delivered records from being told
    apart by position)."""
    which = "; ".join(changes[:3]) + ("; ..." if len(changes) > 3 else "")
    why = (
        f"operator(s) {', '.join(map(repr, reordering))} reorder records, so what was "
        "delivered before the checkpoint cannot be told apart among the new records by their "
        "position"
        if reordering
        else "what was delivered before the checkpoint cannot be told apart"
    )
    return (
        f"The changed operators make other records of what was in flight at the checkpoint "
        f"than the old ones did ({which}): {why} (the lane could not continue by position: "
        "a sample was partly delivered at the checkpoint, split over several records, or the "
        "checkpoint was written by an older Zephon). Resume with the checkpoint's operators "
        "until every lane has passed its next epoch marker (a state taken there has nothing in "
        "flight) and change them at that checkpoint"
    )


def merged_records(stateful: list[str]) -> str:
    """Why a lenient replay stops at records made of several samples whose parts differ from
    the delivered ones (``ReplayFilter.merges``); ``stateful`` names the operators that may
    make them."""
    return (
        f"operator(s) {', '.join(map(repr, stateful))} make one record of several samples: "
        "which parts of the new ones were delivered before the checkpoint cannot be told by "
        "their position, so only changes that keep those records (the same samples in each, "
        "other payloads) resume there"
    )


class ReplayFilter:
    """Swallows records of lane ``lane_id`` up to ``target``; ``expect`` is the checkpoint's
    ``(count, digest)`` of the lane's retained deliveries, ``seen`` what is already accounted for
    (records skipped at the source); ``cause`` what a divergence means, when the usual cause (a
    non-deterministic operator) is not the likely one.

    ``lenient`` (after a resume with changed operators, on a plan whose every operator keeps
    cursor order, so that records reach delivery in cursor order: the monotone path, or the
    epoch path with operators that keep state in order): records are swallowed while they sort
    at or below the cursor, which closes every offset below it as delivery did, without
    checking count and digest; the first record above it is not swallowed (``past``), and the
    epoch or the stream may end first. Each sample up to the cursor was consumed by the old
    operators, each after it is made by the new ones. ``merges`` (the text of the divergence)
    refuses that when a swallowed record was made of several samples (a packer's row) and the
    records differ: the parts of the samples in it cannot be told apart by position."""

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
        merges: str | None = None,
    ):
        self.lane_id = lane_id
        self.target = target
        self.expect = expect
        self.monotone = monotone
        self.count, self.digest = seen
        self.swallowed = 0
        self.cause = cause or NOT_DETERMINISTIC
        self.lenient = lenient
        self.merges = merges
        self.merged = False  # a swallowed record was made of several samples

    def past(self, cursor: SampleCursor) -> bool:
        """Whether a lenient replay is over before the record at ``cursor`` (it sorts above)."""
        return self.lenient and cursor > self.target

    def swallow(self, record: SampleRecord) -> bool:
        """Account for a swallowed record; True when it was the one at the replay cursor."""
        cursor = record.meta.cursor
        target = self.target
        if self.monotone and cursor > target:
            raise self.diverged(f"record {cursor!r} came where the replay cursor should have been")
        self.count += 1
        self.swallowed += 1
        self.digest = (self.digest + cursor.stable_hash) & MASK64
        if self.merges is not None and not self.merged:
            offsets = {ref.base_offset for ref in record.meta.contribution_refs()}
            self.merged = len(offsets) > 1
        if cursor != target:
            return False
        if (self.count, self.digest) != self.expect:
            if not self.lenient:
                raise self.diverged(
                    f"the replay cursor was met after {self.count} records, but the checkpoint "
                    f"recorded {self.expect[0]} (or different ones) before it"
                )
            self.check_unmerged("the records before the replay cursor differ")
        return True

    def check_unmerged(self, why: str) -> None:
        """A lenient replay whose records differ from the delivered ones ends: refused when a
        record made of several samples was among them (``merges``)."""
        if self.merged and self.merges is not None:
            raise self.diverged(f"{why}, and {self.merges}")

    def diverged(self, why: str) -> ReplayDivergenceError:
        """The error for a replay that cannot reach the checkpoint's position."""
        return ReplayDivergenceError(
            f"replay of lane {self.lane_id} to cursor {self.target!r} diverged: {why}. "
            f"{self.cause}; the stream was not resumed."
        )
