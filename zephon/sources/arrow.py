"""ArrowSource (SPEC §1.4): Parquet files and Arrow IPC files (file/Feather v2 and stream format).

Layout. ``shard_id`` is the file index in ``paths`` and ``sample_idx`` the *global* row index
across all files in order (see ``FileSource``), so a shuffled pass permutes every row of every
file. A file is split into *groups*: its Parquet row groups, or its IPC record batches.

Metadata. On first need (``num_samples``, ``describe``, ``chunk``, ``read``) each file's format is
detected by its magic bytes (``PAR1`` at both ends: Parquet; ``ARROW1`` at both ends: IPC file;
a ``0xFFFFFFFF`` continuation marker first: IPC stream) and only its footer is read: the Parquet
FileMetaData, or the IPC footer's block table plus each record batch's message header (never a
batch body, so compressed Feather files are not decompressed to count rows). An IPC stream has no
footer: its message headers are walked, skipping bodies, and it must end with the end-of-stream
marker. Each file is fingerprinted by its size and a sha256 of its footer (of its message headers
for a stream).

Reading. ``read`` groups pointers by file and group, reads only the groups they touch (with the
``columns`` projection pushed into the Parquet/IPC reader), one group at a time, so the memory of a
read is bounded by the groups it touches; the last ``GROUP_CACHE`` decoded groups are kept so
that chunks smaller than a row group do not decode it again. Files are opened per read and closed
before it returns; at most ``METADATA_CACHE`` parsed Parquet footers are kept. A file whose size or
mtime changed since its metadata was read is checked again: if its footer or row layout differs
the read raises ``FetchError`` instead of returning other rows. Parquet page checksums are
verified when the writer stored them (``write_page_checksum=True``). With ``shuffle=True`` the
rows of a chunk are scattered over the whole dataset, so a chunk may touch up to ``chunk_size``
groups: prefer small row groups then, or read unshuffled and put a ``shuffle`` operator after
``fetch``.

Payloads. Each row becomes ``{column: value}`` in ``columns`` order (file schema order when
``columns=None``). A list column (list, large list, fixed-size list) whose values are integers,
floats or booleans becomes a 1-D numpy array of that dtype (a copy, not a view into the decoded
group), or ``None`` for a null list, or a Python list with ``None`` for nulls when the list
holds nulls (numpy integer arrays have no null). Every other value becomes the Python value
``pyarrow`` gives (``int``, ``float``, ``str`` stays ``str``, ``bytes``, ``datetime``, nested
lists and structs as lists and dicts, ``None`` for null).
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon.errors import FetchError
from zephon.sources.jsonl import FileSource, PathsArg

if TYPE_CHECKING:  # pyarrow is imported when a file is first touched, not with zephon.sources
    import pyarrow as pa

__all__ = ["ArrowSource", "table_rows"]

PARQUET = "parquet"
IPC_FILE = "arrow_file"
IPC_STREAM = "arrow_stream"

_CONTINUATION = 0xFFFFFFFF
_SCHEMA, _DICTIONARY_BATCH, _RECORD_BATCH = 1, 2, 3  # flatbuf MessageHeader union tags
_BLOCK = struct.Struct(
    "<qi4xq"
)  # flatbuf struct Block {offset: long; metaDataLength: int; bodyLength: long}


class _FileInfo:
    """What the footer of one file says: its format, identity and the row count of each group."""

    __slots__ = (
        "batch_offsets",
        "columns",
        "fingerprint",
        "group_ends",
        "has_dictionaries",
        "kind",
        "mtime_ns",
        "schema_offset",
        "size",
    )

    def __init__(
        self,
        kind: str,
        size: int,
        mtime_ns: int,
        fingerprint: str,
        group_rows: Sequence[int],
        columns: Sequence[str],
        *,
        batch_offsets: Sequence[int] = (),
        schema_offset: int = 0,
        has_dictionaries: bool = False,
    ):
        self.kind = kind
        self.size = size
        self.mtime_ns = mtime_ns
        self.fingerprint = fingerprint
        self.group_ends = np.cumsum(np.asarray(group_rows, dtype=np.int64), dtype=np.int64)
        self.columns = tuple(columns)
        self.batch_offsets = np.asarray(batch_offsets, dtype=np.int64)
        self.schema_offset = schema_offset
        self.has_dictionaries = has_dictionaries

    @property
    def num_rows(self) -> int:
        return int(self.group_ends[-1]) if self.group_ends.size else 0

    def same_data(self, other: _FileInfo) -> bool:
        """True when ``other`` (a rescan) describes the same bytes: format, fingerprint, groups."""
        return (
            self.kind == other.kind
            and self.fingerprint == other.fingerprint
            and np.array_equal(self.group_ends, other.group_ends)
        )


class _CorruptFile(Exception):
    """Raised inside a scan; becomes a FetchError naming the file."""


class ArrowSource(FileSource):
    """Rows of Parquet and Arrow IPC (file, Feather v2, stream) files, read by row group / record
    batch with an optional ``columns`` projection; see the module docstring for the layout,
    payload rule and error rules.

    Invariant: ``read`` returns exactly the rows the metadata promised, or raises ``FetchError``
    naming the file and pointer; it never silently returns a shorter or different stream.
    """

    #: Decoded (projected) groups kept across reads, so chunks smaller than a group reuse it.
    GROUP_CACHE = 2
    #: Parsed Parquet footers kept; an evicted one is read again from the file when needed.
    METADATA_CACHE = 8

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
    ) -> None:
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
        )
        self._infos: list[_FileInfo] = []
        self._reset_caches()

    def _reset_caches(self) -> None:
        self._groups: OrderedDict[tuple[int, int], pa.Table] = OrderedDict()
        self._parquet_meta: OrderedDict[int, Any] = OrderedDict()

    # --------------------------------------------------------------------- files
    def open_file(self, path: str) -> pa.NativeFile:
        """Open ``path`` for random-access reading; every byte the source reads goes through the
        file returned here (a subclass may wrap it, e.g. to count I/O)."""
        import pyarrow as pa

        return pa.OSFile(path, "r")

    def file_format(self, file_index: int) -> str:
        """``"parquet"``, ``"arrow_file"`` or ``"arrow_stream"``: the detected format of a file."""
        self.file_ends()
        return self._infos[file_index].kind

    def file_groups(self, file_index: int) -> list[int]:
        """Row counts of a file's groups (Parquet row groups or IPC record batches)."""
        self.file_ends()
        return np.diff(self._infos[file_index].group_ends, prepend=0).tolist()

    # --------------------------------------------------------------------- metadata
    def load_metadata(self) -> list[int]:
        """Read every file's footer (and check ``columns`` against it); row counts per file."""
        infos = []
        for i, path in enumerate(self.paths):
            try:
                f = self.open_file(path)
            except OSError as exc:
                raise self.os_error(exc, i) from exc
            try:
                info = self._scan(i, f)
            finally:
                f.close()
            if self.columns is not None:
                missing = [c for c in self.columns if c not in info.columns]
                if missing:
                    raise self.fetch_error(
                        i, f"it has no column(s) {missing} (its columns: {list(info.columns)})"
                    )
            infos.append(info)
        self._infos = infos
        return [info.num_rows for info in infos]

    def _scan(self, i: int, f: pa.NativeFile, pointer: np.ndarray | None = None) -> _FileInfo:
        import pyarrow as pa

        path = self.paths[i]
        try:
            mtime_ns = os.stat(path).st_mtime_ns
            size = f.size()
            head = f.read_at(min(8, size), 0)
            if head[:4] == b"PAR1":
                return self._scan_parquet(i, f, size, mtime_ns)
            if head[:6] == b"ARROW1":
                return _scan_ipc_file(f, size, mtime_ns)
            if head[:4] == b"\xff\xff\xff\xff":
                return _scan_ipc_stream(f, size, mtime_ns)
            raise _CorruptFile(
                f"not a Parquet or Arrow IPC file (starts with {head!r}; expected b'PAR1', "
                "b'ARROW1' or an IPC stream continuation marker)"
            )
        except _CorruptFile as exc:
            raise self.fetch_error(i, str(exc), pointer) from None
        except (struct.error, IndexError) as exc:
            raise self.fetch_error(i, f"corrupt Arrow metadata ({exc})", pointer) from exc
        except OSError as exc:
            raise self.os_error(exc, i, pointer) from exc
        except pa.ArrowException as exc:
            raise self.fetch_error(i, f"{type(exc).__name__}: {exc}", pointer) from exc

    def _scan_parquet(self, i: int, f: pa.NativeFile, size: int, mtime_ns: int) -> _FileInfo:
        footer, md = _parquet_footer(f, size)
        rows = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
        if sum(rows) != md.num_rows:
            raise _CorruptFile(f"row groups hold {sum(rows)} rows, footer says {md.num_rows}")
        self._remember_parquet_meta(i, md)
        fingerprint = hashlib.sha256(footer).hexdigest()
        names = md.schema.to_arrow_schema().names
        return _FileInfo(PARQUET, size, mtime_ns, fingerprint, rows, names)

    def _remember_parquet_meta(self, i: int, md: Any) -> None:
        with self._lock:
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
        import pyarrow as pa

        info = self._infos[i]
        names = self.columns if self.columns is not None else info.columns
        groups = np.searchsorted(info.group_ends, local[positions], side="right")
        group_starts = np.concatenate(([0], info.group_ends[:-1]))
        reader: _GroupReader | None = None
        pointer = rows[positions[0]]
        try:
            bounds = np.flatnonzero(np.diff(groups)) + 1  # positions are sorted by row
            for sel, in_group in zip(
                np.split(positions, bounds), np.split(groups, bounds), strict=True
            ):
                pointer = rows[sel[0]]
                g = int(in_group[0])
                table = self._cached_group(i, g)
                if table is None:
                    if reader is None:
                        reader = self._open_checked(i, pointer)
                    table = reader.read_group(g)
                    expected = int(info.group_ends[g] - group_starts[g])
                    if table.num_rows != expected:
                        raise self.fetch_error(
                            i,
                            f"group {g} holds {table.num_rows} rows, its metadata said {expected}",
                            pointer,
                        )
                    self._cache_group(i, g, table)
                payloads = table_rows(table, local[sel] - group_starts[g], names)
                for pos, payload in zip(sel.tolist(), payloads, strict=True):
                    out[pos] = payload
        except (FetchError, _CorruptFile) as exc:
            if isinstance(exc, _CorruptFile):
                raise self.fetch_error(i, str(exc), pointer) from None
            raise
        except OSError as exc:
            raise self.os_error(exc, i, pointer) from exc
        except pa.ArrowException as exc:
            raise self.fetch_error(i, f"{type(exc).__name__}: {exc}", pointer) from exc
        finally:
            if reader is not None:
                reader.close()

    def _open_checked(self, i: int, pointer: np.ndarray) -> _GroupReader:
        """Open file ``i`` for group reads, after checking it is the file the metadata describes."""
        path = self.paths[i]
        info = self._infos[i]
        f = self.open_file(path)
        try:
            if (f.size(), os.stat(path).st_mtime_ns) != (info.size, info.mtime_ns):
                fresh = self._scan(i, f, pointer)
                if not info.same_data(fresh):
                    raise self.fetch_error(
                        i,
                        f"the file changed since its metadata was read ({info.num_rows} rows in "
                        f"{len(info.group_ends)} groups, {info.size} bytes -> {fresh.num_rows} "
                        f"rows in {len(fresh.group_ends)} groups, {fresh.size} bytes); build a "
                        "new source (its fingerprint will differ from old checkpoints)",
                        pointer,
                    )
                info.mtime_ns = fresh.mtime_ns  # same bytes, touched or copied: accept
            return _GroupReader(self, i, f)
        except BaseException:
            f.close()
            raise

    def _cached_group(self, i: int, g: int) -> pa.Table | None:
        with self._lock:
            table = self._groups.get((i, g))
            if table is not None:
                self._groups.move_to_end((i, g))
            return table

    def _cache_group(self, i: int, g: int, table: pa.Table) -> None:
        if self.GROUP_CACHE <= 0:
            return
        with self._lock:
            self._groups[(i, g)] = table
            self._groups.move_to_end((i, g))
            while len(self._groups) > self.GROUP_CACHE:
                self._groups.popitem(last=False)

    def describe(self) -> dict[str, Any]:
        """Class, chunking/shuffle parameters, paths, columns, and per file its format, size, row
        count and footer fingerprint (content-based, so a copied dataset keeps its identity)."""
        out = self._describe_files()
        out["columns"] = None if self.columns is None else list(self.columns)
        out["files"] = [
            {
                "format": info.kind,
                "size": info.size,
                "rows": info.num_rows,
                "groups": len(info.group_ends),
                "footer_sha256": info.fingerprint,
            }
            for info in self._infos
        ]
        return out

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        del state["_groups"], state["_parquet_meta"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._reset_caches()


class _GroupReader:
    """One open file of an ArrowSource for the duration of a ``read``: decodes single groups with
    the source's column projection."""

    def __init__(self, source: ArrowSource, i: int, f: pa.NativeFile):
        self.source = source
        self.i = i
        self.f = f
        self.info = source._infos[i]
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
            table = self._impl.read_row_group(g, columns=wanted)
        elif info.kind == IPC_FILE:
            if self._impl is None:
                options = None
                if columns is not None:
                    idx = [info.columns.index(c) for c in columns]
                    options = pa.ipc.IpcReadOptions(included_fields=idx)
                self._impl = pa.ipc.open_file(self.f, options=options)
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
        return table

    def _parquet_file(self) -> Any:
        import pyarrow.parquet as pq

        source = self.source
        with source._lock:
            md = source._parquet_meta.get(self.i)
        if md is None:
            md = _parquet_footer(self.f, self.info.size)[1]
            source._remember_parquet_meta(self.i, md)
        # Page CRCs are checked when the writer stored them (write_page_checksum=True).
        return pq.ParquetFile(self.f, metadata=md, page_checksum_verification=True)

    def _stream_batch(self, g: int) -> pa.RecordBatch:
        import pyarrow as pa

        info = self.info
        if info.has_dictionaries:  # dictionaries live in earlier messages: walk the stream
            if self._impl is None or self._impl[0] > g:
                self.f.seek(0)
                self._impl = [0, pa.ipc.open_stream(self.f)]
            while self._impl[0] < g:
                self._impl[1].read_next_batch()
                self._impl[0] += 1
            self._impl[0] += 1
            return self._impl[1].read_next_batch()
        if self._impl is None:
            self.f.seek(info.schema_offset)
            self._impl = pa.ipc.read_schema(pa.ipc.read_message(self.f))
        self.f.seek(int(info.batch_offsets[g]))
        return pa.ipc.read_record_batch(pa.ipc.read_message(self.f), self._impl)

    def close(self) -> None:
        """Close the file."""
        self.f.close()


# ------------------------------------------------------------------------- payloads


def table_rows(table: pa.Table, indices: np.ndarray, names: Sequence[str]) -> list[dict[str, Any]]:
    """Payload dicts of rows ``indices`` of ``table``, keys in ``names`` order (see the module
    docstring for the value rule)."""
    import pyarrow as pa

    if not names:
        return [{} for _ in range(len(indices))]
    picked = table.take(pa.array(np.asarray(indices, dtype=np.int64)))
    columns = [_column_values(picked.column(name)) for name in names]
    return [dict(zip(names, values, strict=True)) for values in zip(*columns, strict=True)]


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
    import pyarrow.compute as pc

    values = arr.values  # the whole child array: offsets below index into it
    if pa.types.is_fixed_size_list(arr.type):
        k = arr.type.list_size
        offsets = (np.arange(len(arr) + 1, dtype=np.int64) + arr.offset) * k
    else:
        offsets = arr.offsets.to_numpy()
    elem_valid = None
    if values.null_count:
        elem_valid = values.is_valid().to_numpy(zero_copy_only=False)
        zero = pa.scalar(False if pa.types.is_boolean(values.type) else 0).cast(values.type)
        values_np = pc.fill_null(values, zero).to_numpy(zero_copy_only=False)
    else:
        values_np = values.to_numpy(zero_copy_only=False)
    list_null = arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count else None
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


# ------------------------------------------------------------------------- footers


def _parquet_footer(f: pa.NativeFile, size: int) -> tuple[bytes, Any]:
    """(footer bytes, parsed FileMetaData) of a Parquet file, reading the footer bytes only."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tail = f.read_at(8, size - 8) if size >= 12 else b""
    if tail[4:] != b"PAR1":
        raise _CorruptFile(
            f"truncated or corrupt Parquet file: no PAR1 magic at its end ({size} bytes)"
        )
    (meta_len,) = struct.unpack("<I", tail[:4])
    if meta_len + 12 > size:
        raise _CorruptFile(
            f"truncated or corrupt Parquet file: footer of {meta_len} bytes in {size} bytes"
        )
    footer = f.read_at(meta_len, size - 8 - meta_len) + tail
    # The thrift footer parses on its own: a magic-framed copy avoids pyarrow's speculative
    # 64 KiB tail read, so metadata costs only the footer's bytes.
    return footer, pq.read_metadata(pa.BufferReader(b"PAR1" + footer))


# ------------------------------------------------------------------------- IPC metadata


class _Table:
    """A read-only view of one flatbuffer table (just what the Arrow IPC headers need)."""

    __slots__ = ("buf", "pos", "vtable", "vtable_len")

    def __init__(self, buf: bytes, pos: int):
        self.buf = buf
        self.pos = pos
        self.vtable = pos - struct.unpack_from("<i", buf, pos)[0]
        self.vtable_len = struct.unpack_from("<H", buf, self.vtable)[0]

    @classmethod
    def root(cls, buf: bytes) -> _Table:
        return cls(buf, struct.unpack_from("<I", buf, 0)[0])

    def _field(self, i: int) -> int:
        at = 4 + 2 * i
        return (
            0
            if at + 2 > self.vtable_len
            else struct.unpack_from("<H", self.buf, self.vtable + at)[0]
        )

    def scalar(self, i: int, fmt: str) -> int:
        off = self._field(i)
        return 0 if off == 0 else struct.unpack_from(fmt, self.buf, self.pos + off)[0]

    def table(self, i: int) -> _Table | None:
        off = self._field(i)
        if off == 0:
            return None
        at = self.pos + off
        return _Table(self.buf, at + struct.unpack_from("<I", self.buf, at)[0])

    def vector(self, i: int) -> tuple[int, int]:
        """(position of the first element, length) of a vector field; (0, 0) when absent."""
        off = self._field(i)
        if off == 0:
            return 0, 0
        at = self.pos + off
        start = at + struct.unpack_from("<I", self.buf, at)[0]
        return start + 4, struct.unpack_from("<I", self.buf, start)[0]


def _message_header(meta: bytes) -> tuple[int, int, int]:
    """(header type, body length, record batch row count or 0) of an encapsulated IPC message's
    metadata (continuation marker, length, flatbuffer)."""
    cont, length = struct.unpack_from("<Ii", meta, 0)
    if cont != _CONTINUATION or length <= 0 or 8 + length > len(meta):
        raise _CorruptFile("corrupt IPC message header (pre-0.15 IPC format is not supported)")
    msg = _Table.root(meta[8 : 8 + length])
    kind = msg.scalar(1, "<B")  # Message.header_type
    body = msg.scalar(3, "<q")  # Message.bodyLength
    rows = 0
    if kind == _RECORD_BATCH:
        header = msg.table(2)  # Message.header -> RecordBatch
        rows = 0 if header is None else header.scalar(0, "<q")  # RecordBatch.length
    if body < 0 or rows < 0:
        raise _CorruptFile("corrupt IPC message header (negative length)")
    return kind, body, rows


def _scan_ipc_file(f: pa.NativeFile, size: int, mtime_ns: int) -> _FileInfo:
    import pyarrow as pa

    tail = f.read_at(10, size - 10) if size >= 18 else b""
    if tail[4:] != b"ARROW1":
        raise _CorruptFile(
            f"truncated or corrupt Arrow IPC file: no ARROW1 magic at its end ({size} bytes)"
        )
    (footer_len,) = struct.unpack("<i", tail[:4])
    if footer_len <= 0 or footer_len + 18 > size:
        raise _CorruptFile(f"truncated or corrupt Arrow IPC file: footer of {footer_len} bytes")
    footer = f.read_at(footer_len, size - 10 - footer_len)
    start, n = _Table.root(footer).vector(3)  # Footer.recordBatches: [Block]
    rows = []
    for k in range(n):
        offset, meta_len, body_len = _BLOCK.unpack_from(footer, start + _BLOCK.size * k)
        if offset < 8 or meta_len < 8 or offset + meta_len + body_len > size - 10 - footer_len:
            raise _CorruptFile(f"record batch {k} lies outside the file")
        kind, _, count = _message_header(f.read_at(meta_len, offset))
        if kind != _RECORD_BATCH:
            raise _CorruptFile(f"block {k} of the footer is not a record batch")
        rows.append(count)
    schema = pa.ipc.open_file(f).schema  # reads the footer only
    fingerprint = hashlib.sha256(footer + tail).hexdigest()
    return _FileInfo(IPC_FILE, size, mtime_ns, fingerprint, rows, schema.names)


def _scan_ipc_stream(f: pa.NativeFile, size: int, mtime_ns: int) -> _FileInfo:
    import pyarrow as pa

    digest = hashlib.sha256(f"size={size}".encode())
    pos = 0
    schema_offset = -1
    has_dictionaries = False
    offsets: list[int] = []
    rows: list[int] = []
    while True:
        head = f.read_at(8, pos)
        if len(head) < 8:
            raise _CorruptFile(
                f"truncated Arrow IPC stream: no end-of-stream marker ({len(rows)} record batches "
                f"read, {size} bytes)"
            )
        cont, length = struct.unpack("<Ii", head)
        if cont != _CONTINUATION:
            raise _CorruptFile(f"corrupt Arrow IPC stream: no continuation marker at byte {pos}")
        if length == 0:
            break
        meta = head + f.read_at(length, pos + 8)
        kind, body, count = _message_header(meta)
        digest.update(meta)
        if kind == _SCHEMA and schema_offset < 0:
            schema_offset = pos
        elif kind == _DICTIONARY_BATCH:
            has_dictionaries = True
        elif kind == _RECORD_BATCH:
            offsets.append(pos)
            rows.append(count)
        pos += 8 + length + body
        if pos > size:
            raise _CorruptFile(
                f"truncated Arrow IPC stream: message at byte {pos} runs past the end"
            )
    if schema_offset < 0:
        raise _CorruptFile("corrupt Arrow IPC stream: no schema message")
    f.seek(schema_offset)
    schema = pa.ipc.read_schema(pa.ipc.read_message(f))
    return _FileInfo(
        IPC_STREAM,
        size,
        mtime_ns,
        digest.hexdigest(),
        rows,
        schema.names,
        batch_offsets=offsets,
        schema_offset=schema_offset,
        has_dictionaries=has_dictionaries,
    )
