"""Token fill of packed bins: the packers' per-fragment work, in C.

``BinFill`` owns one ``(3, seq_len)`` int32 block per open bin (rows ``tokens``, ``segment_ids``,
``positions``) and, per bin, its fragments: the item each came from and ``(frag_start, frag_len,
item_len)``. ``write`` applies the placement rows a kernel of ``zephon._core.binfill`` returned
for one micro-batch, copying each fragment's tokens straight from its item's int32 array without
the GIL; ``take`` hands finished bins over, padded. Tokens are copied once: a bin's block is
allocated when the bin opens and becomes the packed record's payload when it leaves.

Calls from several threads are safe: every method that reads or changes the bins holds the fill's
lock from its first read to its last write, GIL-free copies included, so concurrent calls run one
after the other; a thread waits for the lock without the GIL, so the holder can always finish.
"""

cimport numpy as cnp
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.pythread cimport (
    PyThread_allocate_lock,
    PyThread_free_lock,
)
from zephon._core._lock cimport drop_lock, take_lock
from libc.stdint cimport INT32_MAX, INT32_MIN
from libc.string cimport memcpy

import operator

import numpy as np

cnp.import_array()

# Error codes of the validation pass of write(); the row is reported with them.
cdef enum:
    BAD_ITEM = 1
    BAD_RANGE = 2
    BAD_BIN = 3
    BAD_OFFSET = 4
    BAD_OVERFLOW = 5


cdef inline Py_ssize_t _search(const LiveBin* live, Py_ssize_t n, offset_t bin_id) noexcept nogil:
    # Index of bin_id in the ascending live array, or -1.
    cdef Py_ssize_t lo = 0, hi = n, mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if live[mid].bin_id < bin_id:
            lo = mid + 1
        else:
            hi = mid
    if lo < n and live[lo].bin_id == bin_id:
        return lo
    return -1


cdef inline Py_ssize_t _search_ids(const offset_t* ids, Py_ssize_t n, offset_t bin_id) noexcept nogil:
    cdef Py_ssize_t lo = 0, hi = n, mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if ids[mid] < bin_id:
            lo = mid + 1
        else:
            hi = mid
    if lo < n and ids[lo] == bin_id:
        return lo
    return -1


cdef inline bint _is_token_array(object a) noexcept:
    # A 1-D, C-contiguous, native-order int32 ndarray: its tokens can be read in place.
    if not cnp.PyArray_Check(a):
        return False
    cdef cnp.ndarray arr = <cnp.ndarray>a
    return (
        cnp.PyArray_NDIM(arr) == 1
        and cnp.PyArray_EquivTypenums(cnp.PyArray_TYPE(arr), cnp.NPY_INT32)
        and cnp.PyArray_ISNOTSWAPPED(arr)
        and cnp.PyArray_IS_C_CONTIGUOUS(arr)
    )


cdef _not_tokens(Py_ssize_t i, object a, str owner):
    what = f"{a.dtype} array of shape {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
    raise TypeError(
        f"{owner}: arrays[{i}] must be a 1-D C-contiguous native int32 ndarray, got {what}"
    )


def token_lengths(list arrays not None):
    """The lengths of ``arrays`` (each a 1-D, C-contiguous, native-order int32 ndarray) as an int64
    array: what a placement kernel is given before ``BinFill.write`` reads the same arrays.
    TypeError naming the first array that is not such an ndarray."""
    cdef Py_ssize_t i, n = len(arrays)
    out = np.empty(n, dtype=np.int64)
    cdef offset_t[::1] view = out
    cdef object a
    for i in range(n):
        a = arrays[i]
        if not _is_token_array(a):
            _not_tokens(i, a, "token_lengths")
        view[i] = cnp.PyArray_DIM(<cnp.ndarray>a, 0)
    return out


cdef void _pad(token_t* data, offset_t used, offset_t seq_len, token_t pad_id) noexcept nogil:
    # Padding: pad_id tokens, segment id 0, position 0.
    cdef offset_t p
    for p in range(used, seq_len):
        data[p] = pad_id
        data[seq_len + p] = 0
        data[2 * seq_len + p] = 0


cdef class BinFill:
    """Payload blocks and fragment lists of a packer's open bins, filled from placement rows.

    Invariant: every open bin's block holds, from offset 0 and back to back, the tokens of its
    fragments in placement order, segment ids 1, 2, 3 ... for its non-empty fragments and positions
    restarting at 0 per fragment; bins open in ascending id order and each id opens at most once
    between two ``clear`` calls. A call that raises changes nothing.
    """

    def __cinit__(self, seq_len, pad_id=0):
        if isinstance(seq_len, bool) or isinstance(pad_id, bool):
            raise TypeError("BinFill seq_len and pad_id must be ints, not bools")
        cdef object n = operator.index(seq_len)
        cdef object pad = operator.index(pad_id)
        if not 1 <= n <= INT32_MAX:
            raise ValueError(f"BinFill seq_len must be in [1, 2**31 - 1] (int32 positions), got {n}")
        if not INT32_MIN <= pad <= INT32_MAX:
            raise ValueError(f"BinFill pad_id must be an int32, got {pad}")
        self._seq_len = n
        self._pad_id = pad
        self._max_id = -1
        self._live = NULL
        self._n_live = self._cap_live = 0
        self._slots = NULL
        self._n_slots = 0
        self._free = NULL
        self._n_free = 0
        self._blocks = []
        self._records = []
        self._lock = PyThread_allocate_lock()
        if self._lock == NULL:
            raise MemoryError("BinFill cannot allocate its lock")
        self._owner = 0

    def __dealloc__(self):
        cdef Py_ssize_t k
        if self._slots != NULL:
            for k in range(self._n_slots):
                PyMem_Free(self._slots[k].frags)
        PyMem_Free(self._slots)
        PyMem_Free(self._free)
        PyMem_Free(self._live)
        if self._lock != NULL:
            PyThread_free_lock(self._lock)

    def __reduce__(self):
        raise TypeError("BinFill holds raw buffers and cannot be pickled; build a new one")

    def __repr__(self):
        return f"BinFill(seq_len={self._seq_len}, pad_id={self._pad_id}, n_open={self._n_live})"

    @property
    def seq_len(self):
        """Tokens a bin holds."""
        return self._seq_len

    @property
    def pad_id(self):
        """The token id written after the last fragment of a bin when it is taken."""
        return self._pad_id

    @property
    def n_open(self):
        """Number of bins holding a block now."""
        return self._n_live

    def open_bin_ids(self):
        """Ids of the open bins, ascending, as an int64 array."""
        cdef offset_t[::1] view
        cdef Py_ssize_t k
        self._enter()
        try:
            out = np.empty(self._n_live, dtype=np.int64)
            view = out
            for k in range(self._n_live):
                view[k] = self._live[k].bin_id
        finally:
            self._exit()
        return out

    def used(self, bin_id):
        """Tokens written so far to the open bin ``bin_id``; KeyError if that bin is not open."""
        cdef offset_t b = operator.index(bin_id)
        cdef offset_t used = -1
        cdef Py_ssize_t k
        self._enter()
        k = self._find(b)
        if k >= 0:
            used = self._slots[self._live[k].slot].used
        self._exit()
        if used < 0:
            raise KeyError(f"bin {bin_id} is not open in this BinFill")
        return used

    cdef Py_ssize_t _find(self, offset_t bin_id) noexcept nogil:
        return _search(self._live, self._n_live, bin_id)

    cdef int _enter(self) except -1:
        return take_lock(self._lock, &self._owner, "BinFill")

    cdef void _exit(self) noexcept:
        drop_lock(self._lock, &self._owner)

    cdef int _reserve(self, Py_ssize_t n_live, Py_ssize_t n_free) except -1:
        """Room for ``n_live`` open bins and ``n_free`` free slots; changes no visible state."""
        cdef Py_ssize_t cap, k, grow
        cdef void* p
        if n_live > self._cap_live:
            cap = max(n_live, 2 * self._cap_live, 16)
            p = PyMem_Realloc(self._live, cap * sizeof(LiveBin))
            if p == NULL:
                raise MemoryError(f"BinFill cannot hold {n_live} open bins")
            self._live = <LiveBin*>p
            self._cap_live = cap
        if n_free > self._n_free:
            grow = max(n_free - self._n_free, self._n_slots, 16)
            cap = self._n_slots + grow
            p = PyMem_Realloc(self._slots, cap * sizeof(Slot))
            if p == NULL:
                raise MemoryError(f"BinFill cannot allocate {cap} bin slots")
            self._slots = <Slot*>p
            p = PyMem_Realloc(self._free, cap * sizeof(Py_ssize_t))
            if p == NULL:
                raise MemoryError(f"BinFill cannot allocate {cap} bin slots")
            self._free = <Py_ssize_t*>p
            for k in range(self._n_slots, cap):
                self._slots[k].data = NULL
                self._slots[k].used = 0
                self._slots[k].n_segments = 0
                self._slots[k].frags = NULL
                self._slots[k].n_frags = 0
                self._slots[k].cap_frags = 0
                self._slots[k].taken = False
                self._blocks.append(None)
                self._records.append(None)
            # Push the new slots so that the lowest index is used first.
            for k in range(cap - 1, self._n_slots - 1, -1):
                self._free[self._n_free] = k
                self._n_free += 1
            self._n_slots = cap
        return 0

    cdef int _reserve_frags(self, Slot* slot, Py_ssize_t n) except -1:
        cdef Py_ssize_t cap
        cdef void* p
        if slot.n_frags + n <= slot.cap_frags:
            return 0
        cap = max(slot.n_frags + n, 2 * slot.cap_frags, 8)
        p = PyMem_Realloc(slot.frags, cap * sizeof(Frag))
        if p == NULL:
            raise MemoryError(f"BinFill cannot hold {cap} fragments in one bin")
        slot.frags = <Frag*>p
        slot.cap_frags = cap
        return 0

    def write(self, const offset_t[:, ::1] placements not None, list arrays not None,
              list items not None):
        """Apply placement rows ``(item, frag_start, frag_len, bin_id, bin_offset)`` (int64,
        C-contiguous ``(k, 5)``) of one micro-batch.

        Item ``i``'s tokens are ``arrays[i]`` (a 1-D, C-contiguous, native-order int32 ndarray,
        read in place); each row copies its fragment into its bin and attaches ``items[item]`` to
        that bin. A bin not open yet is opened and must have a larger id than every bin opened
        before; each row's ``bin_offset`` must be where its bin's fragments end so far, and no
        fragment may pass ``seq_len``. Raises TypeError for a bad array and ValueError naming the
        first bad row; nothing changes then.
        """
        cdef Py_ssize_t n_rows = placements.shape[0]
        cdef Py_ssize_t n_items = len(items)
        cdef Py_ssize_t r = 0, i, t = 0, j, n_live = 0, n_new = 0
        cdef int code = 0
        cdef offset_t item, start, size, bin_id, off, item_len, max_id
        cdef offset_t seq_len = self._seq_len
        cdef object a
        if placements.shape[1] != ROW_COLUMNS:
            raise ValueError(
                f"BinFill.write: placements must have {ROW_COLUMNS} columns, got {placements.shape[1]}"
            )
        if len(arrays) != n_items:
            raise ValueError(
                f"BinFill.write: {len(arrays)} arrays for {n_items} items; give one per item"
            )
        # Tuples keep the arrays alive while their data is read without the GIL, and the items as
        # they were validated, whatever another thread does to the caller's lists meanwhile.
        cdef tuple held = tuple(arrays)
        cdef tuple held_items = tuple(items)
        lengths_arr = np.empty(n_items, dtype=np.int64)
        data_arr = np.empty(n_items, dtype=np.uintp)
        cdef offset_t[::1] lengths = lengths_arr
        cdef size_t[::1] data = data_arr
        for i in range(n_items):
            a = held[i]
            if not _is_token_array(a):
                _not_tokens(i, a, "BinFill.write")
            lengths[i] = cnp.PyArray_DIM(<cnp.ndarray>a, 0)
            data[i] = <size_t>cnp.PyArray_DATA(<cnp.ndarray>a)
        if n_rows == 0:
            return
        cdef Py_ssize_t[::1] target
        cdef offset_t[::1] used
        cdef Py_ssize_t[::1] count
        cdef offset_t[::1] new_ids
        cdef Py_ssize_t[::1] slot_of
        cdef Py_ssize_t k
        cdef Slot* slot
        cdef cnp.ndarray block
        cdef cnp.npy_intp dims[2]
        dims[0] = BLOCK_ROWS
        dims[1] = seq_len
        self._enter()
        try:
            # Scratch of the validation pass: each row's target (an open bin's index in _live, or
            # n_live + j for the j-th bin this call opens), and per target its fill and row count.
            # Sized from the open bins under the lock: no other call changes them until we are done.
            n_live = self._n_live
            target_arr = np.empty(n_rows, dtype=np.intp)
            used_arr = np.empty(n_live + n_rows, dtype=np.int64)
            count_arr = np.zeros(n_live + n_rows, dtype=np.intp)
            new_arr = np.empty(n_rows, dtype=np.int64)
            target = target_arr
            used = used_arr
            count = count_arr
            new_ids = new_arr
            with nogil:
                for t in range(n_live):
                    used[t] = self._slots[self._live[t].slot].used
                max_id = self._max_id
                for r in range(n_rows):
                    item = placements[r, ROW_ITEM]
                    start = placements[r, ROW_START]
                    size = placements[r, ROW_SIZE]
                    bin_id = placements[r, ROW_BIN]
                    off = placements[r, ROW_OFFSET]
                    if item < 0 or item >= n_items:
                        code = BAD_ITEM
                        break
                    item_len = lengths[item]
                    if start < 0 or size < 0 or start > item_len or size > item_len - start:
                        code = BAD_RANGE
                        break
                    t = _search(self._live, n_live, bin_id)
                    if t < 0:
                        if n_new and new_ids[n_new - 1] == bin_id:
                            t = n_live + n_new - 1
                        elif bin_id > max_id:
                            new_ids[n_new] = bin_id
                            t = n_live + n_new
                            used[t] = 0
                            n_new += 1
                            max_id = bin_id
                        else:
                            j = _search_ids(&new_ids[0], n_new, bin_id)
                            if j < 0:
                                code = BAD_BIN
                                break
                            t = n_live + j
                    if off != used[t]:
                        code = BAD_OFFSET
                        break
                    if size > seq_len - off:
                        code = BAD_OVERFLOW
                        break
                    used[t] = off + size
                    count[t] += 1
                    target[r] = t
            if code:
                row = [placements[r, k] for k in range(ROW_COLUMNS)]
                if code == BAD_ITEM:
                    why = f"item {row[0]} is not one of the {n_items} items"
                elif code == BAD_RANGE:
                    why = f"fragment [{row[1]}, {row[1]} + {row[2]}) is outside its item's tokens"
                elif code == BAD_BIN:
                    why = f"bin {row[3]} is not open and ids below {max_id + 1} were opened before"
                elif code == BAD_OFFSET:
                    why = f"bin {row[3]} is filled to {used[t]}, not to bin_offset {row[4]}"
                else:
                    why = f"the fragment ends at {row[4]} + {row[2]}, past seq_len {seq_len}"
                raise ValueError(f"BinFill.write: placement row {r} {row}: {why}")

            # Allocate everything before changing anything: open-bin entries, slots, blocks and
            # fragment buffers (growing a buffer changes nothing visible).
            self._reserve(n_live + n_new, n_new)
            blocks = [cnp.PyArray_EMPTY(2, dims, cnp.NPY_INT32, 0) for j in range(n_new)]
            slot_arr = np.empty(n_live + n_new, dtype=np.intp)
            slot_of = slot_arr
            for t in range(n_live):
                slot_of[t] = self._live[t].slot
            for j in range(n_new):
                slot_of[n_live + j] = self._free[self._n_free - 1 - j]
            for t in range(n_live + n_new):
                if count[t]:
                    self._reserve_frags(&self._slots[slot_of[t]], count[t])
            # Commit: the new bins take their slots and blocks (ids ascending: _live stays sorted).
            for j in range(n_new):
                k = slot_of[n_live + j]
                block = blocks[j]
                slot = &self._slots[k]
                slot.data = <token_t*>cnp.PyArray_DATA(block)
                slot.used = 0
                slot.n_segments = 0
                slot.n_frags = 0
                self._blocks[k] = block
                self._records[k] = []
                self._live[n_live + j].bin_id = new_ids[j]
                self._live[n_live + j].slot = k
            self._n_free -= n_new
            self._n_live = n_live + n_new
            if n_new:
                self._max_id = new_ids[n_new - 1]
            with nogil:
                self._copy(placements, lengths, data, target, slot_of)
            # The items of the fragments, in row order (so in bin order within each bin).
            records = self._records
            for r in range(n_rows):
                (<list>records[slot_of[target[r]]]).append(held_items[placements[r, ROW_ITEM]])
        finally:
            self._exit()

    cdef void _copy(self, const offset_t[:, ::1] placements, const offset_t[::1] lengths,
                    const size_t[::1] data, const Py_ssize_t[::1] target,
                    const Py_ssize_t[::1] slot_of) noexcept nogil:
        # Rows were validated: every fragment lies inside its item's tokens and its bin.
        cdef offset_t seq_len = self._seq_len
        cdef Py_ssize_t r
        cdef offset_t item, start, size, off, p
        cdef token_t seg
        cdef token_t* dst
        cdef Slot* slot
        cdef Frag* frag
        for r in range(placements.shape[0]):
            item = placements[r, ROW_ITEM]
            start = placements[r, ROW_START]
            size = placements[r, ROW_SIZE]
            off = placements[r, ROW_OFFSET]
            slot = &self._slots[slot_of[target[r]]]
            dst = slot.data
            if size:
                memcpy(dst + off, (<const token_t*>data[item]) + start, size * sizeof(token_t))
                slot.n_segments += 1
                seg = slot.n_segments
                dst += seq_len + off
                for p in range(size):
                    dst[p] = seg
                dst += seq_len
                for p in range(size):
                    dst[p] = <token_t>p
            slot.used = off + size
            frag = &slot.frags[slot.n_frags]
            frag.start = start
            frag.size = size
            frag.item_len = lengths[item]
            slot.n_frags += 1

    def take(self, const offset_t[::1] bin_ids not None):
        """Hand over the open bins ``bin_ids`` (int64, in the order given) and free their slots.

        Returns ``(blocks, items, frags)``: per bin its ``(3, seq_len)`` int32 block (rows tokens,
        segment_ids, positions; padded with ``pad_id`` / 0 / 0 after the last fragment) and the list
        of its fragments' items in bin order; ``frags`` is an int64 ``(m, 3)`` array of
        ``(frag_start, frag_len, item_len)`` for all their fragments, bin after bin. KeyError for a
        bin that is not open, ValueError for one given twice; nothing changes then.
        """
        idx = np.empty(bin_ids.shape[0], dtype=np.intp)
        self._enter()
        try:
            return self._take(bin_ids, idx)
        finally:
            self._exit()

    cdef tuple _take(self, const offset_t[::1] bin_ids, Py_ssize_t[::1] idx):
        cdef Py_ssize_t n = bin_ids.shape[0], i, k, t, total = 0, dup = -1, row = 0
        cdef Slot* slot
        cdef offset_t seq_len = self._seq_len
        cdef token_t pad_id = self._pad_id
        for i in range(n):
            t = self._find(bin_ids[i])
            if t < 0:
                raise KeyError(f"bin {bin_ids[i]} is not open in this BinFill")
            idx[i] = self._live[t].slot
        for i in range(n):
            slot = &self._slots[idx[i]]
            if slot.taken:
                dup = i
                break
            slot.taken = True
            total += slot.n_frags
        if dup >= 0:
            for k in range(dup):
                self._slots[idx[k]].taken = False
            raise ValueError(f"BinFill.take: bin {bin_ids[dup]} is given twice")
        try:
            frags = np.empty((total, FRAG_COLUMNS), dtype=np.int64)
        except BaseException:
            for i in range(n):
                self._slots[idx[i]].taken = False
            raise
        cdef offset_t[:, ::1] fv = frags
        blocks = []
        items = []
        with nogil:
            for i in range(n):
                slot = &self._slots[idx[i]]
                _pad(slot.data, slot.used, seq_len, pad_id)
                for k in range(slot.n_frags):
                    fv[row, 0] = slot.frags[k].start
                    fv[row, 1] = slot.frags[k].size
                    fv[row, 2] = slot.frags[k].item_len
                    row += 1
        blocks_of = self._blocks
        records_of = self._records
        for i in range(n):
            k = idx[i]
            blocks.append(blocks_of[k])
            items.append(records_of[k])
            blocks_of[k] = None
            records_of[k] = None
            slot = &self._slots[k]
            slot.data = NULL
            slot.used = 0
            slot.n_segments = 0
            slot.n_frags = 0
            self._free[self._n_free] = k
            self._n_free += 1
        # Drop the taken bins from _live, keeping the order of the rest.
        if n:
            t = 0
            for i in range(self._n_live):
                slot = &self._slots[self._live[i].slot]
                if slot.taken:
                    slot.taken = False
                else:
                    self._live[t] = self._live[i]
                    t += 1
            self._n_live = t
        return blocks, items, frags

    def clear(self):
        """Drop every open bin without handing it over; bin ids may start again at 0."""
        cdef Py_ssize_t i, k
        self._enter()
        for i in range(self._n_live):
            k = self._live[i].slot
            self._slots[k].data = NULL
            self._slots[k].used = 0
            self._slots[k].n_segments = 0
            self._slots[k].n_frags = 0
            self._blocks[k] = None
            self._records[k] = None
            self._free[self._n_free] = k
            self._n_free += 1
        self._n_live = 0
        self._max_id = -1
        self._exit()
