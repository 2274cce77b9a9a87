"""What a file source reads from its storage: remote files that count the bytes read from them,
the shard cache in front of them, and the counters a loader's ``stats()`` reports per source
(``read_bytes``: bytes read from remote storage, ranged reads and shard downloads alike;
``cache_hits``/``cache_misses``: opens of a cached shard that found it / had to fetch it)."""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable, Iterable
from typing import Any

from zephon.sources.shard_cache import DOWNLOAD_PIECE, CachedShard, ShardCache

__all__ = [
    "COUNTERS",
    "CountedFile",
    "IOCounters",
    "latest_counters",
    "merge_counters",
    "open_through_cache",
    "process_key",
]

#: The names of a source's counters, in the order ``IOCounters`` keeps them.
COUNTERS = ("read_bytes", "cache_hits", "cache_misses")


# Made once per interpreter: a process forked from this one keeps it, and is told apart by its pid.
_INTERPRETER = secrets.token_hex(8)


def process_key() -> str:
    """Which process of the job this is, for the counters each process reports: its pid, and a
    token of the interpreter that started it, since a worker on another machine (a Ray lane)
    may have the pid of the loader's own process or of another worker."""
    return f"{_INTERPRETER}-{os.getpid()}"


class IOCounters:
    """A source's counters in one process (thread-safe; a copy unpickled elsewhere starts at 0)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values = [0, 0, 0]

    def add(self, k: int, n: int) -> None:
        """Add ``n`` to counter ``k`` (an index into ``COUNTERS``)."""
        with self._lock:
            self.values[k] += n

    def opened(self, shard: CachedShard) -> None:
        """Count one open of a cached shard as a hit or a miss."""
        self.add(1 if shard.hit else 2, 1)

    def as_dict(self) -> dict[str, int]:
        """The counters by name."""
        with self._lock:
            return dict(zip(COUNTERS, self.values, strict=True))

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]


def merge_counters(parts: Iterable[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """Per-source counters summed over ``parts`` (processes, or the components of a mixture)."""
    out: dict[str, dict[str, int]] = {}
    for part in parts:
        for label, counts in part.items():
            into = out.setdefault(label, dict.fromkeys(COUNTERS, 0))
            for name in COUNTERS:
                into[name] += int(counts.get(name, 0))
    return out


def latest_counters(
    a: dict[str, dict[str, int]], b: dict[str, dict[str, int]]
) -> dict[str, dict[str, int]]:
    """The later of two snapshots of one process's counters (they only grow): the larger of each."""
    out = {label: dict(counts) for label, counts in a.items()}
    for label, counts in b.items():
        into = out.setdefault(label, dict.fromkeys(COUNTERS, 0))
        for name in COUNTERS:
            into[name] = max(into.get(name, 0), int(counts.get(name, 0)))
    return out


class CountedFile:
    """A remote file object counting the bytes read through it; everything else passes through."""

    def __init__(self, f: Any, counters: IOCounters) -> None:
        self._f = f
        self._counters = counters

    def read(self, nbytes: int | None = None) -> Any:
        data = self._f.read() if nbytes is None else self._f.read(nbytes)
        self._counters.add(0, len(data))
        return data

    def read_at(self, nbytes: int, offset: int) -> Any:
        data = self._f.read_at(nbytes, offset)
        self._counters.add(0, len(data))
        return data

    def read_buffer(self, nbytes: int | None = None) -> Any:
        data = self._f.read_buffer(nbytes)
        self._counters.add(0, len(data))
        return data

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._f, name)

    def __enter__(self) -> CountedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


def open_through_cache(
    cache: ShardCache,
    uri: str,
    version: str,
    size: int,
    open_remote: Callable[[], Any],
    counters: IOCounters,
) -> CachedShard:
    """The shard at ``uri`` (``version``, ``size`` bytes, as the store gave them when it was
    just opened) through ``cache``: downloaded whole through ``open_remote()`` when the cache
    lacks it, read through ``open_remote()`` directly when the cache has no room."""

    def download(write: Callable[[bytes], None]) -> int:
        got = 0
        with open_remote() as remote:
            for at in range(0, size, DOWNLOAD_PIECE):
                data = remote.read_at(min(DOWNLOAD_PIECE, size - at), at)
                write(data)
                got += len(data)
                if len(data) < min(DOWNLOAD_PIECE, size - at):
                    break
        return got

    return cache.open(uri, version, size, download, open_remote, counters.opened)
