"""Compact, checkable encodings for what checkpoints carry in bulk: non-negative integers as
zlib-compressed int64 in base64, and JSON likewise. Decoding anything else is a ``ValueError``.

Decoding is bounded: a field expands to at most ``MAX_EXPANSION`` times its packed length
(``MIN_UNPACKED`` bytes for a short one) and never past ``MAX_UNPACKED``, so a crafted field that
would inflate to gigabytes is refused after that much, before anything is built from it. What
Zephon packs stays far below the ratio (snapshots of real lanes: under 12 times)."""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "MAX_EXPANSION",
    "MAX_UNPACKED",
    "MIN_UNPACKED",
    "pack_bits",
    "pack_ints",
    "pack_json",
    "unpack_bits",
    "unpack_ints",
    "unpack_json",
    "unpacked_limit",
]

#: A packed field may expand to this many times its length in characters (base64 of zlib) ...
MAX_EXPANSION = 32
#: ... or to this many bytes, whichever is more: short fields need room to be useful ...
MIN_UNPACKED = 64 * 1024
#: ... but never to more than this (the cursors of some 700,000 held records).
MAX_UNPACKED = 16 * 1024 * 1024


def pack_ints(values: Sequence[int] | np.ndarray) -> str:
    """Non-negative ints as base64 of zlib-compressed int64."""
    raw = np.asarray(values, dtype=np.int64).tobytes()
    return base64.b64encode(zlib.compress(raw, 1)).decode("ascii")


def pack_bits(mask: np.ndarray) -> str:
    """A bool array as base64 of zlib-compressed bits (its length is kept elsewhere)."""
    raw = np.packbits(np.asarray(mask, dtype=bool), bitorder="little").tobytes()
    return base64.b64encode(zlib.compress(raw, 1)).decode("ascii")


def unpack_bits(text: Any, n: int) -> np.ndarray:
    """The ``n`` bools ``pack_bits`` made; ValueError for anything else. Long runs of equal bits
    (the open end of a chunk of a million samples) pack far tighter than ``MAX_EXPANSION``, so
    the field may inflate to the bytes its ``n`` bits take, and never past ``MAX_UNPACKED``."""
    needed = min(MAX_UNPACKED, (max(n, 0) + 7) // 8)
    tight = type(text) is str and needed > unpacked_limit(text)
    raw = _inflate(text, "bits", needed if tight else None)
    if len(raw) != (n + 7) // 8:
        raise ValueError(f"not {n} packed bits ({len(raw)} bytes)")
    return np.unpackbits(np.frombuffer(raw, dtype=np.uint8), count=n, bitorder="little") > 0


def unpacked_limit(text: str) -> int:
    """The most bytes the packed field ``text`` may expand to."""
    return min(MAX_UNPACKED, max(MIN_UNPACKED, MAX_EXPANSION * len(text)))


def _inflate(text: Any, what: str, limit: int | None = None) -> bytes:
    """The bytes packed in ``text``, at most ``limit`` of them (``unpacked_limit(text)`` when
    None); ValueError for anything else, and for a field that expands further (it was not written
    by Zephon)."""
    if type(text) is not str:
        raise ValueError(f"not packed {what}: {text!r:.80}")
    try:
        packed = base64.b64decode(text.encode("ascii"), validate=True)
        inflater = zlib.decompressobj()
        bound = unpacked_limit(text) if limit is None else limit
        raw = inflater.decompress(packed, bound)
        if not inflater.eof and inflater.decompress(inflater.unconsumed_tail, 1):
            raise ValueError(
                f"not packed {what}: it expands past {bound} bytes, more than Zephon ever packs "
                + (
                    f"into {len(text)} characters ({MAX_EXPANSION} times, at most {MAX_UNPACKED})"
                    if limit is None
                    else "into this field"
                )
            )
        if not inflater.eof:
            raise ValueError(f"not packed {what} (the compressed data is incomplete)")
        if inflater.unused_data:
            raise ValueError(f"not packed {what} (data after the compressed stream)")
    except (binascii.Error, zlib.error, UnicodeEncodeError) as exc:
        raise ValueError(f"not packed {what} ({exc})") from None
    return raw


def unpack_ints(text: Any, limit: int | None = None) -> np.ndarray:
    """What ``pack_ints`` made; ValueError for anything else. ``limit`` bounds the bytes it
    inflates to instead of ``unpacked_limit``, for a field whose own rules bound its size (and
    whose regular content can pack far tighter than ``MAX_EXPANSION``)."""
    raw = _inflate(text, "integers", limit)
    if len(raw) % 8:
        raise ValueError("not packed integers (a partial int64)")
    values = np.frombuffer(raw, dtype=np.int64)
    if len(values) and int(values.min()) < 0:
        raise ValueError("packed integers must be >= 0")
    return values


def pack_json(obj: Any) -> str:
    """``obj`` as base64 of zlib-compressed JSON (keys sorted)."""
    return base64.b64encode(zlib.compress(json.dumps(obj, sort_keys=True).encode(), 1)).decode()


def unpack_json(text: Any) -> Any:
    """What ``pack_json`` made; ValueError for anything else."""
    raw = _inflate(text, "JSON")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"not packed JSON ({exc})") from None
