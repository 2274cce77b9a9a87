# Layouts of the record model, published for cimport by the delivery bookkeeping.
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


cdef class SampleBatch:
    cdef readonly tuple records
    cdef readonly object payload


cdef SampleMeta make_meta(SampleCursor cursor, offset_t lane_id, object component)
