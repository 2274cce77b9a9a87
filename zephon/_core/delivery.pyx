"""Delivery bookkeeping, compiled: what every record handed to the training loop does to its
lane's chunk table, replay window and counters.

This runs once per delivered record, so it lives in C: closing contributors in the chunk table,
the monotone watermark and eviction, the replay window (count and digest of delivered cursors)
and the run's counters. Whole runs of records go through at once (`DeliveryBook.deliver`).
Nothing here calls back into Python: broken contracts are appended to `DeliveryBook.violations`
as plain tuples, in stream order, for the caller to report after the call.
"""

import json as _json

cimport cython
from cpython.dict cimport PyDict_GetItem, PyDict_SetItem
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.ref cimport PyObject
from libc.stdlib cimport free, realloc

from zephon._core._types cimport offset_t, uint64_t
from zephon._core.chunk_table cimport OFFSET_CLOSED, OFFSET_EVICTED, OFFSET_OPEN, ChunkTable
from zephon._core.cursor cimport (
    SampleCursor,
    hashed_root_cursor,
    root_cmp,
    root_hash,
)
from zephon._core.records cimport (
    ContributorRef,
    RecordRun,
    SampleMeta,
    SampleRecord,
    run_batch,
)


def heritage_key(tag, kind, component):
    """The ``tag_counts`` key of a counted tag's heritage: the JSON text of ``[tag, kind,
    component]`` -- a str, so it survives states that are not JSON round-tripped as well as those
    that are, and job merges."""
    return _json.dumps([tag, kind, component], separators=(",", ":"))


def parse_heritage_key(key):
    """``(tag, kind, component)`` of a ``heritage_key``, or None for any other key."""
    if type(key) is not str or not key.startswith("["):
        return None
    try:
        value = _json.loads(key)
    except ValueError:
        return None
    if type(value) is not list or len(value) != 3 or value[1] not in ("tokens", "samples"):
        return None
    return value[0], value[1], value[2]


cdef inline int _add_count(dict totals, object key, object n) except -1:
    """``totals[key] = totals.get(key, 0) + n`` without the method lookups."""
    cdef PyObject* old = PyDict_GetItem(totals, key)
    if old == NULL:
        PyDict_SetItem(totals, key, n)
    else:
        PyDict_SetItem(totals, key, <object>old + n)
    return 0


cdef inline bint _is_int(object obj, offset_t value) except -1:
    """``obj`` is an ``int`` (not a bool) equal to ``value``."""
    cdef int overflow = 0
    if type(obj) is not int:
        return False
    return PyLong_AsLongLongAndOverflow(obj, &overflow) == value and not overflow


@cython.final
cdef class DeliveryCounters:
    """The run's delivery counters, shared by the lanes of one loader (what ``stats()`` reports).

    Per-component sample counts of plain records are gathered in runs of one component and added
    to ``mix_samples`` when the component changes; ``flush()`` adds the open run, and readers of
    ``mix_samples`` call it first. Insertion order of components is kept.
    """

    def __cinit__(self):
        self.mix_samples = {}
        self.mix_tokens = {}
        self.counted_tags = frozenset()
        self.tag_counts = {}
        self._run_component = None
        self._run_n = 0

    cdef int _flush(self) except -1:
        if self._run_n:
            _add_count(self.mix_samples, self._run_component, self._run_n)
            self._run_n = 0
            self._run_component = None
        return 0

    def flush(self):
        """Add the open run of plain records to ``mix_samples``."""
        self._flush()

    cpdef count_delivered(self, SampleMeta meta):
        """A real record reached the training loop: the delivered count and mixture totals."""
        self.delivered += 1
        tokens = meta.component_token_counts
        if tokens:
            for comp, n in tokens.items():
                _add_count(self.mix_tokens, comp, n)
        samples = meta.component_sample_counts
        if samples:
            self._flush()
            for comp, n in samples.items():
                _add_count(self.mix_samples, comp, n)
        else:
            self._count_component(meta.component)

    cdef int _count_component(self, object comp) except -1:
        # A plain record of ``comp``: the open run goes on, or one of ``comp`` starts.
        if self._run_n and comp is not self._run_component:
            self._flush()
        self._run_component = comp
        self._run_n += 1
        return 0

    cdef int count_plain(self, list components, Py_ssize_t start, Py_ssize_t stop) except -1:
        """``count_delivered`` for plain records (no mixture counts) of
        ``components[start:stop]``."""
        cdef Py_ssize_t i
        self.delivered += stop - start
        for i in range(start, stop):
            self._count_component(components[i])
        return 0

    cdef int count_dataset_ids(self, const offset_t* rows, Py_ssize_t n) except -1:
        """``count_plain`` for records whose component is their dataset id: ``rows[3 * i]``."""
        cdef Py_ssize_t i, start = 0
        cdef offset_t d, current = rows[0]
        self.delivered += n
        if self._run_n and not _is_int(self._run_component, current):
            self._flush()
        if not self._run_n:
            self._run_component = current
        for i in range(1, n):  # a run of one component is counted at its end
            d = rows[3 * i]
            if d != current:
                self._run_n += i - start
                self._flush()
                self._run_component = current = d
                start = i
        self._run_n += n - start
        return 0

    cdef int count_run_tokens(self, RecordRun run) except -1:
        """``mix_tokens`` of a counted run's records (``RecordRun.token_counts``), added once
        per stretch of one component: the totals ``count_delivered`` gives record by record."""
        cdef Py_ssize_t i, n = run.n
        cdef const offset_t* t = run._t + run._lo
        cdef const offset_t* p = run._p
        cdef list comps = run._components
        cdef offset_t total = 0, current
        if n == 0:
            return 0
        if comps is None:  # each record's component is its dataset id
            current = p[0]
            for i in range(n):
                if p[3 * i] != current:
                    _add_count(self.mix_tokens, current, total)
                    current, total = p[3 * i], 0
                total += t[i]
            _add_count(self.mix_tokens, current, total)
            return 0
        comp = comps[run._lo]
        for i in range(n):
            c = comps[run._lo + i]
            if c is not comp and c != comp:
                _add_count(self.mix_tokens, comp, total)
                comp, total = c, 0
            total += t[i]
        _add_count(self.mix_tokens, comp, total)
        return 0

    cpdef count_tombstone(self, SampleMeta meta):
        """A tombstone was delivered; its counted tags are counted per tag. A counted tombstone
        that carries mixture heritage (what the record it stands for held) also adds it up per
        component, under ``heritage_key(tag, "tokens", component)`` and ``heritage_key(tag,
        "samples", component)``, for components named by a str or an int."""
        self.tombstones += 1
        if self.counted_tags and meta.tags:
            for tag in meta.tags:
                if tag in self.counted_tags:
                    _add_count(self.tag_counts, tag, 1)
                    if meta.component_token_counts:
                        self._count_heritage(tag, "tokens", meta.component_token_counts)
                    if meta.component_sample_counts:
                        self._count_heritage(tag, "samples", meta.component_sample_counts)

    cdef int _count_heritage(self, object tag, str kind, object counts) except -1:
        for comp, n in counts.items():
            if isinstance(comp, (str, int)) and not isinstance(comp, bool):
                _add_count(self.tag_counts, heritage_key(tag, kind, comp), n)
        return 0


# Partly delivered samples the delivery book remembers before it forgets the closed ones.
cdef Py_ssize_t PARTIAL_PRUNE_AT = 4096


@cython.final
cdef class DeliveryBook:
    """The bookkeeping of one lane's delivery: its chunk table, watermark, replay window, counters.

    Invariants: offsets close only through delivered records and tombstones (and the watermark on
    the monotone path); the window holds one ``(unit, count, digest)`` entry per chunk (monotone)
    or epoch (epoch path) with delivered records that is still retained, so it never grows with
    the length of the run. A broken contract appends ``("early-close", record, contributor_cursor,
    state)`` or ``("order", cursor, previous_cursor)`` to ``violations``.
    """

    def __cinit__(self):
        self._window = NULL
        self._wlen = 0
        self._wcap = 0

    def __init__(
        self,
        ChunkTable table not None,
        bint monotone,
        DeliveryCounters counters not None,
        bint track_partial=True,
    ):
        self.table = table
        self.monotone = monotone
        self.counters = counters
        self.violations = []
        # Only a lane whose checkpoints keep what it consumed by position asks for these.
        self.partial = set() if track_partial and not monotone else None
        self._parts = {}
        self._prune_at = PARTIAL_PRUNE_AT
        self.last_cursor = None
        self.epochs_done = 0
        self._low_chunk = -1

    def __dealloc__(self):
        free(self._window)
        self._window = NULL

    # ---- the replay window ----------------------------------------------------------------------

    cdef int _window_add(self, offset_t unit, offset_t count, uint64_t digest) except -1:
        cdef WindowEntry* w
        if self._wlen and self._window[self._wlen - 1].unit == unit:
            w = &self._window[self._wlen - 1]
            w.count += count
            w.digest += digest  # modulo 2**64, like the checkpoint's digest
            return 0
        if self._wlen == self._wcap:
            w = <WindowEntry*>realloc(self._window, (self._wcap * 2 + 4) * sizeof(WindowEntry))
            if w == NULL:
                raise MemoryError("cannot grow the replay window")
            self._window = w
            self._wcap = self._wcap * 2 + 4
        w = &self._window[self._wlen]
        w.unit = unit
        w.count = count
        w.digest = digest
        self._wlen += 1
        return 0

    cdef void _window_drop_through(self, offset_t unit) noexcept:
        cdef Py_ssize_t k = 0, i
        while k < self._wlen and self._window[k].unit <= unit:
            k += 1
        if k:
            for i in range(k, self._wlen):
                self._window[i - k] = self._window[i]
            self._wlen -= k

    def window_push(self, offset_t unit, offset_t count, uint64_t digest):
        """Add ``count`` deliveries with cursor digest ``digest`` to the window entry of ``unit``
        (what a restore re-enters for records skipped at the source)."""
        self._window_add(unit, count, digest)

    def window_clear(self):
        """Empty the window (a new epoch starts the retained window afresh)."""
        self._wlen = 0

    def window_totals(self):
        """``(count, digest)`` of what the lane delivered in its retained window."""
        cdef offset_t count = 0
        cdef uint64_t digest = 0
        cdef Py_ssize_t i
        for i in range(self._wlen):
            count += self._window[i].count
            digest += self._window[i].digest
        return count, digest

    @property
    def window_len(self):
        """Entries in the window (chunks or epochs with delivered records still retained)."""
        return self._wlen

    # ---- eviction --------------------------------------------------------------------------------

    def note_evicted(self, chunk_ids):
        """Chunks left the table (evicted by the caller): count them and, on the monotone path,
        drop their window entries."""
        cdef Py_ssize_t n = len(chunk_ids)
        if n:
            self.counters.evicted += n
            if self.monotone:
                self._window_drop_through(chunk_ids[n - 1])

    cdef int _evict_prefix(self) except -1:
        cdef Py_ssize_t k = self.table.c_evict_complete_prefix()
        if k:
            self.counters.evicted += k
            self._window_drop_through(self.table._last_evicted_id)
        return 0

    cdef int _prune_partial(self) except -1:
        # Samples split over records close with their last part: forget those closed since, so
        # that the set holds about what is in flight, never what an epoch split (amortized: the
        # next pruning waits until the set has doubled).
        cdef ChunkTable table = self.table
        self.partial = {
            key
            for key in self.partial
            if table.c_offset_state(key[0], key[1]) == OFFSET_OPEN or key in self._parts
        }
        self._prune_at = max(PARTIAL_PRUNE_AT, 2 * len(self.partial))
        return 0

    cdef int _count_part(self, SampleCursor c, bint last) except -1:
        # A part of a sample split over several records, booked (delivered, swallowed or
        # dropped). Its last part closes the sample, but behind a reordering operator an earlier
        # part can still wait in it (a packer's open bin): until every part is booked the sample
        # stays partly delivered. The last part of a one-level split tells how many there are
        # (its lineage index + 1); a deeper split is counted partly delivered to its epoch's end.
        key = (c.chunk_id, c.chunk_offset)
        entry = self._parts.get(key)
        if entry is None:
            entry = self._parts[key] = [0, 0, False]  # parts booked, parts in all, deeper split
        entry[0] += 1
        if c.nlin != 1:
            entry[2] = True
        if last:
            entry[1] = c.lin[c.nlin - 1] + 1
        if entry[1] and not entry[2] and entry[0] >= entry[1]:
            del self._parts[key]
            self.partial.discard(key)
        else:
            self.partial.add(key)
            if len(self.partial) > self._prune_at:
                self._prune_partial()
        return 0

    def unfinished(self):
        """The ``(chunk_id, chunk_offset)`` of the split samples of which some part is booked
        and some is not, closed or open (epoch path; empty elsewhere)."""
        return set(self._parts)

    def clear_partial(self):
        """Forget the partly delivered samples: an epoch marker, everything before it booked."""
        if self.partial is not None:
            self.partial.clear()
        self._parts.clear()

    def restore_partial(self, keys):
        """Samples a checkpoint said were partly delivered. Their parts are counted from here:
        a part booked before a snapshot is not booked again, so such a sample stays partly
        delivered until as many parts as it has are booked here (never too early)."""
        if self.partial is None:
            return
        for key in keys:
            self.partial.add(key)
            self._parts.setdefault(key, [0, 0, False])

    # ---- records and tombstones ------------------------------------------------------------------

    cdef int _record(self, SampleRecord rec, bint count) except -1:
        cdef SampleMeta meta = rec.meta
        cdef SampleCursor cursor = meta.cursor, c
        cdef SampleCursor last
        cdef ChunkTable table = self.table
        cdef ContributorRef ref
        cdef offset_t low_chunk, low_offset
        cdef int state
        if meta.contributors is None:
            state = table.c_close(cursor.chunk_id, cursor.chunk_offset)
            if state == OFFSET_CLOSED or state == OFFSET_EVICTED:
                self.violations.append(("early-close", rec, cursor, state))
            low_chunk = cursor.chunk_id
            low_offset = cursor.chunk_offset
        else:
            low_chunk = low_offset = -1
            for obj in <tuple>meta.contributors:
                ref = <ContributorRef>obj
                c = ref.cursor
                if ref.is_last_child:
                    state = table.c_close(c.chunk_id, c.chunk_offset)
                    if self.partial is not None and c.nlin:
                        self._count_part(c, True)
                elif self.monotone:
                    state = table.c_offset_state(c.chunk_id, c.chunk_offset)
                else:
                    # Behind a reordering operator siblings legitimately arrive after the closing
                    # record; eviction waits for the epoch marker, so only evicted chunks matter.
                    state = OFFSET_EVICTED if table._find(c.chunk_id) == -1 else 0
                    # A part of a sample split over several records: what a resume with changed
                    # operators must know (which open samples were partly delivered).
                    if self.partial is not None and c.nlin:
                        self._count_part(c, False)
                    elif self.partial is not None:
                        self.partial.add((c.chunk_id, c.chunk_offset))
                        if len(self.partial) > self._prune_at:
                            self._prune_partial()
                if state == OFFSET_CLOSED or state == OFFSET_EVICTED:
                    self.violations.append(("early-close", rec, c, state))
                if low_chunk < 0 or c.chunk_id < low_chunk or (
                    c.chunk_id == low_chunk and c.chunk_offset < low_offset
                ):
                    low_chunk = c.chunk_id
                    low_offset = c.chunk_offset
        # The window entry goes in before eviction can drop the chunk it belongs to.
        self._window_add(cursor.chunk_id if self.monotone else self.epochs_done, 1, cursor.hashval)
        if self.monotone and low_chunk >= 0:
            last = self.last_cursor
            if last is not None and cursor.cmp(last) < 0:
                self.violations.append(("order", cursor, last))
            table.c_close_below(low_chunk, low_offset)
            if low_chunk != self._low_chunk:
                self._low_chunk = low_chunk
                self._evict_prefix()
        self.last_cursor = cursor
        if count:
            self.counters.count_delivered(meta)
        return 0

    cdef int _record_run(self, RecordRun run, bint count) except -1:
        # What ``_record`` does for each record of the run, from the fields: no record is made
        # unless a violation must name it. The first record goes as in ``_record``. The rest are
        # in its chunk at the offsets after it, in order: each closes its offset and adds its
        # cursor to the window, the watermark moves to the last one, and none can change the
        # watermark's chunk (so none evicts) or break the order.
        cdef Py_ssize_t i, n = run.n
        cdef ChunkTable table = self.table
        cdef offset_t cid = run.chunk_id, off = run.first_offset
        cdef const offset_t* p = run._p
        cdef uint64_t digest = 0, h = 0
        cdef int state
        cdef SampleRecord rec
        cdef SampleCursor last
        if n == 0:
            return 0
        state = table.c_close(cid, off)
        if state == OFFSET_CLOSED or state == OFFSET_EVICTED:
            rec = run.record_at(0)
            self.violations.append(("early-close", rec, rec.meta.cursor, state))
        h = root_hash(cid, off, p)
        self._window_add(cid if self.monotone else self.epochs_done, 1, h)
        if self.monotone:
            last = self.last_cursor
            if last is not None and root_cmp(cid, off, p, last) < 0:
                self.violations.append(("order", run.record_at(0).meta.cursor, last))
            table.c_close_below(cid, off)
            if cid != self._low_chunk:
                self._low_chunk = cid
                self._evict_prefix()
        if count and run._components is None:
            self.counters.count_dataset_ids(p, n)
        elif count:
            self.counters.count_plain(run._components, run._lo, run._lo + n)
        if count and run._t != NULL:
            self.counters.count_run_tokens(run)
        if n == 1:
            self.last_cursor = hashed_root_cursor(cid, off, p, h)
            return 0
        if not table.c_close_span(cid, off + 1, off + n):  # one was closed already: which?
            for i in range(1, n):
                state = table.c_close(cid, off + i)
                if state == OFFSET_CLOSED or state == OFFSET_EVICTED:
                    rec = run.record_at(i)
                    self.violations.append(("early-close", rec, rec.meta.cursor, state))
        # Four hashes per step: each is a chain of dependent multiplies, and four independent
        # chains keep the multiplier busy where one would wait on its own latency.
        i = 1
        while i + 4 <= n:
            h = root_hash(cid, off + i + 3, p + 3 * (i + 3))
            digest += (root_hash(cid, off + i, p + 3 * i)
                       + root_hash(cid, off + i + 1, p + 3 * (i + 1))
                       + root_hash(cid, off + i + 2, p + 3 * (i + 2)) + h)
            i += 4
        while i < n:
            h = root_hash(cid, off + i, p + 3 * i)
            digest += h
            i += 1
        self._window_add(cid if self.monotone else self.epochs_done, n - 1, digest)
        self.last_cursor = hashed_root_cursor(cid, off + n - 1, p + 3 * (n - 1), h)
        if self.monotone:
            table.c_close_below(cid, off + n - 1)
        return 0

    cdef int _tombstone(self, SampleRecord tomb, bint count) except -1:
        # A tombstone only closes offsets: it never moves the replay cursor or evicts by itself.
        cdef SampleMeta meta = tomb.meta
        cdef ContributorRef ref
        cdef SampleCursor c
        if meta.contributors is None:
            self.table.c_close(meta.cursor.chunk_id, meta.cursor.chunk_offset)
        else:
            for obj in <tuple>meta.contributors:
                ref = <ContributorRef>obj
                if ref.is_last_child:
                    self.table.c_close(ref.cursor.chunk_id, ref.cursor.chunk_offset)
                c = ref.cursor
                if self.partial is not None and c.nlin:
                    self._count_part(c, ref.is_last_child)
        if count:
            self.counters.count_tombstone(meta)
        return 0

    def record(self, SampleRecord rec not None, bint count=True):
        """Bookkeeping for a real record handed to the training loop (``count``) or swallowed by
        the replay filter (not counted)."""
        self._record(rec, count)

    def tombstone(self, SampleRecord tomb not None, bint count=True):
        """Close the closing contributors of a delivered (``count``) or swallowed tombstone."""
        self._tombstone(tomb, count)

    def deliver(self, list items not None, Py_ssize_t start=0, Py_ssize_t stop=-1):
        """Bookkeeping for ``items[start:stop]`` handed over, in stream order: real records,
        runs of them and tombstones. Stops before the first item that is none of these and
        returns its index (``stop`` when there is none), so the caller handles control items
        where they are."""
        cdef Py_ssize_t i, n = len(items)
        cdef SampleRecord rec
        if stop < 0 or stop > n:
            stop = n
        for i in range(start, stop):
            item = items[i]
            if type(item) is not SampleRecord:
                if type(item) is RecordRun:
                    self._record_run(<RecordRun>item, True)
                    continue
                return i
            rec = <SampleRecord>item
            if rec.meta.is_tombstone:
                self._tombstone(rec, True)
            else:
                self._record(rec, True)
        return stop


def gather(list buf not None, Py_ssize_t pos, list pending not None, Py_ssize_t n_pending,
           Py_ssize_t batch_size, tuple leave not None):
    """Move items from ``buf[pos:]`` into ``pending`` until it holds ``batch_size`` real records.

    Stops before an item it leaves to the caller: a tombstone or control item while ``pending``
    holds no record (those are booked at once, not held), and an item whose type is in ``leave``
    (the lane's end, the start of a run). A ``RecordRun`` longer than the batch needs is split:
    its head goes to ``pending`` and its tail takes its place in ``buf``. Returns the new
    ``(pos, n_pending)``; nothing is booked here.
    """
    cdef Py_ssize_t n = len(buf), k
    while pos < n and n_pending < batch_size:
        item = buf[pos]
        if type(item) is SampleRecord and not (<SampleRecord>item).meta.is_tombstone:
            pending.append(item)
            n_pending += 1
        elif type(item) is RecordRun:
            k = (<RecordRun>item).n
            if n_pending + k > batch_size:
                head, buf[pos] = (<RecordRun>item).split(batch_size - n_pending)
                pending.append(head)
                return pos, batch_size
            pending.append(item)
            n_pending += k
        elif n_pending and type(item) not in leave:
            pending.append(item)
        else:
            break
        pos += 1
    return pos, n_pending


class CollateFailed(Exception):
    """The collate of a batch raised; ``records`` is the batch, the collate's error the cause."""

    def __init__(self, records):
        super().__init__(records)
        self.records = records


cpdef object hand_over_run(list buf, Py_ssize_t pos, Py_ssize_t batch_size, object collate,
                           DeliveryBook book):
    """The usual hand-over in one call: nothing is pending and ``buf[pos]`` is a run of at least
    ``batch_size`` records. Its first ``batch_size`` records are collated, booked and returned as
    ``(pos, SampleBatch)``, ``buf[pos:]`` then holding the rest. Returns None, having done
    nothing, when the case does not apply. A collate that raises raises ``CollateFailed`` before
    anything is booked or moved; a booking error propagates as ``DeliveryBook.deliver``'s does.
    (Compiled callers call it in C: ``cpdef``.)
    """
    if buf is None or book is None:
        raise TypeError("hand_over_run needs a list and a DeliveryBook, not None")
    if pos >= len(buf) or type(buf[pos]) is not RecordRun:
        return None
    cdef RecordRun run = <RecordRun>buf[pos]
    if run.n < batch_size:
        return None
    cdef RecordRun head = run if run.n == batch_size else run._part(0, batch_size)
    try:
        payload = collate(head)
    except Exception as exc:
        raise CollateFailed(head) from exc
    book._record_run(head, True)
    if head is run:
        pos += 1
    else:
        buf[pos] = run._part(batch_size, run.n)
    return pos, run_batch(head, payload)
