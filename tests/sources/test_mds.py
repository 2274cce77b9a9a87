"""MDSSource over directories written by Mosaic's own MDSWriter (streaming-community), raw and
zstd-compressed, locally and on the loopback S3 server."""

from __future__ import annotations

import pickle
import re
import shutil
from collections import Counter
from decimal import Decimal
from functools import partial
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from format_kit import (
    assert_a_changed_dataset_is_refused,
    assert_a_changed_object_is_refused,
    assert_a_copy_reads_the_same,
    assert_a_file_rewritten_under_a_reader_is_refused,
    assert_a_killed_worker_resumes_exactly,
    assert_a_shard_cache_bounds_decompressed_shards,
    assert_a_small_shard_cache_resumes_exactly_in_process_lanes,
    assert_columns_pick_and_order,
    assert_each_sample_twice,
    assert_resumes_exactly,
    assert_resumes_on_two_ranks_and_relanes,
    assert_same_values,
    every_sample,
    kept_decompressed_bytes,
    largest_decompressed_shard,
)
from mds_kit import mds_writer
from worker_kit import wait_until

import zephon
from zephon.errors import FetchError, PlanError
from zephon.ops import batch, fetch
from zephon.sources import MDSSource, ShardCache, open_source

N = 60
COLUMNS = {
    "idx": "int",
    "text": "str",
    "raw": "bytes",
    "small": "int8",
    "count": "uint32",
    "big": "uint64",
    "half": "float16",
    "score": "float64",
    "digits": "str_int",
    "ratio": "str_float",
    "price": "str_decimal",
    "meta": "json",
    "tokens": "ndarray",
    "pair": "ndarray:int32:2",
    "row": "ndarray:float32",
}


def sample(i: int) -> dict[str, Any]:
    return {
        "idx": i,
        "text": f"sample {i} é",
        "raw": bytes([i % 256]) * (1 + i % 4),
        "small": np.int8(-i % 100),
        "count": np.uint32(i * 1000),
        "big": np.uint64(2**63 + i),
        "half": np.float16(i / 4),
        "score": np.float64(i / 3),
        "digits": 10**20 + i,
        "ratio": i / 7,
        "price": Decimal(f"{i}.25"),
        "meta": {"i": i, "tags": ["a"] * (i % 3)},
        "tokens": np.arange(1 + i % 9, dtype=np.int64).reshape(-1, 1) + i,
        "pair": np.array([i, -i], dtype=np.int32),
        "row": np.full(1 + i % 4, i, dtype=np.float32),
    }


def write(root: Path, compression: str | None = None, n: int = N, **columns: str) -> Path:
    writer = mds_writer()
    with writer(
        out=str(root), columns=columns or COLUMNS, compression=compression, size_limit=2048
    ) as out:
        for i in range(n):
            row = sample(i)
            out.write({k: row[k] for k in columns or COLUMNS})
    return root


def assert_written(got: dict[str, Any]) -> None:
    want = sample(got["idx"])
    assert list(got) == sorted(COLUMNS)
    assert_same_values(got, want)


# --------------------------------------------------------------------------- coverage


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_sample_once_per_pass_with_the_writers_values(tmp_path, compression, shuffle):
    root = write(tmp_path / "mds", compression)
    src = MDSSource(root, chunk_size=7, shuffle=shuffle, passes=2, cache_dir=tmp_path / "c")
    assert len(src.files()) > 3, "the data should span several shards"
    assert_each_sample_twice(src, N, itemgetter("idx"), assert_written)


def test_columns_pick_and_order_the_payload(tmp_path):
    assert_columns_pick_and_order(
        partial(MDSSource, write(tmp_path)), {"text": "sample 0 é", "idx": 0}
    )


def test_pickled_columns_need_allow_pickle(tmp_path):
    write(tmp_path, idx="int", meta="pkl")
    with pytest.raises(PlanError, match=r"'meta' .* is pickled; .*allow_pickle=True"):
        MDSSource(tmp_path).num_samples()
    assert MDSSource(tmp_path, columns=["idx"]).num_samples() == N
    src = MDSSource(tmp_path, allow_pickle=True)
    assert [p["meta"] for p in every_sample(src)] == [sample(i)["meta"] for i in range(N)]


def test_a_truncated_shard_is_a_fetch_error_naming_it(tmp_path):
    write(tmp_path)
    shard = tmp_path / "shard.00001.mds"
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(FetchError, match=r"shard\.00001\.mds.*holds \d+ bytes, its index"):
        MDSSource(tmp_path).num_samples()


def test_open_source_picks_mds_for_the_directory_and_its_index(tmp_path):
    write(tmp_path, "zstd")
    for given in (tmp_path, tmp_path / "index.json"):
        src = open_source(given, cache_dir=tmp_path / "c")
        assert type(src) is MDSSource and src.num_samples() == N


# --------------------------------------------------------------------------- pipelines


def pipeline(
    root: Path | str, cache: Path, shards: ShardCache | None = None, **kw: Any
) -> zephon.Pipeline:
    src = MDSSource(
        root, columns=["idx", "tokens"], chunk_size=5, shuffle=True, cache_dir=cache, cache=shards
    )
    return zephon.Pipeline(src, [fetch(), batch(3)], **kw)


def delivered(items: list[Any]) -> Counter:
    return Counter(r.payload["idx"] for item in items for r in item)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_resumes_exactly_at_any_step(tmp_path, compression):
    root = write(tmp_path / "d", compression)
    assert_resumes_exactly(partial(pipeline, root, tmp_path / "c"), lambda n: (0, 3, 9, n - 1))


@pytest.mark.usefixtures("no_leftover_workers")
def test_a_killed_worker_resumes_exactly(tmp_path):
    root = write(tmp_path / "d", "zstd")
    assert_a_killed_worker_resumes_exactly(partial(pipeline, root, tmp_path / "c"), 4)


def test_a_job_of_four_ranks_resumes_on_two_and_relanes(tmp_path):
    make = partial(pipeline, write(tmp_path / "d"), tmp_path / "c")
    assert_resumes_on_two_ranks_and_relanes(make, delivered, Counter(range(N)))


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_rewritten_shard_is_a_checkpoint_mismatch(tmp_path, compression):
    root = write(tmp_path / "d", compression)

    def rewrite() -> None:
        shutil.rmtree(root)
        write(root, compression, n=N + 1)  # the same shards but the last, which gains a sample

    make = partial(pipeline, root, tmp_path / "c")

    def last() -> str:
        return re.escape(sorted(p.name for p in root.glob("shard.*"))[-1])

    assert_a_changed_dataset_is_refused(make, rewrite, last)


# --------------------------------------------------------------------------- a bounded cache


def test_a_shard_cache_bounds_the_decompressed_copies_of_compressed_shards(tmp_path):
    root = write(tmp_path / "d", "zstd")
    assert_a_shard_cache_bounds_decompressed_shards(
        partial(MDSSource, root, chunk_size=7, shuffle=True), tmp_path, "idx", assert_written
    )


def test_a_bucket_copy_keeps_downloads_and_decompressed_copies_within_the_shard_cache(
    tmp_path, bucket
):
    uri = bucket.upload(write(tmp_path / "local", "zstd"), "mds-bounded")
    assert_a_shard_cache_bounds_decompressed_shards(
        partial(MDSSource, uri, chunk_size=7, shuffle=True), tmp_path, "idx", assert_written
    )


@pytest.mark.usefixtures("no_leftover_workers")
def test_compressed_shards_through_a_small_shard_cache_resume_exactly_in_process_lanes(tmp_path):
    root = write(tmp_path / "d", "zstd")
    assert_a_small_shard_cache_resumes_exactly_in_process_lanes(
        partial(MDSSource, root), partial(pipeline, root), tmp_path, 7
    )


def test_a_decompressed_copy_is_not_evicted_while_bytes_read_from_it_are_alive(tmp_path):
    root = write(tmp_path / "d", "zstd")
    largest = largest_decompressed_shard(partial(MDSSource, root), tmp_path / "plain")
    cache = ShardCache(tmp_path / "shards", max_bytes=2 * largest)
    src = MDSSource(root, chunk_size=7, shuffle=True, cache_dir=tmp_path / "c", cache=cache)
    src.num_samples()
    shard = src._shard(0)
    view = src._mapped(0, shard, src.chunk(0).pointers[0]).data[:64]
    key = cache.key(
        src.files()[0].uri + MDSSource.INFLATED_SUFFIX, shard.stored.identity(), shard.raw_size
    )
    entry = Path(cache.shard_path(key))
    head = entry.read_bytes()[:64]
    cache.let_go()  # only the view holds the entry now
    other = pickle.loads(pickle.dumps(src))  # its own cache object: as another process
    every_sample(other)  # evicts every other copy, again and again
    assert entry.read_bytes()[:64] == bytes(view) == head
    del view
    assert not cache._live, "the entry is still open with nothing read from it alive"


def test_a_shard_finding_no_room_in_the_shard_cache_is_decompressed_in_memory_that_time(tmp_path):
    root = write(tmp_path / "d", "zstd")
    largest = largest_decompressed_shard(partial(MDSSource, root), tmp_path / "plain")
    plain = every_sample(MDSSource(root, chunk_size=7, shuffle=True, cache_dir=tmp_path / "plain"))
    cache = ShardCache(tmp_path / "shards", max_bytes=largest * 3 // 2)
    src = MDSSource(root, chunk_size=7, shuffle=True, cache_dir=tmp_path / "c", cache=cache)
    src.num_samples()
    view = src._mapped(0, src._shard(0), src.chunk(0).pointers[0]).data[:64]
    cache.let_go()
    other = pickle.loads(pickle.dumps(src))  # no other copy fits beside the one held open
    got = every_sample(other)
    assert [g["idx"] for g in got] == [g["idx"] for g in plain]
    assert len(list(Path(cache.dir).glob("*.shard"))) == 1
    assert kept_decompressed_bytes(tmp_path / "c", cache) <= cache.max_bytes
    del view


def test_a_decompressed_shard_larger_than_the_shard_cache_is_a_fetch_error_naming_it(tmp_path):
    root = write(tmp_path / "d", "zstd")
    largest = largest_decompressed_shard(partial(MDSSource, root), tmp_path / "plain")
    cache = ShardCache(tmp_path / "shards", max_bytes=largest - 1)
    with pytest.raises(
        FetchError,
        match=r"shard\.\d+\.mds\.zstd.*decompresses to \d+ bytes, more than ShardCache\(.*"
        r"max_bytes=\d+.*raise max_bytes above the largest decompressed shard",
    ):
        MDSSource(root, cache_dir=tmp_path / "c", cache=cache).num_samples()


# --------------------------------------------------------------------------- remote


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_bucket_copy_delivers_the_local_samples(tmp_path, bucket, compression):
    local = write(tmp_path / "local", compression)
    uri = bucket.upload(local, f"mds-{compression}")
    here = MDSSource(local, chunk_size=6, shuffle=True, cache_dir=tmp_path / "c1")
    there = MDSSource(uri, chunk_size=6, shuffle=True, cache_dir=tmp_path / "c2")
    got = assert_a_copy_reads_the_same(here, there, "idx")
    for g in got:
        assert_written(g)


def test_a_changed_remote_block_is_refused(tmp_path, bucket):
    assert_a_changed_object_is_refused(
        bucket,
        write(tmp_path / "local"),
        "mds-changed",
        "shard.00000.mds",
        partial(MDSSource, cache_dir=tmp_path / "c"),
        flip=-3,
        match=r"shard\.00000\.mds.*no longer matches the digest",
    )


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_bucket_copy_resumes_exactly(tmp_path, bucket, compression):
    uri = bucket.upload(write(tmp_path / "local", compression), f"mds-resume-{compression}")
    assert_resumes_exactly(partial(pipeline, uri, tmp_path / "c"), lambda n: (6,))


def test_a_local_shard_rewritten_since_it_was_indexed_is_refused_on_read(tmp_path):
    root = write(tmp_path)
    assert_a_file_rewritten_under_a_reader_is_refused(
        MDSSource(root, chunk_size=5),
        root / "shard.00000.mds",
        flip=-2,
        match=r"shard\.00000\.mds.*changed since it was indexed",
    )


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_bucket_copy_read_through_a_shard_cache_and_ahead_of_its_reads(
    tmp_path, bucket, compression
):
    local = write(tmp_path / "local", compression)
    uri = bucket.upload(local, f"mds-cached-{compression}")
    here = MDSSource(local, chunk_size=6, shuffle=True, cache_dir=tmp_path / "c1")
    cache = ShardCache(tmp_path / "shards", max_bytes=1 << 30, prefetch_shards=64)
    there = MDSSource(uri, chunk_size=6, shuffle=True, cache_dir=tmp_path / "c2", cache=cache)
    assert there.describe() == here.describe()
    for entry in Path(cache.dir).glob("*.shard"):
        entry.unlink()  # the metadata reads cached every shard: start from an empty cache
    # Announced chunks have their shards downloaded in the background, before any read.
    there.upcoming(list(range(there.num_chunks())))
    shards = len(there.files())
    assert wait_until(lambda: len(list(Path(cache.dir).glob("*.shard"))) == shards, 60)
    there.drop_read_caches()
    got = every_sample(there)
    assert [g["idx"] for g in got] == [g["idx"] for g in every_sample(here)]
    assert there.io_counters()[there.root]["cache_misses"] == 2 * shards  # metadata, then ahead


def test_a_shard_rewritten_at_its_size_on_a_store_without_mtime_or_version_is_read_anew(
    tmp_path,
):
    # A memory:// store gives no mtime and no version: the sidecar in the cache directory cannot
    # tell the rewrite, so a new source digests the shard again (and inflates the new content)
    # rather than reading what the old digests named.
    import fsspec

    memory = fsspec.filesystem("memory")

    def text(letter: str) -> Path:
        root = tmp_path / letter
        columns = {"idx": "int", "text": "str"}
        with mds_writer()(out=str(root), columns=columns, compression="zstd") as out:
            for i in range(20):
                out.write({"idx": i, "text": f"{letter}{i:04d}"})
        return root

    by_size: dict[int, Path] = {}
    for letter in "abcdefghijkl":  # two datasets whose compressed shards have one size
        root = text(letter)
        size = (root / "shard.00000.mds.zstd").stat().st_size
        if size in by_size:
            first, second = by_size[size], root
            break
        by_size[size] = root
    else:
        pytest.fail("no two shards of one compressed size")

    def put(root: Path) -> None:
        for path in root.iterdir():
            memory.pipe(f"/{tmp_path.name}/{path.name}", path.read_bytes())

    uri = f"memory:///{tmp_path.name}"
    put(first)
    before = MDSSource(uri, cache_dir=tmp_path / "c")
    assert before.read(before.chunk(0).pointers[:1])[0]["text"] == f"{first.name}0000"
    put(second)
    after = MDSSource(uri, cache_dir=tmp_path / "c")
    assert after.read(after.chunk(0).pointers[:1])[0]["text"] == f"{second.name}0000"
    assert after.describe() != before.describe()


def test_an_ndarray_value_cut_to_nothing_is_a_fetch_error_naming_its_shard_and_column(tmp_path):
    columns = {"arr": "ndarray", "idx": "int"}
    with mds_writer()(out=str(tmp_path), columns=columns) as out:
        for i in range(3):
            out.write({"arr": np.arange(i + 1, dtype=np.int32), "idx": i})
    shard = tmp_path / "shard.00000.mds"
    data = bytearray(shard.read_bytes())
    at = int(np.frombuffer(data, "<u4", count=1, offset=4 + 4 * 2)[0])  # sample 2
    data[at : at + 4] = np.uint32(0).tobytes()  # its array's size: no dtype code, no shape
    shard.write_bytes(bytes(data))
    src = MDSSource(tmp_path, chunk_size=3)
    with pytest.raises(FetchError, match=r"shard\.00000\.mds.*sample 2, column 'arr' \(ndarray\)"):
        src.read(src.chunk(0).pointers)


def test_a_shard_the_index_names_answering_503_is_retried_then_named(
    tmp_path, bucket, failing_proxy
):
    uri = bucket.upload(write(tmp_path / "local"), "mds-503")
    bucket.point_at(failing_proxy.endpoint)
    failing_proxy.fail_paths = {"/shard.00002.mds": 1}  # its HEAD, while the index is listed
    assert MDSSource(uri, cache_dir=tmp_path / "c").num_samples() == N
    assert failing_proxy.failed == 1
    failing_proxy.fail_paths = {"/shard.00002.mds": 100}
    with pytest.raises(FetchError, match=rf"{uri}/shard\.00002\.mds.*gave up after 4 attempts"):
        MDSSource(uri, cache_dir=tmp_path / "c").num_samples()
