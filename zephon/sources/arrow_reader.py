"""Reading one group of an open Arrow or Parquet file, with every byte pyarrow decodes from a
digested range checked against its digest first."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any, Protocol

from zephon.sources.arrow_layout import (
    BATCH,
    IPC_FILE,
    PARQUET,
    SCHEMA,
    CorruptFile,
    ipc_options,
    parquet_footer,
    read_span,
)
from zephon.sources.files import DigestTable

if TYPE_CHECKING:  # pyarrow is imported when a file is first touched, not with zephon.sources
    import pyarrow as pa

    from zephon.sources.arrow_layout import FileInfo


class GroupSource(Protocol):
    """What a ``GroupReader`` needs of its source (``ArrowSource``)."""

    columns: Any

    def file_info(self, i: int) -> FileInfo: ...

    def take_ahead(self, i: int, k: int) -> Any: ...

    def parquet_metadata(self, i: int) -> Any: ...

    def remember_parquet_metadata(self, i: int, md: Any) -> None: ...


class RangeChanged(Exception):
    """Raised by ``_CheckedFile`` when range ``k`` no longer matches its digest."""

    def __init__(self, k: int):
        super().__init__(k)
        self.k = k


class GroupReader:
    """One open file of an ArrowSource for the duration of a ``read``: decodes single groups with
    the source's column projection, through a ``_CheckedFile``."""

    def __init__(self, source: GroupSource, i: int, f: pa.NativeFile):
        import pyarrow as pa

        self.source = source
        self.i = i
        self.info = source.file_info(i)
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
                self._impl = pa.ipc.open_file(self.file, options=ipc_options(idx))
                if self._impl.num_record_batches != len(info.group_ends):
                    raise CorruptFile(
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
        md = source.parquet_metadata(self.i)
        if md is None:
            md = parquet_footer(self.file, self.info.size)[1]
            source.remember_parquet_metadata(self.i, md)
        # Page CRCs are checked when the writer stored them (write_page_checksum=True).
        return pq.ParquetFile(self.file, metadata=md, page_checksum_verification=True)

    def _stream_batch(self, g: int) -> pa.RecordBatch:
        import pyarrow as pa

        info = self.info
        if info.has_dictionaries():  # dictionaries live in earlier messages: walk the stream
            if self._impl is None or self._impl[0] > g:
                self.file.seek(0)
                self._impl = [0, pa.ipc.open_stream(self.file, options=ipc_options())]
            while self._impl[0] < g:
                self._impl[1].read_next_batch()
                self._impl[0] += 1
            self._impl[0] += 1
            return self._impl[1].read_next_batch()
        if self._impl is None:
            self.file.seek(info.table.span(info.first_range(SCHEMA))[0])
            self._impl = pa.ipc.read_schema(pa.ipc.read_message(self.file))
        self.file.seek(info.table.span(info.first_range(BATCH, g))[0])
        return pa.ipc.read_record_batch(pa.ipc.read_message(self.file), self._impl)

    def close(self) -> None:
        """Close the file."""
        self.file.close()


class _CheckedFile(io.RawIOBase):
    """A read-only file object over an open file, for pyarrow's readers: every byte inside a
    digested range is served from that whole range, copied once out of the file and matched
    against its digest first; bytes outside every range (magic numbers, padding) pass through.

    Invariant: nothing pyarrow decodes from a digested range differs from what was digested; a
    range that does not match raises ``RangeChanged``, which pyarrow passes through to the caller.
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
                parts.append(read_span(self._f, at, a - at))
                at = a
            stop = min(b, end)
            parts.append(self._range(k)[at - a : stop - a])
            at = stop
        if at < end:
            parts.append(read_span(self._f, at, end - at))
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
        if not self._table.matches(k, data):
            raise RangeChanged(k)
        self._loaded = (k, memoryview(data))
        return self._loaded[1]
