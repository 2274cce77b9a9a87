"""Token fill of packed bins: the packers' per-fragment work, in C.

``BinFill`` keeps, per open bin, its fragments: the item each came from, ``(frag_start, frag_len,
item_len)`` and where the fragment's tokens (and the same range of each of the item's side arrays:
per-token values such as a loss mask, int32, or float32 copied as their raw bits) sit in the
item's arrays, which it holds. ``write`` applies the placement rows a kernel of
``zephon._core.binfill`` returned for one micro-batch; ``take`` hands finished bins over as
``(3 + n_side, seq_len)`` int32 blocks (rows ``tokens``, ``segment_ids``, ``positions``, then one
row per side field), padded.

Tokens are copied once, when their bin leaves, without the GIL: into the next free rows of a
``RowArena``, field by field, so the bins taken one after another sit back to back. A batch of
them is then a view of the arena, not a copy (``zephon._core.collate``). An arena is written
again once no view holds it, by whichever fill of the process next needs one of its shape
(most often its own; up to ``WARM_BYTES`` of such arenas are kept, a dropped fill's too): memory
the kernel has mapped already, where fresh memory would cost a page fault per page. Fills made
with ``arenas_of`` share their arenas (``RowArenas``), taking rows one after another: a grouped
packer's fills, one per group, hold one fill's arenas between them, however many groups it sees.

Calls from several threads are safe: every method that reads or changes the bins holds the fill's
lock from its first read to its last write, GIL-free copies included, so concurrent calls run one
after the other; a thread waits for the lock without the GIL, so the holder can always finish.
"""

cimport cython
cimport numpy as cnp
from cpython.dict cimport PyDict_GetItem
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.pythread cimport (
    PyThread_allocate_lock,
    PyThread_free_lock,
)
from zephon._core._ints cimport checked_int
from zephon._core._lock cimport drop_lock, take_lock
from zephon._core.records cimport SampleRecord
from libc.stdint cimport INT32_MAX, INT32_MIN
from cpython.ref cimport PyObject
from libc.stdlib cimport qsort
from libc.string cimport memcpy

import operator

import numpy as np

cnp.import_array()

_FLOAT32_MAX = float(np.finfo(np.float32).max)

# Error codes of the validation pass of write(); the row is reported with them.
cdef enum:
    BAD_ITEM = 1
    BAD_RANGE = 2
    BAD_BIN = 3
    BAD_OFFSET = 4
    BAD_OVERFLOW = 5


cdef extern from "Python.h":
    Py_ssize_t _refcount "Py_REFCNT"(PyObject*)

# Arenas the fills of this process wrote to the end and no view holds any more (or whose fill
# was dropped), most recent last, for the next arena any fill needs: their pages are mapped
# already, so neither a fill's next arena nor a new pipeline's first one costs page faults.
# WARM_BYTES in all at most; an arena is written again only once no view holds it.
cdef enum:
    WARM_BYTES = 64 << 20
cdef list _warm = []
cdef Py_ssize_t _warm_bytes = 0


cdef inline Py_ssize_t _arena_bytes(RowArena arena) noexcept:
    return arena.fields * arena.rows * arena.seq_len * sizeof(token_t)


cdef void _keep_warm(RowArena arena):
    global _warm_bytes
    _warm.append(arena)
    _warm_bytes += _arena_bytes(arena)
    while _warm_bytes > WARM_BYTES:
        _warm_bytes -= _arena_bytes(<RowArena>_warm.pop(0))


cdef RowArena _warm_arena(Py_ssize_t fields, Py_ssize_t rows, Py_ssize_t seq_len):
    # The most recently kept warm arena of this shape that no view holds, or None.
    global _warm_bytes
    cdef Py_ssize_t i
    cdef RowArena held
    for i in range(len(_warm) - 1, -1, -1):
        held = <RowArena>_warm[i]
        # Only the list and ``held`` refer to an arena no view holds.
        if (
            held.fields == fields and held.rows == rows and held.seq_len == seq_len
            and _refcount(<PyObject*>held) == 2
        ):
            del _warm[i]
            _warm_bytes -= _arena_bytes(held)
            return held
    return None


def warm_arena_bytes():
    """Bytes of the arenas this process keeps for its next fills."""
    return _warm_bytes


def release_warm_arenas():
    """Drop the arenas kept for the process's next fills (each freed once no view holds it);
    the bytes they held."""
    global _warm_bytes
    freed = _warm_bytes
    del _warm[:]
    _warm_bytes = 0
    return freed


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


cdef int _compare_addresses(const void* a, const void* b) noexcept nogil:
    cdef size_t x = (<const size_t*>a)[0], y = (<const size_t*>b)[0]
    return (x > y) - (x < y)


cdef list _distinct(list items, offset_t[:, ::1] rows):
    """``items`` (one per row) with repeats dropped, first seen first; ``rows[:, 0]`` rewritten
    to index the result."""
    cdef list out = []
    cdef dict index = {}
    cdef Py_ssize_t row
    for row in range(len(items)):
        item = items[row]
        at = index.get(id(item))
        if at is None:
            at = index[id(item)] = len(out)
            out.append(item)
        rows[row, 0] = at
    return out


cdef inline bint _is_flat_array(object a, int typenum) noexcept:
    # A 1-D, C-contiguous, native-order ndarray of typenum: its values can be read in place.
    if not cnp.PyArray_Check(a):
        return False
    cdef cnp.ndarray arr = <cnp.ndarray>a
    # The type number compared first: numpy's own equivalence test costs more than the rest.
    return (
        cnp.PyArray_NDIM(arr) == 1
        and (
            cnp.PyArray_TYPE(arr) == typenum
            or cnp.PyArray_EquivTypenums(cnp.PyArray_TYPE(arr), typenum)
        )
        and cnp.PyArray_ISNOTSWAPPED(arr)
        and cnp.PyArray_IS_C_CONTIGUOUS(arr)
    )


cdef inline bint _is_token_array(object a) noexcept:
    return _is_flat_array(a, cnp.NPY_INT32)


cdef _not_flat(str where, object a, str owner, str dtype):
    what = f"{a.dtype} array of shape {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
    raise TypeError(
        f"{owner}: {where} must be a 1-D C-contiguous native {dtype} ndarray, got {what}"
    )


cdef _not_tokens(Py_ssize_t i, object a, str owner):
    _not_flat(f"arrays[{i}]", a, owner, "int32")


cdef int _side_typenum(str dtype) except -1:
    if dtype == "int32":
        return cnp.NPY_INT32
    if dtype == "float32":
        return cnp.NPY_FLOAT32
    raise ValueError(f"field_lengths: dtype must be 'int32' or 'float32', got {dtype!r}")


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


def field_lengths(list arrays not None, str dtype not None):
    """As ``token_lengths`` for the arrays of a side field: each a 1-D, C-contiguous,
    native-order ndarray of ``dtype`` (``"int32"`` or ``"float32"``). TypeError naming the first
    array that is not such an ndarray."""
    cdef int typenum = _side_typenum(dtype)
    cdef Py_ssize_t i, n = len(arrays)
    out = np.empty(n, dtype=np.int64)
    cdef offset_t[::1] view = out
    cdef object a
    for i in range(n):
        a = arrays[i]
        if not _is_flat_array(a, typenum):
            _not_flat(f"arrays[{i}]", a, "field_lengths", dtype)
        view[i] = cnp.PyArray_DIM(<cnp.ndarray>a, 0)
    return out


cdef list _values_of(list payloads, object name):
    # Each dict payload's value of ``name``, or None when one has none.
    cdef Py_ssize_t i, n = len(payloads)
    cdef list values = [None] * n
    cdef PyObject* found
    for i in range(n):
        found = PyDict_GetItem(payloads[i], name)
        if found == NULL:
            return None
        values[i] = <object>found
    return values


def payload_fields(list records not None, str field not None, tuple sides not None):
    """What a packer's fill reads of ``records``, in the common case, checked in C: each payload a
    dict whose ``field`` is a 1-D, C-contiguous, native int32 ndarray and whose side fields, the
    ``(name, dtype)`` pairs of ``sides`` (``"int32"`` or ``"float32"``), are such ndarrays of
    their dtype, as long as its tokens.

    Returns ``(arrays, lengths, side_arrays)``: the token arrays, their int64 lengths and, per side
    field, the records' arrays of it; or None as soon as one record is not like that, for the
    caller to convert its values or name what is wrong.
    """
    cdef Py_ssize_t n = len(records), i, f
    cdef list payloads = [None] * n
    cdef list arrays, values
    cdef list side_arrays = []
    cdef object payload, a
    cdef int typenum
    out = np.empty(n, dtype=np.int64)
    cdef offset_t[::1] lengths = out
    # Stage by stage, each a loop of short independent steps: the payloads and arrays are mostly
    # out of the cache, and the processor then waits for many of them at once.
    for i in range(n):
        payload = (<SampleRecord?>records[i]).payload
        if type(payload) is not dict:
            return None
        payloads[i] = payload
    arrays = _values_of(payloads, field)
    if arrays is None:
        return None
    for i in range(n):
        a = arrays[i]
        if not _is_token_array(a):
            return None
        lengths[i] = cnp.PyArray_DIM(<cnp.ndarray>a, 0)
    for f in range(len(sides)):
        name, dtype = sides[f]
        typenum = _side_typenum(dtype)
        values = _values_of(payloads, name)
        if values is None:
            return None
        for i in range(n):
            a = values[i]
            if not _is_flat_array(a, typenum) or cnp.PyArray_DIM(<cnp.ndarray>a, 0) != lengths[i]:
                return None
        side_arrays.append(values)
    return arrays, out, side_arrays


# Never tracked by the cyclic collector: what it refers to (its own ndarray) cannot refer back,
# and a collector's clear of an arena found in a dead fill's cycle would free its memory while
# the fill's dealloc passes the arena on to the next fills (``_keep_warm``), which write to it.
@cython.no_gc
cdef class RowArena:
    """Memory that ``BinFill.take`` writes bins into, one after another (see the module
    docstring); the base of every block and row view it hands over."""

    def __cinit__(self, Py_ssize_t fields, Py_ssize_t rows, Py_ssize_t seq_len):
        self.array = np.empty((fields, rows, seq_len), dtype=np.int32)
        self.data = <char*>cnp.PyArray_DATA(<cnp.ndarray>self.array)
        self.fields = fields
        self.rows = rows
        self.seq_len = seq_len
        self.next_row = 0

    def __reduce__(self):
        raise TypeError("a RowArena is a packer's scratch memory and cannot be pickled")


cdef class RowArenas:
    """The arenas ``BinFill.take`` writes bins into (see the module docstring): the one being
    written and those written to the end that views held when last checked. Fills made with
    ``arenas_of`` share them, taking rows one after another: a grouped packer's fills, one per
    group, hold the arenas of one fill between them, however many groups there are."""

    def __cinit__(self, Py_ssize_t fields, Py_ssize_t seq_len):
        # Bins per arena: the largest power of two whose blocks fit in ARENA_BYTES (at least 1).
        cdef Py_ssize_t bin_bytes = fields * seq_len * sizeof(token_t)
        self.rows = 1
        while 2 * self.rows * bin_bytes <= ARENA_BYTES:
            self.rows *= 2
        self.fields = fields
        self.seq_len = seq_len
        self.current = None
        self.retired = []
        self._lock = PyThread_allocate_lock()
        if self._lock == NULL:
            raise MemoryError("RowArenas cannot allocate its lock")
        self._owner = 0

    def __dealloc__(self):
        # Its arenas go on to the process's next fills (reused once no view holds them).
        if self.current is not None:
            _keep_warm(self.current)
        if self.retired is not None:
            for held in self.retired:
                _keep_warm(held)
        if self._lock != NULL:
            PyThread_free_lock(self._lock)

    def __reduce__(self):
        raise TypeError("RowArenas are a packer's scratch memory and cannot be pickled")

    cdef RowArena _arena_for(self):
        """The arena whose next row is free: the current one, else a warm one no view holds any
        more (its memory is mapped already; most often one of these arenas' own), else a new
        one. Arenas views still hold stay here until they are let go. Called under the lock."""
        cdef RowArena arena = self.current
        if arena is not None and arena.next_row < arena.rows:
            return arena
        if arena is not None:
            self.retired.append(arena)
        kept = []
        for held in self.retired:
            # Only this list and the loop refer to an arena no view holds: nothing can read it.
            if _refcount(<PyObject*>held) > 2:
                kept.append(held)
            else:
                _keep_warm(held)
        self.retired = kept
        arena = _warm_arena(self.fields, self.rows, self.seq_len)
        if arena is None:
            arena = RowArena(self.fields, self.rows, self.seq_len)
        arena.next_row = 0
        self.current = arena
        return arena

    cdef Py_ssize_t _held_bytes(self):
        cdef Py_ssize_t total = 0
        take_lock(self._lock, &self._owner, "RowArenas")
        if self.current is not None:
            total += _arena_bytes(self.current)
        for held in self.retired:
            total += _arena_bytes(<RowArena>held)
        drop_lock(self._lock, &self._owner)
        return total


def held_arena_bytes(fills not None):
    """Bytes of the arenas ``fills`` (an iterable of ``BinFill``) hold for their rows: the one
    each writes and those views held when last checked, arenas fills share counted once."""
    cdef set seen = set()
    cdef Py_ssize_t total = 0
    cdef RowArenas arenas
    for fill in fills:
        arenas = (<BinFill?>fill)._arenas
        if id(arenas) not in seen:
            seen.add(id(arenas))
            total += arenas._held_bytes()
    return total


cdef tuple _side_pad(object value, Py_ssize_t k):
    """(kind, 4 bytes as an int32) of side field ``k``'s padding value: an int is an int32 field,
    a float a float32 field."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"BinFill side_pads[{k}] must be an int or a float, not a bool")
    if isinstance(value, (float, np.floating)):
        if abs(value) > _FLOAT32_MAX and value == value and abs(value) != float("inf"):
            raise ValueError(f"BinFill side_pads[{k}] = {value!r} does not fit in float32")
        return SIDE_FLOAT32, int(np.float32(value).view(np.int32))
    try:
        pad = operator.index(value)
    except TypeError:
        raise TypeError(
            f"BinFill side_pads[{k}] must be an int or a float, got {type(value).__name__}"
        ) from None
    if not INT32_MIN <= pad <= INT32_MAX:
        raise ValueError(f"BinFill side_pads[{k}] must be an int32, got {pad}")
    return SIDE_INT32, pad


cdef class BinFill:
    """Fragment lists of a packer's open bins, from placement rows, and the payload blocks of
    the bins that leave.

    Invariant: a taken bin's block holds, from offset 0 and back to back, the tokens of its
    fragments in placement order, segment ids 1, 2, 3 ... for its non-empty fragments, positions
    restarting at 0 per fragment, and in each side row the same range of the fragment's side
    array, then padding; bins open in ascending id order and each id opens at most once between
    two ``clear`` calls. A call that raises changes nothing. The items' arrays are read when their
    bins are taken: they must not change in between.

    ``side_pads`` gives one padding value per side field, in row order: an int makes an int32
    row, a float a float32 row (its bits sit in the int32 block; view the row as float32).
    ``arenas_of``, a fill of the same ``seq_len`` and number of side fields, makes this fill
    write its bins into that fill's arenas (rows of both one after another), not arenas of its
    own.
    """

    def __cinit__(self, seq_len, pad_id=0, side_pads=(), arenas_of=None):
        cdef object n = checked_int(seq_len, "BinFill", "seq_len", 1, INT32_MAX)
        cdef object pad = checked_int(pad_id, "BinFill", "pad_id", INT32_MIN, INT32_MAX)
        pads = tuple(side_pads)
        coded = [_side_pad(value, k) for k, value in enumerate(pads)]
        self._n_side = len(pads)
        self._side_pads = NULL
        self._side_kinds = NULL
        if self._n_side:
            self._side_pads = <token_t*>PyMem_Malloc(self._n_side * sizeof(token_t))
            self._side_kinds = <int*>PyMem_Malloc(self._n_side * sizeof(int))
            if self._side_pads == NULL or self._side_kinds == NULL:
                raise MemoryError(f"BinFill cannot hold {self._n_side} side fields")
            for k, (kind, bits) in enumerate(coded):
                self._side_kinds[k] = kind
                self._side_pads[k] = bits
        self._side_pad_values = pads
        self._seq_len = n
        if arenas_of is None:
            self._arenas = RowArenas(BLOCK_ROWS + self._n_side, n)
        else:
            other = <BinFill?>arenas_of
            if other._seq_len != n or other._n_side != self._n_side:
                raise ValueError(
                    f"BinFill: arenas_of has seq_len {other._seq_len} and {other._n_side} side "
                    f"fields; a fill shares the arenas of one of its shape only ({n} and "
                    f"{self._n_side})"
                )
            self._arenas = other._arenas
        self._pad_id = pad
        self._max_id = -1
        self._live = NULL
        self._n_live = self._cap_live = 0
        self._slots = NULL
        self._n_slots = 0
        self._free = NULL
        self._n_free = 0
        self._sources = []
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
                PyMem_Free(self._slots[k].side_src)
        PyMem_Free(self._slots)
        PyMem_Free(self._free)
        PyMem_Free(self._live)
        PyMem_Free(self._side_pads)
        PyMem_Free(self._side_kinds)
        if self._lock != NULL:
            PyThread_free_lock(self._lock)

    def __reduce__(self):
        raise TypeError("BinFill holds raw buffers and cannot be pickled; build a new one")

    def __repr__(self):
        side = f", side_pads={self._side_pad_values!r}" if self._n_side else ""
        return (
            f"BinFill(seq_len={self._seq_len}, pad_id={self._pad_id}{side}, n_open={self._n_live})"
        )

    @property
    def seq_len(self):
        """Tokens a bin holds."""
        return self._seq_len

    @property
    def pad_id(self):
        """The token id written after the last fragment of a bin when it is taken."""
        return self._pad_id

    @property
    def side_pads(self):
        """The padding value of each side field, as given, in row order."""
        return self._side_pad_values

    @property
    def side_dtypes(self):
        """The value type of each side field's row: ``"int32"`` or ``"float32"``."""
        return tuple(
            "float32" if self._side_kinds[k] == SIDE_FLOAT32 else "int32"
            for k in range(self._n_side)
        )

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

    def contents(self):
        """What the open bins hold, without changing them: ``(rows, items)``, where ``items``
        lists each distinct item once (in bin order, ascending bin id) and ``rows`` is an int64
        ``(m, 5)`` array of ``(item index, frag_start, frag_len, bin_id, bin_offset)`` for every
        fragment. ``write(rows, arrays_of(items), items)`` on an empty ``BinFill`` rebuilds the
        same bins (what a packer restores a checkpoint with)."""
        cdef Py_ssize_t i, k, m = 0, row = 0
        cdef Slot* slot
        cdef offset_t off
        cdef offset_t[:, ::1] view
        cdef list items, records
        cdef size_t* seen
        self._enter()
        try:
            for i in range(self._n_live):
                m += self._slots[self._live[i].slot].n_frags
            rows = np.empty((m, ROW_COLUMNS), dtype=np.int64)
            view = rows
            items = [None] * m
            for i in range(self._n_live):
                slot = &self._slots[self._live[i].slot]
                records = <list>self._records[self._live[i].slot]
                off = 0
                for k in range(slot.n_frags):
                    items[row] = records[k]
                    view[row, 0] = row
                    view[row, 1] = slot.frags[k].start
                    view[row, 2] = slot.frags[k].size
                    view[row, 3] = self._live[i].bin_id
                    view[row, 4] = off
                    off += slot.frags[k].size
                    row += 1
            # An item usually has one fragment in the open bins (the packers close the bins of
            # an item's other pieces at once): sorted identities tell, without a dict.
            seen = <size_t*>PyMem_Malloc(max(m, 1) * sizeof(size_t))
            if seen == NULL:
                raise MemoryError("BinFill.contents")
            try:
                for row in range(m):
                    seen[row] = <size_t><PyObject*>items[row]
                qsort(seen, m, sizeof(size_t), _compare_addresses)
                for row in range(1, m):
                    if seen[row] == seen[row - 1]:
                        return rows, _distinct(items, view)
            finally:
                PyMem_Free(seen)
        finally:
            self._exit()
        return rows, items

    def used(self, bin_id):
        """Tokens placed so far in the open bin ``bin_id``; KeyError if that bin is not open."""
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
                self._slots[k].used = 0
                self._slots[k].frags = NULL
                self._slots[k].side_src = NULL
                self._slots[k].n_frags = 0
                self._slots[k].cap_frags = 0
                self._slots[k].taken = False
                self._sources.append(None)
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
        if self._n_side:
            p = PyMem_Realloc(slot.side_src, cap * self._n_side * sizeof(token_t*))
            if p == NULL:
                raise MemoryError(f"BinFill cannot hold {cap} fragments in one bin")
            slot.side_src = <const token_t**>p
        slot.cap_frags = cap
        return 0

    def write(self, const offset_t[:, ::1] placements not None, list arrays not None,
              list items not None, sides=()):
        """Apply placement rows ``(item, frag_start, frag_len, bin_id, bin_offset)`` (int64,
        C-contiguous ``(k, 5)``) of one micro-batch.

        Item ``i``'s tokens are ``arrays[i]`` (a 1-D, C-contiguous, native-order int32 ndarray,
        read in place when its bin is taken); each row adds its fragment to its bin and attaches
        ``items[item]`` to that bin. ``sides`` holds one list per side field (in row order), whose
        ``i``-th array is item ``i``'s values of that field: a 1-D, C-contiguous, native array of
        the field's dtype and of the same length as ``arrays[i]``; each row takes the same range
        of it. A bin not
        open yet is opened and must have a larger id than every bin opened before; each row's
        ``bin_offset`` must be where its bin's fragments end so far, and no fragment may pass
        ``seq_len``. Raises TypeError for a bad array and ValueError for a side array of the wrong
        length or naming the first bad row; nothing changes then.
        """
        cdef Py_ssize_t n_rows = placements.shape[0]
        cdef Py_ssize_t n_items = len(items)
        cdef Py_ssize_t r = 0, i, t = 0, j, n_live = 0, n_new = 0
        cdef int code = 0
        cdef offset_t item, start, size, bin_id, off, item_len, max_id
        cdef offset_t seq_len = self._seq_len
        cdef Py_ssize_t n_side = self._n_side, f
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
        cdef tuple held_sides = self._held_sides(sides, n_items, lengths)
        side_arr = np.empty((n_side, n_items), dtype=np.uintp)
        cdef size_t[:, ::1] side_data = side_arr
        for f in range(n_side):
            side_list = <tuple>held_sides[f]
            for i in range(n_items):
                side_data[f, i] = <size_t>cnp.PyArray_DATA(<cnp.ndarray>side_list[i])
        if n_rows == 0:
            return
        cdef Py_ssize_t[::1] target
        cdef offset_t[::1] used
        cdef Py_ssize_t[::1] count
        cdef offset_t[::1] new_ids
        cdef Py_ssize_t[::1] slot_of
        cdef Py_ssize_t k
        cdef Slot* slot
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

            # Allocate everything before changing anything: open-bin entries, slots and fragment
            # buffers (growing a buffer changes nothing visible).
            self._reserve(n_live + n_new, n_new)
            slot_arr = np.empty(n_live + n_new, dtype=np.intp)
            slot_of = slot_arr
            for t in range(n_live):
                slot_of[t] = self._live[t].slot
            for j in range(n_new):
                slot_of[n_live + j] = self._free[self._n_free - 1 - j]
            for t in range(n_live + n_new):
                if count[t]:
                    self._reserve_frags(&self._slots[slot_of[t]], count[t])
            # Commit: the new bins take their slots (ids ascending: _live stays sorted).
            for j in range(n_new):
                k = slot_of[n_live + j]
                slot = &self._slots[k]
                slot.used = 0
                slot.n_frags = 0
                self._sources[k] = []
                self._records[k] = []
                self._live[n_live + j].bin_id = new_ids[j]
                self._live[n_live + j].slot = k
            self._n_free -= n_new
            self._n_live = n_live + n_new
            if n_new:
                self._max_id = new_ids[n_new - 1]
            with nogil:
                self._attach(placements, lengths, data, side_data, target, slot_of)
            # The items of the fragments, in row order (so in bin order within each bin), and the
            # arrays the fragments will be read from.
            records = self._records
            sources = self._sources
            for r in range(n_rows):
                k = slot_of[target[r]]
                i = placements[r, ROW_ITEM]
                (<list>records[k]).append(held_items[i])
                (<list>sources[k]).append(held[i])
                for f in range(n_side):
                    (<list>sources[k]).append((<tuple>held_sides[f])[i])
        finally:
            self._exit()

    cdef tuple _held_sides(self, object sides, Py_ssize_t n_items, const offset_t[::1] lengths):
        """``sides`` checked against the fill's side fields and the items' token counts, as a
        tuple of tuples that keeps the arrays alive while they are read without the GIL."""
        cdef Py_ssize_t n_side = self._n_side, f, i
        cdef int typenum
        cdef object a
        held = tuple(tuple(side) for side in sides)
        if len(held) != n_side:
            raise ValueError(
                f"BinFill.write: {len(held)} side fields given, the fill has {n_side}"
            )
        for f in range(n_side):
            side = <tuple>held[f]
            if len(side) != n_items:
                raise ValueError(
                    f"BinFill.write: sides[{f}] has {len(side)} arrays for {n_items} items; "
                    "give one per item"
                )
            typenum = cnp.NPY_FLOAT32 if self._side_kinds[f] == SIDE_FLOAT32 else cnp.NPY_INT32
            for i in range(n_items):
                a = side[i]
                if not _is_flat_array(a, typenum):
                    _not_flat(f"sides[{f}][{i}]", a, "BinFill.write", self.side_dtypes[f])
                if cnp.PyArray_DIM(<cnp.ndarray>a, 0) != lengths[i]:
                    raise ValueError(
                        f"BinFill.write: sides[{f}][{i}] has {cnp.PyArray_DIM(<cnp.ndarray>a, 0)} "
                        f"values for the {lengths[i]} tokens of item {i}"
                    )
        return held

    cdef void _attach(self, const offset_t[:, ::1] placements, const offset_t[::1] lengths,
                      const size_t[::1] data, const size_t[:, ::1] side_data,
                      const Py_ssize_t[::1] target, const Py_ssize_t[::1] slot_of) noexcept nogil:
        # Rows were validated: every fragment lies inside its item's tokens and its bin, and the
        # item's side arrays are as long as its tokens.
        cdef Py_ssize_t r, f, n_side = self._n_side
        cdef offset_t item, start
        cdef Slot* slot
        cdef Frag* frag
        for r in range(placements.shape[0]):
            item = placements[r, ROW_ITEM]
            start = placements[r, ROW_START]
            slot = &self._slots[slot_of[target[r]]]
            frag = &slot.frags[slot.n_frags]
            frag.start = start
            frag.size = placements[r, ROW_SIZE]
            frag.item_len = lengths[item]
            frag.src = (<const token_t*>data[item]) + start
            for f in range(n_side):
                slot.side_src[slot.n_frags * n_side + f] = (
                    (<const token_t*>side_data[f, item]) + start
                )
            slot.used = placements[r, ROW_OFFSET] + frag.size
            slot.n_frags += 1

    def take(self, const offset_t[::1] bin_ids not None):
        """Hand over the open bins ``bin_ids`` (int64, in the order given) and free their slots.

        Returns ``(blocks, items, frags)``: per bin its ``(3 + n_side, seq_len)`` int32 block (rows
        tokens, segment_ids, positions and the side fields; padded with ``pad_id`` / 0 / 0 and each
        side field's padding value after the last fragment), a view of the ``RowArena`` the bins
        are written into one after another (each row is C-contiguous; the block is not), and the
        list of its fragments' items in bin order; ``frags`` is an int64 ``(m, 3)`` array of
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
        cdef Py_ssize_t fields = BLOCK_ROWS + self._n_side
        cdef Slot* slot
        cdef RowArena arena
        cdef RowArenas arenas = self._arenas
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
        cdef list blocks = [None] * n
        cdef cnp.npy_intp dims[2]
        cdef cnp.npy_intp strides[2]
        cdef size_t[::1] dst
        cdef offset_t[:, ::1] fv
        # A block's rows are a field apart in its arena: arenas.rows rows of seq_len tokens.
        cdef Py_ssize_t stride = arenas.rows * self._seq_len
        dims[0] = fields
        dims[1] = self._seq_len
        strides[0] = stride * sizeof(token_t)
        strides[1] = sizeof(token_t)
        try:
            frags = np.empty((total, FRAG_COLUMNS), dtype=np.int64)
            fv = frags
            # Where each bin goes: the next row of an arena, blocks as views of it. The arenas
            # the bins need are allocated before any bin is written or released; the rows are
            # taken under the arenas' lock, which other fills sharing them take too.
            dst = np.empty(n, dtype=np.uintp)
            take_lock(arenas._lock, &arenas._owner, "RowArenas")
            try:
                for i in range(n):
                    arena = arenas._arena_for()
                    dst[i] = <size_t>(arena.data + arena.next_row * self._seq_len * sizeof(token_t))
                    arena.next_row += 1
                    block = cnp.PyArray_New(
                        np.ndarray, 2, dims, cnp.NPY_INT32, strides, <void*>dst[i],
                        sizeof(token_t), cnp.NPY_ARRAY_WRITEABLE | cnp.NPY_ARRAY_ALIGNED, None
                    )
                    cnp.set_array_base(block, arena)
                    blocks[i] = block
            finally:
                drop_lock(arenas._lock, &arenas._owner)
        except BaseException:
            for i in range(n):
                self._slots[idx[i]].taken = False
            raise
        with nogil:
            for i in range(n):
                slot = &self._slots[idx[i]]
                self._fill(slot, <token_t*>dst[i], stride)
                for k in range(slot.n_frags):
                    fv[row, 0] = slot.frags[k].start
                    fv[row, 1] = slot.frags[k].size
                    fv[row, 2] = slot.frags[k].item_len
                    row += 1
        items = []
        sources_of = self._sources
        records_of = self._records
        for i in range(n):
            k = idx[i]
            items.append(records_of[k])
            sources_of[k] = None
            records_of[k] = None
            slot = &self._slots[k]
            slot.used = 0
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

    cdef void _fill(self, const Slot* slot, token_t* dst, Py_ssize_t stride) noexcept nogil:
        # The bin's block at dst, its rows ``stride`` tokens apart: the fragments' tokens, segment
        # ids 1, 2, ... for the non-empty ones, positions from 0 per fragment and the side values,
        # then padding: pad_id tokens, segment id 0, position 0, each side field's padding value.
        cdef offset_t seq_len = self._seq_len, off = 0, size, p
        cdef Py_ssize_t k, f, n_side = self._n_side
        cdef token_t seg = 0, pad
        cdef token_t* tokens = dst
        cdef token_t* segments = dst + stride
        cdef token_t* positions = dst + 2 * stride
        cdef token_t* side
        cdef const Frag* frag
        for k in range(slot.n_frags):
            frag = &slot.frags[k]
            size = frag.size
            if not size:
                continue
            memcpy(tokens + off, frag.src, size * sizeof(token_t))
            seg += 1
            for p in range(size):
                segments[off + p] = seg
                positions[off + p] = <token_t>p
            for f in range(n_side):
                memcpy(dst + (BLOCK_ROWS + f) * stride + off, slot.side_src[k * n_side + f],
                       size * sizeof(token_t))
            off += size
        pad = self._pad_id
        for p in range(off, seq_len):
            tokens[p] = pad
            segments[p] = 0
            positions[p] = 0
        for f in range(n_side):
            side = dst + (BLOCK_ROWS + f) * stride
            pad = self._side_pads[f]
            for p in range(off, seq_len):
                side[p] = pad

    def clear(self):
        """Drop every open bin without handing it over; bin ids may start again at 0."""
        cdef Py_ssize_t i, k
        self._enter()
        for i in range(self._n_live):
            k = self._live[i].slot
            self._slots[k].used = 0
            self._slots[k].n_frags = 0
            self._sources[k] = None
            self._records[k] = None
            self._free[self._n_free] = k
            self._n_free += 1
        self._n_live = 0
        self._max_id = -1
        self._exit()
