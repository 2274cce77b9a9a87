"""Object-storage benchmarks: start-up over many shards and read throughput, on a local
S3-compatible server (moto's server mode, a test dependency) against the same files on disk.

- startup: ``ArrowSource("s3://bucket/prefix").num_samples()`` over ``shards`` Parquet shards:
  listing, every footer and every content digest (in parallel), then again with the metadata
  cache a first run left (one HEAD per shard for its version);
- throughput: tokens/s of ``fetch -> batch`` over the shards from the server and from disk;
- shard cache: tokens/s of the same read served from a warm ``ShardCache`` (every shard a hit:
  its version pinned when the source read its metadata, its bytes from the cache's memory map)
  against the files on disk;
- downloads into a shard cache: milliseconds a download into a ``ShardCache`` takes over the
  last quarter of many against the first quarter (no store: the cache's own files and records),
  into an unbounded cache and into one that must evict.

Functions only; ``zephon bench`` (``report.py``) and the asv suite call them.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

import zephon
from zephon.ops import batch, fetch
from zephon.sources import ArrowSource, ShardCache

__all__ = [
    "cache_hit_rates",
    "download_costs",
    "s3_dataset",
    "startup_seconds",
    "tokens_per_second",
]

TOKENS_PER_ROW = 128


@contextlib.contextmanager
def s3_dataset(shards: int, rows: int = 64) -> Iterator[tuple[str, Path]]:
    """``(s3 uri, local directory)`` of ``shards`` Parquet shards of ``rows`` token rows each,
    the same bytes on a moto S3 server on loopback (started here, stopped after) and on disk."""
    import logging

    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    saved = {
        k: os.environ.get(k)
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ENDPOINT_URL")
    }
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / "data"
            local.mkdir()
            fs = pafs.S3FileSystem(endpoint_override=endpoint, allow_bucket_creation=True)
            fs.create_dir("bench")
            rng = np.random.default_rng(0)
            for k in range(shards):
                tokens = rng.integers(0, 50_000, size=(rows, TOKENS_PER_ROW), dtype=np.int32)
                table = pa.table({"tokens": pa.array(list(tokens), type=pa.list_(pa.int32()))})
                path = local / f"shard-{k:05d}.parquet"
                pq.write_table(table, path, row_group_size=max(1, rows // 2))
                with fs.open_output_stream(f"bench/data/shard-{k:05d}.parquet") as out:
                    out.write(path.read_bytes())
            yield "s3://bench/data", local
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()


def startup_seconds(uri: str, cache_dir: str | os.PathLike[str]) -> float:
    """Seconds from building an ``ArrowSource`` over ``uri`` to knowing its sample count."""
    began = time.perf_counter()
    ArrowSource(uri, cache_dir=cache_dir).num_samples()
    return time.perf_counter() - began


def tokens_per_second(
    where: str | os.PathLike[str], cache_dir: Any, shard_cache: ShardCache | None = None
) -> float:
    """Tokens/s delivered by ``fetch -> batch(32)`` over the shards at ``where`` (metadata
    loaded before the clock starts), through ``shard_cache`` when given."""
    src = ArrowSource(
        where, columns=["tokens"], chunk_size=256, cache_dir=cache_dir, cache=shard_cache
    )
    src.num_samples()
    tokens = 0
    began = time.perf_counter()
    with zephon.Pipeline(src, [fetch(), batch(32)]).iter() as loader:
        for b in loader:
            tokens += sum(len(t) for t in b.payload["tokens"])
    return tokens / (time.perf_counter() - began)


def cache_hit_rates(
    uri: str, local: str | os.PathLike[str], cache_dir: Any, repeats: int = 5
) -> tuple[float, float, float]:
    """``(cached, disk, ratio)``: median tokens/s over ``repeats`` pairs of runs, taken in
    turn, of the shards at ``uri`` read through a warm ``ShardCache`` (filled by a first run,
    not timed) and of ``local``, and the median over the pairs of disk tokens/s over cached
    ones (the cached read's time over the local one's)."""
    with tempfile.TemporaryDirectory() as where:
        shards = ShardCache(where, max_bytes=1 << 40)
        tokens_per_second(uri, cache_dir, shards)  # fills the cache
        cached, disk = [], []
        for _ in range(repeats):
            cached.append(tokens_per_second(uri, cache_dir, shards))
            disk.append(tokens_per_second(local, cache_dir))
    ratios = [d / c for c, d in zip(cached, disk, strict=True)]
    return float(np.median(cached)), float(np.median(disk)), float(np.median(ratios))


def download_costs(shards: int, bound: int | None = None) -> tuple[float, float]:
    """``(first, last)``: milliseconds per download over the first and the last quarter of
    ``shards`` downloads of distinct 32 KiB shards (bytes in memory: the cache's own cost, its
    files and records) into an empty ``ShardCache``, one that holds at most ``bound`` of them
    when given (so that the last quarter evicts)."""
    data = np.random.default_rng(0).bytes(32 << 10)

    def download(write: Any) -> int:
        write(data)
        return len(data)

    quarter = max(1, shards // 4)
    with tempfile.TemporaryDirectory() as where:
        cache = ShardCache(where, max_bytes=len(data) * (bound or shards))

        def per_download(keys: range) -> float:
            began = time.perf_counter()
            for k in keys:
                with cache.open(
                    f"s3://bench/fill/{k}", "v1", len(data), download, lambda: None
                ) as f:
                    f.materialize()
            return (time.perf_counter() - began) / max(1, len(keys)) * 1e3

        first = per_download(range(quarter))
        per_download(range(quarter, shards - quarter))
        return first, per_download(range(max(quarter, shards - quarter), shards))
