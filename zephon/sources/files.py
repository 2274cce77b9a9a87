"""The base of file-backed sources and what they share: paths, I/O error rules, content digests
of byte ranges, and the sidecar files cached beside the data.

``FileSource`` is what ``ArrowSource`` and ``JsonlSource`` have in common: a list of files whose
samples are numbered globally, in file order, so the (seed, pass)-keyed permutation of
``IndexedSource`` shuffles over every sample of every file. Pointer rows are
``(dataset_id, file_index, global_sample_idx)``; the file index is derived from the global index
and checked again at read time. Per-file metadata is read once, lazily, on the first call that
needs it; files are opened per ``read`` call and closed before it returns, so a source holds no
file handle between reads and pickles without them.

Content identity. Each file is covered by byte ranges (Parquet column chunks and footer, Arrow
IPC messages, JSON Lines blocks of whole lines), each with a 64-bit content digest: a
``DigestTable``, computed once from the whole file (local or remote), the first time the file is
opened, and cached in a sidecar. ``describe()`` carries the sha256 of each file's table, so the
pipeline fingerprint changes when any range changes; and every range a read touches is hashed
again and compared before anything decoded from it is returned, so a file changed behind the
cache is refused, never delivered. A remote object is also pinned to the version its store gives
it (``Locations.version``) when it is first opened: its cached table is trusted for that version
only, and a read that finds another raises ``FetchError`` naming both.

Sidecars. ``<file><suffix>`` beside the file, or ``<name>.<hash of its absolute path><suffix>`` in
``index_dir``: an int64 ``.npy`` holding the file's size and mtime (a file touched since is
digested again), the length of each section and a sha256 of the sidecar itself, so a damaged
sidecar is rebuilt instead of trusted. When it cannot be written it lives in memory only. A file's
identity never includes its mtime or path: a copied dataset keeps its fingerprint.

Error rules, shared by every file source: a missing or unreadable file, a file that is malformed or
truncated, and a file that changed since its metadata was read raise ``FetchError`` naming the path
(and the pointer and block when known); any other ``OSError`` (a transient I/O failure) is raised
as an ``OSError`` naming the path, so that ``fetch`` retries it with backoff.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import itertools
import json
import os
import posixpath
import tempfile
import threading
import tokenize
from abc import abstractmethod
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any, TypedDict

import numpy as np

from zephon._core.pointers import index_rows
from zephon.errors import FetchError
from zephon.sources.base import IndexedSource, check_int, check_pointers
from zephon.sources.locations import DataFile, default_cache_dir, local_path, parse_locations
from zephon.sources.remote import RetryPolicy, is_transient, parallel_map, with_retries
from zephon.sources.shard_cache import CachedShard, ShardCache
from zephon.sources.source_io import CountedFile, IOCounters, open_through_cache
from zephon.validation import check_seconds

__all__ = [
    "PERMANENT_ERRNOS",
    "DigestTable",
    "FileSource",
    "PathsArg",
    "content_digest",
    "digest_ranges",
    "is_permanent",
    "load_sidecar",
    "read_sidecar",
    "section_text",
    "text_section",
    "transient_error",
    "write_sidecar",
]


#: errno values that no retry can fix: raised as FetchError instead of a retryable OSError.
PERMANENT_ERRNOS = frozenset(
    {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG}
)

PathsArg = str | os.PathLike[str] | Iterable[str | os.PathLike[str]]

#: ``read_at(offset, nbytes)``: up to ``nbytes`` bytes (any bytes-like) from ``offset`` of a file.
ReadAt = Callable[[int, int], Any]


def is_permanent(exc: OSError) -> bool:
    """True when an ``OSError`` cannot be cured by retrying: a missing or forbidden file, or an
    error without ``errno`` (pyarrow reports format errors, e.g. a bad Parquet page, that way)."""
    return exc.errno is None or exc.errno in PERMANENT_ERRNOS


def transient_error(exc: OSError, path: str, where: str) -> OSError:
    """A retryable ``OSError`` with ``exc``'s errno whose message names ``path`` and ``where``."""
    return OSError(exc.errno, f"{exc.strerror or exc} ({where})", path)


# ------------------------------------------------------------------------- content digests

#: Largest read made while digesting; a longer range is hashed piece by piece.
DIGEST_PIECE = 8 << 20


def content_digest(data: Any) -> int:
    """The 64-bit content digest of a bytes-like object (the first 8 bytes of its sha256, as a
    signed int64): what a ``DigestTable`` stores for each range."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little", signed=True)


def digest_ranges(
    read_at: ReadAt, starts: Sequence[int], lengths: Sequence[int], piece: int = DIGEST_PIECE
) -> np.ndarray:
    """Digests (int64) of the sorted, non-overlapping byte ranges ``[start, start + length)``,
    read through ``read_at`` at most ``piece`` bytes at a time (neighbouring small ranges share a
    read), so memory stays bounded whatever the ranges. EOFError when the file ends too soon."""
    begin = [int(v) for v in starts]
    size = [int(v) for v in lengths]
    out = np.empty(len(begin), dtype=np.int64)
    k = 0
    while k < len(begin):
        a = begin[k]
        if size[k] > piece:
            h = hashlib.sha256()
            for at in range(a, a + size[k], piece):
                want = min(piece, a + size[k] - at)
                buf = read_at(at, want)
                if len(buf) != want:
                    raise EOFError(f"the file ends inside bytes {a}..{a + size[k]}")
                h.update(buf)
            out[k] = int.from_bytes(h.digest()[:8], "little", signed=True)
            k += 1
            continue
        m = k + 1
        while m < len(begin) and begin[m] + size[m] - a <= piece:
            m += 1
        end = begin[m - 1] + size[m - 1]
        buf = memoryview(read_at(a, end - a))
        if len(buf) != end - a:
            raise EOFError(f"the file ends inside bytes {a}..{end}")
        for j in range(k, m):
            lo = begin[j] - a
            out[j] = content_digest(buf[lo : lo + size[j]])
        k = m
    return out


class DigestTable:
    """Byte ranges of one file with the content digest of each: what a file source checks every
    range it reads against, and (through ``identity``) what ``describe()`` says of the file.

    Invariant: the three arrays have one entry per range; ranges are non-empty, sorted by start
    and do not overlap.
    """

    __slots__ = ("digests", "lengths", "starts")

    def __init__(self, starts: Any, lengths: Any, digests: Any):
        self.starts = np.asarray(starts, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.digests = np.asarray(digests, dtype=np.int64)

    @classmethod
    def build(cls, read_at: ReadAt, starts: Any, lengths: Any) -> DigestTable:
        """The table of these ranges, digested now through ``read_at`` (see ``digest_ranges``)."""
        return cls(starts, lengths, digest_ranges(read_at, starts, lengths))

    def __len__(self) -> int:
        return len(self.starts)

    def span(self, k: int) -> tuple[int, int]:
        """``(start, end)`` of range ``k``."""
        start = int(self.starts[k])
        return start, start + int(self.lengths[k])

    def find(self, offset: int) -> int:
        """The index of the range holding byte ``offset``, or -1."""
        k = int(np.searchsorted(self.starts, offset, side="right")) - 1
        if k < 0 or offset >= self.starts[k] + self.lengths[k]:
            return -1
        return k

    def overlapping(self, start: int, end: int) -> range:
        """Indices of the ranges that intersect bytes ``[start, end)``, in file order."""
        lo = int(np.searchsorted(self.starts, start, side="right")) - 1
        if lo < 0 or self.starts[lo] + self.lengths[lo] <= start:
            lo += 1
        return range(lo, int(np.searchsorted(self.starts, end, side="left")))

    def matches(self, k: int, data: Any) -> bool:
        """True when ``data`` is the content range ``k`` had when the table was built."""
        return len(data) == int(self.lengths[k]) and content_digest(data) == int(self.digests[k])

    def is_well_formed(self, size: int) -> bool:
        """True when the ranges are non-empty, sorted, disjoint and inside a file of ``size``."""
        n = len(self.starts)
        if len(self.lengths) != n or len(self.digests) != n:
            return False
        if n == 0:
            return True
        ends = self.starts + self.lengths
        return bool(
            (self.lengths > 0).all()
            and self.starts[0] >= 0
            and ends[-1] <= size
            and (self.starts[1:] >= ends[:-1]).all()
        )

    def identity(self) -> str:
        """The sha256 (hex) of the whole table, ranges and digests: equal for equal content in
        every process and on every machine (no path, no mtime)."""
        h = hashlib.sha256(b"zephon digest table 1")
        h.update(len(self).to_bytes(8, "little"))
        for arr in (self.starts, self.lengths, self.digests):
            h.update(np.ascontiguousarray(arr, dtype="<i8").tobytes())
        return h.hexdigest()

    def sections(self) -> list[np.ndarray]:
        """The three arrays, as a sidecar stores them."""
        return [self.starts, self.lengths, self.digests]


def text_section(value: Any) -> np.ndarray:
    """JSON data as an int64 sidecar section (its text, padded with spaces)."""
    text = json.dumps(value).encode()
    return np.frombuffer(text + b" " * (-len(text) % 8), dtype=np.int64)


def section_text(section: np.ndarray) -> Any:
    """The JSON data a ``text_section`` holds; ValueError when it holds none."""
    try:
        return json.loads(np.asarray(section).tobytes().decode())
    except (UnicodeDecodeError, TypeError) as exc:
        raise ValueError(str(exc)) from None


# ------------------------------------------------------------------------- sidecars

_SIDECAR_VERSION = 1
_FIXED_HEADER = 5  # magic, version, file size, file mtime_ns, number of sections
_CHECKSUM_WORDS = 4  # the sidecar's own sha256, as four int64 words
_MAX_SECTIONS = 64


def _magic(tag: bytes) -> int:
    return int.from_bytes(tag, "little", signed=True)


def write_sidecar(
    where: str, tag: bytes, size: int, mtime_ns: int, sections: Sequence[np.ndarray]
) -> str | None:
    """Write ``sections`` (int64 arrays) for a file of this size and mtime, atomically (temp file,
    rename); the location, or None when it cannot be written (a read-only directory)."""
    head = [_magic(tag), _SIDECAR_VERSION, size, mtime_ns, len(sections)]
    head += [len(s) for s in sections]
    header = np.array(head, dtype=np.int64)
    body = np.concatenate([np.asarray(s, dtype=np.int64) for s in sections] or [header[:0]])
    checksum = hashlib.sha256(header.tobytes())
    checksum.update(body.tobytes())
    words = np.frombuffer(checksum.digest(), dtype=np.int64)
    directory = os.path.dirname(os.path.abspath(where))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".zephon-", dir=directory)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "wb") as fh:
            np.save(fh, np.concatenate((header, words, body)), allow_pickle=False)
        os.replace(tmp, where)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return None
    return where


def read_sidecar(where: str, tag: bytes, size: int, mtime_ns: int) -> list[np.ndarray] | None:
    """The sections (memory-mapped int64 arrays) stored at ``where`` when it exists, is intact
    (its checksum matches) and was written for a file of this size and mtime; None otherwise, and
    the caller rebuilds it."""
    found = load_sidecar(where, tag, size)
    if found is None or found[1] != mtime_ns:
        return None
    return found[0]


def load_sidecar(where: str, tag: bytes, size: int) -> tuple[list[np.ndarray], int] | None:
    """``(sections, mtime_ns it was written for)`` of an intact sidecar at ``where`` written for a
    file of this size, whatever its mtime; None otherwise."""
    try:
        arr = np.load(where, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError, SyntaxError, tokenize.TokenError):
        return None  # absent, or not a .npy: numpy parses a damaged header as Python literals
    if arr.dtype != np.int64 or arr.ndim != 1 or arr.size < _FIXED_HEADER:
        return None
    magic, version, isize, imtime, k = (int(v) for v in arr[:_FIXED_HEADER])
    if (magic, version, isize) != (_magic(tag), _SIDECAR_VERSION, size):
        return None
    if not 0 <= k <= _MAX_SECTIONS or arr.size < _FIXED_HEADER + k + _CHECKSUM_WORDS:
        return None
    lengths = [int(v) for v in arr[_FIXED_HEADER : _FIXED_HEADER + k]]
    body_at = _FIXED_HEADER + k + _CHECKSUM_WORDS
    if min(lengths, default=0) < 0 or sum(lengths) != arr.size - body_at:
        return None
    checksum = hashlib.sha256(np.asarray(arr[: _FIXED_HEADER + k]).tobytes())
    checksum.update(memoryview(arr[body_at:]))
    if checksum.digest() != np.asarray(arr[_FIXED_HEADER + k : body_at]).tobytes():
        return None
    bounds = np.cumsum([body_at, *lengths])
    # Plain ndarray views of the map: np.memmap indexes through Python, a cost on every lookup.
    return [arr[a:b].view(np.ndarray) for a, b in itertools.pairwise(bounds)], imtime


# ------------------------------------------------------------------------- the base


def changed_since(pinned: str, now: str) -> str:
    """What a read says of an object found at version ``now`` after its source pinned
    ``pinned``."""
    return (
        f"the object changed since it was first listed ({pinned} then, {now} now); build a new "
        "source (its fingerprint will differ from old checkpoints if its content did)"
    )


class FileOptions(TypedDict, total=False):
    """The options every file source takes beside its paths, passed on to ``FileSource``
    (defaults there): ``dataset_id``, chunking (``chunk_size``, ``shuffle``, ``seed``,
    ``passes``), where metadata is cached (``index_dir``, ``cache_dir``), the storage
    (``filesystem``, ``threads`` for parallel metadata reads), its deadlines (``timeout`` a
    request, ``total_timeout`` all attempts of one operation) and the node-local ``cache`` of
    whole remote shards (a ``ShardCache``)."""

    dataset_id: int
    chunk_size: int
    shuffle: bool
    seed: int
    passes: int | None
    index_dir: str | os.PathLike[str] | None
    filesystem: Any
    cache_dir: str | os.PathLike[str] | None
    threads: int
    timeout: float
    total_timeout: float
    cache: ShardCache | None


class FileSource(IndexedSource):
    """Base of sources over a list of files: ``shard_id`` is the file index in the resolved file
    list and ``sample_idx`` the global sample index across all files, in file order.

    ``paths`` is anything ``zephon.sources.locations`` resolves (paths, URIs, directories, globs,
    a list of them); ``filesystem`` a ``pyarrow.fs.FileSystem`` or an fsspec filesystem to read
    them from. Nothing is listed or opened before the metadata is first needed.

    Invariant: after ``load_metadata()`` the per-file sample counts are fixed for the life of the
    source; a read that finds a file changed since then raises ``FetchError`` rather than returning
    different or fewer samples. Subclasses implement ``load_metadata`` (returning the sample count
    of each file) and ``read_file``. ``index_dir`` is where their sidecars go (None: beside each
    local file, or in ``cache_dir`` when that place is not writable or the data is remote).

    Remote data: ``timeout`` seconds at most for one request, ``total_timeout`` for every
    attempt of one operation (a listing, a file's metadata, a file's part of a read) together;
    past them, ``FetchError`` naming the URI, the operation and the time waited. With ``cache``
    (a ``ShardCache``) each remote file is downloaded whole into it once and read from there
    (see ``open_random``); its ``prefetch_shards`` downloads the files of the chunks a lane
    reads next in the background (see ``upcoming``).
    """

    #: File name endings a directory listing keeps (a glob keeps whatever it matches).
    SUFFIXES: tuple[str, ...] = ()
    #: Retries of remote reads and metadata (transient errors only; see ``zephon.sources.remote``);
    #: its deadlines are replaced by the source's ``timeout`` and ``total_timeout``.
    RETRY_POLICY = RetryPolicy()
    #: Chunks ahead of the one read that a lane announces when the cache prefetches.
    READ_AHEAD_CHUNKS = 8
    #: Announced chunk positions remembered, so a chunk announced again is not built again.
    SCANNED_CHUNKS = 256

    def __init__(
        self,
        paths: PathsArg,
        *,
        dataset_id: int = 0,
        chunk_size: int = 1024,
        shuffle: bool = False,
        seed: int = 0,
        passes: int | None = 1,
        index_dir: str | os.PathLike[str] | None = None,
        filesystem: Any = None,
        cache_dir: str | os.PathLike[str] | None = None,
        threads: int = 16,
        timeout: float = RetryPolicy.timeout,
        total_timeout: float = RetryPolicy.total_timeout,
        cache: ShardCache | None = None,
    ) -> None:
        name = type(self).__name__
        timeout = check_seconds(timeout, "timeout", name)
        total_timeout = check_seconds(total_timeout, "total_timeout", name)
        if total_timeout < timeout:
            raise ValueError(
                f"{name}: total_timeout={total_timeout:g} is shorter than timeout={timeout:g} "
                "(one request's deadline): it would leave no request its time"
            )
        self.retry_policy = dataclasses.replace(
            self.RETRY_POLICY, timeout=timeout, total_timeout=total_timeout
        )
        self._locations = parse_locations(paths, filesystem, name, timeout)
        for arg, value in (("index_dir", index_dir), ("cache_dir", cache_dir)):
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise TypeError(f"{name}: {arg} must be a path or None, got {value!r}")
        self.index_dir = None if index_dir is None else local_path(index_dir, name, "index_dir")
        self.cache_dir = None if cache_dir is None else local_path(cache_dir, name, "cache_dir")
        self.threads = check_int(threads, "threads", name, minimum=1)
        if cache is not None and not isinstance(cache, ShardCache):
            raise TypeError(
                f"{name}: cache must be a zephon.sources.ShardCache or None, got {cache!r}"
            )
        self.cache = cache
        self.io = IOCounters()
        self._announced: set[int] = set()  # files handed to the cache's read-ahead
        self._scanned: dict[int, None] = {}  # chunk positions whose files were all announced
        self._pinned: dict[str, tuple[str, int]] = {}  # path -> (version, size) at first open
        super().__init__(
            dataset_id=dataset_id, chunk_size=chunk_size, shuffle=shuffle, seed=seed, passes=passes
        )
        self._lock = threading.RLock()
        self._ends: np.ndarray | None = None
        self._files: list[DataFile] | None = None
        self._root = ""

    # --------------------------------------------------------------------- locations
    @property
    def is_local(self) -> bool:
        """True when the files are on the local filesystem."""
        return self._locations.is_local

    @property
    def filesystem(self) -> Any:
        """The ``pyarrow.fs.FileSystem`` the files are read from."""
        return self._locations.filesystem

    def files(self) -> list[DataFile]:
        """The resolved files, in source order (lists directories and globs on first use)."""
        files = self._files
        if files is None:
            with self._lock:
                if self._files is None:
                    self._root, self._files = self.list_files()
                files = self._files
        return files

    def list_files(self) -> tuple[str, list[DataFile]]:
        """The dataset root and its files, in source order: the listing ``files()`` keeps.
        A format whose files are named by an index (MDS's ``index.json``) overrides it."""
        locations = self._locations

        def run(fn: Callable[[str], Any], paths: list[str]) -> list[Any]:
            return self.parallel(fn, paths)

        def resolve() -> tuple[str, list[DataFile]]:
            try:
                return locations.resolve(self.SUFFIXES, run)
            except OSError as exc:
                if not self.is_local and is_transient(exc):
                    raise
                raise FetchError(
                    f"{type(self).__name__} cannot list {locations.items}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc

        files: tuple[str, list[DataFile]] = self.with_retries(
            resolve, lambda: f"{type(self).__name__} listing {locations.items}"
        )
        return files

    @property
    def paths(self) -> list[str]:
        """Each file as messages name it: its local path, or its URI."""
        return [f.uri for f in self.files()]

    @property
    def names(self) -> list[str]:
        """Each file's path relative to the dataset root: what the fingerprint records."""
        return [f.name for f in self.files()]

    @property
    def root(self) -> str:
        """The dataset root (a local path or a URI) the names are relative to."""
        self.files()
        return self._root

    def indexed(self, i: int, load: Callable[[int], Any]) -> Any:
        """``load(i)``, the layout of file ``i``, retried as ``with_retries`` does; what fails
        past the budget says this source cannot index the file."""
        return self.with_retries(
            lambda: load(i), lambda: f"{type(self).__name__} cannot index {self.paths[i]!r}"
        )

    def index_every_file(self, load: Callable[[int], Any]) -> list[Any]:
        """``indexed(i, load)`` of every file, in ``paths`` order (in parallel for remote
        data)."""
        return self.parallel(partial(self.indexed, load=load), range(len(self.files())))

    def with_retries(self, fn: Callable[[], Any], what: Callable[[], str]) -> Any:
        """``fn()`` retried on transient errors when the data is remote (local errors are left to
        ``fetch``'s own retries, see ``os_error``)."""
        if self.is_local:
            return fn()
        return with_retries(fn, what, self.retry_policy)

    def read_retried(self, i: int, fn: Callable[[], Any]) -> Any:
        """``fn()``, a read of file ``i``, retried as ``with_retries`` does; what fails past the
        budget says this source cannot read the file."""
        return self.with_retries(fn, lambda: f"{type(self).__name__} cannot read {self.paths[i]!r}")

    def parallel(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        """``[fn(x) for x in items]`` on at most ``threads`` threads for remote data (joined
        before returning); in order, one at a time, for local files."""
        return parallel_map(fn, items, 1 if self.is_local else self.threads)

    # --------------------------------------------------------------------- metadata
    @abstractmethod
    def load_metadata(self) -> Sequence[int]:
        """Read each file's metadata (footers, line index, digests) and return its sample count,
        in ``paths`` order. Called once, under the source's lock."""

    def file_ends(self) -> np.ndarray:
        """Cumulative sample counts per file (int64): file ``i`` holds global samples
        ``[ends[i-1], ends[i])``. Loads the metadata on first use."""
        ends = self._ends
        if ends is None:
            self.files()
            with self._lock:
                if self._ends is None:
                    counts = np.asarray(self.load_metadata(), dtype=np.int64)
                    self._ends = np.cumsum(counts, dtype=np.int64)
                ends = self._ends
        return ends

    def num_samples(self) -> int:
        """Samples per pass: the total over all files (reads the metadata on first use)."""
        return int(self.file_ends()[-1])

    def sidecar_path(self, file_index: int, suffix: str) -> str:
        """Where a sidecar of file ``file_index`` is kept: ``<file><suffix>`` beside a local file,
        else ``<name>.<hash of its absolute path or URI><suffix>`` in ``index_dir``, or in this
        dataset's directory of the cache (remote data)."""
        f = self.files()[file_index]
        if self.index_dir is None and self.is_local:
            return f.path + suffix
        return self.cache_sidecar_path(file_index, suffix)

    def cache_sidecar_path(self, file_index: int, suffix: str) -> str:
        """The sidecar's place away from the data: in ``index_dir``, else in the cache directory
        (``cache_dir``, ``$ZEPHON_CACHE_DIR`` or ``~/.cache/zephon``) under a directory named
        after the dataset root, created when missing."""
        f = self.files()[file_index]
        key = hashlib.sha256(os.fsencode(f.uri)).hexdigest()[:16]
        base = f"{posixpath.basename(f.path)}.{key}{suffix}"
        if self.index_dir is not None:
            return os.path.join(self.index_dir, base)
        root_key = hashlib.sha256(f"{type(self).__name__} {self.root}".encode()).hexdigest()[:20]
        where = os.path.join(self.cache_dir or default_cache_dir(), "metadata", root_key)
        with contextlib.suppress(OSError):
            os.makedirs(where, exist_ok=True)
        return os.path.join(where, base)

    def store_sidecar(
        self, file_index: int, suffix: str, tag: bytes, size: int, mtime_ns: int, sections: Any
    ) -> str | None:
        """Write a sidecar where ``sidecar_path`` says, or in the cache directory when that place
        is not writable (a read-only data directory); the location, or None (memory only)."""
        where = self.sidecar_path(file_index, suffix)
        stored = write_sidecar(where, tag, size, mtime_ns, sections)
        if stored is None and self.index_dir is None and self.is_local:
            stored = write_sidecar(
                self.cache_sidecar_path(file_index, suffix), tag, size, mtime_ns, sections
            )
        return stored

    def sidecar_candidates(self, file_index: int, suffix: str) -> list[str]:
        """Where a stored sidecar of the file may be: its place, then the cache fallback."""
        first = self.sidecar_path(file_index, suffix)
        if self.index_dir is None and self.is_local:
            return [first, self.cache_sidecar_path(file_index, suffix)]
        return [first]

    def pointer_rows(self, sample_indices: np.ndarray) -> np.ndarray:
        """Pointer rows ``(dataset_id, file_index, global_sample_idx)`` of global sample indices."""
        idx = np.asarray(sample_indices, dtype=np.int64).ravel()
        rows = index_rows(self.dataset_id, idx)
        rows[:, 1] = np.searchsorted(self.file_ends(), idx, side="right")
        return rows

    def read(self, pointers: np.ndarray) -> list[Any]:
        """Payloads of the pointer rows, in row order; each file is visited once, its rows in
        order, through the subclass's ``read_file``."""
        rows, files, local = self.locate(pointers)
        out: list[Any] = [None] * len(rows)
        order = np.lexsort((local, files))
        bounds = np.flatnonzero(np.diff(files[order])) + 1
        for group in np.split(order, bounds):
            if group.size:
                self.read_file(int(files[group[0]]), group, rows, local, out)
        return out

    @abstractmethod
    def read_file(
        self,
        i: int,
        positions: np.ndarray,
        rows: np.ndarray,
        local: np.ndarray,
        out: list[Any],
    ) -> None:
        """Fill ``out[positions]`` from file ``i`` (rows ``local[positions]`` within it)."""

    def locate(self, pointers: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Validated ``(rows, file_index, index_within_file)`` of pointer rows; a row this source
        did not produce (wrong dataset, sample out of range, file index not matching the sample)
        raises FetchError naming the pointer."""
        rows = check_pointers(pointers, self)
        idx = self._sample_indices(rows)
        ends = self.file_ends()
        files = np.searchsorted(ends, idx, side="right")
        bad = files != rows[:, 1]
        if bad.any():
            row = rows[np.flatnonzero(bad)[0]]
            raise FetchError(
                f"{self!r} cannot read pointer {tuple(row.tolist())}: sample "
                f"{int(row[2])} lives in file #{int(files[np.flatnonzero(bad)[0]])}, not in file "
                f"#{int(row[1])}; route pointers to the source that produced them"
            )
        starts = np.concatenate(([0], ends[:-1]))
        return rows, files, idx - starts[files]

    def origin(self, pointer: np.ndarray) -> dict[str, Any]:
        """The file of the pointer row's sample and the sample's place in it (from 0)."""
        _, files, local = self.locate(np.asarray(pointer, dtype=np.int64).reshape(1, 3))
        return {"file": self.paths[int(files[0])], "sample_in_file": int(local[0])}

    def object_version(self, file_index: int, opened: Any) -> str:
        """The store's version of file ``file_index`` (``opened``: a file just opened on it),
        ``""`` when local or when the store gives none; see ``Locations.version``."""
        if isinstance(opened, CachedShard):
            return opened.version
        return self._locations.version(self.files()[file_index].path, opened)

    # --------------------------------------------------------------------- opening data
    def open_random(self, path: str) -> Any:
        """``path`` (on the source's filesystem) opened for random access, where every format
        opens its data: a memory map for local files; for remote ones the object on the store,
        counting the bytes read (``io``), or with ``cache`` its cached copy (a ``CachedShard``,
        fetched whole on its first read). With a cache, the object's version and size are asked
        of the store at its first open only and pinned: later opens of a cached copy of that
        version make no request, and one that has to fetch it again refuses another version
        (``FetchError`` naming both). An object the store names no version of is read from the
        store, uncached."""
        locations = self._locations
        if self.is_local:
            return locations.open_random(path)
        cache = self.cache
        pinned = self._pinned.get(path)
        if cache is None or pinned is None:
            remote = CountedFile(locations.open_random(path), self.io)
            if cache is None:
                return remote
            try:
                found = (locations.version(path, remote), remote.size())
            except BaseException:
                remote.close()
                raise
            if not found[0]:
                return remote  # nothing would tell a rewrite from the copy: read it uncached
            remote.close()  # a hit reads nothing more from the store
            pinned = self._pinned[path] = found
        version, size = pinned
        uri = locations.uri(path)

        def reopen() -> CountedFile:
            f = CountedFile(locations.open_random(path), self.io)
            now = locations.version(path, f)
            if now != version:
                f.close()
                raise FetchError(
                    f"{type(self).__name__} cannot read {uri!r}: {changed_since(version, now)}"
                )
            return f

        return open_through_cache(cache, uri, version, size, reopen, self.io)

    def data_paths(self, file_index: int) -> list[str]:
        """The paths a read of file ``file_index`` opens (what read-ahead fetches): the file
        itself, unless a format keeps its data beside it."""
        return [self.files()[file_index].path]

    def read_ahead_chunks(self) -> int:
        """How many chunks ahead a lane announces (``upcoming``): with a cache that prefetches,
        ``READ_AHEAD_CHUNKS``; else 0."""
        cache = self.cache
        if cache is None or cache.prefetch_shards <= 0 or self.is_local:
            return 0
        return self.READ_AHEAD_CHUNKS

    def upcoming(self, positions: Sequence[int]) -> None:
        """Have the cache download, in the background, the files the chunks at ``positions``
        read (see ``read_ahead``)."""
        if not self.read_ahead_chunks():
            return
        total = self.total_chunks()
        for p in positions:
            if p < 0 or (total is not None and p >= total) or p in self._scanned:
                continue
            if not self.read_ahead(self.chunk(p).pointers):
                return  # the queue is full: the rest is announced again by later chunks
            self._scanned[p] = None
            while len(self._scanned) > self.SCANNED_CHUNKS:
                self._scanned.pop(next(iter(self._scanned)))

    def read_ahead(self, pointers: np.ndarray) -> bool:
        """Queue the background download of the files these pointer rows read that the cache
        was not asked for yet; False when its queue (``prefetch_shards``) is full."""
        cache = self.cache
        if cache is None or cache.prefetch_shards <= 0 or self.is_local:
            return True
        for i in np.unique(pointers[:, 1]).tolist():
            if i in self._announced:
                continue
            for path in self.data_paths(i):
                if not cache.prefetch(self._locations.uri(path), partial(self._fetch_ahead, path)):
                    return False
            self._announced.add(i)
        return True

    def _fetch_ahead(self, path: str) -> None:
        # On the read-ahead thread: the file's cached copy made (retried like a read).
        def fetch() -> None:
            with self.open_random(path) as f:
                if isinstance(f, CachedShard):
                    f.materialize()

        self.with_retries(fetch, lambda: f"{type(self).__name__} fetching {path!r} ahead")

    def io_counters(self) -> dict[str, dict[str, int]]:
        """Bytes read from remote storage and shard cache hits and misses by this copy of the
        source since it was made (a copy unpickled in a worker counts its own), under the
        dataset root; nothing before anything was read."""
        counts = self.io.as_dict()
        if not any(counts.values()):
            return {}
        return {self._root or self._locations.items[0]: counts}

    def drop_read_caches(self) -> None:
        """Stop the cache's read-ahead (what was queued is dropped) and close the shards it
        keeps open between reads; formats forget more."""
        if self.cache is not None:
            self.cache.stop_prefetch()
            self.cache.let_go()
        self._announced.clear()
        self._scanned.clear()

    def cache_can_tell(self, file_index: int, version: str) -> bool:
        """Whether a cached entry can stand for file ``file_index``: the listing gives its mtime
        or the store a ``version``, so a rewrite would show. A store that gives neither
        (``memory://``) has its files digested again by every new source."""
        return bool(version) or self.files()[file_index].mtime_ns is not None

    def check_version(
        self, file_index: int, opened: Any, pinned: str, pointer: np.ndarray | None = None
    ) -> None:
        """FetchError naming the file and both versions when the object just ``opened`` is no
        longer the version ``pinned`` when its metadata was read."""
        now = self.object_version(file_index, opened)
        if now != pinned:
            raise self.fetch_error(file_index, changed_since(pinned, now), pointer)

    # --------------------------------------------------------------------- errors
    def fetch_error(
        self, file_index: int, message: str, pointer: np.ndarray | None = None
    ) -> FetchError:
        """A FetchError naming the source, the file's path and (when given) the pointer row."""
        at = f" pointer {tuple(int(v) for v in pointer)}" if pointer is not None else ""
        return FetchError(
            f"{type(self).__name__} cannot read{at} from {self.paths[file_index]!r}: {message}"
        )

    def os_error(
        self, exc: OSError, file_index: int, pointer: np.ndarray | None = None
    ) -> Exception:
        """What to raise for an ``OSError`` met while reading file ``file_index``: FetchError for
        permanent ones (see ``is_permanent``), else a retryable OSError naming path and pointer.
        Remote data: a transient error (``zephon.sources.remote.is_transient``) is returned as it
        is, for ``with_retries`` to try again; every other one is a FetchError."""
        if not self.is_local:
            if is_transient(exc):
                return exc
            return self.fetch_error(file_index, f"{type(exc).__name__}: {exc}", pointer)
        if is_permanent(exc):
            return self.fetch_error(file_index, f"{type(exc).__name__}: {exc}", pointer)
        at = f"pointer {tuple(int(v) for v in pointer)}" if pointer is not None else "metadata"
        return transient_error(exc, self.paths[file_index], f"{type(self).__name__} {at}")

    # --------------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._announced = set()
        self._scanned = {}

    def describe_files(self) -> dict[str, Any]:
        """The part of ``describe()`` every file source shares; formats add their own keys."""
        # No root, scheme or absolute path: the same files elsewhere keep the fingerprint.
        return self._describe_base()

    def __repr__(self) -> str:
        # Never loads metadata: a repr inside a metadata error must not recurse into the load.
        items = self._locations.items
        first = items[0]
        more = f" + {len(items) - 1} more" if len(items) > 1 else ""
        return (
            f"{type(self).__name__}([{first!r}{more}], dataset_id={self.dataset_id}, "
            f"chunk_size={self.chunk_size}, shuffle={self.shuffle}, seed={self.seed}, "
            f"passes={self.passes})"
        )
