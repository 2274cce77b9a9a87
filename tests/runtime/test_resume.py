"""head + resumed tail == uninterrupted stream, for random pipelines and every kind of operator."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from pipeline_kit import (
    DropMultiples,
    PackPairs,
    RunningTotal,
    SplitInChildren,
    WindowShuffle,
    assert_resumes_at,
    assert_resumes_twice,
    run,
)

import zephon
from zephon.ops.basic import fetch, filter_records, map_transform
from zephon.ops.batching import batch
from zephon.sources.memory import RangeSource

OPERATORS = {
    "split": lambda: SplitInChildren(3),
    "drop": lambda: DropMultiples(4),
    "shuffle": lambda: WindowShuffle(5, seed=7),
    "total": RunningTotal,
    "pairs": PackPairs,
    "filter": lambda: filter_records(_odd_sum),
    "map": lambda: map_transform(_tag),
}


def _odd_sum(payload: dict) -> bool:
    return payload["idx"] % 3 != 1


def _tag(payload: dict) -> dict:
    return {**payload, "tag": payload["idx"] * 7 % 11}


@st.composite
def pipelines(draw: Any) -> zephon.Pipeline:
    n = draw(st.integers(0, 120))
    source = RangeSource(
        n,
        chunk_size=draw(st.integers(1, 17)),
        shuffle=draw(st.booleans()),
        seed=draw(st.integers(0, 3)),
        passes=draw(st.sampled_from([1, 2])),
    )
    names = draw(st.lists(st.sampled_from(sorted(OPERATORS)), max_size=4))
    ops: list = [fetch(), *(OPERATORS[name]() for name in names)]
    if draw(st.booleans()):
        ops.append(batch(draw(st.integers(1, 5)), drop_remainder=draw(st.booleans())))
    return zephon.Pipeline(
        source,
        ops,
        lanes=draw(st.integers(1, 3)),
        epoch_chunks=draw(st.integers(1, 4)),
        micro_batch=draw(st.integers(1, 8)),
    )


WORKER_KINDS = ["inline", "thread", "process"]


@settings(max_examples=60)
@given(pipeline=pipelines(), data=st.data())
def test_resume_at_any_step_continues_the_uninterrupted_stream(pipeline, data):
    full = run(iter(pipeline))
    steps = sorted(set(data.draw(st.lists(st.integers(0, len(full)), min_size=1, max_size=4))))
    assert_resumes_at(pipeline, steps, full)


@settings(max_examples=40)
@given(pipeline=pipelines(), data=st.data())
def test_resuming_twice_in_a_row_continues_the_stream(pipeline, data):
    full = run(iter(pipeline))
    first = data.draw(st.integers(0, len(full)))
    second = data.draw(st.integers(0, len(full) - first))
    assert_resumes_twice(pipeline, first, second, full)


@settings(max_examples=8)
@given(
    pipeline=pipelines(),
    data=st.data(),
    kinds=st.tuples(st.sampled_from(["thread", "process"]), st.sampled_from(WORKER_KINDS)),
)
def test_resume_with_thread_and_process_lanes_and_across_kinds(pipeline, data, kinds):
    full = run(iter(pipeline))
    saved_with, resumed_with = kinds
    step = data.draw(st.integers(0, len(full)))
    pipeline.workers = saved_with
    with iter(pipeline) as loader:
        head = run(loader, step) if step else []
        assert head == full[:step]
        state = loader.state_dict()
    pipeline.workers = resumed_with
    with pipeline.iter(state=state) as resumed:
        assert head + run(resumed) == full


def test_state_taken_before_any_delivery_after_restore_is_the_restored_state():
    pipeline = zephon.Pipeline(RangeSource(50, chunk_size=7), [fetch(), WindowShuffle(4)])
    loader = iter(pipeline)
    run(loader, 11)
    state = loader.state_dict()
    assert pipeline.iter(state=state).state_dict() == state


def test_state_at_the_very_end_resumes_to_an_empty_stream():
    pipeline = zephon.Pipeline(
        RangeSource(40, chunk_size=6), [fetch(), SplitInChildren(), batch(3)], lanes=2
    )
    loader = iter(pipeline)
    full = run(loader)
    assert full
    assert run(pipeline.iter(state=loader.state_dict())) == []


def test_resume_across_a_pass_boundary_of_a_shuffled_source():
    source = RangeSource(30, chunk_size=4, shuffle=True, seed=3, passes=3)
    pipeline = zephon.Pipeline(source, [fetch(), WindowShuffle(3), batch(2)], epoch_chunks=2)
    full = run(iter(pipeline))
    for step in range(len(full) + 1):
        loader = iter(pipeline)
        head = run(loader, step) if step else []
        assert head + run(pipeline.iter(state=loader.state_dict())) == full


def test_every_sample_is_delivered_once_per_pass():
    source = RangeSource(57, chunk_size=5, shuffle=True, passes=2)
    pipeline = zephon.Pipeline(source, [fetch(), WindowShuffle(6)], lanes=3, epoch_chunks=2)
    seen = [rec.payload["idx"] for rec in pipeline]
    assert sorted(seen) == sorted(list(range(57)) * 2)
