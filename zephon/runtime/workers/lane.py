"""What the runtime asks of a lane, whatever kind of worker runs it.

A lane is an iterator over the item lists its ``LaneRunner`` makes, in order, ending when the
runner does. The feed (``feeds.LaneFeed``) takes the lists with ``next()``, asks how many are
ready with ``queued()``, and stops the lane in two phases (``stopping.close_lanes``):
``request_stop()`` tells the worker and never blocks, then ``release()`` hands over the workers
still to wait for, so that many lanes stop under one deadline. A kind of lane implements this
interface and registers an opener (``registry.register_lane_kind``); the errors every kind raises
for the same failure are made in ``stopping`` (``closed_error``, ``exit_outside_operator``,
``timed_out``).
"""

from __future__ import annotations

import abc
from typing import Protocol

#: Seconds a worker gets to stop by itself once asked, before a worker process is terminated.
STOP_TIMEOUT = 0.1


class LaneWorker(Protocol):
    """What stopping needs of a worker; held by the lane's finalizer, so never the lane itself."""

    #: Whether ``terminate`` and ``kill`` can end the worker (a process) or not (a thread).
    forcible: bool

    def request_stop(self) -> None:
        """Tell the worker to stop; never blocks."""

    def wait(self, deadline: float) -> bool:
        """Wait until ``deadline`` (``time.monotonic()``) for the worker to stop; whether it did."""

    def terminate(self) -> None:
        """Ask the operating system to end the worker (does nothing for a thread)."""

    def kill(self) -> None:
        """End the worker by force (does nothing for a thread)."""


class Lane(abc.ABC):
    """One lane running somewhere: its runner's item lists, one per ``next()``.

    After ``request_stop()`` (or ``close()``), ``next()`` raises ``stopping.closed_error``; an
    error in the runner comes out of ``next()`` as the runner raised it (``SystemExit`` as
    ``stopping.exit_outside_operator``), and a lane that waits past the plan's ``timeout`` raises
    ``stopping.timed_out``.
    """

    #: The global lane this is.
    lane_id: int

    def __iter__(self) -> Lane:
        return self

    @abc.abstractmethod
    def __next__(self) -> list:
        """The runner's next item list; ``StopIteration`` once the runner is exhausted."""

    @abc.abstractmethod
    def queued(self) -> int:
        """Item lists made ahead that ``next()`` has not taken yet (0 when nothing runs ahead)."""

    def queued_bytes(self) -> int:
        """The bytes of those lists as the lane counts them against ``max_inflight_bytes``
        (0 when nothing runs ahead, or nothing is counted)."""
        return 0

    def held_by_bytes(self) -> bool:
        """Whether the lane's worker waits on ``max_inflight_bytes`` since ``next()`` last took
        a list: what is ``queued`` now is all it makes until the next is taken."""
        return False

    @abc.abstractmethod
    def request_stop(self) -> None:
        """Tell the lane's worker to stop; never blocks. ``next()`` delivers nothing afterwards."""

    @abc.abstractmethod
    def release(self) -> list[LaneWorker]:
        """The workers to wait for once ``request_stop()`` was called, each handed over once
        (later calls return none): ``close_lanes`` joins them under one deadline."""

    @abc.abstractmethod
    def join(self, deadline: float) -> bool:
        """Wait until ``deadline`` (``time.monotonic()``) for the lane's worker to stop; whether
        it did."""

    @abc.abstractmethod
    def close(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop the lane, giving its worker ``timeout`` seconds; idempotent."""
