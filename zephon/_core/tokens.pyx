"""Token ids from a tokenizer's list of ints into one ``int32`` array, in C.

A Hugging Face ``Encoding`` hands its ids over as a list of Python ints. Converting that list
once, straight into the output (the end-of-sequence id included, cut to a limit), with the range
check done on the same pass, is what ``tokenize`` does per document.
"""

cimport cython
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.ref cimport PyObject

import numpy as np

cimport numpy as cnp

cnp.import_array()

cdef long long ID_LIMIT = 2147483648  # int32 ids are never negative: [0, 2**31)

#: What ``int32_ids`` returns for a list it leaves to the general conversion.
UNDECIDED = object()


@cython.boundscheck(False)
@cython.wraparound(False)
def int32_ids(list ids, object eos, object limit):
    """``ids`` (a list of ints in ``[0, 2**31)``), then ``eos`` unless it is ``None``, cut to
    ``limit`` tokens unless that is ``None``, as a new ``int32`` array. The eos is placed before
    the cut, so a cut document ends without it.

    ``ValueError`` names the first id outside the range; ``UNDECIDED`` when an item is not an
    exact ``int`` (a bool, a numpy integer, anything else), for the caller's general path.
    """
    cdef Py_ssize_t n = PyList_GET_SIZE(ids)
    cdef Py_ssize_t total = n if eos is None else n + 1
    cdef Py_ssize_t i, keep
    cdef long long value, eos_value = 0
    cdef int overflow = 0
    cdef PyObject* item
    if eos is not None:
        eos_value = eos
        if not 0 <= eos_value < ID_LIMIT:
            raise ValueError(f"the end-of-sequence id {eos_value} falls outside [0, 2**31)")
    if limit is not None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        total = min(total, <Py_ssize_t>limit)
    keep = min(n, total)
    cdef cnp.npy_intp size = total
    cdef cnp.ndarray arr = cnp.PyArray_EMPTY(1, &size, cnp.NPY_INT32, 0)
    cdef int* out = <int*>cnp.PyArray_DATA(arr)
    for i in range(n):  # every id is checked, also those a cut leaves out
        item = PyList_GET_ITEM(ids, i)
        if type(<object>item) is not int:
            return UNDECIDED
        value = PyLong_AsLongLongAndOverflow(<object>item, &overflow)
        if overflow or not 0 <= value < ID_LIMIT:
            raise ValueError(f"token ids include {<object>item} (at {i}), outside [0, 2**31)")
        if i < keep:
            out[i] = <int>value
    if total > n:
        out[n] = <int>eos_value
    return arr
