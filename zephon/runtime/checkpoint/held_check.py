"""The packed parts of a snapshot in a checkpoint (``held``), checked before anything is built
from them: the held records' cursors and the open offsets must name chunks of the snapshot and,
when the source is at hand, offsets inside those chunks. Decoding is bounded by ``compact``;
these checks keep what a restore then builds (the held records, the set of open offsets) to
what the snapshot's chunks can hold.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zephon.compact import unpack_ints
from zephon.errors import CheckpointCorruptError
from zephon.runtime.checkpoint.layout import LaneGeometry


def _corrupt(where: str, why: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"loader state field {where} {why}")


class SnapshotChunks:
    """The chunks a snapshot covers (lane-local ``start`` up to ``stop``) and, with ``source``,
    how many samples each holds."""

    def __init__(self, geometry: LaneGeometry, start: int, stop: int, source: Any = None):
        self.geometry = geometry
        self.start = start
        self.stop = stop
        self.source = source
        self._sizes: dict[int, int] = {}

    def __contains__(self, chunk_id: object) -> bool:
        if type(chunk_id) is not int:
            return False
        k = self.geometry.local_index(chunk_id)
        return k is not None and self.start <= k < self.stop

    def size(self, chunk_id: int) -> int | None:
        """The samples in chunk ``chunk_id`` (one of the snapshot's), None without a source."""
        if self.source is None:
            return None
        if chunk_id not in self._sizes:
            self._sizes[chunk_id] = len(self.source.chunk(chunk_id))
        return self._sizes[chunk_id]


def _unpacked(text: Any, where: str) -> np.ndarray:
    try:
        return unpack_ints(text)
    except ValueError as exc:
        raise _corrupt(where, str(exc)) from None


def check_held_records(text: Any, where: str, chunks: SnapshotChunks) -> None:
    """Packed held cursors (``snapshots.flat_cursors``): whole cursors, each of a sample in one of
    the snapshot's chunks."""
    flat = _unpacked(text, where)
    i, n = 0, len(flat)
    while i < n:
        if i + 3 > n or i + 3 + int(flat[i + 2]) > n:
            raise _corrupt(where, "ends inside a cursor")
        chunk_id, offset = int(flat[i]), int(flat[i + 1])
        if chunk_id not in chunks:
            raise _corrupt(where, f"names chunk {chunk_id} outside the snapshot")
        size = chunks.size(chunk_id)
        if size is not None and offset >= size:
            raise _corrupt(where, f"names offset {offset} of chunk {chunk_id}, which holds {size}")
        i += 3 + int(flat[i + 2])


def check_open_offsets(text: Any, where: str, chunks: SnapshotChunks) -> None:
    """Packed ``(chunk, offset)`` pairs of the snapshot's chunks, each at most once and, with a
    source, inside its chunk: never more than the chunks hold."""
    flat = _unpacked(text, where)
    if len(flat) % 2:
        raise _corrupt(where, "must be (chunk, offset) pairs of the snapshot's chunks")
    pairs = flat.reshape(-1, 2)
    for chunk_id in np.unique(pairs[:, 0]).tolist():
        if chunk_id not in chunks:
            raise _corrupt(where, f"names chunk {chunk_id} outside the snapshot")
        size = chunks.size(chunk_id)
        if size is not None and int(pairs[pairs[:, 0] == chunk_id, 1].max()) >= size:
            raise _corrupt(where, f"names an offset past the {size} samples of chunk {chunk_id}")
    if len(np.unique(pairs, axis=0)) != len(pairs):
        raise _corrupt(where, "names an offset twice")
