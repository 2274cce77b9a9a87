"""Lanes on Ray actors against process lanes on this machine: the text pipeline
(``zephon.bench.text``) on 2 Ray lanes and on 2 process lanes, each run in a fresh training
process (time to the first batch, throughput once started), and the cost per record of a lane's
hand-over with records too small to hide it.

One local Ray cluster is started for the measurement and joined by every run (``RAY_ADDRESS``),
as a training process joins the cluster it is given: the cluster's own start is not timed.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

import zephon
from zephon.bench import text as tb
from zephon.ops import batch, fetch
from zephon.sources.memory import RangeSource


@contextlib.contextmanager
def local_cluster(cpus: int = 2) -> Iterator[str]:
    """A local Ray cluster of ``cpus`` CPUs for the duration (the one already joined, if this
    process has one), its address in ``RAY_ADDRESS`` so that child processes join it."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    before = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = address
    try:
        yield address
    finally:
        if before is None:
            del os.environ["RAY_ADDRESS"]
        else:
            os.environ["RAY_ADDRESS"] = before
        if started:
            ray.shutdown()


def small_records_seconds(workers: str, n: int, lanes: int = 2) -> float:
    """Seconds per record of ``fetch -> batch(64)`` over ``n`` integers on ``lanes`` lanes of
    ``workers``, from the first batch to the end: what a lane's hand-over costs per record when
    the records cost nothing to make."""
    pipeline = zephon.Pipeline(
        RangeSource(n, chunk_size=256), [fetch(), batch(64)], lanes=lanes, workers=workers
    )
    loader = iter(pipeline)
    try:
        next(loader)  # the lanes' start is not timed
        start = time.perf_counter()
        count = sum(len(b) for b in loader)
        elapsed = time.perf_counter() - start
    finally:
        loader.close()
    return elapsed / max(1, count)


def per_record(workers: str, n: int, repeats: int) -> float:
    """The median of ``repeats`` runs of ``small_records_seconds``."""
    return statistics.median(small_records_seconds(workers, n) for _ in range(repeats))


def text_runs(data: str, tokenizer: str, repeats: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The text pipeline on 2 process lanes and on 2 Ray lanes, ``repeats`` rounds in turns, each
    run in a fresh process (``text.alternating_runs``): the medians of each."""
    # No memory sampled: it costs the loader's process a read per worker process, and Ray's
    # workers are not its children.
    common = {"data": data, "tokenizer": tokenizer, "threads": False, "lanes": 2, "memory": False}
    process, on_ray, _ = tb.alternating_runs(
        repeats, {"workers": "process", **common}, {"workers": "ray", **common}
    )
    return process, on_ray
