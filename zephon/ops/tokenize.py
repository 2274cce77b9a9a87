"""``tokenize``: text to ``int32`` token ids, 1 -> 1 or 1 -> N when long samples are split.

Every record ``tokenize`` emits carries its mixture heritage: ``component_token_counts =
{component: len(tokens)}`` and ``component_sample_counts = {component: 1}``, which delivery
sums for ``stats()["mixture"]`` and which the packers and ``ensure_mixture`` read.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from zephon.ops.base import Operator, OpTraits
from zephon.ops.basic import record_error
from zephon.ops.children import spawn_child
from zephon.types import SampleMeta, SampleRecord

__all__ = ["ByteTokenizer", "Tokenize", "tokenize"]


class ByteTokenizer:
    """The default tokenizer: the UTF-8 bytes of a text as ids ``0..255``; ``eos_id`` is 256.

    Its id space is ``0..256`` (``vocab_size`` 257), so it needs no vocabulary file or download,
    and ``decode(encode(text)) == text`` for every string.
    """

    eos_id = 256
    vocab_size = 257

    def encode(self, text: str) -> np.ndarray:
        """The UTF-8 bytes of ``text`` as an ``int32`` array (no end-of-sequence id)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """``encode`` for each text, in order."""
        encode = self.encode
        return [encode(t) for t in texts]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of byte ids; ids outside ``0..255`` (the end-of-sequence id) are skipped."""
        arr = np.asarray(ids, dtype=np.int64)
        return bytes(arr[(arr >= 0) & (arr < 256)].astype(np.uint8).tolist()).decode(
            "utf-8", "replace"
        )

    def __call__(self, text: str) -> np.ndarray:
        return self.encode(text)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _ids_of(encoded: Any) -> Any:
    """The ids of one encoder result: an object with ``.ids`` (Hugging Face ``Encoding``), a mapping
    with ``input_ids`` (``transformers``), or the sequence of ints itself."""
    ids = getattr(encoded, "ids", None)
    if ids is not None:
        return ids
    if isinstance(encoded, dict) or hasattr(encoded, "keys"):
        try:
            return encoded["input_ids"]
        except (KeyError, TypeError):
            pass
    return encoded


def _as_int32(encoded: Any) -> np.ndarray:
    """One encoder result as a 1-D ``int32`` array; TypeError/ValueError when it is not ints."""
    arr = np.asarray(_ids_of(encoded))
    if arr.ndim != 1:
        raise ValueError(f"the tokenizer returned an array of shape {arr.shape}, not a sequence")
    if arr.dtype == np.int32:
        return arr
    if arr.size == 0:
        return np.empty(0, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"the tokenizer returned {arr.dtype} values, not integer token ids")
    if arr.dtype.itemsize > 4 or arr.dtype == np.uint32:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < -(2**31) or hi >= 2**31:
            raise ValueError(f"token ids {lo}..{hi} do not fit in int32")
    return arr.astype(np.int32)


class Tokenize(Operator):
    """Tokenizes ``payload[field]`` into an ``int32`` array in ``payload[output_field]``.

    1 -> 1 (truncating to ``max_len`` when given), or 1 -> ``ceil(n / max_len)`` children through
    ``spawn_child`` with ``split_long_samples`` (only the last child closes its base offset).
    Every output carries ``component_token_counts`` / ``component_sample_counts`` for its component.
    """

    name = "tokenize"

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        field: str = "text",
        output_field: str = "tokens",
        max_len: int | None = None,
        split_long_samples: bool = False,
        append_eos: bool = True,
        eos_id: int | None = None,
        workers: int | None = None,
    ):
        if tokenizer is None:
            tokenizer = ByteTokenizer()
        if max_len is not None and (
            isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1
        ):
            raise ValueError(f"tokenize: max_len must be an int >= 1 or None, got {max_len!r}")
        if split_long_samples and max_len is None:
            raise ValueError("tokenize: split_long_samples=True needs max_len")
        self.tokenizer = tokenizer
        self.field = field
        self.output_field = output_field
        self.max_len = max_len
        self.split_long_samples = bool(split_long_samples)
        self.append_eos = bool(append_eos)
        self._mode = _encoder_mode(tokenizer)
        self.eos_id = _resolve_eos(tokenizer, eos_id) if self.append_eos else None
        self._tokenizer_digest = _tokenizer_digest(tokenizer)
        self.traits = OpTraits(
            preserves_cursor_order=True,
            # 1 -> 1 and stateless unless splitting: restore may skip consumed samples at source.
            preserves_indexability=not self.split_long_samples,
            workers=workers,
        )

    def describe(self) -> dict[str, Any]:
        """As ``Operator.describe``, plus a digest of the tokenizer's vocabulary when it can be
        serialized (``to_str``), so a changed vocabulary changes the pipeline fingerprint."""
        out = super().describe()
        if self._tokenizer_digest is not None:
            out["params"]["tokenizer_digest"] = self._tokenizer_digest
        return out

    def encode_texts(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids (without the end-of-sequence id) of each text, as ``int32`` arrays."""
        tok = self.tokenizer
        mode = self._mode
        if mode == "encode_batch" or mode == "batch_encode_plus":
            if mode == "encode_batch":
                encoded = tok.encode_batch(texts)
            else:
                encoded = tok.batch_encode_plus(texts)["input_ids"]
            if len(encoded) != len(texts):
                raise ValueError(
                    f"the tokenizer's batch encoder returned {len(encoded)} results for "
                    f"{len(texts)} texts"
                )
            return [_as_int32(e) for e in encoded]
        encode = tok.encode if mode == "encode" else tok
        return [_as_int32(encode(t)) for t in texts]

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        field = self.field
        texts: list[str] = []
        for rec in records:
            payload = rec.payload
            try:
                text = payload[field]
            except (KeyError, TypeError, IndexError):
                fields = list(payload) if isinstance(payload, dict) else type(payload).__name__
                raise record_error(
                    self, rec, KeyError(f"the payload has no field {field!r} (it has {fields})")
                ) from None
            if not isinstance(text, str):
                raise record_error(
                    self, rec, TypeError(f"field {field!r} is {type(text).__name__}, not str")
                )
            texts.append(text)
        try:
            encoded = self.encode_texts(texts)
        except Exception as exc:
            if len(records) == 1:
                raise record_error(self, records[0], exc) from exc
            raise
        out_field = self.output_field
        eos = self.eos_id
        max_len = self.max_len
        split = self.split_long_samples
        out: list[SampleRecord] = []
        for rec, ids in zip(records, encoded, strict=True):
            if eos is not None:
                tokens = np.empty(len(ids) + 1, dtype=np.int32)
                tokens[:-1] = ids
                tokens[-1] = eos
            else:
                tokens = ids
            meta = rec.meta
            payload = rec.payload
            n = len(tokens)
            if max_len is None or n <= max_len:
                out.append(SampleRecord(_with_counts(meta, n), {**payload, out_field: tokens}))
            elif not split:
                tokens = tokens[:max_len]
                out.append(
                    SampleRecord(_with_counts(meta, max_len), {**payload, out_field: tokens})
                )
            else:
                k = math.ceil(n / max_len)
                for i in range(k):
                    piece = tokens[i * max_len : (i + 1) * max_len]
                    child = spawn_child(meta, i, is_last_child=i == k - 1)
                    out.append(
                        SampleRecord(_with_counts(child, len(piece)), {**payload, out_field: piece})
                    )
        return out


def _with_counts(meta: SampleMeta, n_tokens: int) -> SampleMeta:
    """``meta`` with the heritage of one sample of its component holding ``n_tokens`` tokens."""
    comp = meta.component
    return SampleMeta(
        meta.cursor,
        lane_id=meta.lane_id,
        contributors=meta.contributors,
        tags=meta.tags,
        component=comp,
        component_sample_counts={comp: 1},
        component_token_counts={comp: n_tokens},
    )


def _encoder_mode(tokenizer: Any) -> str:
    """How to call a tokenizer, in order of preference: its ``encode_batch`` (Hugging Face
    ``tokenizers``, ``ByteTokenizer``), ``batch_encode_plus`` (``transformers``), ``encode``, or
    the tokenizer itself when it is a callable ``str -> ints``."""
    for mode in ("encode_batch", "batch_encode_plus", "encode"):
        if callable(getattr(tokenizer, mode, None)):
            return mode
    if callable(tokenizer):
        return "call"
    raise TypeError(
        f"tokenize: the tokenizer must be callable (str -> ints) or have .encode(str), got "
        f"{type(tokenizer).__name__}"
    )


def _resolve_eos(tokenizer: Any, eos_id: int | None) -> int:
    """The end-of-sequence id: ``eos_id`` when given, else the tokenizer's ``eos_id`` or
    ``eos_token_id`` attribute, else ``ByteTokenizer.eos_id`` (256)."""
    candidates = [
        eos_id,
        getattr(tokenizer, "eos_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ]
    for value in candidates:
        if value is not None and not callable(value):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"tokenize: the end-of-sequence id must be an int, got {value!r}")
            if not -(2**31) <= int(value) < 2**31:
                raise ValueError(f"tokenize: the end-of-sequence id {value} does not fit in int32")
            return int(value)
    return ByteTokenizer.eos_id


def _tokenizer_digest(tokenizer: Any) -> str | None:
    to_str = getattr(tokenizer, "to_str", None)
    if not callable(to_str):
        return None
    try:
        text = to_str()
    except Exception:
        return None
    if not isinstance(text, str):
        return None
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenize(
    tokenizer: Any = None,
    *,
    field: str = "text",
    output_field: str = "tokens",
    max_len: int | None = None,
    split_long_samples: bool = False,
    append_eos: bool = True,
    eos_id: int | None = None,
    workers: int | None = None,
) -> Tokenize:
    """Tokenize ``payload[field]`` into ``payload[output_field]`` (``int32``), other fields kept.

    ``tokenizer``: ``None`` (``ByteTokenizer``), a callable ``str -> ints``, or an object with
    ``.encode(str)`` returning ints or an object with ``.ids`` (Hugging Face ``tokenizers``); its
    ``encode_batch`` is used for the whole micro-batch when present. With ``append_eos`` the id
    ``eos_id``, else the tokenizer's ``eos_id``/``eos_token_id``, else 256 is appended before any
    truncation or splitting. ``max_len`` truncates, or with ``split_long_samples=True`` splits into
    ``ceil(n / max_len)`` children (child ``i`` holds ``[i*max_len, (i+1)*max_len)``).
    """
    return Tokenize(
        tokenizer,
        field=field,
        output_field=output_field,
        max_len=max_len,
        split_long_samples=split_long_samples,
        append_eos=append_eos,
        eos_id=eos_id,
        workers=workers,
    )
