# Layout of the token fill of packed bins, published for cimport.
from cpython.pythread cimport PyThread_type_lock

from zephon._core._types cimport offset_t, token_t

# Rows of a bin's block: tokens, then segment ids, then positions, then one row per side field.
cdef enum:
    BLOCK_ROWS = 3

# Bytes a RowArena holds at most, unless one bin's block alone is larger. It holds a power of two
# of bins (64 of 2,048 tokens in three fields), so that batches of a power of two that start at
# its first row never straddle two arenas.
cdef enum:
    ARENA_BYTES = 2 << 20

# Value types of a side field's row (its 4-byte values are copied as raw bits).
cdef enum:
    SIDE_INT32 = 0
    SIDE_FLOAT32 = 1

# Columns of a placement row, as zephon._core.binfill writes them.
cdef enum:
    ROW_ITEM = 0
    ROW_START = 1
    ROW_SIZE = 2
    ROW_BIN = 3
    ROW_OFFSET = 4
    ROW_COLUMNS = 5

# Columns of a fragment row returned by take(): (frag_start, frag_len, item_len).
cdef enum:
    FRAG_COLUMNS = 3


# An open bin, in BinFill._live (sorted by bin_id, since bins open in id order).
ctypedef struct LiveBin:
    offset_t bin_id
    Py_ssize_t slot


# One fragment of a bin: where it starts in its item, its length, the item's length, and its
# first token in the item's array (which BinFill._sources holds until the bin is taken).
ctypedef struct Frag:
    offset_t start
    offset_t size
    offset_t item_len
    const token_t* src


# The state of one slot. A slot holds an open bin or is free; slots are recycled.
ctypedef struct Slot:
    offset_t used          # tokens placed so far; fragments sit back to back from 0
    Frag* frags            # the bin's fragments in bin order (a buffer kept across reuses)
    const token_t** side_src  # per fragment, n_side pointers: its first value of each side field
    Py_ssize_t n_frags
    Py_ssize_t cap_frags
    bint taken             # scratch flag of take()


# The memory of the blocks that take() hands over: (3 + n_side, rows, seq_len) int32, field by
# field, bins in the order they were taken. Views of it have it as their base: collate knows by
# it that rows taken one after another are back to back and never written again.
cdef class RowArena:
    cdef object array              # the ndarray that owns the memory (never handed out: a view
                                   # of it would not hold the arena, and could see it reused)
    cdef char* data
    cdef Py_ssize_t fields         # rows of each bin's block
    cdef Py_ssize_t rows           # bins it holds
    cdef Py_ssize_t seq_len        # tokens of each row
    cdef Py_ssize_t next_row       # the next bin's row


# The arenas a fill takes rows from, or several fills (a grouped packer's, one per group): the one
# being written and those written to the end that views held when last checked. Fills that share
# them take their rows one after another under its lock, so their arenas do not grow with their
# number.
cdef class RowArenas:
    cdef RowArena current          # where the next rows go (None until the first)
    cdef list retired              # arenas written to the end that views held when last checked
    cdef Py_ssize_t fields         # rows of each bin's block
    cdef Py_ssize_t rows           # bins per arena (see ARENA_BYTES)
    cdef Py_ssize_t seq_len        # tokens of each row
    cdef PyThread_type_lock _lock  # held while a fill takes rows; _owner as in BinFill
    cdef long _owner

    cdef RowArena _arena_for(self)
    cdef Py_ssize_t _held_bytes(self)


cdef class BinFill:
    cdef offset_t _seq_len
    cdef token_t _pad_id
    cdef Py_ssize_t _n_side        # side-field rows after the three base rows
    cdef token_t* _side_pads       # per side field: its padding value's 4 bytes
    cdef int* _side_kinds          # per side field: SIDE_INT32 or SIDE_FLOAT32
    cdef tuple _side_pad_values    # the padding values as given (ints and floats)
    cdef offset_t _max_id          # highest bin id opened since the last clear (-1: none)
    cdef LiveBin* _live            # the open bins, ascending bin id
    cdef Py_ssize_t _n_live
    cdef Py_ssize_t _cap_live
    cdef Slot* _slots
    cdef Py_ssize_t _n_slots       # slots allocated (open + free)
    cdef Py_ssize_t* _free         # stack of free slots
    cdef Py_ssize_t _n_free
    cdef list _sources             # per slot: the arrays its fragments read, or None when free
    cdef RowArenas _arenas         # where take() writes the bins (shared with arenas_of's fill)
    cdef list _records             # per slot: the item of each fragment, in bin order
    # Held by every method that reads or changes the bins, GIL-free copies included; _owner is
    # the holding thread's ident, 0 when free.
    cdef PyThread_type_lock _lock
    cdef long _owner

    cdef int _enter(self) except -1
    cdef void _exit(self) noexcept
    cdef int _reserve(self, Py_ssize_t n_live, Py_ssize_t n_free) except -1
    cdef int _reserve_frags(self, Slot* slot, Py_ssize_t n) except -1
    cdef tuple _held_sides(self, object sides, Py_ssize_t n_items, const offset_t[::1] lengths)
    cdef Py_ssize_t _find(self, offset_t bin_id) noexcept nogil
    cdef void _attach(self, const offset_t[:, ::1] placements, const offset_t[::1] lengths,
                      const size_t[::1] data, const size_t[:, ::1] side_data,
                      const Py_ssize_t[::1] target, const Py_ssize_t[::1] slot_of) noexcept nogil
    cdef void _fill(self, const Slot* slot, token_t* dst, Py_ssize_t stride) noexcept nogil
    cdef tuple _take(self, const offset_t[::1] bin_ids, Py_ssize_t[::1] idx)
