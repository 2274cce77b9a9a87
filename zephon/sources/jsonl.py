"""File-backed sources: the shared ``FileSource`` base, and ``JsonlSource`` over JSON Lines files.

``FileSource`` is what ``ArrowSource`` and ``JsonlSource`` have in common: a list of files whose
samples are numbered globally, in file order, so the (seed, pass)-keyed permutation of
``IndexedSource`` shuffles over every sample of every file. Pointer rows are
``(dataset_id, file_index, global_sample_idx)``; the file index is derived from the global index
and checked again at read time. Per-file metadata (row or line counts) is read once, lazily, on
the first call that needs it; files are opened per ``read`` call and closed before it returns, so
a source holds no file handle between reads and pickles without them.

Error rules, shared by every file source (SPEC §1.4): a missing or unreadable file, a file that is
malformed or truncated, and a file that changed since its metadata was read raise ``FetchError``
naming the path and the pointer; any other ``OSError`` (a transient I/O failure) is raised as an
``OSError`` naming the path, so that ``fetch`` retries it with backoff.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import tempfile
import threading
from abc import abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from zephon.errors import FetchError
from zephon.sources.base import IndexedSource, check_pointers

__all__ = ["FileSource", "JsonlSource", "scan_line_starts"]

#: errno values that no retry can fix: raised as FetchError instead of a retryable OSError.
PERMANENT_ERRNOS = frozenset(
    {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG}
)

PathsArg = str | os.PathLike[str] | Iterable[str | os.PathLike[str]]


def normalize_paths(paths: PathsArg, owner: str) -> list[str]:
    """``paths`` (one path or an iterable of paths) as a non-empty list of ``str``; TypeError or
    ValueError naming ``owner`` otherwise."""
    if isinstance(paths, (str, os.PathLike)):
        items: list[Any] = [paths]
    elif isinstance(paths, bytes):
        raise TypeError(f"{owner}: paths must be str or os.PathLike, got bytes {paths!r}")
    else:
        try:
            items = list(paths)
        except TypeError:
            raise TypeError(f"{owner}: paths must be a path or an iterable of paths") from None
    out = []
    for p in items:
        if not isinstance(p, (str, os.PathLike)):
            raise TypeError(f"{owner}: every path must be str or os.PathLike, got {p!r}")
        out.append(os.fspath(p))
    if not out:
        raise ValueError(f"{owner}: paths is empty (did a glob match nothing?)")
    return out


def is_permanent(exc: OSError) -> bool:
    """True when an ``OSError`` cannot be cured by retrying: a missing or forbidden file, or an
    error without ``errno`` (pyarrow reports format errors, e.g. a bad Parquet page, that way)."""
    return exc.errno is None or exc.errno in PERMANENT_ERRNOS


def transient_error(exc: OSError, path: str, where: str) -> OSError:
    """A retryable ``OSError`` with ``exc``'s errno whose message names ``path`` and ``where``."""
    err = OSError(exc.errno, f"{exc.strerror or exc} ({where})", path)
    return err


class FileSource(IndexedSource):
    """Base of sources over a list of files: ``shard_id`` is the file index in ``paths`` and
    ``sample_idx`` the global sample index across all files, in file order.

    Invariant: after ``load_metadata()`` the per-file sample counts are fixed for the life of the
    source; a read that finds a file changed since then raises ``FetchError`` rather than returning
    different or fewer samples. Subclasses implement ``load_metadata`` (returning the sample count
    of each file) and ``_read_file``.
    """

    def __init__(
        self,
        paths: PathsArg,
        *,
        dataset_id: int = 0,
        chunk_size: int = 1024,
        shuffle: bool = False,
        seed: int = 0,
        passes: int | None = 1,
    ) -> None:
        self.paths = normalize_paths(paths, type(self).__name__)
        super().__init__(
            dataset_id=dataset_id, chunk_size=chunk_size, shuffle=shuffle, seed=seed, passes=passes
        )
        self._lock = threading.RLock()
        self._ends: np.ndarray | None = None

    # --------------------------------------------------------------------- metadata
    @abstractmethod
    def load_metadata(self) -> Sequence[int]:
        """Read each file's metadata (footers, line index) and return its sample count, in
        ``paths`` order. Called once, under the source's lock."""

    def file_ends(self) -> np.ndarray:
        """Cumulative sample counts per file (int64): file ``i`` holds global samples
        ``[ends[i-1], ends[i])``. Loads the metadata on first use."""
        ends = self._ends
        if ends is None:
            with self._lock:
                if self._ends is None:
                    counts = np.asarray(self.load_metadata(), dtype=np.int64)
                    self._ends = np.cumsum(counts, dtype=np.int64)
                ends = self._ends
        return ends

    def num_samples(self) -> int:
        """Samples per pass: the total over all files (reads the metadata on first use)."""
        return int(self.file_ends()[-1])

    def pointer_rows(self, sample_indices: np.ndarray) -> np.ndarray:
        """Pointer rows ``(dataset_id, file_index, global_sample_idx)`` of global sample indices."""
        idx = np.asarray(sample_indices, dtype=np.int64).ravel()
        rows = np.empty((idx.size, 3), dtype=np.int64)
        rows[:, 0] = self.dataset_id
        rows[:, 1] = np.searchsorted(self.file_ends(), idx, side="right")
        rows[:, 2] = idx
        return rows

    def read(self, pointers: np.ndarray) -> list[Any]:
        """Payloads of the pointer rows, in row order; each file is visited once, its rows in
        order, through the subclass's ``_read_file``."""
        rows, files, local = self.locate(pointers)
        out: list[Any] = [None] * len(rows)
        order = np.lexsort((local, files))
        bounds = np.flatnonzero(np.diff(files[order])) + 1
        for group in np.split(order, bounds):
            if group.size:
                self._read_file(int(files[group[0]]), group, rows, local, out)
        return out

    def _read_file(
        self,
        i: int,
        positions: np.ndarray,
        rows: np.ndarray,
        local: np.ndarray,
        out: list[Any],
    ) -> None:
        """Fill ``out[positions]`` from file ``i`` (rows ``local[positions]`` within it)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _read_file (abstract)")

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
        permanent ones (see ``is_permanent``), else a retryable OSError naming path and pointer."""
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

    def _describe_files(self) -> dict[str, Any]:
        return {**self._describe_base(), "paths": list(self.paths)}

    def __repr__(self) -> str:
        # Never loads metadata: a repr inside a metadata error must not recurse into the load.
        first = self.paths[0]
        more = f" + {len(self.paths) - 1} more" if len(self.paths) > 1 else ""
        return (
            f"{type(self).__name__}([{first!r}{more}], dataset_id={self.dataset_id}, "
            f"chunk_size={self.chunk_size}, shuffle={self.shuffle}, seed={self.seed}, "
            f"passes={self.passes})"
        )


# ------------------------------------------------------------------------- JSON Lines

#: Block size of the line scan.
SCAN_BLOCK = 1 << 20
#: Bytes from each end of a file that enter its content fingerprint.
FINGERPRINT_EDGE = 1 << 16

_ZIDX_MAGIC = int.from_bytes(b"ZEPHIDX1", "little")
_ZIDX_VERSION = 1
_ZIDX_HEADER = 5  # magic, version, file size, file mtime_ns, number of lines
_WHITESPACE = np.zeros(256, dtype=bool)
_WHITESPACE[[0x20, 0x09, 0x0A, 0x0D]] = True  # JSON's insignificant whitespace


def scan_line_starts(fh: Any, block_size: int = SCAN_BLOCK) -> np.ndarray:
    """Start offsets (int64) of the non-blank lines of a binary file object, read from its start in
    blocks: a line ends at ``\\n`` (or at the end of the file); a line holding only JSON whitespace
    (space, tab, CR) or nothing is blank and has no entry."""
    newline_at: list[np.ndarray] = []
    content_at: list[np.ndarray] = []  # non-whitespace bytes seen up to and including each newline
    seen = 0
    content = 0
    while True:
        block = fh.read(block_size)
        if not block:
            break
        a = np.frombuffer(block, dtype=np.uint8)
        nl = np.flatnonzero(a == 0x0A)
        if nl.size:
            counts = np.cumsum(~_WHITESPACE[a], dtype=np.int64)
            newline_at.append(nl.astype(np.int64) + seen)
            content_at.append(counts[nl] + content)
            content += int(counts[-1])
        else:
            content += int(np.count_nonzero(~_WHITESPACE[a]))
        seen += a.size
    nls = np.concatenate(newline_at) if newline_at else np.zeros(0, dtype=np.int64)
    ends = np.concatenate(content_at) if content_at else np.zeros(0, dtype=np.int64)
    starts = np.concatenate(([0], nls + 1))
    if starts[-1] >= seen:  # the file ends with a newline (or is empty): no line after it
        starts = starts[:-1]
    else:  # a last line without a newline
        ends = np.concatenate((ends, [content]))
    before = np.concatenate(([0], ends[:-1]))
    return starts[(ends - before) > 0].astype(np.int64)


class _LineIndex:
    """The line index of one file: start offsets of its samples, the file identity they were built
    for (size, mtime_ns), a cheap content fingerprint, and the ``.zidx`` holding them (or None).

    Pickles without its offsets when they are memory-mapped from a ``.zidx``: the new process maps
    the same file again (checked against size and mtime) instead of receiving a copy.
    """

    __slots__ = ("fingerprint", "location", "mtime_ns", "size", "starts")

    def __init__(
        self,
        starts: np.ndarray | None,
        size: int,
        mtime_ns: int,
        fingerprint: str,
        location: str | None,
    ):
        self.starts = starts
        self.size = size
        self.mtime_ns = mtime_ns
        self.fingerprint = fingerprint
        self.location = location

    def __getstate__(self) -> tuple[Any, ...]:
        mapped = self.location is not None and isinstance(self.starts, np.memmap)
        starts = None if mapped else self.starts
        return (starts, self.size, self.mtime_ns, self.fingerprint, self.location)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.starts, self.size, self.mtime_ns, self.fingerprint, self.location = state
        if self.starts is None and self.location is not None:
            self.starts = _read_zidx(self.location, self.size, self.mtime_ns)

    def __len__(self) -> int:
        return 0 if self.starts is None else len(self.starts)


class JsonlSource(FileSource):
    """JSON Lines files; the payload of a sample is its line parsed by ``json.loads`` (any JSON
    value, usually a dict).

    A sample is a non-blank line: lines that are empty or hold only whitespace (space, tab, CR) are
    skipped wherever they are, so a trailing newline or blank lines at the end add no samples. The
    line index — the start offset of every sample — is built once per file by a block scan and
    stored as ``<file>.zidx`` beside it (or in ``index_dir``, named after the file and a hash of its
    absolute path), an ``.npy`` whose header records the file's size and mtime, so a stale index is
    rebuilt; when the index cannot be written it is kept in memory (8 bytes per line). A stored
    index is memory-mapped. ``describe()`` fingerprints each file by size, line count and a hash
    of its first and last 64 KiB (not its mtime, so a copied dataset keeps its fingerprint).

    Invariant: a read either returns exactly the indexed line, parsed, or raises ``FetchError``
    (malformed JSON names the file, 1-based line number and pointer; a file whose size or mtime
    differs from its index raises instead of reading shifted lines).
    """

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
    ) -> None:
        if index_dir is not None and not isinstance(index_dir, (str, os.PathLike)):
            raise TypeError(f"JsonlSource: index_dir must be a path or None, got {index_dir!r}")
        self.index_dir = None if index_dir is None else os.fspath(index_dir)
        super().__init__(
            paths,
            dataset_id=dataset_id,
            chunk_size=chunk_size,
            shuffle=shuffle,
            seed=seed,
            passes=passes,
        )
        self._indexes: list[_LineIndex] = []

    # --------------------------------------------------------------------- index
    def index_path(self, file_index: int) -> str:
        """Where the line index of file ``file_index`` is stored: ``<file>.zidx`` beside it, or in
        ``index_dir`` as ``<name>.<hash of the absolute path>.zidx``."""
        path = self.paths[file_index]
        if self.index_dir is None:
            return path + ".zidx"
        digest = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16]
        return os.path.join(self.index_dir, f"{os.path.basename(path)}.{digest}.zidx")

    def index_locations(self) -> list[str | None]:
        """Per file, the ``.zidx`` its index was loaded from or written to, or None when the index
        lives in memory only (its directory was not writable)."""
        self.file_ends()
        return [ix.location for ix in self._indexes]

    def load_metadata(self) -> list[int]:
        """Load or build the line index of every file; returns the sample count of each."""
        self._indexes = [self._load_index(i) for i in range(len(self.paths))]
        return [len(ix) for ix in self._indexes]

    def _load_index(self, i: int) -> _LineIndex:
        path = self.paths[i]
        try:
            with open(path, "rb") as fh:
                st = os.fstat(fh.fileno())
                fingerprint = _edge_fingerprint(fh, st.st_size)
                where = self.index_path(i)
                starts = _read_zidx(where, st.st_size, st.st_mtime_ns)
                if starts is not None:
                    return _LineIndex(starts, st.st_size, st.st_mtime_ns, fingerprint, where)
                fh.seek(0)
                starts = scan_line_starts(fh)
                after = os.fstat(fh.fileno())
        except OSError as exc:
            raise self.os_error(exc, i) from exc
        if (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
            raise self.fetch_error(i, "the file changed while its line index was being built")
        location = _write_zidx(where, starts, st.st_size, st.st_mtime_ns)
        return _LineIndex(starts, st.st_size, st.st_mtime_ns, fingerprint, location)

    # --------------------------------------------------------------------- reading
    def _read_file(
        self,
        i: int,
        positions: np.ndarray,
        rows: np.ndarray,
        local: np.ndarray,
        out: list[Any],
    ) -> None:
        index = self._indexes[i]
        starts = index.starts
        if starts is None:  # unpickled, and the .zidx no longer matches what was pickled
            raise self.fetch_error(
                i,
                f"its line index {index.location!r} changed since this source was pickled",
                rows[positions[0]],
            )
        pos = -1
        try:
            with open(self.paths[i], "rb") as fh:
                st = os.fstat(fh.fileno())
                if (st.st_size, st.st_mtime_ns) != (index.size, index.mtime_ns):
                    raise self.fetch_error(
                        i,
                        f"the file changed since its line index was built (size {index.size} -> "
                        f"{st.st_size}, mtime_ns {index.mtime_ns} -> {st.st_mtime_ns}); build a "
                        "new source (its fingerprint will differ from old checkpoints)",
                        rows[positions[0]],
                    )
                for pos in positions.tolist():
                    offset = int(starts[local[pos]])
                    fh.seek(offset)
                    line = fh.readline()
                    try:
                        out[pos] = json.loads(line)
                    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
                        lineno = _line_number(fh, offset)
                        raise self.fetch_error(
                            i, f"line {lineno} is not valid JSON: {exc}", rows[pos]
                        ) from None
        except OSError as exc:
            raise self.os_error(exc, i, rows[positions[0]] if pos < 0 else rows[pos]) from exc

    def describe(self) -> dict[str, Any]:
        """Class, chunking/shuffle parameters, paths, and per file its size, line count and
        content fingerprint."""
        out = self._describe_files()
        out["files"] = [
            {"size": ix.size, "lines": len(ix), "fingerprint": ix.fingerprint}
            for ix in self._indexes
        ]
        return out


def _edge_fingerprint(fh: Any, size: int) -> str:
    h = hashlib.sha256(f"size={size}".encode())
    fh.seek(0)
    h.update(fh.read(FINGERPRINT_EDGE))
    if size > FINGERPRINT_EDGE:
        fh.seek(max(FINGERPRINT_EDGE, size - FINGERPRINT_EDGE))
        h.update(fh.read(FINGERPRINT_EDGE))
    return h.hexdigest()


def _line_number(fh: Any, offset: int) -> int:
    # Only on the error path: count the newlines before ``offset``.
    fh.seek(0)
    count = 0
    remaining = offset
    while remaining > 0:
        block = fh.read(min(SCAN_BLOCK, remaining))
        if not block:
            break
        count += block.count(b"\n")
        remaining -= len(block)
    return count + 1


def _read_zidx(where: str, size: int, mtime_ns: int) -> np.ndarray | None:
    """The stored line starts at ``where`` when it exists, is well-formed and was built for a file
    of this size and mtime; None otherwise (the caller rebuilds)."""
    try:
        arr = np.load(where, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if arr.dtype != np.int64 or arr.ndim != 1 or arr.size < _ZIDX_HEADER:
        return None
    magic, version, isize, imtime, count = (int(v) for v in arr[:_ZIDX_HEADER])
    if (magic, version, isize, imtime) != (_ZIDX_MAGIC, _ZIDX_VERSION, size, mtime_ns):
        return None
    if count != arr.size - _ZIDX_HEADER:
        return None
    return arr[_ZIDX_HEADER:]


def _write_zidx(where: str, starts: np.ndarray, size: int, mtime_ns: int) -> str | None:
    """Write the index atomically (temp file, rename); the location, or None when it cannot be
    written (read-only directory): the index then lives in memory only."""
    header = np.array([_ZIDX_MAGIC, _ZIDX_VERSION, size, mtime_ns, len(starts)], dtype=np.int64)
    directory = os.path.dirname(os.path.abspath(where))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".zidx-", dir=directory)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "wb") as fh:
            np.save(fh, np.concatenate((header, starts)), allow_pickle=False)
        os.replace(tmp, where)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return None
    return where
