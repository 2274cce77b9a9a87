"""Memory and recovery stay bounded: inflight chunks and replayed records don't grow with a run."""

from __future__ import annotations

import pytest
from pipeline_kit import DropMultiples, SplitInChildren, WindowShuffle, canonical

import zephon
from zephon.ops.basic import fetch, map_transform
from zephon.ops.batching import batch
from zephon.sources.memory import RangeSource


def _double(payload):
    return {"idx": payload["idx"] * 2}


def monotone(n):
    return zephon.Pipeline(
        RangeSource(n, chunk_size=512),
        [fetch(), SplitInChildren(2), DropMultiples(7), batch(32)],
        lanes=2,
    )


def epoch_path(n):
    return zephon.Pipeline(
        RangeSource(n, chunk_size=512),
        [fetch(), DropMultiples(7), WindowShuffle(64), batch(32)],
        lanes=2,
        epoch_chunks=4,
    )


@pytest.mark.parametrize("make", [monotone, epoch_path], ids=["monotone", "epoch"])
def test_peak_inflight_chunks_does_not_grow_with_the_run(make):
    peaks = []
    for n in (20_000, 400_000):
        loader = iter(make(n))
        for _ in loader:
            pass
        stats = loader.stats()
        assert stats["inflight_chunks"] == 0
        peaks.append(stats["max_inflight_chunks"])
    assert peaks[1] == peaks[0]


@pytest.mark.parametrize("make", [monotone, epoch_path], ids=["monotone", "epoch"])
def test_records_replayed_on_restore_do_not_grow_with_the_step(make):
    pipeline = make(100_000)
    replayed = []
    for step in (100, 2_000):
        loader = iter(pipeline)
        for _ in range(step):
            next(loader)
        resumed = pipeline.iter(state=loader.state_dict())
        next(resumed)
        replayed.append(resumed.stats()["replayed"])
    bound = 512 * 2 * (1 if make is monotone else 4)  # one chunk, or one epoch, per lane
    assert all(r <= bound for r in replayed)


def test_indexable_monotone_restore_replays_nothing():
    pipeline = zephon.Pipeline(
        RangeSource(10_000, chunk_size=100), [fetch(), map_transform(_double), batch(8)], lanes=2
    )
    assert pipeline.compile().indexable
    loader = iter(pipeline)
    head = [next(loader) for _ in range(333)]
    resumed = pipeline.iter(state=loader.state_dict())
    tail = list(resumed)
    assert resumed.stats()["replayed"] == 0
    full = list(iter(pipeline))
    assert [canonical(b.payload) for b in head + tail] == [canonical(b.payload) for b in full]


def test_checkpoint_size_does_not_grow_with_the_run():
    import json

    pipeline = epoch_path(200_000)
    loader = iter(pipeline)
    sizes = []
    for i, _ in enumerate(loader):
        if i in (10, 5_000):
            sizes.append(len(json.dumps(loader.state_dict())))
    # what the shuffle window holds open in the epoch is kept by position: its size moves with
    # where the window stands (a few hundred bytes at most here), not with the run's length
    assert sizes[1] <= sizes[0] + 512
    assert sizes[1] < 16 * 1024 * 2
