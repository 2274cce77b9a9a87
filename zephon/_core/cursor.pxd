# Layout of SampleCursor, published for cimport by the other kernels.
from zephon._core._types cimport offset_t, uint64_t


cdef class SampleCursor:
    cdef readonly offset_t chunk_id
    cdef readonly offset_t chunk_offset
    cdef offset_t sid[3]          # (dataset_id, shard_id, sample_idx)
    cdef offset_t* lin            # lineage as C ints, owned; NULL when empty
    cdef Py_ssize_t nlin
    cdef uint64_t hashval         # stable 64-bit hash of all four fields

    cdef void _rehash(self) noexcept
    cdef int cmp(self, SampleCursor other) noexcept


cdef SampleCursor make_cursor(offset_t chunk_id, offset_t chunk_offset,
                              offset_t dataset_id, offset_t shard_id, offset_t sample_idx)
