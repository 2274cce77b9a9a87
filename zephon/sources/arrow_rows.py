"""Payload dicts of rows of a decoded Arrow table (the value rule is in ``zephon.sources.arrow``):
numeric list columns become numpy arrays, without importing pandas or ``pyarrow.compute``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pyarrow is imported when a file is first touched, not with zephon.sources
    import pyarrow as pa


def table_rows(table: pa.Table, indices: np.ndarray, names: Sequence[str]) -> list[dict[str, Any]]:
    """Payload dicts of rows ``indices`` of ``table``, keys in ``names`` order (see the module
    docstring for the value rule)."""
    if not names:
        return [{} for _ in range(len(indices))]
    picked = _contiguous(table, indices)
    if picked is None:
        picked = table.take(_index_array(indices))
    columns = [_column_values(picked.column(name)) for name in names]
    return [dict(zip(names, values, strict=True)) for values in zip(*columns, strict=True)]


def _contiguous(table: pa.Table, indices: np.ndarray) -> pa.Table | None:
    """A zero-copy slice of ``table`` when ``indices`` are consecutive rows (a chunk read in
    order: no gather, and no import of ``pyarrow.compute``, which ``take`` needs), else None."""
    n = len(indices)
    if not n:
        return None
    first = int(indices[0])
    if int(indices[-1]) - first != n - 1 or (n > 2 and not (np.diff(indices) == 1).all()):
        return None
    return table.slice(first, n)


def _index_array(indices: np.ndarray) -> pa.Array:
    """``indices`` as an int64 Arrow array, wrapped rather than converted: ``pa.array()`` makes
    pyarrow import pandas when it is installed, which would cost every worker process about
    0.4 s and tens of MiB before its first batch."""
    import pyarrow as pa

    values = np.ascontiguousarray(indices, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(values), [None, pa.py_buffer(values)])


def _column_values(column: pa.ChunkedArray) -> list[Any]:
    import pyarrow as pa

    arr = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    typ = arr.type
    if (
        pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ)
    ) and (
        pa.types.is_integer(typ.value_type)
        or pa.types.is_floating(typ.value_type)
        or pa.types.is_boolean(typ.value_type)
    ):
        return _numeric_lists(arr)
    return arr.to_pylist()


def _numeric_lists(arr: Any) -> list[Any]:
    import pyarrow as pa

    values = arr.values  # the whole child array: offsets below index into it
    if pa.types.is_fixed_size_list(arr.type):
        k = arr.type.list_size
        offsets = (np.arange(len(arr) + 1, dtype=np.int64) + arr.offset) * k
    else:
        offsets = _to_numpy(arr.offsets)
    # A list with a null element becomes a Python list; only the others read values_np.
    elem_valid = _to_numpy(values.is_valid()) if values.null_count else None
    values_np = _to_numpy(values)
    list_null = _to_numpy(arr.is_null()) if arr.null_count else None
    out: list[Any] = []
    for j in range(len(arr)):
        if list_null is not None and list_null[j]:
            out.append(None)
            continue
        a, b = int(offsets[j]), int(offsets[j + 1])
        if elem_valid is not None and not elem_valid[a:b].all():
            out.append(values.slice(a, b - a).to_pylist())
        else:
            out.append(values_np[a:b].copy())
    return out


# Arrow's names of the fixed-width types numpy names otherwise.
_NUMPY_NAMES = {"halffloat": "float16", "float": "float32", "double": "float64"}


def _to_numpy(arr: Any) -> np.ndarray:
    """The values of a boolean or numeric array, a view of its buffer where they are not bits
    (pyarrow's ``to_numpy()`` imports pandas when it is installed). A null's slot holds whatever
    the buffer holds there."""
    import pyarrow as pa

    data, n, at = arr.buffers()[1], len(arr), arr.offset
    if pa.types.is_boolean(arr.type):
        if data is None:
            return np.zeros(n, dtype=bool)
        bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
        return bits[at : at + n].astype(bool)
    dtype = np.dtype(_NUMPY_NAMES.get(str(arr.type), str(arr.type)))
    if data is None:
        return np.zeros(n, dtype=dtype)
    return np.frombuffer(data, dtype=dtype, count=at + n)[at:]
