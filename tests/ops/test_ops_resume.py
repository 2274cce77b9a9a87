"""head + resumed tail == uninterrupted stream, for random pipelines of the built-in operators:
tokenize (splitting), shuffle, pack_sequences, pack_flat, ensure_mixture and batch."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import zephon
from zephon.ops import (
    batch,
    ensure_mixture,
    fetch,
    pack_flat,
    pack_sequences,
    shuffle,
    tokenize,
)
from zephon.sources.memory import RangeSource
from zephon.sources.mixture import MixtureSource
from zephon.types import SampleBatch


def _doc_a(idx: int) -> dict:
    return {"text": "a" * (idx * 7 % 13), "idx": idx}


def _doc_b(idx: int) -> dict:
    return {"text": "b" * (idx * 5 % 29), "idx": idx}


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


def fingerprint(item: Any) -> tuple:
    """What the training loop saw: cursors and payload bytes."""
    if isinstance(item, SampleBatch):
        return ("batch", tuple(r.meta.cursor for r in item), canonical(item.payload))
    return ("record", item.meta.cursor, canonical(item.payload))


def run(loader: zephon.Loader, limit: int | None = None) -> list[tuple]:
    """What ``loader`` delivers (up to ``limit`` items); it must report no contract violation."""
    out = []
    for item in loader:
        out.append(fingerprint(item))
        if limit is not None and len(out) == limit:
            break
    assert loader.stats()["violations"] == 0
    return out


STATEFUL = ("shuffle", "pack_sequences", "pack_flat", "ensure_mixture")


@st.composite
def pipelines(draw: Any) -> zephon.Pipeline:
    """A random strict pipeline: any contract violation (an early close, a missing tombstone)
    raises at delivery."""
    source = MixtureSource(
        {
            "a": RangeSource(draw(st.integers(8, 40)), dataset_id=0, make=_doc_a),
            "b": RangeSource(
                draw(st.integers(8, 40)),
                dataset_id=1,
                make=_doc_b,
                shuffle=draw(st.booleans()),
                seed=3,
            ),
        },
        {"a": 0.5, "b": 0.5},
        chunk_size=draw(st.integers(2, 9)),
        seed=draw(st.integers(0, 2)),
    )
    split = draw(st.booleans())
    max_len = draw(st.integers(2, 12)) if split or draw(st.booleans()) else None
    ops: list = [fetch(), tokenize(max_len=max_len, split_long_samples=split)]
    names = draw(st.lists(st.sampled_from(STATEFUL), min_size=1, max_size=3))
    for name in names:
        if name == "shuffle":
            ops.append(shuffle(draw(st.integers(1, 6)), seed=draw(st.integers(0, 3))))
        elif name == "pack_sequences":
            ops.append(
                pack_sequences(
                    draw(st.integers(4, 24)),
                    open_bins=draw(st.integers(1, 4)),
                    strategy=draw(st.sampled_from(["best_fit", "first_fit"])),
                )
            )
        elif name == "pack_flat":
            ops.append(pack_flat(draw(st.integers(4, 24))))
        else:
            w = draw(st.sampled_from([0.0, 0.3, 0.5, 0.8]))
            ops.append(
                ensure_mixture(
                    {"a": w, "b": 1.0 - w},
                    by=draw(st.sampled_from(["tokens", "samples"])),
                    buffer_size=draw(st.integers(1, 8)),
                    tolerance=draw(st.sampled_from([0.0, 0.05])),
                )
            )
    if draw(st.booleans()):
        ops.append(batch(draw(st.integers(1, 4)), drop_remainder=draw(st.booleans())))
    pipeline = zephon.Pipeline(
        source,
        ops,
        lanes=draw(st.integers(1, 3)),
        epoch_chunks=draw(st.integers(1, 4)),
        micro_batch=draw(st.integers(1, 8)),
        strict=True,
    )
    return pipeline


def streams_agree(pipeline: zephon.Pipeline, steps: list[int], full: list[tuple]) -> None:
    for step in steps:
        loader = iter(pipeline)
        head = run(loader, step) if step else []
        state = json.loads(json.dumps(loader.state_dict()))  # it must survive JSON
        tail = run(pipeline.iter(state=state))
        assert head + tail == full, f"resume at step {step} of {len(full)}"


@settings(max_examples=100)
@given(pipeline=pipelines(), data=st.data())
def test_resume_at_any_step_continues_the_uninterrupted_stream(pipeline, data):
    full = run(iter(pipeline))
    steps = sorted(set(data.draw(st.lists(st.integers(0, len(full)), min_size=1, max_size=3))))
    streams_agree(pipeline, steps, full)


@settings(max_examples=40)
@given(pipeline=pipelines(), data=st.data())
def test_resuming_twice_in_a_row_continues_the_stream(pipeline, data):
    full = run(iter(pipeline))
    first = data.draw(st.integers(0, len(full)))
    second = data.draw(st.integers(0, len(full) - first))
    loader = iter(pipeline)
    head = run(loader, first) if first else []
    resumed = pipeline.iter(state=loader.state_dict())
    middle = run(resumed, second) if second else []
    tail = run(pipeline.iter(state=resumed.state_dict()))
    assert head + middle + tail == full


def test_the_full_chain_resumes_at_every_step():
    source = MixtureSource(
        {
            "a": RangeSource(30, dataset_id=0, make=_doc_a),
            "b": RangeSource(30, dataset_id=1, make=_doc_b),
        },
        {"a": 0.5, "b": 0.5},
        chunk_size=6,
    )
    pipeline = zephon.Pipeline(
        source,
        [
            fetch(),
            tokenize(max_len=8, split_long_samples=True),
            shuffle(5, seed=1),
            ensure_mixture({"a": 0.5, "b": 0.5}, buffer_size=4),
            pack_sequences(16, open_bins=3),
            batch(2),
        ],
        lanes=2,
        epoch_chunks=2,
        micro_batch=4,
        strict=True,
    )
    full = run(iter(pipeline))
    assert len(full) > 10
    streams_agree(pipeline, list(range(len(full) + 1)), full)
