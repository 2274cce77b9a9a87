"""How long the training loop waited inside the loader's ``next()``: the time a lane's next item
list was not ready (its worker still working on it, or, on an inline lane, the operators making
it), in total and over the latest steps.

Only the refills of the lanes' feeds are timed: two clock reads per item list, nothing per record
or per step. An item handed over from a list already there counts as no wait.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from time import monotonic, perf_counter
from typing import Any

#: The steps the recent wait is summed over.
RECENT_STEPS = 100


class TrainerWait:
    """The waits of one loader, each booked at the step it held up. A step is an item handed to
    the training loop, counted over ``lanes`` (``LaneOutlet.delivered``)."""

    def __init__(self, lanes: Sequence[Any], recent: int = RECENT_STEPS):
        self.lanes = lanes
        self.recent = recent
        self.seconds = 0.0
        self._waits: deque[tuple[int, float]] = deque()  # (items delivered before it, seconds)
        self._first_step = 0
        self._began: float | None = None  # monotonic, at the first next()
        self._ended: float | None = None  # at the end of the stream, close() or a failure

    def _step(self) -> int:
        return sum(lane.delivered for lane in self.lanes)

    def begin(self) -> None:
        """The first ``next()``: steps and the time running count from here."""
        self._first_step = self._step()
        self._began = monotonic()

    def end(self) -> None:
        """No more steps: the time running stops here."""
        if self._began is not None and self._ended is None:
            self._ended = monotonic()

    def timed(self, refill: Any) -> Any:
        """``refill()``, its time booked as a wait of the step under way."""
        began = perf_counter()
        try:
            return refill()
        finally:
            waited = perf_counter() - began
            self.seconds += waited
            step = self._step()
            waits = self._waits
            waits.append((step, waited))
            while waits[0][0] < step - self.recent:
                waits.popleft()

    def stats(self) -> dict[str, float | int]:
        """``seconds`` waited and ``steps`` handed over since the first ``next()``, the
        ``recent_seconds`` waited in the last ``recent_steps`` of them, and the ``elapsed``
        seconds from the first ``next()`` to now (or to the end of the stream)."""
        step = self._step()
        steps = max(step - self._first_step, 0)
        recent = min(self.recent, steps)
        # a wait booked at ``s`` items held up item s + 1: it is recent when s >= step - recent
        recent_seconds = sum(w for s, w in self._waits if s >= step - recent)
        if self._began is None:
            elapsed = 0.0
        else:
            elapsed = (self._ended if self._ended is not None else monotonic()) - self._began
        return {
            "seconds": self.seconds,
            "steps": steps,
            "recent_seconds": recent_seconds,
            "recent_steps": recent,
            "elapsed": elapsed,
        }
