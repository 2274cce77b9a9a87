# Layouts of the loader's compiled step, published for cimport.

from cpython.pythread cimport PyThread_type_lock


cdef class FeedBuffer:
    cdef public list buf
    cdef public Py_ssize_t pos

    cpdef object head(self)


cdef class PendingBatch:
    cdef public list pending
    cdef public Py_ssize_t n_pending
    cdef public Py_ssize_t batch_size
    cdef public object collate


cdef class LaneOutlet:
    cdef public FeedBuffer feed
    cdef public PendingBatch batcher
    cdef public object book
    cdef public bint ended              # the lane's stream ended (not: the lane was closed)
    cdef public object replay           # a replay filter still to run, or None
    cdef public object restored_state   # the state restored from, until something new goes out
    cdef public Py_ssize_t delivered    # items handed over, over the whole run
    cdef public Py_ssize_t limit        # items it hands over at most (even ends across ranks)

    cpdef object hand_over_head(self)
    cdef object _hand_over_record(self, FeedBuffer feed)


cdef class StepLock:
    cdef PyThread_type_lock _handle
    cdef long _owner                    # the thread holding it, or 0

    cdef int take(self) except -1
    cdef void drop(self) noexcept


cdef class LoaderStep:
    cdef public list lanes
    cdef public Py_ssize_t next_lane
    cdef public object policy           # where the lanes' contract violations are reported
    cdef readonly StepLock _lock
    cdef public object _failure
    cdef public bint _closed
    cdef public bint _started
    cdef public Py_ssize_t steps        # items handed over by ``next()`` (not by a restore)

    cdef object _round(self)
