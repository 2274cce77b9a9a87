"""User-defined operators and helpers for the engine's tests: the operators split, drop, reorder
and hold state the way real ones do, through the public operator API only."""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

from zephon.ops.base import Operator, OpTraits, epoch_rng
from zephon.ops.children import pack_meta, spawn_child, tombstones_for_record
from zephon.types import SampleBatch, SampleRecord


class SplitInChildren(Operator):
    """1 -> N: record idx becomes (idx % fanout) + 1 children; only the last child closes."""

    traits = OpTraits(preserves_cursor_order=True)

    def __init__(self, fanout: int = 3):
        self.fanout = fanout

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        out = []
        for rec in records:
            n = rec.payload["idx"] % self.fanout + 1
            for i in range(n):
                meta = spawn_child(rec.meta, i, is_last_child=i == n - 1)
                out.append(SampleRecord(meta, {**rec.payload, "part": i}))
        return out


class DropMultiples(Operator):
    """1 -> 0/1: drops records whose idx is a multiple of ``every``, emitting their tombstones."""

    traits = OpTraits(preserves_cursor_order=True)

    def __init__(self, every: int = 4):
        self.every = every

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        out: list[SampleRecord] = []
        for rec in records:
            if rec.payload["idx"] % self.every == 0:
                out.extend(tombstones_for_record(rec))
            else:
                out.append(rec)
        return out


class WindowShuffle(Operator):
    """Reorders through a seeded window; randomness from (seed, lane, epoch) only."""

    traits = OpTraits(preserves_cursor_order=False, stateful=True)

    def __init__(self, window: int = 5, seed: int = 0):
        self.window = window
        self.seed = seed
        self._buf: list[SampleRecord] = []

    def start_epoch(self, lane_id: int, epoch: int) -> None:
        super().start_epoch(lane_id, epoch)
        self._rng = epoch_rng(self.seed, lane_id, epoch)

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        out = []
        for rec in records:
            self._buf.append(rec)
            if len(self._buf) >= self.window:
                out.append(self._buf.pop(int(self._rng.integers(len(self._buf)))))
        return out

    def flush(self) -> list[SampleRecord]:
        out = [
            self._buf.pop(int(self._rng.integers(len(self._buf)))) for _ in range(len(self._buf))
        ]
        return out


class RunningTotal(Operator):
    """Stateful, in order: adds a running total of idx that survives epochs through carry_state."""

    traits = OpTraits(preserves_cursor_order=True, stateful=True)

    def __init__(self) -> None:
        self._total = 0

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        out = []
        for rec in records:
            self._total += rec.payload["idx"]
            out.append(rec.with_payload({**rec.payload, "total": self._total}))
        return out

    def carry_state(self) -> dict:
        return {"total": self._total}

    def restore_carry(self, state: dict) -> None:
        self._total = state["total"]


class PackPairs(Operator):
    """N -> 1: packs consecutive pairs into one record with both contributors (pack_meta)."""

    traits = OpTraits(preserves_cursor_order=False, stateful=True)

    def __init__(self) -> None:
        self._held: SampleRecord | None = None

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        out = []
        for rec in records:
            if self._held is None:
                self._held = rec
                continue
            first, self._held = self._held, None
            meta = pack_meta(
                first.meta.cursor.child(0),
                [*first.meta.contribution_refs(), *rec.meta.contribution_refs()],
                lane_id=self.lane_id,
            )
            pair = [first.payload["idx"], rec.payload["idx"]]
            out.append(SampleRecord(meta, {"idx": sum(pair), "pair": pair}))
        return out

    def flush(self) -> list[SampleRecord]:
        held, self._held = self._held, None
        return [held] if held is not None else []


def busy(payload: dict) -> dict:
    """``payload`` with ``x`` added, after a deliberately slow loop (pure CPU work): the map an
    explanation must name as the slow operator."""
    x = 0
    for i in range(20_000):
        x += i
    return {**payload, "x": x}


def canonical(value: Any) -> Any:
    """A comparable value of a payload: numpy arrays by dtype, shape and bytes (``repr`` would
    elide the middle of long arrays)."""
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, dict):
        return tuple(sorted((k, canonical(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(canonical(v) for v in value)
    return value


def fingerprint_item(item: Any) -> tuple:
    """What the training loop saw, cursors and payload bytes, as a comparable value."""
    if isinstance(item, SampleBatch):
        return ("batch", tuple(r.meta.cursor for r in item), canonical(item.payload))
    return ("record", item.meta.cursor, canonical(item.payload))


def run(loader: Any, limit: int | None = None) -> list[tuple]:
    """What ``loader`` delivers (up to ``limit`` items); it must report no contract violation."""
    out = []
    for item in loader:
        out.append(fingerprint_item(item))
        if limit is not None and len(out) == limit:
            break
    assert loader.stats()["violations"] == 0
    return out


def assert_resumes_at(pipeline: Any, steps: list[int], full: list[tuple]) -> None:
    """For each step: head + the tail resumed from a JSON round trip of the state == ``full``."""
    for step in steps:
        loader = iter(pipeline)
        head = run(loader, step) if step else []
        state = json.loads(json.dumps(loader.state_dict()))  # it must survive JSON
        tail = run(pipeline.iter(state=state))
        assert head + tail == full, f"resume at step {step} of {len(full)}"


def assert_resumes_twice(pipeline: Any, first: int, second: int, full: list[tuple]) -> None:
    """Resume after ``first`` items, again after ``second`` more: the stream is still ``full``."""
    loader = iter(pipeline)
    head = run(loader, first) if first else []
    resumed = pipeline.iter(state=loader.state_dict())
    middle = run(resumed, second) if second else []
    tail = run(pipeline.iter(state=resumed.state_dict()))
    assert head + middle + tail == full


def run_with_timeout(fn: Any, seconds: float = 30.0) -> Any:
    """Run ``fn`` in a thread; fail (instead of hanging the suite) when it does not finish."""
    result: list[Any] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"did not finish within {seconds}s"
    if error:
        raise error[0]
    return result[0]
