"""WebDatasetSource: WebDataset ``.tar`` shards, read at random through a member index built once
per shard, by our own tar reader: the ``webdataset`` package is never imported.

Samples. As WebDataset groups them: a member's *key* is its path up to the first dot of its base
name and its *field* the rest of the name (lowercased: ``a/0001.seg.png`` is key ``a/0001``,
field ``seg.png``); consecutive members of one key are one sample. Members whose base name has
no dot, metadata members (``__name__``), directories and links are not part of any sample. A
sample's payload is ``{"__key__": key, "__url__": the shard's URI, field: bytes, ...}``: each
member's bytes as written (``decode_text=True`` turns text-like fields into values, see
``TEXT_DECODERS``; images are decoded by the ``decode_images`` operator). ``shard_id`` is the
shard's place in the listing and ``sample_idx`` the global sample index, as for every
``FileSource``.

The member index. The first time a shard is seen it is read once, in order: its members are
found (``zephon.sources.tar_members``) and grouped into samples, and its bytes are digested in
``BLOCK_BYTES`` blocks. Both are cached in a ``.zidx`` sidecar (beside the shard or in
``index_dir`` / the cache directory, keyed by the shard's size and mtime, and for a remote object
by its version); ``describe()`` carries the sha256 of each shard's block digests, so a rewritten
shard changes the fingerprint.

Reading. Only the members a read asks for are read. A local shard is memory-mapped (its size and
mtime checked at every read); a remote one is read in whole checked blocks, one ranged read per
run of neighbouring blocks (``zephon.sources.block_reads``), each block compared with its digest
before a byte of it is returned. A shard changed since it was indexed raises ``FetchError``
naming it.

Errors. A malformed tar (bad checksum, truncated, compressed, a sparse member) and a sample
holding one field twice are a ``FetchError`` naming the shard and the member when the shard is
indexed. With ``columns=``, a sample lacking one of them is a ``FetchError`` naming the shard,
the sample's key, the missing field and the fields it has, when it is read (``Pipeline(
on_error={"fetch": "skip"})`` skips and counts such samples); a field no shard holds is a
``PlanError``. Without ``columns=`` each sample carries the fields it has.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon.errors import FetchError, PlanError
from zephon.sources.block_reads import ChangedBlock, read_spans, regular_table
from zephon.sources.files import (
    DigestTable,
    FileOptions,
    PathsArg,
    content_digest,
    read_sidecar,
    section_text,
    text_section,
)
from zephon.sources.mapped_files import ChangedFile, MappedFiles, map_bytes
from zephon.sources.shard_layouts import ShardLayoutSource
from zephon.sources.tar_members import MemberScan, TarFormatError
from zephon.validation import check_bool

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["TEXT_DECODERS", "WebDatasetSource"]

_IDX_TAG = b"ZWDSIDX1"
_SECTIONS = 10
#: WebDataset's split of a member path into key and field.
_KEY_AND_FIELD = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
#: Members WebDataset leaves out of every sample: metadata such as ``__index__``.
_META_MEMBER = re.compile(r"__[^/]*__($|/)")


def _text(data: bytes) -> str:
    return data.decode("utf-8")


def _number(data: bytes) -> int:
    return int(data.decode("ascii"))


def _json(data: bytes) -> Any:
    return json.loads(data)


#: What ``decode_text=True`` does to a field, by its last extension (as WebDataset's own
#: decoders): text as ``str``, class labels and indices as ``int``, JSON parsed.
TEXT_DECODERS: dict[str, Callable[[bytes], Any]] = {
    **dict.fromkeys(("txt", "text", "transcript"), _text),
    **dict.fromkeys(("cls", "cls2", "class", "count", "index", "inx", "id", "idx"), _number),
    **dict.fromkeys(("json", "jsn"), _json),
}


@dataclass
class _Shard:
    """One shard's member index: per sample its first member (``first``, samples + 1 entries)
    and key; per member its data offset, size and field (an index into ``fields``); the block
    digests of the whole file, the version it was indexed at and its identity. ``slots`` maps a
    field to its place among the fields read (-1: not read)."""

    samples: int
    fields: list[str]
    first: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    field_ids: np.ndarray
    key_ends: np.ndarray  # samples + 1 byte offsets into ``keys``
    keys: bytes
    blocks: DigestTable
    version: str
    identity: str
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def key(self, sample: int) -> str:
        """The key of the shard's sample ``sample``."""
        a, b = int(self.key_ends[sample]), int(self.key_ends[sample + 1])
        return self.keys[a:b].decode("utf-8", "surrogateescape")


class WebDatasetSource(ShardLayoutSource[_Shard]):
    """WebDataset ``.tar`` shards (files, directories, globs, URIs): one sample per key, its
    payload ``{"__key__", "__url__", field: bytes}``. See the module docstring for how members
    become samples, the member index, reads and errors.

    ``columns``: the fields to read, in this order (all of each sample's fields when None);
    ``decode_text``: decode text-like fields (``TEXT_DECODERS``) instead of giving their bytes.

    Invariant: a read returns exactly the bytes the writer stored for each member read, or
    raises ``FetchError`` naming the shard and the sample.

    Every file source also takes the ``FileOptions`` (``dataset_id``, ``chunk_size``,
    ``shuffle``, ``seed``, ``passes``, the metadata caches, ``filesystem``, ``threads``, the
    storage deadlines ``timeout`` and ``total_timeout``, and the shard ``cache``).
    """

    #: Bytes per digested block: what a remote read fetches at least, and per-block index cost.
    BLOCK_BYTES = 1 << 20
    SUFFIXES = (".tar",)
    #: Bytes read at once while a shard is indexed (whole blocks).
    SCAN_BYTES = 8 << 20

    def __init__(
        self,
        paths: PathsArg,
        *,
        columns: list[str] | None = None,
        decode_text: bool = False,
        **options: Unpack[FileOptions],
    ) -> None:
        super().__init__(paths, **options)
        if columns is not None and (
            isinstance(columns, str)
            or not all(isinstance(c, str) and c for c in columns)
            or len(set(columns)) != len(columns)
        ):
            raise TypeError(
                f"WebDatasetSource: columns must be a list of distinct field names, got {columns!r}"
            )
        self.columns = None if columns is None else list(columns)
        self.decode_text = check_bool(decode_text, "decode_text", "WebDatasetSource")
        self._maps = MappedFiles()

    # --------------------------------------------------------------------- the member index
    def column_names(self) -> list[str]:
        """Every field of the shards, in the order they are first met."""
        self.file_ends()
        seen: dict[str, None] = {}
        for i in range(len(self.files())):
            seen.update(dict.fromkeys(self._shard(i).fields))
        return list(seen)

    def index_path(self, file_index: int) -> str:
        """Where the member index of shard ``file_index`` is kept: ``<shard>.zidx`` beside it, or
        in ``index_dir`` / the cache directory (see ``FileSource.sidecar_path``)."""
        return self.sidecar_path(file_index, ".zidx")

    def load_metadata(self) -> list[int]:
        """Load or build each shard's member index (in parallel for remote data, each retried
        on transient errors), then check ``columns``; the sample count of each shard."""
        shards = self.load_shards()
        if self.columns is not None:
            found = {f for s in shards for f in s.fields}
            unknown = [c for c in self.columns if c not in found]
            if unknown:
                raise PlanError(
                    f"WebDatasetSource: no shard of {self.root!r} holds a field {unknown}; they "
                    f"hold {sorted(found)}"
                )
        return [s.samples for s in shards]

    def _load_shard(self, i: int) -> _Shard:
        f = self.files()[i]
        mtime = f.mtime_ns or 0
        try:
            with self.open_random(f.path) as fh:
                version = self.object_version(i, fh)
                shard = self._cached(i, mtime, version)
                if shard is None:
                    shard = self._scan(i, fh, version)
                    self.store_sidecar(i, ".zidx", _IDX_TAG, f.size, mtime, _sections(shard))
        except OSError as exc:
            raise self.os_error(exc, i) from exc
        shard.slots = self._slots(shard.fields)
        return shard

    def _cached(self, i: int, mtime: int, version: str) -> _Shard | None:
        if not self.cache_can_tell(i, version):
            return None
        f = self.files()[i]
        for where in self.sidecar_candidates(i, ".zidx"):
            sections = read_sidecar(where, _IDX_TAG, f.size, mtime)
            if sections is not None:
                shard = _from_sections(sections, f.size, self.BLOCK_BYTES)
                if shard is not None and shard.version == version:
                    return shard
        return None

    def _scan(self, i: int, fh: Any, version: str) -> _Shard:
        # One pass over the shard: its members found, its blocks digested.
        size = self.files()[i].size
        scan = MemberScan()
        digests: list[int] = []
        block = self.BLOCK_BYTES
        try:
            for at in range(0, size, self.SCAN_BYTES):
                want = min(self.SCAN_BYTES, size - at)
                piece = memoryview(fh.read_at(want, at))
                if len(piece) != want:
                    raise self.fetch_error(i, "the file changed while it was being indexed")
                digests += [content_digest(piece[a : a + block]) for a in range(0, want, block)]
                scan.feed(piece)
            scan.finish(size)
        except TarFormatError as exc:
            raise self.fetch_error(i, f"malformed tar archive: {exc}") from None
        blocks = regular_table(size, block, np.array(digests, dtype=np.int64))
        return self._group(i, scan, blocks, version)

    def _group(self, i: int, scan: MemberScan, blocks: DigestTable, version: str) -> _Shard:
        # Members into samples, as WebDataset's group_by_keys does.
        fields: dict[str, int] = {}
        first: list[int] = []
        offsets: list[int] = []
        sizes: list[int] = []
        field_ids: list[int] = []
        keys: list[bytes] = []
        current: str | None = None
        has: set[str] = set()
        for name, offset, size in zip(scan.names, scan.offsets, scan.sizes, strict=True):
            if ("/" not in name and name.startswith("__") and name.endswith("__")) or (
                _META_MEMBER.match(name)
            ):
                continue
            found = _KEY_AND_FIELD.match(name)
            if found is None:
                continue
            key, suffix = found.group(1), found.group(2).lower()
            if key != current:
                current = key
                has = set()
                first.append(len(offsets))
                keys.append(key.encode("utf-8", "surrogateescape"))
            if suffix in has:
                raise self.fetch_error(
                    i,
                    f"member {name!r} repeats field {suffix!r} of sample {key!r}; a sample holds "
                    "each field once: write the shard again",
                )
            has.add(suffix)
            offsets.append(offset)
            sizes.append(size)
            field_ids.append(fields.setdefault(suffix, len(fields)))
        first.append(len(offsets))
        key_ends = np.cumsum([0] + [len(k) for k in keys], dtype=np.int64)
        return _Shard(
            len(keys),
            list(fields),
            np.array(first, dtype=np.int64),
            np.array(offsets, dtype=np.int64),
            np.array(sizes, dtype=np.int64),
            np.array(field_ids, dtype=np.int64),
            key_ends,
            b"".join(keys),
            blocks,
            version,
            _identity(len(keys), len(offsets), blocks),
        )

    def _slots(self, fields: list[str]) -> np.ndarray:
        # Each field's place among the fields read (in ``columns`` order), -1 when not read.
        if self.columns is None:
            return np.arange(len(fields), dtype=np.int64)
        place = {c: k for k, c in enumerate(self.columns)}
        return np.array([place.get(f, -1) for f in fields], dtype=np.int64)

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
        samples = local[positions]
        lo = shard.first[samples]
        counts = shard.first[samples + 1] - lo
        owner = np.repeat(np.arange(samples.size), counts)
        members = lo[owner] + np.arange(owner.size) - (np.cumsum(counts) - counts)[owner]
        slots = shard.slots[shard.field_ids[members]]
        kept = slots >= 0
        members, slots, owner = members[kept], slots[kept], owner[kept]
        counts = np.bincount(owner, minlength=samples.size)
        columns = self.columns
        if columns is not None and (counts != len(columns)).any():
            k = int(np.flatnonzero(counts != len(columns))[0])
            raise self._missing(i, shard, int(samples[k]), rows[positions[k]])
        starts = shard.offsets[members]
        ends = starts + shard.sizes[members]
        if self.is_local:
            data = self._mapped(i, rows[positions[0]])
            values: list[Any] = [
                data[a:e].tobytes() for a, e in zip(starts.tolist(), ends.tolist(), strict=True)
            ]
        else:
            values = self.read_retried(
                i, lambda: self._fetch(i, shard, starts, ends, counts, rows[positions[0]])
            )
        url = self.paths[i]
        # Without columns, each sample's fields in member order; with them, in their order.
        names = columns or shard.fields
        order = slots.tolist()
        at = 0
        for k, (pos, n) in enumerate(zip(positions.tolist(), counts.tolist(), strict=True)):
            sample = int(samples[k])
            payload: dict[str, Any] = {"__key__": shard.key(sample), "__url__": url}
            if columns is None:
                for m in range(at, at + n):
                    payload[names[order[m]]] = values[m]
            else:
                picked: list[Any] = [None] * n
                for m in range(at, at + n):
                    picked[order[m]] = values[m]
                payload.update(zip(columns, picked, strict=True))
            at += n
            if self.decode_text:
                self._decode(i, shard, sample, payload, rows[pos])
            out[pos] = payload

    def _fetch(
        self,
        i: int,
        shard: _Shard,
        starts: np.ndarray,
        ends: np.ndarray,
        counts: np.ndarray,
        pointer: np.ndarray,
    ) -> list[bytes]:
        # The members' bytes from whole checked blocks: one span per sample (its members are
        # neighbours), cut into members here.
        bounds = np.concatenate(([0], np.cumsum(counts)))
        has = counts > 0
        span_starts = starts[bounds[:-1][has]].tolist()
        span_ends = ends[bounds[1:][has] - 1].tolist()
        try:
            with self.open_random(self.files()[i].path) as fh:
                self.check_version(i, fh, shard.version, pointer)
                spans = read_spans(fh, shard.blocks, self.BLOCK_BYTES, span_starts, span_ends)
        except OSError as exc:
            raise self.os_error(exc, i, pointer) from exc
        except ChangedBlock as changed:
            raise self.fetch_error(
                i,
                f"{changed} no longer matches the digest taken when it was indexed: the shard "
                "changed; build a new source (its fingerprint will differ from old checkpoints)",
                pointer,
            ) from None
        out: list[bytes] = []
        at = 0
        for span, origin, n in zip(spans, span_starts, counts[has].tolist(), strict=True):
            view = memoryview(span)
            for a, e in zip(starts[at : at + n].tolist(), ends[at : at + n].tolist(), strict=True):
                out.append(bytes(view[a - origin : e - origin]))
            at += n
        return out

    def _mapped(self, i: int, pointer: np.ndarray) -> np.ndarray:
        # The shard memory-mapped, checked against the size and mtime it was indexed at.
        f = self.files()[i]
        try:
            return self._maps.get(i, f.path, (f.size, f.mtime_ns), lambda: map_bytes(f.path))
        except OSError as exc:
            raise self.os_error(exc, i, pointer) from exc
        except ChangedFile as changed:
            raise self.fetch_error(
                i,
                f"the shard changed since it was indexed (size {f.size}, mtime_ns {f.mtime_ns} "
                f"then; {changed} now); build a new source (its fingerprint will differ from "
                "old checkpoints)",
                pointer,
            ) from None

    def _missing(self, i: int, shard: _Shard, sample: int, pointer: np.ndarray) -> FetchError:
        a, b = int(shard.first[sample]), int(shard.first[sample + 1])
        has = [shard.fields[f] for f in shard.field_ids[a:b].tolist()]
        lacks = [c for c in self.columns or () if c not in has]
        return self.fetch_error(
            i,
            f"sample {shard.key(sample)!r} has no field {lacks} (it has {has}); leave the field "
            "out of columns=, or skip such samples with Pipeline(on_error={'fetch': 'skip'})",
            pointer,
        )

    def _decode(
        self, i: int, shard: _Shard, sample: int, payload: dict[str, Any], pointer: np.ndarray
    ) -> None:
        for name, value in payload.items():
            decode = TEXT_DECODERS.get(name.rsplit(".", 1)[-1])
            if decode is None or name.startswith("__"):
                continue
            try:
                payload[name] = decode(value)
            except ValueError as exc:  # also UnicodeDecodeError, JSONDecodeError
                raise self.fetch_error(
                    i,
                    f"member {shard.key(sample) + '.' + name!r} cannot be decoded as "
                    f"{decode.__name__.lstrip('_')}: {exc}; read it as bytes (decode_text=False)",
                    pointer,
                ) from None

    def drop_read_caches(self) -> None:
        """Unmap the shards kept mapped between reads."""
        super().drop_read_caches()
        self._maps.clear()

    # --------------------------------------------------------------------- identity
    def describe(self) -> dict[str, Any]:
        """Chunking parameters, the fields read, whether text is decoded, and per shard its
        name, sample count and content identity (the digests of its blocks)."""
        out = self.describe_files()
        out["columns"] = self.columns
        out["decode_text"] = self.decode_text
        out["files"] = [
            {
                "name": f.name,
                "samples": self._shard(k).samples,
                "content_sha256": self._shard(k).identity,
            }
            for k, f in enumerate(self.files())
        ]
        return out


def _sections(shard: _Shard) -> list[np.ndarray]:
    """The ``.zidx`` sidecar's int64 sections of a member index."""
    keys = shard.keys + b"\x00" * (-len(shard.keys) % 8)
    return [
        np.array([shard.samples, len(shard.offsets), shard.blocks.starts.size], dtype=np.int64),
        text_section([shard.version, shard.fields]),
        shard.blocks.digests,
        shard.first,
        shard.offsets,
        shard.sizes,
        shard.field_ids,
        shard.key_ends,
        np.frombuffer(keys, dtype=np.int64),
        np.zeros(0, dtype=np.int64),  # room for a later version's section
    ]


def _from_sections(sections: list[np.ndarray], size: int, block: int) -> _Shard | None:
    """The member index a ``.zidx`` holds when its layout is consistent with a shard of ``size``
    bytes read in ``block``-byte blocks; None otherwise (it is built again)."""
    if len(sections) != _SECTIONS or len(sections[0]) != 3:
        return None
    meta, text, digests, first, offsets, sizes, field_ids, key_ends, keys, _ = sections
    samples, members, blocks = (int(v) for v in meta)
    try:
        version, fields = section_text(text)
    except (ValueError, TypeError):
        return None
    ends = offsets + sizes
    consistent = (
        blocks == len(digests) == -(-size // block)
        and len(first) == samples + 1
        and len(key_ends) == samples + 1
        and len(offsets) == len(sizes) == len(field_ids) == members
        and first[0] == 0
        and first[-1] == members
        and bool((np.diff(first) > 0).all())
        and bool((field_ids >= 0).all() and (field_ids < len(fields)).all())
        and bool((offsets >= 0).all() and (ends <= size).all())
        and key_ends[0] == 0
        and bool((np.diff(key_ends) > 0).all())
        and int(key_ends[-1]) <= 8 * len(keys)
    )
    if not consistent:
        return None
    table = regular_table(size, block, digests)
    return _Shard(
        samples,
        [str(f) for f in fields],
        first,
        offsets,
        sizes,
        field_ids,
        key_ends,
        np.asarray(keys).tobytes()[: int(key_ends[-1])],
        table,
        str(version),
        _identity(samples, members, table),
    )


def _identity(samples: int, members: int, blocks: DigestTable) -> str:
    """A shard's content identity: the sha256 of its block digests (every byte) and counts."""
    identity = hashlib.sha256(b"zephon webdataset shard 1")
    identity.update(f"{samples} {members}".encode())
    identity.update(blocks.identity().encode())
    return identity.hexdigest()
