"""The default collate's per-batch loop: dict payloads transposed into columns in C.

``zephon.ops.batching.collate_payloads`` is the rule; this kernel does the common cases (plain
dicts with ``str`` keys, columns of Python ints, floats, bools, same-shape arrays or anything
that stays a list) without building a key tuple, a type set and an iterator per batch. A case it
does not cover (a dict subclass, non-``str`` keys that are not the same objects, numpy scalars)
is handed back to the Python rule, so the result is always the rule's. One case is not a copy:
arrays that lie back to back in memory nothing writes to again, rows a packer handed over one
after another (``zephon._core.packfill.RowArena``) or the arrays a process lane's worker sent
through its shared ring (``zephon._core.shared_pages.SharedPages``), come out as a view of that
memory, equal to the rule's stack of them.
"""

from cpython.long cimport PyLong_AsLongLong
from cpython.object cimport PyTypeObject
from cpython.ref cimport PyObject
from libc.string cimport memcpy

from zephon._core.packfill cimport RowArena
from zephon._core.records cimport RecordRun
from zephon._core.shared_pages cimport SharedPages

import numpy as np

cimport numpy as cnp

cnp.import_array()

cdef type _ndarray = np.ndarray

#: What ``collate_dicts`` returns for a batch it leaves to the Python rule.
UNDECIDED = object()


cdef extern from "Python.h":
    # Borrowed references and no checks. The loops below use them only on objects their caller
    # holds (``payloads``, and so each dict, key and value), and check every type themselves;
    # the direct loop also runs none of the payloads' own code (its keys are exact strs, its
    # values exact ints and floats).
    PyTypeObject PyDict_Type
    PyTypeObject PyLong_Type
    PyTypeObject PyFloat_Type
    PyTypeObject PyUnicode_Type
    PyTypeObject* type_of "Py_TYPE"(PyObject*)
    PyObject* list_item "PyList_GET_ITEM"(object, Py_ssize_t)
    Py_ssize_t dict_size "PyDict_GET_SIZE"(PyObject*)
    int dict_next "PyDict_Next"(PyObject*, Py_ssize_t*, PyObject**, PyObject**)
    double float_value "PyFloat_AS_DOUBLE"(PyObject*)


cdef inline bint _same_key(PyObject* k, PyObject* key):
    # Identity, or equal exact strs (keys parsed per row are equal strings, not one object).
    if k == key:
        return True
    return (
        type_of(k) == &PyUnicode_Type
        and type_of(key) == &PyUnicode_Type
        and <str><object>k == <str><object>key
    )


cdef object _int_column(list values, Py_ssize_t n):
    cdef cnp.npy_intp size = n
    cdef cnp.ndarray arr = cnp.PyArray_EMPTY(1, &size, cnp.NPY_INT64, 0)
    cdef long long* out = <long long*>cnp.PyArray_DATA(arr)
    cdef Py_ssize_t i
    for i in range(n):
        out[i] = PyLong_AsLongLong(values[i])  # raises OverflowError outside int64
    return arr


cdef object _float_column(list values, Py_ssize_t n):
    cdef cnp.npy_intp size = n
    cdef cnp.ndarray arr = cnp.PyArray_EMPTY(1, &size, cnp.NPY_FLOAT64, 0)
    cdef double* out = <double*>cnp.PyArray_DATA(arr)
    cdef Py_ssize_t i
    for i in range(n):
        out[i] = float_value(list_item(values, i))
    return arr


cdef object _bool_column(list values, Py_ssize_t n):
    cdef cnp.npy_intp size = n
    cdef cnp.ndarray arr = cnp.PyArray_EMPTY(1, &size, cnp.NPY_BOOL, 0)
    cdef cnp.npy_bool* out = <cnp.npy_bool*>cnp.PyArray_DATA(arr)
    cdef Py_ssize_t i
    for i in range(n):
        out[i] = values[i] is True
    return arr


cdef bint _plain_copy(object dtype):
    """Whether ``dtype`` is a builtin one in all but identity (arrays that came through pickle
    carry such copies): native, no fields, no metadata."""
    if dtype.metadata is not None:
        return False
    canonical = np.dtype(dtype.str)
    return canonical.isbuiltin == 1 and canonical == dtype


cdef object _stack(list values, Py_ssize_t n, cnp.ndarray first):
    """``np.stack(values)`` for ``n`` arrays of ``first``'s shape and dtype, by one allocation and
    a byte copy per row, when that is numpy's result: every row an exact, C-contiguous ndarray of
    a builtin, native dtype without objects. None otherwise: numpy's stack normalises byte order
    and structured types, keeps subclasses, counts object references and chooses the layout of
    rows in other orders."""
    dtype = (<object>first).dtype
    if dtype.hasobject or (dtype.isbuiltin != 1 and not _plain_copy(dtype)):
        return None
    rows = _adjacent_rows(values, n, first)
    if rows is not None:
        return rows
    out = np.empty((n,) + (<object>first).shape, dtype)
    cdef char* dst = <char*>cnp.PyArray_DATA(<cnp.ndarray>out)
    cdef Py_ssize_t row = cnp.PyArray_NBYTES(first), i
    for i in range(n):
        v = values[i]
        if type(v) is not _ndarray or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>v):
            return None
        memcpy(dst + i * row, cnp.PyArray_DATA(<cnp.ndarray>v), row)
    return out


cdef bint _written_once(PyObject* base):
    """Whether arrays based on ``base`` sit in memory nothing writes to while they live: a
    packer's ``RowArena`` (rows it handed over), or an array on ``SharedPages`` (a region of a
    process lane's ring, which its worker writes again only once every array on it is gone)."""
    if type_of(base) == <PyTypeObject*>RowArena:
        return True
    return (
        type_of(base) == <PyTypeObject*>_ndarray
        and cnp.PyArray_BASE(<cnp.ndarray>base) != NULL
        and type_of(cnp.PyArray_BASE(<cnp.ndarray>base)) == <PyTypeObject*>SharedPages
    )


cdef object _adjacent_rows(list values, Py_ssize_t n, cnp.ndarray first):
    """``values`` as one view, when they lie back to back in memory written once
    (``_written_once``): C-contiguous and writeable views of one base, each starting where the
    one before ends. None otherwise. The view equals ``np.stack(values)`` and, like it, shares
    memory with none of the other batches; it holds the base as the rows did."""
    cdef PyObject* base = cnp.PyArray_BASE(first)
    cdef int ndim = cnp.PyArray_NDIM(first)
    if base == NULL or ndim + 1 > cnp.NPY_MAXDIMS or not _written_once(base):
        return None
    cdef char* start = <char*>cnp.PyArray_DATA(first)
    cdef Py_ssize_t row = cnp.PyArray_NBYTES(first), i
    for i in range(n):
        v = values[i]
        if (
            type(v) is not _ndarray
            or cnp.PyArray_BASE(<cnp.ndarray>v) != base
            or <char*>cnp.PyArray_DATA(<cnp.ndarray>v) != start + i * row
            or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>v)
            or not cnp.PyArray_ISWRITEABLE(<cnp.ndarray>v)
        ):
            return None
    cdef cnp.npy_intp dims[cnp.NPY_MAXDIMS]
    dims[0] = n
    for i in range(ndim):
        dims[i + 1] = cnp.PyArray_DIM(first, i)
    out = cnp.PyArray_New(
        _ndarray, ndim + 1, dims, cnp.PyArray_TYPE(first), NULL, start,
        cnp.PyArray_ITEMSIZE(first), cnp.NPY_ARRAY_CARRAY, None
    )
    cnp.set_array_base(out, <object>base)
    return out


cdef object _column(object key, list values, Py_ssize_t n, object rule):
    """The column for ``values`` (all of one exact type decides); numpy scalars, and ints
    outside int64 (whose error names the field), go to ``rule(key, values)``."""
    first = values[0]
    kind = type(first)
    cdef Py_ssize_t i
    if kind is int or kind is float or kind is bool:
        for i in range(1, n):
            if type(values[i]) is not kind:  # mixed types stay a list
                return values
        if kind is int:
            try:
                return _int_column(values, n)
            except OverflowError:
                return rule(key, tuple(values))
        if kind is float:
            return _float_column(values, n)
        return _bool_column(values, n)
    if kind is _ndarray:
        shape, dtype = (<object>first).shape, (<object>first).dtype
        for i in range(1, n):
            v = values[i]
            if not isinstance(v, np.ndarray) or v.shape != shape or v.dtype != dtype:
                return values
        out = _stack(values, n, <cnp.ndarray>first)
        return np.stack(values) if out is None else out
    return rule(key, tuple(values)) if isinstance(first, np.generic) else values


cdef enum:
    MAX_DIRECT = 16  # columns the direct loop fills at most


cdef object _direct(list payloads, Py_ssize_t lo, Py_ssize_t n):
    """The columns of ``payloads[lo : lo + n]``, filled straight into arrays, when every payload
    is an exact dict, the first one's keys are exact strs and its values exact ints (int64) or
    floats (float64), and every payload has its keys in its order with values of the same types;
    None otherwise, for the general loop to decide (it gives the same result)."""
    # Made before the first borrowed pointer is taken: it is the only allocation here that can
    # start a garbage collection (ndarrays are not tracked by the collector, and inserting exact
    # str keys runs no Python code), so no finalizer can run while the loops below hold them.
    cdef dict out = {}
    cdef PyObject* first = list_item(payloads, lo)
    if type_of(first) != &PyDict_Type:
        return None
    cdef Py_ssize_t nk = dict_size(first), pos = 0, i, j = 0
    if nk == 0 or nk > MAX_DIRECT:
        return None
    cdef PyObject* k
    cdef PyObject* v
    cdef PyObject* p
    cdef PyTypeObject* kinds[MAX_DIRECT]
    cdef PyObject* keyp[MAX_DIRECT]
    cdef void* data[MAX_DIRECT]
    cdef cnp.npy_intp size = n
    while dict_next(first, &pos, &k, &v):
        kinds[j] = type_of(v)
        if kinds[j] != &PyLong_Type and kinds[j] != &PyFloat_Type:
            return None
        if type_of(k) != &PyUnicode_Type:  # hashing another key could run Python code
            return None
        arr = cnp.PyArray_EMPTY(
            1, &size, cnp.NPY_INT64 if kinds[j] == &PyLong_Type else cnp.NPY_FLOAT64, 0
        )
        out[<object>k] = arr
        keyp[j] = k
        data[j] = cnp.PyArray_DATA(<cnp.ndarray>arr)
        j += 1
    try:
        for i in range(n):
            p = list_item(payloads, lo + i)
            if type_of(p) != &PyDict_Type or dict_size(p) != nk:
                return None
            pos = 0
            j = 0
            while dict_next(p, &pos, &k, &v):
                if not _same_key(k, keyp[j]):
                    return None
                if type_of(v) != kinds[j]:
                    return None
                if kinds[j] == &PyFloat_Type:
                    (<double*>data[j])[i] = float_value(v)
                else:  # Cython's conversion reads small ints' digits directly
                    (<long long*>data[j])[i] = <long long><object>v
                j += 1
    except OverflowError:
        return None  # the general loop names the field
    return out


def collate_dicts(list payloads, rule):
    """Columns of ``payloads`` as ``collate_payloads`` makes them (a dict ``{key: column}``),
    ``payloads`` itself when they stay a list, or ``UNDECIDED`` when the Python rule must decide
    for the whole batch. ``rule(key, values)`` is the rule's column function, called for the
    columns this kernel leaves to it.
    """
    out = _collate(payloads, 0, len(payloads), rule)
    return payloads if out is _STAYS else out


def collate_run(RecordRun run not None, rule):
    """``collate_dicts(run.payloads, rule)`` reading the run's payloads where they are, without
    making a list of them first (a list it returns when they stay one)."""
    out = _collate(run._payloads, run._lo, run.n, rule)
    return run._payloads[run._lo : run._lo + run.n] if out is _STAYS else out


# What ``_collate`` returns when the payloads stay the list they are.
cdef object _STAYS = object()


cdef object _collate(list payloads, Py_ssize_t lo, Py_ssize_t n, rule):
    # ``collate_dicts`` over payloads[lo : lo + n]: the columns, ``_STAYS`` or ``UNDECIDED``.
    cdef Py_ssize_t nk, i, j, pos
    cdef PyObject* k
    cdef PyObject* v
    if lo < 0 or n < 0 or lo + n > len(payloads):  # the loops below read items unchecked
        raise IndexError(f"payloads[{lo}:{lo + n}] is outside a list of {len(payloads)}")
    if n == 0:
        return _STAYS
    direct = _direct(payloads, lo, n)  # checks the payloads' types itself, in the same pass
    if direct is not None:
        return direct
    for i in range(n):
        if type(payloads[lo + i]) is not dict:
            return UNDECIDED
    first = payloads[lo]
    nk = dict_size(<PyObject*>first)
    cdef list keys = list(first)
    cdef list columns = [[None] * n for j in range(nk)]
    cdef list col
    for i in range(n):
        p = payloads[lo + i]
        if dict_size(<PyObject*>p) != nk:
            return _STAYS  # different keys: stays a list
        pos = 0
        j = 0
        while dict_next(<PyObject*>p, &pos, &k, &v):
            if not _same_key(k, <PyObject*>keys[j]):
                return UNDECIDED if i and _undecided_keys(<object>k, keys[j]) else _STAYS
            col = <list>columns[j]
            col[i] = <object>v
            j += 1
    return {keys[j]: _column(keys[j], <list>columns[j], n, rule) for j in range(nk)}


cdef bint _undecided_keys(object k, object key):
    # Keys that are not both strs may still be equal (1 and 1.0): the rule decides.
    return not (type(k) is str and type(key) is str)
