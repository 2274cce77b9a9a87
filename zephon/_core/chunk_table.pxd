# The per-lane chunk table: one bit per chunk offset, C memory owned by a cdef class.
# Published here so other kernels can cimport the layout and call the cdef fast paths.
cimport cython
from cpython.pythread cimport PyThread_type_lock

from zephon._core._types cimport offset_t, word_t

# What close()/offset_state() report about one offset (the module's OPEN, CLOSED, ... ints).
cdef enum OffsetState:
    OFFSET_OPEN = 0             # not closed yet
    OFFSET_CLOSED = 1           # closed explicitly (close, close_many, or a forced close)
    OFFSET_BELOW_WATERMARK = 2  # closed only by the watermark (close_below)
    OFFSET_EVICTED = 3          # its chunk has left the table


# One inflight chunk. Its closed offsets are `explicit ∪ [0, wm)`: `bits` holds the offsets closed
# one by one (close, close_many, forced closes), `wm` is how far the lane's watermark reached into
# the chunk. Bits at positions >= n are always 0, so word popcounts need no tail masking.
cdef struct ChunkEntry:
    offset_t chunk_id
    offset_t local_index
    offset_t epoch
    offset_t n            # offsets in the chunk
    offset_t n_closed     # |explicit ∪ [0, wm)|; the chunk is complete when it equals n
    offset_t wm           # offsets [0, wm) are closed by the watermark (0 <= wm <= n)
    word_t* bits          # ceil(n / 64) words of explicit closes; NULL when n == 0


@cython.final
cdef class ChunkTable:
    # Ring buffer of inflight entries, sorted by chunk_id from the head; capacity is a power of two.
    cdef ChunkEntry* _ring
    cdef Py_ssize_t _cap
    cdef Py_ssize_t _head
    cdef Py_ssize_t _count
    # Physical ring index of the entry found last (the fast path of lookups), or -1.
    cdef Py_ssize_t _cached
    # A small direct-mapped cache chunk_id -> physical ring index (-1: empty), so inputs that
    # alternate between chunks skip the binary search. Only ever points at inflight entries.
    cdef Py_ssize_t _slots[64]
    cdef offset_t _first_chunk_id     # first id ever opened, -1 before any
    cdef offset_t _last_chunk_id      # largest id ever opened, -1 before any
    cdef offset_t _last_local_index
    cdef offset_t _last_epoch
    cdef offset_t _last_evicted_id    # id of the last evicted chunk, -1 before any
    cdef offset_t _n_evicted
    cdef offset_t _n_open             # open offsets over all inflight chunks
    cdef offset_t _wm_chunk           # the lane watermark (chunk_id, offset); (-1, 0) = none
    cdef offset_t _wm_offset
    cdef Py_ssize_t _bitmap_bytes
    # Held by the updates that release the GIL or allocate Python objects between reading and
    # writing the table; _owner is the holding thread's ident (0 when free), and every other
    # method waits while it is set. See the module docstring.
    cdef PyThread_type_lock _lock
    cdef long _owner

    cdef Py_ssize_t _find(self, offset_t chunk_id) noexcept nogil
    cdef Py_ssize_t _lower_bound(self, offset_t chunk_id) noexcept nogil
    cdef bint _resize(self, Py_ssize_t new_cap) noexcept nogil
    cdef void _shrink(self) noexcept nogil
    cdef object _evict_first(self, Py_ssize_t k)
    cdef void _evict_head(self) noexcept nogil
    cdef void _forget_slots(self) noexcept nogil
    cdef Py_ssize_t _first_bad(
        self, const offset_t[:] chunk_ids, const offset_t[:] offsets
    ) noexcept nogil
    cdef offset_t _apply_many(
        self, const offset_t[:] chunk_ids, const offset_t[:] offsets
    ) noexcept nogil
    cdef int _enter(self) except -1
    cdef void _exit(self) noexcept
    cdef int _wait_for_holder(self) except -1
    cdef Py_ssize_t _require(self, offset_t chunk_id) except -3
    cdef str _describe_missing(self, offset_t chunk_id)
    cdef Py_ssize_t _slot_of(self, offset_t chunk_id, offset_t offset) except -2

    # Fast paths for Cython callers; same semantics and return codes as the Python methods.
    cdef int c_close(self, offset_t chunk_id, offset_t offset) except -1
    cdef int c_offset_state(self, offset_t chunk_id, offset_t offset) except -1
    cdef int c_close_below(self, offset_t chunk_id, offset_t offset) except -1
    cdef int c_close_span(self, offset_t chunk_id, offset_t lo, offset_t hi) except -1
    # evict_complete_prefix without the id array: how many left (the newest is _last_evicted_id).
    cdef Py_ssize_t c_evict_complete_prefix(self) except -1
