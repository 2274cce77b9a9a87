"""LitDataSource: LitData's optimized chunks (``index.json`` and its ``.bin`` chunks), read by our
own decoder: the ``litdata`` package is never imported.

Layout. ``index.json`` holds ``chunks`` (in order: file name, ``chunk_size`` items,
``chunk_bytes``) and ``config`` (the writer's ``data_format``, one serializer per leaf of a
sample, and ``data_spec``, the tree the leaves came from). A chunk is laid out as an MDS shard:
a uint32 item count, ``count + 1`` uint32 byte offsets, then the items; an item holds one uint32
size per leaf, then every leaf's bytes. Samples must be flat dicts (their keys are the columns).

Serializers decoded: ``int``, ``float``, ``bool``, ``str``, ``text``, ``bytes``, ``numpy``
(any shape) and ``no_header_numpy:<dtype>`` (1-d), to Python and numpy values as written.
Images are given as ``zephon.ops.decode_images`` takes them, never decoded here (no Pillow is
needed): ``jpeg`` and ``image:<extension>`` as the encoded file's ``bytes``, ``jpeg_array`` as a
list of them, ``pil`` (raw pixels) as a ``RawImage`` (``zephon.sources.image_values``).
Refused with a ``PlanError`` naming the column and serializer (leave the column out with
``columns=``): ``pickle`` (it would run code the data chooses), torch tensors (``tensor``,
``no_header_tensor``: write numpy arrays), other media (``video``, ``audio``, ``file``,
``tifffile``...) and ``json`` leaves; refused for the whole dataset: encryption, item
loaders other than the default ``PyTreeLoader``, and chunks whose rows LitData stored as an
Arrow IPC footer (its layout for samples made only of strings or nested lists).

Compression (``compression="zstd"``; needs the ``zstandard`` or ``zstd`` module): framed chunks
(LitData's default, ``compression_level="batch"``) and whole-file ``.zstd.bin`` chunks
(``"chunk"``) are inflated once and memory-mapped from their inflated copy, their stored bytes
checked against their digests first: an entry of the ``ShardCache`` when one is given
(``cache=``; its raw size is a whole-file chunk's ``chunk_bytes``, or read from a framed chunk's
header), else a file in the cache directory kept for later runs (as ``MDSSource`` does);
``"sample"`` chunks keep their layout and each item is inflated when it is read.

Identity and reading are ``MDSSource``'s: each stored chunk digested in blocks (cached in a
``.zsum`` sidecar), the digests and the chunk's index entry in the fingerprint; only the items
asked for are read, from a memory map for local chunks, in whole checked blocks remotely.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon.errors import FetchError, PlanError
from zephon.sources.image_values import encoded_images, raw_image
from zephon.sources.mds import Column, MDSSource, zstd_decompress

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from zephon.sources.files import DigestTable, FileOptions

__all__ = ["LitDataSource"]

#: numpy dtypes by the index LitData's numpy serializers store (its ``_NUMPY_DTYPES_MAPPING``).
_NUMPY_DTYPES = {
    0: "int8",
    1: "int16",
    2: "int32",
    3: "int64",
    4: "uint8",
    5: "uint16",
    6: "uint32",
    7: "uint64",
    8: "float16",
    9: "float32",
    10: "float64",
    11: "complex64",
    12: "complex128",
    13: "bool",
}
_SCALARS = {"int": struct.Struct("<q"), "float": struct.Struct("<d")}
_TEXT = ("str", "text")
#: The image serializers besides ``image:<extension>``.
_IMAGES = ("pil", "jpeg", "jpeg_array")
_FRAMED_MAGIC = b"LDFZ01\0\0"
_FRAMED_PREFIX = struct.Struct("<8sHHIII")
_FRAME = struct.Struct("<IIQII")
_ARROW_FOOTER_MAGIC = b"LDARW01\0"
#: What a damaged item raises while it is decoded.
_DECODE_ERRORS = (ValueError, UnicodeDecodeError, struct.error, IndexError, KeyError)


@dataclass
class _Plan:
    """How an item is decoded: its size header, each leaf's column and decoder (None: not
    read), and whether the payload's keys must be put in ``columns=`` order."""

    sizes: struct.Struct
    columns: list[tuple[str, Callable[[memoryview], Any] | None]]
    reorder: bool


class LitDataSource(MDSSource):
    """A LitData optimized directory (``path``: the directory holding ``index.json``, or that
    file): one sample per item, its payload ``{column: value}`` for ``columns`` (all, in the
    order the writer saw them, when None). See the module docstring for serializers,
    compression and identity.

    Invariant: a read returns exactly the values the writer wrote, or raises ``FetchError``
    naming the chunk, the item and the column.

    Every file source also takes the ``FileOptions`` (``dataset_id``, ``chunk_size``,
    ``shuffle``, ``seed``, ``passes``, the metadata caches, ``filesystem``, ``threads``, the
    storage deadlines ``timeout`` and ``total_timeout``, and the shard ``cache``).
    """

    INFLATED_DIR = "litdata"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        columns: list[str] | None = None,
        **options: Unpack[FileOptions],
    ) -> None:
        super().__init__(path, columns=columns, **options)
        self._config: dict[str, Any] = {}
        self._level = ""  # "", "chunk", "batch" or "sample"
        self._plan: _Plan | None = None

    # --------------------------------------------------------------------- the index
    def index_entries(self, raw: bytes, index_uri: str) -> list[dict[str, Any]]:
        try:
            index = json.loads(raw)
            entries, config = index["chunks"], index["config"]
            assert isinstance(entries, list) and isinstance(config, dict)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise FetchError(
                f"LitDataSource: {index_uri!r} is not a LitData index (a JSON object with "
                "'chunks' and 'config')"
            ) from None
        self._config = config
        self._level = _compression_level(config, index_uri)
        return entries

    def stored_name(self, k: int, entry: Any, index_path: str) -> str:
        try:
            int(entry["chunk_size"]), int(entry["chunk_bytes"])
            return str(entry["filename"])
        except (KeyError, TypeError, ValueError):
            raise FetchError(
                f"LitDataSource: chunk {k} of {index_path!r} lacks its filename, chunk_size or "
                "chunk_bytes; write the index again"
            ) from None

    def shard_facts(self, i: int) -> tuple[int, int | None, bool]:
        entry = self._entries[i]
        samples = int(entry["chunk_size"])
        if self._level in ("chunk", "batch"):
            # The index gives the size of the stored chunk only: the raw one is known once
            # inflated (a whole-file chunk's chunk_bytes is its raw size).
            raw = int(entry["chunk_bytes"]) if self._level == "chunk" else None
            return samples, raw, True
        return samples, int(entry["chunk_bytes"]), False

    def inflate(self, i: int, data: bytes) -> bytes:
        def error(msg: str) -> FetchError:
            return self.fetch_error(i, msg)

        if self._level == "chunk":
            return zstd_decompress(data, error)
        return _unframe(data, error)

    def inflated_size(self, i: int, stored: DigestTable) -> int:
        """A whole-file chunk's ``chunk_bytes`` (its raw size); a framed chunk's from its
        header: the classic header of its items, then their bytes (its last logical offset)."""
        if self._level != "batch":
            return super().inflated_size(i, stored)
        n = int(self._entries[i]["chunk_size"])
        head = self.stored_bytes(i, stored, _FRAMED_PREFIX.size + 4 * (n + 1))
        if len(head) < _FRAMED_PREFIX.size + 4 * (n + 1) or head[:8] != _FRAMED_MAGIC:
            raise self.fetch_error(i, "is not a framed zstd chunk (no LDFZ01 header)")
        items = _FRAMED_PREFIX.unpack_from(head, 0)[3]
        if items != n:
            raise self.fetch_error(
                i, f"its framed header holds {items} items, its index entry says {n}"
            )
        last = int(np.frombuffer(head, "<u4", count=1, offset=_FRAMED_PREFIX.size + 4 * n)[0])
        return 4 + 4 * (n + 1) + last

    def columns_of(self, entries: list[dict[str, Any]]) -> list[Column]:
        where = self.root
        config = self._config
        if config.get("encryption"):
            raise PlanError(
                f"LitDataSource: {where!r} is encrypted; Zephon does not decrypt LitData chunks"
            )
        loader = config.get("item_loader") or "PyTreeLoader"
        if loader != "PyTreeLoader":
            raise PlanError(
                f"LitDataSource: {where!r} was written with the item loader {loader!r}; only "
                "the default PyTreeLoader layout is read"
            )
        formats = config.get("data_format")
        names = _flat_dict_keys(config.get("data_spec"))
        if names is None or not isinstance(formats, list) or len(names) != len(formats):
            raise PlanError(
                f"LitDataSource: the samples of {where!r} are not flat dicts of values (its "
                "data_spec); write each sample as {column: value}"
            )
        return [Column(n, str(f), None) for n, f in zip(names, formats, strict=True)]

    def check_encoding(self, col: Column) -> None:
        enc = col.encoding
        if enc in _SCALARS or enc in _TEXT or enc in _IMAGES or enc.startswith("image:"):
            return
        if enc in ("bool", "bytes", "numpy"):
            return
        if enc.startswith("no_header_numpy:"):
            code = enc.split(":", 1)[1]
            if code.isdigit() and int(code) in _NUMPY_DTYPES:
                return
        why = {
            "pickle": "unpickling runs whatever code the data holds",
            "tensor": "torch tensors are not decoded; write numpy arrays",
            "no_header_tensor": "torch tensors are not decoded; write numpy arrays",
        }.get(enc.split(":")[0], "Zephon does not decode it")
        raise PlanError(
            f"LitDataSource: column {col.name!r} of {self.root!r} was written by the serializer "
            f"{enc!r}: {why}; leave the column out with columns="
        )

    def check_stored(self, i: int) -> None:
        """PlanError for a chunk stored as Arrow rows (never wrapped in zstd: only an
        uncompressed chunk can be one)."""
        f = self.files()[i]
        if not self._level and f.size >= len(_ARROW_FOOTER_MAGIC):
            try:
                with self.open_random(f.path) as fh:
                    tail = len(_ARROW_FOOTER_MAGIC)
                    end = bytes(fh.read_at(tail, f.size - tail))
            except OSError as exc:
                raise self.os_error(exc, i) from exc
            if end == _ARROW_FOOTER_MAGIC:
                raise PlanError(
                    f"LitDataSource: chunk {self.paths[i]!r} holds its rows as an Arrow IPC "
                    "footer (LitData's layout for samples of strings or nested lists), which "
                    "Zephon does not read; convert the dataset to Parquet"
                )

    # --------------------------------------------------------------------- decoding
    def decode_sample(
        self, i: int, sample: memoryview, pointer: np.ndarray, idx: int
    ) -> dict[str, Any]:
        if self._level == "sample":

            def error(message: str) -> FetchError:
                return self.fetch_error(i, f"item {idx} {message}", pointer)

            sample = memoryview(zstd_decompress(bytes(sample), error))
        plan = self._plan or self._make_plan()
        try:
            sizes = plan.sizes.unpack_from(sample, 0)
            at = plan.sizes.size
            values: dict[str, Any] = {}
            for (name, decode), size in zip(plan.columns, sizes, strict=True):
                stop = at + size
                if decode is not None:
                    values[name] = decode(sample[at:stop])
                at = stop
            if at > len(sample):
                raise ValueError("the item is shorter than its sizes say")
        except _DECODE_ERRORS as exc:
            raise self._item_error(i, sample, pointer, idx, exc) from None
        if plan.reorder:
            return {c.name: values[c.name] for c in self._selected}
        return values

    def _make_plan(self) -> _Plan:
        # What decoding an item needs, made once per process (its decoders do not pickle).
        wanted = self._wanted
        columns = [
            (c.name, _decoder(c.encoding) if c.name in wanted else None) for c in self._all_columns
        ]
        order = [c.name for c in self._all_columns if c.name in wanted]
        plan = _Plan(
            struct.Struct(f"<{len(columns)}I"), columns, order != [c.name for c in self._selected]
        )
        self._plan = plan
        return plan

    def _item_error(
        self, i: int, sample: memoryview, pointer: np.ndarray, idx: int, exc: Exception
    ) -> FetchError:
        # The column an item failed at, found by walking it again one column at a time.
        n = len(self._all_columns)
        if len(sample) < 4 * n:
            return self.fetch_error(i, f"item {idx} ends inside its size header", pointer)
        at = 4 * n
        for col, size in zip(self._all_columns, struct.unpack_from(f"<{n}I", sample), strict=True):
            if at + size > len(sample):
                return self.fetch_error(
                    i, f"item {idx} ends inside column {col.name!r}; the chunk is damaged", pointer
                )
            if col.name in self._wanted:
                try:
                    _decoder(col.encoding)(sample[at : at + size])
                except _DECODE_ERRORS as err:
                    return self.fetch_error(
                        i,
                        f"item {idx}, column {col.name!r} ({col.encoding}) cannot be decoded: "
                        f"{type(err).__name__}: {err}",
                        pointer,
                    )
            at += size
        return self.fetch_error(i, f"item {idx} cannot be decoded: {exc}", pointer)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_plan"] = None
        return state

    def describe(self) -> dict[str, Any]:
        """``MDSSource``'s description, with LitData's compression in place of MDS's."""
        out = super().describe()
        for f in out["files"]:
            f["compression"] = self._level or None
        return out


def _compression_level(config: dict[str, Any], where: str) -> str:
    compression = config.get("compression")
    if not compression:
        return ""
    if str(compression).split(":")[0] != "zstd":
        raise FetchError(
            f"LitDataSource: {where!r} is compressed with {compression!r}; only zstd and "
            "uncompressed chunks are read"
        )
    level = config.get("compression_level") or "chunk"
    if level not in ("chunk", "batch", "sample"):
        raise FetchError(f"LitDataSource: {where!r} has compression_level {level!r}")
    return str(level)


def _flat_dict_keys(spec: Any) -> list[str] | None:
    """The keys of a ``data_spec`` that is one dict of leaves, in order; None otherwise."""
    try:
        parsed = json.loads(spec)
        tree = parsed[1]
        if tree["type"] != "builtins.dict":
            return None
        keys = json.loads(tree["context"])
        children = tree["children_spec"]
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    if len(keys) != len(children) or any(c.get("children_spec") for c in children):
        return None
    if not all(isinstance(k, str) for k in keys):
        return None
    return keys


def _decoder(encoding: str) -> Callable[[memoryview], Any]:
    """What turns a leaf's bytes into its value, as LitData's serializer ``encoding`` wrote it."""
    scalar = _SCALARS.get(encoding)
    if scalar is not None:
        unpack = scalar.unpack
        return lambda data: unpack(data)[0]
    if encoding in _TEXT:
        return lambda data: str(data, "utf-8")
    if encoding == "bytes":
        return bytes
    if encoding == "bool":
        return lambda data: data[0] != 0
    if encoding == "numpy":
        return _numpy_with_header
    if encoding == "jpeg" or encoding.startswith("image:"):
        return bytes
    if encoding == "pil":
        return raw_image
    if encoding == "jpeg_array":
        return lambda data: [bytes(image) for image in encoded_images(data)]
    dtype = np.dtype(_NUMPY_DTYPES[int(encoding.split(":", 1)[1])])
    return lambda data: np.frombuffer(data, dtype).copy()


def _numpy_with_header(data: memoryview) -> np.ndarray:
    # LitData's ``numpy`` serializer: uint32 dtype index, uint32 ndim, the dims, the values.
    code, ndim = struct.unpack_from("<II", data)
    shape = struct.unpack_from(f"<{ndim}I", data, 8)
    dtype = np.dtype(_NUMPY_DTYPES[code])
    return np.frombuffer(data, dtype, offset=8 + 4 * ndim).reshape(shape).copy()


def _unframe(data: bytes, error: Any) -> bytes:
    """The classic chunk (count, offsets, items) of a framed zstd chunk: its frames inflated
    and laid back to back behind the classic header."""
    if len(data) < _FRAMED_PREFIX.size or data[:8] != _FRAMED_MAGIC:
        raise error("is not a framed zstd chunk (no LDFZ01 header)")
    _, version, _flags, n, _rows, n_frames = _FRAMED_PREFIX.unpack_from(data, 0)
    table_at = _FRAMED_PREFIX.size + 4 * (n + 1)
    if version != 1 or len(data) < table_at + _FRAME.size * n_frames:
        raise error(f"has a framed zstd header of version {version} or is truncated")
    logical = np.frombuffer(data, "<u4", count=n + 1, offset=_FRAMED_PREFIX.size)
    header = 4 + 4 * (n + 1)
    parts = [struct.pack("<I", n), (logical.astype(np.int64) + header).astype("<u4").tobytes()]
    for k in range(n_frames):
        _first, _items, at, length, raw_len = _FRAME.unpack_from(data, table_at + k * _FRAME.size)
        raw = zstd_decompress(data[at : at + length], error)
        if len(raw) != raw_len:
            raise error(f"frame {k} inflates to {len(raw)} bytes, its header says {raw_len}")
        parts.append(raw)
    out = b"".join(parts)
    if len(out) != header + int(logical[-1]):
        raise error("its frames do not add up to the items its offsets describe")
    return out
