"""The checkpoint schema (``zephon/runtime/checkpoint/schema.py``): the fields a state has, which
versions are read and how an older one is upgraded, and the checks of single fields."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pipeline_kit import run

import zephon
from zephon.errors import CheckpointCorruptError, CheckpointMismatchError
from zephon.ops import batch, fetch, shuffle
from zephon.runtime.checkpoint.format import seal, unseal
from zephon.runtime.checkpoint.schema import (
    JOB_FIELDS,
    NEWER_STATE_KEYS,
    READ_VERSIONS,
    STATE_FIELDS,
    STATE_VERSION,
    check_bool,
    check_int,
    check_lane_list,
    check_next_lane,
    check_rank,
    check_version,
    upgrade,
)
from zephon.sources.memory import RangeSource


def pipeline(**kw: Any) -> zephon.Pipeline:
    ops = [fetch(), shuffle(8, seed=1), batch(3)]
    return zephon.Pipeline(RangeSource(60, chunk_size=6), ops, lanes=2, epoch_chunks=2, **kw)


def state_after(steps: int, **kw: Any) -> dict[str, Any]:
    loader = iter(pipeline(**kw))
    run(loader, steps)
    return json.loads(json.dumps(loader.state_dict()))


def test_a_state_has_exactly_the_fields_the_schema_lists():
    assert set(state_after(3)) == set(STATE_FIELDS) | {"checksum"}


def test_a_job_state_has_exactly_the_job_fields():
    job = zephon.merge_states([state_after(4)])
    assert set(job) == set(JOB_FIELDS) | {"checksum"}


@pytest.mark.parametrize("field", sorted(STATE_FIELDS))
def test_a_state_without_one_of_its_fields_is_refused_unless_it_was_written_later(field):
    body = {k: v for k, v in unseal(state_after(3)).items() if k != field}
    state = seal(body)
    if field in NEWER_STATE_KEYS:  # written before it existed: read the way it was written
        assert run(pipeline().iter(state=state)) == run(pipeline().iter(state=state_after(3)))
        return
    with pytest.raises(CheckpointCorruptError):
        pipeline().iter(state=state)


def test_the_versions_read_are_the_current_one_and_the_two_before():
    assert READ_VERSIONS == (STATE_VERSION - 2, STATE_VERSION - 1, STATE_VERSION)
    for version in (1, STATE_VERSION + 1, "4", None):
        with pytest.raises(CheckpointCorruptError, match=r"reads versions 2 to 4"):
            check_version(
                {"format": "zephon-loader-state", "version": version}, ("zephon-loader-state",)
            )
    with pytest.raises(CheckpointCorruptError, match="not a Zephon loader state"):
        check_version({"format": "zephon-job-state", "version": 4}, ("zephon-loader-state",))


def test_a_version_2_state_is_upgraded_and_resumes_exactly():
    full = run(iter(pipeline()))
    loader = iter(pipeline())
    head = run(loader, 5)
    body = unseal(loader.state_dict())
    old = {
        k: v for k, v in body.items() if k not in ("layout", "history", "skip", "retired", "served")
    }
    old["version"] = 2
    old["lane_states"] = [
        {k: v for k, v in lane.items() if k not in ("held", "run", "pending")}
        for lane in body["lane_states"]
    ]
    upgraded = upgrade(dict(old))
    assert upgraded["version"] == STATE_VERSION
    assert upgraded["layout"] == [{"lanes": 2}]
    assert (upgraded["history"], upgraded["skip"], upgraded["retired"]) == ([], 0, None)
    assert head + run(pipeline().iter(state=seal(old))) == full


@pytest.mark.parametrize("value", [True, False, 1.0, "1", None])
def test_an_integer_field_refuses_anything_but_an_int(value):
    with pytest.raises(CheckpointCorruptError, match=r"field lane_states\[0\].delivered must be"):
        check_int(value, "lane_states[0].delivered")
    assert check_int(7, "lane_states[0].delivered") == 7


def test_an_integer_field_is_held_to_its_range():
    with pytest.raises(CheckpointCorruptError, match=r"next_lane must be in \[0, 1\], got 2"):
        check_int(2, "next_lane", 0, 1)


@pytest.mark.parametrize("value", [0, 1, "true", None])
def test_a_flag_field_refuses_anything_but_true_or_false(value):
    with pytest.raises(CheckpointCorruptError, match=r"field lane_states\[1\].finished"):
        check_bool(value, "lane_states[1].finished")


def test_a_rank_state_resumes_only_on_its_rank_and_world_size():
    body = {"rank": 1, "world_size": 2}
    check_rank(body, 1, 2)
    with pytest.raises(
        CheckpointMismatchError, match=r"state of rank 1 \(world_size=2\).*merge_states"
    ):
        check_rank(body, 0, 2)


def test_the_lane_states_are_a_list_of_one_state_per_lane():
    assert check_lane_list([{}, {}], 2) == [{}, {}]
    wrong: list[Any] = [[{}], {}, None, [{}, {}, {}]]
    for value in wrong:
        with pytest.raises(CheckpointCorruptError, match="lane_states must be a list of 2"):
            check_lane_list(value, 2)


def test_next_lane_must_be_where_the_round_robin_stands():
    lanes = [{"delivered": 3, "finished": False}, {"delivered": 2, "finished": False}]
    assert check_next_lane(1, lanes) == 1
    with pytest.raises(CheckpointCorruptError, match=r"next_lane 0 does not fit .* \[3, 2\]"):
        check_next_lane(0, lanes)
    with pytest.raises(CheckpointCorruptError, match=r"next_lane must be in \[0, 1\]"):
        check_next_lane(2, lanes)
