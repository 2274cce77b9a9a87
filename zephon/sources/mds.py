"""MDSSource: Mosaic Streaming's MDS directories (``index.json`` and its shards), read by our own
decoder: the ``streaming`` package is never imported.

Layout. ``index.json`` lists the shards in order, each with its columns (names, encodings, fixed
sizes), sample count, raw file and, when compressed, the compressed file actually stored. A raw
shard is a little-endian uint32 sample count, ``count + 1`` uint32 byte offsets of the samples,
the writer's configuration, then the samples; a sample holds one uint32 size per column without
a fixed size, then every column's bytes in column order. ``shard_id`` is the shard's place in the
index and ``sample_idx`` the global sample index, as for every ``FileSource``.

Encodings decoded: ``bytes``, ``str``, ``int`` (Python int), ``int8`` .. ``uint64`` and
``float16`` .. ``float64`` (numpy scalars), ``str_int``, ``str_float``, ``str_decimal``
(``decimal.Decimal``), ``json``, ``ndarray`` with or without a fixed dtype and shape (a numpy
array, copied out of the shard), and ``pkl`` only with ``allow_pickle=True``: unpickling runs
code the data chooses, so a pickled column is a ``PlanError`` otherwise (leave it out with
``columns=``). Images are given as ``zephon.ops.decode_images`` takes them, never decoded here
(the source needs no Pillow): ``jpeg`` and ``png`` as the encoded file's ``bytes``,
``list[jpeg]``, ``list[png]`` and ``jpeg_array`` (or ``jpegarray``) as a list of them, ``pil``
(raw pixels) as a ``RawImage`` and ``list[pil]`` as a list of those
(``zephon.sources.image_values`` has the layouts). A count or size that does not fit the value
is a ``FetchError`` naming the shard, the sample and the column. Any other encoding is a
``PlanError`` naming its column.

Identity. The stored file of every shard is digested once in ``BLOCK_BYTES`` blocks (cached in
a ``.zsum`` sidecar keyed by its size, mtime and the store's version of it; never trusted when
the store gives neither mtime nor version); ``describe()`` carries, per shard, the sha256 of
those digests and of its index entry, so a rewritten shard or index changes the fingerprint.

Reading. Only the samples asked for are read. A raw local shard is memory-mapped; a raw remote
shard is read in whole checked blocks (``zephon.sources.block_reads``). A compressed shard
(``zstd``; needs the ``zstandard`` or ``zstd`` module) is fetched and decompressed whole, its
compressed bytes checked against their digests first, and memory-mapped from its inflated copy.
With a ``ShardCache`` (``cache=``) that copy is an entry of the cache, keyed by the stored file's
URI plus ``INFLATED_SUFFIX``, the compressed content's identity and the raw size: bounded by
``max_bytes`` with the downloads, evicted least recently used, shared by every process through
the cache's locks, and held open while any buffer read from it is alive. Without one it goes to
the cache directory (``cache_dir``, else ``$ZEPHON_CACHE_DIR``...), where it is kept for later
runs and never evicted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import posixpath
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon.errors import FetchError, PlanError
from zephon.sources.block_reads import ChangedBlock, block_table, read_spans, regular_table
from zephon.sources.files import (
    DigestTable,
    FileOptions,
    read_sidecar,
    section_text,
    text_section,
)
from zephon.sources.image_values import encoded_images, raw_image
from zephon.sources.locations import DataFile, default_cache_dir
from zephon.sources.mapped_files import ChangedFile, MappedFiles, map_bytes
from zephon.sources.remote import is_transient
from zephon.sources.shard_cache import CachedShard
from zephon.sources.shard_layouts import ShardLayoutSource

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Column", "MDSSource", "zstd_decompress"]

_SUM_TAG = b"ZMDSSUM1"
_SCALARS = {
    name: np.dtype(name).newbyteorder("<")
    for name in (
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
}
#: ``ndarray`` value dtypes by the code the writer stores when the column has no fixed dtype.
_NDARRAY_DTYPES = {
    8: "uint8",
    9: "int8",
    16: "uint16",
    17: "int16",
    18: "float16",
    32: "uint32",
    33: "int32",
    34: "float32",
    64: "uint64",
    65: "int64",
    66: "float64",
}
_SHAPE_DTYPES = {0: "<u1", 1: "<u2", 2: "<u4", 3: "<u8"}
_STR_DECODERS = {"str_int": int, "str_float": float, "str_decimal": Decimal}
#: Image encodings: where a list's count is (after a placeholder uint32 for ``list[...]``), and
#: whether its images are raw pixels.
_IMAGE_LISTS = {
    "list[jpeg]": (4, False),
    "list[png]": (4, False),
    "list[pil]": (4, True),
    "jpeg_array": (0, False),
    "jpegarray": (0, False),
}
_IMAGES = frozenset({"jpeg", "png", "pil", *_IMAGE_LISTS})


@dataclass
class Column:
    """One column of a shard's samples: its name, encoding and size."""

    name: str
    encoding: str
    size: int | None  # fixed size in bytes, or None: a size in each sample's head


@dataclass
class _Shard:
    """One shard: its stored file's digests, where its raw bytes are read from, the sample
    offsets and its identity."""

    samples: int
    stored: DigestTable
    compressed: bool
    raw_path: str  # the stored file, the decompressed copy in cache_dir, or "" (in the cache)
    raw_size: int
    offsets: np.ndarray  # uint32, samples + 1
    identity: str


class MDSSource(ShardLayoutSource[_Shard]):
    """A Mosaic MDS directory (``path``: the directory holding ``index.json``, or that file):
    one sample per row, its payload ``{column: value}`` for ``columns`` (all, in index order,
    when None). See the module docstring for encodings, identity and reads.

    Invariant: a read returns exactly the values the writer wrote, or raises ``FetchError``
    naming the shard, the sample and the column.

    Every file source also takes the ``FileOptions`` (``dataset_id``, ``chunk_size``,
    ``shuffle``, ``seed``, ``passes``, the metadata caches, ``filesystem``, ``threads``, the
    storage deadlines ``timeout`` and ``total_timeout``, and the shard ``cache``).
    """

    BLOCK_BYTES = 1 << 20
    #: The cache directory's subdirectory of decompressed shards (without a ``ShardCache``).
    INFLATED_DIR = "mds"
    #: What a decompressed shard's ``ShardCache`` entry adds to its stored file's URI, so the
    #: entry is never taken for the compressed download of that file.
    INFLATED_SUFFIX = "#inflated"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        columns: list[str] | None = None,
        allow_pickle: bool = False,
        **options: Unpack[FileOptions],
    ) -> None:
        super().__init__(path, **options)
        if len(self._locations.paths) != 1:
            raise ValueError("MDSSource: give one MDS directory (or its index.json)")
        if columns is not None and (
            isinstance(columns, str) or not all(isinstance(c, str) for c in columns)
        ):
            raise TypeError(f"MDSSource: columns must be a list of str, got {columns!r}")
        self.columns = None if columns is None else list(columns)
        self.allow_pickle = bool(allow_pickle)
        self._entries: list[dict[str, Any]] = []
        self._selected: list[Column] = []
        self._all_columns: list[Column] = []
        self._wanted: frozenset[str] = frozenset()
        self._variable_columns = 0
        self._maps = MappedFiles()

    # --------------------------------------------------------------------- the index
    def list_files(self) -> tuple[str, list[DataFile]]:
        locations = self._locations
        root = locations.paths[0]
        if root.endswith("index.json"):
            root = posixpath.dirname(root)
        index_path = posixpath.join(root, "index.json")

        def load() -> bytes:
            try:
                with locations.filesystem.open_input_stream(index_path) as fh:
                    return bytes(fh.read())
            except OSError as exc:
                if not self.is_local and is_transient(exc):
                    raise
                raise FetchError(
                    f"{type(self).__name__} cannot read {locations.uri(index_path)!r}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc

        name = type(self).__name__
        raw: bytes = self.with_retries(load, lambda: f"{name} reading {index_path!r}")
        entries = self.index_entries(raw, locations.uri(index_path))
        if not entries:
            raise FetchError(f"{name}: {locations.uri(index_path)!r} lists no shard")
        self._entries = entries
        names = [self.stored_name(k, e, index_path) for k, e in enumerate(entries)]
        paths = [posixpath.join(root, n) for n in names]

        def stat(p: str) -> Any:
            # One shard's metadata, retried on transient errors as the index's read is.
            def once() -> Any:
                try:
                    return locations.filesystem.get_file_info(p)
                except OSError as exc:
                    if not self.is_local and is_transient(exc):
                        raise
                    raise FetchError(
                        f"{name} cannot read {locations.uri(p)!r}: {type(exc).__name__}: {exc}"
                    ) from exc

            return self.with_retries(once, lambda: f"{name} reading {locations.uri(p)!r}")

        import pyarrow.fs as pafs

        infos = self.parallel(stat, paths)
        files = []
        for stored, p, info in zip(names, paths, infos, strict=True):
            if info.type != pafs.FileType.File:
                raise FetchError(
                    f"{name}: shard {locations.uri(p)!r} listed in {index_path!r} is missing"
                )
            files.append(DataFile(p, locations.uri(p), stored, int(info.size), info.mtime_ns))
        return locations.uri(root), files

    def index_entries(self, raw: bytes, index_uri: str) -> list[dict[str, Any]]:
        """The shard entries of the index file's bytes, in order; FetchError when it is not an
        index of this format. A format with another index (LitData's) overrides it."""
        try:
            index = json.loads(raw)
            entries = index["shards"]
            assert isinstance(entries, list)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise FetchError(
                f"MDSSource: {index_uri!r} is not an MDS index (a JSON object with a 'shards' list)"
            ) from None
        return entries

    def stored_name(self, k: int, entry: Any, index_path: str) -> str:
        """The name of the file shard ``k`` is stored in, relative to the index; FetchError for
        an entry this source cannot read."""
        try:
            if entry["format"] != "mds":
                raise FetchError(
                    f"MDSSource: shard {k} of {index_path!r} has format {entry['format']!r}; "
                    "only 'mds' shards are read"
                )
            int(entry["samples"]), int(entry["raw_data"]["bytes"])
            compression = entry.get("compression")
            if compression is None:
                return str(entry["raw_data"]["basename"])
            if str(compression).split(":")[0] != "zstd":
                raise FetchError(
                    f"MDSSource: shard {k} of {index_path!r} is compressed with {compression!r}; "
                    "only zstd and uncompressed shards are read"
                )
            return str(entry["zip_data"]["basename"])
        except (KeyError, TypeError, ValueError):
            raise FetchError(
                f"MDSSource: shard {k} of {index_path!r} lacks its format, samples, raw_data or "
                "zip_data; write the index again"
            ) from None

    def column_names(self) -> list[str]:
        """Every column of the dataset, in index order."""
        self.file_ends()
        return [c.name for c in self._all_columns]

    def load_metadata(self) -> list[int]:
        """Check the columns, then load each shard's offsets and digests (in parallel for
        remote data); the sample count of each."""
        self._all_columns = self.columns_of(self._entries)
        by_name = {c.name: c for c in self._all_columns}
        wanted = self.columns if self.columns is not None else list(by_name)
        unknown = [c for c in wanted if c not in by_name]
        if unknown:
            raise PlanError(
                f"MDSSource: no column {unknown} in {self.root!r}; it has {list(by_name)}"
            )
        self._selected = [by_name[c] for c in wanted]
        self._wanted = frozenset(wanted)
        self._variable_columns = sum(c.size is None for c in self._all_columns)
        for col in self._selected:
            self.check_encoding(col)

        shards = self.load_shards()
        return [s.samples for s in shards]

    def columns_of(self, entries: list[dict[str, Any]]) -> list[Column]:
        """Every column of the shards ``entries`` describe, in the order samples hold them."""
        layouts = {
            json.dumps([e.get("column_names"), e.get("column_encodings"), e.get("column_sizes")])
            for e in entries
        }
        if len(layouts) > 1:
            raise FetchError(
                f"MDSSource: the shards of {self.root!r} do not share one set of columns; read "
                "each set with its own source"
            )
        if not entries:
            return []
        e = entries[0]
        return [
            Column(n, enc, None if size is None else int(size))
            for n, enc, size in zip(
                e["column_names"], e["column_encodings"], e["column_sizes"], strict=True
            )
        ]

    def check_encoding(self, col: Column) -> None:
        """PlanError naming ``col`` when its values cannot (or may not) be decoded."""
        enc = col.encoding
        if enc == "pkl" and not self.allow_pickle:
            raise PlanError(
                f"MDSSource: column {col.name!r} of {self.root!r} is pickled; unpickling runs "
                "whatever code the data holds. Pass allow_pickle=True only for data you trust, "
                "or leave the column out with columns="
            )
        known = {"bytes", "str", "int", "json", "pkl", *_SCALARS, *_STR_DECODERS, *_IMAGES}
        if enc not in known and enc != "ndarray" and not enc.startswith("ndarray:"):
            raise PlanError(
                f"MDSSource: column {col.name!r} has encoding {enc!r}, which Zephon does not "
                "decode; leave it out with columns="
            )

    def shard_facts(self, i: int) -> tuple[int, int | None, bool]:
        """``(samples, raw size or None when the index does not say it, compressed)`` of shard
        ``i`` from its index entry; a compressed shard is inflated whole by ``inflate``."""
        entry = self._entries[i]
        compressed = entry.get("compression") is not None
        return int(entry["samples"]), int(entry["raw_data"]["bytes"]), compressed

    def inflate(self, i: int, data: bytes) -> bytes:
        """The raw shard of the stored bytes of compressed shard ``i``."""
        return zstd_decompress(data, lambda msg: self.fetch_error(i, msg))

    def inflated_size(self, i: int, stored: DigestTable) -> int:
        """The raw size of compressed shard ``i``, known before it is inflated (the index gives
        it); a format whose index does not reads it from the stored file (``stored_bytes``)."""
        size = self.shard_facts(i)[1]
        assert size is not None, "a format without raw sizes overrides inflated_size"
        return size

    def check_stored(self, i: int) -> None:
        """Refuse shard ``i`` before its header is read when its stored layout is one this source
        does not read (none for MDS)."""

    def _load_shard(self, i: int) -> _Shard:
        entry = self._entries[i]
        f = self.files()[i]
        self.check_stored(i)
        samples, size, compressed = self.shard_facts(i)
        raw_size = f.size if size is None else size
        try:
            stored = self._stored_table(i)
            if compressed and self.cache is not None:
                raw_path, raw_size = "", self.inflated_size(i, stored)
                inflated = self._inflated(i, stored, raw_size)
                header = self._parse_header(i, bytes(inflated[: 4 * (samples + 2)]), samples)
                del inflated  # let go of the cache entry
            else:
                if compressed:
                    raw_path = self._decompressed(i, stored, size)
                    raw_size = os.path.getsize(raw_path)
                    local = True
                else:
                    raw_path, local = f.path, self.is_local
                header = self._read_header(i, raw_path, local, samples)
        except OSError as exc:
            raise self.os_error(exc, i) from exc
        if not compressed and f.size != raw_size:
            raise self.fetch_error(
                i, f"the shard holds {f.size} bytes, its index entry says {raw_size}"
            )
        offsets = header
        bad = offsets[-1] != raw_size or (np.diff(offsets.astype(np.int64)) < 0).any()
        if bad or offsets[0] < 4 * (samples + 2):
            raise self.fetch_error(
                i, "its sample offsets do not fit the shard; it is damaged: write it again"
            )
        identity = hashlib.sha256(b"zephon mds shard 1")
        identity.update(json.dumps(entry, sort_keys=True).encode())
        identity.update(stored.identity().encode())
        return _Shard(
            samples, stored, compressed, raw_path, raw_size, offsets, identity.hexdigest()
        )

    def _stored_table(self, i: int) -> DigestTable:
        # The sidecar stands for the file only when its size and mtime, or the store's version
        # of the object, would show a rewrite (``cache_can_tell``); else the file is digested.
        f = self.files()[i]
        mtime = f.mtime_ns or 0
        with self.open_random(f.path) as fh:
            version = self.object_version(i, fh)
            if self.cache_can_tell(i, version):
                for where in self.sidecar_candidates(i, ".zsum"):
                    table = self._sidecar_table(where, f.size, mtime, version)
                    if table is not None:
                        return table
            table = block_table(fh, f.size, self.BLOCK_BYTES)
        meta = np.array([self.BLOCK_BYTES], dtype=np.int64)
        sections = [meta, table.digests, text_section([version])]
        self.store_sidecar(i, ".zsum", _SUM_TAG, f.size, mtime, sections)
        return table

    def _sidecar_table(self, where: str, size: int, mtime: int, version: str) -> DigestTable | None:
        # The block digests a ``.zsum`` holds for this size, mtime and version; None otherwise.
        sections = read_sidecar(where, _SUM_TAG, size, mtime)
        if sections is None or len(sections) != 3 or len(sections[0]) != 1:
            return None
        try:
            if section_text(sections[2]) != [version]:
                return None
        except ValueError:
            return None
        block = int(sections[0][0])
        if block != self.BLOCK_BYTES or len(sections[1]) != -(-size // block):
            return None
        return regular_table(size, block, sections[1])

    def stored_bytes(self, i: int, stored: DigestTable, end: int) -> bytes:
        """The first ``end`` bytes of shard ``i``'s stored file, checked against its digests."""
        f = self.files()[i]
        with self.open_random(f.path) as fh:
            try:
                (data,) = read_spans(fh, stored, self.BLOCK_BYTES, [0], [min(end, f.size)])
            except ChangedBlock as changed:
                raise self.fetch_error(
                    i, f"{changed} no longer matches the digest taken when it was indexed"
                ) from None
        return data

    def _inflate_stored(self, i: int, stored: DigestTable, raw_size: int | None) -> bytes:
        # The raw shard, from its stored bytes checked against their digests.
        raw = self.inflate(i, self.stored_bytes(i, stored, self.files()[i].size))
        if raw_size is not None and len(raw) != raw_size:
            raise self.fetch_error(
                i, f"decompresses to {len(raw)} bytes, its index entry says {raw_size}"
            )
        return raw

    def _decompressed(self, i: int, stored: DigestTable, raw_size: int | None) -> str:
        # Without a ShardCache: the raw shard, decompressed once into the cache directory and
        # named after its compressed content (written whole, then renamed: a copy there is
        # complete); kept for later runs, never evicted.
        f = self.files()[i]
        key = stored.identity()[:20]
        name = type(self).__name__
        root_key = hashlib.sha256(f"{name} {self.root}".encode()).hexdigest()[:20]
        where = os.path.join(self.cache_dir or default_cache_dir(), self.INFLATED_DIR, root_key)
        target = os.path.join(where, f"{posixpath.basename(f.path)}.{key}.raw")
        with contextlib.suppress(OSError):
            have = os.path.getsize(target)
            if raw_size is None or have == raw_size:
                return target
        raw = self._inflate_stored(i, stored, raw_size)
        os.makedirs(where, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".zephon-", dir=where)
        with os.fdopen(fd, "wb") as out:
            out.write(raw)
        os.replace(tmp, target)
        return target

    def _inflated(self, i: int, stored: DigestTable, raw_size: int) -> np.ndarray:
        # With a ShardCache: the raw shard from its entry in the cache (inflated into it when
        # missing, or in memory this once when the cache has no room), as a read-only uint8
        # array that holds the entry open until it and every view of it are gone.
        cache = self.cache
        assert cache is not None
        if raw_size > cache.max_bytes:
            raise self.fetch_error(
                i,
                f"it decompresses to {raw_size} bytes, more than {cache!r} holds (a compressed "
                "shard is read from its decompressed copy, kept in that cache); raise max_bytes "
                "above the largest decompressed shard, or read this data without cache=",
            )

        def download(write: Callable[[bytes], None]) -> int:
            raw = self._inflate_stored(i, stored, raw_size)
            write(raw)
            return len(raw)

        def direct() -> Any:
            import pyarrow as pa

            return pa.BufferReader(pa.py_buffer(self._inflate_stored(i, stored, raw_size)))

        uri = self.files()[i].uri + self.INFLATED_SUFFIX
        opened = cache.open(uri, stored.identity(), raw_size, download, direct)
        try:
            opened.seek(0)
            return _held_bytes(opened.read_buffer(raw_size), opened)
        except BaseException:
            opened.close()
            raise

    def _read_header(self, i: int, path: str, local: bool, samples: int) -> np.ndarray:
        want = 4 * (samples + 2)
        if local:
            with open(path, "rb") as fh:
                head = fh.read(want)
        else:
            with self.open_random(path) as fh:
                head = bytes(fh.read_at(want, 0))
        return self._parse_header(i, head, samples)

    def _parse_header(self, i: int, head: bytes, samples: int) -> np.ndarray:
        # The sample offsets of a raw shard's first 4 * (samples + 2) bytes.
        want = 4 * (samples + 2)
        if len(head) != want or int(np.frombuffer(head[:4], "<u4")[0]) != samples:
            raise self.fetch_error(
                i, f"its header does not hold the {samples} samples its index entry says"
            )
        return np.frombuffer(head, "<u4", offset=4).copy()

    # --------------------------------------------------------------------- reading
    def read_file(
        self,
        i: int,
        positions: np.ndarray,
        rows: np.ndarray,
        local: np.ndarray,
        out: list[Any],
    ) -> None:
        shard = self._shard(i)
        idx = local[positions]
        starts = shard.offsets[idx].astype(np.int64).tolist()
        ends = shard.offsets[idx + 1].astype(np.int64).tolist()
        if shard.compressed or self.is_local:
            data = self._mapped(i, shard, rows[positions[0]]).data
            samples: list[Any] = [data[a:e] for a, e in zip(starts, ends, strict=True)]
        else:
            samples = self.read_retried(
                i, lambda: self._fetch(i, shard, starts, ends, rows[positions[0]])
            )
        for k, (pos, sample) in enumerate(zip(positions.tolist(), samples, strict=True)):
            out[pos] = self.decode_sample(i, memoryview(sample), rows[positions[k]], int(idx[k]))

    def _fetch(
        self, i: int, shard: _Shard, starts: list[int], ends: list[int], pointer: np.ndarray
    ) -> list[bytes]:
        try:
            with self.open_random(self.files()[i].path) as fh:
                return read_spans(fh, shard.stored, self.BLOCK_BYTES, starts, ends)
        except OSError as exc:
            raise self.os_error(exc, i, pointer) from exc
        except ChangedBlock as changed:
            raise self.fetch_error(
                i,
                f"{changed} no longer matches the digest taken when it was indexed: the shard "
                "changed; build a new source (its fingerprint will differ from old checkpoints)",
                pointer,
            ) from None

    def _mapped(self, i: int, shard: _Shard, pointer: np.ndarray) -> np.ndarray:
        # The raw shard memory-mapped (kept for the next reads); a local uncompressed shard is
        # checked against the size and mtime it was indexed at on every read. A compressed
        # shard read through a ShardCache is mapped from its cache entry, which the cache keeps
        # open between reads as it does its downloads.
        if shard.compressed and self.cache is not None:

            def inflated() -> np.ndarray:
                try:
                    return self._inflated(i, shard.stored, shard.raw_size)
                except OSError as exc:
                    raise self.os_error(exc, i, pointer) from exc

            data: np.ndarray = self.read_retried(i, inflated)
            return data
        mtime = None if shard.compressed else self.files()[i].mtime_ns
        path = shard.raw_path
        try:
            return self._maps.get(i, path, (shard.raw_size, mtime), lambda: map_bytes(path))
        except OSError as exc:
            raise self.os_error(exc, i, pointer) from exc
        except ChangedFile:
            raise self.fetch_error(
                i,
                f"{path!r} changed since it was indexed; build a new source (its "
                "fingerprint will differ from old checkpoints)",
                pointer,
            ) from None

    def decode_sample(
        self, i: int, sample: memoryview, pointer: np.ndarray, idx: int
    ) -> dict[str, Any]:
        """The payload of sample ``idx`` of shard ``i`` from its bytes (``pointer``: its row, for
        errors)."""
        columns = self._all_columns
        n_var = self._variable_columns
        sizes = np.frombuffer(sample, "<u4", count=n_var).tolist() if n_var else []
        at = 4 * n_var
        wanted = self._wanted
        values: dict[str, Any] = {}
        v = 0
        for col in columns:
            if col.size is None:
                size = sizes[v]
                v += 1
            else:
                size = col.size
            if at + size > len(sample):
                raise self.fetch_error(
                    i,
                    f"sample {idx} ends inside column {col.name!r}; the shard is damaged",
                    pointer,
                )
            if col.name in wanted:
                try:
                    values[col.name] = _decode_value(col.encoding, sample[at : at + size])
                except (
                    ValueError,
                    IndexError,  # an array's dtype code or shape cut off
                    UnicodeDecodeError,
                    InvalidOperation,
                    pickle.UnpicklingError,
                ) as exc:
                    raise self.fetch_error(
                        i,
                        f"sample {idx}, column {col.name!r} ({col.encoding}) cannot be decoded: "
                        f"{type(exc).__name__}: {exc}",
                        pointer,
                    ) from None
            at += size
        return {c.name: values[c.name] for c in self._selected}

    def drop_read_caches(self) -> None:
        """Unmap the shards kept mapped between reads."""
        super().drop_read_caches()
        self._maps.clear()

    # --------------------------------------------------------------------- identity
    def describe(self) -> dict[str, Any]:
        """Chunking parameters, the columns read, and per shard its name, samples, compression
        and content identity (stored bytes and index entry)."""
        out = self.describe_files()
        out["columns"] = [[c.name, c.encoding] for c in self._selected]
        out["files"] = [
            {
                "name": f.name,
                "samples": self._shard(k).samples,
                "compression": self._entries[k].get("compression"),
                "content_sha256": self._shard(k).identity,
            }
            for k, f in enumerate(self.files())
        ]
        return out


def _held_bytes(buffer: Any, holder: CachedShard) -> np.ndarray:
    """``buffer`` (a pyarrow buffer) as a read-only uint8 array whose views all keep ``holder``
    open: it is closed (its cache entry released) once the last of them is gone."""
    import pyarrow as pa

    if not buffer.size:
        holder.close()
        return np.zeros(0, dtype=np.uint8)
    held = pa.foreign_buffer(buffer.address, buffer.size, base=(buffer, holder))
    return np.frombuffer(held, dtype=np.uint8)


def _decode_value(encoding: str, data: memoryview) -> Any:
    """One column's value from its bytes, as the MDS writer encoded it."""
    if encoding == "str":
        return str(data, "utf-8")
    if encoding == "bytes":
        return bytes(data)
    if encoding == "int":
        return int(np.frombuffer(data, "<i8")[0])
    scalar = _SCALARS.get(encoding)
    if scalar is not None:
        return np.frombuffer(data, scalar)[0]
    parse = _STR_DECODERS.get(encoding)
    if parse is not None:
        return parse(str(data, "utf-8"))
    if encoding == "json":
        return json.loads(str(data, "utf-8"))
    if encoding == "pkl":
        return pickle.loads(data)
    if encoding in ("jpeg", "png"):
        return bytes(data)
    if encoding == "pil":
        return raw_image(data)
    listed = _IMAGE_LISTS.get(encoding)
    if listed is not None:
        return _image_list(data, *listed)
    return _decode_ndarray(encoding, data)


def _image_list(data: memoryview, at: int, raw: bool) -> list[Any]:
    # A list of images: each one's encoded bytes, or its RawImage for raw pixels.
    images = encoded_images(data, at)
    if not raw:
        return [bytes(image) for image in images]
    out = []
    for k, image in enumerate(images):
        try:
            out.append(raw_image(image))
        except ValueError as exc:
            raise ValueError(f"image {k} of the list: {exc}") from None
    return out


def _decode_ndarray(encoding: str, data: memoryview) -> np.ndarray:
    # ndarray[:dtype[:shape]]: what the header does not fix is stored before the values.
    parts = encoding.split(":")
    at = 0
    if len(parts) > 1 and parts[1]:
        dtype = parts[1]
    else:
        code = data[at]
        at += 1
        if code not in _NDARRAY_DTYPES:
            raise ValueError(f"unknown ndarray dtype code {code}")
        dtype = _NDARRAY_DTYPES[code]
    if len(parts) > 2 and parts[2]:
        shape: tuple[int, ...] = tuple(int(d) for d in parts[2].split(","))
    else:
        byte = data[at]
        at += 1
        ndim, kind = byte >> 2, byte % 4
        shape_dtype = np.dtype(_SHAPE_DTYPES[kind])
        shape = tuple(int(d) for d in np.frombuffer(data, shape_dtype, count=ndim, offset=at))
        at += ndim * shape_dtype.itemsize
    values = np.frombuffer(data, np.dtype(dtype).newbyteorder("<"), offset=at)
    return values.reshape(shape).copy()


def zstd_decompress(data: bytes, error: Any) -> bytes:
    """The bytes zstd ``data`` holds; ``error(message)`` makes what is raised when it is not
    zstd or no zstd module is installed."""
    # The zstd module the MDS writer uses (``zstd``), else ``zstandard``: needed for compressed
    # shards only, imported when one is read.
    try:
        import zstandard

        return bytes(zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 40))
    except ImportError:
        pass
    except Exception as exc:
        raise error(f"is not valid zstd data: {exc}") from None
    try:
        import zstd
    except ImportError:
        raise error(
            "is compressed with zstd; install zstandard (pip install zstandard) to read it"
        ) from None
    try:
        return bytes(zstd.decompress(data))
    except Exception as exc:
        raise error(f"is not valid zstd data: {exc}") from None
