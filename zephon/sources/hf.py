"""HFDatasetSource: a Hugging Face ``datasets.Dataset`` read straight from its Arrow cache files.

A ``Dataset`` loaded from disk or from files keeps its rows in Arrow IPC stream files in its
cache directory (``dataset.cache_files``); this source reads those files as an ``ArrowSource``
does (memory-mapped, record batch by record batch, with the ``columns`` projection), never
through ``datasets``' Python rows, and identifies them the same way: by their names relative to
the cache directory, sizes, row counts, schema and content digests. So it delivers the same
stream as an ``ArrowSource`` over the same rows in Parquet, and resumes on a copy of the cache
elsewhere, never on a dataset saved again with other rows.

What it refuses, with a ValueError saying what to do: a dataset held in memory (no cache files:
``save_to_disk`` then ``load_from_disk``), one with an indices mapping (after ``select``,
``shuffle``, ``filter``...: ``flatten_indices()`` writes the rows it selects), and one whose
columns were changed in memory only (``rename_columns``, ``add_column``: its cache files keep
the old columns). Columns removed or selected in memory are simply not read.

``datasets`` is imported by the caller, never by this module: ``import zephon`` does not load it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from zephon.sources.arrow import ArrowSource

__all__ = ["HFDatasetSource"]


def _cache_files(dataset: Any) -> list[str]:
    # A DatasetDict is a dict of splits whose cache_files is a dict too: one split is wanted.
    if isinstance(dataset, Mapping):
        splits = list(dataset.keys())
        pick = f"dataset[{splits[0]!r}]" if splits else "one of its splits"
        raise TypeError(
            f"HFDatasetSource: got a DatasetDict with splits {splits}; pass one split, e.g. {pick}"
        )
    files = getattr(dataset, "cache_files", None)
    if files is None or not hasattr(dataset, "column_names"):
        raise TypeError(f"HFDatasetSource: expected a datasets.Dataset, got {dataset!r}")
    if getattr(dataset, "_indices", None) is not None:
        raise ValueError(
            "HFDatasetSource: the dataset has an indices mapping (from select, shuffle, filter, "
            "...); call dataset.flatten_indices() first so its rows are in its own cache files"
        )
    if not files:
        raise ValueError(
            "HFDatasetSource: the dataset lives in memory and has no Arrow cache files; "
            "save_to_disk() it and load_from_disk() it again, or build it from files"
        )
    changed = _changed_in_memory(getattr(dataset, "data", None))
    if changed:
        raise ValueError(
            f"HFDatasetSource: the dataset's columns were changed in memory ({changed}), not in "
            "its cache files, which keep the old ones; save_to_disk() it and load_from_disk() "
            "it again (or make the change with map(), which writes new cache files)"
        )
    return [os.fspath(f["filename"]) for f in files]


#: Changes ``datasets`` makes to a memory-mapped table in memory (its ``replays``) that keep the
#: values of its cache files' columns: the source reads ``column_names`` from the files, and the
#: row count is checked against them (``HFDatasetSource.load_metadata``).
_KEEPS_FILE_VALUES = frozenset({"replace_schema_metadata", "drop", "select", "slice"})


def _changed_in_memory(table: Any) -> str:
    """What of ``table`` (a dataset's ``data``) its cache files do not hold: the in-memory
    operations that rename, add or recast its columns, ``"in memory"`` for blocks held in
    memory (``add_column``, a concatenation with an in-memory dataset), or a concatenation of
    columns (whose files each hold some); ``""`` when none."""
    blocks = getattr(table, "blocks", None)
    if blocks is not None:  # a ConcatenationTable: its blocks, row by row
        if any(len(row) > 1 for row in blocks):  # each file holds some of the columns
            return "concatenate_datasets(axis=1)"
        return ", ".join(filter(None, (_changed_in_memory(b) for row in blocks for b in row)))
    if type(table).__name__ == "InMemoryTable":
        return "in memory"
    names = [r[0] for r in getattr(table, "replays", None) or () if r]
    return ", ".join(dict.fromkeys(n for n in names if n not in _KEEPS_FILE_VALUES))


class HFDatasetSource(ArrowSource):
    """Rows of a ``datasets.Dataset`` (one split), read from its Arrow cache files; see the
    module docstring. Payloads, pointers, chunking and identity are those of ``ArrowSource``."""

    def __init__(
        self,
        dataset: Any,
        *,
        dataset_id: int = 0,
        columns: Sequence[str] | None = None,
        chunk_size: int = 1024,
        shuffle: bool = False,
        seed: int = 0,
        passes: int | None = 1,
        index_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        files = _cache_files(dataset)
        super().__init__(
            files,
            dataset_id=dataset_id,
            columns=list(dataset.column_names) if columns is None else columns,
            chunk_size=chunk_size,
            shuffle=shuffle,
            seed=seed,
            passes=passes,
            index_dir=index_dir,
        )
        self.expected_rows = int(dataset.num_rows)

    def load_metadata(self) -> list[int]:
        """``ArrowSource``'s, checking that the cache files hold exactly the dataset's rows (a
        contiguous ``select`` or a slice shares the files of the whole dataset)."""
        counts = super().load_metadata()
        if sum(counts) != self.expected_rows:
            raise ValueError(
                f"HFDatasetSource: the dataset has {self.expected_rows} rows but its cache files "
                f"hold {sum(counts)} (a slice or select of a bigger dataset); call "
                "dataset.flatten_indices() or save_to_disk() it first"
            )
        return counts
