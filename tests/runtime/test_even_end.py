"""Even ends across ranks: with several ranks, every lane hands over as many items as the job's
shortest lane, so every rank delivers the same number of global steps and none is left waiting
in a collective; a pass's remainder is delivered in the next pass, and what is left at the end
of the last pass is dropped and counted."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from pipeline_kit import fingerprint_item

import zephon
from zephon.errors import PlanError
from zephon.ops import filter_records
from zephon.ops.basic import fetch, map_transform
from zephon.ops.batching import batch
from zephon.sources.memory import RangeSource

N = 4


def _double(payload: dict) -> dict:
    return {**payload, "twice": payload["idx"] * 2}


def pipeline(passes: int = 1, **kw: Any) -> zephon.Pipeline:
    """10 chunks of 10 a pass (shuffled): lanes hold 3, 3, 2 and 2 chunks of each single pass."""
    source = RangeSource(100, chunk_size=10, shuffle=True, seed=7, passes=passes)
    return zephon.Pipeline(source, [fetch(), map_transform(_double), batch(3)], lanes=N, **kw)


def streams(world: int, state: dict | None = None, **kw: Any) -> list[list]:
    return [
        [fingerprint_item(x) for x in pipeline(rank=r, world_size=world, **kw).iter(state=state)]
        for r in range(world)
    ]


def samples(items: list) -> Counter:
    return Counter(cursor.sample_id[2] for item in items for cursor in item[1])


def test_four_ranks_over_data_that_does_not_divide_evenly_end_at_the_same_global_step() -> None:
    uneven = streams(4, uneven_end="allow")
    assert len({len(s) for s in uneven}) > 1  # what ranks were left to wait for
    even = streams(4)
    assert len({len(s) for s in even}) == 1
    assert len(even[0]) == min(len(s) for s in uneven)
    # every rank stops exactly where its shortest peer does: nothing twice, the rest counted
    delivered = samples([x for s in even for x in s])
    assert max(delivered.values()) == 1
    dropped = 0
    for r in range(N):
        loader = pipeline(rank=r, world_size=4).iter()
        list(loader)
        dropped += loader.stats()["dropped_at_end"]
    assert dropped == sum(len(s) for s in uneven) - sum(len(s) for s in even) > 0


def test_over_two_passes_a_pass_remainder_is_carried_and_every_sample_comes_once_a_pass() -> None:
    # each pass leaves lanes 0 and 1 a chunk ahead; over both passes every lane holds 5 chunks
    even = streams(4, passes=2)
    assert len({len(s) for s in even}) == 1
    assert samples([x for s in even for x in s]) == Counter({i: 2 for i in range(100)})
    one_pass = streams(4)
    assert len({len(s) for s in one_pass}) == 1
    assert sum(samples([x for s in one_pass for x in s]).values()) < 100  # the rest dropped


def global_steps(per_rank: list[list]) -> list[Counter]:
    per = N // len(per_rank)
    return [
        Counter(x for s in per_rank for x in s[k * per : (k + 1) * per])
        for k in range(len(per_rank[0]) // per)
    ]


def test_the_same_global_steps_and_end_on_every_world_size() -> None:
    reference = global_steps(streams(4))
    for world in (1, 2):
        assert global_steps(streams(world, uneven_end="carry")) == reference, f"world {world}"


@pytest.mark.parametrize("step", [0, 3, 7, 8])
def test_a_job_state_resumes_to_the_same_even_end_on_other_world_sizes(step: int) -> None:
    full = streams(4)
    states = []
    for r in range(4):
        loader = iter(pipeline(rank=r, world_size=4))
        for _ in range(step):
            next(loader, None)
        states.append(json.loads(json.dumps(loader.state_dict())))
        loader.close()
    job = zephon.merge_states(states)
    reference = global_steps(full)[step:]
    for world, kw in ((2, {}), (1, {"uneven_end": "carry"}), (4, {})):
        tails = streams(world, job, **kw)
        assert len({len(t) for t in tails}) == 1, f"world {world}"
        assert global_steps(tails) == reference, f"world {world}"


def test_a_plan_that_filters_cannot_end_evenly_and_says_why() -> None:
    def odd(payload: dict) -> bool:
        return payload["idx"] % 2 == 1

    source = RangeSource(100, chunk_size=10)
    ops = [fetch(), filter_records(odd), batch(3)]
    with pytest.raises(PlanError, match=r"uneven_end='carry'.*filter_records"):
        zephon.Pipeline(source, ops, lanes=N, rank=0, world_size=2, uneven_end="carry").compile()
    plan = zephon.Pipeline(source, ops, lanes=N, rank=0, world_size=2).compile()
    assert plan.uneven_end == "allow"
    assert "may run out of data at different global steps" in plan.describe()
    with pytest.raises(PlanError, match="uneven_end"):
        zephon.Pipeline(source, ops, lanes=N, uneven_end="drop-some").compile()


def test_one_rank_delivers_everything_unless_asked_to_end_evenly() -> None:
    assert pipeline(rank=0, world_size=1).compile().uneven_end == "allow"
    assert pipeline(rank=0, world_size=2).compile().uneven_end == "carry"
    everything = samples([x for s in streams(1) for x in s])
    assert everything == Counter(range(100))


def test_skipping_bad_records_makes_the_counts_unknown_and_says_so() -> None:
    ops = [fetch(), map_transform(_double), batch(3)]
    source = RangeSource(100, chunk_size=10)
    kw: dict[str, Any] = {"lanes": N, "rank": 0, "world_size": 2, "on_error": "skip"}
    assert zephon.Pipeline(source, ops, **kw).compile().uneven_end == "allow"
    with pytest.raises(PlanError, match="on_error='skip'"):
        zephon.Pipeline(source, ops, uneven_end="carry", **kw).compile()


@pytest.mark.parametrize("passes", [1, 2])
def test_ranks_still_end_together_after_samples_are_retired_from_some_lanes(passes: int) -> None:
    ranks = [pipeline(passes, rank=r, world_size=2).iter() for r in range(2)]
    head = [[fingerprint_item(next(loader)) for _ in range(4)] for loader in ranks]
    job = zephon.merge_states([json.loads(json.dumps(loader.state_dict())) for loader in ranks])
    for loader in ranks:
        loader.close()
    # samples 0..19: some lanes lose more of them than others
    retired = [(0, 0, i) for i in range(20)]
    rest = [
        [
            fingerprint_item(x)
            for x in pipeline(passes, rank=r, world_size=2).iter(state=job, retire=retired)
        ]
        for r in range(2)
    ]
    assert len(rest[0]) == len(rest[1])  # no rank waits alone for a peer that ended
    delivered = samples([x for r in range(2) for x in head[r] + rest[r]])
    assert max(delivered.values()) <= passes
    assert not set(samples(rest[0] + rest[1])) & set(range(20))
    # a later resume, the ids kept in the state only, ends the ranks at the same step again
    ranks = [
        pipeline(passes, rank=r, world_size=2).iter(state=job, retire=retired) for r in range(2)
    ]
    for loader in ranks:
        next(loader), next(loader)
    later = zephon.merge_states([loader.state_dict() for loader in ranks])
    for loader in ranks:
        loader.close()
    tail = [list(pipeline(passes, rank=r, world_size=2).iter(state=later)) for r in range(2)]
    assert len(tail[0]) == len(tail[1]) == len(rest[0]) - 2


def test_a_loader_says_whether_it_ends_its_ranks_together_by_itself():
    def make(lanes: int, **kw: Any) -> zephon.Pipeline:
        source = RangeSource(100, chunk_size=10)
        return zephon.Pipeline(source, [fetch(), batch(3)], lanes=lanes, **kw)

    carried = make(4, rank=0, world_size=2).iter()
    assert carried.ends_evenly
    allowed = make(4, rank=0, world_size=2, uneven_end="allow").iter()
    assert not allowed.ends_evenly
    one = make(4, rank=0, world_size=1).iter()
    for _ in range(3):
        next(one)
    with pytest.warns(zephon.RelaneWarning):
        relaned = make(2, rank=0, world_size=2).iter(state=one.state_dict())
    assert not relaned.ends_evenly  # the re-laned lanes run to their ends
    for loader in (carried, allowed, one, relaned):
        loader.close()


def test_a_lane_without_data_is_refused_rather_than_every_rank_delivering_nothing() -> None:
    # 3 chunks on 4 lanes: the fourth lane holds nothing, so every lane would hand over 0 items
    # and the whole (evaluation) set would be dropped with a line in the log.
    source = RangeSource(24, chunk_size=8)
    small = zephon.Pipeline(source, [fetch(), batch(2)], lanes=4, rank=0, world_size=2)
    with pytest.raises(PlanError, match=r"lane 3 of 4 holds no item.*3 chunks.*chunk_size"):
        small.iter()
    allow = zephon.Pipeline(
        source, [fetch(), batch(2)], lanes=4, rank=0, world_size=2, uneven_end="allow"
    )
    assert len(list(allow.iter())) == 8  # rank 0: lanes 0 and 1, a chunk of 4 batches each


def test_dropping_more_than_a_sliver_of_the_data_is_a_warning(caplog) -> None:
    caplog.set_level("INFO", logger="zephon")
    few = streams(4)  # 10 chunks on 4 lanes: 2 of the 10 are dropped
    assert sum(len(s) for s in few) > 0
    dropped = [r for r in caplog.records if "dropped (uneven_end='carry')" in r.getMessage()]
    assert dropped and {r.levelname for r in dropped} == {"WARNING"}
    assert "6 item(s) at the end of the data, 17.6% of the items" in dropped[0].getMessage()
