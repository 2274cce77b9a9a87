# Layouts of the record model, published for cimport by the delivery bookkeeping.
cimport cython

from zephon._core._types cimport offset_t
from zephon._core.cursor cimport SampleCursor


cdef class ContributorRef:
    cdef readonly SampleCursor cursor
    cdef readonly bint is_last_child


cdef class SampleMeta:
    cdef readonly SampleCursor cursor
    cdef readonly offset_t lane_id
    cdef readonly object contributors            # None (implicit) or a tuple of ContributorRef
    cdef readonly frozenset tags
    cdef readonly bint is_tombstone
    cdef readonly object component
    cdef readonly object component_sample_counts  # dict[component, int] or None
    cdef readonly object component_token_counts   # dict[component, int] or None

    cpdef tuple contribution_refs(self)


cdef class SampleRecord:
    cdef readonly SampleMeta meta
    cdef readonly object payload


@cython.final
cdef class RecordRun:
    cdef readonly offset_t chunk_id
    cdef readonly offset_t first_offset
    cdef readonly offset_t lane_id
    cdef readonly Py_ssize_t n       # records in the run
    cdef list _payloads              # the run's payloads are _payloads[_lo : _lo + n]
    cdef list _components            # and its components _components[_lo : _lo + n], or None:
                                     # each record's dataset id is its component
    cdef Py_ssize_t _lo
    cdef object _pointers            # (rows, 3) int64, C-contiguous, kept alive for _p
    cdef const offset_t* _p          # the pointer row of the run's first record
    cdef object _tokens              # None, or int64 token counts indexed as _payloads: each
                                     # record then is one sample of its component, that long
    cdef const offset_t* _t          # _tokens' data (NULL without), indexed as _payloads

    cdef SampleRecord record_at(self, Py_ssize_t i)
    cdef void _set_tokens(self, object counts)
    cdef RecordRun _part(self, Py_ssize_t lo, Py_ssize_t hi)


@cython.final
cdef class JoinedRuns:
    cdef list _runs                  # RecordRuns, in order
    cdef readonly Py_ssize_t n       # records in all of them


cdef class SampleBatch:
    cdef tuple _records           # None until first asked for, when the batch is runs
    cdef object _lazy             # then: the RecordRun or JoinedRuns it was delivered as
    cdef readonly object payload


cdef SampleMeta make_meta(SampleCursor cursor, offset_t lane_id, object component)
cpdef SampleMeta counted_meta(SampleMeta meta, object n_tokens)
cdef SampleBatch run_batch(object runs, object payload)  # runs: a RecordRun or JoinedRuns

cdef SampleRecord make_record(SampleMeta meta, object payload)
