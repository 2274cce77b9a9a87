"""Pointer rows made, and checked against the source that made them, in C.

Every read of an indexed source starts by checking that each ``(dataset_id, shard_id,
sample_idx)`` row names one of its samples. Done with numpy that is half a dozen array passes
and temporaries per micro-batch; here it is one pass that stops at the first row that is not.

An unshuffled source's chunk (its sample range and its rows) is made here too, holding the GIL
throughout. numpy's ``arange`` and ``zeros`` let go of it for a moment in every call, and
CPython's waiting threads only ask for it after 5 ms without a switch, a wait every such moment
starts over: a loader making chunks flat out kept any other thread of the process (a metrics
endpoint, a heartbeat) waiting 60 ms at the median and over 0.5 s at worst.
"""

from libc.stdint cimport int64_t

import numpy as np


cdef Py_ssize_t _first_foreign(
    const int64_t[:, :] rows, int64_t dataset_id, int64_t num_samples
) noexcept nogil:
    cdef Py_ssize_t i
    cdef int64_t idx
    for i in range(rows.shape[0]):
        idx = rows[i, 2]
        if rows[i, 0] != dataset_id or idx < 0 or idx >= num_samples:
            return i
    return -1


def first_foreign_row(const int64_t[:, :] rows, int64_t dataset_id, int64_t num_samples):
    """The index of the first row of int64 ``(n, 3)`` ``rows`` whose dataset id is not
    ``dataset_id`` or whose sample index is outside ``[0, num_samples)``; -1 when every row is
    the source's."""
    if rows.shape[1] != 3:
        raise ValueError(f"pointer rows must have 3 columns, got {rows.shape[1]}")
    return _first_foreign(rows, dataset_id, num_samples)


cdef const int64_t[:, :] _pointer_rows(rows) except *:
    if not isinstance(rows, np.ndarray) or rows.dtype != np.int64 or rows.ndim != 2 \
            or rows.shape[1] != 3:
        raise ValueError(f"pointer rows must be an int64 array of shape (n, 3), got {rows!r:.60}")
    return rows


def own_sample_indices(rows, int64_t dataset_id, int64_t num_samples, str key=None):
    """The sample indices of int64 ``(n, 3)`` ``rows`` as a list of ints when every row is the
    source's (``first_foreign_row`` is -1); otherwise that first foreign row's index, an int.
    One pass and one list, for the sources that index a Python sequence with them. With ``key``,
    each index comes as the dict ``{key: index}`` (made here: a comprehension over the indices
    doing the same took about a third longer)."""
    cdef const int64_t[:, :] view = _pointer_rows(rows)
    cdef Py_ssize_t i, bad = _first_foreign(view, dataset_id, num_samples)
    if bad >= 0:
        return bad
    cdef list out = [None] * view.shape[0]
    if key is None:
        for i in range(view.shape[0]):
            out[i] = view[i, 2]
        return out
    for i in range(view.shape[0]):
        out[i] = {key: view[i, 2]}
    return out


def own_samples(rows, int64_t dataset_id, int64_t num_samples, list items not None):
    """The items of ``items`` that int64 ``(n, 3)`` ``rows`` name, as a list, when every row is
    the source's; otherwise the first foreign row's index, an int (``own_sample_indices``, with
    no int made per row). ``items`` must hold at least ``num_samples`` items (``IndexError``)."""
    cdef const int64_t[:, :] view = _pointer_rows(rows)
    cdef Py_ssize_t i, bad = _first_foreign(view, dataset_id, num_samples)
    if bad >= 0:
        return bad
    if len(items) < num_samples:
        raise IndexError(f"rows may name {num_samples} samples, but the list holds {len(items)}")
    cdef list out = [None] * view.shape[0]
    for i in range(view.shape[0]):
        out[i] = items[<Py_ssize_t>view[i, 2]]
    return out


def index_range(int64_t start, int64_t stop):
    """``numpy.arange(start, stop, dtype=int64)``, made without letting go of the GIL."""
    if stop < start:
        raise ValueError(f"index_range needs start <= stop, got {start} and {stop}")
    out = np.empty(stop - start, dtype=np.int64)
    cdef int64_t[::1] view = out
    cdef Py_ssize_t i
    for i in range(stop - start):
        view[i] = start + i
    return out


def index_rows(int64_t dataset_id, const int64_t[:] indices):
    """The pointer rows ``(dataset_id, 0, idx)`` (int64, shape ``(n, 3)``) of the sample
    ``indices``, made without letting go of the GIL."""
    out = np.empty((indices.shape[0], 3), dtype=np.int64)
    cdef int64_t[:, ::1] rows = out
    cdef Py_ssize_t i
    for i in range(indices.shape[0]):
        rows[i, 0] = dataset_id
        rows[i, 1] = 0
        rows[i, 2] = indices[i]
    return out
