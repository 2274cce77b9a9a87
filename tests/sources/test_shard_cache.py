"""The node-local shard cache: whole remote shards downloaded once into a directory shared by
every lane, thread and process, and read from there. A real S3-compatible server (moto) on
loopback, with the counting proxy in front of it, and real worker processes."""

from __future__ import annotations

import contextlib
import fcntl
import json
import multiprocessing
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from worker_kit import assert_no_leftover_workers, lane_threads, wait_until

import zephon
from zephon.errors import CheckpointMismatchError, FetchError
from zephon.observability.families import metric_families, stats_from_families
from zephon.ops import batch, fetch
from zephon.sources import (
    ArrowSource,
    JsonlSource,
    MixtureSource,
    ShardCache,
    TokenShardSource,
)

no_leftovers = pytest.fixture(autouse=True)(assert_no_leftover_workers)

MAKE = {"parquet": ArrowSource, "jsonl": JsonlSource}


def shards(root: Path, sizes: list[int], group: int = 5) -> Path:
    """``part-K.parquet`` and ``part-K.jsonl`` per size, rows numbered across shards."""
    root.mkdir(parents=True, exist_ok=True)
    start = 0
    for k, n in enumerate(sizes):
        idx = list(range(start, start + n))
        table = pa.table({"idx": idx, "text": [f"row {i}" for i in idx]})
        pq.write_table(table, root / f"part-{k:03d}.parquet", row_group_size=group)
        lines = "".join(json.dumps({"idx": i, "text": f"row {i}"}) + "\n" for i in idx)
        (root / f"part-{k:03d}.jsonl").write_text(lines)
        start += n
    return root


def rows(source, take: int | None = None, **iter_options) -> list[int]:
    """The idx of every delivered row (of the first ``take`` batches)."""
    got: list[int] = []
    pipeline = zephon.Pipeline(source, [fetch(), batch(4)], **iter_options)
    with pipeline.iter() as loader:
        for k, b in enumerate(loader):
            got += [int(i) for i in b.payload["idx"]]
            if take is not None and k + 1 == take:
                break
    return got


def gets(proxy, marker: str = "part-") -> list[str]:
    """The GETs of shard bytes the proxy forwarded."""
    return [r for r in proxy.requests if r.startswith("GET ") and marker in r]


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_cached_source_delivers_exactly_the_uncached_stream(tmp_path, bucket, kind, shuffle):
    local = shards(tmp_path / "data", [7, 12, 3, 9])
    uri = bucket.upload(local, "c")
    make = MAKE[kind]
    where = f"{uri}/*.{kind}"
    options = {"chunk_size": 5, "shuffle": shuffle, "seed": 3, "passes": 2}
    plain = make(where, **options)
    cache = ShardCache(tmp_path / "shards", max_bytes=1 << 30)
    cached = make(where, cache=cache, cache_dir=tmp_path / "meta", **options)
    assert cached.describe() == plain.describe()
    expected = rows(plain)
    assert rows(cached) == expected
    # The same again on worker processes and on threads, reading the copies made by this one.
    again = make(where, cache=cache, cache_dir=tmp_path / "meta", **options)
    assert rows(again, lanes=2, workers="process") == rows(plain, lanes=2, workers="process")
    assert rows(again, lanes=3, workers="thread") == rows(plain, lanes=3, workers="thread")
    assert sorted(expected) == sorted(list(range(31)) * 2)


def test_token_shards_read_through_the_cache_as_without_it(tmp_path, bucket):
    local = tmp_path / "tok"
    local.mkdir()
    for k in range(3):
        np.save(local / f"s{k}.npy", np.arange(k * 100, k * 100 + 64, dtype=np.uint16))
    uri = bucket.upload(local, "t")
    plain = TokenShardSource(f"{uri}/*.npy", window=8, chunk_size=3)
    cached = TokenShardSource(
        f"{uri}/*.npy", window=8, chunk_size=3, cache=ShardCache(tmp_path / "s", max_bytes=1 << 20)
    )
    pointers = np.concatenate([plain.chunk(p).pointers for p in range(plain.num_chunks())])
    want = [d[plain.field].tolist() for d in plain.read(pointers)]
    assert [d[plain.field].tolist() for d in cached.read(pointers)] == want
    assert cached.io_counters()[cached.root]["cache_misses"] == 3


def test_a_warm_restart_reads_no_shard_bytes_from_the_store(tmp_path, bucket, failing_proxy):
    local = shards(tmp_path / "data", [10, 10, 10, 10])
    uri = bucket.upload(local, "w")
    bucket.point_at(failing_proxy.endpoint)
    where = f"{uri}/*.parquet"

    def make() -> ArrowSource:
        cache = ShardCache(tmp_path / "shards", max_bytes=1 << 30)
        return ArrowSource(where, chunk_size=5, cache=cache, cache_dir=tmp_path / "meta")

    cold = rows(make())
    assert len(gets(failing_proxy)) == 4  # each shard downloaded once, in one request
    failing_proxy.requests.clear()
    source = make()
    pipeline = zephon.Pipeline(source, [fetch(), batch(4)])
    with pipeline.iter() as loader:
        warm = [int(i) for b in loader for i in b.payload["idx"]]
        stats = loader.stats()["sources"]
    assert warm == cold
    assert gets(failing_proxy) == []
    # The listing, then the version of each shard for its metadata (the fingerprint), and
    # nothing else: the eight reads (two chunks per shard) are served by the cache.
    heads = [r for r in failing_proxy.requests if r.startswith("HEAD ")]
    assert len(heads) == 4 and len(failing_proxy.requests) == 1 + 4
    assert stats == {uri: {"read_bytes": 0, "cache_hits": 8, "cache_misses": 0}}


def _read_all(where: str, cache_dir: str, meta: str, ready, out) -> None:
    # A loader in its own process: waits for the other one, then reads every row.
    cache = ShardCache(cache_dir, max_bytes=1 << 30)
    source = ArrowSource(where, chunk_size=5, cache=cache, cache_dir=meta)
    ready.wait(60)
    out.put(sorted(int(p["idx"]) for p in source.read(source.pointer_rows(np.arange(30)))))


def test_two_processes_share_one_download_of_each_shard(tmp_path, bucket, failing_proxy):
    local = shards(tmp_path / "data", [10, 10, 10])
    uri = bucket.upload(local, "p")
    bucket.point_at(failing_proxy.endpoint)
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Barrier(2)
    out = ctx.Queue()
    args = (f"{uri}/*.parquet", str(tmp_path / "shards"), str(tmp_path / "meta"), ready, out)
    procs = [ctx.Process(target=_read_all, args=args) for _ in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    assert got == [list(range(30))] * 2
    downloads = sorted(r.split()[1].split("?")[0] for r in gets(failing_proxy))
    assert downloads == [f"/{bucket.name}/p/part-{k:03d}.parquet" for k in range(3)]


def test_eviction_keeps_the_bound_and_spares_open_shards(tmp_path, bucket):
    local = shards(tmp_path / "data", [30, 30, 30, 30])
    uri = bucket.upload(local, "e")
    size = (local / "part-000.parquet").stat().st_size
    cache = ShardCache(tmp_path / "shards", max_bytes=2 * size + size // 2)  # two shards fit
    source = ArrowSource(f"{uri}/*.parquet", chunk_size=5, cache=cache)
    paths = [f.path for f in source.files()]
    held = source.open_random(paths[0])
    held.materialize()  # open for reading: never evicted while it is
    for k in (1, 2, 3):
        with source.open_random(paths[k]) as f:
            f.materialize()
            assert f.hit is False
        assert cache.cached_bytes() <= cache.max_bytes
    with source.open_random(paths[0]) as f:
        f.materialize()
        assert f.hit is True and not f.bypassed  # kept: it was open
    held.close()
    with source.open_random(paths[1]) as f:
        f.materialize()
        assert f.hit is False  # the least recently used, evicted for shard 3
    assert cache.cached_bytes() <= cache.max_bytes
    # Every byte still delivered as it is in the bucket.
    assert sorted(rows(source)) == list(range(120))


def test_a_shard_open_twice_in_a_process_shares_one_map(tmp_path, bucket):
    uri = bucket.upload(shards(tmp_path / "data", [10]), "twice")
    cache = ShardCache(tmp_path / "shards", max_bytes=1 << 30)
    source = ArrowSource(f"{uri}/*.parquet", cache=cache)
    (path,) = [f.path for f in source.files()]
    first = source.open_random(path)
    head = first.read_at(4, 0)
    cache.let_go()  # no longer kept, but still read
    with source.open_random(path) as second:
        assert second.read_at(4, 0) == head == b"PAR1" and second.hit is True
    first.close()
    (lock,) = (p for p in (Path(cache.dir) / "locks").iterdir() if p.name != "space.lock")
    with open(lock, "rb") as fh:  # both closed: nothing holds the shard, eviction may have it
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_lance_which_reads_through_its_own_store_refuses_a_cache(tmp_path):
    from zephon.sources.lance import LanceSource

    with pytest.raises(ValueError, match=r"LanceSource .* leave out cache="):
        LanceSource("s3://bucket/data.lance", cache=ShardCache(tmp_path, max_bytes=1 << 20))


def test_a_shard_larger_than_the_cache_is_a_fetch_error_naming_both(tmp_path, bucket):
    local = shards(tmp_path / "data", [30])
    uri = bucket.upload(local, "big")
    cache = ShardCache(tmp_path / "shards", max_bytes=100)
    source = ArrowSource(f"{uri}/*.parquet", cache=cache)
    with pytest.raises(FetchError, match=r"max_bytes=100\) cannot hold .*part-000\.parquet"):
        source.num_samples()


def _cached_behind(tmp_path, bucket, proxy, name: str) -> tuple[str, ShardCache]:
    """One shard of 40 rows written under ``tmp_path / "data"`` and uploaded as ``name``, the
    store reached through ``proxy``: the shards' glob and an empty cache."""
    uri = bucket.upload(shards(tmp_path / "data", [40], group=5), name)
    bucket.point_at(proxy.endpoint)
    return f"{uri}/*.parquet", ShardCache(tmp_path / "shards", max_bytes=1 << 30)


def _only_entry(cache: ShardCache) -> Path:
    (entry,) = Path(cache.dir).glob("*.shard")
    return entry


def test_a_damaged_cache_file_is_fetched_again_never_served(tmp_path, bucket, failing_proxy):
    where, cache = _cached_behind(tmp_path, bucket, failing_proxy, "d")
    assert sorted(rows(ArrowSource(where, chunk_size=5, cache=cache))) == list(range(40))
    entry = _only_entry(cache)
    data = bytearray(entry.read_bytes())
    data[100:110] = b"\0" * 10
    # Rewritten (a new mtime): the record no longer describes the file.
    entry.write_bytes(bytes(data))
    failing_proxy.requests.clear()
    assert sorted(rows(ArrowSource(where, chunk_size=5, cache=cache))) == list(range(40))
    assert len(gets(failing_proxy)) == 1
    # Damaged in place with its size and mtime kept: a process's first open hashes it.
    st = entry.stat()
    with open(entry, "r+b") as fh:
        fh.seek(100)
        fh.write(b"\0" * 10)
    os.utime(entry, ns=(st.st_atime_ns, st.st_mtime_ns))
    failing_proxy.requests.clear()
    fresh = ShardCache(cache.dir, max_bytes=1 << 30)  # as a new process has it
    source = ArrowSource(where, chunk_size=5, cache=fresh)
    assert sorted(rows(source)) == list(range(40))
    assert len(gets(failing_proxy)) == 1
    # Damaged after this process checked it: the content digests refuse it.
    entry = _only_entry(fresh)
    st = entry.stat()
    with open(entry, "r+b") as fh:
        fh.seek(4)
        fh.write(b"\0" * 64)
    os.utime(entry, ns=(st.st_atime_ns, st.st_mtime_ns))
    source.drop_read_caches()
    with pytest.raises(FetchError, match=r"part-000\.parquet.*no longer match their digest"):
        source.read(np.array([[0, 0, 1]]))


def rewrite_reversed(bucket, key: str, kind: str, n: int) -> None:
    """The same rows, in reverse order, written over ``key``."""
    backwards = [{"idx": i, "text": f"row {i}"} for i in reversed(range(n))]
    if kind == "parquet":
        buf = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pylist(backwards), buf, row_group_size=5)
        data = buf.getvalue().to_pybytes()
    else:
        data = "".join(json.dumps(r) + "\n" for r in backwards).encode()
    bucket.overwrite(key, data)


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_an_object_rewritten_after_caching_is_refused_as_without_a_cache(tmp_path, bucket, kind):
    local = shards(tmp_path / "data", [40], group=5)
    uri = bucket.upload(local, "g")
    key = f"g/part-000.{kind}"
    where = f"{uri}/*.{kind}"
    cache = ShardCache(tmp_path / "shards", max_bytes=1 << 30)
    meta = tmp_path / "meta"
    src = MAKE[kind](where, chunk_size=5, cache=cache, cache_dir=meta)
    pipeline = zephon.Pipeline(src, [fetch(), batch(4)])
    with pipeline.iter() as loader:
        next(loader)
        state = loader.state_dict()
    before = bucket.etag(key)
    rewrite_reversed(bucket, key, kind, 40)
    after = bucket.etag(key)
    # The source keeps the version it pinned, and its copy is that version's bytes.
    assert src.read(np.array([[0, 0, 17]]))[0]["idx"] == 17
    # A copy it has to fetch again is refused, naming both versions, as an uncached read is.
    for entry in Path(cache.dir).glob("*.shard"):
        entry.unlink()
    src.drop_read_caches()
    with pytest.raises(FetchError) as info:
        src.read(np.array([[0, 0, 17]]))
    message = str(info.value)
    assert f"{uri}/part-000.{kind}" in message
    assert f"ETag {before} then, ETag {after} now" in message
    # A restart sees the new version: the checkpoint of the old one is refused.
    again = MAKE[kind](where, chunk_size=5, cache=cache, cache_dir=meta)
    with pytest.raises(CheckpointMismatchError, match=rf"file 'part-000\.{kind}' changed"):
        zephon.Pipeline(again, [fetch(), batch(4)]).iter(state=state).close()


def test_read_ahead_downloads_the_next_shards_and_stops_on_close(tmp_path, bucket):
    local = shards(tmp_path / "data", [8, 8, 8, 8])
    uri = bucket.upload(local, "r")
    cache = ShardCache(tmp_path / "shards", max_bytes=1 << 30, prefetch_shards=2)
    source = ArrowSource(f"{uri}/*.parquet", chunk_size=8, cache=cache)
    source.num_samples()  # the metadata reads download every shard: start from an empty cache
    for entry in Path(cache.dir).glob("*.shard"):
        entry.unlink()
    pipeline = zephon.Pipeline(source, [fetch(), batch(4)])
    with pipeline.iter() as loader:
        first = next(loader)
        assert [int(i) for i in first.payload["idx"]] == [0, 1, 2, 3]
        # Chunk 0 announced chunks 1 and 2 (shards 1 and 2): downloaded without a read.
        assert wait_until(lambda: len(list(Path(cache.dir).glob("*.shard"))) >= 3, 60)
    assert not [t for t in lane_threads() if t.name == "zephon-shard-prefetch"]


def test_a_mixture_hands_the_chunks_ahead_to_its_cached_components(tmp_path, bucket):
    cache = ShardCache(tmp_path / "shards", max_bytes=1 << 30, prefetch_shards=8)
    parts = {}
    for d, name in enumerate("ab"):
        uri = bucket.upload(shards(tmp_path / name, [6, 6, 6]), name)
        parts[name] = ArrowSource(f"{uri}/*.parquet", dataset_id=d, chunk_size=4, cache=cache)
    mixture = MixtureSource(parts, {"a": 0.5, "b": 0.5}, chunk_size=4)
    assert mixture.read_ahead_chunks() == ArrowSource.READ_AHEAD_CHUNKS
    mixture.num_chunks()  # the metadata reads download every shard: start from an empty cache
    for entry in Path(cache.dir).glob("*.shard"):
        entry.unlink()
    mixture.upcoming(list(range(mixture.total_chunks() or 0)))
    assert wait_until(lambda: len(list(Path(cache.dir).glob("*.shard"))) == 6, 60)
    mixture.drop_read_caches()
    assert not [t for t in lane_threads() if t.name == "zephon-shard-prefetch"]


def test_stats_and_metrics_count_bytes_hits_and_misses_from_worker_processes(tmp_path, bucket):
    local = shards(tmp_path / "data", [10, 10, 10, 10])
    uri = bucket.upload(local, "m")
    where = f"{uri}/*.parquet"
    total = sum((local / f"part-{k:03d}.parquet").stat().st_size for k in range(4))
    source = ArrowSource(where, chunk_size=10, cache=ShardCache(tmp_path / "s", max_bytes=1 << 30))
    source.num_samples()  # downloads every shard in this process: misses, and their bytes
    pipeline = zephon.Pipeline(source, [fetch(), batch(5)], lanes=2, workers="process")
    with pipeline.iter() as loader:
        assert sorted(int(i) for b in loader for i in b.payload["idx"]) == list(range(40))
        stats = loader.stats()
    # Four shards downloaded here; each worker then opened its two shards from the cache.
    assert stats["sources"] == {uri: {"read_bytes": total, "cache_hits": 4, "cache_misses": 4}}
    families = {f.name: f.samples for f in metric_families(stats, rank=0)}
    assert families["zephon_source_read_bytes_total"] == [({"rank": "0", "source": uri}, total)]
    assert families["zephon_shard_cache_hits_total"] == [({"rank": "0", "source": uri}, 4.0)]
    assert families["zephon_shard_cache_misses_total"] == [({"rank": "0", "source": uri}, 4.0)]
    scraped = [(f.name, f.samples) for f in metric_families(stats, rank=0)]
    assert stats_from_families(scraped)["sources"] == stats["sources"]


def test_arrow_ipc_files_read_through_the_cache_as_without_it(tmp_path, bucket):
    local = tmp_path / "ipc"
    local.mkdir()
    for k in range(3):
        table = pa.table({"idx": list(range(k * 10, k * 10 + 10))})
        with pa.ipc.new_file(local / f"part-{k}.arrow", table.schema) as out:
            for part in table.to_batches(max_chunksize=4):
                out.write_batch(part)
    uri = bucket.upload(local, "ipc")
    cache = ShardCache(tmp_path / "shards", max_bytes=1 << 30)
    plain = ArrowSource(f"{uri}/*.arrow", chunk_size=4, shuffle=True)
    cached = ArrowSource(f"{uri}/*.arrow", chunk_size=4, shuffle=True, cache=cache)
    assert cached.describe() == plain.describe()
    assert rows(cached) == rows(plain)


def a_damaged_copy_held_open(tmp_path: Path, bucket: Any) -> tuple[str, Any]:
    """The files of a one-shard dataset of 40 rows (8 chunks) in the bucket, and a reader that
    has the shard open through a cache in ``tmp_path / "shards"`` (its lock shared), as a
    process does while it reads; the cached copy is then damaged (a new mtime: not intact)."""
    uri = bucket.upload(shards(tmp_path / "data", [40], group=5), "d")
    where = f"{uri}/*.parquet"
    holder = ArrowSource(
        where, chunk_size=5, cache=ShardCache(tmp_path / "shards", max_bytes=1 << 30)
    )
    (path,) = [f.path for f in holder.files()]
    held = holder.open_random(path)
    held.materialize()
    (entry,) = Path(tmp_path / "shards").glob("*.shard")
    entry.write_bytes(entry.read_bytes()[:-1] + b"\0")
    return where, held


def test_a_copy_another_process_keeps_open_is_read_past_not_waited_for(
    tmp_path, bucket, failing_proxy
):
    # Another process that needs the copy cannot take the lock to download it again: it reads
    # from the store this time instead of waiting for the holder.
    where, held = a_damaged_copy_held_open(tmp_path, bucket)
    bucket.point_at(failing_proxy.endpoint)
    other = ShardCache(tmp_path / "shards", max_bytes=1 << 30)  # as another process has it
    got: list[list[int]] = []
    reader = threading.Thread(
        target=lambda: got.append(rows(ArrowSource(where, chunk_size=5, cache=other))),
        daemon=True,
    )
    failing_proxy.requests.clear()
    reader.start()
    reader.join(timeout=60)  # a generous deadline; it used to wait for the holder for good
    stuck = reader.is_alive()
    held.close()
    reader.join(timeout=60)
    assert not stuck, "a reader waited for a lock another process keeps"
    assert sorted(got[0]) == list(range(40))
    assert gets(failing_proxy)  # read from the store


@pytest.mark.timing
def test_a_reader_waits_for_a_copy_another_process_keeps_open_once_not_at_every_read(
    tmp_path, bucket
):
    # Eight chunks of one shard whose damaged copy another process keeps open: the reader waits
    # LOCK_WAIT for it once, then reads the store without waiting again, not once per chunk.
    where, held = a_damaged_copy_held_open(tmp_path, bucket)
    other = ShardCache(tmp_path / "shards", max_bytes=1 << 30)
    other.LOCK_WAIT = 1.0
    began = time.monotonic()
    try:
        got = rows(ArrowSource(where, chunk_size=5, cache=other))
    finally:
        held.close()
    waited = time.monotonic() - began
    assert sorted(got) == list(range(40))
    assert waited < 4 * other.LOCK_WAIT, f"the reader waited {waited:.1f} s for 8 chunks"


needs_proc = pytest.mark.skipif(
    not os.path.exists("/proc/self/maps"), reason="reads /proc/self/fd and /proc/self/maps"
)


def _held_in(directory: str) -> tuple[list[str], list[str]]:
    """The file descriptors and the memory maps this process has open on files in
    ``directory`` (lock files included)."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(directory + os.sep):
                fds.append(target)
    with open("/proc/self/maps") as fh:
        maps = [line.split()[-1] for line in fh if f" {directory}{os.sep}" in line]
    return fds, maps


def test_a_cached_shard_reads_as_the_file_and_refuses_reads_once_closed(tmp_path, bucket):
    local = shards(tmp_path / "data", [20])
    uri = bucket.upload(local, "r")
    data = (local / "part-000.parquet").read_bytes()
    source = ArrowSource(
        f"{uri}/*.parquet", cache=ShardCache(tmp_path / "shards", max_bytes=1 << 30)
    )
    (path,) = [f.path for f in source.files()]
    with source.open_random(path) as shard:
        assert shard.hit is None  # nothing opened before the first read
        assert shard.seek(4) == 4 and shard.tell() == 4
        assert shard.read(6) == data[4:10] and shard.tell() == 10
        assert shard.read_buffer(5).to_pybytes() == data[10:15]
        assert shard.read_at(8, len(data) - 8) == data[-8:] and shard.tell() == 15
        assert shard.hit is False  # this first open downloaded it
    for call in (lambda: shard.read(1), lambda: shard.read_at(1, 0), lambda: shard.seek(0)):
        with pytest.raises(ValueError):
            call()
    unread = source.open_random(path)
    unread.close()
    with pytest.raises(ValueError, match=r"closed cached shard .*part-000\.parquet"):
        unread.read_at(4, 0)


@needs_proc
def test_a_pass_through_the_cache_leaves_no_descriptor_or_map_behind(tmp_path, bucket):
    uri = bucket.upload(shards(tmp_path / "data", [10] * 8), "f")
    cache = ShardCache(tmp_path / "shards", max_bytes=1 << 30)
    source = ArrowSource(f"{uri}/*.parquet", chunk_size=5, cache=cache)
    for _ in range(2):  # a cold pass (downloads), then a warm one (hits)
        assert sorted(rows(source)) == list(range(80))
        fds, maps = _held_in(cache.dir)
        # What remains open is what the cache keeps between reads, one lock and one map each.
        kept = [p for p in fds if p.endswith(".lock")]
        assert len(kept) <= ShardCache.KEPT_OPEN
        assert len(maps) == len(kept) and sorted(set(maps)) == sorted(maps)
        assert all(p.endswith(".shard") for p in maps)
        source.drop_read_caches()
        assert _held_in(cache.dir) == ([], [])


@needs_proc
def test_an_entry_replaced_on_disk_while_kept_open_is_not_served(tmp_path, bucket, failing_proxy):
    # The copy is swapped for another file (a new inode) of the same size and mtime while
    # this process keeps the entry open between reads: the next read must notice the swap
    # (the file is no longer the one mapped and checked) and fetch the shard again.
    where, cache = _cached_behind(tmp_path, bucket, failing_proxy, "x")

    def read_all() -> list[int]:
        source = ArrowSource(where, chunk_size=5, cache=cache)
        return sorted(int(p["idx"]) for p in source.read(source.pointer_rows(np.arange(40))))

    assert read_all() == list(range(40))
    entry = _only_entry(cache)
    assert _held_in(cache.dir)[1] == [str(entry)]  # kept open (mapped) between reads
    st = entry.stat()
    swapped = entry.with_name("swapped")
    data = bytearray(entry.read_bytes())
    data[100:110] = b"\0" * 10
    swapped.write_bytes(bytes(data))
    os.utime(swapped, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(swapped, entry)
    failing_proxy.requests.clear()
    assert read_all() == list(range(40))
    assert len(gets(failing_proxy)) == 1  # fetched again, once
    assert entry.read_bytes() == (tmp_path / "data" / "part-000.parquet").read_bytes()
    cache.let_go()
    assert _held_in(cache.dir) == ([], [])


# ------------------------------------------------------------------- space, without a store

PIECE = bytes(range(256)) * 16  # every shard of these tests: 4 KiB


def _put(cache: ShardCache, k: int, download=None) -> bool:
    """Shard ``k`` opened through ``cache`` (downloaded when missing, from ``PIECE``): its hit."""

    def whole(write) -> int:
        write(PIECE)
        return len(PIECE)

    shard = cache.open(f"s3://b/part-{k}", "v1", len(PIECE), download or whole, lambda: None)
    with shard:
        assert shard.read_at(len(PIECE), 0) == PIECE
        return bool(shard.hit)


def _never(write) -> int:
    raise AssertionError("downloaded a shard the cache holds")


def _ledger(cache: ShardCache) -> bytes:
    return (Path(cache.dir) / "locks" / "space.lock").read_bytes()


def test_downloads_read_no_other_record_until_the_cache_is_full(tmp_path, monkeypatch):
    # Every download used to read every record in the directory to total the space: filling a
    # cache of N shards read N^2 / 2 records. The ledger leaves that to the downloads that may
    # have to evict, and an eviction leaves room for the next few.
    cache = ShardCache(tmp_path, max_bytes=20 * len(PIECE))
    scans: list[int] = []
    real = ShardCache._entries

    def counted(self):
        scans.append(1)
        return real(self)

    monkeypatch.setattr(ShardCache, "_entries", counted)
    for k in range(20):
        assert _put(cache, k) is False
    assert len(scans) == 1  # the first download, before there was a ledger
    for k in range(20, 50):
        assert _put(cache, k) is False
        assert sum(p.stat().st_size for p in Path(tmp_path).glob("*.shard")) <= cache.max_bytes
    # Full from the 21st on: an eviction brings it down to 90 %, room for two more downloads.
    assert len(scans) <= 1 + 30 // 3 + 1
    assert _ledger(cache) == b"%d\n" % cache.cached_bytes()
    assert _put(cache, 49) is True and _put(cache, 0) is False  # the oldest went first


def test_a_ledger_left_high_or_lost_keeps_the_bound(tmp_path):
    cache = ShardCache(tmp_path, max_bytes=10 * len(PIECE))
    for k in range(8):
        _put(cache, k)
    # Entries deleted by hand: the ledger still counts them, until a download must evict.
    for entry in sorted(Path(tmp_path).glob("*.shard"))[:4]:
        entry.unlink()
        entry.with_suffix(".json").unlink()
    assert cache.cached_bytes() == 4 * len(PIECE)
    for k in range(8, 12):
        _put(cache, k)
        assert cache.cached_bytes() <= cache.max_bytes
    assert cache.cached_bytes() == 8 * len(PIECE)  # the space they left is used again
    assert _ledger(cache) == b"%d\n" % (8 * len(PIECE))
    # A ledger cut short (a write its process did not finish): the next download counts every
    # entry again.
    (Path(tmp_path) / "locks" / "space.lock").write_bytes(b"12")
    for k in range(12, 16):
        _put(cache, k)
        assert cache.cached_bytes() <= cache.max_bytes
    assert _ledger(cache) == b"%d\n" % cache.cached_bytes()


def _die_halfway(directory: str) -> None:
    def half(write) -> int:
        write(PIECE[: len(PIECE) // 2])
        os._exit(3)  # killed mid-download: its lock goes with it, its bytes stay

    _put(ShardCache(directory, max_bytes=1 << 20), 7, half)


def test_a_download_killed_halfway_is_replaced_by_the_next_one(tmp_path):
    child = multiprocessing.get_context("fork").Process(target=_die_halfway, args=(str(tmp_path),))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 3
    assert len(list(Path(tmp_path).glob(".*.tmp"))) == 1
    assert not list(Path(tmp_path).glob("*.shard"))
    cache = ShardCache(tmp_path, max_bytes=1 << 20)
    assert _put(cache, 7) is False and _put(cache, 7) is True
    assert not list(Path(tmp_path).glob(".*.tmp"))
    assert cache.cached_bytes() == len(PIECE)


@needs_proc
def test_a_buffer_read_from_a_shard_outlives_its_close_and_eviction(tmp_path):
    # read_buffer hands out the cache's own map, no copy: closing the shard, letting it go and
    # evicting it must neither free those bytes under the buffer nor keep the map past it.
    cache = ShardCache(tmp_path / "shards", max_bytes=len(PIECE))
    assert _put(cache, 0) is False
    with cache.open("s3://b/part-0", "v1", len(PIECE), _never, lambda: None) as s:
        kept = s.read_buffer(100)
        assert s.hit is True
    cache.let_go()
    assert _put(cache, 1) is False  # room for part-1 only: part-0 is evicted
    assert not Path(cache.shard_path(ShardCache.key("s3://b/part-0", "v1", len(PIECE)))).exists()
    assert kept.to_pybytes() == PIECE[:100]
    del kept, s
    cache.let_go()
    assert _held_in(cache.dir) == ([], [])


def test_an_empty_object_is_cached_and_read_as_empty(tmp_path):
    cache = ShardCache(tmp_path / "shards", max_bytes=1 << 20)
    for hit in (False, True):
        with cache.open("s3://b/empty", "v1", 0, lambda write: 0, lambda: None) as shard:
            assert shard.read() == b"" and shard.hit is hit


class _MeetingCache(ShardCache):
    """A cache whose readers, on their first look at the entry, wait for each other there: two
    readers (threads of one process, or two caches on one directory as two processes have) that
    both find the shard missing at once."""

    meeting: threading.Barrier
    seen: threading.local

    def _intact(self, key: str, uri: str, version: str, size: int):
        found = super()._intact(key, uri, version, size)
        first = getattr(self.seen, "first", True)
        self.seen.first = False
        if first:
            self.meeting.wait(timeout=60)
        return found


@pytest.mark.parametrize("caches", [1, 2], ids=["threads of one process", "two processes"])
def test_two_readers_that_miss_a_shard_at_once_share_one_download(tmp_path, caches):
    # Both hold the entry's lock shared when they find it missing; the first to ask for it
    # exclusively lets its shared hold go and loses. The loser used to wait LOCK_WAIT for the
    # winner's copy to be let go (it is kept open) and read from the store past the cache.
    meeting = threading.Barrier(2)
    made = []
    for _ in range(caches):
        cache = _MeetingCache(tmp_path / "shards", max_bytes=1 << 20)
        cache.meeting, cache.seen = meeting, threading.local()
        made.append(cache)
    downloads: list[str] = []
    direct: list[str] = []

    def whole(write) -> int:
        downloads.append(threading.current_thread().name)
        write(PIECE)
        return len(PIECE)

    def store() -> pa.BufferReader:
        direct.append(threading.current_thread().name)
        return pa.BufferReader(PIECE)

    def read(cache: ShardCache) -> None:
        with cache.open("s3://b/x", "v1", len(PIECE), whole, store) as s:
            assert s.read_at(len(PIECE), 0) == PIECE

    readers = [
        threading.Thread(target=read, args=(made[k % caches],), name=f"reader-{k}")
        for k in range(2)
    ]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(timeout=120)
    assert not any(reader.is_alive() for reader in readers)
    assert len(downloads) == 1 and direct == [], "one download, and no read past the cache"
    for cache in made:
        cache.let_go()
