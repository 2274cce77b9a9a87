"""Elastic determinism: the job's lanes, not its ranks, fix the stream. For every world size that
divides the lane count, global step k holds item k of every lane; a job state merged from all
ranks resumes on any such world size with the same global steps."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from pipeline_kit import SplitInChildren, WindowShuffle, fingerprint_item

import zephon
from zephon.errors import CheckpointError, CheckpointMismatchError, PlanError
from zephon.ops import ensure_mixture, pack_sequences, tokenize
from zephon.ops.basic import fetch, map_transform
from zephon.ops.batching import batch
from zephon.sources.memory import ListSource, RangeSource
from zephon.sources.mixture import MixtureSource

N = 8


def _double(payload: dict) -> dict:
    return {**payload, "twice": payload["idx"] * 2}


def monotone(**kw: Any) -> zephon.Pipeline:
    return zephon.Pipeline(
        RangeSource(400, chunk_size=10), [fetch(), map_transform(_double), batch(2)], **kw
    )


def _texts(dataset: int, n: int) -> ListSource:
    items = [{"text": f"{'ab' * (1 + (i * 7 + dataset) % 13)} {dataset}-{i}"} for i in range(n)]
    return ListSource(items, dataset_id=dataset, chunk_size=16)


def packed(**kw: Any) -> zephon.Pipeline:
    source = MixtureSource(
        {"a": _texts(0, 300), "b": _texts(1, 300)}, {"a": 0.6, "b": 0.4}, chunk_size=16
    )
    ops = [
        fetch(),
        tokenize(max_len=12, split_long_samples=True),
        WindowShuffle(5, seed=1),
        pack_sequences(32, open_bins=4, pad_id=0),
        ensure_mixture({"a": 0.6, "b": 0.4}, buffer_size=8),
        batch(2),
    ]
    return zephon.Pipeline(source, ops, epoch_chunks=2, **kw)


PIPELINES: dict[str, Callable[..., zephon.Pipeline]] = {"monotone": monotone, "packed": packed}


def shortest_lane(make: Callable[..., zephon.Pipeline]) -> int:
    """Items in the shortest lane's stream (one rank per lane): the guarantee holds until then."""
    return min(len(list(make(lanes=N, rank=r, world_size=N))) for r in range(N))


def steps_of(streams: list[list], per: int, limit: int) -> list[Counter]:
    """Step k: the ``per`` items every rank delivers from its ``k * per``-th on."""
    steps = min(min(len(s) for s in streams) // per, limit)
    return [
        Counter(item for s in streams for item in s[k * per : (k + 1) * per]) for k in range(steps)
    ]


def global_steps(make: Callable[..., zephon.Pipeline], world: int, **kw: Any) -> list[Counter]:
    """The run's global steps until the first lane ends."""
    streams = [
        [fingerprint_item(x) for x in make(lanes=N, rank=r, world_size=world, **kw)]
        for r in range(world)
    ]
    return steps_of(streams, N // world, shortest_lane(make))


@pytest.mark.parametrize("kind", sorted(PIPELINES))
def test_global_steps_do_not_depend_on_world_size_or_workers(kind: str) -> None:
    make = PIPELINES[kind]
    reference = global_steps(make, 1)
    assert len(reference) > 5
    for world in (2, 4, 8):
        for workers in ("inline", "thread"):
            steps = global_steps(make, world, workers=workers)
            assert steps == reference, f"world_size={world}, workers={workers}"


@pytest.mark.parametrize("kind", sorted(PIPELINES))
def test_process_workers_give_the_same_global_steps(kind: str) -> None:
    make = PIPELINES[kind]
    reference = global_steps(make, 1)
    for world in (2, 8):
        assert global_steps(make, world, workers="process") == reference, f"world_size={world}"


def _checkpoint(make: Callable[..., zephon.Pipeline], world: int, step: int) -> tuple:
    """Run every rank ``step`` global steps; the merged job state and what was delivered."""
    per = N // world
    states, heads = [], []
    for r in range(world):
        loader = iter(make(lanes=N, rank=r, world_size=world))
        heads.append([fingerprint_item(next(loader)) for _ in range(step * per)])
        states.append(json.loads(json.dumps(loader.state_dict())))
        loader.close()
    return zephon.merge_states(states), heads


def _steps_after(
    job: dict, make: Callable[..., zephon.Pipeline], world: int, done: int
) -> list[Counter]:
    """The global steps after a job state taken at global step ``done``."""
    streams = [
        [fingerprint_item(x) for x in make(rank=r, world_size=world).iter(state=job)]
        for r in range(world)
    ]
    return steps_of(streams, N // world, shortest_lane(make) - done)


@pytest.mark.parametrize("kind", sorted(PIPELINES))
@pytest.mark.parametrize("step", [0, 3, 11])
def test_a_job_checkpointed_on_four_ranks_resumes_on_one_two_and_eight(
    kind: str, step: int
) -> None:
    make = PIPELINES[kind]
    reference = global_steps(make, 4)
    job, _ = _checkpoint(make, 4, step)
    for world in (1, 2, 8):
        resumed = _steps_after(job, make, world, step)
        assert resumed, f"nothing resumed on world_size={world}"
        assert resumed == reference[step:], f"world_size={world}"


def test_resuming_twice_across_three_world_sizes_keeps_the_global_steps() -> None:
    reference = global_steps(packed, 1)
    job, _ = _checkpoint(packed, 4, 2)
    # two more global steps on two ranks, then a job state again
    states = []
    for r in range(2):
        loader = packed(rank=r, world_size=2).iter(state=job)
        for _ in range(2 * (N // 2)):
            next(loader)
        states.append(loader.state_dict())
    job2 = zephon.merge_states(states)
    resumed = _steps_after(job2, packed, 8, 4)
    assert resumed
    assert resumed == reference[4:]


def test_a_job_state_at_the_end_resumes_to_nothing_on_any_world_size() -> None:
    states = []
    for r in range(4):
        loader = iter(monotone(lanes=N, rank=r, world_size=4))
        for _ in loader:
            pass
        states.append(loader.state_dict())
    job = zephon.merge_states(states)
    for world in (1, 2, 8):
        for r in range(world):
            assert list(monotone(rank=r, world_size=world).iter(state=job)) == []


def test_a_rank_state_resumes_directly_when_the_world_size_is_unchanged() -> None:
    full = [fingerprint_item(x) for x in monotone(lanes=N, rank=1, world_size=2)]
    loader = iter(monotone(lanes=N, rank=1, world_size=2))
    head = [fingerprint_item(next(loader)) for _ in range(9)]
    tail = [
        fingerprint_item(x) for x in monotone(rank=1, world_size=2).iter(state=loader.state_dict())
    ]
    assert head + tail == full


def _rank_states(world: int, steps: list[int]) -> list[dict]:
    states = []
    for r, step in zip(range(world), steps):
        loader = iter(monotone(lanes=N, rank=r, world_size=world))
        for _ in range(step * (N // world)):
            next(loader)
        states.append(loader.state_dict())
    return states


def test_merging_refuses_missing_duplicated_and_uneven_ranks() -> None:
    states = _rank_states(4, [2, 2, 2, 2])
    with pytest.raises(CheckpointError, match=r"lanes \[6, 7\].*rank\(s\) \[3\]"):
        zephon.merge_states(states[:3])
    with pytest.raises(CheckpointError, match="more than once"):
        zephon.merge_states([*states, states[0]])
    with pytest.raises(CheckpointError, match="different global steps"):
        zephon.merge_states(_rank_states(4, [2, 2, 3, 2]))
    other = iter(
        zephon.Pipeline(
            RangeSource(401, chunk_size=10),
            [fetch(), map_transform(_double), batch(2)],
            lanes=N,
            rank=3,
            world_size=4,
        )
    )
    next(other)
    with pytest.raises(CheckpointMismatchError, match="different pipelines"):
        zephon.merge_states([*states[:3], other.state_dict()])
    with pytest.raises(CheckpointError):
        zephon.merge_states([])


def test_a_rank_state_on_another_world_size_points_to_merge_states() -> None:
    state = _rank_states(4, [1, 1, 1, 1])[0]
    with pytest.raises(CheckpointMismatchError, match="merge_states"):
        monotone(rank=0, world_size=2).iter(state=state)


def test_a_job_state_with_another_lane_count_is_a_mismatch_without_relane() -> None:
    job = zephon.merge_states(_rank_states(4, [1, 1, 1, 1]))
    with pytest.raises(CheckpointMismatchError, match="lanes"):
        monotone(lanes=4, rank=0, world_size=2, relane=False).iter(state=job)


def test_lanes_must_be_a_multiple_of_the_world_size() -> None:
    with pytest.raises(PlanError, match=r"lanes=6 .* world_size=4"):
        monotone(lanes=6, rank=0, world_size=4).compile()


def test_default_lanes_resumed_on_a_world_size_they_do_not_divide_say_to_pass_lanes() -> None:
    # lanes=None: one lane per rank on the first run (4), the checkpoint's 4 on a resume on 3
    states = []
    for r in range(4):
        with monotone(rank=r, world_size=4).iter() as loader:
            for _ in range(2):
                next(loader)
            states.append(loader.state_dict())
    job = zephon.merge_states(states)
    with pytest.raises(PlanError) as refused:
        monotone(rank=0, world_size=3).iter(state=job)
    assert "the checkpoint's 4 lanes" in str(refused.value)
    assert "pass lanes=" in str(refused.value) and "multiple of 3" in str(refused.value)
    with pytest.warns(zephon.RelaneWarning):  # what it says to do
        relaned = [list(monotone(lanes=3, rank=r, world_size=3).iter(state=job)) for r in range(3)]
    assert sum(len(b) for stream in relaned for b in stream) == 400 - 4 * 2 * 2


def test_default_lanes_are_one_per_rank_and_the_fingerprint_ignores_world_size() -> None:
    assert monotone(rank=0, world_size=4).compile().lanes == 4
    a = monotone(lanes=N, rank=0, world_size=2).compile()
    b = monotone(lanes=N, rank=3, world_size=4).compile()
    assert a.fingerprint == b.fingerprint
    assert list(b.rank_lanes) == [6, 7]


def test_seeded_operators_use_the_global_lane() -> None:
    # lane 5's stream is the same whether it runs on rank 2 of 4 or rank 5 of 8
    def lane_stream(rank: int, world: int) -> list:
        make = zephon.Pipeline(
            RangeSource(300, chunk_size=5),
            [fetch(), SplitInChildren(2), WindowShuffle(6, seed=9)],
            lanes=N,
            rank=rank,
            world_size=world,
        )
        items = [fingerprint_item(x) for x in make]
        per = N // world
        first = 5 - rank * per  # lane 5's place in the rank's round-robin
        return items[first::per]

    alone = lane_stream(5, 8)
    assert len(alone) > 40
    assert lane_stream(2, 4)[:40] == alone[:40]


@pytest.mark.parametrize("workers", ["thread", "process"])
@pytest.mark.parametrize("processes", [1, 2])
def test_fewer_workers_than_lanes_give_the_same_global_steps(workers: str, processes: int) -> None:
    reference = global_steps(packed, 1)
    for world in (1, 4):
        steps = global_steps(packed, world, workers=workers, processes=processes)
        assert steps == reference, f"world_size={world}, {processes} {workers} worker(s)"


def test_a_checkpoint_taken_on_shared_workers_resumes_on_others() -> None:
    reference = global_steps(packed, 2)
    states = []
    for r in range(2):
        loader = iter(packed(lanes=N, rank=r, world_size=2, workers="process", processes=1))
        for _ in range(3 * (N // 2)):
            next(loader)
        states.append(loader.state_dict())
        loader.close()
    job = zephon.merge_states(states)
    resumed = [
        [
            fingerprint_item(x)
            for x in packed(rank=r, world_size=2, workers="thread", processes=2).iter(state=job)
        ]
        for r in range(2)
    ]
    assert steps_of(resumed, N // 2, shortest_lane(packed) - 3) == reference[3:]


def test_processes_is_checked_and_described() -> None:
    with pytest.raises(PlanError, match="processes"):
        monotone(lanes=N, processes=0).compile()
    plan = monotone(lanes=N, rank=0, world_size=2, workers="process", processes=3).compile()
    assert plan.processes == 3
    assert "3 worker process(s)" in plan.describe()
    assert plan.fingerprint == monotone(lanes=N, rank=0, world_size=2).compile().fingerprint


def test_merging_a_job_state_again_or_states_of_two_world_sizes_says_which_states() -> None:
    states = _rank_states(2, [2, 2])
    job = zephon.merge_states(states)
    with pytest.raises(CheckpointError, match=r"state #0 is a job state.*merged already"):
        zephon.merge_states([job, states[1]])
    damaged = {**states[1], "next_lane": 1 - states[1]["next_lane"]}
    with pytest.raises(CheckpointError, match=r"checksum.*\n  - at state 1"):
        zephon.merge_states([states[0], damaged])
    with pytest.raises(CheckpointError, match=r"rank 0 of 2.*rank 1 of 4"):
        zephon.merge_states([states[0], _rank_states(4, [2, 2])[1]])
