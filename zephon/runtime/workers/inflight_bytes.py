"""How many payload bytes a lane holds ahead of the loader (``Pipeline(max_inflight_bytes=)``).

A lane's read-ahead is bounded by item lists (``prefetch``) and, when the plan asks, by bytes. The
bytes are the payloads' own: numpy arrays' ``nbytes``, the length of bytes and str values and the
pixels of a ``RawImage``, summed through dicts, lists and tuples; control items and anything else
count nothing. A process lane counts the body of the message that carries a list instead, which
the pipe already measured.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zephon._core.records import RecordRun
from zephon.sources.image_values import RawImage
from zephon.types import SampleRecord


def payload_bytes(value: Any) -> int:
    """The bytes held by one payload (arrays, bytes, str and raw images, inside dicts, lists and
    tuples)."""
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, (bytes, bytearray, str)):
        return len(value)
    if isinstance(value, memoryview):
        return value.nbytes
    if isinstance(value, RawImage):  # an image column of MDS or LitData, not decoded yet
        return len(value.pixels)
    if isinstance(value, dict):
        return sum(payload_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(payload_bytes(v) for v in value)
    return 0


def item_list_bytes(items: list[Any]) -> int:
    """The payload bytes of a lane's item list: its runs' and its records' payloads."""
    total = 0
    for item in items:
        if type(item) is RecordRun:
            total += sum(payload_bytes(p) for p in item.payloads)
        elif isinstance(item, SampleRecord):
            total += payload_bytes(item.payload)
    return total


def has_room(queued_bytes: int, bound: int | None) -> bool:
    """Whether a lane holding ``queued_bytes`` ahead of the loader may hand over one more list.
    The bound stops the read-ahead once reached, never the first list: one list larger than the
    bound still goes, alone, so no lane can wait forever."""
    return bound is None or queued_bytes < bound
