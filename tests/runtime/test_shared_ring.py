"""Large item lists from a worker process cross in its shared ring: the loader's arrays are made
on pages both processes keep mapped, bitwise the worker's; a region is used again once its arrays
are gone and never while one is held; the ring leaves nothing behind (no mapping in the loader
once its arrays are gone, no file in /dev/shm) after a close and after a worker is killed, and a
run resumed after that continues exactly."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import psutil
import pytest
from worker_kit import script_env, wait_until, worker_processes

import zephon
from zephon.ops import batch, fetch, map_transform
from zephon.sources.memory import RangeSource

pytestmark = [
    pytest.mark.usefixtures("no_leftover_workers"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd, /proc/self/maps"),
]

SIDE = 224


def picture(payload: dict) -> dict:
    """A decoded-size picture that differs per record: 147 kB, 2.4 MB per list of 16."""
    idx = payload["idx"]
    image = np.random.default_rng(idx).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    return {"idx": idx, "image": image}


def pairs(records) -> list[tuple[int, np.ndarray]]:
    """Keeps each record's own array (no stack), so the test sees where it was made."""
    return [(r.payload["idx"], r.payload["image"]) for r in records]


def pipeline(n: int, **kw) -> zephon.Pipeline:
    return zephon.Pipeline(
        RangeSource(n, chunk_size=16),
        [fetch(), map_transform(picture), batch(16, collate=pairs)],
        micro_batch=16,
        **kw,
    )


def ring_mappings() -> list[tuple[int, int]]:
    """The address ranges of the shared rings this process has mapped."""
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "zephon-ring" in line:
                start, end = line.split()[0].split("-")
                found.append((int(start, 16), int(end, 16)))
    return found


def in_ring(array: np.ndarray, mappings: list[tuple[int, int]]) -> bool:
    at = array.__array_interface__["data"][0]
    return any(start <= at < end for start, end in mappings)


def alive(pid: int) -> bool:
    try:  # a zombie waiting for its reaper counts as gone
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def shm_files() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def expected(idx: int) -> bytes:
    return picture({"idx": idx})["image"].tobytes()


def test_large_lists_cross_in_the_ring_bitwise_and_a_region_returns_once_its_arrays_go():
    # 640 pictures on one lane: 94 MB, more than the ring holds, so the ring must be reused.
    n = 640
    shm_before = shm_files()
    seen = 0
    with pipeline(n, workers="process").iter() as loader:
        for b in loader:
            mappings = ring_mappings()
            assert len(mappings) == 1
            for idx, image in b.payload:
                assert in_ring(image, mappings), f"record {idx} took the pipe"
                assert image.flags.writeable and image.tobytes() == expected(idx)
                seen += 1
            del b, image
    assert seen == n
    gc.collect()
    assert ring_mappings() == [] and shm_files() == shm_before


def test_a_held_array_is_never_overwritten_the_lists_after_a_full_ring_take_the_pipe():
    n = 640
    with pipeline(n, workers="process").iter() as loader:
        held = [pair for b in loader for pair in b.payload]
        mappings = ring_mappings()
        where = [in_ring(image, mappings) for _, image in held]
    assert [idx for idx, _ in held] == list(range(n))
    assert all(image.tobytes() == expected(idx) for idx, image in held)
    assert where[0] and not where[-1]  # the ring, until it was full of held regions
    assert not any(where[where.index(False) :])  # nothing released: it stays full
    # Closed, the arrays held still read as they were; the ring goes with the last of them.
    assert ring_mappings()
    del held
    gc.collect()
    assert ring_mappings() == []


def stacked(n: int, **kw) -> zephon.Pipeline:
    """As ``pipeline``, batched by the default collate (the pictures stacked)."""
    return zephon.Pipeline(
        RangeSource(n, chunk_size=16),
        [fetch(), map_transform(picture), batch(16)],
        micro_batch=16,
        **kw,
    )


def test_a_batch_of_a_lists_arrays_is_one_view_of_the_ring_and_its_region_returns_with_it():
    # 640 pictures, more than the ring holds: every batch is a view (no copy), so the ring is
    # reused only as batches go.
    n = 640
    seen = 0
    with stacked(n, workers="process").iter() as loader:
        for b in loader:
            images, idx = b.payload["image"], b.payload["idx"].tolist()
            assert in_ring(images, ring_mappings()), f"batch from {idx[0]} was copied"
            assert not images.flags.owndata and images.flags.writeable
            assert images.tobytes() == b"".join(map(expected, idx))
            seen += len(idx)
            del b, images
    assert seen == n


def test_held_batches_keep_their_pixels_while_later_lists_take_the_pipe():
    n = 640
    with stacked(n, workers="process").iter() as loader:
        held = [b.payload for b in loader]
        mappings = ring_mappings()
    assert [i for p in held for i in p["idx"].tolist()] == list(range(n))
    assert all(p["image"].tobytes() == b"".join(map(expected, p["idx"].tolist())) for p in held)
    where = [in_ring(p["image"], mappings) for p in held]
    assert where[0] and not where[-1]  # the ring, until held batches filled it
    del held
    gc.collect()
    assert ring_mappings() == []


def test_the_pixels_equal_inline_lanes_and_a_held_array_outlives_the_loader():
    inline = [(i, img.tobytes()) for b in pipeline(160, lanes=2).iter() for i, img in b.payload]
    loader = pipeline(160, lanes=2, workers="process").iter()
    got = [(i, img.tobytes()) for b in loader for i, img in b.payload]
    assert got == inline
    loader = pipeline(160, lanes=2, workers="process").iter()
    kept = next(loader).payload[3][1]
    loader.close()
    del loader
    gc.collect()
    assert len(ring_mappings()) == 1  # the kept array's lane's; the other lane's went
    assert kept.tobytes() == expected(3)
    del kept
    gc.collect()
    assert ring_mappings() == []


def test_a_killed_worker_leaves_no_ring_behind_and_the_run_resumes_exactly():
    n = 320
    full = [(i, img.tobytes()) for b in pipeline(n, lanes=2).iter() for i, img in b.payload]
    shm_before = shm_files()
    loader = pipeline(n, lanes=2, workers="process").iter()
    head = [(i, img.tobytes()) for b in (next(loader) for _ in range(5)) for i, img in b.payload]
    assert len(ring_mappings()) == 2
    victim = worker_processes()[0]
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(zephon.ZephonError, match=r"killed by SIGKILL"):
        head.extend((i, img.tobytes()) for b in loader for i, img in b.payload)
    state = loader.state_dict()
    loader.close()
    del loader
    gc.collect()
    assert ring_mappings() == [] and shm_files() == shm_before
    with pipeline(n, lanes=2, workers="process").iter(state=state) as resumed:
        tail = [(i, img.tobytes()) for b in resumed for i, img in b.payload]
    assert head + tail == full


def test_an_abandoned_loader_with_rings_stops_its_workers_without_a_gc_pass():
    gc.collect()
    gc.disable()
    try:
        loader = pipeline(320, lanes=2, workers="process").iter()
        kept = next(loader).payload[0][1]
        next(loader)  # the other lane's first batch: both lanes have their ring
        assert len(ring_mappings()) == 2
        del loader
        assert wait_until(lambda: not worker_processes(), 10.0)
        assert len(ring_mappings()) == 1  # the kept array's ring, and only while it is kept
        del kept
        assert ring_mappings() == []
    finally:
        gc.enable()


def digests(batches) -> list[str]:
    """Each record as its index and the digest of its pixels."""
    return [
        f"{i} {hashlib.sha1(img.tobytes()).hexdigest()}" for b in batches for i, img in b.payload
    ]


CRASH_SCRIPT = textwrap.dedent("""
    import json, multiprocessing, os, sys, time
    sys.path[:0] = [{tests!r}, os.path.dirname({tests!r})]
    import zephon
    from test_shared_ring import digests, pipeline, ring_mappings

    def main():
        out_dir = sys.argv[1]
        loader = pipeline(640, lanes=2, workers="process").iter()
        with open(os.path.join(out_dir, "delivered.txt"), "w") as log:
            for step, b in enumerate(loader, 1):
                log.write("".join(line + "\\n" for line in digests([b])))
                if step % 3 == 0:  # the step inside the checkpoint: one atomic write
                    log.flush()
                    state = {{"step": step, "loader": loader.state_dict()}}
                    zephon.save_checkpoint(os.path.join(out_dir, "ckpt.json"), state)
                if step == 10:
                    seen = {{"pids": [p.pid for p in multiprocessing.active_children()],
                             "rings": len(ring_mappings())}}
                    tmp = os.path.join(out_dir, "seen.tmp")
                    with open(tmp, "w") as f:
                        json.dump(seen, f)
                    os.replace(tmp, os.path.join(out_dir, "seen.json"))
                    time.sleep(600)  # killed here, holding a batch made on a ring

    if __name__ == "__main__":  # worker processes re-import this module
        main()
""")


def test_a_sigkilled_training_process_leaves_no_ring_or_worker_and_resumes_exactly(tmp_path):
    shm_before = shm_files()
    script = tmp_path / "train.py"
    script.write_text(CRASH_SCRIPT.format(tests=os.path.dirname(__file__)))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=script_env())
    try:
        assert wait_until(lambda: (tmp_path / "seen.json").exists() or proc.poll() is not None, 120)
        assert proc.poll() is None, "training script died early"
        seen = json.loads((tmp_path / "seen.json").read_text())
        assert seen["rings"] == 2 and len(seen["pids"]) >= 2
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert wait_until(lambda: not any(alive(pid) for pid in seen["pids"]), 50.0)
    assert shm_files() == shm_before

    saved = zephon.load_checkpoint(tmp_path / "ckpt.json")
    step, state = saved["step"], saved["loader"]
    assert step == 9
    logged = (tmp_path / "delivered.txt").read_text().splitlines()[: step * 16]
    with pipeline(640, lanes=2, workers="process").iter(state=state) as resumed:
        tail = digests(resumed)
    assert logged + tail == digests(pipeline(640, lanes=2).iter())
