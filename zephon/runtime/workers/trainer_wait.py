"""How long the training loop waited inside the loader's ``next()``: the time a lane's next item
list was not ready (its worker still working on it, or, on an inline lane, the operators making
it), in total and over the latest steps.

Only the refills of the lanes' feeds are timed (``LaneFeed.refill``): two clock reads and one
``book()`` per item list, nothing per record or per step. An item handed over from a list
already there counts as no wait.
"""

from __future__ import annotations

import weakref
from collections import deque
from time import monotonic
from typing import Any

#: The steps the recent wait is summed over.
RECENT_STEPS = 100


class TrainerWait:
    """The waits of one loader, each booked at the step it held up: the step after the
    ``steps`` its ``next()`` handed over so far (``LoaderStep.steps``)."""

    def __init__(self, loader: Any, recent: int = RECENT_STEPS):
        # Weak: the loader holds this, and a loader dropped unclosed must still go (and stop its
        # workers) when its last reference does, not at some later garbage collection.
        self._loader = weakref.ref(loader)
        self.recent = recent
        self.seconds = 0.0
        self._waits: deque[tuple[int, float]] = deque()  # (steps handed over before it, seconds)
        self._began: float | None = None  # monotonic, at the first next()
        self._ended: float | None = None  # at the end of the stream, close() or a failure

    def _steps(self) -> int:
        loader = self._loader()
        return 0 if loader is None else loader.steps

    def begin(self) -> None:
        """The first ``next()``: the time running counts from here."""
        self._began = monotonic()

    def end(self) -> None:
        """No more steps: the time running stops here."""
        if self._began is not None and self._ended is None:
            self._ended = monotonic()

    def book(self, waited: float) -> None:
        """``waited`` seconds for an item list, in the step under way."""
        self.seconds += waited
        step = self._steps()
        waits = self._waits
        waits.append((step, waited))
        while waits[0][0] < step - self.recent:
            waits.popleft()

    def stats(self) -> dict[str, float | int]:
        """``seconds`` waited and ``steps`` handed over since the first ``next()``, the
        ``recent_seconds`` waited in the last ``recent_steps`` of them, and the ``elapsed``
        seconds from the first ``next()`` to now (or to the end of the stream)."""
        steps = self._steps()
        recent = min(self.recent, steps)
        # a wait booked at ``s`` steps held up step s + 1: it is recent when s >= steps - recent
        recent_seconds = sum(w for s, w in self._waits if s >= steps - recent)
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
