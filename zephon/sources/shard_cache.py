"""A node-local cache of whole remote shards, shared by every lane, thread and process of the
machine that reads through it.

A file source given ``cache=ShardCache(dir, max_bytes=...)`` over remote data downloads each file
(shard) it reads whole, once, into ``dir`` and reads it from there: memory-mapped, through the
same checks as without the cache.

Entries. A shard is cached under the key of its URI, its store version (ETag, generation or
version id) and its size: ``<key>.shard`` holds its bytes and ``<key>.json`` its record (URI,
version, size, sha256 of the bytes, and the size, mtime and inode the shard file was written
with). An object the store names no version of is read without the cache: nothing would tell a
rewrite from the copy.
A source may also keep bytes it derives from a shard as an entry, under a URI of its own (MDS
and LitData: a compressed shard's decompressed copy, ``<uri>#inflated``, versioned by the
compressed content's digest), bounded and evicted with the downloads.

Sharing. Each key has a lock file (``locks/<key>.lock``, ``fcntl.flock``): a reader holds it
shared while the entry is open; a download holds it exclusively, so a second reader of the same
shard (another thread, another process) waits for that download instead of making its own. The
bytes go to a temporary name first and are renamed into place, so no reader ever sees a partial
shard. A process that dies while downloading leaves its lock released by the kernel and its
temporary file to be replaced by the next download of the key.

Checks. Every open compares the record with the version, size and URI the source asked for, and
the shard file's size, mtime and inode with the ones recorded when it was written: any difference
(a stale entry, a file touched since) and the shard is downloaded again. The first open of an
entry in a process also hashes the whole file against the sha256 taken while downloading, so a
copy damaged on disk is downloaded again, never served. Past that, the source checks every range
it reads against the content digests it pinned, as for uncached data. A process keeps its last
``KEPT_OPEN`` shards open between reads (locked shared, mapped): opening one again costs a
``stat`` of its file.

Eviction. Downloads reserve their size first (under ``locks/space.lock``); when the entries and the
reservations would pass ``max_bytes``, the least recently used entries (the record's mtime is the
last use) are deleted, skipping every entry some reader holds open (the downloading process first
lets go of the shards it only keeps open), until they fit in ``EVICT_TO`` of ``max_bytes``: the
room left over spares the next downloads an eviction each. A ledger (the text of
``locks/space.lock``, written under its lock) keeps the bytes the entries and reservations hold, or
more (a failed download or a file deleted by hand leaves it high), so a download reads no other
entry's record until the ledger says the cache is full; then every record is read, and the ledger
set exact. A shard larger than ``max_bytes`` is a ``FetchError``; one that cannot get room because
every other entry is in use is read from the store directly this time (a bypass), so the bound
holds. So is a shard whose copy must be downloaded again while another process still has the old
one open (it may keep it for as long as it runs): after ``LOCK_WAIT`` seconds the reader bypasses
instead of waiting, and later reads of that shard bypass at once while the copy stays held.

Read-ahead. With ``prefetch_shards=N`` a background thread (``zephon-shard-prefetch``) downloads
at most N announced shards ahead of their reads; ``stop_prefetch`` drops what was not started and
waits for the download under way, and the thread ends by itself whenever its queue is empty.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from zephon.errors import FetchError
from zephon.sources.locations import local_path
from zephon.validation import check_int

__all__ = ["CachedShard", "ShardCache"]

log = logging.getLogger("zephon")

#: Bytes a download writes (and hashes) at a time.
DOWNLOAD_PIECE = 16 << 20

#: ``download(write)``: write the object's bytes through ``write``; returns how many it wrote.
Download = Callable[[Callable[[bytes], None]], int]


class ShardCache:
    """A directory of whole remote shards, bounded by ``max_bytes``, shared through file locks by
    every process of the machine that uses the same ``dir``; see the module docstring.

    Invariant: a shard is served only when its record names the URI, version and size asked for
    and its file is the one the cache wrote (size, mtime, inode; in each process once, its sha256
    too); the entries and reservations never hold more than ``max_bytes``.
    """

    #: Shards a process keeps open between reads (each one's lock held shared, its map kept),
    #: so a read of a shard read recently costs one ``stat`` of it. The process lets them go
    #: when it needs room; to other processes they are open (not evicted).
    KEPT_OPEN = 4
    #: Seconds a process waits to download again a shard whose copy others have open (a
    #: damaged or stale copy some process still reads) before it reads the store directly.
    LOCK_WAIT = 5.0
    #: The share of ``max_bytes`` an eviction brings the entries down to (with the new one).
    EVICT_TO = 0.9

    def __init__(
        self, dir: str | os.PathLike[str], *, max_bytes: int, prefetch_shards: int = 0
    ) -> None:
        if not isinstance(dir, (str, os.PathLike)):
            raise TypeError(f"ShardCache: dir must be a path, got {dir!r}")
        self.dir = os.path.abspath(local_path(dir, "ShardCache", "the cache"))
        self.max_bytes = check_int(max_bytes, "max_bytes", "ShardCache", minimum=1)
        self.prefetch_shards = check_int(
            prefetch_shards, "prefetch_shards", "ShardCache", minimum=0
        )
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._verified: set[tuple[str, int, int, int]] = set()  # key, inode, mtime, size
        self._damaged: set[tuple[str, int, int, int]] = set()  # hashed, and not as recorded
        # Entries whose stale copy another process kept open past LOCK_WAIT: not waited for
        # again, only looked at, until this process can download them.
        self._passed_over: set[str] = set()
        # Records read, by their shard file's (key, inode, mtime, size).
        self._records: dict[tuple[str, int, int, int], dict[str, Any]] = {}
        self._made_dirs = False
        # Entries this process has open (in use or kept), and the kept ones, oldest first.
        self._live: dict[str, _Entry] = {}
        self._kept: OrderedDict[str, _Entry] = OrderedDict()
        self._queue: OrderedDict[str, Callable[[], None]] = OrderedDict()
        self._worker: threading.Thread | None = None
        self._stopping = False

    # --------------------------------------------------------------------- paths
    @staticmethod
    def key(uri: str, version: str, size: int) -> str:
        """The entry name of one version of an object."""
        text = f"zephon shard 1\0{uri}\0{version}\0{size}"
        return hashlib.sha256(text.encode()).hexdigest()[:40]

    # Joined by hand: a read of a cached shard builds three of these.
    def shard_path(self, key: str) -> str:
        """Where the bytes of entry ``key`` are kept."""
        return f"{self.dir}/{key}.shard"

    def _record_path(self, key: str) -> str:
        return f"{self.dir}/{key}.json"

    def _partial_path(self, key: str) -> str:
        return f"{self.dir}/.{key}.tmp"

    def _lock_path(self, key: str) -> str:
        return f"{self.dir}/locks/{key}.lock"

    # --------------------------------------------------------------------- opening
    def open(
        self,
        uri: str,
        version: str,
        size: int,
        download: Download,
        direct: Callable[[], Any],
        opened: Callable[[CachedShard], None] = lambda shard: None,
    ) -> CachedShard:
        """Entry of ``uri`` at ``version`` (``size`` bytes), made by ``download`` when missing or
        not intact, or read through ``direct()`` (the object opened on the store) when the cache
        has no room; nothing is locked, checked or downloaded before its bytes are first needed,
        and then ``opened(shard)`` is called (its ``hit`` known)."""
        return CachedShard(self, uri, version, size, download, direct, opened)

    def _acquire(self, uri: str, version: str, size: int, download: Download) -> Any:
        """``(entry, hit)`` of an intact entry, open and locked shared for the caller (release it
        with ``_release``), downloaded first when needed; None when there is no room for it
        (every other entry in use): read it uncached."""
        if size > self.max_bytes:
            raise FetchError(
                f"ShardCache({self.dir!r}, max_bytes={self.max_bytes}) cannot hold {uri!r} "
                f"({size} bytes); raise max_bytes above the largest shard, or read this data "
                "without cache="
            )
        key = self.key(uri, version, size)
        with self._lock:
            live = self._live.get(key)
        if live is not None:  # open in this process: in use, or kept
            if not live.unchanged():
                self._unkeep(live)  # changed on disk since it was checked
            else:
                with self._lock:
                    reused = self._live.get(key) is live  # not closed meanwhile
                    if reused:
                        live.users += 1
                        if live.kept:
                            self._kept.move_to_end(key)
                if reused:
                    with contextlib.suppress(OSError):
                        os.utime(self._record_path(key))  # its last use, for eviction
                    return live, True
        if not self._made_dirs:
            os.makedirs(os.path.dirname(self._lock_path(key)), exist_ok=True)
            self._made_dirs = True
        fd = os.open(self._lock_path(key), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fetched = False
            for _ in range(8):  # another process may evict between our downgrade and check
                fcntl.flock(fd, fcntl.LOCK_SH)
                found = self._intact(key, uri, version, size)
                if found is not None:
                    return self._opened(key, fd, *found), not fetched
                with self._lock:
                    busy = key in self._live
                if busy:  # our own shared lock would block the exclusive one forever
                    raise FetchError(
                        f"ShardCache: the cached copy of {uri!r} ({self.shard_path(key)!r}) "
                        "changed on disk while this process had it open; do not write into the "
                        "cache directory"
                    )
                taken = self._exclusive(fd, key, uri, version, size)
                if taken is None:
                    # Another process has the old copy open and may keep it for as long as it
                    # runs: read from the store this time rather than wait for it.
                    log.info(
                        "ShardCache: %r is held open by another process in %r; read from the "
                        "store this time",
                        uri,
                        self.dir,
                    )
                    os.close(fd)
                    return None
                if taken is not True:  # another reader downloaded it meanwhile
                    return self._opened(key, fd, *taken), not fetched
                found = self._intact(key, uri, version, size)
                if found is None:  # else intact after all (another process fetched it)
                    if not self._reserve(key, uri, version, size):
                        os.close(fd)
                        return None
                    self._download(key, uri, version, size, download)
                    fetched = True
                # Shared again; not atomic, so the entry is checked once more.
            raise FetchError(
                f"ShardCache: {uri!r} was evicted again and again before it could be read; "
                f"raise max_bytes of {self.dir!r}"
            )
        except BaseException:
            os.close(fd)
            raise

    def _exclusive(self, fd: int, key: str, uri: str, version: str, size: int) -> Any:
        """Entry ``key``'s lock, held shared, taken exclusively (True: download it); or, when
        another reader downloaded the entry meanwhile, ``(map, identity)`` of it, the lock held
        shared again; None when others keep a copy that is not intact open past ``LOCK_WAIT``.

        A shared lock that cannot be made exclusive is let go (``flock`` drops it first), and
        taken again only to look at the entry, so two readers that found it missing at once do
        not keep each other from downloading it: the loser waits, shared, for the winner's
        download and reads its copy. An entry passed over once is not waited for again: every
        read of a shard would wait ``LOCK_WAIT`` for a process that may run for days."""
        with self._lock:
            wait = 0.0 if key in self._passed_over else self.LOCK_WAIT
        deadline = time.monotonic() + wait
        pause = 0.005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                taken: Any = True
                break
            except BlockingIOError:
                pass
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # a download under way: wait for it
                fcntl.flock(fd, fcntl.LOCK_SH)
            taken = self._intact(key, uri, version, size)
            if taken is not None:
                break
            fcntl.flock(fd, fcntl.LOCK_UN)  # others may take it to download meanwhile
            if time.monotonic() >= deadline:
                with self._lock:
                    self._passed_over.add(key)
                return None
            time.sleep(pause)
            pause = min(pause * 2, 0.25)
        with self._lock:
            self._passed_over.discard(key)
        return taken

    def _opened(self, key: str, fd: int, mapped: Any, seen: tuple[int, int, int]) -> _Entry:
        # A newly opened entry, used by its caller and kept open for the next reads.
        entry = _Entry(key, self.shard_path(key), fd, mapped, seen)
        with self._lock:
            old = self._live.get(key)
            self._live[key] = entry
            self._kept[key] = entry
            self._kept.move_to_end(key)
            dropped = [old] if old is not None and old is not entry else []
            while len(self._kept) > self.KEPT_OPEN:
                dropped.append(self._kept.popitem(last=False)[1])
        for old in dropped:
            self._unkeep(old)
        return entry

    def _release(self, entry: _Entry) -> None:
        """One user of ``entry`` is done; closed (its lock let go) when none is and it is no
        longer kept."""
        with self._lock:
            entry.users -= 1
            done = entry.users == 0 and not entry.kept
            if done and self._live.get(entry.key) is entry:
                del self._live[entry.key]
        if done:
            entry.close()

    def _unkeep(self, entry: _Entry) -> None:
        with self._lock:
            entry.kept = False
            if self._kept.get(entry.key) is entry:
                del self._kept[entry.key]
            done = entry.users == 0
            if done and self._live.get(entry.key) is entry:
                del self._live[entry.key]
        if done:
            entry.close()

    def let_go(self) -> None:
        """Close the shards this process keeps open between reads (those in use close when their
        readers do), so eviction may have them."""
        with self._lock:
            kept = list(self._kept.values())
        for entry in kept:
            self._unkeep(entry)

    def _intact(self, key: str, uri: str, version: str, size: int) -> Any:
        """``(map, identity)`` of entry ``key`` when its record and file are what was asked for
        and written (the whole file hashed on its first open in this process), the identity
        (inode, mtime, size) being the mapped file's own; else None."""
        found = _map_file(self.shard_path(key))
        if found is None:
            return None
        mapped, st = found  # the file mapped, whatever the path names since
        seen = (key, st.st_ino, st.st_mtime_ns, st.st_size)
        with self._lock:
            record = self._records.get(seen)  # a record is written with its shard file only
            verified = seen in self._verified
            if seen in self._damaged:  # hashed already: a reader waiting for it looks often
                return None
        if record is None:
            record = _read_json(self._record_path(key))
            wanted = {"state": "done", "uri": uri, "version": version, "size": size}
            if record is None or any(record.get(k) != v for k, v in wanted.items()):
                return None
            if seen[1:] != (record["ino"], record["mtime_ns"], size):
                return None
            with self._lock:
                self._records[seen] = record
        if not verified:
            if hashlib.sha256(mapped).hexdigest() != record["sha256"]:
                with self._lock:
                    self._damaged.add(seen)
                return None
            with self._lock:
                self._verified.add(seen)
        with contextlib.suppress(OSError):
            os.utime(self._record_path(key))  # its last use, for eviction
        return mapped, seen[1:]

    # --------------------------------------------------------------------- downloading
    def _download(self, key: str, uri: str, version: str, size: int, download: Download) -> None:
        # Under the entry's exclusive lock, with its size reserved: to the key's temporary name
        # (only that lock's holder writes it; a dead downloader's bytes there are replaced),
        # then renamed into place and recorded.
        tmp = self._partial_path(key)
        h = hashlib.sha256()
        try:
            with open(tmp, "wb") as out:

                def write(data: bytes) -> None:
                    out.write(data)
                    h.update(data)

                got = download(write)
            if got != size:
                raise FetchError(
                    f"ShardCache: {uri!r} ({version}) gave {got} bytes, {size} were expected: "
                    "the object changed while it was downloaded; build a new source"
                )
            path = self.shard_path(key)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self._drop(key)
            raise
        st = os.stat(path)
        record = {
            "state": "done",
            "uri": uri,
            "version": version,
            "size": size,
            "sha256": h.hexdigest(),
            "mtime_ns": st.st_mtime_ns,
            "ino": st.st_ino,
        }
        _write_json(self._record_path(key), record)
        with self._lock:
            self._verified.add((key, st.st_ino, st.st_mtime_ns, st.st_size))

    def _drop(self, key: str) -> int:
        """Delete entry ``key`` (its bytes and its record); the size its record gave, 0 when
        there was none."""
        record = _read_json(self._record_path(key))
        for path in (self.shard_path(key), self._record_path(key)):
            with contextlib.suppress(OSError):
                os.unlink(path)
        return 0 if record is None else int(record["size"])

    # --------------------------------------------------------------------- space
    def _reserve(self, key: str, uri: str, version: str, size: int) -> bool:
        """Room for ``size`` bytes of entry ``key`` (held exclusively), least recently used
        entries nobody holds open deleted first; False when they cannot make it."""
        with _flocked(os.path.join(self.dir, "locks", "space.lock")) as ledger:
            dropped = self._drop(key)  # a stale or damaged copy of this entry goes first
            known = _read_ledger(ledger)
            total = None if known is None else max(0, known - dropped)
            if total is None or total + size > self.max_bytes:
                total = self._make_room(key, size)
            if total + size > self.max_bytes:
                _write_ledger(ledger, total)
                return False
            # The ledger first: a process dying between the two writes leaves it high, not low.
            _write_ledger(ledger, total + size)
            reservation = {"state": "downloading", "uri": uri, "version": version, "size": size}
            _write_json(self._record_path(key), reservation)
            return True

    def _make_room(self, key: str, size: int) -> int:
        """Under the space lock, with entry ``key`` dropped: the bytes every entry and
        reservation holds, once least recently used entries nobody holds open are deleted for
        ``size`` more bytes (down to ``EVICT_TO`` of ``max_bytes`` when there is anything to
        delete), as far as they can be."""
        entries = sorted(self._entries(), key=lambda e: e[1])
        total = sum(e[2] for e in entries)
        if total + size <= self.max_bytes:
            return total
        self.let_go()  # what this process keeps open but does not read may go
        goal = min(self.max_bytes, int(self.max_bytes * self.EVICT_TO))
        for other, _, other_size in entries:
            if total + size <= goal:
                break
            if other != key and self._evict(other):
                total -= other_size
        return total

    def _entries(self) -> Iterator[tuple[str, int, int]]:
        """``(key, last use, size)`` of every entry and reservation."""
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.dir):
                if not name.endswith(".json") or name.startswith("."):
                    continue
                path = os.path.join(self.dir, name)
                record = _read_json(path)
                if record is None:
                    continue
                with contextlib.suppress(OSError):
                    yield name[: -len(".json")], os.stat(path).st_mtime_ns, int(record["size"])

    def _evict(self, key: str) -> bool:
        """Delete entry ``key`` unless someone holds it (open for reading, or downloading)."""
        try:
            fd = os.open(self._lock_path(key), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        try:
            self._drop(key)
            with contextlib.suppress(OSError):
                os.unlink(self._partial_path(key))  # a dead download's bytes
        finally:
            os.close(fd)
        return True

    def cached_bytes(self) -> int:
        """Bytes of the entries (and reservations) in the directory now."""
        return sum(size for _, _, size in self._entries())

    # --------------------------------------------------------------------- read-ahead
    def prefetch(self, name: str, fetch: Callable[[], None]) -> bool:
        """Run ``fetch`` (which downloads shard ``name`` into the cache) on the read-ahead
        thread; False when it cannot be queued (``prefetch_shards`` are queued already, or the
        read-ahead is stopping). Errors are left to the read that needs the shard (it downloads
        it itself and reports them)."""
        if self.prefetch_shards <= 0:
            return False
        with self._lock:
            if name in self._queue:
                return True
            if self._stopping or len(self._queue) >= self.prefetch_shards:
                return False
            self._queue[name] = fetch
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._prefetch_loop, name="zephon-shard-prefetch", daemon=True
                )
                self._worker.start()
        return True

    def _prefetch_loop(self) -> None:
        while True:
            with self._lock:
                if not self._queue or self._stopping:
                    self._worker = None
                    return
                name, fetch = next(iter(self._queue.items()))
            try:
                fetch()
            except Exception:  # the read of this shard meets it again and reports it
                pass
            finally:
                with self._lock:
                    self._queue.pop(name, None)

    def stop_prefetch(self) -> None:
        """Drop the queued read-ahead and wait for the download under way (its own deadlines
        bound it); later announcements start the thread again."""
        with self._lock:
            self._stopping = True
            self._queue.clear()
            worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join()
        with self._lock:
            self._stopping = False

    # --------------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        return {
            "dir": self.dir,
            "max_bytes": self.max_bytes,
            "prefetch_shards": self.prefetch_shards,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def __repr__(self) -> str:
        return (
            f"ShardCache({self.dir!r}, max_bytes={self.max_bytes}, "
            f"prefetch_shards={self.prefetch_shards})"
        )


class CachedShard:
    """One remote shard opened through a ``ShardCache``: a file object (``read_at``, ``read``,
    ``seek``, ...; whatever its copy's memory map has) over its cached copy, made on first use;
    ``size()``, ``metadata()`` and ``version`` (the store version it was opened at) are known
    without it. ``hit`` is None until the copy is needed, then whether it was there already
    (False: this open downloaded it, or, ``bypassed``, read the store directly because the cache
    had no room)."""

    def __init__(
        self,
        cache: ShardCache,
        uri: str,
        version: str,
        size: int,
        download: Download,
        direct: Callable[[], Any],
        opened: Callable[[CachedShard], None] = lambda shard: None,
    ) -> None:
        self.cache = cache
        self.uri = uri
        self.version = version
        self._size = size
        self._download: Download | None = download
        self._direct = direct
        self._opened = opened
        self._file: Any = None
        self._entry: _Entry | None = None
        self.hit: bool | None = None
        self.bypassed = False
        self.closed = False

    def materialize(self) -> Any:
        """The open cached copy, downloaded first when needed (or the object opened on the store
        when the cache has no room for it)."""
        if self._file is None:
            if self.closed or self._download is None:
                raise ValueError(f"I/O operation on a closed cached shard {self.uri!r}")
            got = self.cache._acquire(self.uri, self.version, self._size, self._download)
            if got is None:
                self._file, self.hit, self.bypassed = self._direct(), False, True
            else:
                import pyarrow as pa

                self._entry, self.hit = got
                self._file = pa.BufferReader(self._entry.data)
            self._download = None
            self._opened(self)
        return self._file

    # The calls every read makes, straight to the copy (``__getattr__`` serves the rest).
    def read_at(self, nbytes: int, offset: int) -> Any:
        """``nbytes`` bytes at ``offset``, as the copy's ``read_at`` gives them."""
        return (self._file or self.materialize()).read_at(nbytes, offset)

    def read(self, nbytes: int | None = None) -> Any:
        """Up to ``nbytes`` bytes (all that is left when None) from the position."""
        return (self._file or self.materialize()).read(nbytes)

    def read_buffer(self, nbytes: int | None = None) -> Any:
        """Up to ``nbytes`` bytes from the position, as a buffer (no copy from the cache)."""
        return (self._file or self.materialize()).read_buffer(nbytes)

    def seek(self, offset: int, whence: int = 0) -> int:
        """Move the position, as the copy's ``seek`` does."""
        return int((self._file or self.materialize()).seek(offset, whence))

    def tell(self) -> int:
        """The position."""
        return int((self._file or self.materialize()).tell())

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    def size(self) -> int:
        """The shard's size in bytes."""
        return self._size

    def metadata(self) -> dict[str, str]:
        """The store version the shard was opened at (as ``Locations.version`` reads it)."""
        return {"zephon-version": self.version}

    def close(self) -> None:
        """Close the copy and let eviction have it again."""
        if self.closed:
            return
        self.closed = True
        self._download = None
        if self._file is not None:
            self._file.close()
        if self._entry is not None:
            self.cache._release(self._entry)
            self._entry = None

    def __enter__(self) -> CachedShard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class _Entry:
    """A cache entry this process has open: its lock file held shared (``fd``), the whole of its
    memory map as a buffer, and the file's identity when it was checked."""

    def __init__(
        self, key: str, path: str, fd: int, mapped: Any, seen: tuple[int, int, int]
    ) -> None:
        import pyarrow as pa

        self.key = key
        self.path = path
        self.fd = fd
        self.data = pa.py_buffer(mapped)  # the map itself, no copy
        self.seen = seen
        self.users = 1
        self.kept = True

    def unchanged(self) -> bool:
        """Whether the entry's file is still the one checked when it was opened."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_ino, st.st_mtime_ns, st.st_size) == self.seen

    def close(self) -> None:
        """Let go of the lock and of the map (unmapped once no buffer read from it is left)."""
        self.data = None
        os.close(self.fd)


# ------------------------------------------------------------------------- helpers


def _map_file(path: str) -> tuple[Any, os.stat_result] | None:
    """A read-only memory map of the file at ``path`` (``b""`` when it is empty) and the mapped
    file's ``stat``; None when it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        return (mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ) if st.st_size else b""), st
    except OSError:
        return None
    finally:
        os.close(fd)


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as fh:
            value = json.loads(fh.read())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) and isinstance(value.get("size"), int) else None


def _write_json(path: str, value: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(value, fh)
    os.replace(tmp, path)


@contextlib.contextmanager
def _flocked(path: str) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)


def _read_ledger(fd: int) -> int | None:
    """The byte count the space lock file ``fd`` holds; None when it holds none (a new cache, or
    a write cut short)."""
    text = os.pread(fd, 32, 0)
    return int(text) if text.endswith(b"\n") and text[:-1].isdigit() else None


def _write_ledger(fd: int, total: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, b"%d\n" % total, 0)
