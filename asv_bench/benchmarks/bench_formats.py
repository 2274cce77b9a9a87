"""Other loaders' formats: samples/s of ``fetch -> batch(32)`` over WebDataset ``.tar`` shards
(``WebDatasetSource``) against ``webdataset.WebDataset(urls)`` iterating the same samples in a
bare loop, on 20,000 samples written by WebDataset's ``TarWriter``; and over a Lance dataset and
LitData chunks against each format's own reader doing the same reads (``zephon.bench.formats``).

Target: ours at least 0.9x each baseline.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from zephon.bench import formats

SAMPLES = 20_000


class WebDatasetShards:
    """Samples/s over the same shards: ours, webdataset's, and their ratio (higher is better)."""

    timeout = 600

    def setup_cache(self) -> dict[str, float]:
        with tempfile.TemporaryDirectory() as directory:
            root = Path(directory) / "wds"
            if not formats.write_webdataset(root, SAMPLES):
                return {}
            runs = [formats.webdataset_rates(root) for _ in range(3)]
        ours = statistics.median(r[0] for r in runs)
        base = statistics.median(r[1] for r in runs)
        return {"ours": ours, "webdataset": base, "ratio": ours / base}

    def setup(self, rates: dict[str, float]) -> None:
        if not rates:
            raise NotImplementedError("webdataset is not installed (pip install webdataset)")

    def track_samples_per_second(self, rates: dict[str, float]) -> float:
        return rates["ours"]

    track_samples_per_second.unit = "samples/s"  # type: ignore[attr-defined]

    def track_webdataset_samples_per_second(self, rates: dict[str, float]) -> float:
        return rates["webdataset"]

    track_webdataset_samples_per_second.unit = "samples/s"  # type: ignore[attr-defined]

    def track_ratio_to_webdataset(self, rates: dict[str, float]) -> float:
        return rates["ratio"]

    track_ratio_to_webdataset.unit = "x"  # type: ignore[attr-defined]


class LanceAndLitData:
    """Our ratio to ``LanceDataset.take`` and to LitData's ``StreamingDataset`` on data written
    by each format's own writer (higher is better)."""

    number = 1
    repeat = 3
    timeout = 600

    def setup(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.root = Path(self._tmp.name)
        if not formats.write_lance(self.root / "d.lance", SAMPLES):
            raise NotImplementedError("pylance is not installed")  # asv skips the benchmark
        if not formats.write_litdata(self.root / "litdata", SAMPLES):
            raise NotImplementedError("litdata is not installed")

    def teardown(self) -> None:
        self._tmp.cleanup()

    def track_ratio_to_lance(self) -> float:
        ours, baseline = formats.lance_rates(self.root / "d.lance")
        return ours / baseline

    track_ratio_to_lance.unit = "x"  # type: ignore[attr-defined]

    def track_ratio_to_litdata(self) -> float:
        ours, baseline = formats.litdata_rates(self.root / "litdata", self.root / "cache")
        return ours / baseline

    track_ratio_to_litdata.unit = "x"  # type: ignore[attr-defined]
