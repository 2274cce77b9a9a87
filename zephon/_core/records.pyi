from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, final, overload

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

from zephon._core.cursor import SampleCursor

@disjoint_base
class ContributorRef:
    """A base offset a record stands for, and whether this record is the last one that will."""

    cursor: SampleCursor
    is_last_child: bool
    def __init__(self, cursor: SampleCursor, is_last_child: bool) -> None: ...
    @property
    def base_offset(self) -> tuple[int, int]: ...
    def __hash__(self) -> int: ...

@disjoint_base
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

def counted_meta(meta: SampleMeta, n_tokens: int) -> SampleMeta: ...

@disjoint_base
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

@disjoint_base
class SampleBatch:
    """Consecutive records grouped for the training loop; each keeps its own cursor and meta."""

    @property
    def records(self) -> tuple[SampleRecord, ...]: ...
    payload: Any
    def __init__(self, records: Iterable[SampleRecord], payload: Any) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[SampleRecord]: ...
    def __getitem__(self, i: int, /) -> SampleRecord: ...

@final
class RecordRun(Sequence[SampleRecord]):
    """Root records of one chunk at consecutive offsets, kept as columns: what ``fetch`` reads."""

    chunk_id: int
    first_offset: int
    lane_id: int
    n: int
    payloads: list[Any]
    components: list[Any]
    def __init__(
        self,
        chunk_id: int,
        pointers: npt.ArrayLike,
        payloads: list[Any],
        lane_id: int,
        components: list[Any] | None,
        first_offset: int = 0,
    ) -> None: ...
    @property
    def pointers(self) -> npt.NDArray[np.int64]: ...
    def records(self) -> list[SampleRecord]: ...
    def with_payloads(self, payloads: list[Any]) -> RecordRun: ...
    def split(self, k: int) -> tuple[RecordRun, RecordRun]: ...
    def __len__(self) -> int: ...
    @overload
    def __getitem__(self, index: int, /) -> SampleRecord: ...
    @overload
    def __getitem__(self, index: slice, /) -> list[SampleRecord]: ...
    def __iter__(self) -> Iterator[SampleRecord]: ...

@final
class JoinedRuns(Sequence[SampleRecord]):
    """Runs read one after another, as one read-only ``Sequence`` of their records."""

    n: int
    def __init__(self, runs: Iterable[RecordRun]) -> None: ...
    @property
    def runs(self) -> list[RecordRun]: ...
    @property
    def payloads(self) -> list[Any]: ...
    def records(self) -> list[SampleRecord]: ...
    def __len__(self) -> int: ...
    @overload
    def __getitem__(self, index: int, /) -> SampleRecord: ...
    @overload
    def __getitem__(self, index: slice, /) -> list[SampleRecord]: ...
    def __iter__(self) -> Iterator[SampleRecord]: ...

def expand_runs(items: list[Any]) -> list[Any]: ...
def records_for_chunk(
    chunk_id: int,
    pointers: npt.ArrayLike,
    payloads: list[Any],
    lane_id: int,
    components: list[Any],
    first_offset: int = 0,
) -> list[SampleRecord]: ...
def count_closing(records: Iterable[SampleRecord | RecordRun]) -> int: ...
def next_control(items: list[Any], start: int = 0) -> int: ...
def map_payloads(
    fn: Callable[[Any], Any], records: list[SampleRecord], start: int, out: list[SampleRecord]
) -> tuple[int, Exception | None]: ...
def map_run(
    fn: Callable[[Any], Any], run: RecordRun
) -> tuple[list[Any], int, Exception | None]: ...
def make_batch(records: Sequence[SampleRecord], payload: Any) -> SampleBatch: ...
def payloads_of(records: list[SampleRecord]) -> list[Any]: ...
def cursors_of(records: list[SampleRecord]) -> list[SampleCursor]: ...
