"""``tokenize``: text to ``int32`` token ids, 1 -> 1 or 1 -> N when long samples are split.

The end-of-sequence id is never a guess: it is ``eos_id=``, or the tokenizer's own (``find_eos``);
with ``append_eos=True`` and none to be found, construction fails with a ``PlanError``. The
tokenizer's padding token, when it has one (``find_pad``), is published at plan time to the
packers after ``tokenize`` (``provides``), so padding is never silently a real token either.

Every record ``tokenize`` emits carries its mixture heritage: ``component_token_counts =
{component: len(tokens)}`` and ``component_sample_counts = {component: 1}``, which delivery
sums for ``stats()["mixture"]`` and which the packers and ``ensure_mixture`` read.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from zephon._core.records import counted_meta
from zephon._core.tokens import UNDECIDED, int32_ids, tokenized_records
from zephon.errors import PlanError
from zephon.ops.base import Operator, OpTraits
from zephon.ops.basic import record_error
from zephon.ops.children import spawn_child
from zephon.types import SampleRecord
from zephon.validation import check_int

__all__ = [
    "EOS_TOKENS",
    "PAD_TOKENS",
    "ByteTokenizer",
    "SpecialToken",
    "Tokenize",
    "find_eos",
    "find_pad",
    "tokenize",
]

#: Tokens that end a document in common vocabularies, in the order ``find_eos`` prefers them.
EOS_TOKENS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]", "[SEP]")
#: Padding tokens of common vocabularies, in the order ``find_pad`` prefers them.
PAD_TOKENS = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")

_ID_LIMIT = 2**31  # token ids are int32 and never negative: [0, 2**31)


class ByteTokenizer:
    """The default tokenizer: the UTF-8 bytes of a text as ids ``0..255``, end of sequence
    ``eos_id = 256`` (``"<eos>"``) and padding ``pad_id = 257`` (``"<pad>"``).

    Its id space is ``0..257`` (``vocab_size`` 258), so it needs no vocabulary file or download,
    and ``decode(encode(text)) == text`` for every string.
    """

    eos_id = 256
    eos_token = "<eos>"
    pad_id = 257
    pad_token = "<pad>"
    vocab_size = 258

    def encode(self, text: str) -> np.ndarray:
        """The UTF-8 bytes of ``text`` as an ``int32`` array (no end-of-sequence id)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """``encode`` for each text, in order."""
        encode = self.encode
        return [encode(t) for t in texts]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of byte ids; ids outside ``0..255`` (end of sequence, padding) are skipped."""
        arr = np.asarray(ids, dtype=np.int64)
        return bytes(arr[(arr >= 0) & (arr < 256)].astype(np.uint8).tolist()).decode(
            "utf-8", "replace"
        )

    def __call__(self, text: str) -> np.ndarray:
        return self.encode(text)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


# ------------------------------------------------------------------------------ special tokens
@dataclasses.dataclass(frozen=True)
class SpecialToken:
    """A special token id of a tokenizer and its text, when the tokenizer can tell."""

    id: int
    token: str | None

    def label(self) -> str:
        """``1 '</s>'``, or ``1`` when the token's text is unknown."""
        return f"{self.id} {self.token!r}" if self.token is not None else str(self.id)


_HF_METHODS = ("token_to_id", "id_to_token", "to_str")


def _is_hf_tokenizer(tokenizer: Any) -> bool:
    """A Hugging Face ``tokenizers.Tokenizer``, recognized by its methods (so ``tokenizers``
    stays an optional dependency that is never imported here)."""
    return all(callable(getattr(tokenizer, name, None)) for name in _HF_METHODS)


def _is_transformers_tokenizer(tokenizer: Any) -> bool:
    """A ``transformers``-style tokenizer: special ids as ``eos_token_id`` / ``sep_token_id``."""
    return any(hasattr(tokenizer, name) for name in ("eos_token_id", "sep_token_id"))


def _token_text(tokenizer: Any, token_id: int, attribute: str) -> str | None:
    """The text of ``token_id`` in the tokenizer's vocabulary, when it can say."""
    if _is_hf_tokenizer(tokenizer):
        return tokenizer.id_to_token(token_id)
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if callable(convert):
        text = convert(token_id)
        return text if isinstance(text, str) else None
    if getattr(tokenizer, attribute + "_id", None) == token_id:
        text = getattr(tokenizer, attribute + "_token", None)
        return text if isinstance(text, str) else None
    return None


def _checked_id(value: Any, what: str) -> int:
    """``value`` as a token id in ``[0, 2**31)``, else a ``PlanError`` saying what it is for."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or not 0 <= int(value) < _ID_LIMIT
    ):
        raise PlanError(
            f"tokenize: {what} must be a token id (an int in [0, 2**31)), got {value!r}"
        )
    return int(value)


def _post_processor_config(tokenizer: Any) -> Any:
    """The JSON description of a Hugging Face tokenizer's post-processor (``None`` without one);
    read from the post-processor alone, not from the whole tokenizer's JSON with its vocabulary."""
    processor = getattr(tokenizer, "post_processor", None)
    if processor is None:
        return None
    state = processor.__getstate__()  # the post-processor's own JSON, as pickling uses it
    return json.loads(state) if isinstance(state, (bytes, str)) else None


def _appended_by_post_processor(processor: Any) -> tuple[str, int] | None:
    """The special token a Hugging Face post-processor appends to every single sequence (a
    ``$A </s>`` template, the separator of BERT/RoBERTa processing), if any."""
    if not isinstance(processor, dict):
        return None
    kind = processor.get("type")
    if kind == "TemplateProcessing":
        single = processor.get("single") or []
        last = single[-1] if single else None
        if isinstance(last, dict) and isinstance(last.get("SpecialToken"), dict):
            name = last["SpecialToken"].get("id")
            ids = (processor.get("special_tokens") or {}).get(name, {}).get("ids") or []
            if isinstance(name, str) and ids:
                return name, ids[-1]
    elif kind in ("BertProcessing", "RobertaProcessing"):
        sep = processor.get("sep")
        if isinstance(sep, list) and len(sep) == 2:
            return sep[0], sep[1]
    elif kind == "Sequence":
        for inner in reversed(processor.get("processors") or []):
            found = _appended_by_post_processor(inner)
            if found is not None:
                return found
    return None


def _first_known(tokenizer: Any, names: Sequence[str], what: str) -> SpecialToken | None:
    for name in names:
        found = tokenizer.token_to_id(name)
        if found is not None:
            return SpecialToken(_checked_id(found, what), name)
    return None


def find_eos(tokenizer: Any, eos_id: int | None = None) -> SpecialToken | None:
    """The end-of-sequence token: ``eos_id`` when given; else the tokenizer's ``eos_id``
    attribute (``ByteTokenizer``: 256); for a ``transformers``-style tokenizer its
    ``eos_token_id``, then ``sep_token_id``; for a Hugging Face ``tokenizers.Tokenizer`` the
    token its post-processor appends, then the first of ``EOS_TOKENS`` in its vocabulary.
    ``None`` when there is none."""
    if eos_id is not None:
        found = _checked_id(eos_id, "eos_id")
        return SpecialToken(found, _token_text(tokenizer, found, "eos"))
    own = getattr(tokenizer, "eos_id", None)
    if own is not None and not callable(own):
        found = _checked_id(own, f"the tokenizer's eos_id ({type(tokenizer).__name__}.eos_id)")
        return SpecialToken(found, _token_text(tokenizer, found, "eos"))
    if _is_transformers_tokenizer(tokenizer):
        for attribute, text in (("eos_token_id", "eos_token"), ("sep_token_id", "sep_token")):
            value = getattr(tokenizer, attribute, None)
            if value is not None:
                found = _checked_id(value, f"the tokenizer's {attribute}")
                token = getattr(tokenizer, text, None)
                return SpecialToken(found, token if isinstance(token, str) else None)
    if _is_hf_tokenizer(tokenizer):
        appended = _appended_by_post_processor(_post_processor_config(tokenizer))
        if appended is not None:
            name, value = appended
            found = _checked_id(value, f"the id of {name!r} in the tokenizer's post-processor")
            return SpecialToken(found, name)
        return _first_known(tokenizer, EOS_TOKENS, "the tokenizer's end-of-sequence id")
    return None


def find_pad(tokenizer: Any) -> SpecialToken | None:
    """The padding token of a tokenizer: its ``pad_id`` attribute (``ByteTokenizer``: 257),
    ``pad_token_id`` (``transformers``), or for a Hugging Face ``tokenizers.Tokenizer`` the first
    of ``PAD_TOKENS`` in its vocabulary. ``None`` when there is none (the packers then need
    ``pad_id=``)."""
    for attribute in ("pad_id", "pad_token_id"):
        value = getattr(tokenizer, attribute, None)
        if value is not None and not callable(value):
            found = _checked_id(value, f"the tokenizer's {attribute}")
            return SpecialToken(found, _token_text(tokenizer, found, "pad"))
    if _is_hf_tokenizer(tokenizer):
        return _first_known(tokenizer, PAD_TOKENS, "the tokenizer's padding id")
    return None


def _refuse_batch_padding(tokenizer: Any) -> None:
    """A Hugging Face tokenizer with padding enabled pads every batch to its longest text: the
    padding would become part of each document, so it is refused."""
    padding = getattr(tokenizer, "padding", None) if _is_hf_tokenizer(tokenizer) else None
    if padding is None:
        return
    pad = padding.get("pad_id") if isinstance(padding, dict) else None
    raise PlanError(
        "tokenize: the tokenizer has padding enabled, so every batch would be padded to its "
        "longest text and the padding would become part of each document. Call "
        "tokenizer.no_padding() first; the packers pad rows themselves"
        + (f" (pass them pad_id={pad}, the id it padded with)" if pad is not None else "")
    )


def _refuse_truncation(tokenizer: Any, owner: str, instead: str) -> None:
    """A Hugging Face tokenizer with truncation enabled (as many saved ``tokenizer.json`` files
    of encoders are) cuts every text at its ``max_length`` and drops the rest: refused, since
    the documents would lose their tails silently. ``instead`` says what cuts them openly."""
    truncation = getattr(tokenizer, "truncation", None) if _is_hf_tokenizer(tokenizer) else None
    if truncation is None:
        return
    length = truncation.get("max_length") if isinstance(truncation, dict) else None
    at = f" at {length} tokens" if length is not None else ""
    raise PlanError(
        f"{owner}: the tokenizer has truncation enabled, so every text would be cut{at} and "
        f"the rest dropped silently. Call tokenizer.no_truncation() first; {instead}"
    )


def _no_eos_error(tokenizer: Any) -> PlanError:
    if _is_hf_tokenizer(tokenizer):
        looked = f"its post-processor and the tokens {', '.join(EOS_TOKENS)}"
    elif _is_transformers_tokenizer(tokenizer):
        looked = "eos_token_id and sep_token_id, both None"
    else:
        looked = "it has no eos_id attribute"
    what = getattr(tokenizer, "__qualname__", None) or type(tokenizer).__name__
    return PlanError(
        f"tokenize: the tokenizer {what} has no end-of-sequence token ({looked}); "
        "pass eos_id= (the id your model ends documents with) or append_eos=False"
    )


# ------------------------------------------------------------------------------ calling
def _encoder_mode(tokenizer: Any) -> str:
    """How to call a tokenizer, in order of preference: a Hugging Face tokenizer's
    ``encode_batch_fast`` (no character offsets) or ``encode_batch`` (also ``ByteTokenizer``),
    ``batch_encode_plus`` (``transformers`` 4), a ``transformers`` tokenizer called on the whole
    list, ``encode``, or the tokenizer itself when it is a callable ``str -> ints``."""
    if _is_hf_tokenizer(tokenizer) and callable(getattr(tokenizer, "encode_batch_fast", None)):
        return "encode_batch_fast"
    for mode in ("encode_batch", "batch_encode_plus"):
        if callable(getattr(tokenizer, mode, None)):
            return mode
    if callable(tokenizer) and callable(getattr(tokenizer, "convert_ids_to_tokens", None)):
        return "call_batch"
    if callable(getattr(tokenizer, "encode", None)):
        return "encode"
    if callable(tokenizer):
        return "call"
    raise TypeError(
        f"tokenize: the tokenizer must be callable (str -> ints) or have .encode(str), got "
        f"{type(tokenizer).__name__}"
    )


def _encode(tokenizer: Any, mode: str, texts: list[str]) -> Sequence[Any]:
    """The tokenizer's raw results for ``texts``, one per text, called the ``mode`` way."""
    if mode == "encode_batch_fast":
        return tokenizer.encode_batch_fast(texts)
    if mode == "encode_batch":
        return tokenizer.encode_batch(texts)
    if mode == "batch_encode_plus":
        return tokenizer.batch_encode_plus(texts)["input_ids"]
    if mode == "call_batch":
        return tokenizer(texts)["input_ids"]
    encode = tokenizer.encode if mode == "encode" else tokenizer
    return [encode(t) for t in texts]


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


# ------------------------------------------------------------------------------ conversion
def _fill(ids: Any, n: int, eos: int | None, limit: int | None) -> np.ndarray:
    """One new ``int32`` array: ``ids`` (``n`` of them) then ``eos``, cut to ``limit`` tokens.

    The ids (an integer array) are cast once, on the copy into the output; the eos is appended
    before the cut, so a cut document ends without it.
    """
    total = n if eos is None else n + 1
    if limit is not None and total > limit:
        out = np.empty(limit, dtype=np.int32)
        out[:] = ids[:limit]
        return out
    out = np.empty(total, dtype=np.int32)
    out[:n] = ids
    if eos is not None:
        out[n] = eos
    return out


def _checked_fill(encoded: Any, eos: int | None, limit: int | None) -> np.ndarray:
    """``_fill`` for an encoder result: 1-D integer ids in ``[0, 2**31)``. A list of ints is
    checked and converted in one compiled pass; anything else is checked on the ids themselves
    (reductions, no copy) before the one conversion into the output."""
    ids = _ids_of(encoded)
    if type(ids) is list:
        out = int32_ids(ids, eos, limit)
        if out is not UNDECIDED:
            return out
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise ValueError(f"the tokenizer returned an array of shape {ids.shape}, not a sequence")
    if ids.size:
        kind = ids.dtype.kind
        if kind not in "iu":
            raise TypeError(f"the tokenizer returned {ids.dtype} values, not integer token ids")
        if kind == "i" or ids.dtype.itemsize >= 4:  # small unsigned ids always fit
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= _ID_LIMIT:
                raise ValueError(f"token ids {lo}..{hi} fall outside [0, 2**31)")
    return _fill(ids, len(ids), eos, limit)


class Tokenize(Operator):
    """Tokenizes ``payload[field]`` into an ``int32`` array in ``payload[output_field]``.

    1 -> 1 (truncating to ``max_len`` when given), or 1 -> ``ceil(n / max_len)`` children through
    ``spawn_child`` with ``split_long_samples`` (only the last child closes its base offset).
    Every output carries ``component_token_counts`` / ``component_sample_counts`` for its component.

    Chosen at construction and exposed: ``eos_id`` / ``eos_token`` (``None`` without
    ``append_eos``), ``appends_eos`` (False when the tokenizer's own post-processor already ends
    every encoding with it, so it is never doubled), and the tokenizer's ``pad_id`` /
    ``pad_token`` (``None`` when it has none), which packers downstream use for padding.
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
        if max_len is not None:
            max_len = check_int(max_len, "max_len", "tokenize", minimum=1)
        if workers is not None:
            workers = check_int(workers, "workers", "tokenize", minimum=1)
        if split_long_samples and max_len is None:
            raise ValueError("tokenize: split_long_samples=True needs max_len")
        self.tokenizer = tokenizer
        self.field = field
        self.output_field = output_field
        self.max_len = max_len
        self.split_long_samples = bool(split_long_samples)
        self.append_eos = bool(append_eos)
        self._mode = _encoder_mode(tokenizer)
        _refuse_batch_padding(tokenizer)
        _refuse_truncation(
            tokenizer,
            "tokenize",
            "max_len= cuts documents (with split_long_samples=True, keeping the rest)",
        )

        eos = find_eos(tokenizer, eos_id) if self.append_eos else None
        if self.append_eos and eos is None:
            raise _no_eos_error(tokenizer)
        self.eos_id = eos.id if eos else None
        self.eos_token = eos.token if eos else None
        # A tokenizer whose post-processor ends every encoding with the eos already gets none
        # from tokenize (it would be doubled).
        self.appends_eos = eos is not None and not self._ends_with_eos(eos.id)
        pad = find_pad(tokenizer)
        self.pad_id = pad.id if pad else None
        self.pad_token = pad.token if pad else None
        self.name = self._label(eos, pad)
        self.traits = OpTraits(
            preserves_cursor_order=True,
            # 1 -> 1 and stateless unless splitting: restore may skip consumed samples at source.
            preserves_indexability=not self.split_long_samples,
            workers=workers,
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Tokenize:
        # Each lane runs its own copy of the operator. A Hugging Face ``Tokenizer`` encodes
        # without changing itself, so the copies share it: copying one re-parses its whole
        # vocabulary. Any other tokenizer (one that may keep state) is copied with the operator.
        tok = self.tokenizer
        if type(tok).__module__ == "tokenizers" and type(tok).__qualname__ == "Tokenizer":
            memo[id(tok)] = tok
        new = object.__new__(type(self))
        memo[id(self)] = new
        for name, value in vars(self).items():
            setattr(new, name, copy.deepcopy(value, memo))
        return new

    def releases_gil(self) -> bool:
        """True for a Hugging Face tokenizer's batch encoder, which encodes in Rust without the
        GIL (and may be called from two threads at once): the lane runner encodes the next read
        beside the current one."""
        return self._mode in ("encode_batch_fast", "encode_batch") and _is_hf_tokenizer(
            self.tokenizer
        )

    def _ends_with_eos(self, eos: int) -> bool:
        """Whether the tokenizer itself ends every encoding with ``eos`` (probed on the empty
        text; only tokenizers that add special tokens themselves are asked)."""
        tok = self.tokenizer
        if not (_is_hf_tokenizer(tok) or _is_transformers_tokenizer(tok)):
            return False
        (empty,) = self.encode_texts([""])
        return len(empty) > 0 and int(empty[-1]) == eos

    def _label(self, eos: SpecialToken | None, pad: SpecialToken | None) -> str:
        """The operator's name in plans and errors: which eos it appends and which pad it has."""
        if eos is None:
            parts = ["append_eos=False"]
        else:
            parts = [f"eos={eos.label()}" + ("" if self.appends_eos else " by the tokenizer")]
        if pad is not None:
            parts.append(f"pad={pad.label()}")
        return f"tokenize({', '.join(parts)})"

    def provides(self) -> dict[str, Any]:
        """Plan-time facts for the operators after this one: the field the token ids are written
        to, and the tokenizer's end-of-sequence and padding ids (``None`` when it has none)."""
        return {
            "token_field": self.output_field,
            "eos_id": self.eos_id,
            "eos_token": self.eos_token,
            "pad_id": self.pad_id,
            "pad_token": self.pad_token,
            "pad_from": self.name,
        }

    def describe(self) -> dict[str, Any]:
        """As ``Operator.describe``, plus a digest of the tokenizer's vocabulary when it can be
        serialized (``to_str``), so a changed vocabulary changes the pipeline fingerprint."""
        out = super().describe()
        digest = tokenizer_digest(self.tokenizer, out["params"]["tokenizer"])
        if digest is not None:
            out["params"]["tokenizer_digest"] = digest
        return out

    def _raw(self, texts: list[str]) -> Sequence[Any]:
        encoded = _encode(self.tokenizer, self._mode, texts)
        if len(encoded) != len(texts):
            raise ValueError(
                f"the tokenizer's batch encoder returned {len(encoded)} results for "
                f"{len(texts)} texts"
            )
        return encoded

    def encode_texts(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids (without the end-of-sequence id) of each text, as ``int32`` arrays."""
        return [_checked_fill(e, None, None) for e in self._raw(texts)]

    def _texts_of(self, records: list[SampleRecord]) -> list[str]:
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
        return texts

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        texts = self._texts_of(records)
        try:
            encoded = self._raw(texts)
        except Exception as exc:
            if len(records) == 1:
                raise record_error(self, records[0], exc) from exc
            raise
        out_field = self.output_field
        eos = self.eos_id if self.appends_eos else None
        # Truncation happens in the one conversion; splitting cuts views of the whole document.
        piece_len = self.max_len if self.split_long_samples else None
        limit = None if self.split_long_samples else self.max_len
        out: list[SampleRecord] = []
        if piece_len is None and type(encoded) is list:
            # The whole call in one compiled pass; it stops at a record only this loop handles
            # (and reports, with the record), which continues from there.
            out = tokenized_records(records, encoded, out_field, eos, limit)
            if len(out) == len(records):
                return out
        done = len(out)
        for rec, result in zip(records[done:], encoded[done:], strict=True):
            try:
                tokens = _checked_fill(result, eos, limit)
            except (AttributeError, TypeError, ValueError, OverflowError) as exc:
                raise record_error(self, rec, exc) from exc
            meta = rec.meta
            payload = rec.payload
            n = len(tokens)
            if piece_len is None or n <= piece_len:
                out.append(SampleRecord(counted_meta(meta, n), {**payload, out_field: tokens}))
            else:
                k = math.ceil(n / piece_len)
                for i in range(k):
                    piece = tokens[i * piece_len : (i + 1) * piece_len]
                    child = spawn_child(meta, i, is_last_child=i == k - 1)
                    out.append(
                        SampleRecord(counted_meta(child, len(piece)), {**payload, out_field: piece})
                    )
        return out


def tokenizer_digest(tokenizer: Any, identity: Any) -> str | None:
    """A digest of the tokenizer's serialized form (``to_str``, Hugging Face), when it has one.
    ``identity`` is what ``describe()`` made of the tokenizer: for a ``tokenizers.Tokenizer`` it
    holds this digest already, which is taken rather than serializing the vocabulary again."""
    if isinstance(identity, dict) and "tokenizer" in identity and "sha256" in identity:
        return str(identity["sha256"])
    to_str = getattr(tokenizer, "to_str", None)
    if not callable(to_str):
        return None
    text = to_str()
    if not isinstance(text, str):
        return None
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def backend_digest(tokenizer: Any, identity: Any) -> str | None:
    """``tokenizer_digest`` of the Hugging Face tokenizer behind ``tokenizer`` (a transformers
    fast tokenizer's ``backend_tokenizer``, else the tokenizer itself), taken from ``identity``
    when ``describe()`` hashed it already."""
    if isinstance(identity, dict) and "backend_sha256" in identity:
        return str(identity["backend_sha256"])
    return tokenizer_digest(getattr(tokenizer, "backend_tokenizer", tokenizer), identity)


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

    ``tokenizer``: ``None`` (``ByteTokenizer``), a Hugging Face ``tokenizers.Tokenizer``, a
    ``transformers`` tokenizer, an object with ``.encode(str)`` returning ints (or an object with
    ``.ids``), or a callable ``str -> ints``; batch encoders are used for the whole micro-batch.

    With ``append_eos`` every document ends with the end-of-sequence id, appended before any
    truncation or splitting: ``eos_id`` when given, else the tokenizer's own (see ``find_eos``:
    ``ByteTokenizer`` 256, ``eos_token_id``/``sep_token_id``, a post-processor's ``$A </s>``, or
    a token such as ``</s>``, ``<|endoftext|>``, ``<eos>``, ``[SEP]``); a tokenizer that has
    none is a ``PlanError`` saying to pass ``eos_id=`` or ``append_eos=False``. ``max_len``
    truncates, or with ``split_long_samples=True`` splits into ``ceil(n / max_len)`` children
    (child ``i`` holds ``[i*max_len, (i+1)*max_len)``). Token ids must lie in ``[0, 2**31)``.
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
