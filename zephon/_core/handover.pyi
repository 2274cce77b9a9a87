from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol, type_check_only

from typing_extensions import disjoint_base

from zephon._core.delivery import DeliveryBook

NO_LIMIT: int

@type_check_only
class HandoverBook(Protocol):
    """A lane's bookkeeping as the step uses it: ``book``, the lane's current ``DeliveryBook``;
    ``found``, the contract violations it found (taken by ``take_violations``); ``opened``, set
    when a chunk was announced since the step last looked (the step clears it)."""

    @property
    def book(self) -> DeliveryBook: ...
    @property
    def found(self) -> list[Any]: ...
    opened: bool
    def take_violations(self) -> list[Any]:
        """The violations found since the last call, as the ``ViolationReport`` takes them."""
    def invented(self, rec: Any, exc: Exception) -> BaseException:
        """The error for a record (None: a record of the batch) whose booking raised ``exc``."""

@type_check_only
class ViolationReport(Protocol):
    """Where the step hands a lane's contract violations (``LoaderStep.policy``)."""

    def report(self, violations: list[Any]) -> None: ...

@disjoint_base
class FeedBuffer:
    """The item list a lane's feed is delivering (``buf``) and the position in it (``pos``)."""

    buf: list[Any]
    pos: int
    def head(self) -> Any: ...

@disjoint_base
class PendingBatch:
    """A lane's pending batch: ``n_pending`` real records wait in ``pending`` for ``batch_size``;
    ``collate`` makes the batch's payload, and ``collate_failed`` (a subclass's) the error for a
    collate that raised."""

    pending: list[Any]
    n_pending: int
    batch_size: int
    collate: Any
    @abstractmethod
    def collate_failed(self, records: Any, exc: Exception) -> BaseException: ...

@disjoint_base
class LaneOutlet:
    """One lane's delivery: its feed, its batcher (or None) and its book."""

    feed: FeedBuffer
    batcher: PendingBatch | None
    book: HandoverBook
    ended: bool
    replay: Any
    restored_state: dict[str, Any] | None
    delivered: int
    limit: int
    def hand_over_head(self) -> Any: ...
    @abstractmethod
    def next_delivery(self) -> Any: ...

@disjoint_base
class StepLock:
    """The loader's lock: ``with lock:``; taken again by the thread holding it, a
    ``RuntimeError``."""

    def locked(self) -> bool: ...
    def __enter__(self) -> StepLock: ...
    def __exit__(self, *exc: object) -> None: ...

@disjoint_base
class LoaderStep:
    """The loader's ``__next__``: a round over its lanes until one delivers."""

    lanes: Sequence[LaneOutlet]
    next_lane: int
    policy: ViolationReport
    @property
    def _lock(self) -> StepLock: ...
    _failure: BaseException | None
    _closed: bool
    _started: bool
    steps: int
    def __next__(self) -> Any: ...
    @abstractmethod
    def _start_or_refuse(self) -> None: ...
    @abstractmethod
    def _note_inflight(self) -> None: ...
    @abstractmethod
    def _fail(self, exc: BaseException) -> None: ...
    @abstractmethod
    def _release_source(self) -> None: ...
