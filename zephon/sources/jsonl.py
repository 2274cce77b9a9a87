"""JsonlSource: JSON Lines files, read through a line index built once per file.

A sample is a non-blank line: lines that are empty or hold only whitespace (space, tab, CR) are
skipped wherever they are, so a trailing newline or blank lines at the end add no samples.

The line index. Each file is cut into blocks of whole lines of about ``BLOCK_BYTES``: a block
starts at the first line that starts in each ``BLOCK_BYTES``-aligned window of the file (block 0
at byte 0), and the last one ends at the end of the file, so every byte is in exactly one block.
For each block the index holds its byte range, its content digest and the number of its first
sample. It is built once per file by a block scan and stored as the ``.zidx`` sidecar (beside the
file or in ``index_dir``; see ``zephon.sources.files``), checked against the file's size and mtime
(and a remote object's version) and its own checksum when read back, so a stale or damaged index
is rebuilt.

Reading. Sample ``j`` of a file lives in the block whose first sample is the last one ``<= j``;
the block is read whole, hashed and compared with its digest, and its lines are found again in
those verified bytes, where their number must be the one the index says. So a file changed since
its index was built, or an index damaged since it was loaded, raises ``FetchError`` (naming the
file, the block and the pointer, and the index file when the index is at fault) instead of
returning another line. A random read costs about one block of I/O and hashing.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon.sources.files import (
    DigestTable,
    FileOptions,
    FileSource,
    PathsArg,
    read_sidecar,
    section_text,
    text_section,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["FileSource", "JsonlSource", "scan_line_starts"]

#: Read size of the line scan that builds an index.
SCAN_BLOCK = 1 << 20

_ZIDX_TAG = b"ZEPHIDX2"
_WHITESPACE = np.zeros(256, dtype=bool)
_WHITESPACE[[0x20, 0x09, 0x0A, 0x0D]] = True  # JSON's insignificant whitespace
_BLANK = b" \t\r"  # what a blank line may hold besides its newline


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


def block_layout(
    line_starts: np.ndarray, size: int, block_bytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(starts, lengths, first_samples)`` of the blocks of a file of ``size`` bytes whose samples
    start at ``line_starts`` (see the module docstring): every byte in one block, every block but
    a blank file's holding at least one sample."""
    if size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    if line_starts.size == 0:
        return np.array([0], np.int64), np.array([size], np.int64), np.array([0], np.int64)
    window = line_starts // block_bytes
    first = np.concatenate(([0], np.flatnonzero(np.diff(window)) + 1)).astype(np.int64)
    starts = line_starts[first].astype(np.int64)
    starts[0] = 0
    lengths = np.diff(np.append(starts, size)).astype(np.int64)
    return starts, lengths, first


class _LineIndex:
    """The line index of one file (see the module docstring): its blocks (a ``DigestTable``), the
    first sample of each, the sample count, the file size, mtime and store version (``""`` for a
    local file) it was built for, its identity (the sha256 of the block table) and the ``.zidx``
    holding it (or None: in memory only).

    Pickles without its arrays when it has a ``.zidx``: the new process reads the file again
    (checked against size, mtime, checksum and identity) instead of receiving a copy.
    """

    __slots__ = (
        "blocks",
        "first_samples",
        "identity",
        "location",
        "mtime_ns",
        "samples",
        "size",
        "version",
    )

    def __init__(
        self,
        blocks: DigestTable,
        first_samples: np.ndarray,
        samples: int,
        size: int,
        mtime_ns: int,
        location: str | None,
        version: str = "",
    ):
        self.blocks: DigestTable | None = blocks
        self.first_samples: np.ndarray | None = first_samples
        self.samples = samples
        self.size = size
        self.mtime_ns = mtime_ns
        self.identity = blocks.identity()
        self.location = location
        self.version = version

    def __getstate__(self) -> tuple[Any, ...]:
        keep = self.location is None
        blocks = self.blocks if keep else None
        first = self.first_samples if keep else None
        return (
            blocks,
            first,
            self.samples,
            self.size,
            self.mtime_ns,
            self.identity,
            self.location,
            self.version,
        )

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        blocks, first, self.samples, self.size, self.mtime_ns, self.identity = state[:6]
        self.location, self.version = state[6:]
        self.blocks, self.first_samples = blocks, first
        if blocks is None and self.location is not None:
            again = _read_zidx(self.location, self.size, self.mtime_ns)
            if again is not None and again.identity == self.identity:
                self.blocks, self.first_samples = again.blocks, again.first_samples

    def __len__(self) -> int:
        return self.samples

    def block_of(self, sample: int) -> int:
        """The block holding the file's sample ``sample``."""
        assert self.first_samples is not None
        return int(np.searchsorted(self.first_samples, sample, side="right")) - 1

    def samples_in(self, block: int) -> int:
        """How many samples block ``block`` holds."""
        first = self.first_samples
        assert first is not None
        end = int(first[block + 1]) if block + 1 < len(first) else self.samples
        return end - int(first[block])


def _read_zidx(where: str, size: int, mtime_ns: int) -> _LineIndex | None:
    """The index stored at ``where`` when it is intact, built for a file of this size and mtime,
    and its layout is consistent; None otherwise (the caller rebuilds it). Its store version is
    ``""`` when it holds none (a local file, or an index written before versions were kept)."""
    sections = read_sidecar(where, _ZIDX_TAG, size, mtime_ns)
    if sections is None or len(sections) not in (5, 6) or len(sections[0]) != 1:
        return None
    # [samples, version (not in indexes of older versions), starts, lengths, digests, first]
    meta, starts, lengths, digests, first = sections[:1] + sections[-4:]
    try:
        version = str(section_text(sections[1])) if len(sections) == 6 else ""
    except ValueError:
        return None
    samples = int(meta[0])
    blocks = DigestTable(starts, lengths, digests)
    if not blocks.is_well_formed(size) or len(first) != len(blocks):
        return None
    if len(blocks):
        ends = blocks.starts + blocks.lengths
        covers = (
            blocks.starts[0] == 0 and ends[-1] == size and (blocks.starts[1:] == ends[:-1]).all()
        )
        counted = (first[0] == 0 and (np.diff(first) > 0).all() and first[-1] < samples) or (
            samples == 0 and len(blocks) == 1 and first[0] == 0
        )
        if not (covers and counted):
            return None
    elif size or samples:
        return None
    return _LineIndex(blocks, first, samples, size, mtime_ns, where, version)


class JsonlSource(FileSource):
    """JSON Lines files; the payload of a sample is its line parsed by ``json.loads`` (any JSON
    value, usually a dict). See the module docstring for the line index and how reads are checked.

    ``describe()`` gives, per file, its size, sample count and the sha256 of its block table —
    covering every byte, never the mtime — so a file changed anywhere gets a new fingerprint and
    a copied dataset keeps its own.

    Invariant: a read either returns exactly the indexed line, parsed, or raises ``FetchError``
    (malformed JSON names the file, 1-based line number and pointer; a changed file or a damaged
    index names the block, and the index file when it is at fault).

    Every file source also takes the ``FileOptions`` (``dataset_id``, ``chunk_size``,
    ``shuffle``, ``seed``, ``passes``, the metadata caches, ``filesystem``, ``threads``, the
    storage deadlines ``timeout`` and ``total_timeout``, and the shard ``cache``).
    """

    #: Target size of an index block (one page): what a random read costs in I/O and hashing,
    #: against 32 bytes of index per block.
    BLOCK_BYTES = 4 << 10
    SUFFIXES = (".jsonl", ".ndjson", ".json")

    def __init__(self, paths: PathsArg, **options: Unpack[FileOptions]) -> None:
        super().__init__(paths, **options)
        self._indexes: list[_LineIndex] = []

    # --------------------------------------------------------------------- index
    def index_path(self, file_index: int) -> str:
        """Where the line index of file ``file_index`` is stored: ``<file>.zidx`` beside it, or in
        ``index_dir`` as ``<name>.<hash of the absolute path>.zidx``."""
        return self.sidecar_path(file_index, ".zidx")

    def index_locations(self) -> list[str | None]:
        """Per file, the ``.zidx`` its index was loaded from or written to, or None when the index
        lives in memory only (its directory was not writable)."""
        self.file_ends()
        return [ix.location for ix in self._indexes]

    def load_metadata(self) -> list[int]:
        """Load or build the line index of every file (in parallel for remote data, each
        retried on transient errors); returns the sample count of each."""
        self._indexes = self.index_every_file(self._load_index)
        return [len(ix) for ix in self._indexes]

    def _open(self, i: int) -> Any:
        # A binary file object with read/seek: a plain local file, or a pyarrow remote file.
        entry = self.files()[i]
        if self.is_local:
            return open(entry.path, "rb")
        return self.open_random(entry.path)

    def _stat(self, i: int, fh: Any) -> tuple[int, int]:
        # (size, mtime_ns) of the open file; remote: the size now, the mtime of the listing.
        if self.is_local:
            st = os.fstat(fh.fileno())
            return st.st_size, st.st_mtime_ns
        return fh.size(), self.files()[i].mtime_ns or 0

    def _load_index(self, i: int) -> _LineIndex:
        try:
            with self._open(i) as fh:
                size, mtime_ns = self._stat(i, fh)
                version = self.object_version(i, fh)
                usable = self.cache_can_tell(i, version)
                for where in self.sidecar_candidates(i, ".zidx"):
                    index = _read_zidx(where, size, mtime_ns)
                    if index is not None and index.version == version and usable:
                        return index
                fh.seek(0)
                starts = scan_line_starts(fh)
                layout = block_layout(starts, size, self.BLOCK_BYTES)
                blocks = DigestTable.build(_reader_at(fh), layout[0], layout[1])
                after: tuple[int, int] | None = self._stat(i, fh)
        except OSError as exc:
            raise self.os_error(exc, i) from exc
        except EOFError:
            after = None
        if after != (size, mtime_ns):
            raise self.fetch_error(i, "the file changed while its line index was being built")
        first = layout[2]
        count = np.array([len(starts)], dtype=np.int64)
        sections = [count, text_section(version), *blocks.sections(), first]
        location = self.store_sidecar(i, ".zidx", _ZIDX_TAG, size, mtime_ns, sections)
        return _LineIndex(blocks, first, len(starts), size, mtime_ns, location, version)

    # --------------------------------------------------------------------- reading
    def read_file(
        self,
        i: int,
        positions: np.ndarray,
        rows: np.ndarray,
        local: np.ndarray,
        out: list[Any],
    ) -> None:
        index = self._indexes[i]
        first = index.first_samples
        if index.blocks is None or first is None:  # unpickled; the .zidx changed meanwhile
            raise self.fetch_error(
                i,
                f"its line index {index.location!r} changed since this source was pickled; "
                "build a new source",
                rows[positions[0]],
            )
        at = [int(positions[0])]

        def what() -> str:
            pointer = tuple(int(v) for v in rows[at[0]])
            return f"JsonlSource cannot read pointer {pointer} from {self.paths[i]!r}"

        self.with_retries(lambda: self._read_file_once(i, positions, rows, local, out, at), what)

    def _read_file_once(
        self,
        i: int,
        positions: np.ndarray,
        rows: np.ndarray,
        local: np.ndarray,
        out: list[Any],
        at: list[int],
    ) -> None:
        index = self._indexes[i]
        first = index.first_samples
        assert index.blocks is not None and first is not None
        pos = int(positions[0])
        try:
            with self._open(i) as fh:
                self.check_version(i, fh, index.version, rows[pos])
                size, mtime_ns = self._stat(i, fh)
                if (size, mtime_ns) != (index.size, index.mtime_ns):
                    raise self.fetch_error(
                        i,
                        f"the file changed since its line index was built (size {index.size} -> "
                        f"{size}, mtime_ns {index.mtime_ns} -> {mtime_ns}); build a "
                        "new source (its fingerprint will differ from old checkpoints)",
                        rows[pos],
                    )
                block = -1
                data = b""
                sample_starts: list[int] = []
                for pos in positions.tolist():
                    at[0] = pos
                    sample = int(local[pos])
                    b = index.block_of(sample)
                    if b != block:
                        block = b
                        data, sample_starts = self._read_block(i, fh, index, b, rows[pos])
                    s = sample_starts[sample - int(first[b])]
                    nl = data.find(b"\n", s)
                    line = data[s:] if nl < 0 else data[s : nl + 1]
                    try:
                        out[pos] = json.loads(line)
                    except (ValueError, RecursionError) as exc:  # also UnicodeDecodeError
                        lineno = _line_number(fh, index.blocks.span(b)[0] + s)
                        raise self.fetch_error(
                            i, f"line {lineno} is not valid JSON: {exc}", rows[pos]
                        ) from None
        except OSError as exc:
            raise self.os_error(exc, i, rows[pos]) from exc

    def _read_block(
        self, i: int, fh: Any, index: _LineIndex, b: int, pointer: np.ndarray
    ) -> tuple[bytes, list[int]]:
        # Block b, checked against its digest, and the offsets of its samples within it.
        blocks = index.blocks
        assert blocks is not None
        start, end = blocks.span(b)
        fh.seek(start)
        data = fh.read(end - start)
        if not blocks.matches(b, data):
            raise self.fetch_error(
                i, f"block {b} (bytes {start}..{end}) {self._mismatch(index)}", pointer
            )
        sample_starts = _sample_starts(data)
        if len(sample_starts) != index.samples_in(b):
            raise self.fetch_error(
                i,
                f"its line index {index.location!r} does not match the file: block {b} (bytes "
                f"{start}..{end}) holds {len(sample_starts)} samples, the index says "
                f"{index.samples_in(b)}; delete the index so it is rebuilt",
                pointer,
            )
        return data, sample_starts

    def _mismatch(self, index: _LineIndex) -> str:
        # Why a block's bytes differ from its digest: the index is damaged when it no longer
        # passes its own checksum, else the file changed behind an index that kept its mtime.
        damaged = index.location is not None and (
            _read_zidx(index.location, index.size, index.mtime_ns) is None
        )
        if damaged:
            return (
                f"does not match its line index {index.location!r}, which is damaged; "
                "delete it and build a new source"
            )
        new_source = "build a new source (its fingerprint will differ from old checkpoints)"
        if index.location is not None:  # reads only get here when size and mtime are unchanged
            new_source = f"delete {index.location!r}, then {new_source}"
        return (
            "no longer matches the digest taken when the line index was built: the file changed "
            f"since, keeping its size and mtime; {new_source}"
        )

    def describe(self) -> dict[str, Any]:
        """Class, chunking/shuffle parameters, paths, and per file its size, sample count and the
        sha256 of its block table (its content)."""
        out = self.describe_files()
        out["files"] = [
            {"name": entry.name, "size": ix.size, "lines": len(ix), "content_sha256": ix.identity}
            for entry, ix in zip(self.files(), self._indexes, strict=True)
        ]
        return out


def _sample_starts(block: bytes) -> list[int]:
    # Offsets of the non-blank lines of a block of whole lines: the rule of scan_line_starts,
    # cheaper on a few kilobytes than the vectorized scan.
    out = []
    at = 0
    for line in block.split(b"\n"):
        if line.strip(_BLANK):
            out.append(at)
        at += len(line) + 1
    return out


def _reader_at(fh: Any) -> Any:
    def read_at(offset: int, nbytes: int) -> bytes:
        fh.seek(offset)
        return fh.read(nbytes)

    return read_at


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
