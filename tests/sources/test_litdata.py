"""LitDataSource over directories written by LitData's own writer (``BinaryWriter``), raw and
in each of its zstd layouts, locally and on the loopback S3 server."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
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
    assert_a_killed_worker_resumes_exactly,
    assert_a_shard_cache_bounds_decompressed_shards,
    assert_a_small_shard_cache_resumes_exactly_in_process_lanes,
    assert_columns_pick_and_order,
    assert_each_sample_twice,
    assert_resumes_exactly,
    assert_resumes_on_two_ranks_and_relanes,
    assert_same_values,
    every_sample,
    largest_decompressed_shard,
)
from litdata.streaming.writer import BinaryWriter

import zephon
from zephon.errors import FetchError, PlanError
from zephon.ops import batch, fetch
from zephon.sources import LitDataSource, ShardCache, open_source

N = 40
#: LitData's zstd layouts: framed (its default), whole-file ``.zstd.bin``, one frame per item.
LAYOUTS = {
    "raw": {},
    "batch": {"compression": "zstd"},
    "chunk": {"compression": "zstd", "compression_level": "chunk"},
    "sample": {"compression": "zstd", "compression_level": "sample"},
}


def sample(i: int) -> dict[str, Any]:
    return {
        "idx": i,
        "text": f"sample {i} é",
        "raw": bytes([i % 256]) * (1 + i % 4),
        "score": i / 3,
        "flag": i % 2 == 0,
        "tokens": np.arange(1 + i % 6, dtype=np.int32) + i,
        "grid": np.full((2, 1 + i % 3), i, dtype=np.float32),
    }


def write(root: Path, layout: str = "raw", n: int = N, **kw: Any) -> Path:
    writer = BinaryWriter(str(root), chunk_bytes=600, **{**LAYOUTS[layout], **kw})
    for i in range(n):
        writer[i] = sample(i)
    writer.done()
    writer.merge()
    return root


def assert_written(got: dict[str, Any]) -> None:
    want = sample(got["idx"])
    assert list(got) == list(want)
    assert_same_values(got, want)


# --------------------------------------------------------------------------- coverage


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_sample_once_per_pass_with_the_writers_values(tmp_path, layout, shuffle):
    root = write(tmp_path / "ld", layout)
    src = LitDataSource(root, chunk_size=7, shuffle=shuffle, passes=2, cache_dir=tmp_path / "c")
    assert len(src.files()) > 3, "the data should span several chunks"
    assert_each_sample_twice(src, N, itemgetter("idx"), assert_written)


def test_columns_pick_and_order_the_payload(tmp_path):
    assert_columns_pick_and_order(
        partial(LitDataSource, write(tmp_path)), {"text": "sample 0 é", "idx": 0}
    )


def test_a_pickled_column_is_refused_naming_it_and_its_serializer(tmp_path):
    writer = BinaryWriter(str(tmp_path), chunk_bytes=600)
    for i in range(5):
        writer[i] = {"idx": i, "meta": {1, i}}  # a set: LitData pickles it
    writer.done()
    writer.merge()
    with pytest.raises(PlanError, match=r"column 'meta' .* serializer 'pickle': unpickling"):
        LitDataSource(tmp_path).num_samples()
    src = LitDataSource(tmp_path, columns=["idx"])
    assert [p["idx"] for p in every_sample(src)] == list(range(5))


def test_a_truncated_chunk_is_a_fetch_error_naming_it(tmp_path):
    write(tmp_path)
    chunk = tmp_path / "chunk-0-1.bin"
    chunk.write_bytes(chunk.read_bytes()[:-7])
    with pytest.raises(FetchError, match=r"chunk-0-1\.bin.*holds \d+ bytes, its index"):
        LitDataSource(tmp_path).num_samples()


def test_a_damaged_item_is_a_fetch_error_naming_its_column(tmp_path):
    write(tmp_path)
    chunk = tmp_path / "chunk-0-0.bin"
    data = bytearray(chunk.read_bytes())
    n = int(np.frombuffer(data, "<u4", count=1)[0])
    first = int(np.frombuffer(data, "<u4", count=1, offset=4)[0])
    # Item 0: seven sizes, then idx, text, raw, score, flag and tokens before grid's dtype code.
    sizes = np.frombuffer(data, "<u4", count=7, offset=first)
    at = first + 4 * 7 + int(sizes[:6].sum())
    data[at : at + 4] = np.uint32(99).tobytes()
    chunk.write_bytes(bytes(data))
    src = LitDataSource(tmp_path, chunk_size=n)
    with pytest.raises(FetchError, match=r"chunk-0-0\.bin.*item 0, column 'grid' \(numpy\)"):
        src.read(src.chunk(0).pointers)
    assert len(LitDataSource(tmp_path, columns=["idx"]).read(src.chunk(0).pointers)) == n


def test_import_zephon_does_not_import_litdata():
    code = "import sys, zephon, zephon.sources; print('litdata' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_open_source_picks_litdata_for_the_directory_and_its_index(tmp_path):
    write(tmp_path, "batch")
    for given in (tmp_path, tmp_path / "index.json"):
        src = open_source(given, cache_dir=tmp_path / "c")
        assert type(src) is LitDataSource and src.num_samples() == N


# --------------------------------------------------------------------------- pipelines


def pipeline(
    root: Path | str, cache: Path, shards: ShardCache | None = None, **kw: Any
) -> zephon.Pipeline:
    src = LitDataSource(
        root, columns=["idx", "tokens"], chunk_size=5, shuffle=True, cache_dir=cache, cache=shards
    )
    return zephon.Pipeline(src, [fetch(), batch(3)], **kw)


def delivered(items: list[Any]) -> Counter:
    return Counter(r.payload["idx"] for item in items for r in item)


@pytest.mark.parametrize("layout", ["raw", "batch"])
def test_resumes_exactly_at_any_step(tmp_path, layout):
    root = write(tmp_path / "d", layout)
    assert_resumes_exactly(partial(pipeline, root, tmp_path / "c"), lambda n: (0, 3, 9, n - 1))


@pytest.mark.usefixtures("no_leftover_workers")
def test_a_killed_worker_resumes_exactly(tmp_path):
    root = write(tmp_path / "d", "batch")
    assert_a_killed_worker_resumes_exactly(partial(pipeline, root, tmp_path / "c"), 4)


def test_a_job_of_four_ranks_resumes_on_two_and_relanes(tmp_path):
    make = partial(pipeline, write(tmp_path / "d"), tmp_path / "c")
    assert_resumes_on_two_ranks_and_relanes(make, delivered, Counter(range(N)))


@pytest.mark.parametrize("layout", ["raw", "batch"])
def test_a_rewritten_chunk_is_a_checkpoint_mismatch(tmp_path, layout):
    root = write(tmp_path / "d", layout)

    def rewrite() -> None:
        shutil.rmtree(root)
        write(root, layout, n=N + 1)  # the same chunks but the last, which gains a sample

    make = partial(pipeline, root, tmp_path / "c")

    def last() -> str:
        return re.escape(sorted(p.name for p in root.glob("chunk-*"))[-1])

    assert_a_changed_dataset_is_refused(make, rewrite, last)


# --------------------------------------------------------------------------- a bounded cache


@pytest.mark.parametrize("layout", ["batch", "chunk"])
def test_a_shard_cache_bounds_the_decompressed_copies_of_compressed_chunks(tmp_path, layout):
    root = write(tmp_path / "d", layout)
    assert_a_shard_cache_bounds_decompressed_shards(
        partial(LitDataSource, root, chunk_size=7, shuffle=True), tmp_path, "idx", assert_written
    )


def test_a_bucket_copy_keeps_downloads_and_decompressed_copies_within_the_shard_cache(
    tmp_path, bucket
):
    uri = bucket.upload(write(tmp_path / "local", "batch"), "litdata-bounded")
    assert_a_shard_cache_bounds_decompressed_shards(
        partial(LitDataSource, uri, chunk_size=7, shuffle=True), tmp_path, "idx", assert_written
    )


@pytest.mark.usefixtures("no_leftover_workers")
def test_compressed_chunks_through_a_small_shard_cache_resume_exactly_in_process_lanes(tmp_path):
    root = write(tmp_path / "d", "batch")
    assert_a_small_shard_cache_resumes_exactly_in_process_lanes(
        partial(LitDataSource, root), partial(pipeline, root), tmp_path, 5
    )


def test_a_decompressed_chunk_larger_than_the_shard_cache_is_a_fetch_error_naming_it(tmp_path):
    root = write(tmp_path / "d", "batch")
    largest = largest_decompressed_shard(partial(LitDataSource, root), tmp_path / "plain")
    cache = ShardCache(tmp_path / "shards", max_bytes=largest - 1)
    with pytest.raises(
        FetchError,
        match=r"chunk-\d+-\d+\.bin.*decompresses to \d+ bytes, more than ShardCache\(.*"
        r"max_bytes=\d+.*raise max_bytes above the largest decompressed shard",
    ):
        LitDataSource(root, cache_dir=tmp_path / "c", cache=cache).num_samples()


# --------------------------------------------------------------------------- remote


@pytest.mark.parametrize("layout", ["raw", "batch", "sample"])
def test_a_bucket_copy_delivers_the_local_samples(tmp_path, bucket, layout):
    local = write(tmp_path / "local", layout)
    uri = bucket.upload(local, f"litdata-{layout}")
    here = LitDataSource(local, chunk_size=6, shuffle=True, cache_dir=tmp_path / "c1")
    there = LitDataSource(uri, chunk_size=6, shuffle=True, cache_dir=tmp_path / "c2")
    got = assert_a_copy_reads_the_same(here, there, "idx")
    for g in got:
        assert_written(g)


def test_a_bucket_copy_read_through_a_shard_cache_delivers_the_local_samples(tmp_path, bucket):
    local = write(tmp_path / "local")
    uri = bucket.upload(local, "litdata-cached")
    here = LitDataSource(local, chunk_size=6, shuffle=True, cache_dir=tmp_path / "c1")
    cache = ShardCache(tmp_path / "shards", max_bytes=1 << 30)
    there = LitDataSource(uri, chunk_size=6, shuffle=True, cache_dir=tmp_path / "c2", cache=cache)
    assert_a_copy_reads_the_same(here, there, "idx")
    assert there.io_counters()[there.root]["cache_misses"] == len(there.files())


def test_a_changed_remote_block_is_refused(tmp_path, bucket):
    assert_a_changed_object_is_refused(
        bucket,
        write(tmp_path / "local"),
        "litdata-changed",
        "chunk-0-0.bin",
        partial(LitDataSource, cache_dir=tmp_path / "c"),
        flip=-3,
        match=r"chunk-0-0\.bin.*no longer matches the digest",
    )


def test_a_bucket_copy_resumes_exactly(tmp_path, bucket):
    uri = bucket.upload(write(tmp_path / "local", "batch"), "litdata-resume")
    assert_resumes_exactly(partial(pipeline, uri, tmp_path / "c"), lambda n: (6,))


def test_chunks_stored_as_an_arrow_footer_are_refused(tmp_path):
    writer = BinaryWriter(str(tmp_path), chunk_bytes=1 << 20)
    for i in range(5):
        writer[i] = {"a": f"x{i}", "b": f"y{i}"}  # strings only: LitData stores Arrow rows
    writer.done()
    writer.merge()
    with pytest.raises(PlanError, match=r"chunk-0-0\.bin.* holds its rows as an Arrow IPC footer"):
        LitDataSource(tmp_path).num_samples()


def test_a_damaged_item_of_a_sample_compressed_chunk_is_named_with_its_pointer(tmp_path):
    write(tmp_path, "sample")
    chunk = tmp_path / "chunk-0-0.bin"
    data = bytearray(chunk.read_bytes())
    n = int(np.frombuffer(data, "<u4", count=1)[0])
    third = int(np.frombuffer(data, "<u4", count=1, offset=4 + 4 * 2)[0])
    data[third : third + 4] = b"XXXX"  # item 2's zstd frame header
    chunk.write_bytes(bytes(data))
    src = LitDataSource(tmp_path, chunk_size=n)
    with pytest.raises(FetchError, match=r"pointer \(0, 0, 2\) from .*chunk-0-0\.bin.*item 2 "):
        src.read(src.chunk(0).pointers)
