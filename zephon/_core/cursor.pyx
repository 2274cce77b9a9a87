"""SampleCursor: the identity of a record.

The constructor takes ``(chunk_id, chunk_offset, sample_id, lineage)`` but cursors sort on
``(chunk_id, chunk_offset, lineage, sample_id)`` so that the children of one offset stay together.
All fields are kept as C integers so comparing, hashing and sorting never build Python tuples.
"""

cimport cython
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdlib cimport qsort
from libc.stdint cimport INT64_MAX
from libc.string cimport memcpy

from zephon._core._ints cimport checked_int


import numpy as np

cimport numpy as cnp

cnp.import_array()

cdef inline int _cmp_i64(offset_t a, offset_t b) noexcept nogil:
    return (a > b) - (a < b)


cdef int _cmp_fields(offset_t ca, offset_t oa, const offset_t* la, Py_ssize_t na, const offset_t* sa,
                     offset_t cb, offset_t ob, const offset_t* lb, Py_ssize_t nb,
                     const offset_t* sb) noexcept nogil:
    cdef int c = _cmp_i64(ca, cb)
    if c:
        return c
    c = _cmp_i64(oa, ob)
    if c:
        return c
    cdef Py_ssize_t i, n = na if na < nb else nb
    for i in range(n):
        c = _cmp_i64(la[i], lb[i])
        if c:
            return c
    c = _cmp_i64(na, nb)  # a lineage that is a prefix of another sorts first, like tuples
    if c:
        return c
    for i in range(3):
        c = _cmp_i64(sa[i], sb[i])
        if c:
            return c
    return 0


cdef offset_t _as_field(object value, str field) except? -1:
    """A non-negative int64 from any integer-like value, or an error naming the field."""
    return <offset_t>checked_int(value, "SampleCursor", field, 0, INT64_MAX)


@cython.freelist(1024)
cdef class SampleCursor:
    """Where a record was born (chunk, offset, sample id) and the path it took (lineage).

    Immutable, hashable and picklable; equality compares all four fields and ordering follows
    ``sort_key``. The hash is stable across processes, so cursors can be digested into checkpoints.
    """

    def __init__(self, chunk_id, chunk_offset, sample_id, lineage=()):
        self.chunk_id = _as_field(chunk_id, "chunk_id")
        self.chunk_offset = _as_field(chunk_offset, "chunk_offset")
        if isinstance(sample_id, (str, bytes)) or not hasattr(sample_id, "__len__"):
            raise TypeError(f"SampleCursor sample_id must be a tuple of 3 ints, got {sample_id!r}")
        if len(sample_id) != 3:
            raise TypeError(
                f"SampleCursor sample_id must be (dataset_id, shard_id, sample_idx), got {sample_id!r}"
            )
        try:
            s0, s1, s2 = sample_id[0], sample_id[1], sample_id[2]
        except (TypeError, KeyError, IndexError):  # a set or mapping: sized but not a sequence
            raise TypeError(
                f"SampleCursor sample_id must be a tuple of 3 ints, got {sample_id!r}"
            ) from None
        self.sid[0] = _as_field(s0, "sample_id[0] (dataset_id)")
        self.sid[1] = _as_field(s1, "sample_id[1] (shard_id)")
        self.sid[2] = _as_field(s2, "sample_id[2] (sample_idx)")
        if isinstance(lineage, (str, bytes)) or not hasattr(lineage, "__len__"):
            raise TypeError(f"SampleCursor lineage must be a tuple of ints, got {lineage!r}")
        cdef Py_ssize_t n = len(lineage), i
        if self.lin != NULL:  # __init__ called twice on one object
            PyMem_Free(self.lin)
            self.lin = NULL
        if n:
            self.lin = <offset_t*>PyMem_Malloc(n * sizeof(offset_t))
            if self.lin == NULL:
                raise MemoryError()
            self.nlin = n
            for i in range(n):
                try:
                    item = lineage[i]
                except (TypeError, KeyError, IndexError):  # a set or mapping: sized, not a sequence
                    raise TypeError(
                        f"SampleCursor lineage must be a tuple of ints, got {lineage!r}"
                    ) from None
                self.lin[i] = _as_field(item, f"lineage[{i}]")
        else:
            self.nlin = 0
        self._rehash()

    def __dealloc__(self):
        if self.lin != NULL:
            PyMem_Free(self.lin)

    cdef void _rehash(self) noexcept:
        if self.nlin == 0:
            self.hashval = root_hash(self.chunk_id, self.chunk_offset, self.sid)
            return
        cdef uint64_t h = _mix(<uint64_t>self.chunk_id, <uint64_t>self.chunk_offset)
        cdef Py_ssize_t i
        h = _mix(h, <uint64_t>self.nlin)
        for i in range(self.nlin):
            h = _mix(h, <uint64_t>self.lin[i])
        for i in range(3):
            h = _mix(h, <uint64_t>self.sid[i])
        self.hashval = h

    cdef int cmp(self, SampleCursor other) noexcept:
        return _cmp_fields(self.chunk_id, self.chunk_offset, self.lin, self.nlin, self.sid,
                           other.chunk_id, other.chunk_offset, other.lin, other.nlin, other.sid)

    @property
    def sample_id(self):
        """The ``(dataset_id, shard_id, sample_idx)`` triple the record was born from."""
        return (self.sid[0], self.sid[1], self.sid[2])

    @property
    def lineage(self):
        """The path through fan-out: one child index per split, outermost first."""
        return tuple([self.lin[i] for i in range(self.nlin)])

    @property
    def base_offset(self):
        """``(chunk_id, chunk_offset)``: the slot in the chunk table this record belongs to."""
        return (self.chunk_id, self.chunk_offset)

    @property
    def sort_key(self):
        """``(chunk_id, chunk_offset, lineage, sample_id)``, the order cursors compare in."""
        return (self.chunk_id, self.chunk_offset, self.lineage, self.sample_id)

    @property
    def stable_hash(self):
        """A 64-bit hash of all four fields that is the same in every process and on every machine."""
        return self.hashval

    def child(self, child_idx):
        """The same cursor with ``child_idx`` appended to the lineage."""
        cdef offset_t idx = _as_field(child_idx, "child_idx")
        cdef SampleCursor c = SampleCursor.__new__(SampleCursor)
        c.chunk_id = self.chunk_id
        c.chunk_offset = self.chunk_offset
        memcpy(c.sid, self.sid, 3 * sizeof(offset_t))
        c.lin = <offset_t*>PyMem_Malloc((self.nlin + 1) * sizeof(offset_t))
        if c.lin == NULL:
            raise MemoryError()
        if self.nlin:
            memcpy(c.lin, self.lin, self.nlin * sizeof(offset_t))
        c.lin[self.nlin] = idx
        c.nlin = self.nlin + 1
        c._rehash()
        return c

    def __richcmp__(self, other, int op):
        if not isinstance(other, SampleCursor):
            return NotImplemented
        cdef int c = self.cmp(<SampleCursor>other)
        if op == 0:
            return c < 0
        if op == 1:
            return c <= 0
        if op == 2:
            return c == 0
        if op == 3:
            return c != 0
        if op == 4:
            return c > 0
        return c >= 0

    def __hash__(self):
        cdef Py_hash_t h = <Py_hash_t>(self.hashval >> 1)  # never -1, which CPython reserves
        return h

    def __reduce__(self):
        return (SampleCursor, (self.chunk_id, self.chunk_offset, self.sample_id, self.lineage))

    def __repr__(self):
        lineage = f", lineage={self.lineage!r}" if self.nlin else ""
        return f"SampleCursor({self.chunk_id}, {self.chunk_offset}, {self.sample_id!r}{lineage})"


cdef SampleCursor make_cursor(offset_t chunk_id, offset_t chunk_offset,
                              offset_t dataset_id, offset_t shard_id, offset_t sample_idx):
    """A root cursor (empty lineage) without argument parsing, for the hot paths of fetch."""
    cdef offset_t sid[3]
    sid[0] = dataset_id
    sid[1] = shard_id
    sid[2] = sample_idx
    return hashed_root_cursor(chunk_id, chunk_offset, sid, root_hash(chunk_id, chunk_offset, sid))


cdef SampleCursor hashed_root_cursor(offset_t chunk_id, offset_t chunk_offset,
                                     const offset_t* sid, uint64_t hashval):
    """``make_cursor`` for a caller that has its ``root_hash`` already (delivery books a run)."""
    cdef SampleCursor c = SampleCursor.__new__(SampleCursor)
    c.chunk_id = chunk_id
    c.chunk_offset = chunk_offset
    c.sid[0] = sid[0]
    c.sid[1] = sid[1]
    c.sid[2] = sid[2]
    c.nlin = 0
    c.hashval = hashval
    return c


def cursors_for_chunk(chunk_id, const offset_t[:, :] pointers, first_offset=0):
    """Root cursors for rows ``first_offset..`` of a chunk's ``(n, 3)`` int64 pointer array."""
    cdef offset_t cid = _as_field(chunk_id, "chunk_id")
    cdef offset_t first = _as_field(first_offset, "first_offset")
    if pointers.shape[1] != 3:
        raise ValueError(f"pointers must have shape (n, 3), got (n, {pointers.shape[1]})")
    cdef Py_ssize_t i, n = pointers.shape[0]
    if n and first > <offset_t>0x7FFFFFFFFFFFFFFF - (n - 1):
        raise ValueError(f"first_offset {first} + {n} rows overflows signed 64-bit chunk offsets")
    cdef list out = [None] * n
    for i in range(n):
        if pointers[i, 0] < 0 or pointers[i, 1] < 0 or pointers[i, 2] < 0:
            raise ValueError(f"pointer row {i} of chunk {cid} has a negative field")
        out[i] = make_cursor(cid, first + i, pointers[i, 0], pointers[i, 1], pointers[i, 2])
    return out


cdef struct _Key:
    offset_t chunk_id
    offset_t chunk_offset
    const offset_t* lin
    Py_ssize_t nlin
    const offset_t* sid
    Py_ssize_t index


cdef int _key_cmp(const void* a, const void* b) noexcept nogil:
    cdef const _Key* x = <const _Key*>a
    cdef const _Key* y = <const _Key*>b
    cdef int c = _cmp_fields(x.chunk_id, x.chunk_offset, x.lin, x.nlin, x.sid,
                             y.chunk_id, y.chunk_offset, y.lin, y.nlin, y.sid)
    if c:
        return c
    return _cmp_i64(x.index, y.index)  # equal cursors keep their input order: a stable sort


def argsort_cursors(cursors):
    """Indices that sort a sequence of cursors (stable), computed in C without Python compares."""
    cdef list items = list(cursors)
    cdef Py_ssize_t i, n = len(items)
    cdef _Key* keys = <_Key*>PyMem_Malloc(max(n, 1) * sizeof(_Key))
    if keys == NULL:
        raise MemoryError()
    cdef SampleCursor c
    cdef cnp.ndarray[cnp.int64_t, ndim=1] order = np.empty(n, dtype=np.int64)
    try:
        for i in range(n):
            obj = items[i]
            if not isinstance(obj, SampleCursor):
                raise TypeError(f"item {i} is not a SampleCursor: {obj!r}")
            c = <SampleCursor>obj
            keys[i].chunk_id = c.chunk_id
            keys[i].chunk_offset = c.chunk_offset
            keys[i].lin = c.lin
            keys[i].nlin = c.nlin
            keys[i].sid = c.sid
            keys[i].index = i
        with nogil:
            qsort(keys, n, sizeof(_Key), _key_cmp)
        for i in range(n):
            order[i] = keys[i].index
    finally:
        PyMem_Free(keys)
    return order


def sort_cursors(cursors):
    """A new list of the cursors in sort-key order; same result as ``sorted`` but done in C."""
    cdef list items = list(cursors)
    cdef const cnp.int64_t[:] order = argsort_cursors(items)
    cdef Py_ssize_t i, n = len(items)
    cdef list out = [None] * n
    for i in range(n):  # a typed gather: iterating the numpy array would box every index
        out[i] = items[order[i]]
    return out


def digest_cursors(cursors):
    """Order-independent digest: the sum of stable hashes modulo 2**64."""
    cdef uint64_t total = 0
    cdef SampleCursor c
    for obj in cursors:
        c = <SampleCursor?>obj
        total += c.hashval
    return total
