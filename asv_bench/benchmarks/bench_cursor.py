"""Sorting SampleCursors: ``sort_cursors`` against numpy ``lexsort`` and a dataclass sort.

Target: sorting 1M cursors takes at most 2x what ``np.lexsort`` takes on the same four columns
(lineage padded to a fixed width), and is at least 5x faster than ``sorted`` on a
``@dataclass(order=True)`` holding the sort-key fields. The ``track_*`` benchmarks report those two
ratios measured in one process, so they do not depend on the machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon._core.cursor import sort_cursors
from zephon.types import SampleCursor

LINEAGE_WIDTH = 2  # at most two splits deep, like tokenize(split) followed by a packer's child()
CHUNK_SIZE = 1024


@dataclass(order=True, frozen=True)
class DataclassCursor:
    """The baseline: the same identity as a plain dataclass, fields in sort-key order."""

    chunk_id: int
    chunk_offset: int
    lineage: tuple[int, ...]
    sample_id: tuple[int, int, int]


def make_columns(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``n`` cursors as columns, in shuffled order (as after a shuffle operator).

    About two records share each base offset, so comparisons often reach the lineage and the
    sample id; lineages are padded with -1, which sorts a lineage before its extensions.
    """
    rng = np.random.default_rng(seed)
    base = rng.integers(0, max(n // 2, 1), n)
    depth = rng.integers(0, LINEAGE_WIDTH + 1, n)
    lineage = rng.integers(0, 4, (n, LINEAGE_WIDTH))
    lineage[np.arange(LINEAGE_WIDTH)[None, :] >= depth[:, None]] = -1
    sample_id = np.stack(
        [rng.integers(0, 4, n), rng.integers(0, 64, n), rng.integers(0, 1 << 20, n)], axis=1
    )
    return {
        "chunk_id": base // CHUNK_SIZE,
        "chunk_offset": base % CHUNK_SIZE,
        "lineage": lineage,
        "depth": depth,
        "sample_id": sample_id,
    }


def _rows(cols: dict[str, np.ndarray]) -> zip[tuple[Any, ...]]:
    pairs = zip(cols["lineage"].tolist(), cols["depth"].tolist(), strict=True)
    lineages = [tuple(row[:depth]) for row, depth in pairs]
    return zip(
        cols["chunk_id"].tolist(),
        cols["chunk_offset"].tolist(),
        lineages,
        [tuple(row) for row in cols["sample_id"].tolist()],
        strict=True,
    )


def _best_of(fn: Callable[[], object], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class CursorSort:
    """Time to sort ``n`` shuffled cursors, and the same order computed by the baselines."""

    params = [100_000, 1_000_000]
    param_names = ["n"]
    number = 1
    repeat = (1, 5, 30.0)
    timeout = 600.0

    def setup(self, n: int) -> None:
        cols = make_columns(n)
        rows = list(_rows(cols))
        self.cursors = [SampleCursor(c, o, s, lin) for c, o, lin, s in rows]
        self.dataclasses = [DataclassCursor(c, o, lin, s) for c, o, lin, s in rows]
        # np.lexsort sorts by its last key first: chunk_id, chunk_offset, lineage, sample_id.
        self.keys = (
            *(cols["sample_id"][:, i] for i in (2, 1, 0)),
            *(cols["lineage"][:, i] for i in reversed(range(LINEAGE_WIDTH))),
            cols["chunk_offset"],
            cols["chunk_id"],
        )

    def time_sort_cursors(self, n: int) -> None:
        sort_cursors(self.cursors)

    def time_sorted_builtin(self, n: int) -> None:
        sorted(self.cursors)

    def time_numpy_lexsort(self, n: int) -> None:
        np.lexsort(self.keys)

    def time_dataclass_sort(self, n: int) -> None:
        sorted(self.dataclasses)

    def track_sort_cursors_over_lexsort(self, n: int) -> float:
        """The target is at most 2."""
        return _best_of(self._sort) / _best_of(self._lexsort)

    track_sort_cursors_over_lexsort.unit = "ratio"  # type: ignore[attr-defined]

    def track_dataclass_over_sort_cursors(self, n: int) -> float:
        """The target is at least 5."""
        return _best_of(self._dataclass_sort, repeat=1) / _best_of(self._sort)

    track_dataclass_over_sort_cursors.unit = "ratio"  # type: ignore[attr-defined]

    def _sort(self) -> object:
        return sort_cursors(self.cursors)

    def _lexsort(self) -> object:
        return np.lexsort(self.keys)

    def _dataclass_sort(self) -> object:
        return sorted(self.dataclasses)
