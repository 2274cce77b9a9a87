"""Object storage: start-up over 1,000 shards on a local S3 server, with and without the
metadata cache, and tokens/s read from it, and from a warm shard cache, against the same files
on disk; what a download into a shard cache costs once it holds thousands of shards."""

from __future__ import annotations

import tempfile

from zephon.bench import storage
from zephon.sources import ShardCache


class Storage:
    """Start-up and throughput on moto's S3 server on loopback (``zephon.bench.storage``)."""

    number = 1
    repeat = 1
    timeout = 600

    def setup(self) -> None:
        self._context = storage.s3_dataset(1000)
        self.uri, self.local = self._context.__enter__()
        self._tmp = tempfile.TemporaryDirectory()
        self.cache = self._tmp.name

    def teardown(self) -> None:
        self._context.__exit__(None, None, None)
        self._tmp.cleanup()

    def track_startup_cold_seconds(self) -> float:
        return storage.startup_seconds(self.uri, tempfile.mkdtemp(dir=self.cache))

    def track_startup_cached_seconds(self) -> float:
        storage.startup_seconds(self.uri, self.cache)
        return storage.startup_seconds(self.uri, self.cache)

    def track_tokens_per_second_s3(self) -> float:
        return storage.tokens_per_second(self.uri, self.cache)

    def track_tokens_per_second_shard_cache(self) -> float:
        with tempfile.TemporaryDirectory(dir=self.cache) as where:
            shards = ShardCache(where, max_bytes=1 << 40)
            storage.tokens_per_second(self.uri, self.cache, shards)  # fills it
            return storage.tokens_per_second(self.uri, self.cache, shards)

    def track_tokens_per_second_local(self) -> float:
        return storage.tokens_per_second(self.local, self.cache)


class ShardCacheDownloads:
    """Milliseconds per download into a ``ShardCache`` (``zephon.bench.storage.download_costs``):
    over the last 1,000 of 4,000 against the first 1,000, and, once full, in a cache of 1,000
    shards against one of 250: flat, filling or evicting."""

    number = 1
    repeat = 1
    timeout = 600

    def track_last_over_first_filling(self) -> float:
        first, last = storage.download_costs(4000)
        return last / first

    def track_evicting_large_over_small(self) -> float:
        return (
            storage.download_costs(4000, bound=1000)[1] / storage.download_costs(4000, bound=250)[1]
        )


for _name in dir(Storage):
    if _name.startswith("track_"):
        getattr(Storage, _name).unit = "s" if "seconds" in _name else "tokens/s"
for _name in dir(ShardCacheDownloads):
    if _name.startswith("track_"):
        getattr(ShardCacheDownloads, _name).unit = "ratio"
