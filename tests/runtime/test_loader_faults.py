"""Fault injection at the loader, over process and thread lanes: kill a worker, close, fail in an
operator, abandon the loader. Each case ends in an exact resume or a Zephon error naming the
cause, leaves no thread or process behind, and closes in at most 0.2 s."""

from __future__ import annotations

import gc
import json
import os
import signal
import time
from pathlib import Path

import pytest
from pipeline_kit import fingerprint_item, run
from worker_kit import finishes_within, lane_threads, wait_until, worker_processes

import zephon
from zephon.ops.basic import fetch, map_transform
from zephon.ops.batching import batch
from zephon.sources.memory import RangeSource

LANES = 3


class Slow:
    """A map function that sleeps a little, so workers are mid-operator or blocked sending when
    the fault comes; it raises on idx 200 while its flag file exists."""

    def __init__(self, flag: Path | None = None):
        self.flag = str(flag) if flag else None

    def __call__(self, payload: dict) -> dict:
        time.sleep(0.0005)
        if self.flag and payload["idx"] == 200 and os.path.exists(self.flag):
            os.unlink(self.flag)
            raise ValueError("failed on purpose at idx 200")
        return {"idx": payload["idx"], "x": payload["idx"] * 3}


def _pipeline(flag: Path | None = None, **kw: object) -> zephon.Pipeline:
    return zephon.Pipeline(
        RangeSource(600, chunk_size=16),
        [fetch(), map_transform(Slow(flag), name="slow"), batch(4)],
        lanes=LANES,
        **kw,  # type: ignore[arg-type]
    )


pytestmark = pytest.mark.usefixtures("no_leftover_workers")


@pytest.fixture(scope="module")
def full() -> list[tuple]:
    return run(iter(_pipeline()))


def _resumes_exactly(
    head: list[tuple], state: dict, full: list[tuple], flag: Path | None = None
) -> None:
    tail = run(_pipeline(flag).iter(state=json.loads(json.dumps(state))))
    assert head + tail == full


def _timed_close(loader: zephon.Loader) -> None:
    with finishes_within(2.0):  # 0.2 s on a quiet machine: it never waits for a busy operator
        loader.close()


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_close_mid_run(workers: str, full: list[tuple]) -> None:
    loader = iter(_pipeline(workers=workers))
    head = run(loader, 23)
    _timed_close(loader)
    _resumes_exactly(head, loader.state_dict(), full)


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_an_operator_error_mid_run(workers: str, full: list[tuple], tmp_path: Path) -> None:
    flag = tmp_path / "armed"
    flag.write_text("1")
    loader = iter(_pipeline(flag, workers=workers))
    head: list[tuple] = []
    with pytest.raises(zephon.OperatorError, match="slow") as info:
        for item in loader:
            head.append(fingerprint_item(item))
    assert "failed on purpose" in str(info.value)
    assert "lane" in str(info.value)
    state = loader.state_dict()
    _timed_close(loader)
    _resumes_exactly(head, state, full, flag)  # the flag is gone: the resumed run goes through


def test_a_killed_worker_mid_run(full: list[tuple]) -> None:
    loader = iter(_pipeline(workers="process"))
    head = run(loader, 17)
    victim = worker_processes()[0]
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(zephon.ZephonError, match=r"killed by SIGKILL") as info:
        for item in loader:
            head.append(fingerprint_item(item))
    assert str(victim.pid) in str(info.value)
    state = loader.state_dict()
    _timed_close(loader)
    _resumes_exactly(head, state, full)


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_an_abandoned_loader_stops_its_workers_without_a_gc_pass(workers: str) -> None:
    gc.disable()
    try:
        for _ in range(5):
            loader = iter(_pipeline(workers=workers))
            next(loader)
            del loader
        assert wait_until(lambda: not lane_threads() and not worker_processes(), 2.0), (
            f"left running: {[t.name for t in lane_threads()]}, {worker_processes()}"
        )
    finally:
        gc.enable()


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_lanes_sharing_one_worker_close_fast_and_resume(workers: str, full: list[tuple]) -> None:
    loader = iter(_pipeline(workers=workers, processes=1))
    head = run(loader, 19)
    assert len(lane_threads() if workers == "thread" else worker_processes()) == 1
    _timed_close(loader)
    _resumes_exactly(head, loader.state_dict(), full)


def test_a_killed_worker_shared_by_all_lanes(full: list[tuple]) -> None:
    loader = iter(_pipeline(workers="process", processes=1))
    head = run(loader, 11)
    (victim,) = worker_processes()
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(zephon.ZephonError, match=r"killed by SIGKILL"):
        for item in loader:
            head.append(fingerprint_item(item))
    state = loader.state_dict()
    _timed_close(loader)
    _resumes_exactly(head, state, full)


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_an_abandoned_loader_with_shared_workers_stops_them(workers: str) -> None:
    gc.disable()
    try:
        for _ in range(3):
            loader = iter(_pipeline(workers=workers, processes=2))
            next(loader)
            del loader
        assert wait_until(lambda: not lane_threads() and not worker_processes(), 2.0)
    finally:
        gc.enable()


def _exits_at_150(payload: dict) -> dict:
    if payload["idx"] == 150:
        os._exit(3)
    return payload


def test_a_lost_workers_error_keeps_no_frame_of_the_failed_pipe_call() -> None:
    # The loader keeps its failure for as long as it lives, and with it the failed pipe call's
    # error as its context; that one's frames would hold the message being sent, an export of
    # a BytesIO, which Python 3.13's garbage collector reports as an ignored BufferError. The
    # worker's exit is met on the pipe (a context) in most runs, at its process sentinel (none)
    # in the others: runs until one meets it on the pipe.
    source = RangeSource(400, chunk_size=20)
    ops = [fetch(), map_transform(_exits_at_150), batch(4)]
    contexts = []
    for _ in range(30):
        with zephon.Pipeline(source, ops, lanes=2, workers="process").iter() as loader:
            with pytest.raises(zephon.ZephonError, match="died") as info:
                run(loader)
            context = info.value.__context__
        if context is not None:
            contexts.append(context)
            break
    assert contexts, "the exit was never met on the pipe"
    assert all(c.__traceback__ is None for c in contexts)
    assert not worker_processes()
