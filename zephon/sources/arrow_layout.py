"""What an Arrow or Parquet file holds, known without decoding its data: its format and groups
(read from the footer, or an IPC stream's schema message, on every open), and the digest table
of its byte ranges with the role, group and column of each (taken once from the whole file, then
kept in its ``.zsum`` sidecar)."""

from __future__ import annotations

import hashlib
import itertools
import struct
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from zephon.sources.files import DigestTable, content_digest, section_text, text_section

if TYPE_CHECKING:  # pyarrow is imported when a file is first touched, not with zephon.sources
    import pyarrow as pa

PARQUET = "parquet"
IPC_FILE = "arrow_file"
IPC_STREAM = "arrow_stream"
KINDS = (PARQUET, IPC_FILE, IPC_STREAM)

# What a digested range of a file holds (one role per range in a FileInfo).
FOOTER, SCHEMA, DICTIONARY, BATCH, COLUMN = range(5)


def read_span(f: pa.NativeFile, offset: int, nbytes: int) -> pa.Buffer:
    """``nbytes`` bytes of ``f`` at ``offset``: zero-copy from a memory map."""
    f.seek(offset)
    return f.read_buffer(nbytes)


class CorruptFile(Exception):
    """Raised inside a scan or read; becomes a FetchError naming the file."""


class FileLayout(NamedTuple):
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


class FileInfo:
    """What is known of one file: its format, size, mtime and store version (``""`` for a local
    file) when its digests were taken, the row count of each group, its columns, and its digest
    table with the role, group and column of each range. Invariant: the table was taken from the
    bytes the footer here describes."""

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
        "version",
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
        self.version = ""

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
        return bool((self.roles == DICTIONARY).any())

    def label(self, k: int, group: int) -> str:
        """What range ``k`` holds, for an error met while reading group ``group``."""
        role, g, c = int(self.roles[k]), int(self.range_groups[k]), int(self.range_columns[k])
        if role == FOOTER:
            return "the footer"
        if role == SCHEMA:
            return "the schema message"
        if role == DICTIONARY:
            return "a dictionary batch"
        if role == BATCH:
            return "its record batch message" if g == group else group_name(self, g)
        other = "" if g == group else f"{group_name(self, g)}, "
        column = self.labels[c] if 0 <= c < len(self.labels) else f"#{c}"
        return f"{other}{'column chunk' if self.kind == PARQUET else 'column'} {column!r}"

    def sections(self) -> list[np.ndarray]:
        """The sidecar form: kind and group count, group rows, the table, roles, groups, columns,
        which digests were taken (all: sidecars of older versions may hold some not taken), and
        the column names, labels and store version."""
        meta = np.array([KINDS.index(self.kind), len(self.group_ends)], dtype=np.int64)
        rows = np.asarray(self.group_rows(), dtype=np.int64)
        taken = np.ones(len(self.table), dtype=np.int64)
        extra = [self.roles, self.range_groups, self.range_columns, taken]
        names = text_section([list(self.columns), list(self.labels), self.version])
        return [meta, rows, *self.table.sections(), *extra, names]

    @classmethod
    def from_sections(cls, sections: list[np.ndarray], size: int, mtime_ns: int) -> FileInfo | None:
        """The info a sidecar holds, or None when its sections are not a consistent table with
        every digest taken."""
        if len(sections) != 10 or len(sections[0]) != 2:
            return None
        (kind, groups), rows, starts, lengths, digests, roles, range_groups, columns, taken = (
            np.array(s) for s in sections[:9]
        )
        try:
            names, labels, *version = section_text(sections[9])
        except (ValueError, TypeError):
            return None
        if len(taken) != len(starts) or not taken.all():
            return None
        table = DigestTable(starts, lengths, digests)
        n = len(table)
        if not 0 <= kind < len(KINDS) or groups != len(rows) or (rows < 0).any():
            return None
        if (
            not table.is_well_formed(size)
            or not len(roles) == len(range_groups) == len(columns) == n
        ):
            return None
        if n and (roles.min() < FOOTER or roles.max() > COLUMN or range_groups.max() >= groups):
            return None
        info = cls(KINDS[kind], size, mtime_ns, rows, table, roles, range_groups, columns)
        info.columns = tuple(str(n) for n in names)
        info.labels = tuple(str(n) for n in labels)
        info.version = str(version[0]) if version else ""
        return info

    def anchor_range(self) -> int:
        """The range holding the footer (an IPC stream: its schema message)."""
        return self.first_range(SCHEMA if self.kind == IPC_STREAM else FOOTER)

    def layout_digest(self) -> str:
        """What identifies the file's content without reading its data: the digest of its footer
        (an IPC stream: of its schema message) and the row count of every group."""
        h = hashlib.sha256(b"zephon footer 1")
        h.update(int(self.table.digests[self.anchor_range()]).to_bytes(8, "little", signed=True))
        h.update(np.ascontiguousarray(self.group_ends, dtype="<i8").tobytes())
        return h.hexdigest()[:32]


def group_name(info: FileInfo, g: int) -> str:
    """``row group g`` or ``record batch g``, as errors name a group of the file."""
    return f"{'row group' if info.kind == PARQUET else 'record batch'} {g}"


def parquet_footer(f: pa.NativeFile, size: int) -> tuple[bytes, Any]:
    """(footer bytes, parsed FileMetaData) of a Parquet file, reading the footer bytes only."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    # One read of the file's end usually holds the whole footer: a round trip on remote storage.
    end = f.read_at(min(size, 1 << 14), size - min(size, 1 << 14)) if size >= 12 else b""
    tail = end[-8:]
    if tail[4:] != b"PAR1":
        raise CorruptFile(
            f"truncated or corrupt Parquet file: no PAR1 magic at its end ({size} bytes)"
        )
    (meta_len,) = struct.unpack("<I", tail[:4])
    if meta_len + 12 > size:
        raise CorruptFile(
            f"truncated or corrupt Parquet file: footer of {meta_len} bytes in {size} bytes"
        )
    if meta_len + 8 <= len(end):
        footer = end[len(end) - 8 - meta_len :]
    else:
        footer = f.read_at(meta_len, size - 8 - meta_len) + tail
    # The thrift footer parses on its own: a magic-framed copy avoids pyarrow's speculative
    # 64 KiB tail read, so metadata costs only the footer's bytes.
    return footer, pq.read_metadata(pa.BufferReader(b"PAR1" + footer))


def parquet_layout(f: pa.NativeFile, size: int) -> FileLayout:
    """A Parquet file's layout, from its footer alone."""
    footer, md = parquet_footer(f, size)
    rows = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
    if sum(rows) != md.num_rows:
        raise CorruptFile(f"row groups hold {sum(rows)} rows, footer says {md.num_rows}")
    names = tuple(md.schema.to_arrow_schema().names)
    leaves = tuple(md.schema.column(c).path for c in range(md.num_columns))
    return FileLayout(
        PARQUET,
        names,
        leaves,
        (size - len(footer), size),
        content_digest(footer),
        rows,
        None,
        None,
        md,
    )


def ipc_file_layout(f: pa.NativeFile, size: int) -> FileLayout:
    """An Arrow IPC file's layout, from its footer alone."""
    import pyarrow as pa

    tail = read_span(f, size - 10, 10).to_pybytes() if size >= 18 else b""
    if tail[4:] != b"ARROW1":
        raise CorruptFile(
            f"truncated or corrupt Arrow IPC file: no ARROW1 magic at its end ({size} bytes)"
        )
    (footer_len,) = struct.unpack("<i", tail[:4])
    if footer_len <= 0 or footer_len + 18 > size:
        raise CorruptFile(f"truncated or corrupt Arrow IPC file: footer of {footer_len} bytes")
    start = size - 10 - footer_len
    reader = pa.ipc.open_file(f)  # reads the footer only
    names = tuple(reader.schema.names)
    return FileLayout(
        IPC_FILE,
        names,
        names,
        (start, size),
        content_digest(read_span(f, start, size - start)),
        None,
        reader.num_record_batches,
        reader.schema,
        None,
    )


def ipc_stream_layout(f: pa.NativeFile, size: int) -> FileLayout:
    """An Arrow IPC stream's layout, from its schema message (its groups are known only once
    the whole stream has been read)."""
    import pyarrow as pa

    f.seek(0)
    try:
        message = pa.ipc.MessageReader.open_stream(f).read_next_message()
    except StopIteration:
        message = None
    if message is None or message.type != "schema":
        raise CorruptFile("corrupt Arrow IPC stream: it does not start with a schema message")
    end = f.tell()
    schema = pa.ipc.read_schema(message)
    names = tuple(schema.names)
    return FileLayout(
        IPC_STREAM,
        names,
        names,
        (0, end),
        content_digest(read_span(f, 0, end)),
        None,
        None,
        schema,
        None,
    )


def digest_file(f: pa.NativeFile, layout: FileLayout, size: int, mtime_ns: int) -> FileInfo:
    """Read the whole file once: the ranges of its digest table, their digests and (IPC) the row
    count of every record batch."""
    footer_start = layout.anchor[0]
    if layout.kind == PARQUET:
        spans = [*_parquet_spans(layout.metadata, footer_start), _footer_span(layout)]
        rows = layout.group_rows
    else:
        stream = layout.kind == IPC_STREAM
        spans, walked = _ipc_spans(f, 0 if stream else 8, None if stream else footer_start, layout)
        if not stream:
            spans.append(_footer_span(layout))
        if None in walked or (layout.groups is not None and len(walked) != layout.groups):
            rows = _ipc_rows(f, layout)  # dictionary batches: count with the full reader
        else:
            rows = [n for n in walked if n is not None]
        if len(rows) != len(walked):
            raise CorruptFile(f"{len(rows)} record batches decode, {len(walked)} were found")
    starts, lengths, roles, groups, columns = _table_columns(spans)
    try:
        table = DigestTable.build(lambda at, n: read_span(f, at, n), starts, lengths)
    except EOFError:
        raise CorruptFile("the file is shorter than its metadata says") from None
    info = FileInfo(layout.kind, size, mtime_ns, rows, table, roles, groups, columns)
    k = info.first_range(SCHEMA if layout.kind == IPC_STREAM else FOOTER)
    if table.span(k) != layout.anchor or table.digests[k] != layout.anchor_digest:
        raise CorruptFile("the file changed while its digests were being taken")
    return info


def _footer_span(layout: FileLayout) -> tuple[int, int, int, int, int]:
    """The span of a file's footer (Parquet's, or an IPC file's), from its layout's anchor."""
    start, end = layout.anchor
    return (start, end - start, FOOTER, -1, -1)


def _table_columns(spans: list[tuple[int, int, int, int, int]]) -> list[list[int]]:
    """The non-empty ``spans`` in file order as five columns (starts, lengths, roles, groups,
    leaf columns); ``CorruptFile`` when two of them overlap."""
    spans = sorted(s for s in spans if s[1] > 0)
    for (a, n, *_), (b, *_) in itertools.pairwise(spans):
        if b < a + n:
            raise CorruptFile(f"bytes {a}..{a + n} and {b}.. of its metadata overlap")
    return [list(c) for c in zip(*spans, strict=True)]


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
                raise CorruptFile(
                    f"row group {g}, column chunk {chunk.path_in_schema!r} lies outside the "
                    f"file's data (bytes {start}..{start + length}, footer at {footer_start})"
                )
            spans.append((start, length, COLUMN, g, c))
    return spans


def _ipc_spans(
    f: pa.NativeFile, start: int, stop: int | None, layout: FileLayout
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
                raise CorruptFile(
                    f"truncated Arrow IPC stream: no end-of-stream marker ({len(rows)} record "
                    f"batches read, {f.size()} bytes)"
                ) from None
            break
        except (pa.ArrowException, OSError) as exc:
            raise CorruptFile(
                f"truncated or corrupt Arrow IPC data: the message at byte {pos} runs past the "
                f"end or is malformed ({exc})"
            ) from None
        end = f.tell()
        if stop is not None and end > stop:
            raise CorruptFile(f"the message at byte {pos} runs into the footer")
        if message.type == "schema":
            spans.append((pos, end - pos, SCHEMA, -1, -1))
        elif message.type == "dictionary":
            spans.append((pos, end - pos, DICTIONARY, -1, -1))
        elif message.type == "record batch":
            batch_spans, count = _batch_spans(message, pos, end, layout.schema, len(rows))
            spans += batch_spans
            rows.append(count)
        else:
            raise CorruptFile(f"unexpected {message.type!r} message at byte {pos}")
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

    whole = [(pos, end - pos, BATCH, g, -1)]
    try:
        batch = pa.ipc.read_record_batch(message, schema)
    except pa.ArrowException:  # dictionary columns need the dictionaries: keep it whole
        return whole, None
    body = message.body
    body_size = 0 if body is None else body.size
    if not body_size:
        return whole, batch.num_rows
    body_start = end - body_size
    spans = [(pos, body_start - pos, BATCH, g, -1)]
    done = 0
    for j, column in enumerate(batch.columns):
        buffers = [b for b in column.buffers() if b is not None and b.size]
        if not buffers:
            continue
        lo = min(b.address for b in buffers) - body.address
        hi = max(b.address + b.size for b in buffers) - body.address
        if lo < done or hi > body_size:  # decompressed elsewhere, or interleaved: keep it whole
            return whole, batch.num_rows
        spans.append((body_start + lo, hi - lo, COLUMN, g, j))
        done = hi
    return spans, batch.num_rows


def ipc_options(fields: list[int] | None = None) -> pa.ipc.IpcReadOptions:
    """IPC read options: the given fields only (all when None), decoded on the calling thread
    (see the module docstring)."""
    import pyarrow as pa

    return pa.ipc.IpcReadOptions(included_fields=fields, use_threads=False)


def _ipc_rows(f: pa.NativeFile, layout: FileLayout) -> list[int]:
    # Row count of every record batch, in reading order, decoding one column of each.
    import pyarrow as pa

    options = ipc_options([0] if layout.columns else None)
    if layout.kind == IPC_FILE:
        reader = pa.ipc.open_file(f, options=options)
        return [reader.get_batch(k).num_rows for k in range(reader.num_record_batches)]
    f.seek(0)
    return [batch.num_rows for batch in pa.ipc.open_stream(f, options=options)]
