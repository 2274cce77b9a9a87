"""TokenShardSource: pre-tokenized corpora, read as documents of token ids without a tokenizer.

Shards. Each listed file is one shard of one of three kinds:

- ``.idx``: a Megatron indexed dataset, the index beside its ``.bin`` of the same stem. The index
  is ``b"MMIDIDX\\x00\\x00"``, a little-endian uint64 version (1), a uint8 dtype code, uint64
  sequence and document counts, then the int32 sequence lengths, the int64 byte pointers of the
  sequences into the ``.bin`` and the int64 document indices (the first sequence of each document,
  and a last entry: the sequence count). A sample is one document: its sequences, contiguous in
  the ``.bin``; a document without sequences (Megatron's for an empty text) is an empty sample.
- ``.npy``: a 1-D integer array saved by ``numpy.save``;
- anything else, with ``dtype=``: a raw array of that dtype (``.bin`` in a listing), little-endian
  unless the dtype is explicitly big-endian (``">u2"``).

A flat array (``.npy`` or raw) is cut into documents by ``eos_id=`` (a document ends with each
end-of-sequence id, which it keeps; tokens after the last one are a last document) or by
``window=`` (fixed windows of that many tokens, the last one shorter when the array does not
divide).

Identity. The first time a shard is seen, its files are read once in full and cut into
``BLOCK_BYTES`` blocks, each with a content digest (``zephon.sources.files.DigestTable``); with
``eos_id`` the document ends are found in the same pass. They are cached in a ``.zsum`` sidecar
(keyed, as every sidecar, by the listed file's size and mtime; for Megatron shards the ``.bin``'s
size and mtime are checked too; remote, the store's version of the data file; a store that gives
neither mtime nor version has its shards digested again by every new source). ``describe()``
carries the sha256 of every shard's tables: a rewritten shard changes the fingerprint, whatever
its name or place.

Reading. A read touches only the documents it asks for. Local shards are memory-mapped (the
mapping is kept between reads and dropped by ``drop_read_caches``; the file's size and mtime are
checked on every read): a document is one slice of the map, copied into an int32 array. Remote
shards are read in whole blocks, one ranged read per run of neighbouring blocks, each block
compared with its digest before a token is taken from it. Negative token ids (a signed dtype too
small for the vocabulary wraps high ids to them) and ids above int32 are refused.

Payloads are ``{field: int32 array}``. ``provides()`` publishes the field and ``eos_id`` /
``pad_id`` for the packers, as ``tokenize`` does, so ``pack_sequences`` needs no ``pad_id=``
when the source was given one.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon._core.tokens import document_views
from zephon.errors import FetchError
from zephon.sources.block_reads import ChangedBlock, block_table, read_spans, regular_table
from zephon.sources.files import (
    DigestTable,
    FileOptions,
    PathsArg,
    read_sidecar,
    section_text,
    text_section,
)
from zephon.sources.mapped_files import ChangedFile, MappedFiles
from zephon.sources.shard_cache import CachedShard
from zephon.sources.shard_layouts import ShardLayoutSource
from zephon.validation import check_int

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["MEGATRON_DTYPES", "TokenShardSource"]

#: Megatron's dtype codes (``megatron.core.datasets.indexed_dataset.DType``); floats are refused.
MEGATRON_DTYPES: dict[int, np.dtype[Any]] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    8: np.dtype(np.uint16),
}
_MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
_MEGATRON_HEADER = struct.Struct("<9sQBQQ")
_TOKEN_DTYPES = frozenset(
    np.dtype(t)
    for t in (np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64)
)
_INT32_MAX = 2**31 - 1
_SUM_TAG = b"ZTOKSUM1"
#: Tokens read at once while scanning a flat file for ``eos_id``.
_SCAN_TOKENS = 1 << 24


@dataclass
class _Shard:
    """One shard's layout: where its tokens are (``data_path``, ``offset`` bytes in, ``dtype``,
    ``tokens``), its documents (``starts``/``lengths`` in tokens, or fixed ``window``s), the
    digest tables of its data file and index, and the identity of both."""

    kind: str  # "megatron", "npy" or "raw"
    data_path: str
    dtype: np.dtype
    offset: int
    tokens: int
    data_size: int
    data_mtime_ns: int
    documents: int
    starts: np.ndarray | None
    lengths: np.ndarray | None
    window: int
    blocks: DigestTable
    identity: str
    total_tokens: int

    def spans(self, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Token starts (relative to ``offset``) and lengths of the documents ``local``."""
        if self.starts is not None and self.lengths is not None:
            return self.starts[local].astype(np.int64), self.lengths[local].astype(np.int64)
        starts = local.astype(np.int64) * self.window
        return starts, np.minimum(self.window, self.tokens - starts)


class TokenShardSource(ShardLayoutSource[_Shard]):
    """Pre-tokenized shards (Megatron ``.bin``/``.idx``, ``.npy``, raw arrays): one sample per
    document, its payload ``{field: int32 token ids}``. See the module docstring for the shard
    kinds, identity and reads.

    ``eos_id``: cuts flat arrays into documents at each end-of-sequence id, and is published to
    the packers; ``window``: cuts flat arrays into windows of that many tokens instead;
    ``dtype``: the token dtype of raw files; ``pad_id``: the padding id published to the packers
    (``pack_sequences`` then needs no ``pad_id=``). The rest is ``FileSource``'s.

    Invariant: a read returns exactly the indexed document's tokens or raises ``FetchError``
    naming the shard, the document and what to do.

    Every file source also takes the ``FileOptions`` (``dataset_id``, ``chunk_size``,
    ``shuffle``, ``seed``, ``passes``, the metadata caches, ``filesystem``, ``threads``, the
    storage deadlines ``timeout`` and ``total_timeout``, and the shard ``cache``).
    """

    #: Bytes per digested block: what a remote read fetches at least, and per-block index cost.
    BLOCK_BYTES = 1 << 20

    def __init__(
        self,
        paths: PathsArg,
        *,
        eos_id: int | None = None,
        window: int | None = None,
        dtype: Any = None,
        field: str = "tokens",
        pad_id: int | None = None,
        **options: Unpack[FileOptions],
    ) -> None:
        name = type(self).__name__
        if eos_id is not None:
            eos_id = check_int(eos_id, "eos_id", name, minimum=0, maximum=_INT32_MAX)
        if pad_id is not None:
            pad_id = check_int(pad_id, "pad_id", name, minimum=-(2**31), maximum=_INT32_MAX)
        if window is not None:
            window = check_int(window, "window", name, minimum=1)
        if not isinstance(field, str) or not field:
            raise TypeError(f"{name}: field must be a non-empty str, got {field!r}")
        self.raw_dtype: np.dtype | None = None
        if dtype is not None:
            given = np.dtype(dtype)
            # Little-endian unless the dtype says big-endian (">u2"): as the file was written.
            self.raw_dtype = given if given.byteorder == ">" else given.newbyteorder("<")
            if self.raw_dtype.newbyteorder("=") not in _TOKEN_DTYPES:
                raise ValueError(f"{name}: dtype must be an integer dtype, got {dtype!r}")
        if eos_id is not None and window is not None:
            raise ValueError(
                f"{name}: give eos_id= (documents end at it) or window= (fixed windows), not both"
            )
        self.eos_id = eos_id
        self.window = window
        self.field = field
        self.token_field = field
        self.pad_id = pad_id
        # What a directory listing keeps: Megatron indexes and .npy files, or raw .bin files.
        self.SUFFIXES = (".bin",) if self.raw_dtype is not None else (".idx", ".npy")
        super().__init__(paths, **options)
        self._maps = MappedFiles()

    # --------------------------------------------------------------------- facts
    def provides(self) -> dict[str, Any]:
        """Plan-time facts for the operators after ``fetch``: the token field and the
        ``eos_id`` / ``pad_id`` given (``None`` when not given)."""
        return {
            "token_field": self.field,
            "eos_id": self.eos_id,
            "eos_token": None,
            "pad_id": self.pad_id,
            "pad_token": None,
            "pad_from": type(self).__name__,
        }

    def token_total(self) -> int:
        """Tokens in one pass: the sum of every document's length, from the indexes."""
        self.file_ends()
        return sum(self._shard(i).total_tokens for i in range(len(self.files())))

    def exact_tokens_per_sample(self) -> Fraction:
        """The mean document length, exactly (what ``MixtureSource(by="tokens")`` uses as this
        component's cost instead of an estimate)."""
        n = self.num_samples()
        return Fraction(self.token_total(), n) if n else Fraction(0)

    # --------------------------------------------------------------------- metadata
    def kind_of(self, file_index: int) -> str:
        """``"megatron"``, ``"npy"`` or ``"raw"``: how the file's tokens are laid out."""
        path = self.files()[file_index].path
        if self.raw_dtype is not None:
            if path.endswith((".idx", ".npy")):
                raise FetchError(
                    f"TokenShardSource: {self.paths[file_index]!r} is not a raw token file; "
                    "drop dtype= to read Megatron indexes and .npy files"
                )
            return "raw"
        if path.endswith(".idx"):
            return "megatron"
        if path.endswith(".npy"):
            return "npy"
        raise FetchError(
            f"TokenShardSource cannot tell how {self.paths[file_index]!r} is laid out: give "
            "Megatron .idx files (their .bin beside), .npy files, or dtype= for raw token files"
        )

    def data_paths(self, file_index: int) -> list[str]:
        """The file a read of shard ``file_index`` opens: a Megatron index's ``.bin``."""
        path = self.files()[file_index].path
        return [path[: -len(".idx")] + ".bin" if self.kind_of(file_index) == "megatron" else path]

    def load_metadata(self) -> list[int]:
        """Load or build each shard's document table and digests (in parallel for remote data,
        each retried on transient errors); the document count of each."""
        shards = self.load_shards()
        return [s.documents for s in shards]

    def _stat(self, path: str) -> tuple[int, int]:
        if self.is_local:
            st = os.stat(path)
            return st.st_size, st.st_mtime_ns
        import pyarrow.fs as pafs

        info = self.filesystem.get_file_info(path)
        if info.type != pafs.FileType.File:
            raise FileNotFoundError(2, "no such file", self._locations.uri(path))
        return int(info.size), info.mtime_ns or 0

    def _load_shard(self, i: int) -> _Shard:
        entry = self.files()[i]
        kind = self.kind_of(i)
        try:
            size, mtime_ns = self._stat(entry.path)
            data_path = entry.path[: -len(".idx")] + ".bin" if kind == "megatron" else entry.path
            data_size, data_mtime = (
                self._stat(data_path) if kind == "megatron" else (size, mtime_ns)
            )
            with self.open_random(entry.path) as fh:
                if kind == "megatron":
                    layout = self._megatron_layout(i, fh, size, data_size)
                else:
                    layout = self._flat_layout(i, kind, fh, size)
            dtype, offset, tokens, starts, lengths = layout
            idx_blocks = None
            if kind == "megatron":
                with self.open_random(entry.path) as fh:
                    idx_blocks = block_table(fh, size, self.BLOCK_BYTES)
            with self.open_random(data_path) as fh:
                # The data file's own version (a Megatron shard's .bin, not its listed .idx).
                version = (
                    fh.version
                    if isinstance(fh, CachedShard)
                    else self._locations.version(data_path, fh)
                )
                cached = None
                if version or entry.mtime_ns is not None:  # a rewrite would show
                    data_stat = (data_size, data_mtime)
                    cached = self._cached_sums(i, kind, size, mtime_ns, data_stat, version)
                if cached is not None:
                    blocks, ends = cached
                else:
                    blocks, ends = self._scan(fh, kind, dtype, offset, data_size)
        except OSError as exc:
            raise self.os_error(exc, i) from exc
        except EOFError:
            raise self.fetch_error(i, "the file changed while it was being indexed") from None
        if cached is None:
            sections = [
                np.array([self.BLOCK_BYTES, data_size, data_mtime, self._eos_key(kind)], np.int64),
                blocks.digests,
                ends,
                text_section([version]),
            ]
            self.store_sidecar(i, ".zsum", _SUM_TAG, size, mtime_ns, sections)
        window = 0
        if kind != "megatron":
            starts, lengths, window = self._documents(tokens, ends)
        documents = int(lengths.size) if lengths is not None else -(-tokens // window)
        total = int(lengths.sum(dtype=np.int64)) if lengths is not None else tokens
        identity = hashlib.sha256(b"zephon token shard 1")
        identity.update(f"{kind} {dtype.str} {tokens} {documents}".encode())
        identity.update(blocks.identity().encode())
        if idx_blocks is not None:
            identity.update(idx_blocks.identity().encode())
        return _Shard(
            kind,
            data_path,
            dtype,
            offset,
            tokens,
            data_size,
            data_mtime,
            documents,
            starts,
            lengths,
            window,
            blocks,
            identity.hexdigest(),
            total,
        )

    def _eos_key(self, kind: str) -> int:
        # What the cached document ends were cut at (-1: none were cut).
        return -1 if self.eos_id is None or kind == "megatron" else self.eos_id

    def _megatron_layout(self, i: int, fh: Any, size: int, data_size: int) -> tuple[Any, ...]:
        head = fh.read(_MEGATRON_HEADER.size)
        if len(head) != _MEGATRON_HEADER.size:
            raise self.fetch_error(i, f"the index is {size} bytes, shorter than its header")
        magic, version, code, sequences, doc_entries = _MEGATRON_HEADER.unpack(head)
        if magic != _MEGATRON_MAGIC or version != 1:
            raise self.fetch_error(
                i,
                f"not a Megatron index (magic {magic!r}, version {version}); expected "
                f"{_MEGATRON_MAGIC!r} version 1",
            )
        if self.window is not None:
            raise self.fetch_error(
                i, "window= cuts flat token files; a Megatron index already holds its documents"
            )
        if code not in MEGATRON_DTYPES:
            raise self.fetch_error(
                i, f"token dtype code {code} is not an integer dtype Megatron writes"
            )
        dtype = MEGATRON_DTYPES[code]
        body = _MEGATRON_HEADER.size + sequences * 12 + doc_entries * 8
        if size not in (body, body + sequences):  # sequence modes (multimodal) may follow
            raise self.fetch_error(
                i,
                f"the index holds {size} bytes, its header ({sequences} sequences, "
                f"{doc_entries} document entries) says {body}; the index is truncated or "
                "damaged: write it again",
            )
        raw = self._read_exact(i, fh, body - _MEGATRON_HEADER.size)
        lengths = np.frombuffer(raw, dtype="<i4", count=sequences)
        pointers = np.frombuffer(raw, dtype="<i8", count=sequences, offset=sequences * 4)
        docs = np.frombuffer(raw, dtype="<i8", count=doc_entries, offset=sequences * 12)
        item = dtype.itemsize
        ends = pointers + lengths.astype(np.int64) * item
        bad = ""
        if doc_entries < 1 or docs[0] != 0 or docs[-1] != sequences:
            bad = "its document indices do not start at 0 and end at the sequence count"
        elif (np.diff(docs) < 0).any():
            bad = "its document indices decrease"
        elif (lengths < 0).any() or (pointers % item).any():
            bad = "a sequence length is negative or a pointer is not a whole token"
        elif sequences and (pointers.min() < 0 or ends.max(initial=0) > data_size):
            bad = f"a sequence lies outside the .bin ({data_size} bytes)"
        else:
            inner = np.ones(sequences, dtype=bool)
            # Sequences after the first of their document (an empty document, which Megatron
            # writes for an empty text, repeats the index and may stand at the end).
            inner[docs[:-1][docs[:-1] < sequences]] = False
            if (pointers[1:][inner[1:]] != ends[:-1][inner[1:]]).any():
                bad = "the sequences of a document are not contiguous in the .bin"
        if bad:
            raise self.fetch_error(i, f"malformed Megatron index: {bad}; write it again")
        first = docs[:-1]
        if doc_entries == sequences + 1 and (np.diff(docs) == 1).all():
            starts, doc_lengths = pointers // item, lengths  # one sequence per document
        else:
            # An empty document starts where the next sequence would (the end of the last one).
            after = int(ends[-1]) if sequences else 0
            starts = np.append(pointers, after)[first] // item
            cum = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
            doc_lengths = cum[docs[1:]] - cum[first]
        return dtype, 0, data_size // item, starts, doc_lengths

    def _flat_layout(self, i: int, kind: str, fh: Any, size: int) -> tuple[Any, ...]:
        if kind == "raw":
            dtype = self.raw_dtype
            assert dtype is not None
            offset = 0
        else:
            try:
                version = np.lib.format.read_magic(fh)
                reader = {
                    (1, 0): np.lib.format.read_array_header_1_0,
                    (2, 0): np.lib.format.read_array_header_2_0,
                }[version]
                shape, _, dtype = reader(fh)
            except (ValueError, KeyError, SyntaxError) as exc:
                raise self.fetch_error(i, f"not a .npy file numpy can read: {exc}") from None
            offset = int(fh.tell())
            if len(shape) != 1 or dtype.hasobject:
                raise self.fetch_error(
                    i, f"holds a {dtype} array of shape {shape}; token files are 1-D integer arrays"
                )
            dtype = np.dtype(dtype)
        if dtype.newbyteorder("=") not in _TOKEN_DTYPES:
            raise self.fetch_error(i, f"holds {dtype} values, not integer token ids")
        tokens, rest = divmod(size - offset, dtype.itemsize)
        if rest or (kind == "npy" and tokens != shape[0]):
            raise self.fetch_error(
                i,
                f"holds {size - offset} bytes of data, not a whole number of {dtype} tokens"
                + ("" if kind == "raw" else f" ({shape[0]} by its header)")
                + "; the file is truncated or damaged",
            )
        if self.eos_id is not None and self.eos_id > np.iinfo(dtype).max:
            raise self.fetch_error(
                i,
                f"eos_id {self.eos_id} does not fit its {dtype.newbyteorder('=')} tokens, so no "
                "token can end a document; give the end-of-sequence id as the file stores it",
            )
        if self.window is None and self.eos_id is None:
            raise self.fetch_error(
                i,
                "a flat token file needs eos_id= (documents end at it) or window= (fixed "
                "windows) to be cut into documents",
            )
        return dtype, offset, tokens, None, None

    def _documents(self, tokens: int, ends: np.ndarray) -> tuple[Any, Any, int]:
        if self.window is not None:
            return None, None, self.window
        bounds = np.concatenate(([0], ends)) if ends.size and ends[-1] == tokens else None
        if bounds is None:
            bounds = np.concatenate(([0], ends, [tokens])) if tokens else np.zeros(1, np.int64)
        return bounds[:-1], np.diff(bounds), 0

    def _read_exact(self, i: int, fh: Any, n: int) -> bytes:
        data = fh.read(n)
        if len(data) != n:
            raise self.fetch_error(i, "the file ended early; it is truncated")
        return bytes(data)

    def _scan(
        self, fh: Any, kind: str, dtype: np.dtype, offset: int, size: int
    ) -> tuple[DigestTable, np.ndarray]:
        # The data file's block digests, and for a flat file cut by eos_id the token index after
        # each end-of-sequence id.
        blocks = block_table(fh, size, self.BLOCK_BYTES)
        found: list[np.ndarray] = []
        if kind != "megatron" and self.eos_id is not None:
            step = _SCAN_TOKENS * dtype.itemsize
            for at in range(offset, size, step):
                fh.seek(at)
                data = fh.read(min(step, size - at))
                values = np.frombuffer(data, dtype=dtype)
                base = (at - offset) // dtype.itemsize
                found.append(np.flatnonzero(values == self.eos_id).astype(np.int64) + base + 1)
        ends = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        return blocks, ends

    def _cached_sums(
        self,
        i: int,
        kind: str,
        size: int,
        mtime_ns: int,
        data_stat: tuple[int, int],
        version: str,
    ) -> tuple[DigestTable, np.ndarray] | None:
        # The digests and document ends a sidecar holds for the shard at this size and mtime
        # (of its .bin too) and the store's ``version`` of its data file; None otherwise.
        for where in self.sidecar_candidates(i, ".zsum"):
            sections = read_sidecar(where, _SUM_TAG, size, mtime_ns)
            if sections is None or len(sections) != 4 or len(sections[0]) != 4:
                continue
            meta, digests, ends, said = sections
            try:
                if section_text(said) != [version]:
                    continue
            except ValueError:
                continue
            block, data_size, data_mtime, eos = (int(v) for v in meta)
            if (block, eos) != (self.BLOCK_BYTES, self._eos_key(kind)):
                continue
            if (data_size, data_mtime) != data_stat:
                continue
            if len(digests) != -(-data_size // block):
                continue
            return regular_table(data_size, block, digests), ends
        return None

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
        starts, lengths = shard.spans(local[positions])
        if self.is_local:
            tokens = self._mapped(i, shard, rows[positions[0]])
            lo = int(starts.min()) if starts.size else 0
            hi = int((starts + lengths).max()) if starts.size else 0
            total = int(lengths.sum())
            fits = shard.dtype.itemsize < 4 or shard.dtype.newbyteorder("=") == np.int32
            asked = local[positions]  # sorted: a document asked twice stands twice in a row
            repeated = asked.size > 1 and bool((asked[1:] == asked[:-1]).any())
            if not repeated and (hi - lo == total or (fits and hi - lo <= 2 * total + 4096)):
                # Neighbouring documents (an unshuffled read): one conversion for all, each
                # payload a view of that copy. Wide ids (int64, uint32, uint64) are converted
                # so only without gaps; ids are checked in the documents asked for only. A
                # document asked twice (a repeating mixture) gets arrays of its own instead:
                # views would share their tokens, and a change made to one would reach both.
                block = self._int32(
                    i, tokens[lo:hi], rows, positions, local, (starts - lo, lengths)
                )
                document_views(out, positions, block, starts - lo, lengths, self.field)
                return
            pieces = [
                self._int32(i, tokens[s : s + n], rows, positions[k : k + 1], local, None)
                for k, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True))
            ]
        else:
            spans = self.read_retried(
                i, lambda: self._fetch_pieces(i, shard, starts, lengths, rows[positions[0]])
            )
            pieces = [
                self._int32(i, piece, rows, positions[k : k + 1], local, None)
                for k, piece in enumerate(spans)
            ]
        field = self.field
        for pos, piece in zip(positions.tolist(), pieces, strict=True):
            out[pos] = {field: piece}

    def _int32(
        self,
        i: int,
        values: np.ndarray,
        rows: np.ndarray,
        positions: np.ndarray,
        local: np.ndarray,
        documents: tuple[np.ndarray, np.ndarray] | None,
    ) -> np.ndarray:
        # ``values`` as a new int32 array; a negative id (a signed shard's) or one above int32
        # is a FetchError naming the document holding it (``documents``: where each of
        # ``positions`` begins in ``values`` and its length; values between them are not read).
        dtype = values.dtype.newbyteorder("=")
        signed = dtype.kind == "i"
        wide = dtype.itemsize >= 4 and dtype != np.int32
        if values.size and ((signed and values.min() < 0) or (wide and values.max() > _INT32_MAX)):
            bad = np.flatnonzero((values < 0) | (values > _INT32_MAX))
            k = np.zeros(bad.size, dtype=np.int64)
            if documents is not None:  # the first bad id inside a document asked for
                order = np.argsort(documents[0], kind="stable")
                starts, lengths = documents[0][order], documents[1][order]
                at = np.maximum(np.searchsorted(starts, bad, "right") - 1, 0)
                inside = (bad >= starts[at]) & (bad < starts[at] + lengths[at])
                bad, k = bad[inside], order[at[inside]]
            if bad.size:
                value = int(values[bad[0]])
                why = (
                    "a negative token id ({}); ids are never negative: a signed dtype too small "
                    "for the vocabulary wraps high ids to negative ones, so write the shard with "
                    "an unsigned or wider dtype"
                    if value < 0
                    else "a token id outside int32 ({}); such ids cannot be delivered"
                )
                raise self.fetch_error(
                    i,
                    f"document {int(local[positions[k[0]]])} holds {why.format(value)}",
                    rows[positions[k[0]]],
                )
        return values.astype(np.int32)

    def _mapped(self, i: int, shard: _Shard, pointer: np.ndarray) -> np.ndarray:
        # The shard's tokens as a memory map, checked against the size and mtime it was indexed
        # at; kept (a few shards) for the next reads.
        def make() -> np.ndarray:
            if shard.tokens == 0:
                return np.zeros(0, dtype=shard.dtype)
            return np.memmap(
                shard.data_path,
                dtype=shard.dtype,
                mode="r",
                offset=shard.offset,
                shape=(shard.tokens,),
            ).view(np.ndarray)

        indexed = (shard.data_size, shard.data_mtime_ns)
        try:
            return self._maps.get(i, shard.data_path, indexed, make)
        except OSError as exc:
            raise self.os_error(exc, i, pointer) from exc
        except ChangedFile as changed:
            now = changed.now
            raise self.fetch_error(
                i,
                f"{shard.data_path!r} changed since it was indexed (size {shard.data_size} -> "
                f"{now[0]}, mtime_ns {shard.data_mtime_ns} -> {now[1]}); build a new source "
                "(its fingerprint will differ from old checkpoints)",
                pointer,
            ) from None

    def _fetch_pieces(
        self,
        i: int,
        shard: _Shard,
        starts: np.ndarray,
        lengths: np.ndarray,
        pointer: np.ndarray,
    ) -> list[np.ndarray]:
        # Whole checked blocks around the documents (see ``block_reads.read_spans``).
        item = shard.dtype.itemsize
        byte_starts = shard.offset + starts * item
        byte_ends = byte_starts + lengths * item
        try:
            with self.open_random(shard.data_path) as fh:
                spans = read_spans(
                    fh, shard.blocks, self.BLOCK_BYTES, byte_starts.tolist(), byte_ends.tolist()
                )
        except OSError as exc:
            raise self.os_error(exc, i, pointer) from exc
        except ChangedBlock as changed:
            raise self.fetch_error(
                i,
                f"{changed} of {shard.data_path!r} no longer matches the digest taken when it "
                "was indexed: the shard changed; build a new source (its fingerprint will "
                "differ from old checkpoints)",
                pointer,
            ) from None
        return [np.frombuffer(raw, dtype=shard.dtype) for raw in spans]

    def drop_read_caches(self) -> None:
        """Unmap the shards kept mapped between reads."""
        super().drop_read_caches()
        self._maps.clear()

    # --------------------------------------------------------------------- identity
    def describe(self) -> dict[str, Any]:
        """Chunking parameters, the cut (``eos_id``/``window``), the field, and per shard its
        name, kind, dtype, documents, tokens and content identity (see the module docstring)."""
        out = self.describe_files()
        out["field"] = self.field
        out["eos_id"] = self.eos_id
        out["window"] = self.window
        out["pad_id"] = self.pad_id
        out["files"] = [
            {
                "name": entry.name,
                "kind": shard.kind,
                "dtype": shard.dtype.str,
                "documents": shard.documents,
                "tokens": shard.total_tokens,
                "content_sha256": shard.identity,
            }
            for entry, shard in zip(
                self.files(), (self._shard(i) for i in range(len(self.files()))), strict=True
            )
        ]
        return out
