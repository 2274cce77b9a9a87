"""Retiring samples at a resume (``retire=``): they are never delivered afterwards, in flight or
not, every other sample is still delivered exactly once, and later checkpoints, re-lanings and
world-size changes keep them retired."""

from __future__ import annotations

import json
import random
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from pipeline_kit import PackPairs, fingerprint_item

import zephon
from zephon.errors import (
    CheckpointCorruptError,
    CheckpointError,
    PlanError,
    RelaneWarning,
    RetireWarning,
)
from zephon.ops import filter_records, map_transform
from zephon.ops.basic import fetch
from zephon.ops.batching import batch
from zephon.ops.packing import pack_sequences
from zephon.ops.shuffle import shuffle
from zephon.runtime.checkpoint.format import seal
from zephon.runtime.checkpoint.retired import MAX_RETIRED, RetiredIds
from zephon.sources.memory import ListSource, RangeSource

N = 600


def _kept(payload: dict) -> bool:
    return payload["idx"] % 11 != 4


def _tagged(payload: dict) -> dict:
    return {**payload, "tag": payload["idx"] * 2}


def shuffled(**kw: Any) -> zephon.Pipeline:
    ops = [fetch(), shuffle(9, seed=5), batch(3)]
    return zephon.Pipeline(
        RangeSource(N, chunk_size=8), ops, **{"lanes": 3, "epoch_chunks": 2, **kw}
    )


def monotone(**kw: Any) -> zephon.Pipeline:
    ops = [fetch(), map_transform(_tagged), filter_records(_kept), batch(2)]
    return zephon.Pipeline(RangeSource(N, chunk_size=8), ops, **{"lanes": 2, **kw})


def indexable(**kw: Any) -> zephon.Pipeline:
    ops = [fetch(), map_transform(_tagged)]
    return zephon.Pipeline(RangeSource(N, chunk_size=8), ops, **{"lanes": 2, **kw})


PIPELINES: dict[str, Callable[..., zephon.Pipeline]] = {
    "shuffled": shuffled,
    "monotone": monotone,
    "indexable": indexable,
}


def ids(item: Any) -> list[tuple]:
    records = list(item) if isinstance(item, zephon.types.SampleBatch) else [item]
    return [r.meta.cursor.sample_id for r in records]


def delivered(items: Any) -> list[tuple]:
    return [i for item in items for i in ids(item)]


def head(loader: Any, items: int) -> tuple[list[tuple], dict]:
    seen = delivered(next(loader) for _ in range(items))
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    return seen, state


def retired_sample(everything: list[tuple], seen: list[tuple]) -> list[tuple]:
    """100 ids: some delivered already, most not (in flight or later)."""
    rng = random.Random(3)
    return rng.sample(seen, min(10, len(seen))) + rng.sample(
        [i for i in everything if i not in set(seen)], 100 - min(10, len(seen))
    )


@pytest.mark.parametrize("kind", sorted(PIPELINES))
@pytest.mark.parametrize("step", [0, 4, 31])
def test_retired_samples_never_come_and_the_rest_come_once(kind: str, step: int) -> None:
    make = PIPELINES[kind]
    everything = delivered(make())
    before, state = head(iter(make()), step)
    retired = retired_sample(everything, before)
    after = delivered(make().iter(state=state, retire=retired))
    assert not set(after) & set(retired)
    expected = Counter(everything) - Counter(i for i in retired if i not in set(before))
    assert Counter(before) + Counter(after) == expected


@pytest.mark.parametrize("kind", sorted(PIPELINES))
@pytest.mark.parametrize("later", [9, 70])  # in the chunks in flight at the resume, and past them
def test_retired_samples_stay_retired_through_checkpoints_and_relanings(
    kind: str, later: int
) -> None:
    make = PIPELINES[kind]
    everything = delivered(make())
    before, state = head(iter(make()), 5)
    retired = retired_sample(everything, before)
    middle, state2 = head(make().iter(state=state, retire=retired), later)
    assert state2["retired"] and state2["history"][-1]["event"] == "retire"
    # exact resume of the retired run, without naming the ids again
    loader = make().iter(state=state2)
    rest = [fingerprint_item(x) for x in loader]
    assert rest == [fingerprint_item(x) for x in make().iter(state=state2)]
    after = delivered(make().iter(state=state2))
    expected = Counter(everything) - Counter(i for i in retired if i not in set(before))
    assert Counter(before) + Counter(middle) + Counter(after) == expected
    # onto another lane count, and as a job state on two ranks
    with pytest.warns(RelaneWarning):
        relaned = delivered(make(lanes=4).iter(state=state2))
    assert Counter(before) + Counter(middle) + Counter(relaned) == expected
    job = zephon.merge_states([state2])
    world = make().compile().lanes  # one lane per rank
    # every lane to its end: even ends ("carry") leave what the longest lanes hold beyond it
    ranks = [
        i
        for r in range(world)
        for i in delivered(make(rank=r, world_size=world, uneven_end="allow").iter(state=job))
    ]
    assert Counter(before) + Counter(middle) + Counter(ranks) == expected
    with pytest.warns(RelaneWarning):
        ranks = [
            i
            for r in range(2)
            for i in delivered(make(lanes=4, rank=r, world_size=2).iter(state=job))
        ]
    assert Counter(before) + Counter(middle) + Counter(ranks) == expected


def test_a_predicate_is_kept_as_the_ids_it_selects() -> None:
    everything = delivered(monotone())
    before, state = head(iter(monotone()), 3)
    loader = monotone().iter(state=state, retire=lambda sample: sample[2] % 10 == 7)
    after = delivered(loader)
    picked = {i for i in everything if i[2] % 10 == 7}
    assert not set(after) & picked
    assert Counter(before) + Counter(after) == Counter(everything) - Counter(
        i for i in picked if i not in set(before)
    )
    assert loader.state_dict()["history"][-1] == {"event": "retire", "step": 1, "ids": 60}


def test_retiring_from_the_start_and_bad_ids() -> None:
    everything = delivered(shuffled())
    gone = everything[::7]
    assert Counter(delivered(shuffled().iter(retire=gone))) == Counter(everything) - Counter(gone)
    with pytest.raises(PlanError, match="triple"):
        shuffled().iter(retire=[(0, 0)])
    with pytest.raises(PlanError, match="sample ids"):
        shuffled().iter(retire="0,0,1")


def test_an_edited_retired_set_is_refused() -> None:
    _, state = head(iter(shuffled()), 4)
    _, state2 = head(shuffled().iter(state=state, retire=[(0, 0, 5), (0, 0, 9)]), 2)
    body = {k: v for k, v in state2.items() if k != "checksum"}
    bad: Any
    for bad in ("", "x", 5, []):
        with pytest.raises(CheckpointCorruptError, match="retired"):
            shuffled().iter(state=seal({**body, "retired": bad}))


SCALE = 1000  # a token is (document + 1) * SCALE + its position


def _docs(n: int) -> list[dict[str, Any]]:
    return [
        {"idx": i, "tokens": np.arange(1 + (i * 37) % 29, dtype=np.int64) + (i + 1) * SCALE}
        for i in range(n)
    ]


def packed(**kw: Any) -> zephon.Pipeline:
    ops = [fetch(), shuffle(6, seed=5), pack_sequences(24, open_bins=3, pad_id=0), batch(2)]
    source = ListSource(_docs(400), chunk_size=6)
    return zephon.Pipeline(source, ops, **{"lanes": 2, "epoch_chunks": 2, **kw})


def per_document(items: list[Any]) -> Counter:
    if not items:
        return Counter()
    tokens = np.concatenate([np.asarray(item.payload["tokens"]).ravel() for item in items])
    return Counter((tokens[tokens != 0] // SCALE - 1).tolist())


def _expected_tokens(before: Counter, retired: set[int]) -> Counter:
    """Every document's tokens once, but those of a retired document only as far as they were
    delivered before the resume."""
    lengths = {d["idx"]: len(d["tokens"]) for d in _docs(400)}
    return Counter({d: before[d] if d in retired else n for d, n in lengths.items()}) + Counter()


@pytest.mark.parametrize("step", [3, 20])
@pytest.mark.parametrize(
    "resume",
    [{}, {"lanes": 3}, {"lanes": 4, "world_size": 2}, {"world_size": 2}],
    ids=["same", "relaned", "relaned-on-two-ranks", "two-ranks"],
)
def test_rows_in_flight_with_a_retired_fragment_still_deliver_every_other_token_once(
    step: int, resume: dict[str, Any]
) -> None:
    loader = iter(packed())
    before = [next(loader) for _ in range(step)]
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    retired = set(range(0, 400, 4))  # 100 documents, many of them in rows in flight
    ids = [(0, 0, i) for i in sorted(retired)]
    world = resume.get("world_size", 1)
    if world > 1 or "lanes" in resume:
        state = zephon.merge_states([state])
    after: list[Any] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RelaneWarning)
        for rank in range(world):
            kw = {**resume, "rank": rank} if world > 1 else resume
            after += list(packed(**kw).iter(state=state, retire=ids))
    seen_before, seen_after = per_document(before), per_document(after)
    assert not set(seen_after) & retired
    assert seen_before + seen_after == _expected_tokens(seen_before, retired)
    for item in after:  # rows that lost a fragment are still well-formed packed rows
        for tokens, segments, positions in zip(
            *(np.asarray(item.payload[k]) for k in ("tokens", "segment_ids", "positions"))
        ):
            used = segments > 0
            assert (tokens[used] != 0).all() and not tokens[~used].any()
            assert used[: used.sum()].all()  # fragments first, then padding
            runs = np.diff(segments[used])
            assert segments[0] == 1 and set(runs.tolist()) <= {0, 1}
            starts = np.flatnonzero(np.diff(segments[used], prepend=0))
            assert not positions[starts].any()
    # From the start, nothing but the retired documents is missing.
    fresh = per_document(list(packed().iter(retire=ids)))
    assert fresh == _expected_tokens(Counter(), retired)


@pytest.mark.parametrize("workers", ["inline", "process"])
def test_a_packed_run_with_retired_documents_resumes_exactly_and_relanes(workers: str) -> None:
    loader = iter(packed())
    before = [next(loader) for _ in range(5)]
    state = loader.state_dict()
    loader.close()
    retired = [(0, 0, i) for i in range(1, 400, 4)]
    loader = packed(workers=workers).iter(state=state, retire=retired)
    middle = [next(loader) for _ in range(30)]
    later = json.loads(json.dumps(loader.state_dict()))
    rest = [fingerprint_item(x) for x in loader]
    assert rest == [fingerprint_item(x) for x in packed().iter(state=later)]
    with pytest.warns(RelaneWarning):
        relaned = list(packed(lanes=3).iter(state=later))
    total = per_document(before) + per_document(middle) + per_document(relaned)
    lengths = {d["idx"]: len(d["tokens"]) for d in _docs(400)}
    assert all(n <= lengths[d] for d, n in total.items())
    assert not set(per_document(middle) + per_document(relaned)) & {i for _, _, i in retired}


def test_retiring_at_a_relaning_after_skipped_steps() -> None:
    everything = delivered(shuffled())
    before, state = head(iter(shuffled()), 7)
    retired = retired_sample(everything, before)
    skipped = zephon.skip_steps(state, 2)
    with pytest.warns(RelaneWarning):
        loader = shuffled(lanes=2).iter(state=skipped, retire=retired)
    after = delivered(loader)
    kinds = [event["event"] for event in loader.state_dict()["history"]]
    assert kinds == ["skip", "retire"]
    assert not set(after) & set(retired)
    assert max((Counter(before) + Counter(after)).values()) == 1
    # two skipped steps of two lanes, of batches of 3: at most 12 samples besides the retired
    missing = set(everything) - set(before) - set(after) - set(retired)
    assert 0 < len(missing) <= 12


def _pairs(state: dict[str, Any], retire: list[tuple[int, int, int]]) -> list[tuple[int, ...]]:
    ops = [fetch(), PackPairs(), batch(2)]
    pipeline = zephon.Pipeline(RangeSource(40, chunk_size=8), ops, lanes=1, epoch_chunks=2)
    delivered = [r.payload for b in pipeline.iter(state=state, retire=retire) for r in b]
    return [tuple(p["pair"]) if "pair" in p else (p["idx"],) for p in delivered]  # or one left


def _pairs_state() -> dict[str, Any]:
    ops = [fetch(), PackPairs(), batch(2)]
    pipeline = zephon.Pipeline(RangeSource(40, chunk_size=8), ops, lanes=1, epoch_chunks=2)
    loader = iter(pipeline)
    next(loader)  # the pairs (0, 1) and (2, 3); the epoch of samples 0..15 is in flight
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    return state


def test_an_operator_that_cannot_leave_samples_out_keeps_the_others_by_position() -> None:
    # the lane restarts its epoch with what it consumed taken out: 10 never reaches PackPairs
    with warnings.catch_warnings():
        warnings.simplefilter("error", RetireWarning)
        pairs = _pairs(_pairs_state(), [(0, 0, 10)])
    samples = sorted(i for pair in pairs for i in pair)
    assert samples == [i for i in range(4, 40) if i != 10]


def test_without_what_was_consumed_a_row_of_such_an_operator_goes_whole_and_says_so() -> None:
    state = _pairs_state()
    body = {k: v for k, v in state.items() if k != "checksum"}
    lanes = [{**lane, "progress": None} for lane in body["lane_states"]]
    old = seal({**body, "lane_states": lanes})  # as a state that did not keep it
    with pytest.warns(RetireWarning, match=r"leave_out"):
        pairs = _pairs(old, [(0, 0, 10)])
    assert (10, 11) not in pairs and len(pairs) == 17  # 11 went with the retired 10


def test_ranks_resumed_with_different_retirements_do_not_merge_and_the_error_says_so() -> None:
    states = [head(iter(shuffled(rank=r, world_size=3)), 2)[1] for r in range(3)]
    retired = [(0, 0, 100), (0, 0, 200)]
    later = [
        head(shuffled(rank=r, world_size=3).iter(state=s, retire=retired if r else None), 2)[1]
        for r, s in enumerate(states)
    ]
    with pytest.raises(CheckpointError, match=r"retired samples.*every rank the same .*retire="):
        zephon.merge_states(later)


def test_a_state_that_retired_a_whole_shard_resumes_and_keeps_it_retired() -> None:
    def make() -> zephon.Pipeline:
        return zephon.Pipeline(RangeSource(30_000, chunk_size=1000), [fetch(), batch(50)], lanes=2)

    def ids(items: list[Any]) -> list[int]:
        return [int(i) for item in items for i in item.payload["idx"]]

    gone = set(range(2_000, 26_000))  # contiguous ids: they pack very tightly
    loader = make().iter(retire=lambda sample: sample[2] in gone)
    before = ids([next(loader) for _ in range(10)])
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    after = ids(list(make().iter(state=state)))
    assert Counter(before + after) == Counter(i for i in range(30_000) if i not in gone)
    job = zephon.merge_states([state])
    assert len(list(make().iter(state=job))) == len(after) // 50


def test_the_most_ids_a_state_keeps_are_read_back() -> None:
    rng = np.random.default_rng(0)
    shards = np.sort(rng.integers(0, 100, MAX_RETIRED))
    rows = np.stack([np.zeros(MAX_RETIRED, np.int64), shards, np.arange(MAX_RETIRED)], axis=1)
    ids = RetiredIds(rows)
    assert np.array_equal(RetiredIds.decode(ids.encode()).rows, ids.rows)


def test_merging_many_ranks_reads_the_retired_ids_they_share_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    states = []
    for r in range(8):
        loader = shuffled(lanes=8, rank=r, world_size=8).iter(retire=[(0, 0, 5), (0, 0, 9)])
        next(loader)
        states.append(json.loads(json.dumps(loader.state_dict())))
        loader.close()
    for state in states:
        zephon.save_rank_state(str(tmp_path), state)
    decode = RetiredIds.decode
    decoded: list[str] = []

    def counted(value: Any, where: str = "retired") -> RetiredIds:
        decoded.append(where)
        return decode(value, where)

    monkeypatch.setattr(RetiredIds, "decode", counted)
    job = zephon.merge_states(states)
    assert len(decoded) == 1  # not once or twice per rank: a job may have a thousand
    assert zephon.load_job_state(str(tmp_path)) == job
    assert len(decoded) <= 1 + 2
    rest = delivered(shuffled(lanes=8).iter(state=job))
    assert not {(0, 0, 5), (0, 0, 9)} & set(rest) and len(set(rest)) == len(rest) > N // 2
