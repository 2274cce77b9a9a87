"""Other loaders' formats: samples/s of ``fetch -> batch(32)`` over a Lance dataset and over
LitData chunks, and the same reads by each format's own reader (``zephon.bench.formats``)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from zephon.bench import formats

SAMPLES = 20_000


class Formats:
    """Each source against its format's reader, on data written by that format's writer."""

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

    def track_lance_ratio(self) -> float:
        ours, baseline = formats.lance_rates(self.root / "d.lance")
        return ours / baseline

    def track_litdata_ratio(self) -> float:
        ours, baseline = formats.litdata_rates(self.root / "litdata", self.root / "cache")
        return ours / baseline


Formats.track_lance_ratio.unit = "x"  # type: ignore[attr-defined]
Formats.track_litdata_ratio.unit = "x"  # type: ignore[attr-defined]
