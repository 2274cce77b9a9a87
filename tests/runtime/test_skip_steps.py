"""``zephon.skip_steps``: a state that continues n global steps later, as the uninterrupted run
is then, with the skipped items booked as delivered and the skip kept in the state's history."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
from pipeline_kit import fingerprint_item

import zephon
from zephon.errors import CheckpointCorruptError, OperatorError
from zephon.ops import map_transform
from zephon.ops.basic import fetch
from zephon.ops.batching import batch
from zephon.ops.shuffle import shuffle
from zephon.runtime.checkpoint.format import seal
from zephon.sources.memory import RangeSource


def pipeline(seed: int = 8, **kw: Any) -> zephon.Pipeline:
    source = RangeSource(900, chunk_size=9, make=lambda i: {"idx": i})
    ops = [fetch(), shuffle(6, seed=seed), batch(2)]
    return zephon.Pipeline(source, ops, **{"lanes": 4, "epoch_chunks": 2, **kw})


def stream(loader: Any) -> list[tuple]:
    return [fingerprint_item(item) for item in loader]


def checkpoint(make: Any, items: int, **kw: Any) -> tuple[list[tuple], dict]:
    loader = iter(make(**kw))
    head = [fingerprint_item(next(loader)) for _ in range(items)]
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    return head, state


@pytest.mark.parametrize("step", [0, 3, 20])
def test_a_merged_job_state_resumes_fifty_global_steps_later_on_two_ranks(step: int) -> None:
    full = [stream(pipeline(rank=r, world_size=2)) for r in range(2)]
    states = [checkpoint(pipeline, 2 * step, rank=r, world_size=2)[1] for r in range(2)]
    job = zephon.skip_steps(zephon.merge_states(states), 50)
    for r in range(2):
        resumed = stream(pipeline(rank=r, world_size=2).iter(state=job))
        assert resumed == full[r][2 * (step + 50) :], f"rank {r}"
        assert resumed


@pytest.mark.parametrize("step", [0, 7])
def test_a_single_rank_state_resumes_n_global_steps_later(step: int) -> None:
    full = stream(pipeline())
    _, state = checkpoint(pipeline, 4 * step + 1)  # also in the middle of a global step
    skipped = zephon.skip_steps(state, 50)
    assert stream(pipeline().iter(state=skipped)) == full[4 * (step + 50) + 1 :]
    twice = zephon.skip_steps(zephon.skip_steps(state, 20), 30)
    assert stream(pipeline().iter(state=twice)) == full[4 * (step + 50) + 1 :]


def test_the_skip_is_booked_as_delivered_and_kept_in_the_history() -> None:
    _, state = checkpoint(pipeline, 8)
    skipped = zephon.skip_steps(state, 5)
    assert skipped["skip"] == 5
    assert skipped["history"] == [{"event": "skip", "step": 2, "steps": 5}]
    loader = pipeline().iter(state=skipped)
    assert loader.state_dict()["skip"] == 5  # not done yet: still in the state
    first = next(loader)
    later = loader.state_dict()
    loader.close()
    assert later["skip"] == 0 and later["history"] == skipped["history"]
    assert [s["delivered"] for s in later["lane_states"]] == [8, 7, 7, 7]
    assert later["counters"]["delivered"] == state["counters"]["delivered"] + 5 * 4 * 2 + 2
    # the state taken after the skip resumes exactly
    full = stream(pipeline())
    assert [fingerprint_item(first), *stream(pipeline().iter(state=later))] == full[28:]


def test_a_skip_is_done_on_the_new_lanes_after_a_relaning() -> None:
    loader = iter(pipeline())
    before = [i for _ in range(8) for i in next(loader).payload["idx"].tolist()]
    state = loader.state_dict()
    loader.close()
    with pytest.warns(zephon.RelaneWarning):
        loader = pipeline(lanes=2).iter(state=zephon.skip_steps(state, 10))
    rest = [i for item in loader for i in item.payload["idx"].tolist()]
    # each of the 2 new lanes skipped 10 batches of 2; nothing else is lost or repeated
    assert len(set(before + rest)) == len(before + rest) == 900 - 10 * 2 * 2


def test_an_edited_skip_count_is_refused() -> None:
    _, state = checkpoint(pipeline, 8)
    skipped = zephon.skip_steps(state, 5)
    body = {k: v for k, v in skipped.items() if k != "checksum"}
    with pytest.raises(CheckpointCorruptError, match="skip"):
        pipeline().iter(state=seal({**body, "skip": 6}))
    with pytest.raises(CheckpointCorruptError, match="skip"):
        pipeline().iter(
            state=seal({**{k: v for k, v in state.items() if k != "checksum"}, "skip": 1})
        )
    with pytest.raises(ValueError, match="global steps"):
        zephon.skip_steps(state, -1)


def test_states_of_the_previous_format_merge_skip_and_resume() -> None:
    full = [stream(pipeline(rank=r, world_size=2)) for r in range(2)]
    old = []
    for r in range(2):
        _, state = checkpoint(pipeline, 6, rank=r, world_size=2)
        body = {
            k: v for k, v in state.items() if k not in ("checksum", "history", "skip", "retired")
        }
        old.append(seal({**body, "version": 3}))
    job = zephon.skip_steps(zephon.merge_states(old), 4)
    assert job["version"] == 4 and job["history"][0]["event"] == "skip"
    for r in range(2):
        assert stream(pipeline(rank=r, world_size=2).iter(state=job)) == full[r][2 * (3 + 4) :]


@pytest.mark.parametrize("event", ["retire", "change"])
def test_a_state_taken_before_the_skip_is_done_resumes_after_retiring_or_a_change(
    event: str,
) -> None:
    _, state = checkpoint(pipeline, 8)
    skipped = zephon.skip_steps(state, 5)
    seed = 8 if event == "retire" else 9
    kw: dict[str, Any] = (
        {"retire": [(0, 0, i) for i in range(0, 900, 7)]}
        if event == "retire"
        else {"allow_changes": True}
    )

    def make() -> zephon.Pipeline:
        return pipeline(seed=seed)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zephon.PipelineChangeWarning)
        expected = stream(make().iter(state=skipped, **kw))
        loader = make().iter(state=skipped, **kw)
    # saved at once (a preemption before the first step): the skip and the event both kept
    early = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    assert early["skip"] == 5
    assert sorted(e["event"] for e in early["history"]) == sorted(["skip", event])
    assert stream(make().iter(state=early)) == expected
    # a second skip joins the one still to be done
    again = zephon.skip_steps(early, 1)
    assert again["skip"] == 6
    assert stream(make().iter(state=again)) == expected[4:]


def _fails_on_500(payload: dict) -> dict:
    if payload["idx"] == 500:
        raise ValueError("sample 500 is broken")
    return payload


def failing(on_error: str) -> zephon.Pipeline:
    source = RangeSource(900, chunk_size=9, make=lambda i: {"idx": i})
    ops = [fetch(), map_transform(_fails_on_500), shuffle(6, seed=8), batch(2)]
    return zephon.Pipeline(source, ops, lanes=4, epoch_chunks=2, on_error=on_error)


def test_a_skip_that_fails_leaves_the_state_it_started_from() -> None:
    steps = 100  # the broken sample is read while skipping, by the last lane
    full = stream(failing("skip"))
    _, state = checkpoint(failing, 8, on_error="raise")
    skipped = zephon.skip_steps(state, steps)
    loader = failing("raise").iter(state=skipped)
    with pytest.raises(OperatorError, match="broken"):
        next(loader)
    after = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    assert after["skip"] == steps
    assert [s["delivered"] for s in after["lane_states"]] == [2, 2, 2, 2]
    # resumed where it stood, skipping the broken sample this time
    assert stream(failing("skip").iter(state=after)) == full[4 * (2 + steps) :]


def uneven(**kw: Any) -> zephon.Pipeline:
    """11 chunks of 10 on 3 lanes: 14, 14 and 10 batches; after lane 2 ends, lanes 0 and 1 fill
    the global steps."""
    source = RangeSource(110, chunk_size=10, make=lambda i: {"idx": i})
    ops = [fetch(), shuffle(4, seed=1), batch(3)]
    return zephon.Pipeline(source, ops, **{"lanes": 3, "epoch_chunks": 2, **kw})


@pytest.mark.parametrize("step", [0, 3, 6])
@pytest.mark.parametrize("steps", [5, 10, 11, 12, 13])
def test_a_skip_past_the_end_of_a_lane_skips_the_global_steps_of_the_run(
    step: int, steps: int
) -> None:
    full = stream(uneven())
    _, state = checkpoint(uneven, 3 * step)
    assert (
        stream(uneven().iter(state=zephon.skip_steps(state, steps))) == full[3 * (step + steps) :]
    )
