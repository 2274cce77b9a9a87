# Layouts of the compiled delivery bookkeeping, published for cimport.
cimport cython

from zephon._core._types cimport offset_t, uint64_t
from zephon._core.chunk_table cimport ChunkTable
from zephon._core.cursor cimport SampleCursor
from zephon._core.records cimport RecordRun, SampleMeta, SampleRecord


# One entry of a lane's replay window: what it delivered from one chunk (monotone) or epoch.
cdef struct WindowEntry:
    offset_t unit          # chunk id (monotone path) or epoch (epoch path)
    offset_t count         # real records delivered
    uint64_t digest        # sum of their cursors' stable hashes, modulo 2**64


@cython.final
cdef class DeliveryCounters:
    cdef public offset_t delivered
    cdef public offset_t tombstones
    cdef public offset_t evicted
    cdef public dict mix_samples        # component -> delivered samples
    cdef public dict mix_tokens         # component -> delivered tokens
    cdef public frozenset counted_tags  # tombstone tags operators want counted
    cdef public dict tag_counts         # tag -> delivered tombstones carrying it;
                                        # heritage_key(tag, kind, component) -> what they carried
    cdef object _run_component          # plain records counted but not yet in mix_samples
    cdef offset_t _run_n

    cdef int _flush(self) except -1
    cpdef count_delivered(self, SampleMeta meta)
    cdef int _count_component(self, object comp) except -1
    cdef int count_plain(self, list components, Py_ssize_t start, Py_ssize_t stop) except -1
    cdef int count_dataset_ids(self, const offset_t* rows, Py_ssize_t n) except -1
    cdef int count_run_tokens(self, RecordRun run) except -1
    cpdef count_tombstone(self, SampleMeta meta)
    cdef int _count_heritage(self, object tag, str kind, object counts) except -1


@cython.final
cdef class DeliveryBook:
    cdef readonly ChunkTable table
    cdef readonly bint monotone
    cdef readonly DeliveryCounters counters
    cdef public SampleCursor last_cursor     # the replay cursor: last real record delivered
    cdef public offset_t epochs_done         # epoch path: epochs whose marker was processed
    cdef readonly list violations            # broken contracts, as plain tuples, in order
    cdef readonly set partial                # epoch path: offsets with a part delivered
    cdef Py_ssize_t _prune_at                # ``partial`` is pruned of closed offsets past this
    cdef dict _parts                         # epoch path: split samples with a part not booked
    cdef offset_t _low_chunk                 # monotone: chunk of the watermark
    cdef WindowEntry* _window
    cdef Py_ssize_t _wlen
    cdef Py_ssize_t _wcap

    cdef int _window_add(self, offset_t unit, offset_t count, uint64_t digest) except -1
    cdef void _window_drop_through(self, offset_t unit) noexcept
    cdef int _evict_prefix(self) except -1
    cdef int _prune_partial(self) except -1
    cdef int _count_part(self, SampleCursor c, bint last) except -1
    cdef int _record(self, SampleRecord rec, bint count) except -1
    cdef int _record_run(self, RecordRun run, bint count) except -1
    cdef int _tombstone(self, SampleRecord tomb, bint count) except -1


cpdef object hand_over_run(list buf, Py_ssize_t pos, Py_ssize_t batch_size, object collate,
                           DeliveryBook book)
