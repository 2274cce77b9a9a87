"""Token ids from a tokenizer's list of ints into one ``int32`` array, in C.

A Hugging Face ``Encoding`` hands its ids over as a list of Python ints. Converting that list
once, straight into the output (the end-of-sequence id included, cut to a limit), with the range
check done on the same pass, is what ``tokenize`` does per document; ``tokenized_records`` does
it for a whole tokenizer call, with the records that carry the arrays. ``document_views`` cuts one
array of neighbouring documents into a payload per document, as a token file's reader does.
"""

from cpython.dict cimport PyDict_Copy
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.ref cimport PyObject
from libc.string cimport memcpy

from zephon._core.records cimport SampleRecord, counted_meta, make_record

import numpy as np

cimport numpy as cnp

cnp.import_array()

cdef type _ndarray = np.ndarray

cdef long long ID_LIMIT = 2147483648  # int32 ids are never negative: [0, 2**31)


cdef extern from *:
    """
    #if PY_VERSION_HEX < 0x030B0000
    #include "longintrepr.h"
    #endif
    /* The value of an int object that holds one digit or none (0 <= value < 2**30), read from
       the object itself; 0 for any other int, left to PyLong_AsLongLongAndOverflow. Per token
       id this is a load, not a call. */
    static inline int zephon_one_digit_long(PyObject* op, long long* value) {
    #if PY_VERSION_HEX >= 0x030C0000
        if (!PyUnstable_Long_IsCompact((PyLongObject*)op)) return 0;
        Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject*)op);
        if (v < 0) return 0;
        *value = (long long)v;
        return 1;
    #else
        Py_ssize_t size = Py_SIZE(op);
        if (size == 0) { *value = 0; return 1; }
        if (size == 1) { *value = (long long)((PyLongObject*)op)->ob_digit[0]; return 1; }
        return 0;
    #endif
    }
    """
    bint one_digit_long "zephon_one_digit_long"(PyObject* op, long long* value)

#: What ``int32_ids`` returns for a list it leaves to the general conversion.
UNDECIDED = object()


cdef long long _checked_eos(object eos) except -1:
    """The end-of-sequence id as a C value (0 for ``None``), refused outside the id range."""
    if eos is None:
        return 0
    cdef long long value = eos
    if not 0 <= value < ID_LIMIT:
        raise ValueError(f"the end-of-sequence id {value} falls outside [0, 2**31)")
    return value


cdef Py_ssize_t _checked_limit(object limit) except -2:
    """The cut as a C value (-1 for ``None``), refused when negative."""
    if limit is None:
        return -1
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    return limit


cdef inline Py_ssize_t _output_length(Py_ssize_t n, bint has_eos, Py_ssize_t limit):
    """Tokens out of ``n`` ids: with the eos appended, then cut to ``limit`` (-1: no cut)."""
    cdef Py_ssize_t total = n + 1 if has_eos else n
    return total if limit < 0 else min(total, limit)


cdef object _converted(list ids, bint has_eos, long long eos, Py_ssize_t limit):
    """``int32_ids`` once its eos and limit are checked (``limit`` -1: no cut); None where it
    gives ``UNDECIDED``."""
    cdef Py_ssize_t n = PyList_GET_SIZE(ids)
    cdef Py_ssize_t total = _output_length(n, has_eos, limit)
    cdef Py_ssize_t i, keep = min(n, total)
    cdef long long value
    cdef int overflow = 0
    cdef PyObject* item
    cdef cnp.npy_intp size = total
    cdef cnp.ndarray arr = cnp.PyArray_EMPTY(1, &size, cnp.NPY_INT32, 0)
    cdef int* out = <int*>cnp.PyArray_DATA(arr)
    for i in range(n):  # every id is checked, also those a cut leaves out
        item = PyList_GET_ITEM(ids, i)
        if type(<object>item) is not int:
            return None
        if not one_digit_long(item, &value):
            value = PyLong_AsLongLongAndOverflow(<object>item, &overflow)
            if overflow or not 0 <= value < ID_LIMIT:
                raise ValueError(f"token ids include {<object>item} (at {i}), outside [0, 2**31)")
        if i < keep:
            out[i] = <int>value
    if total > n:
        out[n] = <int>eos
    return arr


cdef object _converted_array(cnp.ndarray ids, bint has_eos, long long eos, Py_ssize_t limit):
    """``_converted`` for a tokenizer that hands back arrays: a 1-D, C-contiguous, aligned,
    native ``int32`` or ``int64`` array of ids in ``[0, 2**31)``. None for any other array, or
    when an id falls outside the range: the general path converts or reports those."""
    if cnp.PyArray_NDIM(ids) != 1 or not cnp.PyArray_ISCARRAY_RO(ids):
        return None
    cdef int kind = cnp.PyArray_TYPE(ids)
    if kind != cnp.NPY_INT32 and kind != cnp.NPY_INT64:
        return None
    cdef Py_ssize_t n = cnp.PyArray_DIM(ids, 0)
    cdef Py_ssize_t total = _output_length(n, has_eos, limit)
    cdef Py_ssize_t i, keep = min(n, total)
    cdef const int* ids32 = <const int*>cnp.PyArray_DATA(ids)
    cdef const long long* ids64 = <const long long*>cnp.PyArray_DATA(ids)
    if kind == cnp.NPY_INT32:
        for i in range(n):
            if ids32[i] < 0:
                return None
    else:
        for i in range(n):
            if not 0 <= ids64[i] < ID_LIMIT:
                return None
    cdef cnp.npy_intp size = total
    cdef cnp.ndarray arr = cnp.PyArray_EMPTY(1, &size, cnp.NPY_INT32, 0)
    cdef int* out = <int*>cnp.PyArray_DATA(arr)
    if kind == cnp.NPY_INT32:
        memcpy(out, ids32, keep * sizeof(int))
    else:
        for i in range(keep):
            out[i] = <int>ids64[i]
    if total > n:
        out[n] = <int>eos
    return arr


def int32_ids(list ids, object eos, object limit):
    """``ids`` (a list of ints in ``[0, 2**31)``), then ``eos`` unless it is ``None``, cut to
    ``limit`` tokens unless that is ``None``, as a new ``int32`` array. The eos is placed before
    the cut, so a cut document ends without it.

    ``ValueError`` names the first id outside the range; ``UNDECIDED`` when an item is not an
    exact ``int`` (a bool, a numpy integer, anything else), for the caller's general path.
    """
    arr = _converted(ids, eos is not None, _checked_eos(eos), _checked_limit(limit))
    return UNDECIDED if arr is None else arr


def tokenized_records(list records, list encoded, str field, object eos, object limit):
    """The records of one tokenizer call: ``records[i]`` with ``field`` set to the ids of
    ``encoded[i]`` (its ``ids`` list, the list itself, or an ``int32`` or ``int64`` array) as
    ``int32_ids`` converts them, and its meta counting it as one sample of its component with
    that many tokens (``counted_meta``).

    Made in order up to the first record left to the caller's general path, which also reports
    errors with the record they belong to: ids that are neither a list of exact ints nor such an
    array, ids outside ``[0, 2**31)``, a payload that is not a dict, or anything raised on the
    way. The list made is as long as the records it covers.
    """
    cdef Py_ssize_t n = PyList_GET_SIZE(records)
    if PyList_GET_SIZE(encoded) != n:
        raise ValueError(f"{PyList_GET_SIZE(encoded)} results for {n} records")
    cdef bint has_eos = eos is not None
    cdef long long eos_value = _checked_eos(eos)
    cdef Py_ssize_t cut = _checked_limit(limit)
    cdef list out = []
    cdef Py_ssize_t i
    cdef SampleRecord rec
    cdef dict payload
    for i in range(n):
        rec = <SampleRecord?>records[i]
        if type(rec.payload) is not dict:
            break
        result = encoded[i]
        try:
            if type(result) is _ndarray:
                tokens = _converted_array(result, has_eos, eos_value, cut)
            else:
                ids = result if type(result) is list else getattr(result, "ids", None)
                tokens = _converted(ids, has_eos, eos_value, cut) if type(ids) is list else None
        except Exception:  # the general path meets it again, and names the record
            break
        if tokens is None:
            break
        payload = PyDict_Copy(rec.payload)
        payload[field] = tokens
        out.append(make_record(counted_meta(rec.meta, len(tokens)), payload))
    return out


def document_views(list out, positions, cnp.ndarray block not None, starts, lengths, str field):
    """``out[positions[k]] = {field: block[starts[k] : starts[k] + lengths[k]]}`` for every
    ``k``: each document a view of ``block`` (1-D, C-contiguous), made without a Python slice.
    ``positions``, ``starts`` and ``lengths`` are int64 arrays of one length; a span outside
    ``block`` or a position outside ``out`` is a ``ValueError`` and nothing is placed."""
    if block.ndim != 1 or not cnp.PyArray_IS_C_CONTIGUOUS(block) or not block.dtype.isnative:
        raise ValueError("block must be a 1-D C-contiguous array of a native dtype")
    cdef const long long[::1] pos = np.ascontiguousarray(positions, dtype=np.int64)
    cdef const long long[::1] at = np.ascontiguousarray(starts, dtype=np.int64)
    cdef const long long[::1] size = np.ascontiguousarray(lengths, dtype=np.int64)
    cdef Py_ssize_t k, n = pos.shape[0], total = block.shape[0], slots = len(out)
    if at.shape[0] != n or size.shape[0] != n:
        raise ValueError(f"{n} positions, {at.shape[0]} starts and {size.shape[0]} lengths")
    for k in range(n):
        if at[k] < 0 or size[k] < 0 or at[k] + size[k] > total:
            raise ValueError(
                f"document {k} spans {at[k]}..{at[k] + size[k]} outside a block of {total}"
            )
        if not 0 <= pos[k] < slots:
            raise ValueError(f"position {pos[k]} outside a list of {slots}")
    cdef int typenum = cnp.PyArray_TYPE(block)
    cdef Py_ssize_t itemsize = cnp.PyArray_ITEMSIZE(block)
    cdef char* data = <char*>cnp.PyArray_DATA(block)
    cdef bint writeable = cnp.PyArray_ISWRITEABLE(block)
    cdef cnp.npy_intp dims
    cdef cnp.ndarray view
    for k in range(n):
        dims = size[k]
        view = cnp.PyArray_SimpleNewFromData(1, &dims, typenum, data + at[k] * itemsize)
        if not writeable:
            cnp.PyArray_CLEARFLAGS(view, cnp.NPY_ARRAY_WRITEABLE)
        cnp.set_array_base(view, block)  # the view keeps the block alive
        out[pos[k]] = {field: view}
