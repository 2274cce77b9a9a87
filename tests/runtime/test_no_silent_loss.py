"""A state always describes the last item handed to the training loop, whatever happened after
it: closing, errors, interrupts, dead workers or a checkpoint thread. A failed loader never ends
quietly."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pipeline_kit import fingerprint_item, run

import zephon
from zephon.ops.base import Operator, OpTraits
from zephon.ops.basic import fetch, map_transform
from zephon.ops.batching import batch
from zephon.sources.memory import RangeSource
from zephon.types import SampleRecord

N = 300


def _pipeline(**kw: Any) -> zephon.Pipeline:
    ops = kw.pop("ops", None) or [fetch(), map_transform(_plus_one), batch(4)]
    kw.setdefault("lanes", 2)
    return zephon.Pipeline(RangeSource(N, chunk_size=16), ops, **kw)


def _plus_one(payload: dict) -> dict:
    return {"idx": payload["idx"], "v": payload["idx"] + 1}


class FailOnce:
    """A map function that fails on idx 150 while its flag file exists (and removes it), so the
    resumed run goes through; ``how`` is "raise", "interrupt" or "exit" (the worker dies)."""

    def __init__(self, flag: Path, how: str):
        self.flag = str(flag)
        self.how = how

    def __call__(self, payload: dict) -> dict:
        if payload["idx"] == 150 and os.path.exists(self.flag):
            os.unlink(self.flag)
            if self.how == "interrupt":
                raise KeyboardInterrupt
            if self.how == "exit":
                os._exit(3)
            raise ValueError("boom at 150")
        return payload


@pytest.fixture
def flag(tmp_path: Path) -> Path:
    return tmp_path / "fail-once"


def _resume(pipeline: zephon.Pipeline, state: dict) -> list[tuple]:
    return run(pipeline.iter(state=json.loads(json.dumps(state))))


@pytest.mark.parametrize("workers", ["inline", "thread", "process"])
def test_a_state_taken_after_close_resumes_the_rest(workers: str) -> None:
    full = run(iter(_pipeline()))
    loader = iter(_pipeline(workers=workers))
    head = run(loader, 10)
    loader.close()
    assert head + _resume(_pipeline(), loader.state_dict()) == full


def test_a_state_saved_after_the_with_block_resumes_the_rest() -> None:
    full = run(iter(_pipeline()))
    with iter(_pipeline(workers="thread")) as loader:
        head = run(loader, 7)
    assert head + _resume(_pipeline(), loader.state_dict()) == full


@pytest.mark.parametrize(
    ("how", "workers", "error"),
    [
        ("raise", "inline", zephon.OperatorError),
        ("raise", "thread", zephon.OperatorError),
        ("raise", "process", zephon.OperatorError),
        ("interrupt", "inline", KeyboardInterrupt),
        ("exit", "process", zephon.ZephonError),
    ],
)
def test_a_state_taken_after_a_failure_resumes_the_rest(
    flag: Path, how: str, workers: str, error: type[BaseException]
) -> None:
    def ops() -> list:
        return [fetch(), map_transform(FailOnce(flag, how), name="fail-once"), batch(4)]

    full = run(iter(_pipeline(ops=ops())))
    flag.write_text("armed")
    loader = iter(_pipeline(ops=ops(), workers=workers))
    head: list[tuple] = []
    with pytest.raises(error):
        for item in loader:
            head.append(fingerprint_item(item))
    assert head, "the failure came before anything was delivered"
    state = loader.state_dict()
    assert head + _resume(_pipeline(ops=ops()), state) == full


@pytest.mark.parametrize("workers", ["inline", "thread"])
def test_a_failed_loader_keeps_raising_instead_of_ending(flag: Path, workers: str) -> None:
    flag.write_text("armed")
    ops = [fetch(), map_transform(FailOnce(flag, "raise"), name="fail-once"), batch(4)]
    loader = iter(_pipeline(ops=ops, workers=workers))
    with pytest.raises(zephon.OperatorError):
        for _ in loader:
            pass
    for _ in range(2):
        with pytest.raises(zephon.ZephonError, match="failed earlier"):
            next(loader)
    loader.close()


def test_a_closed_loader_does_not_end_quietly() -> None:
    loader = iter(_pipeline())
    next(loader)
    loader.close()
    with pytest.raises(zephon.ZephonError, match="closed"):
        next(loader)


class PadToLongest(Operator):
    """Batch-sensitive but 1 -> 1 and stateless: pads each record to its micro-batch's longest."""

    traits = OpTraits(
        preserves_cursor_order=True, batch_sensitive=True, preserves_indexability=True
    )

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        lengths = [r.payload["idx"] % 7 + 1 for r in records]
        width = max(lengths)
        out = []
        for rec, n in zip(records, lengths):
            tokens = np.zeros(width, dtype=np.int32)
            tokens[:n] = rec.payload["idx"]
            out.append(rec.with_payload({"tokens": tokens}))
        return out


def _token_lists(records: Sequence[SampleRecord]) -> list:
    return [r.payload["tokens"] for r in records]


@pytest.mark.parametrize("with_batch", [False, True])
def test_source_skip_keeps_micro_batches_of_batch_sensitive_operators(with_batch: bool) -> None:
    def pipeline() -> zephon.Pipeline:
        ops: list = [fetch(), PadToLongest()]
        if with_batch:
            ops.append(batch(3, collate=_token_lists))
        return zephon.Pipeline(RangeSource(200, chunk_size=40), ops, lanes=2, micro_batch=8)

    full = run(iter(pipeline()))
    for step in (1, 5, 13, 22, 37, len(full) - 1):
        loader = iter(pipeline())
        head = run(loader, step)
        assert head + _resume(pipeline(), loader.state_dict()) == full, f"step {step}"


def test_state_dict_from_another_thread_is_always_a_position() -> None:
    def pipeline(workers: str = "inline") -> zephon.Pipeline:
        return _pipeline(ops=[fetch(), map_transform(_plus_one)], workers=workers, lanes=3)

    full = run(iter(pipeline()))
    loader = iter(pipeline("thread"))
    states: list[dict] = []
    done = threading.Event()

    def checkpoint() -> None:
        while not done.is_set() and len(states) < 40:
            states.append(loader.state_dict())
            done.wait(0.0005)

    thread = threading.Thread(target=checkpoint)
    thread.start()
    try:
        run(loader)
    finally:
        done.set()
        thread.join()
    assert states
    for state in states:
        tail = _resume(pipeline(), state)
        assert tail == full[len(full) - len(tail) :]
