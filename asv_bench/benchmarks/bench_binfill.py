"""Bin-fill kernels: placement speed and fill of the online packers.

Target: best_fit with 64 open bins places 1M lognormal lengths (mean ~600, capacity 4096) in
under 0.1 s, with waste within 0.5% of ceil(total / capacity). A pure-Python streaming best-fit is
the in-process baseline.
"""

from __future__ import annotations

import math
import time

import numpy as np
import numpy.typing as npt

from zephon._core.binfill import BinPacker, FlatPacker
from zephon.bench.report import python_best_fit

CAPACITY = 4096
OPEN_BINS = 64
N_LOGNORMAL = 1_000_000
N_BASELINE = 100_000


def lognormal_lengths(n: int, seed: int = 0) -> npt.NDArray[np.int64]:
    """Lengths with mean ~600 (lognormal, sigma 1), clipped to >= 1."""
    rng = np.random.default_rng(seed)
    sigma = 1.0
    values = rng.lognormal(math.log(600) - sigma**2 / 2, sigma, n)
    return np.maximum(values, 1).astype(np.int64)


def uniform_lengths(n: int = 20_000, seed: int = 0) -> npt.NDArray[np.int64]:
    """The fill case of the docs: uniform 1..511 tokens."""
    return np.random.default_rng(seed).integers(1, 512, size=n, dtype=np.int64)


def make_packer(kind: str, capacity: int, open_bins: int) -> BinPacker | FlatPacker:
    if kind == "flat":
        return FlatPacker(capacity)
    return BinPacker(capacity, open_bins, kind)  # type: ignore[arg-type]


def pack_count_bins(
    kind: str,
    lengths: npt.NDArray[np.int64],
    capacity: int,
    open_bins: int,
    call_size: int,
    flush_every: int | None = None,
) -> int:
    """Feed ``lengths`` in calls of ``call_size`` items (flushing every ``flush_every`` items);
    return how many bins were used."""
    packer = make_packer(kind, capacity, open_bins)
    n_bins = 0
    since_flush = 0
    for start in range(0, len(lengths), call_size):
        _, closed = packer.add(lengths[start : start + call_size])
        n_bins += len(closed)
        since_flush += call_size
        if flush_every is not None and since_flush >= flush_every:
            n_bins += len(packer.flush())
            since_flush = 0
    return n_bins + len(packer.flush())


class PackLognormal:
    """1M lognormal lengths into 4096-token bins, 64 open; in one call or in 4096-item calls."""

    params = (["best_fit", "first_fit", "flat"], [N_LOGNORMAL, 4096])
    param_names = ["packer", "call_size"]
    timeout = 120

    def setup(self, packer: str, call_size: int) -> None:
        self.lengths = lognormal_lengths(N_LOGNORMAL)
        self.lower_bound = -(-int(self.lengths.sum()) // CAPACITY)

    def time_add_and_flush(self, packer: str, call_size: int) -> None:
        pack_count_bins(packer, self.lengths, CAPACITY, OPEN_BINS, call_size)

    def track_items_per_second(self, packer: str, call_size: int) -> float:
        start = time.perf_counter()
        pack_count_bins(packer, self.lengths, CAPACITY, OPEN_BINS, call_size)
        return len(self.lengths) / (time.perf_counter() - start)

    track_items_per_second.unit = "items/s"  # type: ignore[attr-defined]

    def track_waste_over_lower_bound(self, packer: str, call_size: int) -> float:
        n_bins = pack_count_bins(packer, self.lengths, CAPACITY, OPEN_BINS, call_size)
        return (n_bins - self.lower_bound) / self.lower_bound

    track_waste_over_lower_bound.unit = "fraction"  # type: ignore[attr-defined]


class FillUniform:
    """Fill: 20,000 uniform 1..511 lengths into 1024, 64 open bins, flush every 4,096 items."""

    params = (["best_fit", "first_fit", "flat"],)
    param_names = ["packer"]

    def setup(self, packer: str) -> None:
        self.lengths = uniform_lengths()

    def track_fill(self, packer: str) -> float:
        n_bins = pack_count_bins(packer, self.lengths, 1024, OPEN_BINS, 4096, flush_every=4096)
        return float(self.lengths.sum()) / (n_bins * 1024)

    track_fill.unit = "fill"  # type: ignore[attr-defined]


class PythonBaseline:
    """The compiled best-fit against a pure-Python streaming best-fit on the same 100k lengths."""

    params = ([OPEN_BINS],)
    param_names = ["open_bins"]
    timeout = 120

    def setup(self, open_bins: int) -> None:
        self.lengths = lognormal_lengths(N_BASELINE, seed=1)
        self.as_list = self.lengths.tolist()

    def time_python_best_fit(self, open_bins: int) -> None:
        python_best_fit(self.as_list, CAPACITY, open_bins)

    def time_kernel_best_fit(self, open_bins: int) -> None:
        pack_count_bins("best_fit", self.lengths, CAPACITY, open_bins, len(self.lengths))

    def track_speedup_over_python(self, open_bins: int) -> float:
        start = time.perf_counter()
        python_best_fit(self.as_list, CAPACITY, open_bins)
        python_s = time.perf_counter() - start
        start = time.perf_counter()
        pack_count_bins("best_fit", self.lengths, CAPACITY, open_bins, len(self.lengths))
        return python_s / (time.perf_counter() - start)

    track_speedup_over_python.unit = "x"  # type: ignore[attr-defined]

    def track_same_bins_as_python(self, open_bins: int) -> float:
        kernel = pack_count_bins("best_fit", self.lengths, CAPACITY, open_bins, len(self.lengths))
        return float(kernel == python_best_fit(self.as_list, CAPACITY, open_bins))
