"""Pipeline benchmarks: what the engine adds per record, against baselines run in the
same process.

- overhead: ``fetch -> map_transform -> batch`` on an in-memory ``RangeSource``, one inline lane,
  against a bare generator chain doing the same work (read the payload dicts for the pointers,
  apply the same function, group into lists of ``batch_size``, the same collate) without any
  bookkeeping; and against Grain's checkpointable ``map(...).batch(...)`` on the same work;
- restore: ``pipeline.iter(state=...)`` plus the first ``next()`` at an early and a late step,
  on a monotone and an epoch pipeline, and the checkpoint's size per lane;
- memory: peak RSS of a run of ``n`` delivered records, each in a fresh subprocess;
- lanes: two process lanes against one on a CPU-heavy pure-Python map.

Functions only (no command line): ``zephon bench`` (``zephon/bench/report.py``) and the asv
suite call them. Times are in seconds and sizes in bytes; every function returns plain numbers.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

import zephon
from zephon.bench.clock import start_clock
from zephon.ops.basic import fetch, map_transform
from zephon.ops.batching import batch, collate_payloads
from zephon.sources.memory import RangeSource

__all__ = [
    "BATCH_SIZE",
    "CHUNK_SIZE",
    "LARGE_BATCH",
    "RATIOS",
    "bare_chain",
    "bare_trivial",
    "burn",
    "checkpoint_at",
    "drain",
    "grain_map_batch",
    "lane_throughput",
    "lanes_pipeline",
    "make_text",
    "measure_overhead",
    "measure_ratios",
    "measure_restore",
    "measure_restores",
    "overhead_pipeline",
    "pack_pipeline",
    "peak_rss",
    "process_ceiling",
    "ratio_sides",
    "restore_pipeline",
    "run_side",
    "square",
    "torchdata_map_batch",
    "trivial_collate",
]

BATCH_SIZE = 32
#: A batch larger than a micro-batch (256 records unless the pipeline says otherwise): each batch
#: is gathered from four reads.
LARGE_BATCH = 1024
CHUNK_SIZE = 1024
#: Records of a source that is never exhausted by a benchmark (a RangeSource holds no data).
UNBOUNDED = 1 << 40


def square(payload: dict) -> dict:
    """The map function of the overhead benchmarks: cheap, so the engine's cost shows."""
    idx = payload["idx"]
    return {"idx": idx, "square": idx * idx}


def make_payload(idx: int) -> dict:
    """The payload ``RangeSource`` reads for sample ``idx`` (for the Grain side)."""
    return {"idx": idx}


def drain(iterable: Iterable[Any]) -> None:
    """Consume an iterable as fast as Python can (nothing kept)."""
    deque(iterable, maxlen=0)


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ------------------------------------------------------------------------------ overhead


def overhead_pipeline(
    n: int, *, batch_size: int | None = BATCH_SIZE, lanes: int = 1, workers: str = "inline"
) -> zephon.Pipeline:
    """``fetch -> map_transform(square) -> batch`` over ``RangeSource(n)``; without ``batch``
    when ``batch_size`` is None (records handed over one by one)."""
    ops: list[Any] = [fetch(), map_transform(square)]
    if batch_size is not None:
        ops.append(batch(batch_size))
    return zephon.Pipeline(RangeSource(n, chunk_size=CHUNK_SIZE), ops, lanes=lanes, workers=workers)


def bare_chain(n: int, *, batch_size: int | None = BATCH_SIZE) -> Iterator[Any]:
    """The baseline: the pipeline's work as plain generators, with no cursors, no records and
    no bookkeeping — payload dicts read chunk by chunk, ``square``, lists of ``batch_size``
    collated by the same ``collate_payloads`` the default collate uses (the mapped payloads one
    by one when ``batch_size`` is None)."""
    source = RangeSource(n, chunk_size=CHUNK_SIZE)

    def payloads() -> Iterator[dict]:
        for position in range(source.total_chunks() or 0):
            yield from source.read(source.chunk(position).pointers)

    def mapped(items: Iterator[dict]) -> Iterator[dict]:
        for item in items:
            yield square(item)

    def batched(items: Iterator[dict]) -> Iterator[Any]:
        buf: list[dict] = []
        for item in items:
            buf.append(item)
            if len(buf) == batch_size:
                yield collate_payloads(buf)
                buf = []
        if buf:
            yield collate_payloads(buf)

    return mapped(payloads()) if batch_size is None else batched(mapped(payloads()))


def measure_overhead(
    n: int = 1_000_000, *, repeats: int = 7, batch_size: int | None = BATCH_SIZE
) -> dict[str, float]:
    """Seconds per record of the pipeline and of the bare chain (medians), and the median of the
    paired differences. The two runs alternate so that machine noise hits both alike."""
    ours, bare, diff = [], [], []
    for _ in range(repeats):
        start = start_clock()
        drain(iter(overhead_pipeline(n, batch_size=batch_size)))
        t_ours = (time.perf_counter() - start) / n
        start = start_clock()
        drain(bare_chain(n, batch_size=batch_size))
        t_bare = (time.perf_counter() - start) / n
        ours.append(t_ours)
        bare.append(t_bare)
        diff.append(t_ours - t_bare)
    return {
        "ours": statistics.median(ours),
        "bare": statistics.median(bare),
        "overhead": statistics.median(diff),
    }


def grain_map_batch(n: int, *, batch_size: int = BATCH_SIZE) -> Any:
    """Grain's checkpointable map-and-batch on the same work, or None when grain is missing:
    ``MapDataset.range(n).map(make_payload)`` read in the caller's thread (``num_threads=0``,
    what Grain recommends for in-memory data), then ``IterDataset.map(square).batch(...)`` with
    the same collate. Its iterator has ``get_state`` / ``set_state``."""
    try:
        import grain
    except ImportError:
        return None
    options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    return (
        grain.MapDataset.range(n)
        .map(make_payload)
        .to_iter_dataset(options)
        .map(square)
        .batch(batch_size, batch_fn=collate_payloads)
    )


def grain_checkpoint_roundtrip(dataset: Any, steps: int = 10) -> bool:
    """True when Grain's iterator resumes from ``get_state()`` to the same next batch."""
    it = iter(dataset)
    for _ in range(steps):
        next(it)
    state = it.get_state()
    expected = next(it)
    resumed = iter(dataset)
    resumed.set_state(state)
    got = next(resumed)
    return got.keys() == expected.keys() and all(
        np.array_equal(got[k], expected[k]) for k in expected
    )


def measure_grain(
    n: int = 200_000, *, repeats: int = 5, batch_size: int = BATCH_SIZE
) -> dict[str, float] | None:
    """Seconds per record of Grain's map-and-batch and of the pipeline on the same ``n`` records
    (medians, runs alternating); None without grain."""
    dataset = grain_map_batch(n, batch_size=batch_size)
    if dataset is None:
        return None
    if not grain_checkpoint_roundtrip(dataset):
        raise AssertionError("Grain's iterator did not resume from its own state")
    ours, theirs = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        drain(iter(overhead_pipeline(n, batch_size=batch_size)))
        ours.append((time.perf_counter() - start) / n)
        start = time.perf_counter()
        drain(iter(dataset))
        theirs.append((time.perf_counter() - start) / n)
    return {"ours": statistics.median(ours), "grain": statistics.median(theirs)}


def trivial_collate(records: Any) -> int:
    """A collate that does nothing but count: what is left is the engine's own cost."""
    return len(records)


def overhead_pipeline_with(n: int, collate: Any, *, batch_size: int = BATCH_SIZE) -> Any:
    """``overhead_pipeline`` with another collate (``trivial_collate``, or None: the default)."""
    return zephon.Pipeline(
        RangeSource(n, chunk_size=CHUNK_SIZE),
        [fetch(), map_transform(square), batch(batch_size, collate=collate)],
    )


def bare_trivial(n: int, *, batch_size: int = BATCH_SIZE) -> Iterator[int]:
    """The bare generator chain with the trivial collate (lists of ``batch_size``, counted)."""
    source = RangeSource(n, chunk_size=CHUNK_SIZE)
    buf: list[dict] = []
    for position in range(source.total_chunks() or 0):
        for item in source.read(source.chunk(position).pointers):
            buf.append(square(item))
            if len(buf) == batch_size:
                yield len(buf)
                buf = []
    if buf:
        yield len(buf)


def torchdata_map_batch(n: int, *, batch_size: int = BATCH_SIZE) -> Any:
    """torchdata.nodes on the same work, or None without torchdata: the same payloads read chunk
    by chunk, ``Mapper(square)``, ``Batcher(batch_size)``, ``Mapper(collate_payloads)``, in a
    ``Loader`` (its checkpointable iterator)."""
    try:
        import torchdata.nodes as tn
    except ImportError:
        return None
    source = RangeSource(n, chunk_size=CHUNK_SIZE)

    def payloads() -> Iterator[dict]:
        for position in range(source.total_chunks() or 0):
            yield from source.read(source.chunk(position).pointers)

    node = tn.Mapper(tn.IterableWrapper(payloads()), square)
    node = tn.Mapper(tn.Batcher(node, batch_size, drop_last=False), collate_payloads)
    return tn.Loader(node)


#: The ratios ``measure_ratios`` gives, each as (numerator, denominator).
RATIOS = {
    "trivial/bare": ("trivial", "bare"),
    "default/bare": ("default", "bare"),
    "torchdata/default": ("torchdata", "default"),
    "torchdata/bare_default": ("torchdata", "bare_default"),
}


def ratio_sides(n: int) -> dict[str, Callable[[], Any]]:
    """The sides ``measure_ratios`` times, by name: each makes an iterator over ``n`` records
    (None for torchdata when it is missing)."""
    return {
        "trivial": lambda: iter(overhead_pipeline_with(n, trivial_collate)),
        "default": lambda: iter(overhead_pipeline_with(n, None)),
        "bare": lambda: bare_trivial(n),
        "bare_default": lambda: bare_chain(n),
        "torchdata": lambda: torchdata_map_batch(n),
    }


def run_side(side: str, n: int) -> None:
    """Drain one of ``ratio_sides`` over ``n`` records, after a short run of the pipeline that
    imports and warms up what every side uses: what an instruction count runs, twice (a long
    ``n`` and a short one, whose difference is the per-record cost; see docs/benchmarks.md)."""
    drain(iter(overhead_pipeline_with(2 * CHUNK_SIZE, None)))
    it = ratio_sides(n)[side]()
    if it is None:
        raise RuntimeError(f"side {side!r} needs torchdata, which is not installed")
    drain(it)


def measure_ratios(n: int = 300_000, *, repeats: int = 5) -> dict[str, float]:
    """Seconds per record (medians, runs alternating) of the pipeline with the trivial and the
    default collate, of the bare chain with the trivial and with the default collate, and of
    torchdata.nodes with the default collate (``nan`` without torchdata); and each of ``RATIOS``
    as the median of the rounds' own ratios, so that a machine whose speed drifts between rounds
    moves both sides of a ratio alike. ``torchdata/bare_default`` is the ceiling of the
    torchdata row: how far any engine could get ahead of torchdata on this work if it added
    nothing at all to the reads, the map and the collate."""
    makers = ratio_sides(n)
    runs: dict[str, list[float]] = {key: [] for key in makers}
    torchdata_map_batch(1)  # import torch and torchdata before the clock starts
    for _ in range(repeats):
        for key, make in makers.items():
            start = start_clock()
            it = make()
            if it is None:
                runs[key].append(float("nan"))
                continue
            drain(it)
            runs[key].append((time.perf_counter() - start) / n)
    out = {k: statistics.median(v) for k, v in runs.items()}
    for name, (top, bottom) in RATIOS.items():
        out[name] = statistics.median(a / b for a, b in zip(runs[top], runs[bottom]))
    return out


WORDS = ("zephon", "packs", "tokens", "into", "bins", "and", "restores", "exactly")


def make_text(idx: int) -> dict:
    """A deterministic document of 1..96 words (about 300 bytes on average)."""
    n = 1 + (idx * 2654435761) % 96
    return {"text": " ".join(WORDS[(idx + k) % len(WORDS)] for k in range(n))}


def pack_pipeline(n: int, *, lanes: int = 1, workers: str = "inline") -> zephon.Pipeline:
    """``fetch -> tokenize (bytes) -> pack_sequences(1024) -> batch(8)`` over ``n`` documents."""
    from zephon.ops import pack_sequences, tokenize

    return zephon.Pipeline(
        RangeSource(n, make=make_text, chunk_size=CHUNK_SIZE),
        [fetch(), tokenize(), pack_sequences(1024), batch(8)],
        lanes=lanes,
        workers=workers,
    )


# ------------------------------------------------------------------------------ restore


def restore_pipeline(kind: str) -> zephon.Pipeline:
    """A pipeline delivering records (one per step) that no benchmark exhausts.

    ``"monotone"``: ``fetch -> map_transform`` (restore skips consumed samples at the source);
    ``"epoch"``: ``fetch -> map_transform -> shuffle(256)`` (restore replays the current epoch
    of 8 chunks through the replay filter).
    """
    ops: list[Any] = [fetch(), map_transform(square)]
    if kind == "epoch":
        from zephon.ops.shuffle import shuffle

        ops.append(shuffle(256, seed=1))
    elif kind != "monotone":
        raise ValueError(f"kind must be 'monotone' or 'epoch', got {kind!r}")
    return zephon.Pipeline(RangeSource(UNBOUNDED, chunk_size=CHUNK_SIZE), ops)


def checkpoint_at(pipeline: zephon.Pipeline, step: int) -> dict[str, Any]:
    """The loader state after ``step`` deliveries, round-tripped through JSON like a file."""
    loader = iter(pipeline)
    for _ in range(step):
        next(loader)
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    return state


def measure_restore(
    pipeline: zephon.Pipeline, state: dict[str, Any], *, repeats: int = 7
) -> dict[str, float]:
    """Median seconds of ``pipeline.iter(state=state)`` plus the first ``next()``; the records
    replayed to get there; the state's JSON size per lane in bytes."""
    return measure_restores(pipeline, [state], repeats=repeats)[0]


def measure_restores(
    pipeline: zephon.Pipeline, states: list[dict[str, Any]], *, repeats: int = 7
) -> list[dict[str, float]]:
    """``measure_restore`` for several states, their runs alternating so that machine noise
    and allocator state hit all of them alike."""
    times: list[list[float]] = [[] for _ in states]
    replayed = [0] * len(states)
    for _ in range(repeats):
        for k, state in enumerate(states):
            start = start_clock()
            loader = pipeline.iter(state=state)
            next(loader)
            times[k].append(time.perf_counter() - start)
            replayed[k] = loader.stats()["replayed"]
            loader.close()
    return [
        {
            "seconds": statistics.median(times[k]),
            "replayed": replayed[k],
            "bytes_per_lane": len(json.dumps(state).encode()) / len(state["lane_states"]),
        }
        for k, state in enumerate(states)
    ]


# ------------------------------------------------------------------------------ memory


def _rss_child(kind: str, n: int) -> None:
    """Run in a fresh interpreter: deliver ``n`` records, print the peak RSS (bytes) as JSON."""
    if kind == "monotone":
        pipeline = overhead_pipeline(n)
    else:
        from zephon.ops.shuffle import shuffle

        pipeline = zephon.Pipeline(
            RangeSource(n, chunk_size=CHUNK_SIZE),
            [fetch(), map_transform(square), shuffle(256, seed=1), batch(BATCH_SIZE)],
        )
    loader = iter(pipeline)
    drain(loader)
    stats = loader.stats()
    print(
        json.dumps(
            {
                "peak_rss": _peak_rss_bytes(),
                "delivered": stats["delivered"],
                "max_inflight_chunks": stats["max_inflight_chunks"],
            }
        )
    )


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def peak_rss(n: int, kind: str = "monotone") -> dict[str, int]:
    """Peak RSS in bytes of a fresh process that delivers ``n`` records through the overhead
    pipeline (``kind="monotone"``) or its epoch-path variant with a shuffle (``"epoch"``)."""
    # The directory holding this copy of zephon: the child imports the same one.
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = (
        f"import sys; sys.path.insert(0, {here!r}); "
        f"from zephon.bench.pipeline import _rss_child; _rss_child({kind!r}, {int(n)})"
    )
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    result: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# ------------------------------------------------------------------------------ lanes


def burn(payload: dict) -> dict:
    """A CPU-heavy pure-Python map (about 0.1-0.2 ms per record): holds the GIL throughout."""
    x = payload["idx"]
    for _ in range(2000):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
    return {"idx": payload["idx"], "burn": x}


def lanes_pipeline(n: int, lanes: int, workers: str = "process") -> zephon.Pipeline:
    """``fetch -> map_transform(burn) -> batch`` over ``n`` records in chunks of 128."""
    return zephon.Pipeline(
        RangeSource(n, chunk_size=128),
        [fetch(), map_transform(burn), batch(BATCH_SIZE)],
        lanes=lanes,
        workers=workers,
    )


def lane_throughput(n: int, lanes: int, workers: str = "process") -> float:
    """Records per second delivered from the first batch to the end (worker start-up excluded)."""
    loader = iter(lanes_pipeline(n, lanes, workers))
    try:
        first = next(loader)
        start = time.perf_counter()
        count = sum(len(b) for b in loader)
        elapsed = time.perf_counter() - start
    finally:
        loader.close()
    del first
    return count / elapsed


def _burn_many(n: int) -> int:
    return len([burn({"idx": i}) for i in range(n)])


def process_ceiling(n: int) -> float:
    """The machine's parallel ceiling for the lanes benchmark: ``burn`` over ``n`` records in
    each of two plain worker processes at once against ``n`` in one, as a throughput ratio
    (2.0 on two free cores; lanes cannot beat it)."""
    import multiprocessing as mp

    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx: Any = mp.get_context(method)
    with ctx.Pool(2) as pool:
        pool.map(_burn_many, [1, 1])  # workers up before the clock starts
        start = time.perf_counter()
        pool.map(_burn_many, [n])
        one = time.perf_counter() - start
        start = time.perf_counter()
        pool.map(_burn_many, [n, n], chunksize=1)
        two = time.perf_counter() - start
    return 2 * one / two
