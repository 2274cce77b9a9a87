from typing import Any

from typing_extensions import disjoint_base

NO_LIMIT: int

@disjoint_base
class FeedBuffer:
    """The item list a lane's feed is delivering (``buf``) and the position in it (``pos``)."""

    buf: list[Any]
    pos: int

@disjoint_base
class PendingBatch:
    """A lane's pending batch: ``n_pending`` real records wait in ``pending`` for ``batch_size``;
    ``collate`` makes the batch's payload."""

    pending: list[Any]
    n_pending: int
    batch_size: int
    collate: Any

@disjoint_base
class LaneOutlet:
    """One lane's delivery: its feed, its batcher (or None) and its book."""

    feed: Any
    batcher: Any
    book: Any
    ended: bool
    replay: Any
    restored_state: dict[str, Any] | None
    delivered: int
    limit: int
    def hand_over_head(self) -> Any: ...

@disjoint_base
class LoaderStep:
    """The loader's ``__next__``: a round over its lanes until one delivers."""

    lanes: list[Any]
    next_lane: int
    _lock: Any
    _failure: BaseException | None
    _closed: bool
    _started: bool
    steps: int
    def __next__(self) -> Any: ...
