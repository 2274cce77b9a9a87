"""What tests read of a ``ChunkTable`` beyond what the runtime asks of it, computed from the
table's own queries: the compiled table keeps only what delivery and eviction use."""

from __future__ import annotations

from zephon._core.chunk_table import ChunkTable


def open_offsets(table: ChunkTable, chunk_id: int, epoch: int = 0) -> list[int]:
    """The still-open offsets of an inflight chunk of ``epoch``, in increasing order; none for a
    chunk that has left the table."""
    ids, offsets = table.epoch_open_offsets(epoch)
    return [int(o) for o in offsets[ids == chunk_id]]


def is_complete(table: ChunkTable, chunk_id: int, epoch: int = 0) -> bool:
    """Whether every offset of the chunk is closed (a chunk that has left the table is)."""
    return not open_offsets(table, chunk_id, epoch)
