"""The record model: classes compiled in ``zephon._core``; this module is their home."""

from __future__ import annotations

import numpy as np

from zephon._core.cursor import SampleCursor
from zephon._core.records import (
    ContributorRef,
    JoinedRuns,
    RecordRun,
    SampleBatch,
    SampleMeta,
    SampleRecord,
)
from zephon.validation import check_int

__all__ = [
    "ContributorRef",
    "JoinedRuns",
    "RecordRun",
    "SampleBatch",
    "SampleCursor",
    "SampleMeta",
    "SampleRecord",
    "WorkChunk",
]


class WorkChunk:
    """One unit of work from a source: its position and one ``(dataset_id, shard_id, sample_idx)``
    row per sample, as an ``int64`` array of shape ``(n, 3)``."""

    __slots__ = ("pointers", "position")

    def __init__(self, position: int, pointers: np.ndarray):
        arr = np.asarray(pointers)
        if arr.ndim != 2 or arr.shape[1] != 3:
            raise ValueError(f"WorkChunk pointers must have shape (n, 3), got {arr.shape}")
        if arr.dtype != np.int64:
            if not np.issubdtype(arr.dtype, np.integer) and arr.size:
                raise TypeError(f"WorkChunk pointers must be integers, got {arr.dtype}")
            arr = arr.astype(np.int64)
        self.position = check_int(position, "position", "WorkChunk", minimum=0)
        self.pointers = arr

    def __len__(self) -> int:
        return len(self.pointers)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WorkChunk):
            return NotImplemented
        return self.position == other.position and np.array_equal(self.pointers, other.pointers)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"WorkChunk(position={self.position}, {len(self)} samples)"
