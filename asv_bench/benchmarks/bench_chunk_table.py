"""The chunk table's two hot paths against what a Python or numpy implementation would cost.

Bulk: closing 10M base offsets spread over a few inflight chunks (the replay filter swallowing a
retained epoch). Per call: one `close` per delivered record, the delivery loop's cost.
"""

import numpy as np

from zephon._core.chunk_table import ChunkTable

TOTAL_MARKS = 10_000_000


def _marks(n_chunks: int, order: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(chunk_ids, offsets, chunk size) for TOTAL_MARKS marks over n_chunks chunks."""
    size = TOTAL_MARKS // n_chunks
    chunk_ids = np.repeat(np.arange(n_chunks, dtype=np.int64), size)
    offsets = np.tile(np.arange(size, dtype=np.int64), n_chunks)
    if order == "shuffled_within_chunk":  # what a shuffle buffer delivers: grouped by chunk only
        rng = np.random.default_rng(0)
        for c in range(n_chunks):
            rng.shuffle(offsets[c * size : (c + 1) * size])
    elif order == "interleaved":  # lanes or packing mixing chunks: the id changes every mark
        chunk_ids = np.ascontiguousarray(chunk_ids.reshape(n_chunks, size).T.ravel())
        offsets = np.ascontiguousarray(offsets.reshape(n_chunks, size).T.ravel())
    return chunk_ids, offsets, size


def _fresh_table(n_chunks: int, size: int) -> ChunkTable:
    table = ChunkTable()
    for c in range(n_chunks):
        table.open_chunk(c, c, size, 0)
    return table


class CloseManyBulk:
    """ChunkTable.close_many over 10M offsets; marks/s = 10M / time."""

    params = ([1, 4, 64], ["sequential", "shuffled_within_chunk", "interleaved"])
    param_names = ["n_chunks", "order"]
    timeout = 120

    def setup(self, n_chunks: int, order: str) -> None:
        self.chunk_ids, self.offsets, self.size = _marks(n_chunks, order)
        self.n_chunks = n_chunks
        self.table = _fresh_table(n_chunks, self.size)

    def time_close_many(self, n_chunks: int, order: str) -> None:
        # Re-marking closed offsets costs the same as marking open ones (no branch on the bit).
        self.table.close_many(self.chunk_ids, self.offsets)

    def peakmem_close_many(self, n_chunks: int, order: str) -> None:
        _fresh_table(n_chunks, self.size).close_many(self.chunk_ids, self.offsets)


class BulkBaselines:
    """The same 10M marks with a Python set of (chunk, offset) pairs and with numpy."""

    params = ([4], ["sequential"])
    param_names = ["n_chunks", "order"]
    timeout = 300

    def setup(self, n_chunks: int, order: str) -> None:
        self.chunk_ids, self.offsets, self.size = _marks(n_chunks, order)
        self.flat = self.chunk_ids * self.size + self.offsets

    def time_python_set_update(self, n_chunks: int, order: str) -> None:
        closed: set[int] = set()
        closed.update(self.flat.tolist())

    def time_numpy_bool_mask(self, n_chunks: int, order: str) -> None:
        closed = np.zeros(n_chunks * self.size, dtype=bool)
        closed[self.flat] = True
        int(np.count_nonzero(closed))

    def time_numpy_bincount(self, n_chunks: int, order: str) -> None:
        np.bincount(self.flat, minlength=n_chunks * self.size)


class ClosePerCall:
    """One close() per delivered record, from Python, as the delivery loop calls it."""

    params = [1, 8, 64]
    param_names = ["n_inflight"]

    def setup(self, n_inflight: int) -> None:
        self.size = 4096
        self.n_inflight = n_inflight
        self.table = _fresh_table(n_inflight, self.size)
        # Offsets hop over the inflight chunks the way lanes interleave at delivery.
        self.pairs = [(i % n_inflight, i % self.size) for i in range(100_000)]

    def time_close_100k(self, n_inflight: int) -> None:
        close = self.table.close
        for chunk_id, offset in self.pairs:
            close(chunk_id, offset)

    def time_python_set_add_100k(self, n_inflight: int) -> None:
        add = set().add
        for pair in self.pairs:
            add(pair)


class Lifecycle:
    """Open, close by watermark and evict a long lane: the steady-state bookkeeping cost."""

    params = [64, 1024]
    param_names = ["chunk_size"]

    def time_open_close_evict_10k_chunks(self, chunk_size: int) -> None:
        table = ChunkTable()
        for c in range(10_000):
            table.open_chunk(c, c, chunk_size, c // 8)
            table.close_below(c, chunk_size)
            table.evict_complete_prefix()

    def track_bytes_held_after_10k_chunks(self, chunk_size: int) -> int:
        table = ChunkTable()
        for c in range(10_000):
            table.open_chunk(c, c, chunk_size, 0)
            if c >= 8:
                table.close_below(c - 8, 0)
                table.evict_complete_prefix()
        return table.bytes_held

    track_bytes_held_after_10k_chunks.unit = "bytes"  # type: ignore[attr-defined]
