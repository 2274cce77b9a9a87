"""A rank's global step is counted from the items its ``next()`` calls handed over, so ranks in
lockstep merge into a job state at every global step: after lanes ended (the rank's other lanes
then deliver more per step) and right after a re-laning onto more lanes than chunks are left.
Ranks checkpointed inside a global step are refused at merge, saying so, never as corrupt."""

from __future__ import annotations

import json
import warnings
from collections import defaultdict
from typing import Any

import pytest
from pipeline_kit import fingerprint_item

import zephon
from zephon.errors import CheckpointError, RelaneWarning
from zephon.ops.basic import fetch
from zephon.ops.batching import batch
from zephon.ops.shuffle import shuffle
from zephon.runtime.checkpoint.format import seal
from zephon.sources.memory import RangeSource

N = 4  # the job's lanes; 11 chunks of 10: lanes 0..2 hold 3 chunks, lane 3 holds 2


def uneven(**kw: Any) -> zephon.Pipeline:
    """Lanes that end at different global steps (``uneven_end="allow"``), or that every rank
    ends together (``"carry"``)."""
    kw.setdefault("uneven_end", "allow")
    kw.setdefault("lanes", N)
    return zephon.Pipeline(RangeSource(110, chunk_size=10), [fetch(), batch(2)], **kw)


def shuffled(**kw: Any) -> zephon.Pipeline:
    ops = [fetch(), shuffle(3, seed=1), batch(2)]
    return zephon.Pipeline(RangeSource(110, chunk_size=10), ops, epoch_chunks=2, **kw)


def lane_of(item: Any) -> int:
    return item[1][0].chunk_id % N


def by_lane(items: list) -> dict[int, list]:
    out: dict[int, list] = defaultdict(list)
    for x in items:
        out[lane_of(x)].append(x)
    return dict(out)


def rank_streams(world: int, state: dict | None = None, end: str = "allow") -> list[list]:
    return [
        [
            fingerprint_item(x)
            for x in uneven(rank=r, world_size=world, uneven_end=end).iter(state=state)
        ]
        for r in range(world)
    ]


def lockstep(world: int, end: str = "allow") -> list[tuple[list[list], dict]]:
    """Every rank runs global step after global step (``N // world`` items each) until all are
    done; after each step: what each rank delivered so far and the merged job state."""
    per = N // world
    loaders = [iter(uneven(rank=r, world_size=world, uneven_end=end)) for r in range(world)]
    heads: list[list] = [[] for _ in range(world)]
    out = []
    while True:
        states = [json.loads(json.dumps(loader.state_dict())) for loader in loaders]
        out.append(([list(h) for h in heads], zephon.merge_states(states)))
        if all(lane["ended"] for loader in loaders for lane in loader.stats()["lanes"].values()):
            break
        for loader, head in zip(loaders, heads):
            for _ in range(per):
                item = next(loader, None)
                if item is not None:
                    head.append(fingerprint_item(item))
    for loader in loaders:
        loader.close()
    return out


@pytest.mark.parametrize("end", ["allow", "carry"])
def test_lockstep_ranks_merge_at_every_global_step_through_the_end_of_the_pass(end: str) -> None:
    full = rank_streams(2, end=end)
    if end == "allow":
        assert len(full[0]) > len(full[1])  # lane 3 ends first, lane 2 then delivers twice
    else:
        assert len(full[0]) == len(full[1])
    taken = lockstep(2, end)
    assert len(taken) > len(full[1]) // 2  # through the end
    every = sorted(x for stream in full for x in stream)
    for k, (heads, job) in enumerate(taken):
        for world in (1, 2, 4):
            tails = rank_streams(world, job, end)
            if world == 2:  # on the same ranks: each rank continues exactly
                assert [h + t for h, t in zip(heads, tails)] == full, f"step {k}"
            delivered = [x for stream in heads + tails for x in stream]
            assert sorted(delivered) == every, f"step {k}, world_size={world}"
            lanes = by_lane([x for h in heads for x in h])
            for g, rest in by_lane([x for t in tails for x in t]).items():
                assert lanes.get(g, []) + rest == by_lane(every)[g], f"step {k}, lane {g}"


def test_ranks_really_at_different_global_steps_are_still_refused() -> None:
    loaders = [iter(uneven(rank=r, world_size=2)) for r in range(2)]
    for _ in range(2 * 12):
        next(loaders[0])
    for _ in range(2 * 11):  # rank 1's lane 3 has ended: it delivers from lane 2 only
        next(loaders[1])
    with pytest.raises(CheckpointError, match="rank 0 at step 12, rank 1 at step 11"):
        zephon.merge_states([loader.state_dict() for loader in loaders])


def _mid_step_states(world: int, lanes: int, step: int) -> list[dict]:
    per = lanes // world
    states = []
    for r in range(world):
        loader = iter(shuffled(lanes=lanes, rank=r, world_size=world))
        for _ in range(step * per + 1):  # one micro-step into the global step
            next(loader)
        states.append(json.loads(json.dumps(loader.state_dict())))
        loader.close()
    return states


@pytest.mark.parametrize(("world", "step"), [(2, 0), (2, 3), (4, 2)])
def test_ranks_checkpointed_inside_a_global_step_are_refused_at_merge_saying_so(
    world: int, step: int
) -> None:
    states = _mid_step_states(world, 8, step)
    with pytest.raises(CheckpointError, match="inside a global step") as raised:
        zephon.merge_states(states)
    assert not isinstance(raised.value, zephon.CheckpointCorruptError)
    assert f"global step {step}" in str(raised.value)
    # each rank's own state still resumes on its own rank
    for r, state in enumerate(states):
        assert next(iter(shuffled(lanes=8, rank=r, world_size=world).iter(state=state)))


def test_ranks_one_micro_step_apart_are_refused_as_inside_a_global_step() -> None:
    states = _mid_step_states(2, 8, 2)
    loader = iter(shuffled(lanes=8, rank=1, world_size=2))
    for _ in range(2 * 4):
        next(loader)
    with pytest.raises(CheckpointError, match="inside a global step"):
        zephon.merge_states([states[0], loader.state_dict()])


def test_a_job_state_merged_inside_a_global_step_by_an_earlier_zephon_is_not_called_corrupt() -> (
    None
):
    states = _mid_step_states(2, 8, 3)
    body = {k: v for k, v in states[0].items() if k not in ("rank", "world_size", "next_lane")}
    body = {k: v for k, v in body.items() if k not in ("served", "checksum")}
    body["format"] = "zephon-job-state"
    body["lane_states"] = [lane for state in states for lane in state["lane_states"]]
    job = seal(body)  # what merge_states wrote before it counted global steps
    for world in (1, 2, 4, 8):
        for r in range(world):
            try:
                list(shuffled(rank=r, world_size=world).iter(state=job))
            except CheckpointError as exc:
                assert not isinstance(exc, zephon.CheckpointCorruptError), f"world {world}"
                assert "inside a global step" in str(exc)


def test_a_job_relaned_onto_more_lanes_than_chunks_left_merges_at_every_step() -> None:
    loader = iter(uneven(rank=0, world_size=1))
    for _ in range(40):  # lane 3 has ended, lanes 0..2 are in their last chunk
        next(loader)
    state = loader.state_dict()
    loader.close()
    world, per = 4, 2  # 8 new lanes: only 0, 1 and 2 have a run to finish
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RelaneWarning)
        loaders = [
            uneven(lanes=8, rank=r, world_size=world).iter(state=state) for r in range(world)
        ]
    delivered = 0
    while True:
        got = 0
        for loader in loaders:
            for _ in range(per):  # rank 1's lane 2 fills its step alone
                got += next(loader, None) is not None
        delivered += got
        job = zephon.merge_states([loader.state_dict() for loader in loaders])
        for w in (1, 2, 8):
            rest = sum(
                len(list(uneven(lanes=8, rank=r, world_size=w).iter(state=job))) for r in range(w)
            )
            assert delivered + rest == 55 - 40, f"world_size={w}"
        if not got:
            break
    assert delivered == 55 - 40


def test_a_one_rank_job_merged_inside_a_global_step_resumes_there() -> None:
    full = [fingerprint_item(x) for x in shuffled(lanes=8, rank=0, world_size=1)]
    loader = iter(shuffled(lanes=8, rank=0, world_size=1))
    head = [fingerprint_item(next(loader)) for _ in range(13)]
    job = zephon.merge_states([loader.state_dict()])
    resumed = shuffled(lanes=8, rank=0, world_size=1).iter(state=job)
    tail = [fingerprint_item(next(resumed)) for _ in range(3)]
    assert resumed.state_dict()["served"] == 16  # two whole global steps of 8
    assert head + tail + [fingerprint_item(x) for x in resumed] == full


def _states_after_a_lane_ended() -> list[dict]:
    """Two ranks at global step 11: rank 1's lane 3 has ended, so its lane 2 delivered more
    items than lanes 0 and 1 of rank 0."""
    loaders = [iter(uneven(rank=r, world_size=2)) for r in range(2)]
    for loader in loaders:
        for _ in range(2 * 11):
            next(loader)
    states = [json.loads(json.dumps(loader.state_dict())) for loader in loaders]
    for loader in loaders:
        loader.close()
    return states


def test_ranks_skipped_by_the_same_steps_after_a_lane_ended_still_merge() -> None:
    skipped = [zephon.skip_steps(state, 1) for state in _states_after_a_lane_ended()]
    assert [s["history"] for s in skipped] == [[{"event": "skip", "step": 11, "steps": 1}]] * 2
    assert zephon.merge_states(skipped)["skip"] == 1


def test_ranks_that_retire_the_same_samples_after_a_lane_ended_still_merge() -> None:
    states = _states_after_a_lane_ended()
    loaders = [
        uneven(rank=r, world_size=2).iter(state=s, retire=[(0, 0, 105)])
        for r, s in enumerate(states)
    ]
    retired = [loader.state_dict() for loader in loaders]
    for loader in loaders:
        loader.close()
    assert [s["history"] for s in retired] == [[{"event": "retire", "step": 11, "ids": 1}]] * 2
    assert zephon.merge_states(retired)["step"] == 11


def test_a_skip_after_a_relaning_is_kept_at_the_jobs_global_step() -> None:
    loader = iter(uneven(rank=0, world_size=1))
    for _ in range(4 * 5):
        next(loader)
    state = loader.state_dict()
    loader.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RelaneWarning)
        relaned = uneven(lanes=2, rank=0, world_size=1).iter(state=state)
        for _ in range(2 * 3):
            next(relaned)
    later = relaned.state_dict()
    relaned.close()
    assert zephon.skip_steps(later, 1)["history"] == [{"event": "skip", "step": 8, "steps": 1}]


def _many_rank_states(world: int, lanes: int, items: Any) -> list[dict]:
    """The states of ``world`` ranks of a job of ``lanes`` lanes, rank ``r`` after
    ``items(r)`` items."""
    states = []
    for r in range(world):
        pipeline = zephon.Pipeline(
            RangeSource(lanes * 600, chunk_size=10),
            [fetch(), batch(2)],
            lanes=lanes,
            rank=r,
            world_size=world,
        )
        loader = iter(pipeline)
        for _ in range(items(r)):
            next(loader)
        states.append(json.loads(json.dumps(loader.state_dict())))
        loader.close()
    return states


def _merge_error(states: list[dict]) -> str:
    with pytest.raises(CheckpointError) as raised:
        zephon.merge_states(states)
    return str(raised.value)


def test_merge_errors_about_hundreds_of_ranks_name_a_few_and_the_odd_one_out() -> None:
    world = 256
    ahead = _merge_error(_many_rank_states(world, world, lambda r: 2 + (r == 200)))
    assert "rank 200 at step 3" in ahead
    assert "rank 0 at step 2" in ahead and "252 more at step 2" in ahead
    assert len(ahead) < 1000, ahead
    inside = _merge_error(_many_rank_states(world, 2 * world, lambda r: 5))
    assert "inside a global step" in inside and "rank 0 had handed over 1" in inside
    assert len(inside) < 1000, inside
    apart = _merge_error(_many_rank_states(world, world, lambda r: 2 + r))
    assert "rank 7 at step 9" in apart and len(apart) < 1000, apart
    mixed = _many_rank_states(world, world, lambda r: 2)
    mixed[9] = _many_rank_states(2, world, lambda r: 2 * world // 2)[1]
    sizes = _merge_error(mixed)
    assert "rank 1 of 2" in sizes and "rank 1 of 256" in sizes and len(sizes) < 1000, sizes
    twice = _merge_error(mixed[:9] + mixed[10:] + mixed[:9] + mixed[10:])
    assert "more than once" in twice and len(twice) < 1000, twice
