"""The record model: contributors, sample metadata, records and batches.

Compiled because one of each is made per record on the hot path. All four classes are
immutable: their attributes are read-only, and "changing" one means building a new one.
"""

cimport cython

from zephon._core._ints cimport checked_int
from zephon._core._types cimport offset_t
from libc.stdint cimport INT64_MAX
from zephon._core.cursor cimport SampleCursor, make_cursor

import collections.abc as _abc

import numpy as np

cimport numpy as cnp

cnp.import_array()

cdef type _ndarray = np.ndarray

_NO_TAGS = frozenset()


cdef extern from "Python.h":
    int PyObject_GC_IsTracked(object op)
    void PyObject_GC_UnTrack(void* op)


@cython.no_gc
cdef class ContributorRef:
    """A base offset a record stands for, and whether this record is the last one that will."""

    def __init__(self, cursor, is_last_child):
        if not isinstance(cursor, SampleCursor):
            raise TypeError(f"ContributorRef cursor must be a SampleCursor, got {cursor!r}")
        self.cursor = cursor
        self.is_last_child = bool(is_last_child)

    @property
    def base_offset(self):
        """``(chunk_id, chunk_offset)`` of the contributor's cursor."""
        return self.cursor.base_offset

    def __eq__(self, other):
        if not isinstance(other, ContributorRef):
            return NotImplemented
        cdef ContributorRef o = <ContributorRef>other
        return self.is_last_child == o.is_last_child and self.cursor == o.cursor

    def __hash__(self):
        return hash((self.cursor, self.is_last_child))

    def __reduce__(self):
        return (ContributorRef, (self.cursor, self.is_last_child))

    def __repr__(self):
        return f"ContributorRef({self.cursor!r}, is_last_child={bool(self.is_last_child)})"


cdef tuple _as_contributors(object contributors):
    try:
        refs = tuple(contributors)
    except TypeError:
        raise TypeError(
            f"SampleMeta contributors must be None or an iterable of ContributorRef, "
            f"got {contributors!r}"
        ) from None
    for i, ref in enumerate(refs):
        if not isinstance(ref, ContributorRef):
            raise TypeError(f"SampleMeta contributors[{i}] must be a ContributorRef, got {ref!r}")
    return refs


cpdef frozenset as_tags(object tags, str owner):
    """``tags`` as a frozenset of str names, None meaning none; TypeError naming ``owner`` for
    what would lose or mangle names: a mapping (its values), a lone str (split into its
    characters), something not iterable, or a name that is not a str."""
    cdef frozenset out
    if tags is None:
        return _NO_TAGS
    if type(tags) is frozenset:
        out = <frozenset>tags
    elif isinstance(tags, (str, bytes)):
        raise TypeError(
            f"{owner} tags must be a collection of str names, not a lone str or bytes "
            f"({tags!r:.60}); wrap it: tags={{{tags!r:.60}}}"
        )
    elif isinstance(tags, dict) or isinstance(tags, _abc.Mapping):
        raise TypeError(
            f"{owner} tags must be a collection of str names, not a mapping "
            f"({type(tags).__name__}), whose values would be lost; pass its keys if they are "
            "the names"
        )
    else:
        try:
            out = frozenset(tags)
        except TypeError:
            raise TypeError(
                f"{owner} tags must be an iterable of str names, got {tags!r:.60}"
            ) from None
    for tag in out:
        if not isinstance(tag, str):
            raise TypeError(f"{owner} tags must be str names, got {tag!r:.60} among them")
    return out


@cython.freelist(1024)
@cython.no_gc
cdef class SampleMeta:
    """The tracking half of a record: cursor, lane, contributors, tags and mixture heritage.

    ``contributors`` is ``None`` when the record implicitly stands for its own cursor and closes it.
    """

    def __init__(self, cursor, *, lane_id=0, contributors=None, tags=_NO_TAGS,
                 is_tombstone=False, component=None, component_sample_counts=None,
                 component_token_counts=None):
        if not isinstance(cursor, SampleCursor):
            raise TypeError(f"SampleMeta cursor must be a SampleCursor, got {cursor!r}")
        self.cursor = cursor
        self.lane_id = checked_int(lane_id, "SampleMeta", "lane_id", 0, INT64_MAX)
        self.contributors = None if contributors is None else _as_contributors(contributors)
        self.tags = as_tags(tags, "SampleMeta")
        self.is_tombstone = bool(is_tombstone)
        self.component = component
        self.component_sample_counts = component_sample_counts
        self.component_token_counts = component_token_counts

    cpdef tuple contribution_refs(self):
        """The explicit contributors, or ``(ContributorRef(cursor, True),)`` when implicit."""
        if self.contributors is not None:
            return <tuple>self.contributors
        cdef ContributorRef ref = ContributorRef.__new__(ContributorRef)
        ref.cursor = self.cursor
        ref.is_last_child = True
        return (ref,)

    def replace(self, **changes):
        """A copy with some fields changed (keyword names as in the constructor)."""
        fields = self._fields()
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"SampleMeta has no field(s) {sorted(unknown)}")
        fields.update(changes)
        cursor = fields.pop("cursor")
        return SampleMeta(cursor, **fields)

    def _fields(self):
        return {
            "cursor": self.cursor,
            "lane_id": self.lane_id,
            "contributors": self.contributors,
            "tags": self.tags,
            "is_tombstone": bool(self.is_tombstone),
            "component": self.component,
            "component_sample_counts": self.component_sample_counts,
            "component_token_counts": self.component_token_counts,
        }

    def __eq__(self, other):
        if not isinstance(other, SampleMeta):
            return NotImplemented
        return self._fields() == (<SampleMeta>other)._fields()

    __hash__ = None  # the component count dicts are mutable

    def __reduce__(self):
        # Positional state and a rebuild without re-validation: records cross the pipe of every
        # process lane, so this runs once per record there. A root cursor (the usual case) goes
        # as five ints, which pickle far faster than a nested cursor object.
        cdef SampleCursor c = self.cursor
        state = (self.lane_id, self.contributors, self.tags, self.is_tombstone, self.component,
                 self.component_sample_counts, self.component_token_counts)
        if c.nlin == 0:
            return (_root_meta_from_state,
                    (c.chunk_id, c.chunk_offset, c.sid[0], c.sid[1], c.sid[2], *state))
        return (_meta_from_state, (c, *state))

    def __repr__(self):
        extra = "".join(
            f", {k}={v!r}" for k, v in self._fields().items()
            if k != "cursor" and v not in (None, _NO_TAGS, False, 0)
        )
        return f"SampleMeta({self.cursor!r}{extra})"


def _meta_from_state(SampleCursor cursor, offset_t lane_id, contributors, frozenset tags,
                     bint is_tombstone, component, component_sample_counts,
                     component_token_counts):
    """Unpickle a SampleMeta from what ``__reduce__`` saved (a valid meta: no re-validation)."""
    cdef SampleMeta m = SampleMeta.__new__(SampleMeta)
    m.cursor = cursor
    m.lane_id = lane_id
    m.contributors = contributors
    m.tags = tags
    m.is_tombstone = is_tombstone
    m.component = component
    m.component_sample_counts = component_sample_counts
    m.component_token_counts = component_token_counts
    return m


def _root_meta_from_state(offset_t chunk_id, offset_t chunk_offset, offset_t dataset_id,
                          offset_t shard_id, offset_t sample_idx, offset_t lane_id, contributors,
                          frozenset tags, bint is_tombstone, component, component_sample_counts,
                          component_token_counts):
    """Unpickle a SampleMeta whose cursor has no lineage (saved as its five fields)."""
    return _meta_from_state(
        make_cursor(chunk_id, chunk_offset, dataset_id, shard_id, sample_idx), lane_id,
        contributors, tags, is_tombstone, component, component_sample_counts,
        component_token_counts,
    )


def _root_record_from_state(offset_t chunk_id, offset_t chunk_offset, offset_t dataset_id,
                            offset_t shard_id, offset_t sample_idx, offset_t lane_id,
                            contributors, frozenset tags, bint is_tombstone, component,
                            component_sample_counts, component_token_counts, payload):
    """Unpickle a SampleRecord whose cursor has no lineage (meta state saved inline)."""
    return _record_from_state(
        _root_meta_from_state(chunk_id, chunk_offset, dataset_id, shard_id, sample_idx, lane_id,
                              contributors, tags, is_tombstone, component,
                              component_sample_counts, component_token_counts),
        payload,
    )


def _record_from_state(SampleMeta meta, payload):
    """Unpickle a SampleRecord (its meta is already a SampleMeta: no re-validation)."""
    return make_record(meta, payload)


cdef SampleMeta make_meta(SampleCursor cursor, offset_t lane_id, object component):
    """A plain meta (implicit contributor, no tags) without keyword parsing."""
    cdef SampleMeta m = SampleMeta.__new__(SampleMeta)
    m.cursor = cursor
    m.lane_id = lane_id
    m.contributors = None
    m.tags = _NO_TAGS
    m.is_tombstone = False
    m.component = component
    m.component_sample_counts = None
    m.component_token_counts = None
    return m


cdef inline SampleMeta _one_sample(SampleMeta m, object n_tokens):
    # ``m`` counted as one sample of its component, ``n_tokens`` tokens long.
    m.component_sample_counts = {m.component: 1}
    m.component_token_counts = {m.component: n_tokens}
    return m


cpdef SampleMeta counted_meta(SampleMeta meta, object n_tokens):
    """``meta`` for a record that is one sample of its component, ``n_tokens`` tokens long: the
    mixture heritage a tokenizer gives each document it encodes (the rest of ``meta`` kept)."""
    cdef SampleMeta m = SampleMeta.__new__(SampleMeta)
    m.cursor = meta.cursor
    m.lane_id = meta.lane_id
    m.contributors = meta.contributors
    m.tags = meta.tags
    m.is_tombstone = False
    m.component = meta.component
    return _one_sample(m, n_tokens)


cdef inline void _collected_as_its_payload(SampleRecord r):
    """Leaves ``r`` out of the cycle collector when its payload is left out (a dict of strings,
    numbers and arrays is, by CPython itself): its meta is left out already, so nothing it
    holds leads back to it. A pipeline holds thousands of records at once; collected, each would
    be walked by every collection it lives through and then moved to the oldest generation, whose
    full collections would come as often as a few tens of thousands had been made. (A payload
    that gains, later, a container leading back to its own record would leave that cycle to
    reference counting alone, which never frees it: a record never changes its payload, and no
    zephon operator puts a record into a payload.)"""
    if not PyObject_GC_IsTracked(r.payload):
        PyObject_GC_UnTrack(<void*>r)


cdef SampleRecord make_record(SampleMeta meta, object payload):
    """A record of a valid meta, without the constructor's checks."""
    cdef SampleRecord r = SampleRecord.__new__(SampleRecord)
    r.meta = meta
    r.payload = payload
    _collected_as_its_payload(r)
    return r


@cython.freelist(1024)
cdef class SampleRecord:
    """A payload (usually a dict of fields) with its tracking metadata; a tombstone's payload is None."""

    def __init__(self, meta, payload):
        if not isinstance(meta, SampleMeta):
            raise TypeError(f"SampleRecord meta must be a SampleMeta, got {meta!r}")
        self.meta = meta
        self.payload = payload
        _collected_as_its_payload(self)

    @property
    def cursor(self):
        return self.meta.cursor

    @property
    def is_tombstone(self):
        return self.meta.is_tombstone

    def contribution_refs(self):
        return self.meta.contribution_refs()

    def with_payload(self, payload):
        """The same record identity carrying a new payload."""
        return make_record(self.meta, payload)

    def __reduce__(self):
        # One flat reduce per record (meta state inlined) for the pipes of process lanes.
        cdef SampleMeta m = self.meta
        cdef SampleCursor c = m.cursor
        if c.nlin == 0:
            return (_root_record_from_state, (
                c.chunk_id, c.chunk_offset, c.sid[0], c.sid[1], c.sid[2], m.lane_id,
                m.contributors, m.tags, m.is_tombstone, m.component, m.component_sample_counts,
                m.component_token_counts, self.payload,
            ))
        return (_record_from_state, (m, self.payload))

    def __repr__(self):
        if self.meta.is_tombstone:
            return f"SampleRecord(tombstone {self.meta.cursor!r})"
        return f"SampleRecord({self.meta!r}, payload={_short(self.payload)})"


def _short(payload):
    if isinstance(payload, dict):
        return "{" + ", ".join(f"{k!r}: {type(v).__name__}" for k, v in payload.items()) + "}"
    return type(payload).__name__


cdef class SampleBatch:
    """Consecutive records grouped for the training loop; each keeps its own cursor and meta."""

    def __init__(self, records, payload):
        self._records = tuple(records)
        for i, r in enumerate(self._records):
            if not isinstance(r, SampleRecord):
                raise TypeError(f"SampleBatch records[{i}] must be a SampleRecord, got {r!r}")
        self.payload = payload

    @property
    def records(self):
        """The batch's records, in delivery order (a tuple of ``SampleRecord``)."""
        if self._records is None:  # delivered as runs: their records are made when asked for
            self._records = tuple(self._lazy.records())
            self._lazy = None
        return self._records

    def __len__(self):
        if self._records is None:
            return len(self._lazy)
        return len(self._records)

    def __iter__(self):
        return iter(self.records)

    def __getitem__(self, i):
        return self.records[i]

    def __reduce__(self):
        return (SampleBatch, (self.records, self.payload))

    def __repr__(self):
        return f"SampleBatch({len(self.records)} records, payload={_short(self.payload)})"


def records_for_chunk(chunk_id, pointers, list payloads, lane_id, list components,
                      first_offset=0):
    """Root records for rows of a chunk: cursor ``(chunk_id, first_offset + i, pointers[i])``.

    This is what ``fetch`` builds per sample, so it is done here without per-record parsing.
    """
    return RecordRun(chunk_id, pointers, payloads, lane_id, components, first_offset).records()


@cython.final
cdef class RecordRun:
    """Root records of one chunk at consecutive offsets, kept as columns: what ``fetch`` reads.

    Record ``i`` has the cursor ``(chunk_id, first_offset + i, pointers[i])``, lane ``lane_id``,
    payload ``payloads[i]`` and component ``components[i]`` (with ``components=None``, its
    dataset id: ``pointers[i][0]``), and closes its own offset. Nothing per record is built until
    something asks for records (``records()``, indexing, iterating), so operators that only map
    payloads (``Operator.maps_payloads``), batching and delivery bookkeeping go through a run
    without making a record, a meta or a cursor per sample.
    With ``token_counts`` (``counted_run``), record ``i`` is one sample of its component,
    ``token_counts[i]`` tokens long: its meta carries the counts ``counted_meta`` gives.
    It is a read-only ``Sequence`` of ``SampleRecord``; ``split`` shares its columns.
    """

    def __init__(self, chunk_id, pointers, list payloads not None, lane_id, list components,
                 first_offset=0, token_counts=None):
        rows = pointers
        if not (type(rows) is _ndarray and cnp.PyArray_TYPE(<cnp.ndarray>rows) == cnp.NPY_INT64
                and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>rows)):  # a chunk's rows already are
            rows = np.ascontiguousarray(pointers, dtype=np.int64)
        if rows.ndim != 2 or rows.shape[1] != 3:
            raise ValueError(f"pointers must have shape (n, 3), got {rows.shape}")
        cdef Py_ssize_t i, n = rows.shape[0]
        if len(payloads) != n or (components is not None and len(components) != n):
            raise ValueError(
                f"{n} pointers but {len(payloads)} payloads and "
                f"{n if components is None else len(components)} components"
            )
        cdef offset_t cid = chunk_id, first = first_offset, lane = lane_id
        if cid < 0 or first < 0 or lane < 0:
            raise ValueError("chunk_id, first_offset and lane_id must be >= 0")
        cdef const offset_t* p = <const offset_t*>cnp.PyArray_DATA(<cnp.ndarray>rows)
        for i in range(n):
            if p[3 * i] < 0 or p[3 * i + 1] < 0 or p[3 * i + 2] < 0:
                raise ValueError(f"pointer row {i} of chunk {cid} has a negative field")
        self.chunk_id = cid
        self.first_offset = first
        self.lane_id = lane
        self.n = n
        self._payloads = payloads
        self._components = components
        self._lo = 0
        self._pointers = rows
        self._p = p if n else NULL
        if token_counts is not None:
            token_counts = np.array(token_counts, dtype=np.int64)
            if token_counts.shape != (n,):
                raise ValueError(f"{n} records but token_counts of shape {token_counts.shape}")
            if n and token_counts.min() < 0:
                raise ValueError("token_counts must be >= 0")
        self._set_tokens(token_counts)

    cdef void _set_tokens(self, object counts):
        # ``counts``: None, or a C-contiguous int64 array indexed as ``_payloads``.
        self._tokens = counts
        if counts is None:
            self._t = NULL
        else:
            self._t = <const offset_t*>cnp.PyArray_DATA(<cnp.ndarray>counts)

    cdef SampleRecord record_at(self, Py_ssize_t i):
        cdef const offset_t* p = self._p + 3 * i
        cdef SampleMeta m = make_meta(
            make_cursor(self.chunk_id, self.first_offset + i, p[0], p[1], p[2]),
            self.lane_id, p[0] if self._components is None else self._components[self._lo + i],
        )
        if self._t != NULL:  # a counted run: its meta as counted_meta gives it
            _one_sample(m, self._t[self._lo + i])
        return make_record(m, self._payloads[self._lo + i])

    cdef RecordRun _part(self, Py_ssize_t lo, Py_ssize_t hi):
        # Records lo..hi-1 of this run, sharing its columns.
        cdef RecordRun part = RecordRun.__new__(RecordRun)
        part.chunk_id = self.chunk_id
        part.first_offset = self.first_offset + lo
        part.lane_id = self.lane_id
        part.n = hi - lo
        part._payloads = self._payloads
        part._components = self._components
        part._lo = self._lo + lo
        part._pointers = self._pointers
        part._p = self._p + 3 * lo
        part._tokens = self._tokens
        part._t = self._t
        return part

    @property
    def payloads(self):
        """The records' payloads, in order (a new list)."""
        return self._payloads[self._lo : self._lo + self.n]

    @property
    def components(self):
        """The records' mixture components, in order (a new list)."""
        if self._components is None:
            return [self._p[3 * i] for i in range(self.n)]
        return self._components[self._lo : self._lo + self.n]

    def records(self):
        """The run as a list of ``SampleRecord``."""
        cdef Py_ssize_t i
        cdef list out = [None] * self.n
        for i in range(self.n):
            out[i] = self.record_at(i)
        return out

    def with_payloads(self, list payloads not None):
        """The same records carrying ``payloads`` (one per record, in order)."""
        if len(payloads) != self.n:
            raise ValueError(f"{len(payloads)} payloads for a run of {self.n} records")
        cdef RecordRun out = self._part(0, self.n)
        out._payloads = payloads
        out._components = self.components if self._lo and self._components is not None \
            else self._components
        if self._lo and self._tokens is not None:
            out._set_tokens(self.token_counts.copy())
        out._lo = 0
        return out

    def split(self, Py_ssize_t k):
        """``(first k records, the rest)`` as two runs sharing this one's columns;
        ``0 < k < len(self)``."""
        if k <= 0 or k >= self.n:
            raise ValueError(f"a run of {self.n} records splits at 1..{self.n - 1}, not at {k}")
        return self._part(0, k), self._part(k, self.n)

    @property
    def token_counts(self):
        """Each record's length in tokens (int64), for a run whose records are each one
        sample of their component that many tokens long (``counted_run``); else None."""
        if self._tokens is None:
            return None
        return self._tokens[self._lo : self._lo + self.n]

    @property
    def pointers(self):
        """The ``(n, 3)`` pointer rows of the run's records."""
        cdef Py_ssize_t row = 0
        if self._p != NULL:
            row = (self._p - <const offset_t*>cnp.PyArray_DATA(self._pointers)) // 3
        return self._pointers[row : row + self.n]

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        cdef Py_ssize_t i
        if isinstance(index, slice):
            return [self.record_at(i) for i in range(*index.indices(self.n))]
        i = index
        if i < 0:
            i += self.n
        if i < 0 or i >= self.n:
            raise IndexError(f"record {index} of a run of {self.n}")
        return self.record_at(i)

    def __iter__(self):
        return iter(self.records())

    def __reduce__(self):
        comps = None if self._components is None else self.components
        return (RecordRun, (self.chunk_id, self.pointers, self.payloads, self.lane_id, comps,
                            self.first_offset, self.token_counts))

    def __repr__(self):
        return (f"RecordRun(chunk {self.chunk_id}, offsets {self.first_offset}.."
                f"{self.first_offset + self.n - 1}, lane {self.lane_id})")


_abc.Sequence.register(RecordRun)


@cython.final
cdef class JoinedRuns:
    """Runs read one after another, as one read-only ``Sequence`` of their records: what a
    batch that spans several reads hands its collate. As with a single run, nothing per record
    is built until something asks for records; ``payloads`` joins the runs' payload columns."""

    def __init__(self, runs):
        cdef list kept = list(runs)
        cdef Py_ssize_t n = 0
        for i, run in enumerate(kept):
            if type(run) is not RecordRun:
                raise TypeError(f"JoinedRuns item {i} must be a RecordRun, got {run!r:.80}")
            n += (<RecordRun>run).n
        self._runs = kept
        self.n = n

    @property
    def runs(self):
        """The runs, in order (a new list)."""
        return list(self._runs)

    @property
    def payloads(self):
        """The records' payloads, in order (a new list)."""
        cdef list out = []
        cdef RecordRun run
        for r in self._runs:
            run = <RecordRun>r
            out.extend(run._payloads[run._lo : run._lo + run.n])
        return out

    def records(self):
        """The records as a list of ``SampleRecord``."""
        cdef list out = []
        for run in self._runs:
            out.extend((<RecordRun>run).records())
        return out

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        cdef Py_ssize_t i
        if isinstance(index, slice):
            return self.records()[index]
        i = index
        if i < 0:
            i += self.n
        if i < 0 or i >= self.n:
            raise IndexError(f"record {index} of {self.n} joined records")
        for run in self._runs:
            if i < (<RecordRun>run).n:
                return (<RecordRun>run).record_at(i)
            i -= (<RecordRun>run).n

    def __iter__(self):
        return iter(self.records())

    def __reduce__(self):
        return (JoinedRuns, (self._runs,))

    def __repr__(self):
        return f"JoinedRuns({len(self._runs)} runs, {self.n} records)"


_abc.Sequence.register(JoinedRuns)


def counted_run(RecordRun run not None, str field):
    """``run`` with each record counted as one sample of its component, as many tokens long as
    ``len(payload[field])`` is now (``counted_meta``): what ``fetch`` hands on for a
    pre-tokenized source. The counts are a column of the run; no record is made for them."""
    cdef Py_ssize_t i, n = run.n
    counts = np.empty(n, dtype=np.int64)
    cdef offset_t* t = <offset_t*>cnp.PyArray_DATA(<cnp.ndarray>counts)
    cdef list payloads = run._payloads
    for i in range(n):
        t[i] = len(payloads[run._lo + i][field])
    cdef RecordRun out = run.with_payloads(run.payloads)  # its own columns, from index 0
    out._set_tokens(counts)
    return out


def expand_runs(list items):
    """``items`` with every ``RecordRun`` replaced by its records (``items`` itself when it
    holds none): what code that looks at records one by one starts with."""
    cdef Py_ssize_t i, n = len(items)
    for i in range(n):
        if type(items[i]) is RecordRun:
            break
    else:
        return items
    cdef list out = items[:i]
    for j in range(i, n):
        item = items[j]
        if type(item) is RecordRun:
            out.extend((<RecordRun>item).records())
        else:
            out.append(item)
    return out


def count_closing(records):
    """How many closing contributors a list of records (tombstones and runs included) carries."""
    cdef Py_ssize_t total = 0
    cdef SampleRecord rec
    cdef ContributorRef ref
    for obj in records:
        if type(obj) is RecordRun:  # each of its records closes its own offset
            total += (<RecordRun>obj).n
            continue
        rec = <SampleRecord?>obj
        if rec.meta.contributors is None:
            total += 1
        else:
            for r in <tuple>rec.meta.contributors:
                ref = <ContributorRef>r
                total += ref.is_last_child
    return total


def next_control(list items, Py_ssize_t start=0):
    """Index of the first item at or after ``start`` that is not a real record (a tombstone or a
    control item), or ``len(items)``: how the lane runner finds runs of records for an operator."""
    cdef Py_ssize_t i, n = len(items)
    for i in range(start, n):
        obj = items[i]
        if type(obj) is not SampleRecord or (<SampleRecord>obj).meta.is_tombstone:
            return i
    return n


def map_payloads(fn, list records, Py_ssize_t start, list out):
    """Append to ``out`` each of ``records[start:]`` carrying the payload ``fn(record.payload)``
    (same meta), in one C loop: what ``map_transform`` does per record.

    Stops at the first record for which ``fn`` returns None or raises, and returns ``(i, exc)``:
    that record's index (``len(records)`` when every record went through) and the exception
    raised (None when ``fn`` returned None), so the caller can name the record.
    """
    cdef Py_ssize_t i = start, n = len(records)
    cdef SampleRecord rec
    try:
        while i < n:
            rec = <SampleRecord?>records[i]
            payload = fn(rec.payload)
            if payload is None:
                return i, None
            out.append(make_record(rec.meta, payload))
            i += 1
    except Exception as exc:
        return i, exc
    return n, None


def map_run(fn, RecordRun run not None):
    """``[fn(p) for p in run.payloads]`` in one C loop, reading the payloads where they sit in the
    run (a list of them made first would touch every payload once more, out of cache by then):
    what ``map_transform`` does to a run.

    Stops at the first payload for which ``fn`` returns None or raises, and returns
    ``(out, i, exc)``: the new payloads (complete when ``i == len(run)``), that payload's index
    and the exception raised (None when ``fn`` returned None).
    """
    cdef list payloads = run._payloads
    cdef Py_ssize_t i = 0, lo = run._lo, n = run.n
    cdef list out = [None] * n
    try:
        while i < n:
            new = fn(payloads[lo + i])
            if new is None:
                return out, i, None
            out[i] = new
            i += 1
    except Exception as exc:
        return out, i, exc
    return out, n, None


def make_batch(records, payload):
    """A ``SampleBatch`` of ``records`` (real ``SampleRecord``s as delivery gathered them, or
    a ``RecordRun`` or ``JoinedRuns``, whose records are made only if asked for) without the
    constructor's per-record type checks."""
    if type(records) is RecordRun or type(records) is JoinedRuns:
        return run_batch(records, payload)
    cdef SampleBatch b = SampleBatch.__new__(SampleBatch)
    b._records = tuple(<list?>records)
    b.payload = payload
    return b


cdef SampleBatch run_batch(object runs, object payload):
    """The ``SampleBatch`` that is ``runs``, a ``RecordRun`` or ``JoinedRuns`` (its records are
    made only if asked for)."""
    cdef SampleBatch b = SampleBatch.__new__(SampleBatch)
    b._lazy = runs
    b.payload = payload
    return b


def payloads_of(list records):
    """``[record.payload for record in records]`` in one C loop (what collation starts with)."""
    cdef Py_ssize_t i, n = len(records)
    cdef list out = [None] * n
    for i in range(n):
        out[i] = (<SampleRecord?>records[i]).payload
    return out


def cursors_of(list records):
    """``[record.meta.cursor for record in records]`` in one C loop (what a snapshot keeps)."""
    cdef Py_ssize_t i, n = len(records)
    cdef list out = [None] * n
    for i in range(n):
        out[i] = (<SampleRecord?>records[i]).meta.cursor
    return out
