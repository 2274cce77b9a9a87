# Layouts of the bin-fill packers, published for cimport by the packing operators.
from cpython.pythread cimport PyThread_type_lock

from zephon._core._types cimport offset_t

# Strategy codes of BinPacker._strategy.
cdef enum:
    BEST_FIT = 0
    FIRST_FIT = 1

# Columns of one placement row: (item, frag_start, frag_len, bin_id, bin_offset).
cdef enum:
    PLACEMENT_COLUMNS = 5


# One open bin of a BinPacker.
ctypedef struct OpenBin:
    offset_t room                  # remaining space; always >= 1 while the bin is open
    offset_t bin_id
    offset_t cut                   # 1 once the bin holds a piece of a cut sequence (cut_to_fill)
    offset_t segments              # fragments placed in it (counted against max_segments)


cdef class BinPacker:
    cdef offset_t _capacity
    cdef Py_ssize_t _max_open      # open-bin limit; the length of _bins
    cdef int _strategy             # BEST_FIT or FIRST_FIT
    cdef bint _cut_to_fill         # a sequence that fits nowhere may fill the fullest bin's rest
    cdef offset_t _max_segments    # a bin leaves once it holds this many fragments (0: no cap)
    cdef offset_t _next_id         # id the next opened bin gets
    cdef Py_ssize_t _n_open
    # Open bins as a compact array. best_fit keeps it sorted by (room, bin_id): the tightest fit is
    # a binary search and the fullest bin is first. first_fit keeps it in bin-id order: the first
    # bin with room is the lowest id. Either way a new bin (most room, highest id) goes at the end.
    cdef OpenBin* _bins
    # Held by every method that reads or changes the open bins, GIL-free sections included;
    # _owner is the holding thread's ident, 0 when free.
    cdef PyThread_type_lock _lock
    cdef long _owner

    cdef int _enter(self) except -1
    cdef void _exit(self) noexcept
    cdef object _open_ids(self)
    cdef void _close_at(self, Py_ssize_t k) noexcept nogil
    cdef Py_ssize_t _fullest_uncut(self) noexcept nogil
    cdef Py_ssize_t _place(self, const offset_t[:] lengths, const offset_t[:, :] no_cut,
                           offset_t* rows, offset_t* closed,
                           Py_ssize_t* n_rows_out) noexcept nogil


cdef class FlatPacker:
    cdef offset_t _capacity
    cdef offset_t _next_id         # id the next opened bin gets
    cdef offset_t _bin_id          # the open bin, or -1 when none is open
    cdef offset_t _used            # tokens in the open bin (0 when none is open)
    # As in BinPacker: held by every method that reads or changes the state.
    cdef PyThread_type_lock _lock
    cdef long _owner

    cdef int _enter(self) except -1
    cdef void _exit(self) noexcept

    cdef Py_ssize_t _place(self, const offset_t[:] lengths, offset_t* rows,
                           offset_t* closed) noexcept nogil
