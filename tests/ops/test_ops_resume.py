"""head + resumed tail == uninterrupted stream, for random pipelines of the built-in operators:
tokenize (splitting), shuffle, pack_sequences, pack_flat, ensure_mixture and batch."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pipeline_kit import assert_resumes_at, assert_resumes_twice, run

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


def _doc_a(idx: int) -> dict:
    return {"text": "a" * (idx * 7 % 13), "idx": idx}


def _doc_b(idx: int) -> dict:
    return {"text": "b" * (idx * 5 % 29), "idx": idx}


# The drawn mixtures are often far from their weights on purpose: the warning is expected.
pytestmark = pytest.mark.filterwarnings("ignore::zephon.errors.MixtureDropWarning")

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
                    cut_to_fill=draw(st.booleans()),
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


@settings(max_examples=100)
@given(pipeline=pipelines(), data=st.data())
def test_resume_at_any_step_continues_the_uninterrupted_stream(pipeline, data):
    full = run(iter(pipeline))
    steps = sorted(set(data.draw(st.lists(st.integers(0, len(full)), min_size=1, max_size=3))))
    assert_resumes_at(pipeline, steps, full)


@settings(max_examples=40)
@given(pipeline=pipelines(), data=st.data())
def test_resuming_twice_in_a_row_continues_the_stream(pipeline, data):
    full = run(iter(pipeline))
    first = data.draw(st.integers(0, len(full)))
    second = data.draw(st.integers(0, len(full) - first))
    assert_resumes_twice(pipeline, first, second, full)


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
    assert_resumes_at(pipeline, list(range(len(full) + 1)), full)
