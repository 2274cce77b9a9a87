"""A lane kind registered from outside the package runs every pipeline as the built-in kinds do:
the same stream as thread lanes, exact resumes from a state taken mid-run, and re-laning. The
built-in kinds are registered kinds like it, and the planner accepts exactly the registered
names."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from own_thread_lanes import NAME, OwnThreadLane, open_own_thread_lanes
from pipeline_kit import fingerprint_item, run
from text_pipelines_kit import mixture_pipeline, text_pipeline, texts

import zephon
from zephon.errors import PlanError, RelaneWarning
from zephon.ops import (
    Operator,
    OperatorContext,
    OpTraits,
    batch,
    fetch,
    pack_sequences,
    shuffle,
    tokenize,
)
from zephon.runtime.loader import Loader
from zephon.runtime.workers.kinds import open_lanes
from zephon.runtime.workers.registry import (
    lane_kind_names,
    register_lane_kind,
    unregister_lane_kind,
)
from zephon.sources.memory import RangeSource

pytestmark = pytest.mark.usefixtures("no_leftover_workers")


@pytest.fixture(autouse=True, scope="module")
def own_thread_kind() -> Iterator[None]:
    register_lane_kind(NAME, open_own_thread_lanes)
    yield
    unregister_lane_kind(NAME)


def text(**kw: Any) -> zephon.Pipeline:
    return text_pipeline(300, **kw)


def mixture(**kw: Any) -> zephon.Pipeline:
    return mixture_pipeline(200, **kw)


def packing(**kw: Any) -> zephon.Pipeline:
    ops = [
        fetch(),
        tokenize(max_len=40, split_long_samples=True),
        shuffle(8, seed=5),
        pack_sequences(64, open_bins=3),
        batch(2),
    ]
    return zephon.Pipeline(texts(2, 300), ops, epoch_chunks=4, **kw)


PIPELINES: dict[str, Callable[..., zephon.Pipeline]] = {
    "text": text,
    "mixture": mixture,
    "packing": packing,
}


def stream(loader: Loader) -> list[tuple]:
    with loader:
        return run(loader)


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_a_registered_kind_delivers_the_stream_of_thread_lanes(name: str) -> None:
    make = PIPELINES[name]
    on_threads = stream(iter(make(lanes=4, processes=2, workers="thread")))
    assert on_threads
    assert stream(iter(make(lanes=4, processes=2, workers=NAME))) == on_threads


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_a_registered_kind_resumes_exactly_from_a_state_taken_mid_run(name: str) -> None:
    make = PIPELINES[name]
    full = stream(iter(make(lanes=4, workers="thread")))
    for step in (1, len(full) // 2, len(full) - 1):
        loader = iter(make(lanes=4, workers=NAME))
        head = run(loader, step)
        state = json.loads(json.dumps(loader.state_dict()))
        loader.close()
        assert head + stream(make(lanes=4, workers=NAME).iter(state=state)) == full
        # and the state is an ordinary one: thread lanes continue it alike
        assert head + stream(make(lanes=4, workers="thread").iter(state=state)) == full


def relaned(make: Callable[..., zephon.Pipeline], state: dict, workers: str) -> list[tuple]:
    with pytest.warns(RelaneWarning, match="onto 3 lanes"):
        loader = make(lanes=3, workers=workers).iter(state=state)
    with loader:
        return [fingerprint_item(item) for item in loader]


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_a_registered_kind_relanes_a_state_like_thread_lanes(name: str) -> None:
    make = PIPELINES[name]
    loader = iter(make(lanes=4, workers=NAME))
    head = run(loader, 7)
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    assert len(head) == 7
    on_threads = relaned(make, state, "thread")
    assert on_threads
    assert relaned(make, state, NAME) == on_threads


def test_the_opened_lanes_are_the_registered_kinds_own() -> None:
    plan = text(lanes=4, processes=2, workers=NAME).compile()
    lanes = open_lanes(plan, [(lane, {}) for lane in plan.rank_lanes])
    try:
        assert [type(lane) for lane in lanes] == [OwnThreadLane] * 4
        assert [lane.lane_id for lane in lanes] == [0, 1, 2, 3]
        assert all(next(lane) is not None for lane in lanes)
    finally:
        for lane in lanes:
            lane.close()


def test_the_planner_accepts_exactly_the_registered_kinds() -> None:
    assert lane_kind_names()[:3] == ("inline", "thread", "process")
    assert NAME in lane_kind_names()
    with pytest.raises(PlanError, match=r"workers must be one of .*'own-thread'.*got 'rayy'"):
        text(workers="rayy").compile()
    with pytest.raises(PlanError, match="registered already"):
        register_lane_kind("thread", open_own_thread_lanes)
    unregister_lane_kind(NAME)
    try:
        with pytest.raises(PlanError, match="got 'own-thread'"):
            text(workers=NAME).compile()
    finally:
        register_lane_kind(NAME, open_own_thread_lanes)


NOTED: list[tuple[str, ...]] = []  # what the operators below did, in this process


class NotedSetup(Operator):
    """Notes its setup (where, and whether on the main thread) and its teardown."""

    traits = OpTraits(preserves_cursor_order=True)

    def setup(self, ctx: OperatorContext) -> None:
        on_main = threading.current_thread() is threading.main_thread()
        NOTED.append(("setup", ctx.worker, str(list(ctx.lanes)), str(on_main)))

    def teardown(self) -> None:
        NOTED.append(("teardown",))

    def process_many(self, records: list) -> list:
        return records


def test_a_registered_kind_shares_the_training_process_setup_of_its_operators() -> None:
    NOTED.clear()
    pipeline = zephon.Pipeline(
        RangeSource(64, chunk_size=8), [fetch(), NotedSetup(), batch(4)], lanes=4, workers=NAME
    )
    with iter(pipeline) as loader:
        assert len(run(loader)) == 16
    # once for the loader's four lanes, on a lane's own thread, and torn down once
    assert NOTED == [("setup", NAME, "[0, 1, 2, 3]", "False"), ("teardown",)]
