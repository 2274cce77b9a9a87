"""The first operator's calls on a lane's next reads, made on threads while the current read
goes through the operators after it.

A native tokenizer encodes outside the GIL, its own threads sharing out each call; every call
ends with a tail in which those threads wait for the slowest. So the lane reads its next read
while the tokenizer works and starts the call on it at once, on a second thread: the tokenizer's
threads go from one call to the next instead of waiting, for the tail and for the lane's packing
and delivering. Only for an operator that says so (``Operator.releases_gil``), keeps no state
and gets whole reads: its output cannot depend on when, or beside what, it is called. What the
lane yields is the same, item for item: a result is used only when the runner reaches its read
with exactly the records it was made from, every count and check is made then, and a call that
failed is made again in the lane's thread (once no call runs), which meets the error and reports
it as it would have."""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future, wait
from queue import SimpleQueue
from time import perf_counter
from typing import Any

from zephon._core.records import expand_runs, next_control
from zephon.ops.base import Operator

#: Where a read is: the local chunk, its first offset and its end.
Where = tuple[int, int, int]

#: Calls made at once: the next read's starts while this one's runs, so that the tokenizer's
#: threads that finish their share of one call go on with the next instead of waiting for the
#: slowest (calls of a micro-batch each end with such a tail).
CALLS_AT_ONCE = 2

_OFF = ("false", "0", "off", "no")


def calls_at_once() -> int:
    """``CALLS_AT_ONCE``, or 1 where this process's native thread pools are held to one thread
    (``TOKENIZERS_PARALLELISM`` off or ``RAYON_NUM_THREADS=1``, as a worker process sized to one
    CPU is): a call then has no tail to fill, and a second would take another CPU."""
    if os.environ.get("TOKENIZERS_PARALLELISM", "").lower() in _OFF:
        return 1
    if os.environ.get("RAYON_NUM_THREADS", "").strip() == "1":
        return 1
    return CALLS_AT_ONCE


def _timed(op: Operator, records: list) -> tuple[list, float]:
    began = perf_counter()
    out = op.process_many(records[:])  # a list of its own: the lane may call it again on them
    return out, perf_counter() - began


class NextRead:
    """The reads a lane made ahead (at most the one being processed and the next), in order,
    each with the first operator's call on its records, made on threads of their own
    (``zephon-ahead-<operator>``, ``calls_at_once()`` of them, one more once a worker's tokenizer
    is given more threads as other workers finish): the next read's call runs beside the current
    one's."""

    def __init__(self, op_name: str) -> None:
        self._calls: SimpleQueue[tuple[Future, Operator, list] | None] = SimpleQueue()
        self._name = f"zephon-ahead-{op_name}"
        self._threads = [self._thread() for _ in range(calls_at_once())]
        # Per read ahead: where, what was read (or the error reading raised), its records and
        # the call on them (None when the read holds more than records).
        self._queue: deque[tuple[Where, Any, list | None, Future | None]] = deque()
        self._current: tuple[list, Future] | None = None  # the taken read's call

    def start(self, where: Where, fetched: Any, op: Operator) -> None:
        """``fetched`` (the items read at ``where``, or the error the read raised) comes next;
        ``op`` is called on its records when they are records only (a read with tombstones or
        control items is left to the lane)."""
        if isinstance(fetched, BaseException):
            self._queue.append((where, fetched, None, None))
            return
        records = expand_runs(fetched)  # the same record objects the lane pushes
        call: Future | None = None
        if records and next_control(records, 0) == len(records):
            call = Future()
            if not self._threads[0].is_alive():
                for thread in self._threads:
                    thread.start()
            elif len(self._threads) < calls_at_once():  # the worker's pool was widened
                self._threads.append(self._thread())
                self._threads[-1].start()
            self._calls.put((call, op, records))
        self._queue.append((where, records, records if call else None, call))

    def take(self, where: Where) -> Any:
        """What was read at ``where`` (raising the error it raised); None when no read ahead is
        that one (every read ahead is dropped then)."""
        self._current = None
        if not self._queue or self._queue[0][0] != where:
            self.drop()
            return None
        _, fetched, records, call = self._queue.popleft()
        if isinstance(fetched, BaseException):
            self.drop()
            raise fetched
        if call is not None:
            assert records is not None
            self._current = (records, call)
        return fetched

    def working(self) -> bool:
        """Whether the read last taken has its call made ahead (the lane then makes none
        itself, and may queue the next read's)."""
        return self._current is not None

    def result_for(self, records: list) -> tuple[list, float] | None:
        """The first operator's output for ``records`` and the seconds it took, when the read
        last taken had its call made on exactly these records and it succeeded; else None, once
        no call runs any more, for the lane to make it itself."""
        current, self._current = self._current, None
        if current is None:
            return None
        made_from, call = current
        try:
            out = call.result()
        except BaseException:  # made again by the lane, which reports it
            out = None
        if out is None or made_from is not records:
            self._idle()
            return None
        return out

    def _idle(self) -> None:
        """Wait until no call runs (their results stay queued)."""
        wait([call for _, _, _, call in self._queue if call is not None])

    def drop(self) -> None:
        """Forget every read ahead, once its call has ended."""
        self._idle()
        self._queue.clear()
        self._current = None

    def close(self) -> None:
        """End the threads (after the calls running on them; those not started are not made)."""
        for _, _, _, call in self._queue:
            if call is not None:
                call.cancel()
        started = [thread for thread in self._threads if thread.is_alive()]
        for _ in started:
            self._calls.put(None)
        for thread in started:
            thread.join()
        self._queue.clear()
        self._current = None

    def _thread(self) -> threading.Thread:
        # A daemon thread, as the lane's own: a call that never returns does not keep the
        # process from exiting (a thread lane that timed out leaves both behind).
        return threading.Thread(target=self._serve, name=self._name, daemon=True)

    def _serve(self) -> None:
        while (job := self._calls.get()) is not None:
            call, op, records = job
            if call.set_running_or_notify_cancel():
                try:
                    call.set_result(_timed(op, records))
                except BaseException as exc:  # the lane makes the call again and reports it
                    call.set_exception(exc)
