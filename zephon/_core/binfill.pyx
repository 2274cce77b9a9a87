"""Bin-fill kernels: where each sequence goes when packing into fixed-capacity bins.

The packers do placement only; they never see tokens. Each ``add`` returns placement rows
``(item, frag_start, frag_len, bin_id, bin_offset)`` and the ids of the bins that left the packer,
and ``zephon._core.packfill.BinFill`` copies tokens by those rows. Both packers stream: bins stay
open across ``add`` calls until they are full, are pushed out to make room, or are flushed.

A packer belongs to one lane, but calls from several threads are safe: every method that reads or
changes a packer's state holds the packer's lock from its first read to its last write, GIL-free
placement included, so concurrent calls run one after the other. A thread waits for the lock
without the GIL, so the holder can always finish.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.pythread cimport (
    PyThread_allocate_lock,
    PyThread_free_lock,
)
from zephon._core._ints cimport checked_int
from zephon._core._lock cimport drop_lock, take_lock
from libc.stdint cimport INT64_MAX
from libc.string cimport memmove

import operator

import numpy as np

cdef extern from "Python.h":
    const Py_ssize_t PY_SSIZE_T_MAX

# Placement rows of one call may not exceed this many; keeps the row-count arithmetic and the
# (rows, 5) int64 allocation size clear of overflow. Far beyond any memory a machine has.
cdef Py_ssize_t _MAX_ROWS = PY_SSIZE_T_MAX // 64


cdef offset_t _as_count(object value, str owner, str name) except? -1:
    """A positive int64 from an integer-like value, or an error naming the argument."""
    return <offset_t>checked_int(value, owner, name, 1, INT64_MAX)


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


cdef inline Py_ssize_t _first_with_room(const OpenBin* bins, Py_ssize_t n,
                                        offset_t r) noexcept nogil:
    # Bins sorted by (room, bin_id): the first with room >= r is the tightest fit, lowest id on ties.
    cdef Py_ssize_t lo = 0, hi = n, mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if bins[mid].room < r:
            lo = mid + 1
        else:
            hi = mid
    return lo


cdef inline void _sift_down(OpenBin* bins, Py_ssize_t p) noexcept nogil:
    # bins[p].room just shrank: move it left to keep the (room, bin_id) order.
    cdef OpenBin moved = bins[p]
    cdef Py_ssize_t lo = 0, hi = p, mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if bins[mid].room < moved.room or (
            bins[mid].room == moved.room and bins[mid].bin_id < moved.bin_id
        ):
            lo = mid + 1
        else:
            hi = mid
    if lo < p:
        memmove(bins + lo + 1, bins + lo, (p - lo) * sizeof(OpenBin))
        bins[lo] = moved


cdef inline offset_t _head_outside(const offset_t[:, :] no_cut, Py_ssize_t span, Py_ssize_t item,
                                   offset_t start, offset_t head) noexcept nogil:
    # The head of item ``item`` from ``start`` cut at most ``head`` long whose cut falls strictly
    # inside none of the item's ``(lo, hi)`` rows of ``no_cut`` (from row ``span`` on): moved back
    # to the ``lo`` of the row it falls in (0 or less: no head can be cut).
    cdef offset_t at = start + head
    while span < no_cut.shape[0] and no_cut[span, 0] == item:
        if no_cut[span, 1] < at < no_cut[span, 2]:
            return no_cut[span, 1] - start
        span += 1
    return head


_NO_SPANS = np.empty((0, 3), dtype=np.int64)


cdef object _no_cut_rows(object no_cut, Py_ssize_t n_items):
    """``no_cut`` as an int64 ``(m, 3)`` array of ``(item, lo, hi)`` rows sorted by item then
    ``lo`` with ``lo < hi`` and items in ``[0, n_items)``; ValueError naming a bad row."""
    if no_cut is None:
        return _NO_SPANS
    rows = np.asarray(no_cut)
    if rows.dtype != np.int64 or rows.ndim != 2 or rows.shape[1] != 3:
        raise ValueError(
            f"BinPacker.add: no_cut must be an int64 (m, 3) array of (item, lo, hi) rows, got "
            f"{rows.dtype} {rows.shape}"
        )
    if len(rows):
        items, lo, hi = rows[:, 0], rows[:, 1], rows[:, 2]
        bad = (items < 0) | (items >= n_items) | (lo >= hi)
        last = len(rows) - 1  # no negative index: this module is compiled without wraparound
        bad[1:] |= (items[1:] < items[:last]) | ((items[1:] == items[:last]) & (lo[1:] < hi[:last]))
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"BinPacker.add: no_cut row {k} {rows[k].tolist()} is not an (item, lo, hi) range "
                f"with lo < hi, sorted by item then lo without overlaps, of an item in "
                f"0..{n_items - 1}"
            )
    return rows


cdef class BinPacker:
    """Online best-fit or first-fit packing of sequences into at most ``max_open_bins`` open bins.

    A sequence longer than ``capacity`` first fills whole bins of its own with all its whole
    ``capacity``-token fragments; the rest (if any) goes to the tightest open bin that fits
    (``"best_fit"``) or the lowest-id one that fits (``"first_fit"``). When nothing fits and the
    limit is reached, the fullest open bin leaves. With ``cut_to_fill``, that bin is first filled
    with the head of the sequence (so it leaves full), and the rest goes where it fits best among
    the bins that hold no piece of a cut sequence (else to a new bin): a bin takes at most one such
    piece; ``add(..., no_cut=)`` keeps such a head cut out of given ranges of an item. A bin that becomes exactly full leaves at once, and so does one that holds
    ``max_segments`` non-empty fragments (when given; an empty item is no sequence and joins a
    bin without counting). Invariant: no bin ever holds more than ``capacity`` tokens or more
    than ``max_segments`` non-empty fragments, every bin id (0, 1, 2, ... in opening order)
    leaves exactly once, and fragments in a bin sit back to back from offset 0.
    """

    def __cinit__(self, capacity, max_open_bins, strategy="best_fit", cut_to_fill=False,
                  max_segments=None):
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
        if not isinstance(cut_to_fill, bool):
            raise TypeError(f"BinPacker cut_to_fill must be a bool, got {cut_to_fill!r}")
        self._cut_to_fill = cut_to_fill
        self._max_segments = (
            0 if max_segments is None else _as_count(max_segments, "BinPacker", "max_segments")
        )
        self._max_open = <Py_ssize_t>max_open
        self._bins = <OpenBin*>PyMem_Malloc(self._max_open * sizeof(OpenBin))
        if self._bins == NULL:
            raise MemoryError(f"BinPacker cannot allocate {self._max_open} open bins")
        self._n_open = 0
        self._next_id = 0
        self._lock = PyThread_allocate_lock()
        if self._lock == NULL:
            raise MemoryError("BinPacker cannot allocate its lock")
        self._owner = 0

    def __dealloc__(self):
        PyMem_Free(self._bins)
        if self._lock != NULL:
            PyThread_free_lock(self._lock)

    def __repr__(self):
        return (
            f"BinPacker(capacity={self._capacity}, max_open_bins={self._max_open}, "
            f"strategy={self.strategy!r}, cut_to_fill={self.cut_to_fill}, "
            f"max_segments={self.max_segments}, n_open={self._n_open})"
        )

    @property
    def max_segments(self):
        """Fragments after which a bin leaves, or None for no cap."""
        return self._max_segments or None

    @property
    def cut_to_fill(self):
        """Whether a sequence that fits nowhere fills the fullest bin's rest before it leaves."""
        return bool(self._cut_to_fill)

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
        self._enter()
        try:
            return self._open_ids()
        finally:
            self._exit()

    cdef object _open_ids(self):
        out = np.empty(self._n_open, dtype=np.int64)
        cdef offset_t[::1] view = out
        cdef Py_ssize_t k
        for k in range(self._n_open):
            view[k] = self._bins[k].bin_id
        if self._strategy == BEST_FIT:
            out.sort()
        return out

    def used(self, bin_id):
        """Tokens placed so far in the open bin ``bin_id``; KeyError if that bin is not open."""
        cdef offset_t b = operator.index(bin_id)
        cdef Py_ssize_t k
        self._enter()
        try:
            for k in range(self._n_open):
                if self._bins[k].bin_id == b:
                    return self._capacity - self._bins[k].room
        finally:
            self._exit()
        raise KeyError(f"bin {bin_id} is not open in this BinPacker")

    cdef void _close_at(self, Py_ssize_t k) noexcept nogil:
        # Shift the tail down so the open bins stay compact and in order.
        cdef Py_ssize_t tail = self._n_open - k - 1
        if tail > 0:
            memmove(self._bins + k, self._bins + k + 1, tail * sizeof(OpenBin))
        self._n_open -= 1

    cdef Py_ssize_t _fullest_uncut(self) noexcept nogil:
        """Index of the fullest open bin holding no piece of a cut sequence (lowest id on ties),
        or -1."""
        cdef Py_ssize_t p, k = -1
        for p in range(self._n_open):
            if self._bins[p].cut:
                continue
            if self._strategy == BEST_FIT:
                return p  # sorted by (room, bin_id): the first uncut bin is the one
            if k < 0 or self._bins[p].room < self._bins[k].room:
                k = p
        return k

    cdef Py_ssize_t _place(self, const offset_t[:] lengths, const offset_t[:, :] no_cut,
                           offset_t* rows, offset_t* closed,
                           Py_ssize_t* n_rows_out) noexcept nogil:
        """Place every item of ``lengths``; write its rows (their count to ``n_rows_out``) and
        closed bin ids; return the count of closed ids. ``rows`` must hold ``_bin_rows(lengths)``
        rows, and one more per item with ``cut_to_fill`` (lengths checked >= 0). ``no_cut``:
        ``(item, lo, hi)`` rows sorted by item then ``lo`` (checked), where a head cut may not
        fall strictly inside ``(lo, hi)``."""
        cdef offset_t cap = self._capacity
        cdef OpenBin* bins = self._bins
        cdef bint best_fit = self._strategy == BEST_FIT
        cdef bint cut
        cdef Py_ssize_t i, k, p, n_closed = 0, n_rows = 0, span = 0
        cdef Py_ssize_t n_spans = no_cut.shape[0]
        cdef offset_t length, start, r, bin_id, head
        for i in range(lengths.shape[0]):
            length = lengths[i]
            start = 0
            cut = False
            if length > cap:
                # A long item: every whole capacity-sized fragment fills a new bin of its own,
                # which is full at once; only the remainder (if any) is placed like any item.
                while length - start >= cap:
                    bin_id = self._next_id
                    self._next_id += 1
                    _put(rows, i, start, cap, bin_id, 0)
                    rows += PLACEMENT_COLUMNS
                    n_rows += 1
                    closed[n_closed] = bin_id
                    n_closed += 1
                    start += cap
                if start == length:
                    continue
            r = length - start
            if best_fit:
                p = _first_with_room(bins, self._n_open, r)
            else:
                p = 0
                while p < self._n_open and bins[p].room < r:
                    p += 1
            if p == self._n_open and self._n_open == self._max_open and self._cut_to_fill:
                # Fill the rest of the bin that would leave with the head of this item: it
                # leaves full (or up to a no-cut range the cut would fall in), and the tail (a
                # piece of a cut sequence) is placed as usual.
                k = self._fullest_uncut()
                head = 0
                if k >= 0:
                    head = bins[k].room
                    while span < n_spans and no_cut[span, 0] < i:
                        span += 1
                    head = _head_outside(no_cut, span, i, start, head)
                if head > 0:
                    _put(rows, i, start, head, bins[k].bin_id, cap - bins[k].room)
                    rows += PLACEMENT_COLUMNS
                    n_rows += 1
                    start += head
                    r = length - start
                    closed[n_closed] = bins[k].bin_id
                    n_closed += 1
                    self._close_at(k)
                    cut = True
                    # the tail goes to a bin that holds no other piece of a cut item
                    if best_fit:
                        p = _first_with_room(bins, self._n_open, r)
                        while p < self._n_open and bins[p].cut:
                            p += 1
                    else:
                        p = 0
                        while p < self._n_open and (bins[p].room < r or bins[p].cut):
                            p += 1
            if p == self._n_open:  # nothing fits
                if self._n_open == self._max_open:
                    # The fullest bin (lowest id on ties) leaves to make room. Best-fit keeps it
                    # first; first-fit keeps id order, so find it.
                    k = 0
                    if not best_fit:
                        for p in range(1, self._n_open):
                            if bins[p].room < bins[k].room:
                                k = p
                    closed[n_closed] = bins[k].bin_id
                    n_closed += 1
                    self._close_at(k)
                # A new bin has the largest room and the largest id: its place is the end in
                # either order.
                p = self._n_open
                bins[p].bin_id = self._next_id
                bins[p].room = cap
                bins[p].cut = 0
                bins[p].segments = 0
                self._next_id += 1
                self._n_open += 1
            _put(rows, i, start, r, bins[p].bin_id, cap - bins[p].room)
            rows += PLACEMENT_COLUMNS
            n_rows += 1
            if cut:
                bins[p].cut = 1
            bins[p].room -= r
            if r:  # an empty item is no sequence: it never closes a bin by count
                bins[p].segments += 1
            if bins[p].room == 0 or (
                self._max_segments and bins[p].segments == self._max_segments
            ):
                closed[n_closed] = bins[p].bin_id
                n_closed += 1
                self._close_at(p)
            elif best_fit and r > 0:
                _sift_down(bins, p)
        n_rows_out[0] = n_rows
        return n_closed

    def add(self, const offset_t[:] lengths not None, no_cut=None):
        """Place sequences of the given lengths, in order.

        Returns ``(placements, closed_bins)``: an int64 ``(k, 5)`` array of rows
        ``(item, frag_start, frag_len, bin_id, bin_offset)`` in placement order, and the int64 ids
        of the bins that left during this call, in the order they left. Nothing changes if a length
        is negative (ValueError naming its index).

        ``no_cut`` (with ``cut_to_fill``): int64 ``(item, lo, hi)`` rows, sorted by item then
        ``lo``, the ranges of item positions a head cut may not fall strictly inside (an image's
        token span): such a head ends at ``lo`` instead, and when that leaves no head the item is
        not cut (the bin leaves as it would without ``cut_to_fill``). Whole-capacity fragments of
        an item longer than ``capacity`` are cut at capacity whatever it says.
        """
        cdef Py_ssize_t bad = -1, n_rows, n_closed, written = 0
        cdef offset_t[:, ::1] rows_view
        cdef offset_t[::1] closed_view
        cdef const offset_t[:, :] spans = _no_cut_rows(no_cut, lengths.shape[0])
        self._enter()
        try:
            with nogil:
                n_rows = _bin_rows(lengths, self._capacity, &bad)
            if n_rows < 0:
                _raise_bad(n_rows, bad, lengths, "BinPacker")
            if n_rows == 0:
                return np.empty((0, PLACEMENT_COLUMNS), dtype=np.int64), np.empty(0, dtype=np.int64)
            if self._cut_to_fill:  # at most one head cut per item
                if lengths.shape[0] > _MAX_ROWS - n_rows:
                    raise MemoryError("BinPacker.add: too many fragments to place")
                n_rows += lengths.shape[0]
            placements = np.empty((n_rows, PLACEMENT_COLUMNS), dtype=np.int64)
            # Every bin that leaves was open at the start or opened by one of these rows; the
            # lock keeps _n_open what it is here until placement is done.
            closed = np.empty(n_rows + self._n_open, dtype=np.int64)
            rows_view = placements
            closed_view = closed
            with nogil:
                n_closed = self._place(
                    lengths, spans, &rows_view[0, 0], &closed_view[0], &written
                )
        finally:
            self._exit()
        if written < n_rows:
            placements = placements[:written].copy()
        return placements, closed[:n_closed].copy()

    def state(self):
        """The open bins and the next bin id as plain data: ``{"next_id", "bins": ((bin_id,
        room, cut), ...)}`` (``(bin_id, room, cut, segments)`` with ``max_segments``) in the
        packer's own order (what ``restore`` takes back, as tuples or as the lists JSON makes of
        them). Tuples, because a pipeline takes this state every few dozen samples and keeps it
        until the next: the cycle collector stops tracking a tuple of ints the first time it
        meets one, and walks a list until it is freed."""
        cdef Py_ssize_t k
        self._enter()
        try:
            # The fragment count only with a cap: states of uncapped packers stay as they were.
            bins = tuple([
                (self._bins[k].bin_id, self._bins[k].room, self._bins[k].cut)
                + ((self._bins[k].segments,) if self._max_segments else ())
                for k in range(self._n_open)
            ])
            return {"next_id": self._next_id, "bins": bins}
        finally:
            self._exit()

    def restore(self, state):
        """Take back what ``state()`` gave; ValueError (nothing changed) for a state this packer
        could not have been in."""
        try:
            next_id = operator.index(state["next_id"])
            bins = [[operator.index(v) for v in b] for b in state["bins"]]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"BinPacker.restore: not a packer state ({exc})") from None
        if len(bins) > self._max_open or next_id < 0:
            raise ValueError(f"BinPacker.restore: {len(bins)} open bins, next id {next_id}")
        columns = 4 if self._max_segments else 3
        for k, b in enumerate(bins):
            if len(b) != columns or not 0 <= b[0] < next_id or not 1 <= b[1] <= self._capacity:
                raise ValueError(f"BinPacker.restore: bin {b!r} does not fit this packer")
            if b[2] not in (0, 1):
                raise ValueError(f"BinPacker.restore: bin {b!r} has a bad cut flag")
            if columns == 4 and not 0 <= b[3] < self._max_segments:
                raise ValueError(f"BinPacker.restore: bin {b!r} has a bad fragment count")
            if k and (
                (b[1], b[0]) <= (bins[k - 1][1], bins[k - 1][0])
                if self._strategy == BEST_FIT
                else b[0] <= bins[k - 1][0]
            ):
                raise ValueError("BinPacker.restore: the open bins are out of order")
        self._enter()
        try:
            for k, b in enumerate(bins):
                self._bins[k].bin_id = b[0]
                self._bins[k].room = b[1]
                self._bins[k].cut = b[2]
                self._bins[k].segments = b[3] if columns == 4 else 0
            self._n_open = len(bins)
            self._next_id = next_id
        finally:
            self._exit()

    def flush(self):
        """Close every open bin; return their ids in ascending order as an int64 array."""
        self._enter()
        try:
            out = self._open_ids()
            self._n_open = 0
        finally:
            self._exit()
        return out

    def reset(self):
        """Drop all open bins without reporting them; bin ids start again at 0."""
        self._enter()
        self._n_open = 0
        self._next_id = 0
        self._exit()

    cdef int _enter(self) except -1:
        return take_lock(self._lock, &self._owner, "BinPacker")

    cdef void _exit(self) noexcept:
        drop_lock(self._lock, &self._owner)


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
        self._lock = PyThread_allocate_lock()
        if self._lock == NULL:
            raise MemoryError("FlatPacker cannot allocate its lock")
        self._owner = 0

    def __dealloc__(self):
        if self._lock != NULL:
            PyThread_free_lock(self._lock)

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
        cdef offset_t open_id = self._bin_id  # one read: the id is either open or not
        if open_id < 0:
            return np.empty(0, dtype=np.int64)
        return np.array([open_id], dtype=np.int64)

    def used(self, bin_id):
        """Tokens placed so far in the open bin ``bin_id``; KeyError if that bin is not open."""
        cdef offset_t b = operator.index(bin_id)
        cdef offset_t used = -1
        self._enter()  # the id and its fill must be read together
        if self._bin_id >= 0 and b == self._bin_id:
            used = self._used
        self._exit()
        if used < 0:
            raise KeyError(f"bin {bin_id} is not open in this FlatPacker")
        return used

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
        cdef offset_t[:, ::1] rows_view
        cdef offset_t[::1] closed_view
        cdef offset_t* closed_ptr = NULL
        self._enter()
        try:
            # Sized from the open bin's fill under the lock, so no other call can change it
            # before placement writes exactly these rows.
            with nogil:
                n_rows = _flat_rows(lengths, self._capacity, self._used, &n_closed, &bad)
            if n_rows < 0:
                _raise_bad(n_rows, bad, lengths, "FlatPacker")
            placements = np.empty((n_rows, PLACEMENT_COLUMNS), dtype=np.int64)
            closed = np.empty(n_closed, dtype=np.int64)
            if n_rows == 0:
                return placements, closed
            rows_view = placements
            closed_view = closed
            if n_closed:
                closed_ptr = &closed_view[0]
            with nogil:
                self._place(lengths, &rows_view[0, 0], closed_ptr)
        finally:
            self._exit()
        return placements, closed

    def state(self):
        """The open bin and the next bin id as plain data: ``{"next_id", "bin_id", "used"}``
        (``bin_id`` -1 when no bin is open; what ``restore`` takes back)."""
        self._enter()
        try:
            return {"next_id": self._next_id, "bin_id": self._bin_id, "used": self._used}
        finally:
            self._exit()

    def restore(self, state):
        """Take back what ``state()`` gave; ValueError (nothing changed) for a state this packer
        could not have been in."""
        try:
            next_id = operator.index(state["next_id"])
            bin_id = operator.index(state["bin_id"])
            used = operator.index(state["used"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"FlatPacker.restore: not a packer state ({exc})") from None
        ok = (bin_id == -1 and used == 0 and next_id >= 0) or (
            0 <= bin_id < next_id and 0 <= used < self._capacity
        )
        if not ok:
            raise ValueError(f"FlatPacker.restore: {state!r} does not fit this packer")
        self._enter()
        self._next_id = next_id
        self._bin_id = bin_id
        self._used = used
        self._exit()

    def flush(self):
        """Close the partial bin, if any; return its id as an int64 array of length 0 or 1."""
        cdef offset_t open_id
        self._enter()
        open_id = self._bin_id
        self._bin_id = -1
        self._used = 0
        self._exit()
        if open_id < 0:
            return np.empty(0, dtype=np.int64)
        return np.array([open_id], dtype=np.int64)

    def reset(self):
        """Drop the open bin without reporting it; bin ids start again at 0."""
        self._enter()
        self._bin_id = -1
        self._used = 0
        self._next_id = 0
        self._exit()

    cdef int _enter(self) except -1:
        return take_lock(self._lock, &self._owner, "FlatPacker")

    cdef void _exit(self) noexcept:
        drop_lock(self._lock, &self._owner)
