"""Typed stub of the compiled delivery bookkeeping (zephon/_core/delivery.pyx)."""

from collections.abc import Iterable, Sequence
from typing import Any, final

import numpy as np
import numpy.typing as npt

from zephon._core.chunk_table import ChunkTable
from zephon._core.cursor import SampleCursor
from zephon._core.records import RecordRun, SampleBatch, SampleMeta, SampleRecord

def heritage_key(tag: str, kind: str, component: str | int) -> str: ...
def parse_heritage_key(key: Any) -> tuple[str, str, str | int] | None: ...

@final
class DeliveryCounters:
    """The run's delivery counters, shared by the lanes of one loader."""

    delivered: int
    tombstones: int
    evicted: int
    mix_samples: dict[Any, int]
    mix_tokens: dict[Any, int]
    counted_tags: frozenset[Any]
    tag_counts: dict[Any, int]
    def __init__(self) -> None: ...
    def flush(self) -> None: ...
    def count_delivered(self, meta: SampleMeta) -> None: ...
    def count_tombstone(self, meta: SampleMeta) -> None: ...

@final
class DeliveryBook:
    """The bookkeeping of one lane's delivery: chunk table, watermark, replay window, counters."""

    table: ChunkTable
    monotone: bool
    counters: DeliveryCounters
    last_cursor: SampleCursor | None
    epochs_done: int
    violations: list[tuple[Any, ...]]
    partial: set[tuple[int, int]] | None
    def __init__(
        self,
        table: ChunkTable,
        monotone: bool,
        counters: DeliveryCounters,
        track_partial: bool = True,
    ) -> None: ...
    def window_push(self, unit: int, count: int, digest: int) -> None: ...
    def window_clear(self) -> None: ...
    def window_totals(self) -> tuple[int, int]: ...
    @property
    def window_len(self) -> int: ...
    def note_evicted(self, chunk_ids: npt.NDArray[np.int64] | Sequence[int]) -> None: ...
    def record(self, rec: SampleRecord, count: bool = True) -> None: ...
    def tombstone(self, tomb: SampleRecord, count: bool = True) -> None: ...
    def deliver(self, items: list[Any], start: int = 0, stop: int = -1) -> int: ...
    def unfinished(self) -> set[tuple[int, int]]: ...
    def clear_partial(self) -> None: ...
    def restore_partial(self, keys: Iterable[tuple[int, int]]) -> None: ...

def gather(
    buf: list[Any],
    pos: int,
    pending: list[Any],
    n_pending: int,
    batch_size: int,
    leave: tuple[type, ...],
) -> tuple[int, int]: ...

class CollateFailed(Exception):
    """The collate of a batch raised; ``records`` is the batch, the collate's error the cause."""

    records: RecordRun
    def __init__(self, records: RecordRun) -> None: ...

def hand_over_run(
    buf: list[Any], pos: int, batch_size: int, collate: Any, book: DeliveryBook
) -> tuple[int, SampleBatch] | None: ...
