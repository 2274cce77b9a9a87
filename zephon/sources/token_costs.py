"""Token costs of a mixture's components: the mean tokens per sample, estimated once at plan time.

``MixtureSource(by="tokens")`` draws component ``c`` with sample probability proportional to
``w_c / cost_c``, so that its expected share of the **tokens** is ``w_c``. ``cost_c`` is measured
here, once, on a fixed sample of the component's own records read through its ``read()`` (so it
works for every indexed source: memory, Parquet/Arrow, JSON lines, remote files):

- the *estimate sample* is the first ``estimate_size`` images of a permutation of the component's
  sample indices keyed by its name alone (not the mixture's seed): the same data gives the same
  estimate whatever the seed, and a component smaller than ``estimate_size`` is measured whole;
- with ``length_column``, the cost is the mean of that (exact, per-sample) column over the sample;
- otherwise it is the mean UTF-8 bytes of ``text_field`` over the sample times a tokens-per-byte
  ratio: pinned by the user, or calibrated by tokenizing the first ``calibration_size`` records of
  the sample (in permutation order, so they are a uniform sample too) with ``tokenizer``;
- ``added_tokens`` (1 by default: the end-of-sequence id ``tokenize`` appends) is added to every
  cost;
- with ``image_tokens`` (a function of a raw record, e.g. ``zephon.ops.image_token_counter``),
  the mean of what it gives over the same sample is added too: the tokens a vision encoder makes
  of a record's images, which its text bytes do not show;
- a ``TokenShardSource`` (pre-tokenized documents, no tokenizer after it) is not estimated: its
  cost is its exact mean document length, from its index (``method="exact"``, nothing added).

Every quantity is exact integer or rational arithmetic, and the ratio and the cost are rounded to
``QUANTUM`` (1e-6) before they affect anything, so an estimate is identical on every machine and
never depends on thread counts or float summation order. Nothing here changes during a run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from zephon.errors import PlanError
from zephon.sources.base import IndexedSource
from zephon.sources.files import FileSource
from zephon.sources.permutation import derive_key, permute
from zephon.sources.token_shards import TokenShardSource

__all__ = ["QUANTUM", "TokenCost", "count_tokens", "estimate_cost", "estimate_indices", "quantize"]

#: The precision of every ratio and cost that affects sampling.
QUANTUM = Fraction(1, 10**6)
#: Records read per ``read()`` call while measuring, so measuring holds little in memory.
READ_BATCH = 256


def quantize(value: Fraction) -> Fraction:
    """``value`` rounded to the nearest multiple of ``QUANTUM`` (ties to even), exactly."""
    return round(value / QUANTUM) * QUANTUM


@dataclasses.dataclass(frozen=True)
class TokenCost:
    """One component's estimated mean tokens per sample and how it was obtained.

    ``method`` is ``"exact"``, ``"length_column"`` or ``"tokens_per_byte"``; ``sampled`` the
    records measured; ``mean_bytes`` / ``tokens_per_byte`` / ``calibrated`` (records tokenized,
    0 when the ratio was pinned) are set for the byte method only; ``mean_image_tokens`` when
    the estimate counted image tokens (included in ``tokens_per_sample``).
    """

    method: str
    tokens_per_sample: Fraction
    sampled: int
    mean_bytes: Fraction | None = None
    tokens_per_byte: Fraction | None = None
    calibrated: int = 0
    mean_image_tokens: Fraction | None = None

    def describe(self) -> dict[str, Any]:
        """JSON identity for the fingerprint: every quantity as a float (deterministic, since
        each is an exact rational)."""
        out: dict[str, Any] = {
            "method": self.method,
            "tokens_per_sample": float(self.tokens_per_sample),
            "sampled": self.sampled,
        }
        if self.method == "tokens_per_byte":
            assert self.mean_bytes is not None and self.tokens_per_byte is not None
            out["mean_bytes"] = float(self.mean_bytes)
            out["tokens_per_byte"] = float(self.tokens_per_byte)
            out["calibrated"] = self.calibrated
        if self.mean_image_tokens is not None:
            out["mean_image_tokens"] = float(self.mean_image_tokens)
        return out


def estimate_indices(name: str, n: int, size: int) -> np.ndarray:
    """The estimate sample of a component named ``name`` with ``n`` samples: ``min(size, n)``
    distinct sample indices, in permutation order."""
    k = min(size, n)
    return permute(np.arange(k, dtype=np.int64), n, derive_key(0, 0, f"token-cost:{name}"))


def count_tokens(tokenizer: Any, texts: list[str]) -> list[int]:
    """Tokens per text as the tokenizer encodes them: ``encode_batch`` (Hugging Face
    ``tokenizers``, ``ByteTokenizer``), else ``encode`` (``transformers``), else the tokenizer
    called on each text; a result's ``.ids`` when it has them, else the result itself. Padding
    (where a Hugging Face ``Encoding``'s attention mask is 0) is not counted: ``tokenize``
    never delivers it."""
    return _token_counts(_encoder(tokenizer)(texts), len(texts))


def _encoder(tokenizer: Any) -> Callable[[list[str]], Sequence[Any]]:
    """How ``count_tokens`` encodes a list of texts with ``tokenizer``."""
    batch = getattr(tokenizer, "encode_batch", None)
    if callable(batch):
        return batch
    encode = getattr(tokenizer, "encode", None)
    one = encode if callable(encode) else tokenizer
    if not callable(one):
        raise TypeError(
            "MixtureSource: tokenizer must have encode_batch(texts) or encode(text), or be "
            f"callable, got {type(tokenizer).__name__}"
        )
    return lambda texts: [one(t) for t in texts]


def _token_counts(encoded: Sequence[Any], n: int) -> list[int]:
    if len(encoded) != n:
        raise ValueError(
            f"MixtureSource: the tokenizer returned {len(encoded)} results for {n} texts"
        )
    return [_real_tokens(e) for e in encoded]


def _real_tokens(encoded: Any) -> int:
    """The tokens of one encoder result without its padding: a Hugging Face ``Encoding`` of a
    tokenizer with padding enabled is padded to the longest text of its batch (or to a fixed
    length), and its attention mask is 0 there."""
    ids = getattr(encoded, "ids", encoded)
    mask = getattr(encoded, "attention_mask", None)
    if isinstance(mask, list) and len(mask) == len(ids):
        return sum(1 for m in mask if m)
    return len(ids)


def _calibration_tokens(
    name: str, src: IndexedSource, tokenizer: Any, texts: list[str], indices: np.ndarray
) -> int:
    """Tokens in ``texts``, the samples of component ``name`` at ``indices``. An exception of the
    tokenizer is a PlanError naming the component and, when one text alone fails, its sample and
    file, chained to the tokenizer's error; so is a Hugging Face tokenizer with truncation
    enabled, whose counts would stop at its ``max_length`` (``tokenize`` refuses it too)."""
    if getattr(tokenizer, "truncation", None) is not None and callable(
        getattr(tokenizer, "no_truncation", None)
    ):
        raise PlanError(
            f"MixtureSource(by='tokens'): the tokenizer calibrating component {name!r} has "
            "truncation enabled, so its counts would stop at its max_length; call "
            "tokenizer.no_truncation() first (tokenize refuses it as well)"
        )
    encode = _encoder(tokenizer)
    try:
        encoded = encode(texts)
    except Exception as exc:
        where = f"on its {len(texts)} calibration samples together (each alone encodes)"
        for idx, text in zip(indices.tolist(), texts, strict=False):
            try:
                encode([text])
            except Exception:
                where = f"on sample {idx}{_file_of(src, idx)}"
                break
        raise PlanError(
            f"MixtureSource(by='tokens'): the tokenizer failed calibrating component {name!r} "
            f"{where}: {type(exc).__name__}: {exc}; fix the tokenizer or the data, or pin the "
            f"component's ratio with tokens_per_byte={{{name!r}: ...}}"
        ) from exc
    return sum(_token_counts(encoded, len(texts)))


def _file_of(src: IndexedSource, idx: int) -> str:
    """`` in file '...'`` for a sample of a file source, else nothing."""
    if not isinstance(src, FileSource):
        return ""
    file_index = int(src.pointer_rows(np.array([idx], dtype=np.int64))[0, 1])
    return f" in file {src.paths[file_index]!r}"


def _read_payloads(src: IndexedSource, indices: np.ndarray) -> list[tuple[int, Any]]:
    """``(index, payload)`` of the records at ``indices`` (read in sorted batches), in the order
    of ``indices``."""
    order = np.argsort(indices, kind="stable")
    ordered = indices[order]
    out: list[tuple[int, Any]] = [(0, None)] * len(indices)
    for start in range(0, len(ordered), READ_BATCH):
        part = ordered[start : start + READ_BATCH]
        payloads = src.read(src.pointer_rows(part))
        for j, (idx, payload) in enumerate(zip(part.tolist(), payloads, strict=True)):
            out[int(order[start + j])] = (idx, payload)
    return out


def _read_values(src: IndexedSource, name: str, indices: np.ndarray, field: str) -> list[Any]:
    """``payload[field]`` of the records at ``indices``, in the order of ``indices``."""
    values = []
    for idx, payload in _read_payloads(src, indices):
        try:
            values.append(payload[field])
        except (KeyError, TypeError, IndexError):
            fields = list(payload) if isinstance(payload, dict) else type(payload).__name__
            raise ValueError(
                f"MixtureSource(by='tokens'): sample {idx} of component {name!r} has no "
                f"field {field!r} to estimate its tokens from (it has {fields})"
            ) from None
    return values


def _mean_image_tokens(
    name: str, src: IndexedSource, indices: np.ndarray, image_tokens: Callable[[Any], int]
) -> Fraction:
    """The mean of ``image_tokens(payload)`` over the records at ``indices``; a failure or a
    count that is not an int >= 0 is a PlanError naming the component and the sample."""
    total = 0
    for idx, payload in _read_payloads(src, indices):
        try:
            n = image_tokens(payload)
        except Exception as exc:
            raise PlanError(
                f"MixtureSource(by='tokens'): image_tokens failed on sample {idx}"
                f"{_file_of(src, idx)} of component {name!r}: {type(exc).__name__}: {exc}"
            ) from exc
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
            raise PlanError(
                f"MixtureSource(by='tokens'): image_tokens gave {n!r} for sample {idx} of "
                f"component {name!r}; it must return the sample's image tokens, an int >= 0"
            )
        total += int(n)
    return Fraction(total, len(indices))


def _byte_lengths(name: str, texts: list[Any], field: str, indices: np.ndarray) -> list[int]:
    out = []
    for idx, text in zip(indices.tolist(), texts, strict=True):
        if not isinstance(text, str):
            raise TypeError(
                f"MixtureSource(by='tokens'): field {field!r} of sample {idx} of component "
                f"{name!r} is {type(text).__name__}, not str"
            )
        out.append(len(text.encode("utf-8")))
    return out


def _lengths(name: str, values: list[Any], field: str, indices: np.ndarray) -> list[int]:
    out = []
    for idx, value in zip(indices.tolist(), values, strict=True):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(
                f"MixtureSource(by='tokens'): length_column {field!r} of sample {idx} of "
                f"component {name!r} is {value!r}, not an int"
            )
        if value < 0:
            raise ValueError(
                f"MixtureSource(by='tokens'): length_column {field!r} of sample {idx} of "
                f"component {name!r} is negative ({value})"
            )
        out.append(int(value))
    return out


def estimate_cost(
    name: str,
    src: IndexedSource,
    *,
    length_column: str | None,
    text_field: str,
    tokens_per_byte: Fraction | None,
    tokenizer: Any,
    estimate_size: int,
    calibration_size: int,
    added_tokens: int,
    image_tokens: Callable[[Any], int] | None = None,
) -> TokenCost:
    """The token cost of component ``name`` (see the module docstring for the rule). Raises
    ValueError when it cannot be estimated: an empty component, a zero cost, or neither a pinned
    ratio nor a tokenizer for the byte method."""
    n = src.num_samples()
    if n == 0:
        raise ValueError(
            f"MixtureSource(by='tokens'): component {name!r} has no samples to estimate its "
            "token cost from; give it weight 0 or some data"
        )
    indices = estimate_indices(name, n, estimate_size)
    if isinstance(src, TokenShardSource):  # pre-tokenized: every length is in its index
        if image_tokens is not None:
            raise ValueError(
                f"MixtureSource(by='tokens'): component {name!r} is pre-tokenized (its exact "
                "lengths already hold every token); image_tokens= does not apply to it"
            )
        found = TokenCost("exact", quantize(src.exact_tokens_per_sample()), n)
    elif length_column is not None:
        lengths = _lengths(
            name, _read_values(src, name, indices, length_column), length_column, indices
        )
        cost = quantize(Fraction(sum(lengths), len(lengths)) + added_tokens)
        found = TokenCost("length_column", cost, len(lengths))
    else:
        texts = _read_values(src, name, indices, text_field)
        sizes = _byte_lengths(name, texts, text_field, indices)
        mean_bytes = Fraction(sum(sizes), len(sizes))
        calibrated = 0
        if tokens_per_byte is None:
            if tokenizer is None:
                raise ValueError(
                    f"MixtureSource(by='tokens'): component {name!r} needs a token cost: pass "
                    "length_column=, tokens_per_byte= (a number or a dict naming it) or "
                    "tokenizer= (the one you give tokenize)"
                )
            calibrated = min(calibration_size, len(texts))
            tokens = _calibration_tokens(
                name, src, tokenizer, texts[:calibrated], indices[:calibrated]
            )
            total_bytes = sum(sizes[:calibrated])
            tokens_per_byte = (
                quantize(Fraction(tokens, total_bytes)) if total_bytes else Fraction(0)
            )
        cost = quantize(mean_bytes * tokens_per_byte + added_tokens)
        found = TokenCost(
            "tokens_per_byte", cost, len(sizes), mean_bytes, tokens_per_byte, calibrated
        )
    if image_tokens is not None:
        mean = quantize(_mean_image_tokens(name, src, indices, image_tokens))
        found = dataclasses.replace(
            found, tokens_per_sample=found.tokens_per_sample + mean, mean_image_tokens=mean
        )
    if found.tokens_per_sample <= 0:
        raise ValueError(
            f"MixtureSource(by='tokens'): component {name!r} costs 0 tokens per sample by its "
            "estimate; its samples look empty (give it weight 0, or added_tokens >= 1 for the "
            "end-of-sequence id)"
        )
    return found
