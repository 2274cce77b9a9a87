from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from zephon._core.cursor import SampleCursor

class ContributorRef:
    """A base offset a record stands for, and whether this record is the last one that will."""

    cursor: SampleCursor
    is_last_child: bool
    def __init__(self, cursor: SampleCursor, is_last_child: bool) -> None: ...
    @property
    def base_offset(self) -> tuple[int, int]: ...
    def __hash__(self) -> int: ...

class SampleMeta:
    """The tracking half of a record: cursor, lane, contributors, tags and mixture heritage."""

    cursor: SampleCursor
    lane_id: int
    contributors: tuple[ContributorRef, ...] | None
    tags: frozenset[str]
    is_tombstone: bool
    component: Hashable | None
    component_sample_counts: dict[Any, int] | None
    component_token_counts: dict[Any, int] | None
    def __init__(
        self,
        cursor: SampleCursor,
        *,
        lane_id: int = 0,
        contributors: Iterable[ContributorRef] | None = None,
        tags: Iterable[str] = ...,
        is_tombstone: bool = False,
        component: Hashable | None = None,
        component_sample_counts: Mapping[Any, int] | None = None,
        component_token_counts: Mapping[Any, int] | None = None,
    ) -> None: ...
    def contribution_refs(self) -> tuple[ContributorRef, ...]: ...
    def replace(self, **changes: Any) -> SampleMeta: ...

class SampleRecord:
    """A payload with its tracking metadata; a tombstone's payload is None."""

    meta: SampleMeta
    payload: Any
    def __init__(self, meta: SampleMeta, payload: Any) -> None: ...
    @property
    def cursor(self) -> SampleCursor: ...
    @property
    def is_tombstone(self) -> bool: ...
    def contribution_refs(self) -> tuple[ContributorRef, ...]: ...
    def with_payload(self, payload: Any) -> SampleRecord: ...

class SampleBatch:
    """Consecutive records grouped for the training loop; each keeps its own cursor and meta."""

    records: tuple[SampleRecord, ...]
    payload: Any
    def __init__(self, records: Iterable[SampleRecord], payload: Any) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[SampleRecord]: ...
    def __getitem__(self, i: int) -> SampleRecord: ...

def records_for_chunk(
    chunk_id: int,
    pointers: npt.NDArray[np.int64],
    payloads: list[Any],
    lane_id: int,
    components: list[Any],
    first_offset: int = 0,
) -> list[SampleRecord]: ...
def count_closing(records: Iterable[SampleRecord]) -> int: ...
def next_control(items: list[Any], start: int = 0) -> int: ...
def map_payloads(
    fn: Callable[[Any], Any], records: list[SampleRecord], start: int, out: list[SampleRecord]
) -> tuple[int, Exception | None]: ...
def make_batch(records: list[SampleRecord], payload: Any) -> SampleBatch: ...
def payloads_of(records: list[SampleRecord]) -> list[Any]: ...
def cursors_of(records: list[SampleRecord]) -> list[SampleCursor]: ...
