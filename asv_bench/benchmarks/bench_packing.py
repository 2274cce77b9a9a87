"""Packing end to end (SPEC §5): tokens/s of ``pack_sequences`` / ``pack_flat`` through a Pipeline,
source iteration and bookkeeping included, and their fill, against a pure-Python streaming
first-fit packer that builds the same payload (tokens, segment ids, positions) in the same process.

Input: 20,000 pre-tokenized sequences of uniform 1..511 tokens into bins of 1024, 64 open bins,
an epoch (flush) every 4,096 sequences. Run this file directly to print the numbers.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import zephon
from zephon.ops import fetch, pack_flat, pack_sequences
from zephon.sources.memory import ListSource

SEQ_LEN = 1024
OPEN_BINS = 64
N_DOCS = 20_000
CHUNK = 1024
EPOCH_DOCS = 4096


def uniform_documents(n: int = N_DOCS, seed: int = 0) -> list[dict[str, Any]]:
    """Pre-tokenized payloads: ``{"tokens": int32[1..511]}``."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 512, size=n)
    return [{"tokens": rng.integers(0, 50_000, size=k, dtype=np.int32)} for k in lengths]


def make_pipeline(docs: list[dict[str, Any]], packer: str) -> zephon.Pipeline:
    op = (
        pack_flat(SEQ_LEN)
        if packer == "flat"
        else pack_sequences(SEQ_LEN, open_bins=OPEN_BINS, strategy=packer)
    )
    return zephon.Pipeline(
        ListSource(docs, chunk_size=CHUNK),
        [fetch(), op],
        epoch_chunks=EPOCH_DOCS // CHUNK,
        micro_batch=256,
    )


def run_pipeline(pipeline: zephon.Pipeline) -> int:
    """Deliver everything; return the number of packed records."""
    n = 0
    for _ in pipeline:
        n += 1
    return n


class _Bin:
    __slots__ = ("positions", "room", "segment_ids", "segments", "tokens")

    def __init__(self) -> None:
        self.tokens = np.zeros(SEQ_LEN, dtype=np.int32)
        self.segment_ids = np.zeros(SEQ_LEN, dtype=np.int32)
        self.positions = np.zeros(SEQ_LEN, dtype=np.int32)
        self.room = SEQ_LEN
        self.segments = 0


def python_first_fit(docs: list[dict[str, Any]]) -> list[dict[str, np.ndarray]]:
    """A pure-Python streaming first-fit packer (the shape of Grain's), with the same rules and
    payload as ``pack_sequences``: long sequences fill bins of their own, the fullest bin leaves
    when nothing fits, every bin is flushed each ``EPOCH_DOCS`` sequences."""
    out: list[dict[str, np.ndarray]] = []
    open_bins: list[_Bin] = []
    arange = np.arange(SEQ_LEN, dtype=np.int32)

    def emit(b: _Bin) -> None:
        out.append({"tokens": b.tokens, "segment_ids": b.segment_ids, "positions": b.positions})

    def place(b: _Bin, piece: np.ndarray) -> None:
        at = SEQ_LEN - b.room
        n = len(piece)
        b.segments += 1
        b.tokens[at : at + n] = piece
        b.segment_ids[at : at + n] = b.segments
        b.positions[at : at + n] = arange[:n]
        b.room -= n

    for i, doc in enumerate(docs):
        tokens = doc["tokens"]
        while len(tokens) >= SEQ_LEN:
            full = _Bin()
            place(full, tokens[:SEQ_LEN])
            emit(full)
            tokens = tokens[SEQ_LEN:]
        if len(tokens):
            target = next((b for b in open_bins if b.room >= len(tokens)), None)
            if target is None:
                if len(open_bins) == OPEN_BINS:
                    fullest = min(open_bins, key=lambda b: b.room)
                    open_bins.remove(fullest)
                    emit(fullest)
                target = _Bin()
                open_bins.append(target)
            place(target, tokens)
            if target.room == 0:
                open_bins.remove(target)
                emit(target)
        if (i + 1) % EPOCH_DOCS == 0:
            for b in open_bins:
                emit(b)
            open_bins = []
    for b in open_bins:
        emit(b)
    return out


class PackEndToEnd:
    """Tokens/s and fill of the packers through a Pipeline (fetch -> pack), source included."""

    params = (["best_fit", "first_fit", "flat"],)
    param_names = ["packer"]
    timeout = 300

    def setup(self, packer: str) -> None:
        self.docs = uniform_documents()
        self.n_tokens = sum(len(d["tokens"]) for d in self.docs)
        self.pipeline = make_pipeline(self.docs, packer)

    def time_pipeline(self, packer: str) -> None:
        run_pipeline(self.pipeline)

    def track_tokens_per_second(self, packer: str) -> float:
        start = time.perf_counter()
        run_pipeline(self.pipeline)
        return self.n_tokens / (time.perf_counter() - start)

    track_tokens_per_second.unit = "tokens/s"  # type: ignore[attr-defined]

    def track_fill(self, packer: str) -> float:
        return self.n_tokens / (run_pipeline(self.pipeline) * SEQ_LEN)

    track_fill.unit = "fill"  # type: ignore[attr-defined]

    def track_speedup_over_python_first_fit(self, packer: str) -> float:
        start = time.perf_counter()
        python_first_fit(self.docs)
        python_s = time.perf_counter() - start
        start = time.perf_counter()
        run_pipeline(self.pipeline)
        return python_s / (time.perf_counter() - start)

    track_speedup_over_python_first_fit.unit = "x"  # type: ignore[attr-defined]


class PythonFirstFit:
    """The in-process baseline: pure-Python streaming first-fit on the same documents."""

    timeout = 300

    def setup(self) -> None:
        self.docs = uniform_documents()
        self.n_tokens = sum(len(d["tokens"]) for d in self.docs)

    def time_python_first_fit(self) -> None:
        python_first_fit(self.docs)

    def track_tokens_per_second(self) -> float:
        start = time.perf_counter()
        python_first_fit(self.docs)
        return self.n_tokens / (time.perf_counter() - start)

    track_tokens_per_second.unit = "tokens/s"  # type: ignore[attr-defined]

    def track_fill(self) -> float:
        return self.n_tokens / (len(python_first_fit(self.docs)) * SEQ_LEN)

    track_fill.unit = "fill"  # type: ignore[attr-defined]


def main(repeats: int = 3) -> None:
    """Print tokens/s and fill of each packer and of the Python baseline (best of ``repeats``)."""
    docs = uniform_documents()
    n_tokens = sum(len(d["tokens"]) for d in docs)

    def best(fn: Any) -> tuple[float, Any]:
        times, result = [], None
        for _ in range(repeats):
            start = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - start)
        return min(times), result

    base_s, bins = best(lambda: python_first_fit(docs))
    print(
        f"python first-fit      {n_tokens / base_s / 1e6:7.2f} Mtok/s  "
        f"fill {n_tokens / (len(bins) * SEQ_LEN):.4f}"
    )
    for packer in ("best_fit", "first_fit", "flat"):
        pipeline = make_pipeline(docs, packer)
        secs, n_bins = best(lambda p=pipeline: run_pipeline(p))
        print(
            f"pipeline {packer:<12} {n_tokens / secs / 1e6:7.2f} Mtok/s  "
            f"fill {n_tokens / (n_bins * SEQ_LEN):.4f}  x{base_s / secs:.1f} vs python first-fit"
        )


if __name__ == "__main__":
    main()
