"""Thread and process lanes deliver the stream inline lanes do, and never outlive the loader."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest
from pipeline_kit import DropMultiples, PackPairs, SplitInChildren, WindowShuffle, fingerprint_item
from worker_kit import script_env, wait_until

import zephon
from zephon._core.records import expand_runs
from zephon.errors import OperatorError, PlanError, ZephonError
from zephon.ops.basic import fetch, map_transform
from zephon.ops.batching import batch
from zephon.runtime.workers.kinds import open_lanes
from zephon.runtime.workers.pickled_plan import PlanParcel
from zephon.runtime.workers.processes import ProcessLane
from zephon.runtime.workers.stopping import close_lanes
from zephon.sources.memory import ListSource, RangeSource
from zephon.types import SampleRecord

KINDS = ["inline", "thread", "process"]


pytestmark = pytest.mark.usefixtures("no_leftover_workers")


def with_array(payload: dict) -> dict:
    return {**payload, "vec": np.arange(payload["idx"] % 5 + 3, dtype=np.int32)}


def explode_on_13(payload: dict) -> dict:
    if payload["idx"] == 13:
        raise ValueError("thirteen")
    return payload


class HoldRecordZero:
    """Record 0 (lane 0's first) waits for the file ``release``; every other record appends its
    idx to ``log`` and carries 1 MiB, so one item list of 8 is far more than a pipe holds."""

    def __init__(self, where: str):
        self.release = os.path.join(where, "release")
        self.log = os.path.join(where, "log")

    def __call__(self, payload: dict) -> dict:
        if payload["idx"] == 0:
            wait_until(lambda: os.path.exists(self.release), 60)
            return payload
        with open(self.log, "a") as f:
            f.write(f"{payload['idx']}\n")
        return {**payload, "vec": np.full(1 << 18, payload["idx"], dtype=np.float32)}


def make(workers: str, n: int = 300, **kw) -> zephon.Pipeline:
    ops = [
        fetch(),
        map_transform(with_array),
        SplitInChildren(2),
        DropMultiples(5),
        WindowShuffle(4, seed=3),
        PackPairs(),
        batch(3),
    ]
    return zephon.Pipeline(
        RangeSource(n, chunk_size=16, shuffle=True),
        ops,
        lanes=2,
        workers=workers,
        epoch_chunks=2,
        **kw,
    )


def items(loader) -> list[tuple]:
    with loader:
        return [fingerprint_item(b) for b in loader]


@pytest.fixture(scope="module")
def reference() -> list[tuple]:
    return items(iter(make("inline")))


@pytest.mark.parametrize("workers", KINDS[1:])
def test_stream_is_identical_to_inline_lanes(workers, reference):
    assert items(iter(make(workers))) == reference
    assert not multiprocessing.active_children()


@pytest.mark.parametrize(
    ("saved_with", "resumed_with"),
    [("process", "inline"), ("inline", "process"), ("thread", "process")],
)
def test_state_restores_across_worker_kinds(saved_with, resumed_with, reference):
    for step in (0, 7, 40):
        loader = iter(make(saved_with))
        head = [fingerprint_item(next(loader)) for _ in range(step)]
        state = json.loads(json.dumps(loader.state_dict()))
        loader.close()
        assert head + items(make(resumed_with).iter(state=state)) == reference
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("workers", KINDS)
def test_an_operator_error_in_a_worker_names_operator_cursor_and_sample(workers):
    p = zephon.Pipeline(
        RangeSource(40, chunk_size=8), [fetch(), map_transform(explode_on_13)], workers=workers
    )
    with pytest.raises(
        OperatorError,
        match=r"explode_on_13.*SampleCursor\(1, 5, \(0, 0, 13\)\)"
        r".*thirteen",
    ) as info:
        list(p)
    assert info.value.operator and "explode_on_13" in info.value.operator
    assert not multiprocessing.active_children()


def test_process_lanes_need_a_picklable_pipeline():
    p = zephon.Pipeline(RangeSource(4), [fetch(), map_transform(lambda d: d)], workers="process")
    with pytest.raises(PlanError, match="picklable"):
        next(iter(p))


def test_closing_early_stops_the_workers():
    loader = iter(make("process", n=5000))
    next(loader)
    assert len(multiprocessing.active_children()) == 2
    loader.close()
    assert not multiprocessing.active_children()


CRASH_SCRIPT = textwrap.dedent("""
    import json, multiprocessing, os, sys, time
    sys.path[:0] = [{tests!r}, os.path.dirname({tests!r})]
    import zephon
    from test_workers import make
    from pipeline_kit import fingerprint_item
    def main():
        out_dir = sys.argv[1]
        loader = iter(make("process", n=3000))
        with open(os.path.join(out_dir, "delivered.txt"), "w") as log:
            for step, item in enumerate(loader, 1):
                log.write(repr(fingerprint_item(item)) + "\\n")
                if step % 10 == 0:  # the step inside the checkpoint: one atomic write
                    log.flush()
                    state = {{"step": step, "loader": loader.state_dict()}}
                    zephon.save_checkpoint(os.path.join(out_dir, "ckpt.json"), state)
                if step == 55:
                    pids = [p.pid for p in multiprocessing.active_children()]
                    # Renamed into place: the test reads pids.json as soon as it exists.
                    tmp = os.path.join(out_dir, "pids.tmp")
                    with open(tmp, "w") as f:
                        json.dump(pids, f)
                    os.replace(tmp, os.path.join(out_dir, "pids.json"))
                    time.sleep(600)  # killed here, mid-run, with its workers busy or blocked

    if __name__ == "__main__":  # worker processes re-import this module
        main()
""")


def _alive(pid: int) -> bool:
    try:  # a zombie waiting for its reaper counts as gone
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # also when it is reaped while being looked at
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and SIGKILL")
def test_sigkilled_training_process_resumes_identically_and_leaves_no_workers(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(CRASH_SCRIPT.format(tests=os.path.dirname(__file__)))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=script_env())
    assert wait_until(lambda: (tmp_path / "pids.json").exists() or proc.poll() is not None, 120)
    assert proc.poll() is None, "training script died early"
    pids = json.loads((tmp_path / "pids.json").read_text())
    assert len(pids) >= 2
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert wait_until(lambda: not any(_alive(pid) for pid in pids), 50.0), (
        "worker processes outlived the killed loader"
    )

    saved = zephon.load_checkpoint(tmp_path / "ckpt.json")
    step, state = saved["step"], saved["loader"]
    logged = (tmp_path / "delivered.txt").read_text().splitlines()[:step]
    tail = [repr(x) for x in items(make("process", n=3000).iter(state=state))]
    full = [repr(x) for x in items(iter(make("inline", n=3000)))]
    assert logged + tail == full


def test_a_lane_ahead_of_the_delivery_order_keeps_working_while_another_is_awaited(tmp_path):
    # Lane 0 is stuck on its first record and the loader waits for it; lane 1 may still run
    # ``prefetch`` item lists ahead instead of stalling on its first write to a full pipe.
    hold = HoldRecordZero(str(tmp_path))
    plan = zephon.Pipeline(
        RangeSource(64, chunk_size=8), [fetch(), map_transform(hold)], lanes=2, workers="process"
    ).compile()
    logged: list[int] = []

    def lane_1_records() -> list[int]:
        with contextlib.suppress(FileNotFoundError), open(hold.log) as f:
            return [int(line) for line in f.read().split()]
        return []

    def release() -> None:
        # two item lists sent and a third made: 3 chunks of lane 1 (8 records each)
        wait_until(lambda: len(lane_1_records()) >= 24, 30)
        logged.extend(lane_1_records())
        open(hold.release, "w").close()

    lanes = open_lanes(plan, [(0, {}), (1, {})])
    releaser = threading.Thread(target=release)
    releaser.start()
    try:
        first = [r.payload["idx"] for r in expand_runs(next(lanes[0])) if hasattr(r, "payload")]
        releaser.join()
        rest = [
            [
                r.payload["idx"]
                for items in lane
                for r in expand_runs(items)
                if hasattr(r, "payload")
            ]
            for lane in lanes
        ]
    finally:
        close_lanes(lanes)
    assert logged[:24] == [*range(8, 16), *range(24, 32), *range(40, 48)]
    assert first + rest[0] == [i for i in range(64) if i // 8 % 2 == 0]
    assert rest[1] == [i for i in range(64) if i // 8 % 2 == 1]


def test_a_worker_killed_while_another_lane_is_awaited_is_reported_by_its_own_lane(tmp_path):
    hold = HoldRecordZero(str(tmp_path))
    plan = zephon.Pipeline(
        RangeSource(64, chunk_size=8), [fetch(), map_transform(hold)], lanes=2, workers="process"
    ).compile()
    lanes = open_lanes(plan, [(0, {}), (1, {})])
    killed = lanes[1]
    assert isinstance(killed, ProcessLane)
    spent: list[float] = []

    def kill_lane_1_then_release() -> None:
        wait_until(lambda: os.path.exists(hold.log), 30)
        os.kill(killed.pid, signal.SIGKILL)
        wait_until(lambda: not os.path.exists(f"/proc/{killed.pid}/status"), 30)
        before = time.process_time()
        time.sleep(1.0)  # the loader keeps waiting for lane 0, its pipe to lane 1 at its end
        spent.append(time.process_time() - before)
        open(hold.release, "w").close()

    releaser = threading.Thread(target=kill_lane_1_then_release)
    releaser.start()
    try:
        first = next(lanes[0])
        releaser.join()
        with pytest.raises(ZephonError, match=r"lane 1 \(pid \d+\) died: it was killed by SIGKILL"):
            for _ in lanes[1]:
                pass
        assert [r.payload["idx"] for r in expand_runs(first) if hasattr(r, "payload")] == [
            *range(8)
        ]
    finally:
        close_lanes(lanes)
    assert spent[0] < 0.5  # it waited, rather than spinning on the ended pipe


def _through_gate(path: str) -> None:
    with open(path, "rb"):  # a FIFO: opening it waits for the test to open its other end
        return None


class Gate:
    """Unpickled (in a worker, as it starts) only once the test opens the FIFO ``path``; it
    becomes None, the runner's default ``carry``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (_through_gate, (self.path,))


def test_starting_a_worker_does_not_wait_for_it_to_read_its_plan(tmp_path):
    # A plan larger than a pipe holds: were it part of the start, starting the worker would
    # wait for the worker to read it, and so would the start of every worker after it.
    gate = str(tmp_path / "gate")
    os.mkfifo(gate)
    texts = [f"{i:06d}" * 200 for i in range(300)]
    pipeline = zephon.Pipeline(ListSource(texts, chunk_size=100), [fetch()], workers="process")
    plan = pipeline.compile()
    assert len(PlanParcel(plan).plan_bytes) > 256 * 1024
    started: list[ProcessLane] = []
    returned = threading.Event()

    def start() -> None:
        started.append(ProcessLane(plan, 0, carry=Gate(gate)))
        returned.set()

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    try:
        # The worker is still held at the gate, before it could read anything.
        held = returned.wait(60)
    finally:
        with open(gate, "wb"):  # lets the worker go on
            pass
        thread.join(60)
    try:
        assert held, "starting the worker waited for it to read its plan"
        (lane,) = started
        items = expand_runs([item for got in lane for item in got])
        payloads = [r.payload for r in items if type(r) is SampleRecord]
    finally:
        close_lanes(started)
    assert payloads == texts
