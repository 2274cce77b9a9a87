"""ArrowSource: Parquet files and Arrow IPC files (file/Feather v2 and stream format), read with
pyarrow's own readers.

Layout. ``shard_id`` is the file index in ``paths`` and ``sample_idx`` the *global* row index
across all files in order (see ``FileSource``), so a shuffled pass permutes every row of every
file. A file is split into *groups*: its Parquet row groups, or its IPC record batches.

Metadata. On first need (``num_samples``, ``describe``, ``chunk``, ``read``) each file's format is
detected by its magic bytes (``PAR1``: Parquet; ``ARROW1``: IPC file; a ``0xFFFFFFFF``
continuation marker: IPC stream) and its footer (Parquet FileMetaData, IPC footer) or schema
message (IPC stream) is read. The first time a file is seen (local or remote) it is also read
once in full to build its digest table (see ``zephon.sources.files``): one range per Parquet
column chunk, one for the footer, and one per IPC message, where an uncompressed record batch
without dictionaries is split into its header and one range per column (located by pyarrow's own
decoder), so projected reads check only what they read. The table, the row count of every group
and a remote object's version are cached in the ``.zsum`` sidecar (beside the file, in
``index_dir`` or in the cache directory); later opens of a file with the same size and mtime
read only the sidecar (and, remote, ask the object's version). ``describe()`` gives each file's
format, size, rows, groups, footer digest and the sha256 of its table.

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

import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon.errors import FetchError
from zephon.sources.arrow_layout import (
    COLUMN,
    PARQUET,
    CorruptFile,
    FileInfo,
    digest_file,
    group_name,
    ipc_file_layout,
    ipc_stream_layout,
    parquet_layout,
    read_span,
)
from zephon.sources.arrow_reader import GroupReader, RangeChanged
from zephon.sources.arrow_rows import table_rows
from zephon.sources.files import FileOptions, FileSource, PathsArg, read_sidecar
from zephon.validation import check_int

if TYPE_CHECKING:  # pyarrow is imported when a file is first touched, not with zephon.sources
    import pyarrow as pa
    from typing_extensions import Unpack

__all__ = ["ArrowSource", "table_rows"]

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


class ArrowSource(FileSource):
    """Rows of Parquet and Arrow IPC (file, Feather v2, stream) files, read by row group / record
    batch with an optional ``columns`` projection; see the module docstring for the layout,
    identity, payload rule and error rules.

    Invariant: ``read`` returns exactly the rows whose bytes were digested when the metadata was
    read, or raises ``FetchError`` naming the file and pointer; it never silently returns a
    shorter or different stream.

    Every file source also takes the ``FileOptions`` (``dataset_id``, ``chunk_size``,
    ``shuffle``, ``seed``, ``passes``, the metadata caches, ``filesystem``, ``threads``, the
    storage deadlines ``timeout`` and ``total_timeout``, and the shard ``cache``).
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
        columns: Sequence[str] | None = None,
        readahead: int = 64 << 20,
        **options: Unpack[FileOptions],
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
        super().__init__(paths, **options)
        self._infos: list[FileInfo] = []
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
        return self.open_random(path)

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

        def one(i: int) -> FileInfo:
            info: FileInfo = self.with_retries(
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

    def _scan(self, i: int) -> FileInfo:
        """File ``i``'s info: its cached one when it was stored for this size and mtime (and, for
        remote data, the object's version now: one metadata request), else from its footer and
        its whole content, digested now and cached."""
        entry = self.files()[i]
        size, mtime_ns = entry.size, entry.mtime_ns or 0
        cached, where = self._cached(i, size, mtime_ns)
        if cached is not None and self.is_local:
            cached.location = where
            return cached
        try:
            f = self.open_file(entry.path)
        except OSError as exc:
            raise self.os_error(exc, i) from exc
        try:
            version = self.object_version(i, f)
            if cached is not None and cached.version == version and self.cache_can_tell(i, version):
                cached.location = where
                return cached
            size = f.size()
            head = read_span(f, 0, min(8, size)).to_pybytes()
            if head[:4] == b"PAR1":
                layout = parquet_layout(f, size)
            elif head[:6] == b"ARROW1":
                layout = ipc_file_layout(f, size)
            elif head[:4] == b"\xff\xff\xff\xff":
                layout = ipc_stream_layout(f, size)
            else:
                raise CorruptFile(
                    f"not a Parquet or Arrow IPC file (starts with {head!r}; expected b'PAR1', "
                    "b'ARROW1' or an IPC stream continuation marker)"
                )
            info = digest_file(f, layout, size, mtime_ns)
            info.version = version
            info.columns = layout.columns
            info.labels = layout.labels
            info.location = self.store_sidecar(
                i, ".zsum", _ZSUM_TAG, size, mtime_ns, info.sections()
            )
        except CorruptFile as exc:
            raise self.fetch_error(i, str(exc)) from None
        except OSError as exc:
            raise self.os_error(exc, i) from exc
        except _malformed() as exc:
            raise self.fetch_error(i, f"corrupt metadata: {type(exc).__name__}: {exc}") from exc
        finally:
            f.close()
        if layout.metadata is not None:
            self.remember_parquet_metadata(i, layout.metadata)
        return info

    def _cached(self, i: int, size: int, mtime_ns: int) -> tuple[FileInfo | None, str | None]:
        # The first intact stored info of file i for this size and mtime, and where it is.
        for where in self.sidecar_candidates(i, ".zsum"):
            found = read_sidecar(where, _ZSUM_TAG, size, mtime_ns)
            info = None if found is None else FileInfo.from_sections(found, size, mtime_ns)
            if info is not None:
                return info, where
        return None, None

    def file_info(self, i: int) -> FileInfo:
        """The layout of file ``i`` read when the metadata was loaded."""
        return self._infos[i]

    def parquet_metadata(self, i: int) -> Any:
        """File ``i``'s Parquet footer when it is still cached, else None."""
        with self._cache_lock:
            return self._parquet_meta.get(i)

    def remember_parquet_metadata(self, i: int, md: Any) -> None:
        """Keep file ``i``'s Parquet footer (the most recently used few are kept)."""
        with self._cache_lock:
            self._parquet_meta[i] = md
            self._parquet_meta.move_to_end(i)
            while len(self._parquet_meta) > self.METADATA_CACHE:
                self._parquet_meta.popitem(last=False)

    # --------------------------------------------------------------------- reading
    def read_file(
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
                f"{self.paths[i]!r}: {group_name(info, at[1])}"
            )

        self.with_retries(lambda: self._read_file_once(i, positions, rows, local, out, at), what)

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
        reader: GroupReader | None = None
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
                        reader = self._open_checked(i, pointer)
                        # The groups read, in order: each run's first (np.unique would import
                        # numpy.ma, some 7 ms, on each worker process's first read).
                        firsts = np.concatenate(([0], bounds))
                        self._read_ahead(i, groups[firsts].tolist(), rows[positions[firsts]], at)
                    table = reader.read_group(g)
                    expected = int(info.group_ends[g] - group_starts[g])
                    if table.num_rows != expected:
                        raise CorruptFile(
                            f"it holds {table.num_rows} rows, its metadata said {expected}"
                        )
                    self._cache_group(i, g, table)
                payloads = table_rows(table, local[sel] - group_starts[g], names)
                for pos, payload in zip(sel.tolist(), payloads, strict=True):
                    out[pos] = payload
        except FetchError:
            raise
        except RangeChanged as exc:
            start, end = info.table.span(exc.k)
            raise self.fetch_error(
                i,
                f"{group_name(info, g)}: {info.label(exc.k, g)} (bytes {start}..{end}) changed "
                f"since its metadata was read (its bytes no longer match their digest); "
                f"{self._rebuild_hint(i)}",
                pointer,
            ) from None
        except CorruptFile as exc:
            raise self.fetch_error(i, f"{group_name(info, g)}: {exc}", pointer) from None
        except OSError as exc:
            raise self.os_error(exc, i, at[0]) from exc
        except _malformed() as exc:
            raise self.fetch_error(
                i, f"{group_name(info, g)}: {type(exc).__name__}: {exc}", pointer
            ) from exc
        finally:
            if reader is not None:
                reader.close()

    def _rebuild_hint(self, i: int) -> str:
        # Reads get here when the file kept its size and mtime (else the size or the version
        # check, or a new source, would have seen it): a new source would trust the cached
        # digests again, so the cache entry has to go first.
        info = self._infos[i]
        if info.location is not None:
            return (
                f"if the new content is intended, delete {info.location!r} (its cached digests), "
                "then build a new source"
            )
        return "build a new source"

    def _open_checked(self, i: int, pointer: np.ndarray) -> GroupReader:
        """Open file ``i`` for group reads, after checking it still has the size and the store
        version its digests were taken at (every range read is then checked against its
        digest)."""
        info = self._infos[i]
        f = self.open_file(self.files()[i].path)
        try:
            self.check_version(i, f, info.version, pointer)
            size = f.size()
            if size != info.size:
                raise self.fetch_error(
                    i,
                    f"the file changed since its metadata was read ({info.num_rows} rows in "
                    f"{len(info.group_ends)} groups, {info.size} bytes -> now {size} bytes); "
                    "build a new source (its fingerprint will differ from old checkpoints)",
                    pointer,
                )
            return GroupReader(self, i, f)
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
        super().drop_read_caches()
        with self._cache_lock:
            self._groups.clear()
            self._ahead.clear()
            self._ahead_bytes = 0

    def describe(self) -> dict[str, Any]:
        """Class, chunking/shuffle parameters, columns, and per file its name relative to the
        dataset root, format, size, row count, group count, the digest of its footer and group
        layout, and the sha256 of its digest table (its content): no absolute path, scheme, mtime
        or store version, so the same files moved or copied to a bucket keep the identity, and a
        file rewritten (even with the same footer), grown, added or removed does not."""
        out = self.describe_files()
        out["columns"] = None if self.columns is None else list(self.columns)
        out["files"] = [
            {
                "name": entry.name,
                "format": info.kind,
                "size": info.size,
                "rows": info.num_rows,
                "groups": len(info.group_ends),
                "footer": info.layout_digest(),
                "content_sha256": info.identity,
            }
            for entry, info in zip(self.files(), self._infos, strict=True)
        ]
        return out

    def _read_ahead(self, i: int, groups: list[int], pointers: np.ndarray, at: list[Any]) -> None:
        """Fetch, concurrently, the raw ranges (projected columns only) of the remote Parquet
        ``groups`` this read needs (``pointers``: the first row read in each) and of the groups
        after them, up to ``readahead`` bytes in all; reads then take them from memory (each
        still checked against its digest). A range that cannot be fetched fails the read when
        its group is needed, naming that group and its pointer in ``at``; one fetched ahead of
        need is left for the read of its own group, and so is every range not fetched yet."""
        info = self._infos[i]
        cached = self.cache is not None
        if self.is_local or cached or info.kind != PARQUET or self.readahead <= 0 or not groups:
            return  # a cached file is read whole from the cache
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
            picked = np.flatnonzero((info.roles == COLUMN) & (info.range_groups == g))
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
        # Once a fetch failed, the others are not made: on a storage that does not answer each
        # would wait out a request's deadline. What a group needs is then fetched by its read.
        failed = threading.Event()

        def fetch_range(k: int) -> tuple[int, bytes | OSError | None]:
            if failed.is_set():
                return k, None
            a, b = info.table.span(k)
            try:
                f = self.open_file(path)
                try:
                    return k, f.read_at(b - a, a)
                finally:
                    f.close()
            except OSError as exc:
                failed.set()
                return k, exc

        for k, data in self.parallel(fetch_range, ranges):
            if data is None:
                continue
            if not isinstance(data, OSError):
                self._keep_ahead(i, k, data)
                continue
            g = int(info.range_groups[k])
            if g in groups:
                at[0], at[1] = pointers[groups.index(g)], g
                raise data

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
