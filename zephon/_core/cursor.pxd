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
cdef SampleCursor hashed_root_cursor(offset_t chunk_id, offset_t chunk_offset,
                                     const offset_t* sid, uint64_t hashval)


cdef inline uint64_t _mix(uint64_t h, uint64_t v) noexcept nogil:
    # splitmix64 finaliser over a running state: stable across processes and machines.
    h ^= v + <uint64_t>0x9E3779B97F4A7C15 + (h << 6) + (h >> 2)
    h = (h ^ (h >> 30)) * <uint64_t>0xBF58476D1CE4E5B9
    h = (h ^ (h >> 27)) * <uint64_t>0x94D049BB133111EB
    return h ^ (h >> 31)


cdef inline int root_cmp(offset_t chunk_id, offset_t chunk_offset, const offset_t* sid,
                         SampleCursor other) noexcept:
    # SampleCursor.cmp of the cursor with no lineage these fields make, against ``other``.
    if chunk_id != other.chunk_id:
        return -1 if chunk_id < other.chunk_id else 1
    if chunk_offset != other.chunk_offset:
        return -1 if chunk_offset < other.chunk_offset else 1
    if other.nlin:
        return -1  # no lineage sorts before any lineage
    cdef int i
    for i in range(3):
        if sid[i] != other.sid[i]:
            return -1 if sid[i] < other.sid[i] else 1
    return 0


cdef inline uint64_t root_hash(offset_t chunk_id, offset_t chunk_offset,
                               const offset_t* sid) noexcept nogil:
    # The stable hash of a cursor with no lineage, from its fields alone (inlined where
    # delivery books a run of records).
    cdef uint64_t h = _mix(<uint64_t>chunk_id, <uint64_t>chunk_offset)
    h = _mix(h, 0)
    h = _mix(h, <uint64_t>sid[0])
    h = _mix(h, <uint64_t>sid[1])
    return _mix(h, <uint64_t>sid[2])
