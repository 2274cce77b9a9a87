"""Lane feeds: where a lane's item lists come from, and stopping its worker.

The feed starts the lane's runner where the plan says lanes run (``workers``), holds the item list
being delivered, and adds the lane to any error that comes out of the runner.
"""

from __future__ import annotations

import threading
from time import perf_counter
from typing import TYPE_CHECKING, Any

from zephon._core.handover import FeedBuffer
from zephon.errors import ZephonError
from zephon.plan import Plan
from zephon.runtime.lanes.retire_screen import screen
from zephon.runtime.workers import first_reads
from zephon.runtime.workers.kinds import open_lane, open_lanes
from zephon.runtime.workers.lane import Lane
from zephon.runtime.workers.memory_release import give_back
from zephon.runtime.workers.registry import LaneKind, lane_kind
from zephon.runtime.workers.stopping import close_lanes

if TYPE_CHECKING:
    from zephon.runtime.checkpoint.retired import RetiredIds
    from zephon.runtime.workers.trainer_wait import TrainerWait
    from zephon.sources.base import WorkSource


class LaneFeed(FeedBuffer):
    """The items of lane ``lane_id``, one list at a time (``buf``, read from ``pos``)."""

    def __init__(self, plan: Plan, lane_id: int):
        self.plan = plan
        self.lane_id = lane_id
        self.buf: list[Any] = []
        self.pos = 0
        # Where the runner starts (set on restore, or by a head start); the runner takes it.
        self.start_at: dict[str, Any] = {}
        self.runner: Lane | None = None  # the running lane, of the plan's kind
        self.starting: WorkerStarts | None = None  # set while its worker starts on a thread
        self.read_ahead_lists = 0  # reads ahead made here (``read_ahead``)
        self.closed = False
        self.retired: RetiredIds | None = None  # samples taken out of the run (``retire=``)
        self.waits: TrainerWait | None = None  # the loader's, which times every refill

    def start(self) -> None:
        """Start the lane's runner unless it runs already (or wait for a start under way)."""
        if self.closed:
            raise ZephonError(f"lane {self.lane_id} was closed")
        if self.starting is not None:
            self.starting.wait()
            self.starting = None
        if self.runner is None:
            self.runner = open_lane(self.plan, self.lane_id, **self.start_at)
            self.start_at = {}  # the runner has it (with any records a head start handed over)

    def refill(self) -> None:
        """The next item list from the runner (started on first use). While its worker process
        waits for the fork server, the lane's first lists are read here (``first_reads``)."""
        waits = self.waits
        if waits is None:
            self._refill()
            return
        began = perf_counter()
        try:
            self._refill()
        finally:
            waits.book(perf_counter() - began)

    def _refill(self) -> None:
        starting = self.starting
        if starting is not None and self._reads_on() and starting.claim(self) and self.read_ahead():
            return
        self.start()
        assert self.runner is not None
        try:
            self.buf = next(self.runner)
        except ZephonError as exc:
            raise exc.add_context(lane=self.lane_id) from exc.__cause__
        self.pos = 0
        if self.retired is not None:
            self.buf = screen(self.retired, self.buf)

    def _reads_on(self) -> bool:
        """Whether the loader may read the lane ahead from ``start_at``: a first read, or one
        that goes on in the run the last read ended in, its last (a read that meets the next
        run's start is left to the worker, and what it read would be read there again)."""
        return not self.read_ahead_lists or len(self.start_at.get("runs") or ()) <= 1

    def read_ahead(self) -> bool:
        """Read the lane's next lists in this process (its worker, not yet started, continues
        after them, unless they reached the lane's end); False when nothing was read."""
        whole = False
        try:
            read = first_reads.read_ahead(self.plan, self.lane_id, self.start_at)
            if read is not None:
                (self.buf, after), self.pos = read, 0
                whole = after is None
                self.start_at = {} if after is None else after
                self.read_ahead_lists += 1
                if self.retired is not None:
                    self.buf = screen(self.retired, self.buf)
        except ZephonError as exc:  # its data could not be read (first_reads.read_ahead)
            raise exc.add_context(lane=self.lane_id) from exc.__cause__
        finally:
            assert self.starting is not None
            self.starting.read_over(self, whole=whole)
        return read is not None

    def next_item(self) -> Any:
        """The next item, a run of records coming as its records one by one."""
        if self.pos >= len(self.buf):
            self.refill()
        item = self.head()
        self.pos += 1
        return item

    def queued(self) -> int:
        """Item lists the lane's worker has ready beyond ``buf`` (0 before it starts)."""
        return 0 if self.runner is None or self.closed else self.runner.queued()

    def close(self) -> None:
        """Stop the runner and release what it holds; nothing is delivered from it afterwards."""
        close_feeds([self])


def start_feeds(feeds: list[LaneFeed], first: LaneFeed | None = None) -> None:
    """Start the runners of many lanes at once, sharing the plan's worker processes or threads
    (``kinds.open_lanes``). Where the lane kind says the loader reads first
    (``LaneKind.loader_reads_first``), ``first``, the lane delivered from first, is read in this
    process while the workers start, and so may the others until their workers can
    (``first_reads``)."""
    waiting = [feed for feed in feeds if feed.runner is None and not feed.closed]
    if not waiting:
        return
    plan = waiting[0].plan
    kind = lane_kind(plan.workers)
    # Made once, here, before the loader's reads and the worker starts run side by side.
    shared = kind.shared_for(plan)
    reads_first = kind.loader_reads_first
    if first not in waiting or reads_first is None or not reads_first(plan, len(waiting)):
        _open_runners(plan, waiting, shared)
        return
    starts = WorkerStarts(plan, kind, [first, *(f for f in waiting if f is not first)], shared)
    starts.claim(first)
    try:
        first.read_ahead()
    finally:
        # The workers warm up (the fork server's imports) once the first lane's read is over:
        # they would take a core from that read, and the first batch would wait for them.
        starts.begin()


def _open_runners(plan: Plan, feeds: list[LaneFeed], shared: Any) -> None:
    """Start the runners of ``feeds`` where they start (``start_at``), sharing the workers."""
    runners = open_lanes(plan, [(feed.lane_id, feed.start_at) for feed in feeds], shared)
    for feed, runner in zip(feeds, runners):
        feed.runner, feed.start_at = runner, {}  # the runner has it, as in start()


class WorkerStarts:
    """The workers of ``feeds``, started on a thread (``begin``) that first warms the kind up
    (``LaneKind.warm_up``: worker processes wait for the fork server, which imports the plan's
    modules before it forks). Until then the loader may claim a lane and read its first lists
    itself (``LaneFeed.read_ahead``): that lane's worker is started when the read is over, from
    where it ended. Each feed's ``start()`` waits for this; an error here is raised there."""

    def __init__(self, plan: Plan, kind: LaneKind, feeds: list[LaneFeed], shared: Any):
        self.error: BaseException | None = None
        self._reads_kept: WorkSource | None = plan.source  # until the first wait() drops them
        self._cancelled = False
        self._lock = threading.Condition()
        # Per lane the loader has read ahead: True while it reads, False between its reads;
        # gone once the thread starts the lane's worker (``_taken``).
        self._reading: dict[int, bool] = {}
        self._taken: set[int] = set()
        self._whole: set[int] = set()  # lanes the loader read to their end: no worker runs them
        self._lanes = len(feeds)
        for feed in feeds:
            feed.starting = self
        self._thread = threading.Thread(
            target=self._run,
            args=(plan, kind, feeds, shared),
            name=f"zephon-worker-starts-{feeds[0].lane_id}",
            daemon=True,
        )

    def begin(self) -> None:
        """Warm the kind up and start the workers, on the thread."""
        self._thread.start()

    def claim(self, feed: LaneFeed) -> bool:
        """Whether the loader may read ``feed`` ahead (again): its worker is not being started
        yet. Until the workers can start, the loader reads on from where its last read of the
        lane ended, instead of waiting for them. The thread takes a lane only between two of
        the loader's reads of it, so a read may still begin once the workers could start:
        refusing it then made the first 50 batches of the text pipeline no sooner (2 process
        lanes, 9 rounds), as the loader's read uses every tokenizer thread of its process."""
        with self._lock:
            if self._cancelled or feed.lane_id in self._taken:
                return False
            self._reading[feed.lane_id] = True
            return True

    def read_over(self, feed: LaneFeed, *, whole: bool = False) -> None:
        """The loader's read of ``feed`` is over: its worker may start, from where it ended;
        none starts when the read reached the lane's end (``whole``)."""
        with self._lock:
            self._reading[feed.lane_id] = False
            if whole:
                self._taken.add(feed.lane_id)
                self._whole.add(feed.lane_id)
            self._lock.notify_all()
        if self.all_read_whole():  # no worker will run: nor will this process read again
            self._drop_reads()

    def read_whole(self, feed: LaneFeed) -> bool:
        """Whether the loader read ``feed`` to its end, so that no worker runs it."""
        with self._lock:
            return feed.lane_id in self._whole

    def all_read_whole(self) -> bool:
        """Whether the loader read every lane to its end: no worker is left to start."""
        with self._lock:
            return len(self._whole) == self._lanes

    def _take(self, feeds: list[LaneFeed]) -> list[LaneFeed] | None:
        """The lanes of ``feeds`` the loader is not reading now, taken for their workers to
        start (the loader reads them no more); waits while it reads every one of them. None
        once the starts are cancelled."""
        with self._lock:
            while not self._cancelled:
                free = [feed for feed in feeds if not self._reading.get(feed.lane_id, False)]
                if free:
                    self._taken.update(feed.lane_id for feed in free)
                    return free
                self._lock.wait()
            return None

    def _run(self, plan: Plan, kind: LaneKind, feeds: list[LaneFeed], shared: Any) -> None:
        try:
            if kind.warm_up is not None:
                kind.warm_up(shared)
            waiting = list(feeds)
            while waiting:
                free = self._take(waiting)
                if free is None:
                    return
                runs = [feed for feed in free if feed.lane_id not in self._whole]
                if runs:
                    _open_runners(plan, runs, shared)
                waiting = [feed for feed in waiting if feed not in free]
        except BaseException as exc:  # raised by the feeds' start()
            self.error = exc

    def wait(self) -> None:
        """Until every worker is started; the error that stopped a start, if one did. The first
        time, the loader's process then frees what its reads ahead kept and took."""
        self._joined()
        if self.error is not None:
            raise self.error
        self._drop_reads()

    def _drop_reads(self) -> None:
        """Every lane is its worker's now, or was read here to its end, and this process reads
        no more: its source forgets what the reads kept (decoded row groups, bytes fetched
        ahead), and the memory goes back here, in the thread that read (Arrow's mimalloc pool
        returns only the calling thread's free pages)."""
        if self._reads_kept is not None:
            source, self._reads_kept = self._reads_kept, None
            source.drop_read_caches()
            give_back()

    def cancel(self) -> None:
        """The lanes close: workers not started yet are not; wait for the thread, so that every
        worker it started is on its feed to be stopped."""
        with self._lock:
            self._cancelled = True
            self._lock.notify_all()
        self._joined()

    def _joined(self) -> None:
        if self._thread.ident is not None:  # begun
            self._thread.join()


def close_feeds(feeds: list[LaneFeed]) -> None:
    """Stop the runners of many lanes at once, under one deadline (``stopping.close_lanes``)."""
    runners = []
    for feed in feeds:
        starting = feed.starting
        if starting is not None:  # what a start under way opened is stopped here too
            # A lane the loader read to its end leaves the other lanes' workers starting; once
            # every lane was, the thread is stopped and waited for like any other start.
            if not starting.read_whole(feed) or starting.all_read_whole():
                starting.cancel()
            feed.starting = None
        if feed.runner is not None:
            runners.append(feed.runner)
        feed.runner = None
        feed.closed = True
        feed.buf, feed.pos = [], 0
    if runners:
        close_lanes(runners)
