"""The per-lane chunk table: which offsets of a lane's inflight chunks are closed.

Every chunk a lane starts is entered with one bit per offset; delivered records and tombstones close
the base offsets of their closing contributors, the monotone path's watermark closes whole prefixes,
and complete chunks leave the table from the head (one by one on the monotone path, a whole epoch at
a time on the epoch path). The table owns its memory in C: a ring buffer of chunk entries sorted by
chunk id, and one malloc'd bitmap per inflight chunk that is freed when the chunk is evicted, so the
memory held follows the number of inflight chunks and never the length of the run.

A table belongs to one lane and is used from one thread (the loader's delivery thread), but calls
from several threads are safe and run one after the other. Most methods hold the GIL from their
first read to their last write and call no Python code in between, so the GIL alone keeps them
whole; they only check that no locked section is running (one flag test on the per-record path).
The few that release the GIL (`close_many` on large inputs) or allocate result arrays between
reading and writing hold the table's lock, with `_owner` set, from start to end. A thread that
finds the lock held waits for it without the GIL, and a locked section cannot start while
another thread holds the GIL inside a method, since taking the lock and setting `_owner` needs it.
"""

from cpython.pythread cimport (
    WAIT_LOCK,
    PyThread_acquire_lock,
    PyThread_allocate_lock,
    PyThread_free_lock,
    PyThread_get_thread_ident,
    PyThread_release_lock,
)
from zephon._core._lock cimport drop_lock, take_lock
from libc.stdint cimport uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy

import numpy as np

from zephon._core._types cimport offset_t, word_t

cdef extern from *:
    """
    #include <stdint.h>
    #if defined(_MSC_VER)
    #include <intrin.h>
    static inline int zephon_popcount64(uint64_t w) { return (int)__popcnt64(w); }
    static inline int zephon_ctz64(uint64_t w) {
        unsigned long i; _BitScanForward64(&i, w); return (int)i;
    }
    #else
    static inline int zephon_popcount64(uint64_t w) { return __builtin_popcountll(w); }
    static inline int zephon_ctz64(uint64_t w) { return __builtin_ctzll(w); }
    #endif
    #define ZEPHON_ALL_ONES (~(uint64_t)0)
    """
    const uint64_t ALL_ONES "ZEPHON_ALL_ONES"
    int zephon_popcount64(uint64_t w) noexcept nogil
    int zephon_ctz64(uint64_t w) noexcept nogil


OPEN = OFFSET_OPEN
CLOSED = OFFSET_CLOSED
BELOW_WATERMARK = OFFSET_BELOW_WATERMARK
EVICTED = OFFSET_EVICTED

cdef enum:
    # Smallest ring capacity; the ring shrinks back to it when the table empties.
    MIN_CAP = 8
    # close_many releases the GIL from this many marks on.
    NOGIL_MIN_MARKS = 65536


# ---- bitmap helpers: positions [a, b) of one chunk's words ---------------------------------------

cdef inline offset_t _popcount_range(const word_t* bits, offset_t a, offset_t b) noexcept nogil:
    """Number of set bits at positions [a, b)."""
    cdef offset_t wa, wb, i, total
    if a >= b:
        return 0
    wa = a >> 6
    wb = (b - 1) >> 6
    cdef word_t lo = ALL_ONES << (a & 63)
    cdef word_t hi = ALL_ONES >> (63 - ((b - 1) & 63))
    if wa == wb:
        return zephon_popcount64(bits[wa] & lo & hi)
    total = zephon_popcount64(bits[wa] & lo)
    for i in range(wa + 1, wb):
        total += zephon_popcount64(bits[i])
    return total + zephon_popcount64(bits[wb] & hi)


cdef inline void _set_range(word_t* bits, offset_t a, offset_t b) noexcept nogil:
    """Set the bits at positions [a, b), a whole word at a time."""
    cdef offset_t wa, wb, i
    if a >= b:
        return
    wa = a >> 6
    wb = (b - 1) >> 6
    cdef word_t lo = ALL_ONES << (a & 63)
    cdef word_t hi = ALL_ONES >> (63 - ((b - 1) & 63))
    if wa == wb:
        bits[wa] |= lo & hi
        return
    bits[wa] |= lo
    for i in range(wa + 1, wb):
        bits[i] = ALL_ONES
    bits[wb] |= hi


cdef inline offset_t _collect_open(
    const ChunkEntry* e, offset_t* out, offset_t limit
) noexcept nogil:
    """Write up to `limit` open offsets of `e` (not explicit, not below its watermark) to `out`."""
    cdef offset_t k = 0, i, wa, wb
    cdef word_t w
    if e.wm >= e.n or limit <= 0:
        return 0
    wa = e.wm >> 6
    wb = (e.n - 1) >> 6
    for i in range(wa, wb + 1):
        w = ~e.bits[i]
        if i == wa:
            w &= ALL_ONES << (e.wm & 63)
        if i == wb:
            w &= ALL_ONES >> (63 - ((e.n - 1) & 63))
        while w:
            out[k] = (i << 6) + zephon_ctz64(w)
            k += 1
            if k == limit:
                return k
            w &= w - 1
    return k


cdef inline offset_t _advance_wm(ChunkEntry* e, offset_t new_wm) noexcept nogil:
    """Move the chunk's watermark to `new_wm`; returns how many offsets that newly closed."""
    cdef offset_t newly
    if new_wm <= e.wm:
        return 0
    if new_wm == e.wm + 1:  # delivery moves it one offset at a time: a bit test, no popcount
        newly = 1 - <offset_t>((e.bits[e.wm >> 6] >> (e.wm & 63)) & 1)
    else:
        newly = (new_wm - e.wm) - _popcount_range(e.bits, e.wm, new_wm)
    e.wm = new_wm
    e.n_closed += newly
    return newly


cdef inline offset_t _force_close(ChunkEntry* e) noexcept nogil:
    """Close every open offset of `e` explicitly; returns how many were open."""
    cdef offset_t was_open = e.n - e.n_closed
    if was_open:
        _set_range(e.bits, e.wm, e.n)
        e.n_closed = e.n
    return was_open


cdef inline offset_t _min(offset_t a, offset_t b) noexcept nogil:
    return a if a < b else b


cdef inline Py_ssize_t _slot(offset_t chunk_id) noexcept nogil:
    """Slot of a chunk id in the 64-slot lookup cache (Fibonacci hashing: lane ids are strided)."""
    return <Py_ssize_t>((<uint64_t>chunk_id * <uint64_t>0x9E3779B97F4A7C15) >> 58)


cdef class ChunkTable:
    """The chunk table of one lane: one bit per offset of each inflight chunk, in C memory.

    Chunks are opened in increasing chunk id (and lane-local index, and non-decreasing epoch) and
    leave from the head only. Invariants: entries are sorted by chunk id; each entry's closed count
    equals the popcount of its closed offsets, so completeness and `n_open_offsets` are O(1);
    `bytes_held` is exactly the C memory owned and returns to its baseline when the table empties.
    The watermark is a point `(chunk_id, offset)` in cursor order that only moves forward; every
    offset below it is closed, including offsets of chunks opened after it moved.
    """

    def __cinit__(self):
        self._ring = <ChunkEntry*>calloc(MIN_CAP, sizeof(ChunkEntry))
        if self._ring == NULL:
            raise MemoryError("cannot allocate the chunk table")
        self._cap = MIN_CAP
        self._head = 0
        self._count = 0
        self._cached = -1
        self._forget_slots()
        self._first_chunk_id = -1
        self._last_chunk_id = -1
        self._last_local_index = -1
        self._last_epoch = -1
        self._last_evicted_id = -1
        self._n_evicted = 0
        self._n_open = 0
        self._wm_chunk = -1
        self._wm_offset = 0
        self._bitmap_bytes = 0
        self._lock = PyThread_allocate_lock()
        if self._lock == NULL:
            raise MemoryError("cannot allocate the chunk table's lock")
        self._owner = 0

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self._ring != NULL:
            for i in range(self._count):
                free(self._ring[(self._head + i) & (self._cap - 1)].bits)
            free(self._ring)
            self._ring = NULL
        if self._lock != NULL:
            PyThread_free_lock(self._lock)

    # ---- internals -----------------------------------------------------------------------------

    cdef Py_ssize_t _lower_bound(self, offset_t chunk_id) noexcept nogil:
        """Logical position of the first inflight entry with id >= chunk_id (binary search)."""
        cdef Py_ssize_t lo = 0, hi = self._count, mid
        cdef Py_ssize_t mask = self._cap - 1
        while lo < hi:
            mid = (lo + hi) >> 1
            if self._ring[(self._head + mid) & mask].chunk_id < chunk_id:
                lo = mid + 1
            else:
                hi = mid
        return lo

    cdef Py_ssize_t _find(self, offset_t chunk_id) noexcept nogil:
        """Physical ring index of an inflight chunk; -1 if it was evicted; -2 if never opened.

        Ids in [first opened, last evicted] that are not inflight count as evicted, also ids in
        that range that this table never opened (the caller only asks about its own lane's ids).
        """
        cdef Py_ssize_t p = self._cached
        if p >= 0 and self._ring[p].chunk_id == chunk_id:
            return p
        cdef Py_ssize_t h = _slot(chunk_id)
        p = self._slots[h]
        if p >= 0 and self._ring[p].chunk_id == chunk_id:
            self._cached = p
            return p
        cdef Py_ssize_t lo = self._lower_bound(chunk_id)
        if lo < self._count:
            p = (self._head + lo) & (self._cap - 1)
            if self._ring[p].chunk_id == chunk_id:
                self._cached = p
                self._slots[h] = p
                return p
        if 0 <= chunk_id and self._first_chunk_id <= chunk_id <= self._last_evicted_id:
            return -1
        return -2

    cdef str _describe_missing(self, offset_t chunk_id):
        if self._last_chunk_id < 0:
            where = "no chunk has been opened yet"
        elif self._count:
            where = (
                f"inflight chunks are {self._ring[self._head].chunk_id}.."
                f"{self._last_chunk_id}"
            )
        else:
            where = f"no chunk is inflight; the last opened was {self._last_chunk_id}"
        return f"chunk {chunk_id} was never opened in this chunk table ({where})"

    cdef Py_ssize_t _require(self, offset_t chunk_id) except -3:
        """`_find`, raising ValueError for a chunk id this table never opened."""
        cdef Py_ssize_t p = self._find(chunk_id)
        if p == -2:
            raise ValueError(self._describe_missing(chunk_id))
        return p

    cdef int _enter(self) except -1:
        """Start a locked section: take the lock (waiting for it without the GIL) and set _owner."""
        return take_lock(self._lock, &self._owner, "ChunkTable")

    cdef void _exit(self) noexcept:
        drop_lock(self._lock, &self._owner)

    cdef int _wait_for_holder(self) except -1:
        """Called when _owner is set: wait until no locked section runs. Returns with the GIL
        held and _owner 0, so none can start before the caller is done."""
        if self._owner == <long>PyThread_get_thread_ident():  # as take_lock stores it
            raise RuntimeError(
                "ChunkTable was called again while this thread is inside one of its updates"
            )
        while self._owner:
            with nogil:
                PyThread_acquire_lock(self._lock, WAIT_LOCK)
                PyThread_release_lock(self._lock)
        return 0

    cdef bint _resize(self, Py_ssize_t new_cap) noexcept nogil:
        """Re-lay the ring into `new_cap` slots (a power of two >= count) from index 0."""
        cdef ChunkEntry* ring = <ChunkEntry*>malloc(new_cap * sizeof(ChunkEntry))
        cdef Py_ssize_t i
        if ring == NULL:
            return False
        for i in range(self._count):
            memcpy(&ring[i], &self._ring[(self._head + i) & (self._cap - 1)], sizeof(ChunkEntry))
        free(self._ring)
        self._ring = ring
        self._cap = new_cap
        self._head = 0
        self._cached = -1
        self._forget_slots()
        return True

    cdef void _forget_slots(self) noexcept nogil:
        cdef Py_ssize_t i
        for i in range(64):
            self._slots[i] = -1

    cdef void _shrink(self) noexcept nogil:
        """Give back ring capacity after evictions: a burst of inflight chunks is not kept."""
        cdef Py_ssize_t cap = self._cap
        while cap > MIN_CAP and self._count * 4 <= cap:
            cap >>= 1
        if cap != self._cap:
            self._resize(cap)  # on failure the larger ring stays, which is still correct

    cdef void _evict_head(self) noexcept nogil:
        cdef ChunkEntry* e = &self._ring[self._head]
        cdef Py_ssize_t h = _slot(e.chunk_id)
        if self._slots[h] == self._head:
            self._slots[h] = -1  # the slot's entry is dead now; its stale id must not match
        free(e.bits)
        e.bits = NULL
        self._bitmap_bytes -= ((e.n + 63) >> 6) * <Py_ssize_t>sizeof(word_t)
        self._n_open -= e.n - e.n_closed
        self._last_evicted_id = e.chunk_id
        self._n_evicted += 1
        self._head = (self._head + 1) & (self._cap - 1)
        self._count -= 1
        self._cached = -1

    cdef object _evict_first(self, Py_ssize_t k):
        """Evict the first ``k`` inflight chunks (the caller holds the lock); their ids, int64."""
        cdef Py_ssize_t i
        out = np.empty(k, dtype=np.int64)
        cdef offset_t[::1] view = out
        for i in range(k):
            view[i] = self._ring[self._head].chunk_id
            self._evict_head()
        self._shrink()
        return out

    cdef Py_ssize_t _first_bad(
        self, const offset_t[:] chunk_ids, const offset_t[:] offsets
    ) noexcept nogil:
        """Index of the first (chunk id, offset) pair that close_many must reject, or -1."""
        cdef Py_ssize_t i = 0, n = chunk_ids.shape[0], p
        cdef offset_t cid
        cdef uint64_t size
        if n == 0:
            return -1
        # Walked as in _apply_many.
        cdef const char *cp = <const char*>&chunk_ids[0]
        cdef const char *op = <const char*>&offsets[0]
        cdef Py_ssize_t cs = chunk_ids.strides[0], os = offsets.strides[0]
        while i < n:
            cid = (<const offset_t*>cp)[0]
            p = self._find(cid)
            if p == -2:
                return i
            # An evicted chunk takes any offset >= 0: as unsigned, negatives are >= 2**63.
            size = <uint64_t>self._ring[p].n if p >= 0 else (<uint64_t>1 << 63)
            while i < n and (<const offset_t*>cp)[0] == cid:
                if <uint64_t>(<const offset_t*>op)[0] >= size:
                    return i
                cp += cs
                op += os
                i += 1
        return -1

    cdef offset_t _apply_many(
        self, const offset_t[:] chunk_ids, const offset_t[:] offsets
    ) noexcept nogil:
        """Set the bits of validated pairs; returns how many offsets were open before."""
        cdef Py_ssize_t i = 0, n = chunk_ids.shape[0], p
        cdef offset_t cid, off, wm, newly, total = 0, wi, cur_wi
        cdef ChunkEntry* e
        cdef word_t* bits
        cdef word_t w = 0
        if n == 0:
            return 0
        # Pointers walked by byte strides: the loop keeps them in registers (indexing the
        # memoryviews reloads their strides from the stack at every pair).
        cdef const char *cp = <const char*>&chunk_ids[0]
        cdef const char *op = <const char*>&offsets[0]
        cdef Py_ssize_t cs = chunk_ids.strides[0], os = offsets.strides[0]
        while i < n:
            # A run of pairs of one chunk.
            cid = (<const offset_t*>cp)[0]
            p = self._find(cid)
            if p < 0:  # an evicted chunk: nothing to close
                while i < n and (<const offset_t*>cp)[0] == cid:
                    cp += cs
                    op += os
                    i += 1
                continue
            e = &self._ring[p]
            bits = e.bits
            wm = e.wm
            cur_wi = -1  # no word loaded yet
            newly = 0
            while i < n and (<const offset_t*>cp)[0] == cid:
                off = (<const offset_t*>op)[0]
                cp += cs
                op += os
                i += 1
                wi = off >> 6
                # The current word stays in a register while offsets stay in it (no
                # store-to-load stall on runs of neighbouring offsets).
                if wi != cur_wi:
                    if cur_wi >= 0:
                        bits[cur_wi] = w
                    cur_wi = wi
                    w = bits[wi]
                # Branch-free: count the bit if it was clear and not already closed by the
                # watermark.
                newly += <offset_t>(((w >> (off & 63)) & 1) ^ 1) & <offset_t>(off >= wm)
                w |= (<word_t>1) << (off & 63)
            if cur_wi >= 0:
                bits[cur_wi] = w
            e.n_closed += newly
            total += newly
        self._n_open -= total
        return total

    # ---- cdef fast paths -------------------------------------------------------------------------

    cdef int c_close(self, offset_t chunk_id, offset_t offset) except -1:
        cdef Py_ssize_t p
        cdef ChunkEntry* e
        cdef word_t w, m
        if self._owner:
            self._wait_for_holder()
        p = self._slot_of(chunk_id, offset)
        if p < 0:
            return OFFSET_EVICTED
        e = &self._ring[p]
        m = (<word_t>1) << (offset & 63)
        w = e.bits[offset >> 6]
        if w & m:
            return OFFSET_CLOSED
        e.bits[offset >> 6] = w | m
        if offset < e.wm:
            return OFFSET_BELOW_WATERMARK
        e.n_closed += 1
        self._n_open -= 1
        return OFFSET_OPEN

    cdef int c_close_span(self, offset_t chunk_id, offset_t lo, offset_t hi) except -1:
        """Close offsets ``[lo, hi)`` (``0 <= lo``) of chunk ``chunk_id`` if every one of them is
        open: 1. Otherwise nothing changes (0), and the caller closes them one by one to learn
        which was closed already, or that the chunk was evicted."""
        cdef Py_ssize_t p
        cdef ChunkEntry* e
        cdef offset_t counted
        if lo >= hi:
            return 1
        if self._owner:
            self._wait_for_holder()
        p = self._slot_of(chunk_id, hi - 1)
        if p < 0:
            return 0
        e = &self._ring[p]
        if _popcount_range(e.bits, lo, hi):
            return 0
        _set_range(e.bits, lo, hi)
        counted = hi - (lo if lo > e.wm else e.wm)  # those below the watermark it counted
        if counted > 0:
            e.n_closed += counted
            self._n_open -= counted
        return 1

    cdef Py_ssize_t _slot_of(self, offset_t chunk_id, offset_t offset) except -2:
        """Ring slot of an inflight chunk with ``offset`` in range, -1 for an evicted chunk;
        ValueError for an offset out of range or a chunk this table never held."""
        cdef Py_ssize_t p = self._find(chunk_id)
        if p >= 0:
            if <uint64_t>offset >= <uint64_t>self._ring[p].n:
                raise ValueError(
                    f"offset {offset} is outside [0, {self._ring[p].n}) of chunk {chunk_id}"
                )
            return p
        if p == -1 and offset >= 0:
            return -1
        if p == -1:
            raise ValueError(f"offset {offset} of chunk {chunk_id} is negative")
        raise ValueError(self._describe_missing(chunk_id))

    cdef int c_offset_state(self, offset_t chunk_id, offset_t offset) except -1:
        cdef Py_ssize_t p
        if self._owner:
            self._wait_for_holder()
        p = self._slot_of(chunk_id, offset)
        if p < 0:
            return OFFSET_EVICTED
        cdef ChunkEntry* e = &self._ring[p]
        if (e.bits[offset >> 6] >> (offset & 63)) & 1:
            return OFFSET_CLOSED
        if offset < e.wm:
            return OFFSET_BELOW_WATERMARK
        return OFFSET_OPEN

    cdef int c_close_below(self, offset_t chunk_id, offset_t offset) except -1:
        cdef Py_ssize_t pos, i, mask = self._cap - 1
        cdef ChunkEntry* e
        cdef offset_t old_chunk
        if self._owner:
            self._wait_for_holder()
        old_chunk = self._wm_chunk
        if chunk_id < 0 or offset < 0:
            raise ValueError(
                f"watermark (chunk {chunk_id}, offset {offset}) has a negative chunk id or offset"
            )
        if chunk_id < self._wm_chunk or (
            chunk_id == self._wm_chunk and offset <= self._wm_offset
        ):
            return 0  # the watermark only moves forward
        self._wm_chunk = chunk_id
        self._wm_offset = offset
        pos = self._lower_bound(chunk_id)
        if pos < self._count:
            e = &self._ring[(self._head + pos) & mask]
            if e.chunk_id == chunk_id:
                self._n_open -= _advance_wm(e, _min(offset, e.n))
        # Entries below the old watermark's chunk are already fully closed by it: stop there.
        i = pos - 1
        while i >= 0:
            e = &self._ring[(self._head + i) & mask]
            if e.chunk_id < old_chunk:
                break
            self._n_open -= _advance_wm(e, e.n)
            i -= 1
        return 0

    cdef Py_ssize_t c_evict_complete_prefix(self) except -1:
        cdef Py_ssize_t k = 0
        cdef ChunkEntry* e
        if self._owner:
            self._wait_for_holder()
        while self._count:
            e = &self._ring[self._head]
            if e.n_closed != e.n:
                break
            self._evict_head()
            k += 1
        if k:
            self._shrink()
        return k

    # ---- opening ---------------------------------------------------------------------------------

    def open_chunk(
        self, offset_t chunk_id, offset_t local_index, offset_t n_offsets, offset_t epoch
    ) -> None:
        """Enter a chunk with `n_offsets` open offsets (a chunk of 0 offsets is complete at once).

        Chunk ids and lane-local indexes must strictly increase and epochs must not decrease over
        the table's life (evicted chunks included). Offsets below the watermark start closed.
        """
        cdef Py_ssize_t n_words, p
        cdef word_t* bits = NULL
        cdef ChunkEntry* e
        cdef offset_t wm = 0
        if self._owner:
            self._wait_for_holder()
        if chunk_id < 0:
            raise ValueError(f"cannot open chunk {chunk_id}: chunk ids are >= 0")
        if chunk_id <= self._last_chunk_id:
            raise ValueError(
                f"cannot open chunk {chunk_id} out of order: chunk {self._last_chunk_id} was "
                "already opened and chunk ids must strictly increase"
            )
        if local_index < 0 or local_index <= self._last_local_index:
            raise ValueError(
                f"cannot open chunk {chunk_id} with local index {local_index}: local indexes "
                f"must be >= 0 and strictly increase (last was {self._last_local_index})"
            )
        if n_offsets < 0:
            raise ValueError(f"cannot open chunk {chunk_id} with {n_offsets} offsets (< 0)")
        if epoch < 0 or epoch < self._last_epoch:
            raise ValueError(
                f"cannot open chunk {chunk_id} in epoch {epoch}: epochs must be >= 0 and "
                f"must not decrease (last was {self._last_epoch})"
            )
        if n_offsets > (<offset_t>1 << 56):
            raise MemoryError(f"chunk {chunk_id} has too many offsets ({n_offsets})")
        n_words = <Py_ssize_t>((n_offsets + 63) >> 6)
        if n_words:
            bits = <word_t*>calloc(n_words, sizeof(word_t))
            if bits == NULL:
                raise MemoryError(f"cannot allocate the bitmap of chunk {chunk_id}")
        if self._count == self._cap and not self._resize(self._cap * 2):
            free(bits)
            raise MemoryError(f"cannot grow the chunk table to enter chunk {chunk_id}")
        if chunk_id < self._wm_chunk:
            wm = n_offsets
        elif chunk_id == self._wm_chunk:
            wm = _min(self._wm_offset, n_offsets)
        p = (self._head + self._count) & (self._cap - 1)
        e = &self._ring[p]
        e.chunk_id = chunk_id
        e.local_index = local_index
        e.epoch = epoch
        e.n = n_offsets
        e.n_closed = wm
        e.wm = wm
        e.bits = bits
        self._count += 1
        self._cached = p
        if self._first_chunk_id < 0:
            self._first_chunk_id = chunk_id
        self._last_chunk_id = chunk_id
        self._last_local_index = local_index
        self._last_epoch = epoch
        self._n_open += n_offsets - wm
        self._bitmap_bytes += n_words * <Py_ssize_t>sizeof(word_t)

    # ---- closing ---------------------------------------------------------------------------------

    def close(self, offset_t chunk_id, offset_t offset) -> int:
        """Close one offset; returns its state before the call (OPEN, CLOSED, BELOW_WATERMARK or
        EVICTED). Closing twice is harmless; an offset of an evicted chunk is left alone.

        An offset closed only by the watermark reports BELOW_WATERMARK once and is then explicitly
        closed (CLOSED afterwards); one closed explicitly before the watermark passed stays CLOSED.
        """
        return self.c_close(chunk_id, offset)

    def close_span(self, offset_t chunk_id, offset_t lo, offset_t hi) -> bool:
        """Close offsets ``[lo, hi)`` at once if every one of them is open (True); otherwise
        change nothing (False). What delivery does for a run of records of one chunk."""
        if lo < 0:
            raise ValueError(f"offset {lo} of chunk {chunk_id} is negative")
        return self.c_close_span(chunk_id, lo, hi) == 1

    def offset_state(self, offset_t chunk_id, offset_t offset) -> int:
        """The state `close` would report for this offset, without changing anything."""
        return self.c_offset_state(chunk_id, offset)

    def close_many(self, const offset_t[:] chunk_ids, const offset_t[:] offsets) -> int:
        """Close the offsets `offsets[i]` of chunks `chunk_ids[i]` (1-D int64 buffers of one
        length); returns how many were open before. Pairs of evicted chunks are ignored.

        All-or-nothing: every pair is checked first, and a bad one (a chunk never opened, an
        offset outside its chunk) raises ValueError with nothing changed. Consecutive pairs of the
        same chunk reuse its entry, so grouping by chunk (not sorting) is what makes this fast.
        """
        cdef Py_ssize_t n = chunk_ids.shape[0], bad
        cdef offset_t newly = 0
        if offsets.shape[0] != n:
            raise ValueError(
                f"close_many got {n} chunk ids but {offsets.shape[0]} offsets; "
                "the arrays must have one length"
            )
        self._enter()
        try:
            if n >= NOGIL_MIN_MARKS:
                with nogil:
                    bad = self._first_bad(chunk_ids, offsets)
                    if bad < 0:
                        newly = self._apply_many(chunk_ids, offsets)
            else:
                bad = self._first_bad(chunk_ids, offsets)
                if bad < 0:
                    newly = self._apply_many(chunk_ids, offsets)
            if bad >= 0:
                self._slot_of(chunk_ids[bad], offsets[bad])  # raises the precise message
                raise AssertionError("unreachable")  # pragma: no cover
        finally:
            self._exit()
        return newly

    def close_below(self, offset_t chunk_id, offset_t offset) -> None:
        """Move the lane's watermark to (chunk_id, offset): closes every offset of inflight chunks
        with a smaller id and offsets < `offset` of chunk `chunk_id`, a word at a time.

        A point at or below the current watermark changes nothing. `offset` may be the chunk's
        size (or more) to close the whole chunk. Chunks opened later below the watermark start
        closed below it.
        """
        self.c_close_below(chunk_id, offset)

    def close_epoch(self, offset_t epoch) -> int:
        """Force-close the open offsets of the inflight chunks of `epoch`; returns how many."""
        cdef Py_ssize_t i
        cdef ChunkEntry* e
        cdef offset_t total = 0
        if self._owner:
            self._wait_for_holder()
        for i in range(self._count):
            e = &self._ring[(self._head + i) & (self._cap - 1)]
            if e.epoch == epoch:
                total += _force_close(e)
        self._n_open -= total
        return total

    # ---- queries ---------------------------------------------------------------------------------

    def epoch_open_offsets(self, offset_t epoch, offset_t limit=-1):
        """`(chunk_ids, offsets)`: the open offsets of the inflight chunks of `epoch`, in cursor
        order (at most `limit` pairs when >= 0). Used to name what an epoch marker finds open."""
        cdef Py_ssize_t i
        cdef ChunkEntry* e
        cdef offset_t total = 0, k = 0, got, j
        cdef offset_t[::1] ids_view, offs_view
        self._enter()
        try:
            for i in range(self._count):
                e = &self._ring[(self._head + i) & (self._cap - 1)]
                if e.epoch == epoch:
                    total += e.n - e.n_closed
            if limit >= 0:
                total = _min(total, limit)
            ids = np.empty(total, dtype=np.int64)
            offs = np.empty(total, dtype=np.int64)
            ids_view = ids
            offs_view = offs
            for i in range(self._count):
                if k == total:
                    break
                e = &self._ring[(self._head + i) & (self._cap - 1)]
                if e.epoch == epoch and e.n_closed < e.n:
                    got = _collect_open(e, &offs_view[k], total - k)
                    for j in range(k, k + got):
                        ids_view[j] = e.chunk_id
                    k += got
        finally:
            self._exit()
        return ids, offs

    # ---- eviction --------------------------------------------------------------------------------

    def evict_complete_prefix(self):
        """Monotone path: evict complete chunks from the head, stopping at the first incomplete
        one; returns the evicted chunk ids (int64) and frees their bitmaps."""
        cdef Py_ssize_t k = 0
        cdef ChunkEntry* e
        self._enter()
        try:
            while k < self._count:
                e = &self._ring[(self._head + k) & (self._cap - 1)]
                if e.n_closed != e.n:
                    break
                k += 1
            return self._evict_first(k)
        finally:
            self._exit()

    def evict_complete_epochs(self, offset_t through_epoch):
        """Epoch path: from the head, evict whole epochs <= `through_epoch` whose inflight chunks
        are all complete, stopping at the first epoch that is not; returns the evicted ids."""
        cdef Py_ssize_t j, k = 0
        cdef ChunkEntry* e
        cdef offset_t ep
        cdef bint done
        self._enter()
        try:
            while k < self._count:
                ep = self._ring[(self._head + k) & (self._cap - 1)].epoch
                if ep > through_epoch:
                    break
                j = k
                done = True
                while j < self._count:
                    e = &self._ring[(self._head + j) & (self._cap - 1)]
                    if e.epoch != ep:
                        break
                    if e.n_closed != e.n:
                        done = False
                        break
                    j += 1
                if not done:
                    break
                k = j
            return self._evict_first(k)
        finally:
            self._exit()

    # ---- properties ------------------------------------------------------------------------------

    @property
    def n_inflight(self) -> int:
        """Chunks in the table."""
        return self._count

    @property
    def first_local_index(self) -> int:
        """Lane-local index of the head (oldest inflight) chunk, or -1 when the table is empty."""
        if self._owner:
            self._wait_for_holder()
        return self._ring[self._head].local_index if self._count else -1

    @property
    def n_open_offsets(self) -> int:
        """Open offsets over all inflight chunks (maintained incrementally, O(1))."""
        return self._n_open

    @property
    def bytes_held(self) -> int:
        """Bytes of C memory the table owns now: the entry ring plus the inflight bitmaps."""
        return self._cap * <Py_ssize_t>sizeof(ChunkEntry) + self._bitmap_bytes

    @property
    def watermark(self):
        """The watermark `(chunk_id, offset)`, or None before the first `close_below`."""
        if self._wm_chunk < 0:
            return None
        return (self._wm_chunk, self._wm_offset)

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        self._enter()  # formatting allocates between the reads
        try:
            if self._count:
                chunks = f"{self._ring[self._head].chunk_id}..{self._last_chunk_id}"
            else:
                chunks = "none"
            return (
                f"ChunkTable(n_inflight={self._count}, inflight_chunks={chunks}, "
                f"n_open_offsets={self._n_open}, watermark={self.watermark}, "
                f"n_evicted={self._n_evicted}, bytes_held={self.bytes_held})"
            )
        finally:
            self._exit()
