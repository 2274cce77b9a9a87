"""File sources over object storage: a real S3-compatible server (moto) on loopback, and for the
plain reads and resumes a real GCS one (gcp-storage-emulator) too."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from worker_kit import assert_no_leftover_workers

import zephon
from zephon.errors import CheckpointMismatchError, FetchError
from zephon.ops import batch, fetch
from zephon.sources import ArrowSource, JsonlSource

no_leftovers = pytest.fixture(autouse=True)(assert_no_leftover_workers)


def shards(root: Path, sizes: list[int], group: int = 5) -> Path:
    """Parquet shards ``part-K.parquet`` (two levels deep for half of them) and one JSONL file
    per shard, rows numbered across shards."""
    start = 0
    for k, n in enumerate(sizes):
        sub = root / ("a" if k % 2 else "b")
        sub.mkdir(parents=True, exist_ok=True)
        idx = list(range(start, start + n))
        table = pa.table({"idx": idx, "text": [f"row {i}" for i in idx]})
        pq.write_table(table, sub / f"part-{k:03d}.parquet", row_group_size=group)
        lines = "".join(json.dumps({"idx": i, "text": f"row {i}"}) + "\n" for i in idx)
        (sub / f"part-{k:03d}.jsonl").write_text(lines)
        start += n
    return root


def stream(source: zephon.sources.WorkSource, state: dict | None = None, take: int | None = None):
    """The idx of every delivered row (or of the first ``take`` batches) and the state after."""
    got: list[int] = []
    with zephon.Pipeline(source, [fetch(), batch(4)]).iter(state=state) as loader:
        for k, b in enumerate(loader):
            got += [int(i) for i in b.payload["idx"]]
            if take is not None and k + 1 == take:
                return got, json.loads(json.dumps(loader.state_dict()))
    return got, None


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_bucket_copy_delivers_exactly_the_local_stream(tmp_path, store, kind, shuffle):
    local = shards(tmp_path / "data", [7, 12, 3, 9])
    uri = store.upload(local, "corpus")
    source = ArrowSource if kind == "parquet" else JsonlSource
    suffix = "*.parquet" if kind == "parquet" else "*.jsonl"
    here = source(str(local / "**" / suffix), chunk_size=5, shuffle=shuffle, seed=3, passes=2)
    there = source(f"{uri}/**/{suffix}", chunk_size=5, shuffle=shuffle, seed=3, passes=2)
    assert (
        there.names
        == here.names
        == [f"{d}/part-{k:03d}.{kind}" for d, k in (("a", 1), ("a", 3), ("b", 0), ("b", 2))]
    )
    assert there.paths[0] == f"{uri}/a/part-001.{kind}"
    assert there.describe() == here.describe()
    local_rows, _ = stream(here)
    remote_rows, _ = stream(there)
    assert remote_rows == local_rows and sorted(local_rows) == sorted(list(range(31)) * 2)


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_a_checkpoint_of_the_local_copy_resumes_on_the_bucket_and_back(tmp_path, store, kind):
    local = shards(tmp_path / "data", [10, 6, 13])
    uri = store.upload(local, "c")
    make = ArrowSource if kind == "parquet" else JsonlSource

    def source(where: str) -> zephon.sources.WorkSource:
        return make(where, chunk_size=4, shuffle=True, seed=1)

    full, _ = stream(source(str(local)))
    head, state = stream(source(str(local)), take=3)
    tail, _ = stream(source(uri), state=state)
    assert head + tail == full
    head, state = stream(source(uri), take=2)
    tail, _ = stream(source(str(local)), state=state)
    assert head + tail == full


def test_process_lanes_read_the_bucket_as_the_loader_sees_it(tmp_path, store):
    uri = store.upload(shards(tmp_path / "data", [9, 6, 11]), "p")

    def rows(**kw) -> list[int]:
        source = ArrowSource(uri, chunk_size=4, shuffle=True, seed=2)
        with zephon.Pipeline(source, [fetch(), batch(4)], lanes=2, **kw).iter() as loader:
            return [int(i) for b in loader for i in b.payload["idx"]]

    inline = rows()
    assert sorted(inline) == list(range(26))
    assert rows(workers="process") == inline


@pytest.mark.parametrize(
    "status", [(503, "SlowDown"), (429, "TooManyRequests")], ids=["503", "429"]
)
def test_a_server_failing_the_first_requests_with_503_or_429_is_retried(
    tmp_path, bucket, failing_proxy, status
):
    # 429 Too Many Requests: how S3-compatible stores (MinIO, Ceph, R2) throttle
    local = shards(tmp_path / "data", [8, 8, 8], group=4)
    uri = bucket.upload(local, "d")
    expected, _ = stream(ArrowSource(str(local)))
    bucket.point_at(failing_proxy.endpoint)
    failing_proxy.fail_status = status
    failing_proxy.fail = 3  # the S3 client makes no retries of its own: the source's 4 attempts
    src = ArrowSource(uri, chunk_size=6)
    assert src.num_samples() == 24
    failing_proxy.fail = 3
    got, _ = stream(src)
    assert got == expected and failing_proxy.failed == 6


def test_a_server_that_is_gone_is_a_fetch_error_naming_the_uri(tmp_path, bucket, failing_proxy):
    local = shards(tmp_path / "data", [8, 8], group=4)
    uri = bucket.upload(local, "e")
    bucket.point_at(failing_proxy.endpoint)
    src = ArrowSource(uri, chunk_size=4, readahead=0)
    assert src.num_samples() == 16
    failing_proxy.stop()  # gone after the metadata was read
    began = time.monotonic()
    with pytest.raises(
        FetchError,
        match=rf"pointer \(0, 0, 0\) from '{uri}/a/part-001\.parquet'"
        r": row group 0: gave up after 4 attempts",
    ):
        src.read(np.array([[0, 0, 0]]))
    with pytest.raises(FetchError, match=rf"{uri}.*gave up after"):
        stream(ArrowSource(uri))  # gone before the listing
    assert time.monotonic() - began < 60


def test_dropping_the_read_caches_forgets_the_bytes_fetched_ahead(tmp_path, bucket, failing_proxy):
    local = shards(tmp_path / "data", [40], group=5)  # one file of 8 row groups
    uri = bucket.upload(local, "h")
    bucket.point_at(failing_proxy.endpoint)
    src = ArrowSource(uri, chunk_size=5)
    assert src.num_samples() == 40

    def read(idx: int) -> tuple[dict, int]:
        """Sample ``idx``, and how many requests for the file's bytes its read made."""
        failing_proxy.requests.clear()
        (payload,) = src.read(np.array([[0, 0, idx]]))
        return payload, len([r for r in failing_proxy.requests if r.startswith("GET /")])

    assert read(0)[1] > 0  # group 0, and the groups after it fetched ahead
    assert read(12) == ({"idx": 12, "text": "row 12"}, 0)  # group 2: fetched ahead
    src.drop_read_caches()
    payload, requests = read(17)  # group 3 was fetched ahead too, and is forgotten
    assert payload == {"idx": 17, "text": "row 17"} and requests > 0


def test_the_metadata_cache_lets_a_restart_skip_the_footers(tmp_path, bucket, failing_proxy):
    local = shards(tmp_path / "data", [5] * 6)
    uri = bucket.upload(local, "f")
    bucket.point_at(failing_proxy.endpoint)
    first = ArrowSource(f"{uri}/**/*.parquet", cache_dir=tmp_path / "cache")
    desc = first.describe()
    footers = [r for r in failing_proxy.requests if "part-" in r]
    assert len(footers) >= 6  # every shard's footer was read
    failing_proxy.requests.clear()
    again = ArrowSource(f"{uri}/**/*.parquet", cache_dir=tmp_path / "cache")
    assert again.describe() == desc
    # The listing, and one HEAD per shard for its version: none of its bytes.
    assert sorted(r.split()[0] for r in failing_proxy.requests if "part-" in r) == ["HEAD"] * 6
    assert stream(again)[0] == stream(ArrowSource(str(local / "**" / "*.parquet")))[0]
    where = again.digest_locations()
    assert all(w is not None and w.startswith(str(tmp_path / "cache")) for w in where)


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_an_object_overwritten_while_read_is_refused_naming_both_versions(tmp_path, bucket, kind):
    local = shards(tmp_path / "data", [40], group=5)
    uri = bucket.upload(local, "g")
    key = f"g/b/part-000.{kind}"
    before = bucket.etag(key)
    make = ArrowSource if kind == "parquet" else JsonlSource
    src = make(f"{uri}/**/*.{kind}", chunk_size=5)
    assert src.read(np.array([[0, 0, 1]]))[0]["idx"] == 1
    text = (local / "b" / "part-000.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines()]
    rows.reverse()  # the same rows in another order (a JSONL file of the same size)
    if kind == "parquet":
        buf = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pylist(rows), buf, row_group_size=5)
        data = buf.getvalue().to_pybytes()
    else:
        data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    bucket.overwrite(key, data)
    after = bucket.etag(key)
    assert after != before
    with pytest.raises(FetchError) as info:
        src.read(np.array([[0, 0, 17]]))
    message = str(info.value)
    assert f"{uri}/b/part-000.{kind}" in message and "pointer (0, 0, 17)" in message
    assert f"ETag {before} then, ETag {after} now" in message


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_an_object_overwritten_after_a_checkpoint_is_refused_at_resume(tmp_path, bucket, kind):
    local = shards(tmp_path / "data", [20, 20], group=5)
    uri = bucket.upload(local, "r")
    make = ArrowSource if kind == "parquet" else JsonlSource
    where = f"{uri}/**/*.{kind}"
    _, state = stream(make(where, chunk_size=5), take=2)
    key = f"r/a/part-001.{kind}"
    path = local / "a" / f"part-001.{kind}"
    if kind == "parquet":
        table = pq.read_table(path)
        overwrite_with = table.take(list(reversed(range(table.num_rows))))
        buf = pa.BufferOutputStream()
        pq.write_table(overwrite_with, buf, row_group_size=5)
        bucket.overwrite(key, buf.getvalue().to_pybytes())
    else:
        bucket.overwrite(key, "".join(reversed(path.read_text().splitlines(True))).encode())
    # The same cache directory: the cached digests are of the version checkpointed.
    with pytest.raises(CheckpointMismatchError, match=rf"file 'a/part-001\.{kind}' changed"):
        stream(make(where, chunk_size=5), state=state)


def test_a_range_that_fails_names_the_row_group_it_belongs_to(tmp_path, bucket, failing_proxy):
    local = shards(tmp_path / "data", [40], group=5)  # one file of 8 row groups
    uri = bucket.upload(local, "k")
    bucket.point_at(failing_proxy.endpoint)
    src = ArrowSource(uri, chunk_size=5, columns=["idx"])
    assert src.num_samples() == 40
    chunk = pq.read_metadata(local / "b" / "part-000.parquet").row_group(3).column(0)
    failing_proxy.fail_ranges = {chunk.dictionary_page_offset or chunk.data_page_offset}
    # Row group 3 is fetched ahead of this read, and fails: not this read's business.
    assert src.read(np.array([[0, 0, 2]])) == [{"idx": 2}]
    with pytest.raises(
        FetchError,
        match=rf"pointer \(0, 0, 16\) from '{uri}/b/part-000\.parquet': row group 3: gave up",
    ):
        src.read(np.array([[0, 0, 7], [0, 0, 16]]))  # row groups 1 and 3
