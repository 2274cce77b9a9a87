"""Local files memory-mapped for reads, shared by the file sources that map their shards (MDS,
token shards, WebDataset): a few maps kept between reads, the least recently used dropped first,
and every read checking first that the file still has the size and mtime it was indexed at, so a
file rewritten since is refused instead of read.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

__all__ = ["ChangedFile", "MappedFiles", "map_bytes"]


class ChangedFile(Exception):
    """The file no longer has the size and mtime it was indexed at: ``now`` is its
    ``(size, mtime_ns)``."""

    def __init__(self, now: tuple[int, int]):
        super().__init__(f"size {now[0]}, mtime_ns {now[1]}")
        self.now = now


class MappedFiles:
    """Maps of local files by key, at most ``keep`` of them held between reads.

    Invariant: ``get`` returns a map only after a ``stat`` of the file, just before, found the
    size and mtime it was indexed at; a map is kept with the stat it was made after.
    """

    def __init__(self, keep: int = 16) -> None:
        self.keep = keep
        self._maps: OrderedDict[Hashable, tuple[tuple[int, int], np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()

    def get(
        self,
        key: Hashable,
        path: str,
        indexed: tuple[int, int | None],
        make: Callable[[], np.ndarray],
    ) -> np.ndarray:
        """The map of ``path`` (made by ``make()`` when none is kept under ``key``), after checking
        the file's size and mtime are ``indexed`` (an mtime of None: any). ``ChangedFile`` when
        they are not; an ``OSError`` of the ``stat`` or the map passes through."""
        st = os.stat(path)
        now = (st.st_size, st.st_mtime_ns)
        if now[0] != indexed[0] or indexed[1] not in (None, now[1]):
            raise ChangedFile(now)
        with self._lock:
            kept = self._maps.get(key)
            if kept is not None and kept[0] == now:
                self._maps.move_to_end(key)
                return kept[1]
        data = make()
        with self._lock:
            self._maps[key] = (now, data)
            self._maps.move_to_end(key)
            while len(self._maps) > self.keep:
                self._maps.popitem(last=False)
        return data

    def clear(self) -> None:
        """Unmap every file kept (the maps still used by a caller stay valid until released)."""
        with self._lock:
            self._maps.clear()

    def __getstate__(self) -> dict[str, Any]:
        return {"keep": self.keep}  # a process maps the files again itself

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["keep"])  # type: ignore[misc]


def map_bytes(path: str) -> np.ndarray:
    """The whole file as a read-only uint8 array over a memory map (a plain ndarray view: a
    ``np.memmap`` indexes through Python)."""
    return np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
