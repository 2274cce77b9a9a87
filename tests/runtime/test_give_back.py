"""give_back: free memory between live allocations goes back to the operating system, in a worker
process also soon after one item list took much more than the usual."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import zephon
from zephon.ops import batch, fetch, map_transform
from zephon.runtime.workers.memory_release import private_resident_bytes
from zephon.sources.memory import RangeSource

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc and glibc's heap"
)

# In a fresh interpreter, so that nothing else this test process did shapes its heap. Each step
# leaves about 80 MB of malloc'd blocks free, with a live block every 128 KB so that free()
# cannot shrink the heap, and prints the resident anonymous memory before and after a call.
SCRIPT = textwrap.dedent(
    """
    import pyarrow as pa

    from zephon.runtime.workers.memory_release import (
        give_back,
        give_back_at_most_every,
        give_back_once_grown,
    )


    def resident_anon_kib():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])


    kept = []


    def step(call, blocks=20_000):
        blocks = [bytearray(4000) for _ in range(blocks)]
        kept.extend(blocks[::32])
        del blocks
        before = resident_anon_kib()
        call()
        print(before - resident_anon_kib())


    pa.array(range(100_000))  # Arrow's pool in use: give_back releases it as well
    step(give_back)
    step(lambda: give_back_at_most_every(3600.0))  # the first call in this process gives back
    # About 80 MB more than after the last give-back: gives back. About 16 MB more: keeps them.
    step(lambda: give_back_once_grown(32 << 20))
    step(lambda: give_back_once_grown(32 << 20), blocks=4_000)
    step(lambda: give_back_at_most_every(3600.0))  # within the hour: it does not
    """
)


def test_give_back_returns_the_free_pages_between_live_allocations() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True
    )
    now, first, grown, little, again = map(int, done.stdout.split())
    assert now > 40 * 1024 and first > 40 * 1024 and grown > 40 * 1024, (now, first, grown)
    assert little < 8 * 1024 and again < 8 * 1024, (little, again)


# Each item list takes about 60 MB again and frees it, the last block kept until the next list
# (so that free() cannot shrink the heap); each chunk starts with a give-back and a list that
# only announces it. The first list may give back what it took; the next ones take the same again
# and must keep it, as a give-back costs a page fault per page when the next list touches them.
USUAL = textwrap.dedent(
    """
    from zephon.runtime.workers.memory_release import give_back, give_back_once_grown


    def resident_anon_kib():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])


    survivor = []


    def usual_list():
        blocks = [bytearray(4000) for _ in range(15_000)]
        survivor[:] = blocks[-1:]
        del blocks


    for _ in range(5):
        give_back()  # a chunk's start
        give_back_once_grown(32 << 20)  # after the list announcing it
        usual_list()
        before = resident_anon_kib()
        give_back_once_grown(32 << 20)
        print(before - resident_anon_kib())
    """
)


def test_what_every_item_list_takes_again_stays_with_the_worker() -> None:
    done = subprocess.run([sys.executable, "-c", USUAL], capture_output=True, text=True, check=True)
    first, *usual = map(int, done.stdout.split())
    assert all(kept < 8 * 1024 for kept in usual), (first, usual)


_pinned: list[bytearray] = []


def held_after_bloat(payload: dict) -> dict:
    """Record 40 leaves about 80 MB of freed heap blocks, pinned in place by a live one every
    128 KB; every record says where it ran and how much memory that process holds."""
    idx = payload["idx"]
    if idx == 40:
        blocks = [bytearray(4000) for _ in range(20_000)]
        _pinned.extend(blocks[::32])
        del blocks
    return {"idx": idx, "pid": os.getpid(), "held": private_resident_bytes()}


@pytest.mark.usefixtures("no_leftover_workers")
def test_a_worker_gives_back_what_one_list_took_before_it_makes_the_next() -> None:
    pipeline = zephon.Pipeline(
        RangeSource(64, chunk_size=64),  # one chunk: no chunk start gives back after record 40
        [fetch(), map_transform(held_after_bloat), batch(4)],
        workers="process",
        micro_batch=4,
    )
    with pipeline.iter() as loader:
        seen = {
            idx: (pid, held)
            for b in loader
            for idx, pid, held in zip(
                b.payload["idx"].tolist(), b.payload["pid"].tolist(), b.payload["held"].tolist()
            )
        }
    (pid, bloated), (same_pid, next_list) = seen[40], seen[44]
    assert pid == same_pid != os.getpid()  # both in the worker, one item list apart
    assert bloated - next_list > 40 * 2**20, (bloated, next_list)


def test_lanes_on_threads_of_one_worker_check_their_growth_at_once() -> None:
    # A worker process runs several lanes on threads of its own, and each checks its growth
    # after every item list it sends: the record of the last checks is the process's, shared.
    # It used to be read while another lane's thread added to it ("deque mutated during
    # iteration", a worker's error ending the loader's run).
    import threading

    from zephon.runtime.workers.memory_release import give_back_once_grown

    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def checks() -> None:
        start.wait()
        try:
            for _ in range(20_000):
                give_back_once_grown(1 << 40)  # never reached: only the check runs
        except BaseException as exc:
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [threading.Thread(target=checks) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []


def test_giving_back_drops_the_arenas_packers_keep_for_the_next_ones() -> None:
    import numpy as np

    from zephon._core.packfill import BinFill, release_warm_arenas, warm_arena_bytes
    from zephon.runtime.workers.memory_release import give_back

    release_warm_arenas()
    fill = BinFill(2048)
    fill.write(np.array([[0, 0, 3, 0, 0]], dtype=np.int64), [np.arange(3, dtype=np.int32)], [0])
    fill.take(np.array([0], dtype=np.int64))
    del fill  # its arena is kept warm for the next packer of this process
    assert warm_arena_bytes() > 0
    give_back()
    assert warm_arena_bytes() == 0
