"""``zephon bench``: the headline benchmarks, each against its baseline run in the same
process, printed as one table of medians and ratios with the target and pass/fail.

A ratio measured in one process hardly depends on the machine; absolute targets (marks per
second, nanoseconds, seconds) do. ``--quick`` uses smaller sizes (a minute or two instead of
several); ratios that depend on the size (restore step, RSS growth) say which sizes they used.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np

from zephon.bench import pipeline as pb
from zephon.progress import bar as progress_bar
from zephon.progress import progress_shown, show_progress
from zephon.runtime.workers.thread_budget import usable_cpus, worker_environment


@dataclasses.dataclass
class Row:
    """One line of the table: what was measured, ours and the baseline (medians, formatted),
    their ratio, the target and whether it held (None: nothing to judge)."""

    what: str
    ours: str
    baseline: str
    ratio: str
    target: str
    passed: bool | None
    note: str = ""


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    return pb.median_time(fn, repeats)


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.3g} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    if value >= 1e-6:
        return f"{value * 1e6:.3g} µs"
    return f"{value * 1e9:.3g} ns"


# ------------------------------------------------------------------------------ cursor sort


@dataclasses.dataclass(order=True, frozen=True)
class _DataclassCursor:
    chunk_id: int
    chunk_offset: int
    lineage: tuple[int, ...]
    sample_id: tuple[int, int, int]


def cursor_rows(quick: bool) -> list[Row]:
    """Sorting shuffled cursors: ``sort_cursors`` vs numpy ``lexsort`` on the same four columns
    (lineage padded to two levels) and vs ``sorted`` on a ``dataclass(order=True)``."""
    from zephon._core.cursor import sort_cursors
    from zephon.types import SampleCursor

    n = 200_000 if quick else 1_000_000
    rng = np.random.default_rng(0)
    base = rng.integers(0, n // 2, n)
    depth = rng.integers(0, 3, n)
    lineage = rng.integers(0, 4, (n, 2))
    lineage[np.arange(2)[None, :] >= depth[:, None]] = -1
    sample_id = np.stack(
        [rng.integers(0, 4, n), rng.integers(0, 64, n), rng.integers(0, 1 << 20, n)], axis=1
    )
    chunk_id, offset = base // 1024, base % 1024
    lineages = [tuple(row[:d]) for row, d in zip(lineage.tolist(), depth.tolist())]
    sids = [tuple(row) for row in sample_id.tolist()]
    rows = list(zip(chunk_id.tolist(), offset.tolist(), lineages, sids))
    cursors = [SampleCursor(c, o, s, lin) for c, o, lin, s in rows]
    plain = [_DataclassCursor(c, o, lin, s) for c, o, lin, s in rows]
    keys = (
        *(sample_id[:, i] for i in (2, 1, 0)),
        lineage[:, 1],
        lineage[:, 0],
        offset,
        chunk_id,
    )
    ours = _median_time(lambda: sort_cursors(cursors), 5)
    lexsort = _median_time(lambda: np.lexsort(keys), 5)
    dataclass = _median_time(lambda: sorted(plain), 1 if quick else 3)
    label = f"{n // 1000}k" if n < 1_000_000 else f"{n // 1_000_000}M"
    return [
        Row(
            f"cursor sort, {label} cursors: sort_cursors vs numpy lexsort",
            _seconds(ours),
            _seconds(lexsort),
            f"{ours / lexsort:.2f}×",
            "≤ 2× lexsort",
            ours / lexsort <= 2,
        ),
        Row(
            f"cursor sort, {label} cursors: vs sorted(dataclass(order=True))",
            _seconds(ours),
            _seconds(dataclass),
            f"{dataclass / ours:.1f}× faster",
            "≥ 5× faster",
            dataclass / ours >= 5,
        ),
    ]


# ------------------------------------------------------------------------------ bitmap engine


def bitmap_rows(quick: bool) -> list[Row]:
    """Bulk ``close_many`` marks/s vs a Python set and numpy ``bincount``; one ``close()`` per
    record from Python and the compiled delivery bookkeeping per record, vs ``set.add``."""
    from zephon._core.chunk_table import ChunkTable
    from zephon._core.delivery import DeliveryBook, DeliveryCounters
    from zephon._core.records import records_for_chunk

    n_marks = 2_000_000 if quick else 10_000_000
    n_chunks = 4
    size = n_marks // n_chunks
    chunk_ids = np.repeat(np.arange(n_chunks, dtype=np.int64), size)
    offsets = np.tile(np.arange(size, dtype=np.int64), n_chunks)
    flat = (chunk_ids * size + offsets).tolist()
    table = ChunkTable()
    for c in range(n_chunks):
        table.open_chunk(c, c, size, 0)
    # Re-marking closed offsets costs what marking open ones does (no branch on the bit).
    bulk = _median_time(lambda: table.close_many(chunk_ids, offsets), 7)
    py_set = _median_time(lambda: set().update(flat), 3)
    counts = np.asarray(flat, dtype=np.int64)
    bincount = _median_time(lambda: np.bincount(counts, minlength=n_marks), 5)

    calls = 200_000 if quick else 1_000_000
    pairs = [(i % 8, i % 4096) for i in range(calls)]
    small = ChunkTable()
    for c in range(8):
        small.open_chunk(c, c, 4096, 0)

    def close_each() -> None:
        close = small.close
        for c, o in pairs:
            close(c, o)

    def add_each() -> None:
        seen: set[tuple[int, int]] = set()
        add = seen.add
        for pair in pairs:
            add(pair)

    per_close = _median_time(close_each, 5) / calls
    per_add = _median_time(add_each, 5) / calls

    # What delivery does per record: close, watermark, eviction, window digest, counters.
    chunk, n_per_chunk = 64, 4096
    pointers = np.zeros((n_per_chunk, 3), dtype=np.int64)
    pointers[:, 2] = np.arange(n_per_chunk)
    records = [
        records_for_chunk(c, pointers, [None] * n_per_chunk, 0, [0] * n_per_chunk)
        for c in range(chunk)
    ]
    batches = [r[i : i + pb.BATCH_SIZE] for r in records for i in range(0, n_per_chunk, 32)]

    def deliver_all() -> None:
        book_table = ChunkTable()
        book = DeliveryBook(book_table, True, DeliveryCounters())
        for c in range(chunk):
            book_table.open_chunk(c, c, n_per_chunk, 0)
        for b in batches:
            book.deliver(b)
        if book.violations:
            raise AssertionError(f"the delivery benchmark broke a contract: {book.violations}")

    per_delivered = _median_time(deliver_all, 5) / (chunk * n_per_chunk)
    return [
        Row(
            f"bitmap bulk close_many, {n_marks // 1_000_000}M marks: marks/s",
            _si(n_marks / bulk, "marks/s"),
            _si(n_marks / py_set, "marks/s"),
            f"{py_set / bulk:.0f}× a Python set",
            "≥ 200M marks/s",
            n_marks / bulk >= 200e6,
            f"numpy bincount: {_si(n_marks / bincount, 'marks/s')}",
        ),
        Row(
            "bitmap: one ChunkTable.close() per record from Python",
            _seconds(per_close),
            _seconds(per_add),
            f"{per_close / per_add:.2f}× set.add",
            "≤ 100 ns",
            per_close <= 100e-9,
        ),
        Row(
            "delivery bookkeeping per record (DeliveryBook, batches of 32)",
            _seconds(per_delivered),
            _seconds(per_close),
            f"{per_delivered / per_close:.2f}× close()",
            "≤ 100 ns",
            per_delivered <= 100e-9,
            "close + watermark + eviction + window digest + counters",
        ),
    ]


# ------------------------------------------------------------------------------ packing kernel

CAPACITY = 4096
OPEN_BINS = 64


def lognormal_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Lengths with mean ~600 (lognormal, sigma 1), at least 1."""
    values = np.random.default_rng(seed).lognormal(math.log(600) - 0.5, 1.0, n)
    return np.maximum(values, 1).astype(np.int64)


def kernel_bins(lengths: np.ndarray, capacity: int = CAPACITY, open_bins: int = OPEN_BINS) -> int:
    """Bins the compiled best-fit uses for ``lengths`` in one call (then a flush)."""
    from zephon._core.binfill import BinPacker

    packer = BinPacker(capacity, open_bins, "best_fit")
    _, closed = packer.add(lengths)
    return len(closed) + len(packer.flush())


def python_best_fit(
    lengths: list[int], capacity: int = CAPACITY, open_bins: int = OPEN_BINS
) -> int:
    """A pure-Python streaming best-fit with the kernel's rules; returns the bins used."""
    rooms: list[int] = []
    n_bins = 0
    for length in lengths:
        if length > capacity:
            n_bins += length // capacity
            length %= capacity
            if length == 0:
                continue
        best = -1
        for k, room in enumerate(rooms):
            if room >= length and (best < 0 or room < rooms[best]):
                best = k
        if best < 0:
            if len(rooms) == open_bins:
                rooms.pop(rooms.index(min(rooms)))
            rooms.append(capacity)
            n_bins += 1
            best = len(rooms) - 1
        rooms[best] -= length
        if rooms[best] == 0:
            rooms.pop(best)
    return n_bins


def kernel_rows(quick: bool) -> list[Row]:
    """best_fit with 64 open bins on 1M lognormal lengths: time and waste over the lower bound,
    against a pure-Python streaming best-fit on a smaller sample, scaled to 1M."""
    n = 1_000_000
    lengths = lognormal_lengths(n)
    lower = -(-int(lengths.sum()) // CAPACITY)
    seconds = _median_time(lambda: kernel_bins(lengths), 5)
    waste = (kernel_bins(lengths) - lower) / lower
    m = 20_000 if quick else 100_000
    sample = lognormal_lengths(m, seed=1)
    as_list = sample.tolist()
    py_seconds = _median_time(lambda: python_best_fit(as_list), 1 if quick else 3) * (n / m)
    py_lower = -(-int(sample.sum()) // CAPACITY)
    py_waste = (python_best_fit(as_list) - py_lower) / py_lower
    return [
        Row(
            "best_fit kernel, 1M lognormal lengths into 4096, 64 bins: time",
            _seconds(seconds),
            _seconds(py_seconds),
            f"{py_seconds / seconds:.0f}× faster",
            "< 0.1 s",
            seconds < 0.1,
            f"Python best-fit on {m // 1000}k lengths, scaled to 1M",
        ),
        Row(
            "best_fit kernel: waste over ceil(total / capacity)",
            f"{waste * 100:.3f} %",
            f"{py_waste * 100:.3f} %",
            "",
            "≤ 0.5 %",
            waste <= 0.005,
        ),
    ]


# ------------------------------------------------------------------------------ packing e2e


def packing_rows(quick: bool, out: TextIO) -> list[Row]:
    """``pack_sequences`` end to end vs Grain's packers, from ``zephon.bench.packing``."""
    try:
        from zephon.bench.packing import packing_comparison
    except ImportError as exc:
        print(
            f"  (packing end to end skipped: zephon.bench.packing unavailable: {exc})",
            file=out,
        )
        return []
    rows = []
    for r in packing_comparison(repeat=2 if quick else 5):
        grain_tps, grain_fill = r.get("grain_tokens_per_s"), r.get("grain_fill")
        speedup = r.get("speedup_vs_grain")
        what = f"packing e2e, {r['strategy']}: tokens/s ({r['sequences']:,} seqs)"
        if grain_tps is None or grain_fill is None or speedup is None:
            rows.append(
                Row(
                    what,
                    _si(r["zephon_tokens_per_s"], "tok/s"),
                    "grain missing",
                    "",
                    "≥ 10× Grain",
                    None,
                )
            )
            continue
        better_fill = r["zephon_fill"] > grain_fill
        rows.append(
            Row(
                what,
                _si(r["zephon_tokens_per_s"], "tok/s"),
                _si(grain_tps, "tok/s"),
                f"{speedup:.1f}× Grain",
                "≥ 10× Grain",
                speedup >= 10,
            )
        )
        rows.append(
            Row(
                f"packing e2e, {r['strategy']}: fill",
                f"{r['zephon_fill']:.4f}",
                f"{grain_fill:.4f}",
                f"{r['zephon_fill'] - grain_fill:+.4f}",
                "better than Grain",
                better_fill,
            )
        )
    return rows


def side_field_rows(quick: bool) -> list[Row]:
    """Packing with two side fields (an int32 loss mask, float32 weights) vs tokens alone."""
    from zephon.bench.packing import side_field_comparison

    rows = []
    for r in side_field_comparison(repeat=3 if quick else 7):
        rows.append(
            Row(
                f"packing e2e, {r['strategy']}: tokens + 2 side fields vs tokens alone",
                _seconds(r["with_sides_s"]),
                _seconds(r["tokens_alone_s"]),
                f"{r['ratio']:.2f}×",
                "≤ 1.5×",
                r["ratio"] <= 1.5,
                f"{r['sequences']:,} sequences into 1024-token rows; loss_mask + weights",
            )
        )
    return rows


# ------------------------------------------------------------------------------ pipeline


def pipeline_rows(quick: bool) -> list[Row]:
    """Overhead per record over a bare generator chain, and records/s against Grain."""
    n = 200_000 if quick else 1_000_000
    o = pb.measure_overhead(n, repeats=5 if quick else 7)
    rows = [
        Row(
            f"pipeline overhead per record: fetch→map→batch(32), 1 inline lane, {n:,} records",
            f"{o['ours'] * 1e6:.3f} µs",
            f"{o['bare'] * 1e6:.3f} µs",
            f"+{o['overhead'] * 1e6:.3f} µs",
            "≤ +1 µs over bare",
            o["overhead"] <= 1e-6,
            "baseline: bare generator chain (same reads, map, batching, collate)",
        )
    ]
    large = pb.measure_overhead(n // 2, repeats=5 if quick else 7, batch_size=pb.LARGE_BATCH)
    rows.append(
        Row(
            f"overhead ratio: fetch→map→batch({pb.LARGE_BATCH}), each batch four reads of 256",
            _seconds(large["ours"]),
            _seconds(large["bare"]),
            f"{large['ours'] / large['bare']:.2f}×",
            "≤ 2×",
            large["ours"] <= 2 * large["bare"],
            "bare: the same chain with batches of the same size (medians of runs in turns)",
        )
    )
    repeats = 3 if quick else 7
    r = pb.measure_ratios(100_000 if quick else 300_000, repeats=repeats)
    trivial, default = r["trivial/bare"], r["default/bare"]
    rows.append(
        Row(
            "overhead ratio: fetch→map→batch(32), trivial collate vs bare generator",
            _seconds(r["trivial"]),
            _seconds(r["bare"]),
            f"{trivial:.2f}×",
            "≤ 1.5×",
            trivial <= 1.5,
            "bare: the same reads and map, lists of 32 counted (the collate of both)",
        )
    )
    rows.append(
        Row(
            "overhead ratio: the same with the default collate vs bare (trivial collate)",
            _seconds(r["default"]),
            _seconds(r["bare"]),
            f"{default:.2f}×",
            "≤ 2×",
            default <= 2,
        )
    )
    if math.isnan(r["torchdata"]):
        rows.append(Row("vs torchdata.nodes", "", "torchdata missing", "", "≥ 2.5×", None))
    else:
        rows.append(
            Row(
                "records/s vs torchdata.nodes Mapper→Batcher→Mapper(collate) in a Loader",
                _si(1 / r["default"], "rec/s"),
                _si(1 / r["torchdata"], "rec/s"),
                f"{r['torchdata/default']:.2f}× torchdata",
                "≥ 2.5×",
                r["torchdata/default"] >= 2.5,
                "both with the default collate (collate_payloads); the median of "
                f"{repeats} rounds' ratios, all run in turns; the ceiling (a bare generator "
                f"chain with the same collate, no engine at all): "
                f"{r['torchdata/bare_default']:.2f}× torchdata",
            )
        )
    g = pb.measure_grain(50_000 if quick else 200_000, repeats=3 if quick else 5)
    if g is None:
        rows.append(Row("records/s vs Grain map+batch", "", "grain missing", "", "≥ 5×", None))
    else:
        rows.append(
            Row(
                "records/s vs Grain checkpointable map(...).batch(32)",
                _si(1 / g["ours"], "rec/s"),
                _si(1 / g["grain"], "rec/s"),
                f"{g['grain'] / g['ours']:.1f}× Grain",
                "≥ 5× Grain",
                g["grain"] / g["ours"] >= 5,
                "Grain: MapDataset.range.map → to_iter_dataset(num_threads=0) .map .batch",
            )
        )
    return rows


def restore_rows(quick: bool) -> list[Row]:
    """Restore time at an early and a late step (monotone and epoch path), and checkpoint size.

    What a restore costs depends on where the step falls in its chunk and epoch (that is what is
    replayed), so the late step is the one nearest 1M (100k with ``--quick``) at the same place
    in its epoch as the early one: the comparison isolates the effect of the step itself.
    """
    early = 1_000
    per_epoch = pb.CHUNK_SIZE * pb.restore_pipeline("epoch").epoch_chunks
    goal = 100_000 if quick else 1_000_000
    late = early + round((goal - early) / per_epoch) * per_epoch
    rows = []
    for kind in ("monotone", "epoch"):
        pipeline = pb.restore_pipeline(kind)
        states = [pb.checkpoint_at(pipeline, early), pb.checkpoint_at(pipeline, late)]
        first, last = pb.measure_restores(pipeline, states, repeats=15)
        ratio = last["seconds"] / first["seconds"]
        rows.append(
            Row(
                f"restore ({kind}): iter(state)+next() at step {late:,} vs {early:,}",
                _seconds(last["seconds"]),
                _seconds(first["seconds"]),
                f"{ratio:.2f}×",
                "≤ 1.2×",
                ratio <= 1.2,
                f"records replayed: {last['replayed']} vs {first['replayed']}",
            )
        )
        size = max(first["bytes_per_lane"], last["bytes_per_lane"])
        rows.append(
            Row(
                f"checkpoint size per lane ({kind}) at step {late:,} vs {early:,}",
                f"{last['bytes_per_lane']:.0f} B",
                f"{first['bytes_per_lane']:.0f} B",
                f"{last['bytes_per_lane'] / first['bytes_per_lane']:.2f}×",
                "≤ 16 KiB",
                size <= 16 * 1024,
            )
        )
    return rows


def memory_rows(quick: bool) -> list[Row]:
    """Peak RSS of fresh processes delivering n and 5n records (monotone and epoch path)."""
    small, large = (200_000, 1_000_000) if quick else (1_000_000, 5_000_000)
    rows = []
    for kind in ("monotone", "epoch"):
        a = pb.peak_rss(small, kind)
        b = pb.peak_rss(large, kind)
        ratio = b["peak_rss"] / a["peak_rss"]
        rows.append(
            Row(
                f"peak RSS ({kind}): {large:,} vs {small:,} delivered records",
                f"{b['peak_rss'] / 2**20:.1f} MiB",
                f"{a['peak_rss'] / 2**20:.1f} MiB",
                f"{(ratio - 1) * 100:+.1f} %",
                "≤ +10 %",
                ratio <= 1.10,
                f"max inflight chunks: {b['max_inflight_chunks']} vs {a['max_inflight_chunks']}",
            )
        )
    return rows


#: Two lanes are judged against ``TWO_CORE_TARGET`` only where the machine's own two plain
#: processes reach ``FREE_CORES_CEILING`` times one (``pb.process_ceiling``): two free cores.
TWO_CORE_TARGET = 1.6
FREE_CORES_CEILING = 1.8


def _two_core_verdict(ratio: float, ceiling: float) -> bool | None:
    """Whether two lanes' ``ratio`` over one meets ``TWO_CORE_TARGET``; None (not judged) when
    the machine's ``ceiling`` shows its second core was not free."""
    return ratio >= TWO_CORE_TARGET if ceiling >= FREE_CORES_CEILING else None


def lanes_rows(quick: bool) -> list[Row]:
    """Records/s of two process lanes against one on a CPU-heavy pure-Python map, and the
    machine's own ceiling: the same map in two plain processes against one."""
    n = 4096 if quick else 12_288
    pb.lane_throughput(256, 1)  # start the fork server before anything is timed
    ones, twos = [], []
    for _ in range(1 if quick else 3):
        ones.append(pb.lane_throughput(n, 1))
        twos.append(pb.lane_throughput(n, 2))
    one, two = statistics.median(ones), statistics.median(twos)
    ceiling = pb.process_ceiling(n // 2)
    return [
        Row(
            f"lanes: 2 process lanes vs 1, CPU-heavy Python map, {n:,} records",
            _si(two, "rec/s"),
            _si(one, "rec/s"),
            f"{two / one:.2f}×",
            f"≥ {TWO_CORE_TARGET}× (2 cores)",
            _two_core_verdict(two / one, ceiling),
            f"{os.cpu_count()} CPUs visible; the same map in 2 plain processes vs 1: "
            f"{ceiling:.2f}× (the machine's ceiling; judged only from {FREE_CORES_CEILING}×: "
            "two free cores)",
        )
    ]


def metrics_rows(quick: bool) -> list[Row]:
    """``fetch -> map -> batch(32)`` on 2 inline lanes with its metrics served and scraped every
    50 ms by another process (``zephon.observability.serve_metrics``) against the same run
    without them, in interleaved pairs of rounds (``zephon.bench.metrics``). Judged by the CPU
    time of the process, which counts everything its metrics thread does; on a machine shared
    with other jobs the wall clock measures mostly them."""
    from zephon.bench import metrics as mb

    n = 100_000 if quick else 250_000
    measured = mb.measure(n, 10 if quick else 24)  # as many pairs of either order
    wall, cpu = mb.ratios(measured)
    on = statistics.median(c for _, c in measured["on"])
    off = statistics.median(c for _, c in measured["off"])
    return [
        Row(
            f"metrics served and scraped every 50 ms, fetch → map → batch(32), {n:,} records",
            _si(n / on, "rec/CPU s"),
            _si(n / off, "rec/CPU s") + " (no metrics)",
            f"{cpu:.3f}×",
            "≥ 0.95×",
            cpu >= 0.95,
            f"ratio: over {len(measured['on'])} pairs of rounds, either first by turns; "
            f"{measured['scrapes']} scrapes in all; by wall time: {wall:.3f}×",
        )
    ]


def mixture_rows(quick: bool) -> list[Row]:
    """Tokens ``ensure_mixture`` drops with a token-aware source (calibrated by the tokenizer)
    against a sample-weighted one, on the same two Parquet datasets (0.7 / 0.3 by tokens)."""
    import tempfile

    from zephon.bench import mixture as mb

    n_code, n_docs = (1_000, 8_000) if quick else (4_000, 30_000)
    with tempfile.TemporaryDirectory() as directory:
        bpe = mb.write_corpus(directory, n_code, n_docs)
        ours = mb.run_mixture(directory, bpe, "tokenizer")
        base = mb.run_mixture(directory, bpe, "samples")
    off = max(abs(ours["shares"][n] - w) for n, w in mb.WEIGHTS.items())
    return [
        Row(
            f"mixture: tokens dropped by ensure_mixture, by='tokens' vs by='samples', "
            f"{n_code + n_docs:,} docs",
            f"{ours['dropped_fraction']:.1%}",
            f"{base['dropped_fraction']:.1%}",
            f"{ours['batches'] / max(base['batches'], 1):.1f}× batches",
            "≤ 5% dropped, shares ±0.01",
            ours["dropped_fraction"] <= 0.05 and off <= 0.01,
            f"token shares {ours['shares']['code']:.3f} / {ours['shares']['docstrings']:.3f}; "
            f"{ours['batches']:,} batches vs {base['batches']:,}",
        )
    ]


def storage_rows(quick: bool) -> list[Row]:
    """Start-up over 1,000 Parquet shards on a local S3 server (cold and with the metadata
    cache), tokens/s from the server against the same files on disk, and tokens/s from a warm
    shard cache against the files on disk (the median time ratio of runs taken in pairs)."""
    import tempfile

    try:
        from zephon.bench import storage
    except ImportError:
        return [Row("storage", "", "moto missing", "", "", None)]
    shards = 200 if quick else 1000
    with storage.s3_dataset(shards) as (uri, local), tempfile.TemporaryDirectory() as cache:
        cold = storage.startup_seconds(uri, cache)
        warm = storage.startup_seconds(uri, cache)
        remote = storage.tokens_per_second(uri, cache)
        disk = storage.tokens_per_second(local, cache)
        hits, on_disk, ratio = storage.cache_hit_rates(uri, local, cache, 5 if quick else 9)
    fills = 1000 if quick else 4000
    filling = storage.download_costs(fills)
    small, large = fills // 16, fills // 4
    evicting = (
        storage.download_costs(fills, bound=small)[1],
        storage.download_costs(fills, bound=large)[1],
    )
    return [
        Row(
            f"start-up, {shards:,} shards on local S3: metadata cache vs none",
            _seconds(warm),
            _seconds(cold),
            f"{cold / warm:.1f}×",
            "",
            None,
            "cold: listing + every footer, 16 threads; cached: the listing only",
        ),
        Row(
            "tokens/s, fetch -> batch(32): local S3 vs local files",
            _si(remote, "tok/s"),
            _si(disk, "tok/s"),
            f"{remote / disk:.2f}×",
            "",
            None,
        ),
        Row(
            "tokens/s, fetch -> batch(32): shard cache hits vs local files",
            _si(hits, "tok/s"),
            _si(on_disk, "tok/s"),
            f"{ratio:.2f}× time",
            "≤ 1.1× time",
            ratio <= 1.1,
            "a warm ShardCache: no request per read, each shard memory-mapped from the cache; "
            "the ratio is the median over runs taken in pairs",
        ),
        _flat_row(
            f"shard cache, ms per download: the last {fills // 4:,} of {fills:,} vs the first",
            filling,
            "32 KiB shards from memory (the cache's own files and records): a download must not "
            "cost more as the shards cached grow",
        ),
        _flat_row(
            f"shard cache, ms per download once full: {large:,} shards vs {small:,}",
            evicting,
            f"the last {fills // 4:,} of {fills:,} downloads, each evicting: finding what to "
            "evict must not cost more in a larger cache",
        ),
    ]


def _flat_row(what: str, costs: tuple[float, float], note: str) -> Row:
    """A cost in ms (``costs``: the baseline's, then ours) that must stay flat: at most 1.5×."""
    base, ours = costs
    return Row(
        what,
        f"{ours:.2f} ms",
        f"{base:.2f} ms",
        f"{ours / base:.2f}×",
        "≤ 1.5×",
        ours / base <= 1.5,
        note,
    )


# ------------------------------------------------------------------------------ other formats


def format_rows(quick: bool) -> list[Row]:
    """``fetch -> batch(32)`` over a Megatron token shard against numpy memmap slicing, and over
    Mosaic MDS shards, WebDataset shards, a Lance dataset and LitData chunks against each
    format's own reader in a bare loop (``zephon.bench.formats``)."""
    import tempfile
    from pathlib import Path

    from zephon.bench import formats

    docs = 20_000 if quick else 60_000
    samples = 20_000 if quick else 60_000
    repeats = 3
    token_rounds = 3 if quick else 7  # runs of a tenth of a second: more of them
    with tempfile.TemporaryDirectory() as tmp:
        idx = formats.write_megatron(Path(tmp) / "tokens", docs)
        runs = [formats.token_shard_rates(idx) for _ in range(token_rounds)]
        found = formats.write_mds(Path(tmp) / "mds", samples)
        mds = [formats.mds_rates(Path(tmp) / "mds") for _ in range(repeats if found else 0)]
        has_wds = formats.write_webdataset(Path(tmp) / "wds", samples)
        wds = [
            formats.webdataset_rates(Path(tmp) / "wds") for _ in range(repeats if has_wds else 0)
        ]
        lance_found = formats.write_lance(Path(tmp) / "d.lance", samples)
        lance = [
            formats.lance_rates(Path(tmp) / "d.lance") for _ in range(repeats if lance_found else 0)
        ]
        litdata_found = formats.write_litdata(Path(tmp) / "litdata", samples)
        litdata = [
            formats.litdata_rates(Path(tmp) / "litdata", Path(tmp) / "cache")
            for _ in range(repeats if litdata_found else 0)
        ]
    ours = statistics.median(r[0] for r in runs)
    base = statistics.median(r[1] for r in runs)
    paired = statistics.median(o / b for o, b in runs)
    rows = [
        Row(
            f"docs/s, TokenShardSource fetch -> batch(32), {docs:,} Megatron docs",
            _si(ours, "doc/s"),
            _si(base, "doc/s"),
            f"{paired:.2f}×",
            "≥ 1×",
            paired >= 1.0,
            "baseline: numpy memmap slices of the .bin at the .idx pointers, as int32, each "
            f"batch of 32 dropped when the next starts; the median of {token_rounds} rounds' "
            "ratios (each round both, in turn)",
        )
    ]
    for runs_of, what, missing, note in (
        (
            mds,
            f"MDSSource fetch -> batch(32), {samples:,} raw MDS samples",
            "MDS: streaming-community missing",
            "baseline: Mosaic's MDSReader.get_item over every shard, same columns",
        ),
        (
            wds,
            f"WebDatasetSource fetch -> batch(32), {samples:,} samples in .tar shards",
            "WebDataset: webdataset missing",
            "baseline: webdataset.WebDataset(urls) over the same shards, batches of 32",
        ),
        (
            lance,
            f"LanceSource fetch -> batch(32), {samples:,} Lance rows",
            "Lance: pylance missing",
            "baseline: LanceDataset.take of the same 1,024-row chunks, to_pylist",
        ),
        (
            litdata,
            f"LitDataSource fetch -> batch(32), {samples:,} raw LitData items",
            "LitData: litdata missing",
            "baseline: LitData's StreamingDataset iterated over the same directory",
        ),
    ):
        if not runs_of:
            rows.append(Row(missing, "", "not measured", "", "", None))
            continue
        ours = statistics.median(r[0] for r in runs_of)
        base = statistics.median(r[1] for r in runs_of)
        rows.append(
            Row(
                f"samples/s, {what}",
                _si(ours, "sample/s"),
                _si(base, "sample/s"),
                f"{ours / base:.2f}×",
                "≥ 0.9×",
                ours >= 0.9 * base,
                note,
            )
        )
    return rows


def pypi_rows(quick: bool) -> list[Row]:
    """Against the pure-Python zephon on PyPI, each side in its own interpreter
    (``$ZEPHON_PYPI_PYTHON``, ``zephon.bench.pypi``): ``fetch -> pack_sequences(2048) -> batch(8)``
    on a Megatron token shard against its packing of the same documents
    (``zephon.bench.pypi_packing``), the map pipeline against its map and batch, inline and
    with the runner it picks itself (``zephon.bench.pypi_pipeline``), and the text pipeline
    against its tokenize, pack and batch (``zephon.bench.pypi_text``)."""
    from zephon.bench.pypi import pypi_python

    python = pypi_python()
    if python is None:
        return [
            Row(
                "against the PyPI zephon (packing, the map and the text pipelines)",
                "",
                "PyPI zephon: not measured",
                "",
                "",
                None,
                "set ZEPHON_PYPI_PYTHON to the interpreter of a venv holding it",
            )
        ]
    return [
        _pypi_packing_row(python, quick),
        *_pypi_map_rows(python, quick),
        _pypi_text_row(python, quick),
    ]


def _against_pypi(
    ours: list[tuple[float, int]], seed: list[tuple[float, int]], unit: str
) -> tuple[float, float, str]:
    """The median rates of runs ``(rate, count)`` of ours and of the PyPI zephon, and what its
    first run delivered beside ours' (``as many <unit> as ours``, or a different count)."""
    rate = statistics.median(r[0] for r in ours)
    base = statistics.median(r[0] for r in seed)
    return rate, base, _delivered(seed[0][1], ours[0][1], unit)


def _delivered(theirs: int, ours: int, unit: str) -> str:
    """What a baseline delivered beside ours: ``as many <unit> as ours``, or how many."""
    if theirs == ours:
        return f"as many {unit} as ours"
    return f"{theirs:,} {unit} against our {ours:,}"


def _pypi_packing_row(python: str, quick: bool) -> Row:
    import tempfile
    from pathlib import Path

    from zephon.bench import formats, pypi_packing
    from zephon.bench.pypi import whole_chunks

    docs = whole_chunks(20_480 if quick else 61_440)
    repeats = 3
    with tempfile.TemporaryDirectory() as tmp:
        idx = formats.write_megatron(Path(tmp) / "tokens", docs)
        ours = [pypi_packing.ours_tokens_per_second(idx) for _ in range(repeats)]
        seed = [pypi_packing.pypi_tokens_per_second(idx, python) for _ in range(repeats)]
    rate, base, delivered = _against_pypi(ours, seed, "tokens")
    return Row(
        f"tokens/s, TokenShardSource fetch -> pack_sequences(2048) -> batch(8), {docs:,} "
        "Megatron docs",
        _si(rate, "tok/s"),
        _si(base, "tok/s"),
        f"{rate / base:.2f}×",
        "≥ 10×",
        rate >= 10 * base,
        "baseline: the PyPI zephon's pack_flat (best fit, 64 open bins, batch 8) over the "
        f"same documents held in memory, in its own process; it delivered {delivered}",
    )


def _pypi_map_rows(python: str, quick: bool) -> list[Row]:
    from zephon.bench import pypi_pipeline
    from zephon.bench.pypi import whole_chunks

    n = whole_chunks(51_200 if quick else 204_800)
    repeats = 3
    ours = [pypi_pipeline.ours_records_per_second(n) for _ in range(repeats)]
    rows = []
    for runner in pypi_pipeline.RUNNERS:
        seed = [pypi_pipeline.pypi_records_per_second(n, python, runner) for _ in range(repeats)]
        rate, base, delivered = _against_pypi(ours, seed, "records")
        rows.append(
            Row(
                f"records/s, fetch→map→batch(32), {n:,} records, vs the PyPI zephon ({runner} "
                "runner)",
                _si(rate, "rec/s"),
                _si(base, "rec/s"),
                f"{rate / base:.1f}×",
                "≥ 10×",
                rate >= 10 * base,
                "baseline: the PyPI zephon's map_transform(square) -> batch(32) over the same "
                f"payloads held in memory, in its own process; it delivered {delivered}; ours "
                "also collates each batch",
            )
        )
    return rows


def _pypi_text_row(python: str, quick: bool) -> Row:
    import subprocess

    from zephon.bench import pypi_text
    from zephon.bench import text as tb

    megabytes = 8.0 if quick else 32.0
    data, tok_path = tb.corpus(megabytes)
    tok = tb.load_tokenizer(tok_path)
    texts = pypi_text.corpus_documents(data)
    what = (
        f"tokens/s, text pipeline tokenize → pack(2048) → batch(8), {len(texts):,} documents "
        f"({megabytes:g} MB), vs the PyPI zephon"
    )
    repeats = 3
    try:
        seed = [
            pypi_text.pypi_tokens_per_second(
                texts, tok_path, tok.token_to_id("<|endoftext|>"), python
            )
            for _ in range(repeats)
        ]
    except subprocess.CalledProcessError as exc:  # its environment lacks tokenizers/transformers
        why = (exc.stderr or "").strip().splitlines()[-1:] or [f"exit {exc.returncode}"]
        return Row(what, "", "PyPI zephon: not measured", "", "", None, why[0])
    ours = [pypi_text.ours_tokens_per_second(texts, tok) for _ in range(repeats)]
    rate, base, delivered = _against_pypi(ours, seed, "tokens")
    return Row(
        what,
        _si(rate, "tok/s"),
        _si(base, "tok/s"),
        f"{rate / base:.2f}×",
        "",
        None,
        "both over the same documents held in memory, one tokenizer (8k BPE); baseline: the "
        "PyPI zephon's tokenize → pack_flat(2048, best_fit_wrap) → batch(8) in its own "
        f"process, with its default runner; it delivered {delivered}",
    )


# ------------------------------------------------------------------------------ text pipeline


def text_rows(quick: bool) -> list[Row]:
    """The text pipeline (``zephon.bench.text``): end to end against the bare limit, fill at
    2048 against Grain's best-fit on the same tokens (the corpus' pieces, and its files whole),
    two process lanes against one inline lane (time, first batch, memory; the machine's
    two-process ceiling beside them) and restore at a late step against an early one, inline and
    with process lanes."""
    from zephon.bench import text as tb

    try:
        import pyarrow  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as exc:
        return [Row("text pipeline", "", f"skipped: {exc}", "", "", None)]
    megabytes = 8.0 if quick else 32.0
    repeats = 1 if quick else 3
    data, tok_path = tb.corpus(megabytes)
    tok = tb.load_tokenizer(tok_path)
    # The end-to-end ratio is the row closest to its target: more rounds than the others.
    e2e = tb.end_to_end(data, tok_path, 3 if quick else 7)
    rows = [
        Row(
            f"text e2e: Parquet→tokenize→pack(2048)→batch(8), {megabytes:g} MB stdlib text, "
            f"micro_batch={tb.ROW_GROUP}",
            _si(e2e["ours"], "tok/s"),
            _si(e2e["bare"], "tok/s"),
            f"{e2e['ratio']:.2f}× the limit",
            "≥ 0.97× limit",
            e2e["ratio"] >= 0.97,
            "limit: pyarrow read_row_group + Tokenizer.encode_batch_fast on each row group "
            f"({tb.ROW_GROUP} texts a call), no records (8k BPE); the pipeline with as many "
            f"texts a call (micro_batch={tb.ROW_GROUP}); with the default micro_batch "
            f"{e2e['default_ratio']:.2f}×; both in this process, on the same tokenizer and its "
            f"thread pool ({_tokenizer_threads()}); {len(e2e['rounds'])} alternating rounds: "
            "median speeds, and the median of each round's ratio",
        )
    ]
    rows.append(_text_grain_row(tb, data, tok_path, 1 if quick else 3))
    payloads = tb.token_payloads(data, tok)
    lengths = [len(p["tokens"]) for p in payloads]
    pieces = tb.fill_versus_grain(payloads)
    files = tb.fill_versus_grain(tb.file_payloads(megabytes, tok))
    rows += [
        _whole_fill_row("text fill at 2048 (pack_sequences best_fit, 64 bins)", pieces),
        _cut_to_fill_row("text fill at 2048", pieces),
        _whole_fill_row("whole-file fill at 2048 (one document per file), documents whole", files),
        _cut_to_fill_row("whole-file fill at 2048", files),
    ]
    ceiling = pb.process_ceiling(2048 if quick else 4096)
    lane_rounds = 1 if quick else 5  # rows judged on a ratio near 1: more rounds
    for threads in (False, True):
        # Memory is reported from the runs without tokenizer threads only, and only they sample
        # it: it costs the loader's process CPU that the lanes' times would carry.
        common = {"data": data, "tokenizer": tok_path, "threads": threads, "memory": not threads}
        one, two, ratios = tb.alternating_runs(
            lane_rounds,
            {"lanes": 1, "workers": "inline", **common},
            {"lanes": 2, "workers": "process", **common},
        )
        rows.append(_text_lanes_row(tb, one, two, ratios, threads, ceiling, lane_rounds))
        if not threads:
            rows.append(_lanes_memory_row(tb, one, two))
    n_batches = max(1, int(len(lengths) * statistics.mean(lengths) / tb.SEQ_LEN / 8))
    rows += _text_restore_rows(tb, data, tok_path, n_batches, repeats)
    return rows


def _text_grain_row(tb: Any, data: str, tok_path: str, rounds: int) -> Row:
    """The text pipeline against Grain on the same work (``tb.versus_grain``): no target."""
    what = "text e2e vs Grain: the same reads, tokenizer calls and packing, inline"
    g = tb.versus_grain(data, tok_path, rounds)
    if g is None:
        return Row(what, "", "grain missing", "", "", None)
    counts = g["tokens"]
    return Row(
        what,
        _si(g["ours"], "tok/s"),
        _si(g["grain"], "tok/s"),
        f"{g['ratio']:.2f}× Grain",
        "",
        None,
        f"Grain: rows batched by {tb.ROW_GROUP}, one encode_batch_fast call a batch, cut to "
        f"rows of {tb.SEQ_LEN}, BestFitPackIterDataset (64 bins), batch({tb.BATCH}), no read "
        f"threads; Grain tokenizing one document at a time (its map per element): "
        f"{_si(g['per_document'], 'tok/s')}, ours {g['per_document_ratio']:.2f}× that; "
        f"Grain delivered {_delivered(counts['grain'], counts['ours'], 'tokens')} (one document "
        f"at a time: {_delivered(counts['per_document'], counts['ours'], 'tokens')}); the "
        f"median of {rounds} rounds' ratios, in turns",
    )


def _text_lanes_row(
    tb: Any,
    one: dict[str, Any],
    two: dict[str, Any],
    ratios: dict[str, float],
    threads: bool,
    ceiling: float,
    repeats: int,
) -> Row:
    """Two process lanes against one inline lane (``tb.alternating_runs``). Tokenizer threads
    off: whole runs, the workers' start included. On: from the first batch on (the inline lane
    already tokenizes on every CPU, so the workers can only gain what it leaves idle), with the
    start beside it, the first batch at most twice the inline lane's."""
    first = 1 / ratios["first_batch"]  # two process lanes' first batch over inline's
    times = (
        f"first batch {_seconds(two['first_batch'])} vs {_seconds(one['first_batch'])} "
        f"({first:.2f}×); whole runs {_seconds(two['seconds'])} vs {_seconds(one['seconds'])} "
        f"({ratios['seconds']:.2f}×); from batch {tb.STEADY_FROM} on "
        f"{ratios['steady_seconds']:.2f}×"
    )
    where = (
        f"the machine's two-process ceiling: {ceiling:.2f}×; fresh processes (fork server start "
        f"included), the two in turns: medians of {repeats} rounds' ratios"
    )
    if not threads:
        speed = ratios["seconds"]
        return Row(
            "text lanes: 2 process lanes vs 1 inline, tokenizer threads off",
            _seconds(two["seconds"]),
            _seconds(one["seconds"]),
            f"{speed:.2f}×",
            "≥ 1.5×",
            speed >= 1.5,
            f"{where}; {times}",
        )
    after = ratios["after_first"]
    return Row(
        "text lanes: 2 process lanes vs 1 inline, tokenizer threads on, from the first batch",
        _seconds(two["after_first"]),
        _seconds(one["after_first"]),
        f"{after:.2f}×; first batch {first:.2f}×",
        "≥ 1.0×; first batch ≤ 2×",
        after >= 1.0 and first <= 2.0,
        f"{where}; {times}; tokenizer threads: the inline lane's pool as the tokenizer sizes it "
        f"({_tokenizer_threads()}), each worker's {_worker_threads(2)}",
    )


def _tokenizer_threads() -> str:
    """How this process's tokenizer thread pool is sized: by the user, or one per CPU."""
    if os.environ.get("TOKENIZERS_PARALLELISM", "").lower() in ("false", "0", "off", "no"):
        return "TOKENIZERS_PARALLELISM off: 1 thread"
    given = os.environ.get("RAYON_NUM_THREADS")
    return f"RAYON_NUM_THREADS={given}" if given else f"{usable_cpus()} threads, one per CPU"


def _worker_threads(processes: int) -> str:
    """How many tokenizer threads each of ``processes`` worker processes runs
    (``worker_environment``)."""
    env = worker_environment(processes)
    if env["TOKENIZERS_PARALLELISM"] == "false":
        return "1 thread"
    return f"{env['RAYON_NUM_THREADS']} threads"


def ray_rows(quick: bool) -> list[Row]:
    """The text pipeline on 2 Ray lanes against 2 process lanes (fresh training processes joining
    one local Ray cluster of 2 CPUs): throughput once started, the first batch, and the cost per
    record of the hand-over with records too small to hide it."""
    try:
        import pyarrow  # noqa: F401
        import ray  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as exc:
        return [Row("ray lanes", "", f"skipped: {exc}", "", "", None)]
    from zephon.bench import ray_lanes as rb
    from zephon.bench import text as tb

    megabytes = 8.0 if quick else 32.0
    repeats = 1 if quick else 3
    n_small = 20_000 if quick else 100_000
    data, tok_path = tb.corpus(megabytes)
    with rb.local_cluster(2):
        process, on_ray = rb.text_runs(data, tok_path, repeats)
        small = {w: rb.per_record(w, n_small, repeats) for w in ("process", "ray")}
    steady = process["steady_seconds"] / on_ray["steady_seconds"]
    return [
        Row(
            f"ray lanes: text pipeline, 2 Ray lanes vs 2 process lanes, {megabytes:g} MB",
            _seconds(on_ray["steady_seconds"]),
            _seconds(process["steady_seconds"]),
            f"{steady:.2f}×",
            "≥ 0.8×",
            steady >= 0.8,
            f"throughput from batch {tb.STEADY_FROM} on (time shown); first batch "
            f"{_seconds(on_ray['first_batch'])} vs {_seconds(process['first_batch'])} "
            f"({on_ray['first_batch'] / process['first_batch']:.2f}×; with either kind the "
            f"training process reads the first lane while the workers start); whole runs "
            f"{_seconds(on_ray['seconds'])} vs "
            f"{_seconds(process['seconds'])}; fresh training processes joining one local Ray "
            f"cluster of 2 CPUs (its start not timed), tokenizer threads off, medians of "
            f"{repeats} rounds in turns",
        ),
        Row(
            f"ray lanes: per record, fetch→batch(64) of {n_small:,} integers, 2 lanes",
            f"{small['ray'] * 1e6:.2f} µs",
            f"{small['process'] * 1e6:.2f} µs",
            f"{small['ray'] / small['process']:.2f}×",
            "",
            None,
            "Ray lanes vs process lanes, from the first batch on: the hand-over's cost per "
            "record (an actor call and the object store against a pipe), item lists of 256",
        ),
    ]


def _whole_fill_row(what: str, m: dict[str, Any]) -> Row:
    """Fill with documents whole against Grain's best fit (``text.fill_versus_grain``)."""
    grain, ours = m["grain"], m["whole"]
    return Row(
        what,
        f"{ours['fill']:.4f}",
        "grain missing" if grain is None else f"{grain['fill']:.4f}",
        "" if grain is None else f"{ours['fill'] - grain['fill']:+.4f}",
        "≥ Grain best-fit",
        None if grain is None else ours["fill"] >= grain["fill"] - 1e-9,
        f"{m['documents']:,} documents, {m['long']:,} longer than a row; baseline: Grain "
        "BestFitPackIterDataset on the same tokens cut into rows first",
    )


def _cut_to_fill_row(what: str, m: dict[str, Any]) -> Row:
    """Fill with ``cut_to_fill=True`` and its speed against Grain's (``text.fill_versus_grain``)."""
    grain, cut = m["grain"], m["cut"]
    return Row(
        f"{what}, pack_sequences(cut_to_fill=True), 64 bins",
        f"{cut['fill']:.4f}",
        "grain missing" if grain is None else _si(grain["tokens_per_s"], "tok/s"),
        "" if grain is None else f"{cut['tokens_per_s'] / grain['tokens_per_s']:.1f}× Grain",
        "fill ≥ 0.99 at ≥ 10× Grain",
        None
        if grain is None
        else cut["fill"] >= 0.99 and cut["tokens_per_s"] >= 10 * grain["tokens_per_s"],
        f"ours {_si(cut['tokens_per_s'], 'tok/s')} (fetch→pack→batch on the corpus' token "
        "arrays); Grain: best-fit on the same tokens cut into rows first; the median of "
        "3 alternating runs each",
    )


def _lanes_memory_row(tb: Any, one: dict[str, Any], two: dict[str, Any]) -> Row:
    """Two process lanes' peak memory against one inline lane's, and ``tb.memory_bound``."""
    mib = 2**20
    bound, data = tb.memory_bound(one, 2)
    return Row(
        "text lanes: memory (PSS, loader + fork server + workers) 2 process vs inline",
        f"{two['pss'] / mib:.0f} MiB",
        f"{one['pss'] / mib:.0f} MiB",
        f"{two['pss'] / one['pss']:.2f}×",
        "≤ 1.5× + data",
        two["pss"] <= bound,
        f"bound {bound / mib:.0f} MiB = 1.5 × {one['pss_before'] / mib:.0f} MiB (inline before "
        f"its first read) + 2 workers × {data / mib:.0f} MiB (a lane's data: inline peak less "
        f"that); of the peak, the loader's process {two['pss_loader'] / mib:.0f} MiB, the fork "
        f"server, resource tracker and workers {(two['pss'] - two['pss_loader']) / mib:.0f} MiB; "
        "peak of samples every 64 batches",
    )


def _text_restore_rows(
    tb: Any, data: str, tok_path: str, n_batches: int, repeats: int
) -> list[Row]:
    """Restore at steps across the whole run, as after a preemption (a new pipeline, the
    tokenizer loaded again, ``iter(state)`` + first ``next()``): one inline lane against Grain
    in its process, two process lanes against Grain with two ``mp_prefetch`` workers, and two
    process lanes against two inline lanes (the same lanes restore the same records)."""
    steps = sorted({1, 10, n_batches // 4, n_batches // 2, n_batches * 3 // 4} - {0})
    common = {"data": data, "tokenizer": tok_path, "threads": False, "restore_steps": steps}
    ours = {
        (workers, lanes): tb.median_runs(repeats, lanes=lanes, workers=workers, **common)
        for workers, lanes in (("inline", 1), ("process", 2), ("inline", 2))
    }
    try:
        import grain  # noqa: F401
    except ImportError:
        grain_runs = None
    else:
        grain_runs = {
            w: tb.median_runs(repeats, lanes=1, workers="inline", grain_workers=w, **common)
            for w in (0, 2)
        }

    def per_step(run: dict[str, Any]) -> str:
        return ", ".join(_seconds(t) for t in run["restore"])

    rows = []
    for (workers, lanes), grain_workers in ((("inline", 1), 0), (("process", 2), 2)):
        run = ours[(workers, lanes)]
        worst = max(run["restore"])
        theirs = None if grain_runs is None else grain_runs[grain_workers]
        ratio = None if theirs is None else worst / max(theirs["restore"])
        reach = min(r / t for r, t in zip(run["reach"], run["restore"], strict=True))
        what = "1 inline lane" if workers == "inline" else "2 process lanes"
        against = "Grain in-process" if grain_workers == 0 else "Grain, 2 mp_prefetch workers"
        rows.append(
            Row(
                f"text restore ({what}): worst of steps {', '.join(map(str, steps))}",
                _seconds(worst),
                "grain missing" if theirs is None else _seconds(max(theirs["restore"])),
                "" if ratio is None else f"{ratio:.2f}× {against}",
                "≤ 1 s and ≤ 2× Grain",
                worst <= 1.0 and (ratio is None or ratio <= 2.0),
                f"per step: {per_step(run)}"
                + ("" if theirs is None else f"; Grain: {per_step(theirs)}")
                + f"; reaching each step uninterrupted took ≥ {reach:.1f}× the restore; a new "
                "pipeline per restore, tokenizer loaded again",
            )
        )
    process, inline = ours[("process", 2)], ours[("inline", 2)]
    over = max(p - i for p, i in zip(process["restore"], inline["restore"], strict=True))
    rows.append(
        Row(
            "text restore: 2 process lanes vs 2 inline lanes, worst step",
            _seconds(max(process["restore"])),
            _seconds(max(inline["restore"])),
            f"{over:+.2f} s",
            "≤ inline + 0.5 s",
            over <= 0.5,
            f"process per step: {per_step(process)}; inline: {per_step(inline)}",
        )
    )
    return rows


# ------------------------------------------------------------------------------ images


def image_rows(quick: bool) -> list[Row]:
    """The image pipeline (``zephon.bench.images``): one lane against a bare loop making the same
    Pillow calls (evaluation and training chains), two process lanes against one inline lane
    (the machine's two-process ceiling beside it), against torch's ``DataLoader`` with two
    workers, peak RSS over 10 times the images, and the handover of decoded pixels."""
    from zephon.bench import images as ib

    try:
        import PIL  # noqa: F401
        import pyarrow  # noqa: F401
    except ImportError as exc:
        return [Row("images", "", f"skipped: {exc}", "", "", None)]
    n = 512 if quick else 2048
    rounds = 3 if quick else 5
    path = ib.make_images(n, ib.data_directory())
    rows = []
    for train in (False, True):
        chain = "random_resized_crop(224)" if train else "resize(256)→center_crop(224)"
        m = ib.alternating(
            rounds,
            bare=functools.partial(ib.bare_rate, path, train=train),
            ours=functools.partial(ib.pipeline_rate, ib.image_pipeline(path, train=train)),
        )
        rows.append(
            Row(
                f"images: JPEG→decode→{chain}→batch(64), 1 inline lane, {n:,} images",
                _si(m["ours"], "img/s"),
                _si(m["bare"], "img/s"),
                f"{m['ours/bare']:.2f}×",
                "≥ 0.9× bare",
                m["ours/bare"] >= 0.9,
                "bare: the same Pillow calls on the same row groups, np.stack per batch; "
                f"medians of {rounds} interleaved rounds (absolute numbers are noisy on a "
                "shared machine, the ratio is what counts)",
            )
        )
    pb.lane_throughput(256, 1)  # start the fork server before anything is timed
    cpu: dict[str, list[float]] = {"process": [], "torch": []}
    lane_rounds = 3 if quick else 9  # the torch ratio sits near 1: more rounds
    m = ib.alternating(
        lane_rounds,
        inline=lambda: ib.pipeline_rate(ib.image_pipeline(path)),
        process=lambda: ib.pipeline_rate(
            ib.image_pipeline(path, lanes=2, workers="process"), cpu["process"]
        ),
        torch=lambda: ib.torch_rate(path, cpu=cpu["torch"]),
    )
    ceiling = pb.process_ceiling(2048 if quick else 4096)
    rows.append(
        Row(
            f"images: 2 process lanes vs 1 inline lane, {n:,} images (eval chain)",
            _si(m["process"], "img/s"),
            _si(m["inline"], "img/s"),
            f"{m['process/inline']:.2f}×",
            f"≥ {TWO_CORE_TARGET}× (2 cores)",
            _two_core_verdict(m["process/inline"], ceiling),
            f"the machine's two-process ceiling now: {ceiling:.2f}× (judged only from "
            f"{FREE_CORES_CEILING}×: two free cores); medians of {lane_rounds} interleaved rounds",
        )
    )
    versus_torch = m["process/torch"]
    rows.append(
        Row(
            "images: 2 process lanes vs torch DataLoader(num_workers=2), same Pillow calls",
            _si(m["process"], "img/s"),
            _si(m["torch"], "img/s"),
            f"{versus_torch:.2f}×",
            "≥ 1×",
            versus_torch >= 1.0,
            "torch: a map-style Dataset over the same Parquet column, batch_size=64, default "
            f"collate; both from their first batch on; the median of {lane_rounds} "
            "interleaved rounds' ratios",
        )
    )
    ours_cpu, torch_cpu = (statistics.median(cpu[k]) for k in ("process", "torch"))
    rows.append(
        Row(
            "images: the training process's CPU per image, 2 process lanes vs torch "
            "DataLoader(num_workers=2)",
            f"{ours_cpu * 1e6:.1f} µs",
            f"{torch_cpu * 1e6:.1f} µs",
            f"{ours_cpu / torch_cpu:.2f}×",
            "",
            None,
            "time.process_time() of the loop's process over the same runs (what the workers "
            "leave to the training loop; a shared machine distorts it little)",
        )
    )
    small = 2_000 if quick else 10_000
    tiny = ib.make_images(small, ib.data_directory(), sizes=((96, 72), (72, 96)))
    for workers in ("inline", "process"):
        a, b = ib.peak_rss(tiny, 1, workers), ib.peak_rss(tiny, 10, workers)
        growth = b["peak_rss"] / a["peak_rss"] - 1
        rows.append(
            Row(
                f"images: peak RSS (loader + workers, 2 {workers} lanes) {b['images']:,} vs "
                f"{a['images']:,} images",
                f"{b['peak_rss'] / 2**20:.0f} MiB",
                f"{a['peak_rss'] / 2**20:.0f} MiB",
                f"{growth * 100:+.1f} %",
                "≤ +10 %",
                growth <= 0.10,
                "96x72 JPEGs cropped to 64, 10 passes over the file against 1; RSS summed over "
                "the process and its children, sampled every 8 batches, in fresh processes",
            )
        )
    n_handover = 2048 if quick else 8192
    m = ib.alternating(
        rounds,
        thread=lambda: ib.handover_rate(n_handover, "thread"),
        process=lambda: ib.handover_rate(n_handover, "process"),
    )
    rows.append(
        Row(
            "images: decoded 224x224x3 uint8 through 2 process lanes (handover only)",
            _si(m["process"], "B/s"),
            _si(m["thread"], "B/s"),
            f"{m['process/thread']:.2f}×",
            "",
            None,
            "baseline: 2 thread lanes (no pipe); batches of 64 (9.6 MB), nothing else done",
        )
    )
    return rows


# ------------------------------------------------------------------------------ the table

SECTIONS: dict[str, Callable[..., list[Row]]] = {
    "cursor sort": cursor_rows,
    "bitmap engine": bitmap_rows,
    "packing kernel": kernel_rows,
    "packing end to end": packing_rows,
    "packing side fields": side_field_rows,
    "pipeline overhead": pipeline_rows,
    "restore and checkpoint size": restore_rows,
    "memory": memory_rows,
    "lanes": lanes_rows,
    "mixture": mixture_rows,
    "metrics": metrics_rows,
    "object storage": storage_rows,
    "other formats": format_rows,
    "against the PyPI zephon": pypi_rows,
    "text pipeline": text_rows,
    "ray lanes": ray_rows,
    "images": image_rows,
}


def format_table(rows: list[Row]) -> str:
    """The rows as an aligned text table, with notes under the rows that have one."""
    header = ("what", "ours (median)", "baseline (median)", "ratio", "target", "result")
    cells = [
        (
            r.what,
            r.ours,
            r.baseline,
            r.ratio,
            r.target,
            "PASS" if r.passed else ("FAIL" if r.passed is False else "—"),
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [line.format(*header), line.format(*("-" * w for w in widths))]
    for row, cell in zip(rows, cells):
        out.append(line.format(*cell))
        if row.note:
            out.append(f"    {row.note}")
    return "\n".join(out)


def run_bench(
    out: TextIO = sys.stdout, *, quick: bool = False, only: list[str] | None = None
) -> int:
    """Run every section (or those whose name contains one of ``only``), print the table."""
    rows: list[Row] = []
    start = time.perf_counter()
    print(
        f"zephon bench{' --quick' if quick else ''}: {os.cpu_count()} CPUs, Python "
        f"{sys.version.split()[0]}, numpy {np.__version__}",
        file=out,
        flush=True,
    )
    chosen = {
        name: section
        for name, section in SECTIONS.items()
        if not only or any(word in name for word in only)
    }
    shown = progress_bar(len(chosen), "zephon bench", unit="section")
    # The sections' own bars (a restore's replay, timed dozens of times) would only be noise
    # in the output, and drawing them would be timed too.
    was_shown = progress_shown()
    show_progress(False)
    try:
        for name, section in chosen.items():
            print(f"  measuring {name} ...", file=out, flush=True)
            t0 = time.perf_counter()
            args: tuple[Any, ...] = (quick, out) if section is packing_rows else (quick,)
            rows.extend(section(*args))
            print(f"    done in {time.perf_counter() - t0:.1f} s", file=out, flush=True)
            if shown is not None:
                shown.update(1)
    finally:
        show_progress(was_shown)
        if shown is not None:
            shown.close()
    print("", file=out)
    print(format_table(rows), file=out)
    judged = [r for r in rows if r.passed is not None]
    passed = sum(1 for r in judged if r.passed)
    print(
        f"\n{passed} of {len(judged)} targets met in {time.perf_counter() - start:.0f} s "
        "(same-process baselines; absolute targets depend on the machine)",
        file=out,
        flush=True,
    )
    return 0
