"""Checks every file format's source must pass, written once: each sample once per pass, a
bucket copy read as the local files, exact resume, resume after a killed worker, a job resumed on
fewer ranks and re-laned, a checkpoint refused once its data changed, a file or bucket object
changed behind the source refused. Each format's tests call them with its own source, or a
``make(**pipeline_options)`` building its own pipeline, over files its own writer made."""

from __future__ import annotations

import functools
import json
import os
import pickle
import signal
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pipeline_kit import fingerprint_item, run
from worker_kit import worker_processes

import zephon
from zephon.errors import CheckpointMismatchError, FetchError, PlanError, RelaneWarning
from zephon.sources import ShardCache

Make = Callable[..., zephon.Pipeline]
Delivered = Callable[[list[Any]], Counter]


def every_sample(src: Any) -> list[Any]:
    """Every sample ``src`` holds, read chunk by chunk in its order."""
    total = src.total_chunks()
    assert total is not None
    return [p for pos in range(total) for p in src.read(src.chunk(pos).pointers)]


def assert_columns_pick_and_order(source: Callable[..., Any], first: dict[str, Any]) -> None:
    """``source(columns=list(first))`` reads ``first`` (its keys in that order) as its first
    sample; a column no file has is a PlanError naming it."""
    src = source(columns=list(first))
    assert src.read(src.chunk(0).pointers[:1]) == [first]
    with pytest.raises(PlanError, match=r"no column \['nope'\]"):
        source(columns=["nope"]).num_samples()


def assert_each_sample_twice(
    src: Any, n: int, index: Callable[[Any], int], check: Callable[[Any], None]
) -> None:
    """Over two passes ``src`` reads each of its ``n`` samples (told apart by ``index``) twice,
    each passing ``check``."""
    got = every_sample(src)
    assert Counter(index(g) for g in got) == Counter({i: 2 for i in range(n)})
    for g in got:
        check(g)


def assert_a_copy_reads_the_same(here: Any, there: Any, key: str) -> list[Any]:
    """``there`` (a copy of ``here``'s files) describes itself as ``here`` does and reads its
    samples in the same order (compared by ``key``); what ``there`` read."""
    assert there.describe() == here.describe()
    got = every_sample(there)
    assert [g[key] for g in got] == [g[key] for g in every_sample(here)]
    return got


def assert_same_values(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Each of ``want``'s values in ``got``: arrays of the same dtype, shape and elements, any
    other value equal and of the same type."""
    for key, value in want.items():
        if isinstance(value, np.ndarray):
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            np.testing.assert_array_equal(got[key], value, err_msg=key)
        else:
            assert got[key] == value and type(got[key]) is type(value), key


def closed_state(loader: Any) -> dict[str, Any]:
    """``loader``'s state after a JSON round trip (it must survive JSON); the loader closed."""
    state: dict[str, Any] = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    return state


def stopped_after(make: Make, items: int, **kw: Any) -> tuple[list[tuple], dict[str, Any]]:
    """What ``make(**kw)`` delivers first (``items`` of it), and its state then after a JSON
    round trip (the loader closed)."""
    loader = iter(make(**kw))
    head = run(loader, items) if items else []
    return head, closed_state(loader)


def assert_resumes_exactly(make: Make, steps: Callable[[int], Iterable[int]]) -> None:
    """Stopped after each of ``steps(len(full))`` items and resumed by a new pipeline, two lanes
    deliver the uninterrupted stream ``full``."""
    full = run(iter(make(lanes=2)))
    for step in steps(len(full)):
        head, state = stopped_after(make, step, lanes=2)
        assert head + run(make(lanes=2).iter(state=state)) == full, f"step {step}"


def assert_a_killed_worker_resumes_exactly(make: Make, items: int) -> None:
    """A process lane SIGKILLed after ``items`` items fails the loader naming the signal; its
    last state resumes (in threads) to the uninterrupted stream."""
    full = run(iter(make(lanes=2)))
    # With a timeout the workers read from the start: on a fork server's first start the loader
    # may otherwise still be reading these few samples itself, with no worker to kill.
    loader = iter(make(lanes=2, workers="process", timeout=60.0))
    head = run(loader, items)
    os.kill(worker_processes()[0].pid, signal.SIGKILL)
    with pytest.raises(zephon.ZephonError, match="killed by SIGKILL"):
        for item in loader:
            head.append(fingerprint_item(item))
    assert head + run(make(lanes=2).iter(state=closed_state(loader))) == full


def four_ranks_stopped(make: Make) -> tuple[list[Any], dict[str, Any]]:
    """Four ranks of four lanes each take two items; what they took and their merged state."""
    states, before = [], []
    for rank in range(4):
        loader = iter(make(lanes=4, rank=rank, world_size=4))
        before += [next(loader) for _ in range(2)]
        states.append(closed_state(loader))
    return before, zephon.merge_states(states)


def assert_resumes_on_two_ranks(
    make: Make, delivered: Delivered, every: Counter
) -> tuple[list[Any], dict[str, Any]]:
    """A job of four ranks resumed on two: each of ``every`` delivered once in all. Returns
    what the four ranks took and their merged state."""
    before, job = four_ranks_stopped(make)
    after = [x for r in range(2) for x in make(rank=r, world_size=2).iter(state=job)]
    assert delivered(before) + delivered(after) == every
    return before, job


def assert_relanes(
    pipeline: zephon.Pipeline,
    state: dict[str, Any],
    before: list[Any],
    delivered: Delivered,
    every: Counter,
) -> None:
    """``pipeline`` resumed from a ``state`` of another lane count warns, and delivers what
    ``before`` did not: each of ``every`` once in all."""
    with pytest.warns(RelaneWarning):
        after = list(pipeline.iter(state=state))
    assert delivered(before) + delivered(after) == every


def assert_resumes_on_two_ranks_and_relanes(
    make: Make, delivered: Delivered, every: Counter
) -> None:
    """A job of four ranks resumes on two ranks, and on one rank of three lanes (re-laned):
    each of ``every`` delivered once both times."""
    before, job = assert_resumes_on_two_ranks(make, delivered, every)
    assert_relanes(make(lanes=3), job, before, delivered, every)


def assert_a_changed_dataset_is_refused(
    make: Make, change: Callable[[], None], match: str | Callable[[], str]
) -> None:
    """A state taken after one item no longer resumes once ``change()`` changed the data:
    CheckpointMismatchError matching ``match`` (or what ``match()`` returns after the change)."""
    _, state = stopped_after(make, 1)
    change()
    with pytest.raises(CheckpointMismatchError, match=match if isinstance(match, str) else match()):
        iter(make().iter(state=state))


def assert_a_file_rewritten_under_a_reader_is_refused(
    src: Any, path: Path, *, flip: int, match: str
) -> None:
    """``src`` read its first chunk; then the local file ``path`` is rewritten with its byte
    ``flip`` flipped (same size, another mtime): reading the chunk again raises FetchError
    matching ``match``."""
    src.read(src.chunk(0).pointers)
    data = bytearray(path.read_bytes())
    data[flip] ^= 1
    path.write_bytes(bytes(data))
    os.utime(path, ns=(1, 1))
    with pytest.raises(FetchError, match=match):
        src.read(src.chunk(0).pointers)


def assert_a_changed_object_is_refused(
    bucket: Any,
    local: Path,
    prefix: str,
    name: str,
    source: Callable[[str], Any],
    *,
    flip: int,
    match: str,
) -> None:
    """``local`` uploaded under ``prefix`` and indexed by ``source(uri)``; then its object
    ``name`` overwritten with its byte ``flip`` flipped: reading every sample raises FetchError
    matching ``match``."""
    there = source(bucket.upload(local, prefix))
    there.num_samples()
    data = bytearray((local / name).read_bytes())
    data[flip] ^= 1
    bucket.overwrite(f"{prefix}/{name}", bytes(data))
    with pytest.raises(FetchError, match=match):
        every_sample(there)


def kept_decompressed_bytes(cache_dir: Path, cache: Any) -> int:
    """Bytes a source over compressed shards keeps on disk: the decompressed copies it put in
    ``cache_dir`` and every entry of ``cache`` (a ``ShardCache``: downloads and decompressed
    copies)."""
    copies = sum(f.stat().st_size for f in Path(cache_dir).rglob("*.raw"))
    return copies + sum(f.stat().st_size for f in Path(cache.dir).glob("*.shard"))


def largest_decompressed_shard(source: Callable[..., Any], cache_dir: Path) -> int:
    """The size of the largest shard ``source(cache_dir=...)`` decompresses, as it reads
    without a ``ShardCache`` (its copies in ``cache_dir``)."""
    every_sample(source(cache_dir=cache_dir))
    return max(f.stat().st_size for f in Path(cache_dir).rglob("*.raw"))


def assert_a_shard_cache_bounds_decompressed_shards(
    source: Callable[..., Any], tmp: Path, key: str, check: Callable[[Any], None]
) -> None:
    """``source(cache_dir=..., cache=...)`` over compressed shards, through a ``ShardCache``
    with room for three of its decompressed shards, keeps every copy it makes within
    ``max_bytes``, and reads (compared by ``key``, each sample passing ``check``) what it reads
    without the cache: first, and again in a copy of it (as a process lane has) after the
    evictions made it decompress shards again."""
    plain = every_sample(source(cache_dir=tmp / "plain"))
    largest = max(f.stat().st_size for f in Path(tmp / "plain").rglob("*.raw"))
    cache = ShardCache(tmp / "shards", max_bytes=3 * largest)
    cached = source(cache_dir=tmp / "c", cache=cache)
    shards = len(cached.files())
    assert shards > 3, "the data should span more shards than the cache holds"
    for _ in range(2):
        got = every_sample(cached)
        assert [g[key] for g in got] == [g[key] for g in plain]
        for g in got:
            check(g)
        kept = kept_decompressed_bytes(tmp / "c", cache)
        assert kept <= cache.max_bytes, f"{kept} bytes kept, max_bytes={cache.max_bytes}"
        assert len(list(Path(cache.dir).glob("*.shard"))) < shards, "nothing was evicted"
        cached.drop_read_caches()
        cached = pickle.loads(pickle.dumps(cached))


def assert_a_small_shard_cache_resumes_exactly_in_process_lanes(
    source: Callable[..., Any], make: Make, tmp: Path, items: int
) -> None:
    """``make(cache_dir, shards, **kw)``, the pipeline over compressed shards, on two process
    lanes through a ``ShardCache`` with room for two of ``source``'s decompressed shards:
    delivers the stream of a read without the cache, and resumes exactly after ``items`` items
    with the others evicted, keeping what it keeps on disk within ``max_bytes``."""
    largest = largest_decompressed_shard(source, tmp / "plain")
    full = run(iter(make(tmp / "plain", lanes=2)))
    cache = ShardCache(tmp / "shards", max_bytes=2 * largest)
    cached = functools.partial(make, tmp / "c", cache, lanes=2, workers="process")
    assert run(iter(cached())) == full
    head, state = stopped_after(cached, items)
    assert len(list(Path(cache.dir).glob("*.shard"))) <= 2  # the others were evicted
    assert head + run(cached().iter(state=state)) == full
    assert kept_decompressed_bytes(tmp / "c", cache) <= cache.max_bytes
