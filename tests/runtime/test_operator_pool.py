"""Operators with workers > 1 run micro-batch slices on a pool and re-emit them in input order."""

from __future__ import annotations

import threading

from pipeline_kit import fingerprint_item

import zephon
from zephon.ops.basic import fetch, map_transform
from zephon.sources.memory import RangeSource

THREADS: set[str] = set()


def note_thread(payload: dict) -> dict:
    THREADS.add(threading.current_thread().name)
    return {"idx": payload["idx"], "sq": payload["idx"] ** 2}


def test_pooled_operator_output_equals_single_worker_output():
    def run(workers):
        p = zephon.Pipeline(
            RangeSource(2000, chunk_size=100),
            [fetch(), map_transform(note_thread, workers=workers)],
            micro_batch=64,
        )
        return [fingerprint_item(r) for r in p]

    THREADS.clear()
    single = run(None)
    assert {threading.current_thread().name} == THREADS
    pooled = run(4)
    assert pooled == single
    assert any(name.startswith("zephon-") for name in THREADS)
