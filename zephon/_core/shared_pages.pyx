"""Pages of a mapping shared with a worker process, as the base of the arrays made on them.

A process lane's worker copies the arrays of an item list into a region of a shared ring and
sends only where they lie; the loader makes the arrays on the region (``shared_region``). Their
base is a ``SharedPages``: the default collate recognises it, and stacks arrays that lie there
back to back as one view of them instead of a copy (``zephon._core.collate``). That is sound
because the worker writes a region only before it is handed over and again only once every
array made on it has been collected (the region array's finalizer tells it), and a view of
them holds the region as they do.
"""

from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer

import numpy as np

cimport numpy as cnp

cnp.import_array()


cdef class SharedPages:
    """``size`` bytes from ``start`` of a writable mapping (an ``mmap``), held exported while
    this object lives."""

    def __cinit__(self, object mapping, Py_ssize_t start, Py_ssize_t size):
        PyObject_GetBuffer(mapping, &self._buffer, PyBUF_WRITABLE)
        self._held = True
        if start < 0 or size < 0 or start + size > self._buffer.len:
            raise ValueError(
                f"pages {start}..{start + size} lie outside a mapping of {self._buffer.len} bytes"
            )
        self.data = <char*>self._buffer.buf + start

    def __dealloc__(self):
        if self._held:
            PyBuffer_Release(&self._buffer)

    def __reduce__(self):
        raise TypeError("SharedPages are memory mapped in this process and cannot be pickled")


def shared_region(object mapping, Py_ssize_t start, Py_ssize_t size):
    """A writable uint8 array of ``size`` bytes from ``start`` of ``mapping``, whose base is a
    ``SharedPages``."""
    pages = SharedPages(mapping, start, size)
    cdef cnp.npy_intp dims[1]
    dims[0] = size
    out = cnp.PyArray_New(
        np.ndarray, 1, dims, cnp.NPY_UINT8, NULL, pages.data, 1, cnp.NPY_ARRAY_CARRAY, None
    )
    cnp.set_array_base(out, pages)
    return out
