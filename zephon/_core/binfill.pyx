"""Bin-fill kernels: where each sequence goes when packing into fixed-capacity bins (SPEC §1.3).

The packers do placement only; they never see tokens. Each ``add`` returns placement rows
``(item, frag_start, frag_len, bin_id, bin_offset)`` and the ids of the bins that left the packer,
and the packing operators copy tokens with numpy from those rows. Both packers stream: bins stay
open across ``add`` calls until they are full, are pushed out to make room, or are flushed.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport INT64_MAX, uint64_t
from libc.string cimport memmove

import operator

import numpy as np

# Placement rows of one call may not exceed this many; keeps the row-count arithmetic and the
# (rows, 5) int64 allocation size clear of overflow. Far beyond any memory a machine has.
cdef Py_ssize_t _MAX_ROWS = (<Py_ssize_t>1 << 58)


cdef offset_t _as_count(object value, str owner, str name) except? -1:
    """A positive int64 from an integer-like value, or an error naming the argument."""
    if isinstance(value, (bool, float)):
        raise TypeError(f"{owner} {name} must be an int, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{owner} {name} must be an int, got {type(value).__name__}") from None
    if v < 1:
        raise ValueError(f"{owner} {name} must be >= 1, got {v}")
    if v > INT64_MAX:
        raise ValueError(f"{owner} {name} must fit in signed 64 bits, got {v}")
    return <offset_t>v


cdef inline void _put(offset_t* row, Py_ssize_t item, offset_t frag_start, offset_t frag_len,
                      offset_t bin_id, offset_t bin_offset) noexcept nogil:
    row[0] = item
    row[1] = frag_start
    row[2] = frag_len
    row[3] = bin_id
    row[4] = bin_offset


cdef Py_ssize_t _bin_rows(const offset_t[:] lengths, offset_t cap,
                          Py_ssize_t* bad) noexcept nogil:
    """Exact number of placement rows BinPacker makes for ``lengths`` (-1: negative, -2: too many).

    An item of length L > 0 becomes ceil(L / cap) fragments; a zero-length item one row.
    """
    cdef Py_ssize_t i, total = 0
    cdef offset_t length, q
    for i in range(lengths.shape[0]):
        length = lengths[i]
        if length < 0:
            bad[0] = i
            return -1
        q = (length // cap + (1 if length % cap else 0)) if length else 1
        if q > _MAX_ROWS - total:
            bad[0] = i
            return -2
        total += q
    return total


cdef Py_ssize_t _flat_rows(const offset_t[:] lengths, offset_t cap, offset_t used,
                           Py_ssize_t* n_closed, Py_ssize_t* bad) noexcept nogil:
    """Exact rows and closed bins FlatPacker makes for ``lengths`` from ``used`` tokens in the bin.

    Item tokens occupy stream positions [u, u + L) of the current bin onwards, so they touch
    ceil((u + L) / cap) bins and fill floor((u + L) / cap) of them; computed without forming u + L.
    """
    cdef Py_ssize_t i, total = 0, closes = 0
    cdef offset_t length, q, m, room, pieces
    for i in range(lengths.shape[0]):
        length = lengths[i]
        if length < 0:
            bad[0] = i
            return -1
        if length == 0:
            pieces = 1
        else:
            q = length // cap
            m = length % cap
            room = cap - used
            if m >= room:           # the tail crosses (or reaches) a bin end
                pieces = q + 1 + (1 if m > room else 0)
                closes += q + 1
                used = m - room
            else:
                pieces = q + (1 if used + m > 0 else 0)
                closes += q
                used = used + m
        if pieces > _MAX_ROWS - total:
            bad[0] = i
            return -2
        total += pieces
    n_closed[0] = closes
    return total


cdef _raise_bad(Py_ssize_t code, Py_ssize_t index, const offset_t[:] lengths, str owner):
    if code == -1:
        raise ValueError(
            f"{owner}.add: lengths[{index}] is {lengths[index]}; sequence lengths must be >= 0"
        )
    raise MemoryError(f"{owner}.add: lengths up to index {index} make too many fragments to place")


cdef class BinPacker:
    """Online best-fit or first-fit packing of sequences into at most ``max_open_bins`` open bins.

    A sequence longer than ``capacity`` first fills whole bins of its own with ``capacity``-token
    fragments; the rest goes to the tightest open bin that fits (``"best_fit"``) or the lowest-id one
    (``"first_fit"``). When nothing fits and the limit is reached, the fullest open bin leaves. A bin
    that becomes exactly full leaves at once. Invariant: no bin ever holds more than ``capacity``
    tokens, every bin id (0, 1, 2, ... in opening order) leaves exactly once, and fragments in a bin
    sit back to back from offset 0.
    """

    def __cinit__(self, capacity, max_open_bins, strategy="best_fit"):
        self._capacity = _as_count(capacity, "BinPacker", "capacity")
        cdef offset_t max_open = _as_count(max_open_bins, "BinPacker", "max_open_bins")
        if strategy == "best_fit":
            self._strategy = BEST_FIT
        elif strategy == "first_fit":
            self._strategy = FIRST_FIT
        else:
            raise ValueError(f"BinPacker strategy must be 'best_fit' or 'first_fit', got {strategy!r}")
        if max_open > _MAX_ROWS:
            raise MemoryError(f"BinPacker max_open_bins={max_open} is too large to allocate")
        self._max_open = <Py_ssize_t>max_open
        self._ids = <offset_t*>PyMem_Malloc(self._max_open * sizeof(offset_t))
        self._room = <offset_t*>PyMem_Malloc(self._max_open * sizeof(offset_t))
        if self._ids == NULL or self._room == NULL:
            raise MemoryError(f"BinPacker cannot allocate {self._max_open} open bins")
        self._n_open = 0
        self._next_id = 0
        self._busy = False

    def __dealloc__(self):
        PyMem_Free(self._ids)
        PyMem_Free(self._room)

    def __repr__(self):
        return (
            f"BinPacker(capacity={self._capacity}, max_open_bins={self._max_open}, "
            f"strategy={self.strategy!r}, n_open={self._n_open})"
        )

    @property
    def capacity(self):
        """Tokens a bin holds."""
        return self._capacity

    @property
    def max_open_bins(self):
        """How many bins may be open at once."""
        return self._max_open

    @property
    def strategy(self):
        """``"best_fit"`` or ``"first_fit"``."""
        return "best_fit" if self._strategy == BEST_FIT else "first_fit"

    @property
    def n_open(self):
        """Number of bins open now."""
        return self._n_open

    def open_bin_ids(self):
        """Ids of the open bins, ascending, as an int64 array."""
        out = np.empty(self._n_open, dtype=np.int64)
        cdef offset_t[::1] view = out
        cdef Py_ssize_t k
        for k in range(self._n_open):
            view[k] = self._ids[k]
        return out

    def used(self, bin_id):
        """Tokens placed so far in the open bin ``bin_id``; KeyError if that bin is not open."""
        cdef offset_t b = operator.index(bin_id)
        cdef Py_ssize_t k
        for k in range(self._n_open):
            if self._ids[k] == b:
                return self._capacity - self._room[k]
        raise KeyError(f"bin {bin_id} is not open in this BinPacker")

    cdef void _close_at(self, Py_ssize_t k) noexcept nogil:
        # Shift the tail down so the open bins stay compact and in ascending id order.
        cdef Py_ssize_t tail = self._n_open - k - 1
        if tail > 0:
            memmove(self._ids + k, self._ids + k + 1, tail * sizeof(offset_t))
            memmove(self._room + k, self._room + k + 1, tail * sizeof(offset_t))
        self._n_open -= 1

    cdef Py_ssize_t _place(self, const offset_t[:] lengths, offset_t* rows,
                           offset_t* closed) noexcept nogil:
        """Place every item of ``lengths``; write its rows and closed bin ids; return the count of
        closed ids. ``rows`` must hold exactly ``_bin_rows(lengths)`` rows (lengths checked >= 0)."""
        cdef offset_t cap = self._capacity
        cdef offset_t* ids = self._ids
        cdef offset_t* room = self._room
        cdef bint best_fit = self._strategy == BEST_FIT
        cdef Py_ssize_t i, k, best, n_closed = 0
        cdef offset_t length, start, r, bin_id
        cdef uint64_t slack, best_slack
        for i in range(lengths.shape[0]):
            length = lengths[i]
            start = 0
            while length - start > cap:  # whole-bin fragments of a long item, full at once
                bin_id = self._next_id
                self._next_id += 1
                _put(rows, i, start, cap, bin_id, 0)
                rows += PLACEMENT_COLUMNS
                closed[n_closed] = bin_id
                n_closed += 1
                start += cap
            r = length - start
            if r == 0 and start > 0:
                continue
            best = -1
            if best_fit:
                # Slack room - r as unsigned: a bin too small wraps to >= 2**63, above any fit,
                # so one min-scan finds the tightest fit; ties keep the lower index (= lower id).
                best_slack = <uint64_t>-1
                for k in range(self._n_open):
                    slack = <uint64_t>(room[k] - r)
                    if slack < best_slack:
                        best_slack = slack
                        best = k
                        if slack == 0:
                            break
                if best >= 0 and best_slack > <uint64_t>INT64_MAX:
                    best = -1
            else:
                for k in range(self._n_open):
                    if room[k] >= r:
                        best = k
                        break
            if best < 0:
                if self._n_open == self._max_open:
                    # Nothing fits and no bin may open: the fullest bin (lowest id on ties) leaves.
                    best = 0
                    for k in range(1, self._n_open):
                        if room[k] < room[best]:
                            best = k
                    closed[n_closed] = ids[best]
                    n_closed += 1
                    self._close_at(best)
                best = self._n_open
                ids[best] = self._next_id
                room[best] = cap
                self._next_id += 1
                self._n_open += 1
            _put(rows, i, start, r, ids[best], cap - room[best])
            rows += PLACEMENT_COLUMNS
            room[best] -= r
            if room[best] == 0:
                closed[n_closed] = ids[best]
                n_closed += 1
                self._close_at(best)
        return n_closed

    def add(self, const offset_t[:] lengths not None):
        """Place sequences of the given lengths, in order.

        Returns ``(placements, closed_bins)``: an int64 ``(k, 5)`` array of rows
        ``(item, frag_start, frag_len, bin_id, bin_offset)`` in placement order, and the int64 ids
        of the bins that left during this call, in the order they left. Nothing changes if a length
        is negative (ValueError naming its index).
        """
        cdef Py_ssize_t bad = -1, n_rows, n_closed
        with nogil:
            n_rows = _bin_rows(lengths, self._capacity, &bad)
        if n_rows < 0:
            _raise_bad(n_rows, bad, lengths, "BinPacker")
        placements = np.empty((n_rows, PLACEMENT_COLUMNS), dtype=np.int64)
        if n_rows == 0:
            return placements, np.empty(0, dtype=np.int64)
        # Every bin that leaves was open at the start or opened by one of these rows.
        closed = np.empty(n_rows + self._n_open, dtype=np.int64)
        cdef offset_t[:, ::1] rows_view = placements
        cdef offset_t[::1] closed_view = closed
        self._enter()
        try:
            with nogil:
                n_closed = self._place(lengths, &rows_view[0, 0], &closed_view[0])
        finally:
            self._busy = False
        return placements, closed[:n_closed].copy()

    def flush(self):
        """Close every open bin; return their ids in ascending order as an int64 array."""
        self._enter()
        out = self.open_bin_ids()
        self._n_open = 0
        self._busy = False
        return out

    def reset(self):
        """Drop all open bins without reporting them; bin ids start again at 0."""
        self._enter()
        self._n_open = 0
        self._next_id = 0
        self._busy = False

    cdef int _enter(self) except -1:
        # add() releases the GIL while it edits the open-bin arrays; a second thread must not
        # edit them at the same time.
        if self._busy:
            raise RuntimeError("BinPacker is in use by another thread; give each lane its own packer")
        self._busy = True
        return 0


cdef class FlatPacker:
    """Concatenate sequences in arrival order and cut the stream every ``capacity`` tokens.

    A sequence may wrap across several bins (one placement row per piece). A bin leaves as soon as it
    is full; ``flush`` hands over the partial last bin. Invariant: at most one bin is open, bin ids
    are 0, 1, 2, ... in stream order, and every bin but a flushed one holds exactly ``capacity``.
    """

    def __cinit__(self, capacity):
        self._capacity = _as_count(capacity, "FlatPacker", "capacity")
        self._next_id = 0
        self._bin_id = -1
        self._used = 0
        self._busy = False

    def __repr__(self):
        return f"FlatPacker(capacity={self._capacity}, n_open={self.n_open})"

    @property
    def capacity(self):
        """Tokens a bin holds."""
        return self._capacity

    @property
    def n_open(self):
        """1 while a partial bin is open, else 0."""
        return 1 if self._bin_id >= 0 else 0

    def open_bin_ids(self):
        """Id of the open bin as an int64 array of length 0 or 1."""
        if self._bin_id < 0:
            return np.empty(0, dtype=np.int64)
        return np.array([self._bin_id], dtype=np.int64)

    def used(self, bin_id):
        """Tokens placed so far in the open bin ``bin_id``; KeyError if that bin is not open."""
        cdef offset_t b = operator.index(bin_id)
        if self._bin_id >= 0 and b == self._bin_id:
            return self._used
        raise KeyError(f"bin {bin_id} is not open in this FlatPacker")

    cdef Py_ssize_t _place(self, const offset_t[:] lengths, offset_t* rows,
                           offset_t* closed) noexcept nogil:
        """Place every item of ``lengths``; return the count of closed ids written to ``closed``."""
        cdef offset_t cap = self._capacity
        cdef Py_ssize_t i, n_closed = 0
        cdef offset_t length, start, take
        for i in range(lengths.shape[0]):
            length = lengths[i]
            start = 0
            while True:
                if self._bin_id < 0:
                    self._bin_id = self._next_id
                    self._next_id += 1
                    self._used = 0
                take = cap - self._used
                if length - start < take:
                    take = length - start
                _put(rows, i, start, take, self._bin_id, self._used)
                rows += PLACEMENT_COLUMNS
                self._used += take
                start += take
                if self._used == cap:
                    closed[n_closed] = self._bin_id
                    n_closed += 1
                    self._bin_id = -1
                    self._used = 0
                if start >= length:
                    break
        return n_closed

    def add(self, const offset_t[:] lengths not None):
        """Append sequences of the given lengths to the stream.

        Returns ``(placements, closed_bins)`` laid out as in ``BinPacker.add``; a zero-length item
        gets a zero-length row in the current bin (opening one if none is open). Nothing changes if
        a length is negative (ValueError naming its index).
        """
        cdef Py_ssize_t bad = -1, n_rows, n_closed = 0
        with nogil:
            n_rows = _flat_rows(lengths, self._capacity, self._used, &n_closed, &bad)
        if n_rows < 0:
            _raise_bad(n_rows, bad, lengths, "FlatPacker")
        placements = np.empty((n_rows, PLACEMENT_COLUMNS), dtype=np.int64)
        closed = np.empty(n_closed, dtype=np.int64)
        if n_rows == 0:
            return placements, closed
        cdef offset_t[:, ::1] rows_view = placements
        cdef offset_t[::1] closed_view = closed
        cdef offset_t* closed_ptr = &closed_view[0] if n_closed else NULL
        self._enter()
        try:
            with nogil:
                self._place(lengths, &rows_view[0, 0], closed_ptr)
        finally:
            self._busy = False
        return placements, closed

    def flush(self):
        """Close the partial bin, if any; return its id as an int64 array of length 0 or 1."""
        self._enter()
        out = self.open_bin_ids()
        self._bin_id = -1
        self._used = 0
        self._busy = False
        return out

    def reset(self):
        """Drop the open bin without reporting it; bin ids start again at 0."""
        self._enter()
        self._bin_id = -1
        self._used = 0
        self._next_id = 0
        self._busy = False

    cdef int _enter(self) except -1:
        if self._busy:
            raise RuntimeError("FlatPacker is in use by another thread; give each lane its own packer")
        self._busy = True
        return 0
