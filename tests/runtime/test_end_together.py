"""Ranks whose data ends at different global steps stop together without torch:
``Loader.end_together`` takes the job's own minimum all-reduce (here one made of a
multiprocessing barrier, and one over gloo on 127.0.0.1), every rank stops at the step the
shortest one ends at, and what the others still had is counted in ``dropped_at_end``."""

from __future__ import annotations

import json
import multiprocessing
import os
import textwrap
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from net_kit import run_ranks

import zephon
from zephon.ops import batch, fetch, filter_records
from zephon.sources import RangeSource

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEADLINE = 120  # seconds: generous, only to turn a hang into a failure


def keep(payload: dict) -> bool:
    # Lane 0 (rank 0) reads the first half of each chunk pair, lane 1 the second: rank 1 keeps less.
    return payload["idx"] % 64 < 40 or payload["idx"] % 3 == 0


def make(rank: int = 0, world_size: int = 1) -> zephon.Pipeline:
    ops = [fetch(), filter_records(keep), batch(4)]
    return zephon.Pipeline(
        RangeSource(1024, chunk_size=32), ops, lanes=2, rank=rank, world_size=world_size
    )


def alone() -> list[list[list[int]]]:
    """Each rank's batches, as sample ids, when nothing makes the ranks end together."""
    return [[[r.meta.cursor.sample_id[2] for r in b] for b in make(r, 2)] for r in range(2)]


def train(rank: int, least: Callable[[int], Any], step_done: Callable[[], None]) -> dict:
    """What a rank's training loop sees: its batches until the job's data ends together."""
    loader = make(rank, 2).iter()
    seen = []
    for item in loader.end_together(least):
        step_done()  # a training step: every rank must be there
        seen.append([r.meta.cursor.sample_id[2] for r in item])
    state = loader.state_dict()
    loader.close()
    return {
        "seen": seen,
        "dropped": loader.stats()["dropped_at_end"],
        "finished": all(s["finished"] for s in state["lane_states"]),
    }


def _barrier_rank(rank: int, slots: Any, barrier: Any, out: Any) -> None:
    def least(value: int) -> int:
        slots[rank] = value
        barrier.wait(DEADLINE)
        smallest = min(slots[:])
        barrier.wait(DEADLINE)  # nobody writes the next value before every rank read this one
        return smallest

    try:
        out.send(train(rank, least, lambda: barrier.wait(DEADLINE)))
    except BaseException:
        barrier.abort()  # the other rank fails at once instead of waiting out the deadline
        raise
    out.close()


def _check(results: list[dict]) -> None:
    counts = [len(s) for s in alone()]
    assert counts[0] != counts[1]  # the data really ends at different steps
    assert [len(r["seen"]) for r in results] == [min(counts)] * 2
    assert [r["seen"] for r in results] == [s[: min(counts)] for s in alone()]
    assert sum(r["dropped"] for r in results) == max(counts) - min(counts)
    assert all(r["finished"] for r in results)
    delivered = Counter(i for r in results for batch_ids in r["seen"] for i in batch_ids)
    assert max(delivered.values()) == 1


def test_ranks_stop_together_through_a_barrier_made_all_reduce() -> None:
    ctx = multiprocessing.get_context("fork")
    slots = ctx.Array("q", 2)
    barrier = ctx.Barrier(2)
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [
        ctx.Process(target=_barrier_rank, args=(r, slots, barrier, pipes[r][1])) for r in range(2)
    ]
    for proc in procs:
        proc.start()
    try:
        results = []
        for reader, _ in pipes:
            assert reader.poll(DEADLINE), "a rank did not finish"
            results.append(reader.recv())
    finally:
        for proc in procs:
            proc.join(DEADLINE)
            if proc.is_alive():
                proc.kill()
                proc.join()
    assert [proc.exitcode for proc in procs] == [0, 0]
    _check(results)


GLOO_RANK = textwrap.dedent("""
    import json, sys, warnings
    warnings.simplefilter("ignore")
    sys.path.insert(0, {tests!r})
    import torch
    import torch.distributed as dist
    from runtime.test_end_together import train

    url, rank = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=2)

    def least(value):
        flag = torch.tensor([value])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return flag.item()

    print(json.dumps(train(rank, least, dist.barrier)))
    dist.destroy_process_group()
""").format(tests=TESTS)


def test_ranks_stop_together_through_a_gloo_all_reduce(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed")
    script = tmp_path / "rank.py"
    script.write_text(GLOO_RANK)
    done = run_ranks(script, 2, timeout=DEADLINE)
    assert [code for code, _, _ in done] == [0, 0], [err[-3000:] for _, _, err in done]
    _check([json.loads(out.strip().splitlines()[-1]) for _, out, _ in done])


def test_end_together_needs_a_function() -> None:
    with make().iter() as loader, pytest.raises(TypeError, match="minimum over all ranks"):
        loader.end_together(3)  # type: ignore[arg-type]


def test_a_rank_without_data_stopping_the_whole_job_at_once_is_a_warning(caplog) -> None:
    # One chunk for two ranks: rank 1 has nothing, so every rank stops before its first item,
    # a small evaluation set delivering nothing at all; a line at INFO would hide it.
    import threading

    caplog.set_level("INFO", logger="zephon")
    ops = [fetch(), filter_records(keep), batch(4)]
    source = RangeSource(32, chunk_size=32)
    slots = [1, 1]
    barrier = threading.Barrier(2, timeout=DEADLINE)
    seen: list[list] = [[], []]

    def least(rank: int, value: int) -> int:
        slots[rank] = value
        barrier.wait()
        smallest = min(slots)
        barrier.wait()
        return smallest

    def rank_loop(rank: int) -> None:
        pipeline = zephon.Pipeline(source, ops, lanes=2, rank=rank, world_size=2)
        with pipeline.iter() as loader:
            seen[rank] = list(loader.end_together(lambda n: least(rank, n)))

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE)
    assert seen == [[], []]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2, warned
    assert any("rank 1 has no data" in m for m in warned)
    assert any("rank 0 delivered nothing" in m and "some rank had no data" in m for m in warned)
