"""``batch``: groups consecutive records of a lane into a ``SampleBatch`` at delivery."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any

import numpy as np

from zephon._core.records import payloads_of
from zephon.errors import PlanError
from zephon.ops.base import Operator, OpTraits
from zephon.types import SampleRecord

__all__ = ["Batch", "batch", "collate_payloads", "default_collate"]


def default_collate(records: Sequence[SampleRecord]) -> Any:
    """Dict payloads become a dict of stacked arrays (array fields of one shape) or lists
    (everything else); other payloads become a list."""
    if type(records) is list:
        return collate_payloads(payloads_of(records))
    return collate_payloads([r.payload for r in records])


def collate_payloads(payloads: list[Any]) -> Any:
    """``default_collate`` on the payloads themselves: dicts with the same keys in the same order
    become a dict of stacked arrays (array fields of one shape and dtype) or lists; anything else
    stays the list it was."""
    if not payloads:
        return payloads
    kinds = set(map(type, payloads))
    if not all(issubclass(kind, dict) for kind in kinds):
        return payloads
    if len(set(map(tuple, payloads))) != 1:  # not one key order shared by all
        return payloads
    out: dict[str, Any] = {}
    for key in payloads[0]:
        values = list(map(itemgetter(key), payloads))
        first = values[0]
        if isinstance(first, np.ndarray) and all(
            isinstance(v, np.ndarray) and v.shape == first.shape and v.dtype == first.dtype
            for v in values
        ):
            out[key] = np.stack(values)
        else:
            out[key] = values
    return out


class Batch(Operator):
    """Groups ``batch_size`` consecutive records per lane; run by delivery, never inside a lane.

    Bookkeeping for the grouped records happens when the batch is handed to the training loop,
    so a checkpoint never counts records that sit in an undelivered batch.
    """

    name = "batch"
    groups_at_delivery = True
    traits = OpTraits(preserves_cursor_order=True)

    def __init__(
        self,
        batch_size: int,
        *,
        drop_remainder: bool = False,
        collate: Callable[[Sequence[SampleRecord]], Any] | None = None,
    ):
        if int(batch_size) < 1:
            raise PlanError(f"batch: batch_size must be >= 1, got {batch_size}")
        self.batch_size = int(batch_size)
        self.drop_remainder = drop_remainder
        self.collate = collate or default_collate

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        raise TypeError("batch groups records at delivery; it never runs inside a lane")


def batch(
    batch_size: int,
    *,
    drop_remainder: bool = False,
    collate: Callable[[Sequence[SampleRecord]], Any] | None = None,
) -> Batch:
    """The last operator: ``batch_size`` records per ``SampleBatch``, collated by ``collate``."""
    return Batch(batch_size, drop_remainder=drop_remainder, collate=collate)
