"""Planning: validation names the operator, the eviction path follows traits, ranks resolve."""

from __future__ import annotations

import pytest
from pipeline_kit import DropMultiples, RunningTotal, SplitInChildren, WindowShuffle

import zephon
from zephon.errors import PlanError
from zephon.ops.base import Operator, OpTraits
from zephon.ops.basic import fetch, filter_records, map_transform
from zephon.ops.batching import batch
from zephon.planner import resolve_rank
from zephon.sources.memory import RangeSource


def ident(payload):
    return payload


def plan(ops, **kw):
    return zephon.Pipeline(RangeSource(10), ops, **kw).compile()


class NoTraits(Operator):
    def process_many(self, records):
        return records


def test_traits_require_an_explicit_order_claim():
    with pytest.raises(TypeError):
        OpTraits()  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("ops", "message"),
    [
        ([], "at least the fetch"),
        ([map_transform(ident)], "first operator must be fetch"),
        ([fetch(), fetch()], r"operator #1 \(fetch\).*first"),
        ([fetch(), batch(2), map_transform(ident)], r"operator #1 \(batch\).*last"),
        ([fetch(), NoTraits()], r"operator #1 \(NoTraits\) declares no OpTraits"),
        ([fetch(), object()], "not a zephon.ops.Operator"),
    ],
)
def test_invalid_pipelines_raise_plan_error_naming_the_operator(ops, message):
    with pytest.raises(PlanError, match=message):
        plan(ops)


class ParallelTotal(RunningTotal):
    traits = OpTraits(preserves_cursor_order=True, stateful=True, workers=4)


def test_stateful_operator_with_several_workers_is_refused():
    with pytest.raises(PlanError, match=r"ParallelTotal.*stateful.*4 workers.*workers=1"):
        plan([fetch(), ParallelTotal()])


@pytest.mark.parametrize("value", [True, False])
def test_deterministic_is_deprecated_and_changes_nothing(value):
    def stream(**kw):
        ops = [fetch(), WindowShuffle(4), map_transform(ident, workers=3), batch(4)]
        pipeline = zephon.Pipeline(RangeSource(100, chunk_size=8), ops, **kw)
        return pipeline, [[r.cursor for r in b.records] for b in pipeline]

    default, expected = stream()
    with pytest.warns(DeprecationWarning, match=r"deterministic=\.\.\.\) is deprecated.*no effect"):
        deprecated, got = stream(deterministic=value)
    assert got == expected
    assert deprecated.fingerprint == default.fingerprint


def test_deprecated_deterministic_false_still_plans_a_stateful_operator_with_workers_and_says_so():
    with pytest.warns(DeprecationWarning) as caught:
        p = plan([fetch(), ParallelTotal()], deterministic=False)
    assert p.eviction_path == "epoch"
    assert any("ParallelTotal" in str(w.message) and "ignored" in str(w.message) for w in caught)


@pytest.mark.parametrize(
    ("middle", "path", "indexable"),
    [
        ([map_transform(ident)], "monotone", True),
        ([SplitInChildren(), filter_records(bool)], "monotone", False),
        ([DropMultiples()], "monotone", False),
        ([WindowShuffle()], "epoch", False),
        ([RunningTotal()], "epoch", False),
    ],
)
def test_eviction_path_follows_the_traits(middle, path, indexable):
    p = plan([fetch(), *middle, batch(4)])
    assert (p.eviction_path, p.indexable) == (path, indexable)
    assert path in p.describe()


def test_describe_says_why_the_epoch_path_was_chosen():
    text = plan([fetch(), WindowShuffle(), RunningTotal()]).describe()
    assert "reorders: WindowShuffle" in text and "keeps state: WindowShuffle, RunningTotal" in text


def test_fingerprint_is_stable_and_sensitive():
    def make(n=10, lanes=1, window=5):
        return zephon.Pipeline(RangeSource(n), [fetch(), WindowShuffle(window)], lanes=lanes)

    assert make().fingerprint == make().fingerprint
    assert (
        len(
            {
                make().fingerprint,
                make(n=11).fingerprint,
                make(lanes=2).fingerprint,
                make(window=6).fingerprint,
            }
        )
        == 4
    )


@pytest.mark.parametrize("bad", [{"lanes": 0}, {"epoch_chunks": 0}, {"workers": "gpu"}])
def test_bad_pipeline_parameters_raise_plan_error(bad):
    with pytest.raises(PlanError):
        plan([fetch()], **bad)


def test_rank_comes_from_arguments_then_environment(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resolve_rank(None, None) == (0, 1)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert resolve_rank(None, None) == (2, 3)
    assert resolve_rank(1, 3) == (1, 3)
    with pytest.raises(PlanError):
        resolve_rank(3, 3)


def test_three_ranks_cover_a_shuffled_dataset_exactly_once():
    seen: list[int] = []
    for rank in range(3):
        p = zephon.Pipeline(
            RangeSource(1000, chunk_size=16, shuffle=True, seed=5),
            [fetch(), WindowShuffle(7), batch(4)],
            lanes=6,  # the job's lanes: two per rank
            rank=rank,
            world_size=3,
        )
        seen.extend(r.payload["idx"] for b in p for r in b)
    assert sorted(seen) == list(range(1000))


def test_rank_from_the_environment_gives_the_explicit_ranks_stream(monkeypatch):
    def stream(**kw):
        p = zephon.Pipeline(RangeSource(300, chunk_size=8), [fetch(), WindowShuffle(3)], **kw)
        return [r.cursor for r in p]

    explicit = stream(rank=1, world_size=2)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert stream() == explicit
