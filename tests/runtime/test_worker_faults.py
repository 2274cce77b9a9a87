"""Lane workers stop promptly, never outlive their lane, and report a death or a stall clearly.

Everything here runs real worker threads and real worker processes (forkserver), and kills,
stops and forks real processes.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from pipeline_kit import fingerprint_item
from worker_kit import (
    blocked_sending,
    finishes_within,
    lane_threads,
    script_env,
    wait_until,
    worker_processes,
)

import zephon
from zephon.errors import OperatorError, PlanError, ZephonError
from zephon.ops import Operator, OpTraits, fetch, map_transform
from zephon.planner import Plan
from zephon.runtime.workers.kinds import open_lane
from zephon.runtime.workers.processes import ProcessLane
from zephon.runtime.workers.stopping import close_lanes
from zephon.sources import RangeSource
from zephon.types import SampleRecord

pytestmark = pytest.mark.usefixtures("no_leftover_workers")


# ------------------------------------------------------------------------------ operators
# Module-level, so worker processes can import them by name.


def with_big_array(payload: dict) -> dict:
    """8 MiB per record: one item list fills the pipe, so the worker blocks sending the next."""
    return {**payload, "vec": np.full(1 << 21, payload["idx"], dtype=np.float32)}


def with_big_bytes(payload: dict) -> dict:
    """8 MiB per record inside the pickle (bytes are not out-of-band buffers, so they never go
    through the worker's shared ring): one item list fills the pipe, and the worker blocks
    sending the next."""
    return {**payload, "blob": bytes([payload["idx"] % 256]) * (8 << 20)}


def with_small_array(payload: dict) -> dict:
    return {**payload, "vec": np.arange(payload["idx"] % 7 + 1, dtype=np.int64)}


def sleep_from_idx_9(payload: dict) -> dict:
    if payload["idx"] >= 9:
        time.sleep(60)  # the worker is busy inside the operator when it is stopped
    return payload


def slow(payload: dict) -> dict:
    time.sleep(0.002)
    return payload


def os_exit_on_13(payload: dict) -> dict:
    if payload["idx"] == 13:
        os._exit(3)
    return payload


def segfault_on_13(payload: dict) -> dict:
    if payload["idx"] == 13:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    return payload


def sys_exit_on_13(payload: dict) -> dict:
    if payload["idx"] == 13:
        sys.exit(4)
    return payload


RELEASE = threading.Event()
ENTERED = threading.Event()  # a thread lane is inside wait_for_release_from_idx_9


def wait_for_release_from_idx_9(payload: dict) -> dict:
    if payload["idx"] >= 9:
        ENTERED.set()
        RELEASE.wait(30)  # a thread lane stuck in an operator until the test lets it go
    return payload


class ExitsInFlush(Operator):
    """Calls ``sys.exit`` when flushed at the end of the lane."""

    traits = OpTraits(preserves_cursor_order=True, stateful=True)

    def process_many(self, records):
        return records

    def flush(self):
        sys.exit(5)


class HoldsALock(Operator):
    """A stateless pass-through whose settings hold something that cannot be pickled."""

    traits = OpTraits(preserves_cursor_order=True)

    def __init__(self) -> None:
        self.settings = {"retries": 3, "guard": threading.Lock()}

    def describe(self) -> dict:  # identifiable for the fingerprint, yet not picklable
        return {"class": "HoldsALock", "retries": self.settings["retries"]}

    def process_many(self, records):
        return records


# ------------------------------------------------------------------------------ helpers


def plan_of(*ops, workers: str = "process", n: int = 4000, **kw) -> Plan:
    return zephon.Pipeline(
        RangeSource(n, chunk_size=8), [fetch(), *ops], workers=workers, **kw
    ).compile()


@contextlib.contextmanager
def no_cyclic_gc():
    """Only reference counting may free objects here: a cyclic GC pass would hide a cycle."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def started(lane):
    """The lane after one item list, so its worker is up and running."""
    next(lane)
    return lane


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def records_of(item_lists) -> list[tuple]:
    """What a lane's item lists carry to delivery, records only, as comparable values."""
    return [fingerprint_item(x) for items in item_lists for x in items if type(x) is SampleRecord]


def raised_within(lane, seconds: float) -> BaseException:
    """The error ``next(lane)`` raises within ``seconds`` (item lists before it are drained)."""
    deadline = time.monotonic() + seconds
    with pytest.raises(ZephonError) as info:
        while time.monotonic() < deadline:
            next(lane)
    return info.value


# ------------------------------------------------------------------------------ abandoned lanes


def test_an_abandoned_thread_lane_stops_its_thread_without_a_gc_pass():
    plan = plan_of(map_transform(with_small_array), workers="thread")
    with no_cyclic_gc():
        lanes = [started(open_lane(plan, 0)) for _ in range(5)]
        assert len(lane_threads()) == 5
        del lanes
        assert wait_until(lambda: not lane_threads(), 10.0), [t.name for t in lane_threads()]


def test_an_abandoned_process_lane_stops_its_worker_without_a_gc_pass():
    plan = plan_of(map_transform(with_big_bytes))
    with no_cyclic_gc():
        lanes = [started(open_lane(plan, lane)) for lane in range(2)]
        pids = [lane.pid for lane in lanes]
        assert wait_until(functools.partial(blocked_sending, *lanes), 10.0)
        del lanes
        assert wait_until(lambda: not worker_processes(), 10.0)
    assert all(gone(pid) for pid in pids)


# ------------------------------------------------------------------------------ closing fast


@pytest.mark.timing
def test_closing_four_lanes_blocked_sending_large_arrays_takes_under_0_2_s():
    plan = zephon.Pipeline(
        RangeSource(4000, chunk_size=8),
        [fetch(), map_transform(with_big_bytes)],
        lanes=4,
        workers="process",
    ).compile()
    lanes = [started(open_lane(plan, lane)) for lane in range(4)]
    assert wait_until(functools.partial(blocked_sending, *lanes), 10.0)
    t0 = time.monotonic()
    close_lanes(lanes)
    elapsed = time.monotonic() - t0
    assert not worker_processes()
    assert elapsed < 0.2, f"closing 4 blocked lanes took {elapsed:.3f}s"


@pytest.mark.timing
def test_closing_lanes_blocked_sending_one_after_the_other_is_fast_too():
    plan = plan_of(map_transform(with_big_bytes))
    lanes = [started(open_lane(plan, 0)) for _ in range(3)]
    assert wait_until(functools.partial(blocked_sending, *lanes), 10.0)
    t0 = time.monotonic()
    for lane in lanes:
        lane.close()
    elapsed = time.monotonic() - t0
    assert not worker_processes()
    assert elapsed < 0.2, f"closing 3 blocked lanes one by one took {elapsed:.3f}s"


@pytest.mark.timing
def test_closing_lanes_busy_in_an_operator_escalates_after_the_deadline():
    plan = plan_of(map_transform(sleep_from_idx_9))
    lanes = [started(open_lane(plan, 0)) for _ in range(4)]
    time.sleep(0.3)  # every worker is now inside time.sleep(60)
    t0 = time.monotonic()
    close_lanes(lanes, timeout=0.1)
    elapsed = time.monotonic() - t0
    assert not worker_processes()
    assert 0.1 <= elapsed < 0.3, f"closing 4 busy lanes took {elapsed:.3f}s"
    assert [lane.exitcode for lane in lanes] == [-signal.SIGTERM] * 4


@pytest.mark.timing
def test_closing_thread_lanes_blocked_on_a_full_queue_is_fast():
    plan = plan_of(map_transform(with_small_array), workers="thread")
    lanes = [started(open_lane(plan, 0)) for _ in range(4)]
    time.sleep(0.2)  # every worker thread now waits for room in its queue
    t0 = time.monotonic()
    close_lanes(lanes)
    elapsed = time.monotonic() - t0
    assert not lane_threads()
    assert elapsed < 0.2, f"closing 4 thread lanes took {elapsed:.3f}s"


def test_a_thread_lane_busy_in_an_operator_stops_when_the_operator_returns():
    RELEASE.clear()
    ENTERED.clear()
    plan = plan_of(map_transform(wait_for_release_from_idx_9), workers="thread")
    lane = started(open_lane(plan, 0))
    assert ENTERED.wait(10.0)
    with finishes_within(3.0):  # a thread cannot be interrupted: close gives up after 0.1 s
        lane.close(timeout=0.1)
    assert lane_threads()
    RELEASE.set()
    assert wait_until(lambda: not lane_threads(), 20.0)


@pytest.mark.parametrize("workers", ["inline", "thread", "process"])
def test_close_is_idempotent_and_a_closed_lane_says_so(workers):
    lane = started(open_lane(plan_of(workers=workers), 0))
    lane.close()
    lane.close()
    lane.request_stop()
    close_lanes([lane, lane])
    with pytest.raises(ZephonError, match="lane 0 is closed"):
        next(lane)


# ------------------------------------------------------------------------------ deaths


@pytest.mark.timing
@pytest.mark.parametrize("after", range(8))
def test_a_sigkilled_worker_surfaces_promptly_naming_lane_pid_and_signal(after):
    lane = open_lane(plan_of(map_transform(with_small_array), map_transform(slow)), 0)
    assert isinstance(lane, ProcessLane)
    for _ in range(after):
        next(lane)
    pid = lane.pid
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    error = raised_within(lane, 1.0)
    elapsed = time.monotonic() - t0
    assert f"lane 0 (pid {pid})" in str(error)
    assert "killed by SIGKILL" in str(error)
    assert elapsed < 0.5, f"the death surfaced after {elapsed:.3f}s"


@pytest.mark.timing
def test_a_worker_killed_while_the_loader_waits_surfaces_at_once():
    lane = started(open_lane(plan_of(map_transform(sleep_from_idx_9)), 0))
    pid = lane.pid
    killer = threading.Timer(0.3, os.kill, (pid, signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    try:
        error = raised_within(lane, 5.0)
        elapsed = time.monotonic() - t0
    finally:
        killer.join()
    assert "killed by SIGKILL" in str(error) and f"pid {pid}" in str(error)
    assert elapsed < 0.3 + 0.5


def test_a_worker_that_calls_os_exit_reports_its_exit_code():
    lane = open_lane(plan_of(map_transform(os_exit_on_13)), 0)
    error = raised_within(lane, 5.0)
    assert re.search(r"lane 0 \(pid \d+\).*exit code 3", str(error))


def test_a_worker_that_segfaults_reports_sigsegv():
    lane = open_lane(plan_of(map_transform(segfault_on_13)), 0)
    error = raised_within(lane, 5.0)
    assert re.search(r"lane 0 \(pid \d+\).*killed by SIGSEGV", str(error))


def test_a_dead_worker_stops_the_loader_and_every_other_worker():
    pipeline = zephon.Pipeline(
        RangeSource(4000, chunk_size=8),
        [fetch(), map_transform(with_big_array)],
        lanes=4,
        workers="process",
    )
    loader = iter(pipeline)
    next(loader)
    workers = pipeline.compile().processes  # one per lane, at most one per CPU
    assert wait_until(lambda: len(worker_processes()) == workers, 10.0)  # sending 8 MiB lists
    victim = worker_processes()[0].pid
    os.kill(victim, signal.SIGKILL)
    with (
        finishes_within(10.0),
        pytest.raises(ZephonError, match=rf"pid {victim}\).*killed by SIGKILL"),
    ):
        for _ in range(100):
            next(loader)
    assert not worker_processes()


@pytest.mark.parametrize("workers", ["inline", "thread", "process"])
def test_sys_exit_in_an_operator_is_an_operator_error(workers):
    p = zephon.Pipeline(
        RangeSource(40, chunk_size=8), [fetch(), map_transform(sys_exit_on_13)], workers=workers
    )
    with pytest.raises(OperatorError, match=r"sys_exit_on_13.*sys\.exit\(4\)") as info:
        list(p)
    assert info.value.operator == "map_transform(sys_exit_on_13)"


@pytest.mark.parametrize("workers", ["inline", "thread", "process"])
def test_sys_exit_in_flush_is_an_operator_error(workers):
    p = zephon.Pipeline(RangeSource(10), [fetch(), ExitsInFlush()], workers=workers)
    with pytest.raises(OperatorError, match=r"ExitsInFlush.*sys\.exit\(5\) in flush\(\)"):
        list(p)


def test_an_unpicklable_pipeline_names_the_operator_and_its_attribute():
    plan = plan_of(map_transform(lambda d: d, name="inline_lambda"))
    with pytest.raises(PlanError, match=r"operator 'inline_lambda' \(#1\).*attribute fn\b"):
        open_lane(plan, 0)
    plan = plan_of(map_transform(with_small_array), HoldsALock())
    with pytest.raises(
        PlanError, match=r"operator 'HoldsALock' \(#2\).*attribute settings\['guard'\]"
    ):
        open_lane(plan, 0)


def a_lock_at_idx_21(payload: dict) -> dict:
    if payload["idx"] == 21:
        return {**payload, "extra": {"guard": threading.Lock()}}
    return payload


def test_a_record_that_cannot_be_pickled_is_named_with_its_cursor_and_field():
    pipeline = zephon.Pipeline(
        RangeSource(40, chunk_size=8),
        [fetch(), map_transform(a_lock_at_idx_21)],
        lanes=2,
        workers="process",
    )
    with pytest.raises(
        ZephonError,
        match=r"record SampleCursor\(2, 5, \(0, 0, 21\)\) \(sample_id=\(0, 0, 21\)\), in "
        r"its payload\['extra'\]\['guard'\],.*cannot pickle '_thread.lock' object",
    ):
        list(pipeline)


def interrupt_on_13(payload: dict) -> dict:
    if payload["idx"] == 13:
        raise KeyboardInterrupt
    return payload


def test_a_ctrl_c_in_the_terminal_is_left_to_the_loaders_process():
    # Ctrl-C signals the whole process group; a worker that died of it would lose its lane.
    expected = records_of(
        open_lane(plan_of(map_transform(with_small_array), n=400, workers="inline"), 0)
    )
    lane = open_lane(plan_of(map_transform(with_small_array), map_transform(slow), n=400), 0)
    assert isinstance(lane, ProcessLane)
    head = records_of([next(lane)])
    os.kill(lane.pid, signal.SIGINT)
    tail = records_of(lane)
    lane.close()
    assert head + tail == expected


def test_a_keyboard_interrupt_in_an_inline_operator_stays_a_keyboard_interrupt():
    # Inline, the operator runs in the training loop's thread: this is how Ctrl-C arrives there,
    # and it must not turn into an exception that `except Exception` would swallow.
    p = zephon.Pipeline(RangeSource(40, chunk_size=8), [fetch(), map_transform(interrupt_on_13)])
    with pytest.raises(KeyboardInterrupt):
        list(p)


# ------------------------------------------------------------------------------ fork()


def test_a_forked_child_that_exits_normally_leaves_the_parents_workers_running():
    expected = records_of(
        open_lane(plan_of(map_transform(with_small_array), n=400, workers="inline"), 0)
    )
    lane = open_lane(plan_of(map_transform(with_small_array), n=400), 0)
    head = records_of([next(lane)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads (3.12+)
        child = os.fork()
    if child == 0:  # the child drops its copy of the lane and exits as a script would
        try:
            del lane
            gc.collect()
            atexit._run_exitfuncs()
        finally:
            os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    tail = records_of(lane)
    lane.close()
    assert head + tail == expected


# ------------------------------------------------------------------------------ timeout


@pytest.mark.timing
def test_a_stopped_worker_times_out_naming_the_lane_and_the_wait():
    lane = open_lane(plan_of(map_transform(with_small_array), timeout=0.5), 0)
    assert isinstance(lane, ProcessLane)
    pid = lane.pid
    try:
        for _ in range(40):  # on a busy machine the worker may take longer than that to start
            try:
                next(lane)
                break
            except ZephonError as exc:
                assert "produced nothing for 0.5 s" in str(exc)  # and the lane goes on after it
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(ZephonError, match=rf"lane 0 \(pid {pid}\).*nothing for 0\.5 s"):
            for _ in range(1000):
                next(lane)
        assert 0.5 <= time.monotonic() - t0 < 1.0
    finally:
        # Stopped in the middle of writing a message, the worker leaves the pipe mid-message:
        # the lane then stops it (same error), and it is gone already.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        lane.close()


@pytest.mark.timing
@pytest.mark.skipif(sys.platform == "win32", reason="a POSIX pipe written to by hand")
def test_a_message_cut_off_mid_way_times_out_instead_of_blocking():
    # A worker stopped (or stuck) between the parts of a message, or inside a large one: the
    # loader has the header and must not wait forever for the rest.
    import multiprocessing as mp
    import struct

    from zephon.runtime.workers.pipe_messages import MessageStalled, encode, receive, write

    reader, writer = mp.Pipe(duplex=False)
    try:
        header, parts = encode("items", [np.arange(50_000)])
        writer.send(header)
        body = b"".join(parts)
        os.write(writer.fileno(), struct.pack("!i", len(body)) + body[:1000])  # then stops
        t0 = time.monotonic()
        with pytest.raises(MessageStalled):
            receive(reader, 0.3)
        assert 0.3 <= time.monotonic() - t0 < 1.0
    finally:
        reader.close()
        writer.close()
    # and a whole message still arrives as it was sent
    reader, writer = mp.Pipe(duplex=False)
    try:
        # More than a pipe holds, from another thread as a worker would send it; arrays of
        # every size (none at all included), each arriving in a writable buffer of its own.
        arrays = [np.arange(50_000), np.arange(0), np.arange(7), np.arange(300_000)]
        message = encode("items", [*arrays, "x"])
        sender = threading.Thread(target=write, args=(writer, message))
        sender.start()
        got_kind, value, size = receive(reader, 5.0)
        sender.join()
        assert got_kind == "items" and value[-1] == "x"
        assert size == sum(len(part) for part in message[1])  # the body: pickle and arrays
        for got, want in zip(value, arrays, strict=False):
            np.testing.assert_array_equal(got, want)
            assert got.flags.writeable
        got_arrays = value[: len(arrays)]
        assert not any(
            np.shares_memory(a, b) for i, a in enumerate(got_arrays) for b in got_arrays[i + 1 :]
        )
        # and without a deadline, as lanes that wait for ever read it
        sender = threading.Thread(target=write, args=(writer, message))
        sender.start()
        _, again, _ = receive(reader)
        sender.join()
        np.testing.assert_array_equal(again[3], arrays[3])
    finally:
        reader.close()
        writer.close()


@pytest.mark.timing
def test_a_thread_lane_stuck_in_an_operator_times_out():
    RELEASE.clear()
    plan = plan_of(map_transform(wait_for_release_from_idx_9), workers="thread", timeout=0.3)
    lane = started(open_lane(plan, 0))
    try:
        t0 = time.monotonic()
        with pytest.raises(
            ZephonError, match=r"lane 0 \(thread zephon-lane-0\).*nothing for 0\.3 s"
        ):
            for _ in range(10):
                next(lane)
        assert 0.3 <= time.monotonic() - t0 < 0.8
    finally:
        RELEASE.set()
        lane.close()
    assert wait_until(lambda: not lane_threads(), 2.0)


def test_without_a_timeout_a_slow_lane_is_waited_for():
    plan = plan_of(map_transform(slow), workers="process", n=64)
    assert plan.timeout is None
    with contextlib.closing(open_lane(plan, 0)) as lane:
        assert sum(1 for _ in lane) > 0


@pytest.mark.parametrize("bad", [0, -1.5, "1", True])
def test_a_timeout_must_be_a_positive_number(bad):
    with pytest.raises(PlanError, match="timeout"):
        plan_of(timeout=bad)


def test_the_timeout_is_described_and_kept_out_of_the_fingerprint():
    assert "timeout: 2.5 s" in plan_of(timeout=2.5).describe()
    assert "timeout" not in plan_of().describe()
    assert plan_of(timeout=2.5).fingerprint == plan_of().fingerprint


# ------------------------------------------------------------------------------ __main__ guard

UNGUARDED_SCRIPT = textwrap.dedent("""
    import zephon
    from zephon.ops import fetch, map_transform, shuffle
    from zephon.sources import RangeSource

    print("the script runs", flush=True)

    def double(payload):  # defined in the script: a worker needs the script to unpickle it
        return {"x": payload["idx"] * 2}

    # shuffle keeps state it can describe: the first lanes get a head start while the fork
    # server starts (through a probe process, which must not run the script either)
    ops = [fetch(), map_transform(double)] if NEEDS_SCRIPT else [fetch(), shuffle(8)]
    pipeline = zephon.Pipeline(RangeSource(100), ops, lanes=2, workers="process")
    print("delivered", sum(1 for _ in pipeline))  # no `if __name__ == "__main__":` around this
""")


def run_unguarded(tmp_path: Path, needs_script: bool) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(f"NEEDS_SCRIPT = {needs_script}\n" + UNGUARDED_SCRIPT)
    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=script_env(),
    )


def test_a_script_without_a_main_guard_fails_fast_with_one_clear_message(tmp_path):
    done = run_unguarded(tmp_path, needs_script=True)
    assert done.returncode != 0
    err = done.stderr
    assert 'if __name__ == "__main__":' in err
    assert err.count("PlanError") == 1
    assert "An attempt has been made to start a new process" not in err
    assert len(err.splitlines()) < 30, err


def test_workers_leave_out_the_script_when_the_plan_needs_nothing_defined_there(tmp_path):
    # The script is not run again in the workers: its module-level code runs once, unguarded.
    done = run_unguarded(tmp_path, needs_script=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["the script runs", "delivered 100"]
    assert "Traceback" not in done.stderr, done.stderr
