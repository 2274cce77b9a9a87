"""Thread and process lanes deliver the stream inline lanes do, and never outlive the loader."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from pipeline_kit import DropMultiples, PackPairs, SplitInChildren, WindowShuffle, fingerprint_item
from worker_kit import assert_no_leftover_workers, script_env

import zephon
from zephon.errors import OperatorError, PlanError
from zephon.ops.basic import fetch, map_transform
from zephon.ops.batching import batch
from zephon.sources.memory import RangeSource

KINDS = ["inline", "thread", "process"]


@pytest.fixture(autouse=True)
def _no_leftover_workers():
    yield from assert_no_leftover_workers()


def with_array(payload: dict) -> dict:
    return {**payload, "vec": np.arange(payload["idx"] % 5 + 3, dtype=np.int32)}


def explode_on_13(payload: dict) -> dict:
    if payload["idx"] == 13:
        raise ValueError("thirteen")
    return payload


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
                if step % 10 == 0:
                    log.flush()
                    zephon.save_checkpoint(os.path.join(out_dir, "ckpt.json"), loader.state_dict())
                    with open(os.path.join(out_dir, "step.txt"), "w") as f:
                        f.write(str(step))
                if step == 55:
                    pids = [p.pid for p in multiprocessing.active_children()]
                    with open(os.path.join(out_dir, "pids.json"), "w") as f:
                        json.dump(pids, f)
                    time.sleep(600)  # killed here, mid-run, with its workers busy or blocked

    if __name__ == "__main__":  # worker processes re-import this module
        main()
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its reaper counts as gone
        return f.read().split()[2] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and SIGKILL")
def test_sigkilled_training_process_resumes_identically_and_leaves_no_workers(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(CRASH_SCRIPT.format(tests=os.path.dirname(__file__)))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=script_env())
    deadline = time.monotonic() + 120
    while not (tmp_path / "pids.json").exists():
        assert proc.poll() is None, "training script died early"
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(0.2)
    pids = json.loads((tmp_path / "pids.json").read_text())
    assert len(pids) >= 2
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    gone_by = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < gone_by:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), "worker processes outlived the killed loader"

    step = int((tmp_path / "step.txt").read_text())
    logged = (tmp_path / "delivered.txt").read_text().splitlines()[:step]
    state = zephon.load_checkpoint(tmp_path / "ckpt.json")
    tail = [repr(x) for x in items(make("process", n=3000).iter(state=state))]
    full = [repr(x) for x in items(iter(make("inline", n=3000)))]
    assert logged + tail == full
