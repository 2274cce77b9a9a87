"""``batch``: groups consecutive records of a lane into a ``SampleBatch`` at delivery."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from zephon._core.collate import UNDECIDED, collate_dicts, collate_run
from zephon._core.records import JoinedRuns, RecordRun, payloads_of
from zephon.ops.base import Operator, OpTraits
from zephon.types import SampleRecord
from zephon.validation import check_int

__all__ = ["Batch", "batch", "collate_payloads", "default_collate"]


def default_collate(records: Sequence[SampleRecord]) -> Any:
    """Dict payloads become a dict of columns (see ``collate_payloads``); other payloads become a
    list."""
    if type(records) is RecordRun:  # no record built, the payloads read where they are
        out = collate_run(records, _column)
        return collate_by_rule(records.payloads) if out is UNDECIDED else out
    if type(records) is JoinedRuns:
        payloads = records.payloads
    elif type(records) is list:
        payloads = payloads_of(records)
    else:
        payloads = [r.payload for r in records]
    return collate_payloads(payloads)


# Python scalar types whose columns become arrays, and the dtype they take (as torch's
# default_collate does); numpy scalars keep their own dtype.
_SCALAR_DTYPES: dict[type, type] = {int: np.int64, float: np.float64, bool: np.bool_}
_NUMERIC_KINDS = "biufc"


def collate_payloads(payloads: list[Any]) -> Any:
    """``default_collate`` on the payloads themselves: dicts with the same keys in the same order
    become a dict of columns, anything else stays the list it was.

    A column becomes a numpy array when every value has the same type: arrays of one shape and
    dtype are stacked; Python ints become ``int64``, floats ``float64`` and bools ``bool``;
    numeric numpy scalars keep their dtype. Strings, ``None``, mixed types and anything else stay
    lists. Python ints that do not fit in int64 raise ``OverflowError`` naming the field.

    The common cases run in a compiled loop (``zephon._core.collate``) that hands anything it does
    not cover back to ``collate_by_rule``, so both give the same result.
    """
    if type(payloads) is list:
        out = collate_dicts(payloads, _column)
        if out is not UNDECIDED:
            return out
    return collate_by_rule(payloads)


def collate_by_rule(payloads: list[Any]) -> Any:
    """``collate_payloads`` written out in Python: the rule the compiled loop follows."""
    if not payloads:
        return payloads
    kinds = set(map(type, payloads))
    if not all(issubclass(kind, dict) for kind in kinds):
        return payloads
    if len(set(map(tuple, payloads))) != 1:  # not one key order shared by all
        return payloads
    # One key order: the values of all payloads, transposed in one pass, are the columns.
    columns = zip(*map(dict.values, payloads))
    return {key: _column(key, values) for key, values in zip(payloads[0], columns)}


def _column(key: Any, values: tuple[Any, ...]) -> Any:
    """One collated column (see ``collate_payloads``)."""
    first = values[0]
    kind = type(first)
    if kind is np.ndarray:
        if all(
            isinstance(v, np.ndarray) and v.shape == first.shape and v.dtype == first.dtype
            for v in values
        ):
            return np.stack(values)
        return list(values)
    dtype: Any = _SCALAR_DTYPES.get(kind)
    if dtype is None:
        if not isinstance(first, np.generic) or first.dtype.kind not in _NUMERIC_KINDS:
            return list(values)
        dtype = first.dtype
    if len(set(map(type, values))) != 1:  # mixed types (1 and 1.5, 1 and True) stay a list
        return list(values)
    try:
        return np.fromiter(values, dtype, len(values))
    except OverflowError:
        raise OverflowError(
            f"field {key!r} holds Python ints that do not fit in int64 (from {min(values)} to "
            f"{max(values)}); store them as strings or numpy uint64, or pass batch(collate=...)"
        ) from None


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
        self.batch_size = check_int(batch_size, "batch_size", "batch", minimum=1)
        self.drop_remainder = drop_remainder
        self.collate = collate or default_collate

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        raise TypeError("batch groups records at delivery; it never runs inside a lane")

    def describe(self) -> dict[str, Any]:
        """As ``Operator.describe``, with the default collate by name: the library's own code
        changes between versions, and checkpoints must not depend on that (a collate you pass
        still enters by its code)."""
        out = super().describe()
        if self.collate is default_collate:
            out["params"]["collate"] = f"{__name__}.default_collate"
        return out


def batch(
    batch_size: int,
    *,
    drop_remainder: bool = False,
    collate: Callable[[Sequence[SampleRecord]], Any] | None = None,
) -> Batch:
    """The last operator: ``batch_size`` records per ``SampleBatch``, collated by ``collate``."""
    return Batch(batch_size, drop_remainder=drop_remainder, collate=collate)
