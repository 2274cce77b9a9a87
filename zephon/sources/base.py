"""The source protocol: what the runtime asks of a source, and a base for indexed ones.

A source is a deterministic, random-access sequence of chunks. Chunk positions run across passes:
position ``p`` is chunk ``p % num_chunks()`` of pass ``p // num_chunks()``, and the runtime deals
positions out to lanes by ``p % (world_size * lanes)``, so ``chunk(p)`` must cost O(chunk) whatever
``p`` is.

``check_int`` is re-exported from ``zephon.validation``, where it lives, for code that imports it
from here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from zephon._core.pointers import (
    first_foreign_row,
    index_range,
    index_rows,
    own_sample_indices,
    own_samples,
)
from zephon.errors import FetchError
from zephon.sources.permutation import derive_key, permute
from zephon.types import WorkChunk
from zephon.validation import check_bool, check_int

__all__ = ["IndexedSource", "WorkSource", "check_int", "check_pointers"]


def _qualified_name(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


_INT64 = np.dtype(np.int64)


def check_pointers(pointers: np.ndarray, source: object) -> np.ndarray:
    """Pointer rows as an int64 ``(n, 3)`` array; raises ValueError naming ``source`` otherwise.
    Every ``read``/``components`` implementation starts here so bad input fails the same way."""
    # What chunks hold (the check of every micro-batch) passes at once.
    if type(pointers) is np.ndarray and pointers.dtype == _INT64 and pointers.shape[1:] == (3,):
        return pointers
    arr = np.asarray(pointers)
    if arr.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != 3 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"{source!r}: pointers must be an integer array of shape (n, 3) "
            f"(dataset_id, shard_id, sample_idx), got {arr.dtype} {arr.shape}"
        )
    return arr.astype(np.int64, copy=False)


class WorkSource(ABC):
    """A deterministic, random-access sequence of chunks of sample pointers, and their reader.

    Invariant: ``chunk(p)`` is a pure function of the source and ``p`` (same chunk every time, in
    every process), and ``read`` turns any pointer row the source produced into its payload.
    """

    #: Pre-tokenized sources: the payload field holding each sample's token ids, so that
    #: ``fetch`` gives every record its component token counts (as ``tokenize`` does); else None.
    token_field: str | None = None

    @abstractmethod
    def num_chunks(self) -> int | None:
        """Chunks per pass, or None when a pass is unbounded."""

    def total_chunks(self) -> int | None:
        """Chunk positions over all passes, or None when unbounded; a single-pass source (this
        default) has ``num_chunks()``."""
        return self.num_chunks()

    @abstractmethod
    def chunk(self, position: int) -> WorkChunk:
        """The chunk at ``position`` (``chunk.position == position``) in O(chunk) work and memory.
        Raises ValueError for a negative position and IndexError for one ``>= total_chunks()``."""

    def chunk_lengths(self, positions: np.ndarray) -> np.ndarray:
        """How many pointers the chunks at ``positions`` hold (int64), for the runtime to count a
        lane's samples without reading them; this default builds each chunk."""
        return np.array([len(self.chunk(int(p)).pointers) for p in positions], dtype=np.int64)

    @abstractmethod
    def read(self, pointers: np.ndarray) -> list[Any]:
        """Payloads for a batch of ``(dataset_id, shard_id, sample_idx)`` rows, in row order; what
        the ``fetch`` operator calls. A row the source cannot read raises FetchError."""

    def components(self, pointers: np.ndarray) -> list[Any]:
        """The mixture component of each pointer row: by default the row's ``dataset_id``."""
        return check_pointers(pointers, self)[:, 0].tolist()

    def origin(self, pointer: np.ndarray) -> dict[str, Any]:
        """Where the sample of one pointer row lives, for messages about it (a file source:
        ``{"file": path, "sample_in_file": i}``); this default can tell nothing: ``{}``."""
        return {}

    def drop_read_caches(self) -> None:
        """Forget what reads kept for the reads after them (decoded data, bytes fetched ahead),
        but not what describes the data: reading the same samples again reads them again. A
        process that will not read from this source for a while calls it to free that memory
        (a loader whose stream ended or that was closed, and the loader's process once its
        workers read); this default keeps nothing."""
        return None

    def read_ahead_chunks(self) -> int:
        """How many chunk positions after the one it reads a lane announces (``upcoming``);
        this default: 0, none."""
        return 0

    def upcoming(self, positions: Sequence[int]) -> None:
        """The chunk positions a lane reads next, in order, so the source can fetch their data
        in the background (a lane calls it when ``read_ahead_chunks`` is not 0); this default
        does nothing. Only timing may depend on it, never what a read returns."""
        return None

    def read_ahead(self, pointers: np.ndarray) -> bool:
        """Fetch, in the background, the data these pointer rows (of a chunk a lane reads
        soon) will read; False when no more can be taken on now. This default does nothing."""
        return True

    def io_counters(self) -> dict[str, dict[str, int]]:
        """Per data set (a source's label: its dataset root) what this copy of the source read
        from storage in this process (``read_bytes``, ``cache_hits``, ``cache_misses``); this
        default reads nothing worth counting."""
        return {}

    def provides(self) -> dict[str, Any]:
        """Plan-time facts for the operators after ``fetch`` (e.g. the token field and pad id of
        pre-tokenized data, as ``tokenize`` publishes them); none by default."""
        return {}

    def target_mixture(self) -> tuple[str, dict[Any, float]] | None:
        """``(by, shares)`` when the source draws its components towards target shares (``by``
        is ``"tokens"`` or ``"samples"``), else None (this default); ``Loader.stats()`` reports
        the realized shares against it when no operator sets a target."""
        return None

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """JSON-able identity for the pipeline fingerprint: equal across processes for the same
        source, different when its parameters or data differ."""

    def _check_position(self, position: int) -> int:
        p = check_int(position, "chunk position", self, minimum=0)
        total = self.total_chunks()
        if total is not None and p >= total:
            raise IndexError(f"{self!r}: chunk position {p} is past the end ({total} chunks)")
        return p


class IndexedSource(WorkSource):
    """A source with a known number of samples per pass and random access to each sample.

    Chunk ``c`` of pass ``q`` holds the pass-order positions ``[k*chunk_size, (k+1)*chunk_size)``
    (clipped to ``num_samples()``), where ``k = c`` unshuffled, or a (seed, pass)-keyed permutation
    of the chunk indices when ``shuffle=True``; pass-order position ``j`` holds sample ``j``, or its
    image under a (seed, pass)-keyed permutation of ``[0, num_samples())`` when shuffled. So every
    pass holds every sample exactly once, and nothing larger than a chunk is ever materialized.
    """

    def __init__(
        self,
        *,
        dataset_id: int = 0,
        chunk_size: int = 1024,
        shuffle: bool = False,
        seed: int = 0,
        passes: int | None = 1,
    ) -> None:
        name = type(self).__name__
        self.dataset_id = check_int(dataset_id, "dataset_id", name, minimum=0)
        self.chunk_size = check_int(chunk_size, "chunk_size", name, minimum=1)
        self.passes = None if passes is None else check_int(passes, "passes", name, minimum=1)
        self.shuffle = check_bool(shuffle, "shuffle", name)
        self.seed = check_int(seed, "seed", name)

    @abstractmethod
    def num_samples(self) -> int:
        """Samples per pass."""

    def num_chunks(self) -> int:
        """Chunks per pass: ``ceil(num_samples() / chunk_size)``."""
        return -(-self.num_samples() // self.chunk_size)

    def total_chunks(self) -> int | None:
        """``num_chunks() * passes``; None when ``passes=None`` (an empty source has 0 chunks)."""
        per_pass = self.num_chunks()
        if per_pass == 0:
            return 0
        return None if self.passes is None else per_pass * self.passes

    def chunk(self, position: int) -> WorkChunk:
        """Chunk ``position % num_chunks()`` of pass ``position // num_chunks()``."""
        p = self._check_position(position)
        per_pass = self.num_chunks()
        pass_idx, c = divmod(p, per_pass)
        k = c
        if self.shuffle:
            key = derive_key(self.seed, pass_idx, "chunks")
            k = int(permute(np.array([c], dtype=np.int64), per_pass, key)[0])
        start = k * self.chunk_size
        stop = min(start + self.chunk_size, self.num_samples())
        return WorkChunk(p, self.pointer_rows(self.samples(pass_idx, start, stop)))

    def chunk_lengths(self, positions: np.ndarray) -> np.ndarray:
        """``len(chunk(p).pointers)`` for each position, worked out from the chunk layout alone:
        only the last chunk of a pass is short, wherever the pass's shuffle put it."""
        p = np.asarray(positions, dtype=np.int64)
        per_pass = self.num_chunks()
        if not p.size or not per_pass:
            return np.zeros(p.shape, dtype=np.int64)
        passes, k = np.divmod(p, per_pass)
        if self.shuffle:
            for q in np.unique(passes).tolist():
                at = passes == q
                k[at] = permute(k[at], per_pass, derive_key(self.seed, q, "chunks"))
        start = k * self.chunk_size
        return np.minimum(start + self.chunk_size, self.num_samples()) - start

    def samples(self, pass_idx: int, start: int, stop: int) -> np.ndarray:
        """The sample indices (int64) at pass-order positions ``[start, stop)`` of pass
        ``pass_idx``; a pass is a permutation of ``[0, num_samples())``."""
        n = self.num_samples()
        q = check_int(pass_idx, "pass_idx", self)
        start = check_int(start, "start", self)
        stop = check_int(stop, "stop", self)
        if q < 0 or (self.passes is not None and q >= self.passes):
            raise IndexError(f"{self!r}: pass {q} does not exist (passes={self.passes})")
        if not 0 <= start <= stop <= n:
            raise IndexError(f"{self!r}: sample range [{start}, {stop}) is outside [0, {n})")
        positions = index_range(start, stop)  # holding the GIL (``zephon._core.pointers``)
        if not self.shuffle:
            return positions
        return permute(positions, n, derive_key(self.seed, q, "samples"))

    def pointer_rows(self, sample_indices: np.ndarray) -> np.ndarray:
        """Pointer rows (int64 ``(n, 3)``) of the given sample indices: ``(dataset_id, 0, idx)``
        unless the source has shards."""
        return index_rows(self.dataset_id, np.asarray(sample_indices, dtype=np.int64).ravel())

    def _sample_indices(self, pointers: np.ndarray) -> np.ndarray:
        # The sample_idx column of rows this source produced; anything else is a FetchError.
        rows = check_pointers(pointers, self)
        bad = first_foreign_row(rows, self.dataset_id, self.num_samples())
        if bad >= 0:
            raise self._foreign(rows[bad])
        return rows[:, 2]

    def _sample_index_list(self, pointers: np.ndarray, key: str | None = None) -> list[Any]:
        # ``_sample_indices`` as a list of ints, in one compiled pass (what in-memory reads use);
        # with ``key``, each as the payload ``{key: idx}``.
        return self._own(pointers, own_sample_indices, key)

    def _own_list_items(self, pointers: np.ndarray, items: list[Any]) -> list[Any]:
        # The items of ``items`` the pointers name, in the compiled pass that checks them.
        return self._own(pointers, own_samples, items)

    def _own(self, pointers: np.ndarray, kernel: Callable[..., Any], arg: Any) -> list[Any]:
        # ``kernel`` (``own_sample_indices`` or ``own_samples``) on checked pointers: its list,
        # or the FetchError for the first row that is not this source's.
        rows = check_pointers(pointers, self)
        found = kernel(rows, self.dataset_id, self.num_samples(), arg)
        if isinstance(found, int):
            raise self._foreign(rows[found])
        return found

    def _foreign(self, row: np.ndarray) -> FetchError:
        return FetchError(
            f"{self!r} cannot read pointer {tuple(row.tolist())}: it holds dataset_id "
            f"{self.dataset_id}, sample_idx in [0, {self.num_samples()}); route pointers to the "
            "source that produced them"
        )

    def _describe_base(self) -> dict[str, Any]:
        return {
            "class": _qualified_name(self),
            "dataset_id": self.dataset_id,
            "num_samples": self.num_samples(),
            "chunk_size": self.chunk_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "passes": self.passes,
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(n={self.num_samples()}, dataset_id={self.dataset_id}, "
            f"chunk_size={self.chunk_size}, shuffle={self.shuffle}, seed={self.seed}, "
            f"passes={self.passes})"
        )


def sample_origin(source: WorkSource | None, cursor: Any) -> dict[str, Any]:
    """``source.origin`` of the sample a record's ``cursor`` names, for a message about it;
    ``{}`` without a source or cursor, or when naming the place fails (it must never hide the
    error being reported)."""
    if source is None or cursor is None:
        return {}
    try:
        return source.origin(np.asarray(cursor.sample_id, dtype=np.int64))
    except Exception:
        return {}
