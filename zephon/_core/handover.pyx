"""The loader's step, compiled: one batch (or, without a batcher, one record) handed to the
training loop in the usual case without a Python frame.

A loader runs one step per batch. In the usual case the step is short: take the loader's lock,
pick the next lane, hand over the head of the run at that lane's feed position (collate, book,
wrap; ``delivery.hand_over_run``), look at two flags, release the lock. Written in Python that
took about as long as booking the batch itself, so the state those steps read lives in the
compiled bases below; the runtime's classes derive from them and keep every other case (the
first step, a refill, a pending batch, control items, tombstones, the end, errors) in Python.
A pipeline without a batcher runs one step per record, the record at the feed position booked
the same way.

What the step calls back is declared here, as methods a subclass defines (each refuses by name
until it does), and, for the objects it is handed, as the protocols of ``handover.pyi``
(``HandoverBook``, ``ViolationReport``), so that a type checker holds the runtime's classes to
them.
"""

from cpython.pythread cimport PyThread_allocate_lock, PyThread_free_lock

from zephon._core._lock cimport drop_lock, take_lock
from zephon._core.delivery cimport DeliveryBook, hand_over_run
from zephon._core.records cimport RecordRun, SampleRecord

from zephon._core.delivery import CollateFailed

NO_LIMIT = (1 << 62) - 1  # a lane's ``limit`` when it runs to its end


cdef object _undefined(object obj, str name):
    return NotImplementedError(
        f"{type(obj).__name__} must define {name}(), which the compiled hand-over calls"
    )


cdef class FeedBuffer:
    """The item list a lane's feed is delivering (``buf``) and the position in it (``pos``)."""

    def __cinit__(self):
        self.buf = []

    cpdef object head(self):
        """The item at ``pos`` (which must be in ``buf``); a run there is first put back as its
        records, one item each, and its first record is the head."""
        cdef list buf = self.buf
        item = buf[self.pos]
        if type(item) is RecordRun:
            records = (<RecordRun>item).records()
            buf[self.pos : self.pos + 1] = records
            item = records[0]
        return item


cdef class PendingBatch:
    """A lane's pending batch: ``n_pending`` real records wait in ``pending`` for ``batch_size``;
    ``collate`` makes the batch's payload, and ``collate_failed`` (a subclass's) the error for a
    collate that raised."""

    def __cinit__(self):
        self.pending = []

    def collate_failed(self, records, exc):
        """The error to raise for a collate of ``records`` that raised ``exc``."""
        raise _undefined(self, "collate_failed")


cdef class LaneOutlet:
    """One lane's delivery: its ``feed`` (a ``FeedBuffer``), its ``batcher`` (a ``PendingBatch``
    or None) and its ``book`` (a ``HandoverBook``: its ``book`` attribute is the lane's current
    ``DeliveryBook``). ``hand_over_head()`` is the usual step; everything else is the subclass's
    ``next_delivery()``. A lane that has handed over ``limit`` items hands over nothing more."""

    def __cinit__(self, *args, **kwargs):
        self.limit = NO_LIMIT

    def next_delivery(self):
        """The lane's next item when ``hand_over_head()`` had none; None once the lane is done."""
        raise _undefined(self, "next_delivery")

    cpdef object hand_over_head(self):
        """The usual hand-over: when the lane is running, nothing is pending and the feed position
        holds a run at least a batch long, its head as the next batch, collated and booked
        (``hand_over_run``); otherwise None, having done nothing. A collate that fails is an
        ``OperatorError`` naming the batch's first record, with nothing booked. A lane without a
        batcher hands over the real record at the feed position (``_hand_over_record``)."""
        cdef FeedBuffer feed = self.feed
        cdef PendingBatch batcher = self.batcher
        if (self.ended or self.replay is not None or feed is None or feed.pos >= len(feed.buf)
                or self.delivered >= self.limit):
            return None
        if batcher is None:
            return self._hand_over_record(feed)
        if batcher.n_pending:
            return None
        cdef DeliveryBook book = <DeliveryBook?>self.book.book
        try:
            done = hand_over_run(feed.buf, feed.pos, batcher.batch_size, batcher.collate, book)
        except CollateFailed as exc:
            cause = exc.__cause__
            raise self.batcher.collate_failed(exc.records, cause) from cause
        except (KeyError, ValueError, IndexError) as exc:
            raise self.book.invented(None, exc) from None
        if done is None:
            return None
        feed.pos = (<tuple>done)[0]
        self.restored_state = None
        self.delivered += 1
        return (<tuple>done)[1]

    cdef object _hand_over_record(self, FeedBuffer feed):
        """Without a batcher: the real record at the feed position (``FeedBuffer.head``), booked,
        as the next item. None for anything else (a tombstone, a control item), having done
        nothing."""
        item = feed.head()
        if type(item) is not SampleRecord or (<SampleRecord>item).meta.is_tombstone:
            return None
        cdef DeliveryBook book = <DeliveryBook?>self.book.book
        try:
            book._record(<SampleRecord>item, True)
        except (KeyError, ValueError, IndexError) as exc:
            raise self.book.invented(item, exc) from None
        feed.pos += 1
        self.restored_state = None
        self.delivered += 1
        return item


# A signal handler runs in the main thread between two bytecodes, and so possibly in the middle
# of a step: there the loader's bookkeeping is half way from one item to the next.
_CALLED_AGAIN = (
    "the loader was called again from inside one of its own calls on this thread (by a signal "
    "handler that ran while next() was working, or by code a step runs): in the middle of a "
    "step the loader has no state a run could resume from. In a signal handler, set a flag, and "
    "call state_dict() in the training loop once next() has returned"
)


cdef class StepLock:
    """The loader's lock: one step, or one look at its state, at a time. ``with lock:`` from
    Python; the compiled step takes it without a method call (a ``threading.Lock``'s methods,
    called from the step, cost about 700 instructions a step: a tenth of a record's when records
    go out one by one). A thread that takes it again while holding it gets a ``RuntimeError``,
    not a hang."""

    def __cinit__(self):
        self._handle = PyThread_allocate_lock()
        if self._handle == NULL:
            raise MemoryError("could not allocate the loader's lock")

    def __dealloc__(self):
        if self._handle != NULL:
            PyThread_free_lock(self._handle)

    cdef int take(self) except -1:
        return take_lock(self._handle, &self._owner, "the loader", _CALLED_AGAIN)

    cdef void drop(self) noexcept:
        drop_lock(self._handle, &self._owner)

    def locked(self):
        """Whether a thread holds it."""
        return self._owner != 0

    def __enter__(self):
        self.take()
        return self

    def __exit__(self, *exc):
        self.drop()


cdef class LoaderStep:
    """The loader's ``__next__``: a round over its ``lanes`` (``LaneOutlet``s) from
    ``next_lane`` under ``_lock``, until one delivers. A loader that has not started, has failed
    or was closed goes through ``_start_or_refuse()`` first; a lane's contract violations go to
    ``policy`` (a ``ViolationReport``), a chunk it announced to ``_note_inflight()``, an error to
    ``_fail(exc)``, and the end of the stream to ``_release_source()``: a subclass defines those.
    ``steps`` counts the items handed over.
    """

    def __cinit__(self):
        self.lanes = []
        self._lock = StepLock()

    def _start_or_refuse(self):
        """Before a step of a loader not started, failed or closed: start it, or raise."""
        raise _undefined(self, "_start_or_refuse")

    def _note_inflight(self):
        """A lane announced a chunk: the lanes may hold more chunks than before."""
        raise _undefined(self, "_note_inflight")

    def _fail(self, exc):
        """The step raised ``exc`` (raised again afterwards): the loader has failed."""
        raise _undefined(self, "_fail")

    def _release_source(self):
        """Every lane has ended: the loader reads its source no more."""
        raise _undefined(self, "_release_source")

    def __next__(self):
        cdef StepLock lock = self._lock
        lock.take()
        try:
            if self._failure is not None or self._closed or not self._started:
                self._start_or_refuse()
            out = self._round()
            self.steps += 1
            return out
        finally:
            lock.drop()

    cdef object _round(self):
        cdef list lanes = self.lanes
        cdef Py_ssize_t n = len(lanes), i
        cdef LaneOutlet lane
        try:
            for i in range(n):  # one full round at most: each lane delivers or has ended
                lane = <LaneOutlet?>lanes[self.next_lane]
                out = lane.hand_over_head()
                if out is None:  # anything but the usual step: the lane's own next_delivery()
                    out = lane.next_delivery()
                self.next_lane = (self.next_lane + 1) % n
                book = lane.book
                if book.found:
                    self.policy.report(book.take_violations())
                if book.opened:  # the lanes hold more chunks only after an announcement
                    book.opened = False
                    self._note_inflight()
                if out is not None:
                    return out
        except BaseException as exc:
            self._fail(exc)
            raise
        self._release_source()  # the stream is over
        raise StopIteration
