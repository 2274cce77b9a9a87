"""Compact, checkable encodings for what checkpoints carry in bulk: non-negative integers as
zlib-compressed int64 in base64, and JSON likewise. Decoding anything else is a ``ValueError``."""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["pack_ints", "pack_json", "unpack_ints", "unpack_json"]


def pack_ints(values: Sequence[int] | np.ndarray) -> str:
    """Non-negative ints as base64 of zlib-compressed int64."""
    raw = np.asarray(values, dtype=np.int64).tobytes()
    return base64.b64encode(zlib.compress(raw, 1)).decode("ascii")


def unpack_ints(text: Any) -> np.ndarray:
    """What ``pack_ints`` made; ValueError for anything else."""
    if type(text) is not str:
        raise ValueError(f"not packed integers: {text!r}")
    try:
        raw = zlib.decompress(base64.b64decode(text.encode("ascii"), validate=True))
    except (binascii.Error, zlib.error, UnicodeEncodeError) as exc:
        raise ValueError(f"not packed integers ({exc})") from None
    if len(raw) % 8:
        raise ValueError("not packed integers (a partial int64)")
    values = np.frombuffer(raw, dtype=np.int64)
    if len(values) and int(values.min()) < 0:
        raise ValueError("packed integers must be >= 0")
    return values


def pack_json(obj: Any) -> str:
    return base64.b64encode(zlib.compress(json.dumps(obj, sort_keys=True).encode(), 1)).decode()


def unpack_json(text: Any) -> Any:
    if type(text) is not str:
        raise ValueError(f"not packed JSON: {text!r}")
    try:
        return json.loads(zlib.decompress(base64.b64decode(text.encode("ascii"), validate=True)))
    except (binascii.Error, zlib.error, UnicodeEncodeError, ValueError) as exc:
        raise ValueError(f"not packed JSON ({exc})") from None
