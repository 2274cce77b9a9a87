# Pages shared with a worker process (see shared_pages.pyx): the base of the arrays a ring
# region holds. collate knows by this type that arrays on it that lie back to back were written
# once, before they were handed over, and are never written again while any of them lives.
cdef class SharedPages:
    cdef Py_buffer _buffer         # the mapping's buffer, held while the pages are
    cdef bint _held                # whether _buffer was taken (and so is released)
    cdef char* data                # the first byte of the pages
