"""ArrowSource: Parquet files and Arrow IPC files (file/Feather v2 and stream format), read with
pyarrow's own readers.

Layout. ``shard_id`` is the file index in ``paths`` and ``sample_idx`` the *global* row index
across all files in order (see ``FileSource``), so a shuffled pass permutes every row of every
file. A file is split into *groups*: its Parquet row groups, or its IPC record batches.

Metadata. On first need (``num_samples``, ``describe``, ``chunk``, ``read``) each file's format is
detected by its magic bytes (``PAR1``: Parquet; ``ARROW1``: IPC file; a ``0xFFFFFFFF``
continuation marker: IPC stream) and its footer (Parquet FileMetaData, IPC footer) or schema
message (IPC stream) is read. The first time a file is seen it is also read once in full to build
its digest table (see ``zephon.sources.files``): one range per Parquet column chunk, one for the
footer, and one per IPC message, where an uncompressed record batch without dictionaries is split
into its header and one range per column (located by pyarrow's own decoder), so projected reads
check only what they read. The table and the row count of every group are cached in the ``.zsum``
sidecar (beside the file or in ``index_dir``); later opens read only the footer and the sidecar.
``describe()`` gives each file's format, size, rows, groups and the sha256 of its table.

Reading. Files are opened through ``open_file`` (a memory map by default) per ``read`` and closed
before it returns. ``read`` groups pointers by file and group and reads only the groups they touch,
with the ``columns`` projection pushed into the Parquet/IPC reader, one group at a time, so the
memory of a read is bounded by the groups it touches. Groups are decoded on the calling thread,
not on Arrow's CPU thread pool: a pipeline's lanes are its parallelism, and memory freed on a pool
thread stays with that thread's allocator heap, out of reach of the trims that hand a worker's
freed memory back. Every byte pyarrow reads inside a digested
range is served from that whole range, copied once out of the file and compared with its digest
first: a file changed since its digests were taken (even rewritten with the same footer, even
behind a sidecar that kept its mtime) raises ``FetchError`` naming the file, the group and the
pointer, and nothing decoded from it is returned. Parquet page checksums are verified too when the
writer stored them (``write_page_checksum=True``), and every decoded group is validated (offsets,
UTF-8) before a value is taken from it. The last ``GROUP_CACHE`` decoded groups are
kept so that chunks smaller than a row group do not decode it again, and at most
``METADATA_CACHE`` parsed Parquet footers. With ``shuffle=True`` the rows of a chunk are scattered
over the whole dataset, so a chunk may touch up to ``chunk_size`` groups: prefer small row groups
then, or read unshuffled and put a ``shuffle`` operator after ``fetch``.

Payloads. Each row becomes ``{column: value}`` in ``columns`` order (file schema order when
``columns=None``). A list column (list, large list, fixed-size list) whose values are integers,
floats or booleans becomes a 1-D numpy array of that dtype (a copy, not a view into the decoded
group), or ``None`` for a null list, or a Python list with ``None`` for nulls when the list
holds nulls (numpy integer arrays have no null). Every other value becomes the Python value
``pyarrow`` gives (``int``, ``float``, ``str`` stays ``str``, ``bytes``, ``datetime``, nested
lists and structs as lists and dicts, ``None`` for null).

Errors. A malformed file (bad magic, truncated or corrupt footer, message or page, undecodable
values) raises ``FetchError`` naming the file, and the group and pointer during a read; no
pyarrow, Unicode, key or index error escapes bare.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from zephon.errors import FetchError
from zephon.sources.files import (
    DigestTable,
    FileSource,
    PathsArg,
    digest,
    load_sidecar,
)
from zephon.validation import check_int

if TYPE_CHECKING:  # pyarrow is imported when a file is first touched, not with zephon.sources
    import pyarrow as pa

__all__ = ["ArrowSource", "table_rows"]

PARQUET = "parquet"
IPC_FILE = "arrow_file"
IPC_STREAM = "arrow_stream"
_KINDS = (PARQUET, IPC_FILE, IPC_STREAM)

# What a digested range of a file holds (one role per range in a _FileInfo).
_FOOTER, _SCHEMA, _DICTIONARY, _BATCH, _COLUMN = range(5)
_ZSUM_TAG = b"ZEPHSUM2"

#: Besides pyarrow.ArrowException: what reading a malformed file raises (UnicodeDecodeError is a
#: ValueError); each becomes a FetchError naming the file.
_MALFORMED: tuple[type[Exception], ...] = (
    ValueError,
    KeyError,
    IndexError,
    EOFError,
    OverflowError,
    struct.error,
)


def _malformed() -> tuple[type[Exception], ...]:
    import pyarrow as pa

    return (pa.ArrowException, *_MALFORMED)


class _CorruptFile(Exception):
    """Raised inside a scan or read; becomes a FetchError naming the file."""


class _Changed(Exception):
    """Raised by ``_CheckedFile`` when range ``k`` no longer matches its digest."""

    def __init__(self, k: int):
        super().__init__(k)
        self.k = k


class _Layout(NamedTuple):
    """What the footer (or the schema message) of a file says, read on every open."""

    kind: str
    columns: tuple[str, ...]  # top-level column names
    labels: tuple[str, ...]  # name of each column a range can belong to (Parquet: leaf paths)
    anchor: tuple[int, int]  # the footer's (the stream's schema message's) byte span
    anchor_digest: int
    group_rows: list[int] | None  # Parquet: from the footer; IPC: known after a full read
    groups: int | None  # IPC file: record batches in the footer
    schema: Any  # IPC: the pyarrow schema
    metadata: Any  # Parquet: the FileMetaData


class _FileInfo:
    """What is known of one file: its format, size and mtime when its digests were taken, the row
    count of each group, its columns, and its digest table with the role, group and column of
    each range. Invariant: the table was taken from the bytes the footer here describes."""

    __slots__ = (
        "columns",
        "group_ends",
        "identity",
        "kind",
        "labels",
        "location",
        "mtime_ns",
        "range_columns",
        "range_groups",
        "roles",
        "size",
        "table",
    )

    def __init__(
        self,
        kind: str,
        size: int,
        mtime_ns: int,
        group_rows: Any,
        table: DigestTable,
        roles: Any,
        range_groups: Any,
        range_columns: Any,
    ):
        self.kind = kind
        self.size = size
        self.mtime_ns = mtime_ns
        self.group_ends = np.cumsum(np.asarray(group_rows, dtype=np.int64), dtype=np.int64)
        self.table = table
        self.roles = np.asarray(roles, dtype=np.int64)
        self.range_groups = np.asarray(range_groups, dtype=np.int64)
        self.range_columns = np.asarray(range_columns, dtype=np.int64)
        self.identity = table.identity()
        self.columns: tuple[str, ...] = ()
        self.labels: tuple[str, ...] = ()
        self.location: str | None = None

    @property
    def num_rows(self) -> int:
        return int(self.group_ends[-1]) if self.group_ends.size else 0

    def group_rows(self) -> list[int]:
        return np.diff(self.group_ends, prepend=0).tolist()

    def first_range(self, role: int, group: int = -1) -> int:
        """Index of the first range with this role (of this group), or -1."""
        hit = np.flatnonzero((self.roles == role) & (self.range_groups == group))
        return int(hit[0]) if hit.size else -1

    def has_dictionaries(self) -> bool:
        return bool((self.roles == _DICTIONARY).any())

    def label(self, k: int, group: int) -> str:
        """What range ``k`` holds, for an error met while reading group ``group``."""
        role, g, c = int(self.roles[k]), int(self.range_groups[k]), int(self.range_columns[k])
        if role == _FOOTER:
            return "the footer"
        if role == _SCHEMA:
            return "the schema message"
        if role == _DICTIONARY:
            return "a dictionary batch"
        if role == _BATCH:
            return "its record batch message" if g == group else _group_name(self, g)
        other = "" if g == group else f"{_group_name(self, g)}, "
        column = self.labels[c] if 0 <= c < len(self.labels) else f"#{c}"
        return f"{other}{'column chunk' if self.kind == PARQUET else 'column'} {column!r}"

    def sections(self) -> list[np.ndarray]:
        """The sidecar form: kind and group count, group rows, the table, roles, groups, columns."""
        meta = np.array([_KINDS.index(self.kind), len(self.group_ends)], dtype=np.int64)
        rows = np.asarray(self.group_rows(), dtype=np.int64)
        extra = [self.roles, self.range_groups, self.range_columns, self.table.known_section()]
        names = json.dumps([list(self.columns), list(self.labels)]).encode()
        packed = np.frombuffer(names + b" " * (-len(names) % 8), dtype=np.int64)
        return [meta, rows, *self.table.sections(), *extra, packed]

    @classmethod
    def from_sections(
        cls, sections: list[np.ndarray], size: int, mtime_ns: int
    ) -> _FileInfo | None:
        """The info a sidecar holds, or None when its sections are not a consistent table."""
        if len(sections) != 10 or len(sections[0]) != 2:
            return None
        (kind, groups), rows, starts, lengths, digests, roles, range_groups, columns, known = (
            np.array(s) for s in sections[:9]
        )
        try:
            names, labels = json.loads(np.asarray(sections[9]).tobytes().decode())
        except (ValueError, TypeError):
            return None
        if len(known) != len(starts):
            return None
        table = DigestTable(starts, lengths, digests, known != 0)
        n = len(table)
        if not 0 <= kind < len(_KINDS) or groups != len(rows) or (rows < 0).any():
            return None
        if (
            not table.is_well_formed(size)
            or not len(roles) == len(range_groups) == len(columns) == n
        ):
            return None
        if n and (roles.min() < _FOOTER or roles.max() > _COLUMN or range_groups.max() >= groups):
            return None
        info = cls(_KINDS[kind], size, mtime_ns, rows, table, roles, range_groups, columns)
        info.columns = tuple(str(n) for n in names)
        info.labels = tuple(str(n) for n in labels)
        return info

    def anchor_range(self) -> int:
        """The range holding the footer (an IPC stream: its schema message)."""
        return self.first_range(_SCHEMA if self.kind == IPC_STREAM else _FOOTER)

    def layout_digest(self) -> str:
        """What identifies the file's content without reading its data: the digest of its footer
        (an IPC stream: of its schema message) and the row count of every group."""
        h = hashlib.sha256(b"zephon footer 1")
        h.update(int(self.table.digests[self.anchor_range()]).to_bytes(8, "little", signed=True))
        h.update(np.ascontiguousarray(self.group_ends, dtype="<i8").tobytes())
        return h.hexdigest()[:32]


class ArrowSource(FileSource):
    """Rows of Parquet and Arrow IPC (file, Feather v2, stream) files, read by row group / record
    batch with an optional ``columns`` projection; see the module docstring for the layout,
    identity, payload rule and error rules.

    Invariant: ``read`` returns exactly the rows whose bytes were digested when the metadata was
    read, or raises ``FetchError`` naming the file and pointer; it never silently returns a
    shorter or different stream.
    """

    #: What a worker process reading these files imports (lazily here): its fork server
    #: imports it once for all workers. Not ``pyarrow.compute``: only ``Table.take`` needs it,
    #: for rows that are not consecutive (a shuffled source), and importing it would delay every
    #: fork server's start (so the first batch) by about 40 ms.
    worker_modules = ("pyarrow", "pyarrow.parquet", "pyarrow.ipc")
    #: Decoded (projected) groups kept across reads, so chunks smaller than a group reuse it.
    GROUP_CACHE = 2
    #: Parsed Parquet footers kept; an evicted one is read again from the file when needed.
    METADATA_CACHE = 8
    SUFFIXES = (".parquet", ".pq", ".arrow", ".feather", ".ipc", ".arrows")

    def __init__(
        self,
        paths: PathsArg,
        *,
        dataset_id: int = 0,
        columns: Sequence[str] | None = None,
        chunk_size: int = 1024,
        shuffle: bool = False,
        seed: int = 0,
        passes: int | None = 1,
        index_dir: str | os.PathLike[str] | None = None,
        filesystem: Any = None,
        cache_dir: str | os.PathLike[str] | None = None,
        readahead: int = 64 << 20,
        threads: int = 16,
    ) -> None:
        self.readahead = check_int(readahead, "readahead", "ArrowSource", minimum=0)
        if columns is not None:
            if isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
                raise TypeError(
                    f"ArrowSource: columns must be a list of str or None, got {columns!r}"
                )
            if len(set(columns)) != len(columns):
                raise ValueError(f"ArrowSource: columns has duplicates: {list(columns)!r}")
        self.columns: tuple[str, ...] | None = None if columns is None else tuple(columns)
        super().__init__(
            paths,
            dataset_id=dataset_id,
            chunk_size=chunk_size,
            shuffle=shuffle,
            seed=seed,
            passes=passes,
            index_dir=index_dir,
            filesystem=filesystem,
            cache_dir=cache_dir,
            threads=threads,
        )
        self._infos: list[_FileInfo] = []
        self._reset_caches()

    def _reset_caches(self) -> None:
        # Its own lock: metadata threads fill these while the caller holds the source's lock.
        self._cache_lock = threading.Lock()
        self._groups: OrderedDict[tuple[int, int], pa.Table] = OrderedDict()
        self._parquet_meta: OrderedDict[int, Any] = OrderedDict()
        # Raw bytes of ranges fetched ahead of their read: (file, range) -> bytes, bounded by
        # ``readahead`` bytes in total; each is checked against its digest when it is used.
        self._ahead: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        self._ahead_bytes = 0

    # --------------------------------------------------------------------- files
    def open_file(self, path: str) -> pa.NativeFile:
        """Open ``path`` (a path on the source's filesystem) for random-access reading (a memory
        map for local files); every byte the source reads goes through the file returned here (a
        subclass may wrap it, e.g. to count I/O)."""
        return self._locations.open_random(path)

    def file_format(self, file_index: int) -> str:
        """``"parquet"``, ``"arrow_file"`` or ``"arrow_stream"``: the detected format of a file."""
        self.file_ends()
        return self._infos[file_index].kind

    def file_groups(self, file_index: int) -> list[int]:
        """Row counts of a file's groups (Parquet row groups or IPC record batches)."""
        self.file_ends()
        return self._infos[file_index].group_rows()

    def digest_locations(self) -> list[str | None]:
        """Per file, the ``.zsum`` its digest table was loaded from or written to, or None when
        the table lives in memory only (its directory was not writable)."""
        self.file_ends()
        return [info.location for info in self._infos]

    # --------------------------------------------------------------------- metadata
    def load_metadata(self) -> list[int]:
        """Read every file's footer (in parallel for remote data, each retried on transient
        errors) or trust its cached metadata, and check ``columns`` against it; row counts per
        file."""

        def one(i: int) -> _FileInfo:
            info: _FileInfo = self.with_retries(
                lambda: self._scan(i),
                lambda: f"ArrowSource cannot read the metadata of {self.paths[i]!r}",
            )
            if self.columns is not None:
                missing = [c for c in self.columns if c not in info.columns]
                if missing:
                    raise self.fetch_error(
                        i, f"it has no column(s) {missing} (its columns: {list(info.columns)})"
                    )
            return info

        infos = self.parallel(one, range(len(self.files())))
        self._infos = infos
        return [info.num_rows for info in infos]

    def _scan(self, i: int) -> _FileInfo:
        """File ``i``'s info: its cached one when it was stored for this size and mtime (no
        I/O), else from its footer, keeping the cached digests when the footer is the same (a
        touched or copied file), else new: digested in full for a local file, learned range by
        range as they are read for remote data."""
        entry = self.files()[i]
        size, mtime_ns = entry.size, entry.mtime_ns or 0
        cached, cached_mtime, where = self._cached(i, size)
        if cached is not None and cached_mtime == mtime_ns:
            cached.location = where
            return cached
        try:
            f = self.open_file(entry.path)
        except OSError as exc:
            raise self.os_error(exc, i) from exc
        try:
            size = f.size()
            head = _read(f, 0, min(8, size)).to_pybytes()
            if head[:4] == b"PAR1":
                layout = _parquet_layout(f, size)
            elif head[:6] == b"ARROW1":
                layout = _ipc_file_layout(f, size)
            elif head[:4] == b"\xff\xff\xff\xff":
                layout = _ipc_stream_layout(f, size)
            else:
                raise _CorruptFile(
                    f"not a Parquet or Arrow IPC file (starts with {head!r}; expected b'PAR1', "
                    "b'ARROW1' or an IPC stream continuation marker)"
                )
            info = None if cached is None else _agreeing(cached, layout)
            if info is None:
                if layout.kind == PARQUET and not self.is_local:
                    info = _lazy_parquet_info(layout, size, mtime_ns)
                else:
                    info = _digest_file(f, layout, size, mtime_ns)
            info.mtime_ns = mtime_ns
            info.columns = layout.columns
            info.labels = layout.labels
            info.location = self.store_sidecar(
                i, ".zsum", _ZSUM_TAG, size, mtime_ns, info.sections()
            )
            info.table.dirty = False
        except _CorruptFile as exc:
            raise self.fetch_error(i, str(exc)) from None
        except OSError as exc:
            raise self.os_error(exc, i) from exc
        except _malformed() as exc:
            raise self.fetch_error(i, f"corrupt metadata: {type(exc).__name__}: {exc}") from exc
        finally:
            f.close()
        if layout.metadata is not None:
            self._remember_parquet_meta(i, layout.metadata)
        return info

    def _cached(self, i: int, size: int) -> tuple[_FileInfo | None, int, str | None]:
        # The first intact stored info of file i for this size: (info, its mtime, where).
        for where in self.sidecar_candidates(i, ".zsum"):
            found = load_sidecar(where, _ZSUM_TAG, size)
            if found is None:
                continue
            info = _FileInfo.from_sections(found[0], size, found[1])
            if info is not None:
                return info, found[1], where
        return None, 0, None

    def _store(self, i: int) -> None:
        # Store what reads learned of file i's digests (under the lock: one writer at a time).
        with self._lock:
            info = self._infos[i]
            if not info.table.dirty:
                return
            info.table.dirty = False
            info.location = self.store_sidecar(
                i, ".zsum", _ZSUM_TAG, info.size, info.mtime_ns, info.sections()
            )

    def _remember_parquet_meta(self, i: int, md: Any) -> None:
        with self._cache_lock:
            self._parquet_meta[i] = md
            self._parquet_meta.move_to_end(i)
            while len(self._parquet_meta) > self.METADATA_CACHE:
                self._parquet_meta.popitem(last=False)

    # --------------------------------------------------------------------- reading
    def _read_file(
        self,
        i: int,
        positions: np.ndarray,
        rows: np.ndarray,
        local: np.ndarray,
        out: list[Any],
    ) -> None:
        # Remote data: the whole file's part of the read is attempted again on a transient
        # error; what fails past the budget names the URI, the group and the pointer.
        at: list[Any] = [rows[positions[0]], 0]

        def what() -> str:
            info = self._infos[i]
            return (
                f"ArrowSource cannot read pointer {tuple(int(v) for v in at[0])} from "
                f"{self.paths[i]!r}: {_group_name(info, at[1])}"
            )

        try:
            self.with_retries(
                lambda: self._read_file_once(i, positions, rows, local, out, at), what
            )
        finally:
            self._store(i)

    def _read_file_once(
        self,
        i: int,
        positions: np.ndarray,
        rows: np.ndarray,
        local: np.ndarray,
        out: list[Any],
        at: list[Any],
    ) -> None:
        info = self._infos[i]
        names = self.columns if self.columns is not None else info.columns
        groups = np.searchsorted(info.group_ends, local[positions], side="right")
        group_starts = np.concatenate(([0], info.group_ends[:-1]))
        reader: _GroupReader | None = None
        pointer = rows[positions[0]]
        g = int(groups[0])
        try:
            bounds = np.flatnonzero(np.diff(groups)) + 1  # positions are sorted by row
            for sel, in_group in zip(
                np.split(positions, bounds), np.split(groups, bounds), strict=True
            ):
                pointer = rows[sel[0]]
                g = int(in_group[0])
                at[0], at[1] = pointer, g
                table = self._cached_group(i, g)
                if table is None:
                    if reader is None:
                        self._read_ahead(i, [int(v) for v in np.unique(groups)])
                        reader = self._open_checked(i, pointer)
                    table = reader.read_group(g)
                    expected = int(info.group_ends[g] - group_starts[g])
                    if table.num_rows != expected:
                        raise _CorruptFile(
                            f"it holds {table.num_rows} rows, its metadata said {expected}"
                        )
                    self._cache_group(i, g, table)
                payloads = table_rows(table, local[sel] - group_starts[g], names)
                for pos, payload in zip(sel.tolist(), payloads, strict=True):
                    out[pos] = payload
        except FetchError:
            raise
        except _Changed as exc:
            start, end = info.table.span(exc.k)
            raise self.fetch_error(
                i,
                f"{_group_name(info, g)}: {info.label(exc.k, g)} (bytes {start}..{end}) changed "
                f"since its metadata was read (its bytes no longer match their digest); "
                f"{self._rebuild_hint(i)}",
                pointer,
            ) from None
        except _CorruptFile as exc:
            raise self.fetch_error(i, f"{_group_name(info, g)}: {exc}", pointer) from None
        except OSError as exc:
            raise self.os_error(exc, i, pointer) from exc
        except _malformed() as exc:
            raise self.fetch_error(
                i, f"{_group_name(info, g)}: {type(exc).__name__}: {exc}", pointer
            ) from exc
        finally:
            if reader is not None:
                reader.close()

    def _rebuild_hint(self, i: int) -> str:
        # The cached digests are kept while the footer is unchanged (whatever the mtime), so a
        # new source would refuse the file again: the cache entry has to go first. The
        # fingerprint is made of the footer, so a rewrite that kept it resumes old checkpoints.
        info = self._infos[i]
        if info.location is not None:
            return (
                f"if the new content is intended, delete {info.location!r} (its cached digests), "
                "then build a new source"
            )
        return "build a new source"

    def _open_checked(self, i: int, pointer: np.ndarray) -> _GroupReader:
        """Open file ``i`` for group reads, after checking it still has the size its digests
        were taken at (every range read is then checked against its digest)."""
        info = self._infos[i]
        f = self.open_file(self.files()[i].path)
        try:
            size = f.size()
            if size != info.size:
                raise self.fetch_error(
                    i,
                    f"the file changed since its metadata was read ({info.num_rows} rows in "
                    f"{len(info.group_ends)} groups, {info.size} bytes -> now {size} bytes); "
                    "build a new source (its fingerprint will differ from old checkpoints)",
                    pointer,
                )
            return _GroupReader(self, i, f)
        except BaseException:
            f.close()
            raise

    def _cached_group(self, i: int, g: int) -> pa.Table | None:
        with self._cache_lock:
            table = self._groups.get((i, g))
            if table is not None:
                self._groups.move_to_end((i, g))
            return table

    def _cache_group(self, i: int, g: int, table: pa.Table) -> None:
        if self.GROUP_CACHE <= 0:
            return
        with self._cache_lock:
            self._groups[(i, g)] = table
            self._groups.move_to_end((i, g))
            while len(self._groups) > self.GROUP_CACHE:
                self._groups.popitem(last=False)

    def drop_read_caches(self) -> None:
        """Forget the decoded groups and the bytes fetched ahead; footers stay."""
        with self._cache_lock:
            self._groups.clear()
            self._ahead.clear()
            self._ahead_bytes = 0

    def describe(self) -> dict[str, Any]:
        """Class, chunking/shuffle parameters, columns, and per file its name relative to the
        dataset root, format, size, row count, group count and the digest of its footer and
        group layout: no absolute path, scheme or mtime, so the same files moved or copied to a
        bucket keep the identity, and a file rewritten, grown, added or removed does not."""
        out = self._describe_files()
        out["columns"] = None if self.columns is None else list(self.columns)
        out["files"] = [
            {
                "name": entry.name,
                "format": info.kind,
                "size": info.size,
                "rows": info.num_rows,
                "groups": len(info.group_ends),
                "footer": info.layout_digest(),
            }
            for entry, info in zip(self.files(), self._infos, strict=True)
        ]
        return out

    def _read_ahead(self, i: int, groups: list[int]) -> None:
        """Fetch, concurrently, the raw ranges (projected columns only) of the remote Parquet
        groups this read needs and of the groups after them, up to ``readahead`` bytes in
        all; reads then take them from memory (each still checked against its digest)."""
        info = self._infos[i]
        if self.is_local or info.kind != PARQUET or self.readahead <= 0 or not groups:
            return
        wanted_cols = None
        if self.columns is not None:
            wanted_cols = {
                c
                for c, label in enumerate(info.labels)
                if any(label == n or label.startswith(n + ".") for n in self.columns)
            }
        ranges: list[int] = []
        budget = self.readahead
        last = len(info.group_ends)
        for g in [*groups, *range(groups[-1] + 1, last)]:
            picked = np.flatnonzero((info.roles == _COLUMN) & (info.range_groups == g))
            if wanted_cols is not None:
                picked = np.array(
                    [k for k in picked if int(info.range_columns[k]) in wanted_cols], dtype=np.int64
                )
            with self._cache_lock:
                fresh = [int(k) for k in picked if (i, int(k)) not in self._ahead]
            cost = sum(int(info.table.lengths[k]) for k in fresh)
            if g not in groups and cost > budget:
                break
            budget -= cost
            ranges += fresh
        if not ranges:
            return
        path = self.files()[i].path

        def fetch_range(k: int) -> tuple[int, bytes]:
            a, b = info.table.span(k)
            f = self.open_file(path)
            try:
                return k, f.read_at(b - a, a)
            finally:
                f.close()

        for k, data in self.parallel(fetch_range, ranges):
            self._keep_ahead(i, k, data)

    def _keep_ahead(self, i: int, k: int, data: bytes) -> None:
        with self._cache_lock:
            self._ahead[(i, k)] = data
            self._ahead_bytes += len(data)
            while self._ahead_bytes > max(self.readahead, len(data)) and self._ahead:
                _, old = self._ahead.popitem(last=False)
                self._ahead_bytes -= len(old)

    def take_ahead(self, i: int, k: int) -> bytes | None:
        """The raw bytes of range ``k`` of file ``i`` when read-ahead fetched them (once)."""
        with self._cache_lock:
            data = self._ahead.pop((i, k), None)
            if data is not None:
                self._ahead_bytes -= len(data)
            return data

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for key in ("_groups", "_parquet_meta", "_ahead", "_ahead_bytes", "_cache_lock"):
            del state[key]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._reset_caches()


def _group_name(info: _FileInfo, g: int) -> str:
    return f"{'row group' if info.kind == PARQUET else 'record batch'} {g}"


class _GroupReader:
    """One open file of an ArrowSource for the duration of a ``read``: decodes single groups with
    the source's column projection, through a ``_CheckedFile``."""

    def __init__(self, source: ArrowSource, i: int, f: pa.NativeFile):
        import pyarrow as pa

        self.source = source
        self.i = i
        self.info = source._infos[i]
        checked = _CheckedFile(
            f, self.info.table, self.info.size, lambda k: source.take_ahead(i, k)
        )
        self.file = pa.PythonFile(checked, mode="r")
        self._impl: Any = None

    def read_group(self, g: int) -> pa.Table:
        """Group ``g`` of the file as a table holding the projected columns only."""
        import pyarrow as pa

        info = self.info
        columns = self.source.columns
        if info.kind == PARQUET:
            if self._impl is None:
                self._impl = self._parquet_file()
            wanted = None if columns is None else list(columns)
            table = self._impl.read_row_group(g, columns=wanted, use_threads=False)
        elif info.kind == IPC_FILE:
            if self._impl is None:
                idx = None if columns is None else [info.columns.index(c) for c in columns]
                self._impl = pa.ipc.open_file(self.file, options=_ipc_options(idx))
                if self._impl.num_record_batches != len(info.group_ends):
                    raise _CorruptFile(
                        f"{self._impl.num_record_batches} record batches, its metadata said "
                        f"{len(info.group_ends)}"
                    )
            table = pa.Table.from_batches([self._impl.get_batch(g)])
        else:
            table = pa.Table.from_batches([self._stream_batch(g)])
        if columns is not None:
            table = table.select(list(columns))
        # IPC readers take buffers as the file has them: an offset or UTF-8 error found here is a
        # FetchError; found while converting values it would abort the process.
        table.validate(full=True)
        return table

    def _parquet_file(self) -> Any:
        import pyarrow.parquet as pq

        source = self.source
        with source._cache_lock:
            md = source._parquet_meta.get(self.i)
        if md is None:
            md = _parquet_footer(self.file, self.info.size)[1]
            source._remember_parquet_meta(self.i, md)
        # Page CRCs are checked when the writer stored them (write_page_checksum=True).
        return pq.ParquetFile(self.file, metadata=md, page_checksum_verification=True)

    def _stream_batch(self, g: int) -> pa.RecordBatch:
        import pyarrow as pa

        info = self.info
        if info.has_dictionaries():  # dictionaries live in earlier messages: walk the stream
            if self._impl is None or self._impl[0] > g:
                self.file.seek(0)
                self._impl = [0, pa.ipc.open_stream(self.file, options=_ipc_options())]
            while self._impl[0] < g:
                self._impl[1].read_next_batch()
                self._impl[0] += 1
            self._impl[0] += 1
            return self._impl[1].read_next_batch()
        if self._impl is None:
            self.file.seek(info.table.span(info.first_range(_SCHEMA))[0])
            self._impl = pa.ipc.read_schema(pa.ipc.read_message(self.file))
        self.file.seek(info.table.span(info.first_range(_BATCH, g))[0])
        return pa.ipc.read_record_batch(pa.ipc.read_message(self.file), self._impl)

    def close(self) -> None:
        """Close the file."""
        self.file.close()


class _CheckedFile(io.RawIOBase):
    """A read-only file object over an open file, for pyarrow's readers: every byte inside a
    digested range is served from that whole range, copied once out of the file and matched
    against its digest first; bytes outside every range (magic numbers, padding) pass through.

    Invariant: nothing pyarrow decodes from a digested range differs from what was digested; a
    range that does not match raises ``_Changed``, which pyarrow passes through to the caller.
    """

    def __init__(
        self, f: pa.NativeFile, table: DigestTable, size: int, ahead: Any = lambda k: None
    ):
        super().__init__()
        self._ahead = ahead
        self._f = f
        self._table = table
        self._size = size
        self._pos = 0
        self._loaded: tuple[int, memoryview] = (-1, memoryview(b""))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            self._pos = offset
        elif whence == io.SEEK_CUR:
            self._pos += offset
        else:
            self._pos = self._size + offset
        return self._pos

    def read(self, size: int | None = -1) -> Any:
        start = self._pos
        end = self._size if size is None or size < 0 else min(self._size, start + size)
        if end <= start:
            return b""
        parts: list[Any] = []
        at = start
        for k in self._table.overlapping(start, end):
            a, b = self._table.span(k)
            if a > at:
                parts.append(_read(self._f, at, a - at))
                at = a
            stop = min(b, end)
            parts.append(self._range(k)[at - a : stop - a])
            at = stop
        if at < end:
            parts.append(_read(self._f, at, end - at))
        self._pos = end
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        n = len(data)
        memoryview(buffer).cast("B")[:n] = data
        return n

    def close(self) -> None:
        self._f.close()
        super().close()

    def _range(self, k: int) -> memoryview:
        if self._loaded[0] == k:
            return self._loaded[1]
        data = self._ahead(k)
        if data is None:
            a, b = self._table.span(k)
            self._f.seek(a)
            data = self._f.read(b - a)  # a copy: the bytes checked are the bytes decoded
        if not self._table.check(k, data):
            raise _Changed(k)
        self._loaded = (k, memoryview(data))
        return self._loaded[1]


def _read(f: pa.NativeFile, offset: int, nbytes: int) -> pa.Buffer:
    # Zero-copy from a memory map; any NativeFile otherwise.
    f.seek(offset)
    return f.read_buffer(nbytes)


# ------------------------------------------------------------------------- payloads


def table_rows(table: pa.Table, indices: np.ndarray, names: Sequence[str]) -> list[dict[str, Any]]:
    """Payload dicts of rows ``indices`` of ``table``, keys in ``names`` order (see the module
    docstring for the value rule)."""
    if not names:
        return [{} for _ in range(len(indices))]
    picked = _contiguous(table, indices)
    if picked is None:
        picked = table.take(_index_array(indices))
    columns = [_column_values(picked.column(name)) for name in names]
    return [dict(zip(names, values, strict=True)) for values in zip(*columns, strict=True)]


def _contiguous(table: pa.Table, indices: np.ndarray) -> pa.Table | None:
    """A zero-copy slice of ``table`` when ``indices`` are consecutive rows (a chunk read in
    order: no gather, and no import of ``pyarrow.compute``, which ``take`` needs), else None."""
    n = len(indices)
    if not n:
        return None
    first = int(indices[0])
    if int(indices[-1]) - first != n - 1 or (n > 2 and not (np.diff(indices) == 1).all()):
        return None
    return table.slice(first, n)


def _index_array(indices: np.ndarray) -> pa.Array:
    """``indices`` as an int64 Arrow array, wrapped rather than converted: ``pa.array()`` makes
    pyarrow import pandas when it is installed, which would cost every worker process about
    0.4 s and tens of MiB before its first batch."""
    import pyarrow as pa

    values = np.ascontiguousarray(indices, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(values), [None, pa.py_buffer(values)])


def _column_values(column: pa.ChunkedArray) -> list[Any]:
    import pyarrow as pa

    arr = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    typ = arr.type
    if (
        pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ)
    ) and (
        pa.types.is_integer(typ.value_type)
        or pa.types.is_floating(typ.value_type)
        or pa.types.is_boolean(typ.value_type)
    ):
        return _numeric_lists(arr)
    return arr.to_pylist()


def _numeric_lists(arr: Any) -> list[Any]:
    import pyarrow as pa

    values = arr.values  # the whole child array: offsets below index into it
    if pa.types.is_fixed_size_list(arr.type):
        k = arr.type.list_size
        offsets = (np.arange(len(arr) + 1, dtype=np.int64) + arr.offset) * k
    else:
        offsets = _to_numpy(arr.offsets)
    # A list with a null element becomes a Python list; only the others read values_np.
    elem_valid = _to_numpy(values.is_valid()) if values.null_count else None
    values_np = _to_numpy(values)
    list_null = _to_numpy(arr.is_null()) if arr.null_count else None
    out: list[Any] = []
    for j in range(len(arr)):
        if list_null is not None and list_null[j]:
            out.append(None)
            continue
        a, b = int(offsets[j]), int(offsets[j + 1])
        if elem_valid is not None and not elem_valid[a:b].all():
            out.append(values.slice(a, b - a).to_pylist())
        else:
            out.append(values_np[a:b].copy())
    return out


# Arrow's names of the fixed-width types numpy names otherwise.
_NUMPY_NAMES = {"halffloat": "float16", "float": "float32", "double": "float64"}


def _to_numpy(arr: Any) -> np.ndarray:
    """The values of a boolean or numeric array, a view of its buffer where they are not bits
    (pyarrow's ``to_numpy()`` imports pandas when it is installed). A null's slot holds whatever
    the buffer holds there."""
    import pyarrow as pa

    data, n, at = arr.buffers()[1], len(arr), arr.offset
    if pa.types.is_boolean(arr.type):
        if data is None:
            return np.zeros(n, dtype=bool)
        bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
        return bits[at : at + n].astype(bool)
    dtype = np.dtype(_NUMPY_NAMES.get(str(arr.type), str(arr.type)))
    if data is None:
        return np.zeros(n, dtype=dtype)
    return np.frombuffer(data, dtype=dtype, count=at + n)[at:]


# ------------------------------------------------------------------------- metadata


def _parquet_footer(f: pa.NativeFile, size: int) -> tuple[bytes, Any]:
    """(footer bytes, parsed FileMetaData) of a Parquet file, reading the footer bytes only."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    # One read of the file's end usually holds the whole footer: a round trip on remote storage.
    end = f.read_at(min(size, 1 << 14), size - min(size, 1 << 14)) if size >= 12 else b""
    tail = end[-8:]
    if tail[4:] != b"PAR1":
        raise _CorruptFile(
            f"truncated or corrupt Parquet file: no PAR1 magic at its end ({size} bytes)"
        )
    (meta_len,) = struct.unpack("<I", tail[:4])
    if meta_len + 12 > size:
        raise _CorruptFile(
            f"truncated or corrupt Parquet file: footer of {meta_len} bytes in {size} bytes"
        )
    if meta_len + 8 <= len(end):
        footer = end[len(end) - 8 - meta_len :]
    else:
        footer = f.read_at(meta_len, size - 8 - meta_len) + tail
    # The thrift footer parses on its own: a magic-framed copy avoids pyarrow's speculative
    # 64 KiB tail read, so metadata costs only the footer's bytes.
    return footer, pq.read_metadata(pa.BufferReader(b"PAR1" + footer))


def _parquet_layout(f: pa.NativeFile, size: int) -> _Layout:
    footer, md = _parquet_footer(f, size)
    rows = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
    if sum(rows) != md.num_rows:
        raise _CorruptFile(f"row groups hold {sum(rows)} rows, footer says {md.num_rows}")
    names = tuple(md.schema.to_arrow_schema().names)
    leaves = tuple(md.schema.column(c).path for c in range(md.num_columns))
    return _Layout(
        PARQUET, names, leaves, (size - len(footer), size), digest(footer), rows, None, None, md
    )


def _ipc_file_layout(f: pa.NativeFile, size: int) -> _Layout:
    import pyarrow as pa

    tail = _read(f, size - 10, 10).to_pybytes() if size >= 18 else b""
    if tail[4:] != b"ARROW1":
        raise _CorruptFile(
            f"truncated or corrupt Arrow IPC file: no ARROW1 magic at its end ({size} bytes)"
        )
    (footer_len,) = struct.unpack("<i", tail[:4])
    if footer_len <= 0 or footer_len + 18 > size:
        raise _CorruptFile(f"truncated or corrupt Arrow IPC file: footer of {footer_len} bytes")
    start = size - 10 - footer_len
    reader = pa.ipc.open_file(f)  # reads the footer only
    names = tuple(reader.schema.names)
    return _Layout(
        IPC_FILE,
        names,
        names,
        (start, size),
        digest(_read(f, start, size - start)),
        None,
        reader.num_record_batches,
        reader.schema,
        None,
    )


def _ipc_stream_layout(f: pa.NativeFile, size: int) -> _Layout:
    import pyarrow as pa

    f.seek(0)
    try:
        message = pa.ipc.MessageReader.open_stream(f).read_next_message()
    except StopIteration:
        message = None
    if message is None or message.type != "schema":
        raise _CorruptFile("corrupt Arrow IPC stream: it does not start with a schema message")
    end = f.tell()
    schema = pa.ipc.read_schema(message)
    names = tuple(schema.names)
    return _Layout(
        IPC_STREAM, names, names, (0, end), digest(_read(f, 0, end)), None, None, schema, None
    )


def _agreeing(info: _FileInfo, layout: _Layout) -> _FileInfo | None:
    """``info`` (stored for a file of the same size) when it agrees with the footer just read:
    same format, footer bytes and groups; None otherwise (the file is taken as new)."""
    if info.kind != layout.kind:
        return None
    k = info.anchor_range()
    if (
        k < 0
        or info.table.span(k) != layout.anchor
        or info.table.digests[k] != layout.anchor_digest
    ):
        return None
    if layout.group_rows is not None and info.group_rows() != layout.group_rows:
        return None
    if layout.groups is not None and len(info.group_ends) != layout.groups:
        return None
    return info


def _lazy_parquet_info(layout: _Layout, size: int, mtime_ns: int) -> _FileInfo:
    """A Parquet file's info from its footer alone: the ranges of its column chunks, whose
    digests are taken the first time each is read, and the footer's, known now."""
    footer_start, footer_end = layout.anchor
    spans = _parquet_spans(layout.metadata, footer_start)
    spans.append((footer_start, footer_end - footer_start, _FOOTER, -1, -1))
    spans = sorted(s for s in spans if s[1] > 0)
    for (a, n, *_), (b, *_) in itertools.pairwise(spans):
        if b < a + n:
            raise _CorruptFile(f"bytes {a}..{a + n} and {b}.. of its metadata overlap")
    starts, lengths, roles, groups, columns = (list(c) for c in zip(*spans, strict=True))
    table = DigestTable.unknown(starts, lengths)
    k = starts.index(footer_start)
    table.digests[k] = layout.anchor_digest
    table.known[k] = True
    return _FileInfo(PARQUET, size, mtime_ns, layout.group_rows, table, roles, groups, columns)


def _digest_file(f: pa.NativeFile, layout: _Layout, size: int, mtime_ns: int) -> _FileInfo:
    """Read the whole file once: the ranges of its digest table, their digests and (IPC) the row
    count of every record batch."""
    footer_start, footer_end = layout.anchor
    if layout.kind == PARQUET:
        spans = _parquet_spans(layout.metadata, footer_start)
        spans.append((footer_start, footer_end - footer_start, _FOOTER, -1, -1))
        rows = layout.group_rows
    else:
        stream = layout.kind == IPC_STREAM
        spans, walked = _ipc_spans(f, 0 if stream else 8, None if stream else footer_start, layout)
        if not stream:
            spans.append((footer_start, footer_end - footer_start, _FOOTER, -1, -1))
        if None in walked or (layout.groups is not None and len(walked) != layout.groups):
            rows = _ipc_rows(f, layout)  # dictionary batches: count with the full reader
        else:
            rows = [n for n in walked if n is not None]
        if len(rows) != len(walked):
            raise _CorruptFile(f"{len(rows)} record batches decode, {len(walked)} were found")
    spans = sorted(s for s in spans if s[1] > 0)
    for (a, n, *_), (b, *_) in itertools.pairwise(spans):
        if b < a + n:
            raise _CorruptFile(f"bytes {a}..{a + n} and {b}.. of its metadata overlap")
    starts, lengths, roles, groups, columns = (list(c) for c in zip(*spans, strict=True))
    try:
        table = DigestTable.build(lambda at, n: _read(f, at, n), starts, lengths)
    except EOFError:
        raise _CorruptFile("the file is shorter than its metadata says") from None
    info = _FileInfo(layout.kind, size, mtime_ns, rows, table, roles, groups, columns)
    k = info.first_range(_SCHEMA if layout.kind == IPC_STREAM else _FOOTER)
    if table.span(k) != layout.anchor or table.digests[k] != layout.anchor_digest:
        raise _CorruptFile("the file changed while its digests were being taken")
    return info


def _parquet_spans(md: Any, footer_start: int) -> list[tuple[int, int, int, int, int]]:
    # (start, length, role, group, leaf column) of every column chunk: from its first page (the
    # dictionary page when there is one) for total_compressed_size bytes. An empty chunk may
    # record data_page_offset 0: only offsets past the leading magic count.
    spans = []
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        for c in range(rg.num_columns):
            chunk = rg.column(c)
            length = chunk.total_compressed_size
            pages = [chunk.data_page_offset]
            if chunk.has_dictionary_page:
                pages.append(chunk.dictionary_page_offset)
            offsets = [p for p in pages if p is not None and p >= 4]
            if not offsets and not length:
                continue
            start = min(offsets, default=0)
            if start < 4 or length < 0 or start + length > footer_start:
                raise _CorruptFile(
                    f"row group {g}, column chunk {chunk.path_in_schema!r} lies outside the "
                    f"file's data (bytes {start}..{start + length}, footer at {footer_start})"
                )
            spans.append((start, length, _COLUMN, g, c))
    return spans


def _ipc_spans(
    f: pa.NativeFile, start: int, stop: int | None, layout: _Layout
) -> tuple[list[tuple[int, int, int, int, int]], list[int | None]]:
    # Walk the encapsulated messages from ``start`` (to the footer at ``stop``, or to the
    # end-of-stream marker): their spans, and the row count of each record batch met (None when
    # it cannot be decoded on its own).
    import pyarrow as pa

    f.seek(start)
    reader = pa.ipc.MessageReader.open_stream(f)
    spans: list[tuple[int, int, int, int, int]] = []
    rows: list[int | None] = []
    pos = start
    while stop is None or pos < stop:
        try:
            message = reader.read_next_message()
        except StopIteration:
            if f.tell() == pos and stop is None:
                raise _CorruptFile(
                    f"truncated Arrow IPC stream: no end-of-stream marker ({len(rows)} record "
                    f"batches read, {f.size()} bytes)"
                ) from None
            break
        except (pa.ArrowException, OSError) as exc:
            raise _CorruptFile(
                f"truncated or corrupt Arrow IPC data: the message at byte {pos} runs past the "
                f"end or is malformed ({exc})"
            ) from None
        end = f.tell()
        if stop is not None and end > stop:
            raise _CorruptFile(f"the message at byte {pos} runs into the footer")
        if message.type == "schema":
            spans.append((pos, end - pos, _SCHEMA, -1, -1))
        elif message.type == "dictionary":
            spans.append((pos, end - pos, _DICTIONARY, -1, -1))
        elif message.type == "record batch":
            batch_spans, count = _batch_spans(message, pos, end, layout.schema, len(rows))
            spans += batch_spans
            rows.append(count)
        else:
            raise _CorruptFile(f"unexpected {message.type!r} message at byte {pos}")
        pos = end
    return spans, rows


def _batch_spans(
    message: Any, pos: int, end: int, schema: Any, g: int
) -> tuple[list[tuple[int, int, int, int, int]], int | None]:
    # A record batch message as one span, or as its header plus one span per column when
    # pyarrow decodes it straight from the message body (uncompressed, no dictionaries): the
    # column's buffers then lie in the body, and their addresses say where. With its row count
    # when it decodes on its own (not with dictionary columns).
    import pyarrow as pa

    whole = [(pos, end - pos, _BATCH, g, -1)]
    try:
        batch = pa.ipc.read_record_batch(message, schema)
    except pa.ArrowException:  # dictionary columns need the dictionaries: keep it whole
        return whole, None
    body = message.body
    body_size = 0 if body is None else body.size
    if not body_size:
        return whole, batch.num_rows
    body_start = end - body_size
    spans = [(pos, body_start - pos, _BATCH, g, -1)]
    done = 0
    for j, column in enumerate(batch.columns):
        buffers = [b for b in column.buffers() if b is not None and b.size]
        if not buffers:
            continue
        lo = min(b.address for b in buffers) - body.address
        hi = max(b.address + b.size for b in buffers) - body.address
        if lo < done or hi > body_size:  # decompressed elsewhere, or interleaved: keep it whole
            return whole, batch.num_rows
        spans.append((body_start + lo, hi - lo, _COLUMN, g, j))
        done = hi
    return spans, batch.num_rows


def _ipc_options(fields: list[int] | None = None) -> pa.ipc.IpcReadOptions:
    """IPC read options: the given fields only (all when None), decoded on the calling thread
    (see the module docstring)."""
    import pyarrow as pa

    return pa.ipc.IpcReadOptions(included_fields=fields, use_threads=False)


def _ipc_rows(f: pa.NativeFile, layout: _Layout) -> list[int]:
    # Row count of every record batch, in reading order, decoding one column of each.
    import pyarrow as pa

    options = _ipc_options([0] if layout.columns else None)
    if layout.kind == IPC_FILE:
        reader = pa.ipc.open_file(f, options=options)
        return [reader.get_batch(k).num_rows for k in range(reader.num_record_batches)]
    f.seek(0)
    return [batch.num_rows for batch in pa.ipc.open_stream(f, options=options)]
