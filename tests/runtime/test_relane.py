"""Re-laning: a state taken with N lanes continues on N' lanes with every sample delivered exactly
once. Token values encode (sample, position), so the multiset of tokens delivered before the
checkpoint plus after it must be every token of the pass, once; a filter must drop exactly what it
drops in the uninterrupted run."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from pipeline_kit import fingerprint_item

import zephon
from zephon.errors import CheckpointCorruptError, CheckpointMismatchError, RelaneWarning
from zephon.ops import (
    Operator,
    OpTraits,
    ensure_mixture,
    filter_records,
    map_transform,
    spawn_child,
)
from zephon.ops.basic import fetch
from zephon.ops.batching import batch
from zephon.ops.packing import pack_flat, pack_sequences
from zephon.ops.shuffle import shuffle
from zephon.runtime.checkpoint.format import seal
from zephon.runtime.checkpoint.layout import Leftover
from zephon.sources.memory import ListSource, RangeSource
from zephon.sources.mixture import MixtureSource
from zephon.types import SampleRecord

PAD = -1
SCALE = 1000  # token = sample * SCALE + position


def _docs(n: int) -> list[dict[str, Any]]:
    return [
        {"idx": i, "tokens": np.arange(1 + (i * 37) % 29, dtype=np.int64) + i * SCALE}
        for i in range(n)
    ]


class SplitTokens(Operator):
    """1 -> N: cuts ``tokens`` into pieces of at most ``size`` (children of the record)."""

    traits = OpTraits(preserves_cursor_order=True)

    def __init__(self, size: int):
        self.size = size

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        out = []
        for rec in records:
            tokens = rec.payload["tokens"]
            parts = max(1, -(-len(tokens) // self.size))
            for i in range(parts):
                meta = spawn_child(rec.meta, i, is_last_child=i == parts - 1)
                piece = tokens[i * self.size : (i + 1) * self.size]
                out.append(SampleRecord(meta, {**rec.payload, "tokens": piece}))
        return out


def packed(**kw: Any) -> zephon.Pipeline:
    ops = [
        fetch(),
        SplitTokens(12),
        shuffle(6, seed=5),
        pack_sequences(24, open_bins=3, pad_id=PAD),
    ]
    return zephon.Pipeline(
        ListSource(_docs(400), chunk_size=6), [*ops, batch(2)], epoch_chunks=2, **kw
    )


def flat(**kw: Any) -> zephon.Pipeline:
    ops = [fetch(), shuffle(4, seed=2), pack_flat(16, pad_id=PAD), batch(3)]
    return zephon.Pipeline(ListSource(_docs(300), chunk_size=5), ops, epoch_chunks=3, **kw)


def _kept(payload: dict) -> bool:
    return payload["idx"] % 7 != 3


def _as_tokens(payload: dict) -> dict:
    return {"idx": payload["idx"], "tokens": np.array([payload["idx"] * SCALE])}


def filtered(**kw: Any) -> zephon.Pipeline:
    ops = [fetch(), map_transform(_as_tokens), filter_records(_kept), batch(4)]
    return zephon.Pipeline(RangeSource(500, chunk_size=7), ops, **kw)


PIPELINES: dict[str, Callable[..., zephon.Pipeline]] = {
    "packed": packed,
    "flat": flat,
    "filtered": filtered,
}


def tokens(item: Any) -> list[int]:
    values = np.asarray(item.payload["tokens"]).ravel()
    return values[values != PAD].tolist()


def every_token(make: Callable[..., zephon.Pipeline], lanes: int) -> Counter:
    return Counter(t for item in make(lanes=lanes) for t in tokens(item))


def relaned(state: dict, make: Callable[..., zephon.Pipeline], lanes: int, **kw: Any) -> Any:
    with pytest.warns(RelaneWarning, match=r"onto \d+ lanes") as shown:
        loader = make(lanes=lanes, **kw).iter(state=state)
    assert len(shown) == 1
    return loader


def head(make: Callable[..., zephon.Pipeline], lanes: int, step: int) -> tuple[list, dict]:
    """The tokens of the first ``step`` items on ``lanes`` lanes and the state after them."""
    loader = iter(make(lanes=lanes))
    seen = [t for _ in range(step) for t in tokens(next(loader))]
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    return seen, state


def steps_for(make: Callable[..., zephon.Pipeline], lanes: int) -> list[int]:
    total = sum(1 for _ in make(lanes=lanes))
    return sorted({0, 1, 5, total // 3, total - 2, total})


MOVES = [(8, 3), (8, 16), (4, 1), (1, 5)]


@pytest.mark.parametrize("kind", sorted(PIPELINES))
@pytest.mark.parametrize(("old", "new"), MOVES)
def test_every_token_is_delivered_exactly_once_across_a_relaning(
    kind: str, old: int, new: int
) -> None:
    make = PIPELINES[kind]
    reference = every_token(make, old)
    assert reference == every_token(make, new)  # the pass's tokens do not depend on the lanes
    for step in steps_for(make, old):
        before, state = head(make, old, step)
        after = [t for item in relaned(state, make, new) for t in tokens(item)]
        assert Counter(before) + Counter(after) == reference, f"step {step}"


@pytest.mark.parametrize("kind", sorted(PIPELINES))
def test_process_and_thread_lanes_relane_like_inline_ones(kind: str) -> None:
    make = PIPELINES[kind]
    before, state = head(make, 8, 7)
    inline = [fingerprint_item(x) for x in relaned(state, make, 3)]
    process = [fingerprint_item(x) for x in relaned(state, make, 3, workers="process")]
    assert process == inline
    thread = [fingerprint_item(x) for x in relaned(state, make, 3, workers="thread")]
    assert thread == inline
    assert Counter(before) + Counter(t for x in relaned(state, make, 3) for t in tokens(x)) == (
        every_token(make, 8)
    )


def test_the_filter_drops_what_it_drops_without_a_relaning() -> None:
    kept = {i * SCALE for i in range(500) if _kept({"idx": i})}
    before, state = head(filtered, 8, 9)
    after = [t for item in relaned(state, filtered, 3) for t in tokens(item)]
    assert sorted(before + after) == sorted(kept)


@pytest.mark.parametrize("kind", sorted(PIPELINES))
def test_a_relaned_run_resumes_exactly_and_relanes_again(kind: str) -> None:
    make = PIPELINES[kind]
    reference = every_token(make, 8)
    before, state8 = head(make, 8, 6)
    loader = relaned(state8, make, 3)
    middle = [tokens(next(loader)) for _ in range(5)]
    state3 = json.loads(json.dumps(loader.state_dict()))
    rest3 = [tokens(x) for x in loader]
    # exact resume of the re-laned run, on the same lanes
    assert [tokens(x) for x in make(lanes=3).iter(state=state3)] == rest3
    # and a second re-laning, 3 -> 6
    after = [t for x in relaned(state3, make, 6) for t in tokens(x)]
    flat_middle = [t for part in middle for t in part]
    assert Counter(before) + Counter(flat_middle) + Counter(after) == reference


def _global_steps(streams: list[list], per: int) -> list[Counter]:
    steps = min(len(s) for s in streams) // per
    return [
        Counter(item for s in streams for item in s[k * per : (k + 1) * per]) for k in range(steps)
    ]


def test_eight_three_six_then_elastic_on_two_and_three_ranks() -> None:
    reference = every_token(packed, 8)
    before, state8 = head(packed, 8, 4)
    loader = relaned(state8, packed, 3)
    middle = [t for _ in range(4) for t in tokens(next(loader))]
    state3 = loader.state_dict()
    loader.close()
    # the 6-lane job, run on one rank for a while, checkpointed
    loader = relaned(state3, packed, 6)
    third = [t for _ in range(6) for t in tokens(next(loader))]
    state6 = json.loads(json.dumps(loader.state_dict()))
    rest = [fingerprint_item(x) for x in loader]
    rest_tokens = [t for x in packed(lanes=6).iter(state=state6) for t in tokens(x)]
    assert Counter(before) + Counter(middle) + Counter(third) + Counter(rest_tokens) == reference
    # elastic resume of the re-laned 6-lane job: the same global steps on 1, 2, 3 and 6 ranks,
    # until its first lane ends (one rank per lane shows when)
    job = zephon.merge_states([state6])
    by_world = {
        world: [
            [fingerprint_item(x) for x in packed(rank=r, world_size=world).iter(state=job)]
            for r in range(world)
        ]
        for world in (1, 2, 3, 6)
    }
    assert by_world[1][0] == rest
    until = min(len(s) for s in by_world[6])
    assert until > 3
    reference_steps = _global_steps(by_world[6], 1)[:until]
    for world in (1, 2, 3):
        steps = _global_steps(by_world[world], 6 // world)[:until]
        assert steps == reference_steps, f"world_size={world}"


def test_a_relaned_job_state_merges_and_resumes_on_any_world_size() -> None:
    reference = every_token(packed, 8)
    before, state8 = head(packed, 8, 3)
    ranks, middle = [], []
    for r in range(2):
        loader = relaned(state8, packed, 4, rank=r, world_size=2)
        # one global step: an item of each of the rank's two lanes
        middle += [t for _ in range(2) for t in tokens(next(loader))]
        ranks.append(loader.state_dict())
        loader.close()
    job = zephon.merge_states(ranks)
    assert job["layout"] == ranks[0]["layout"] and len(job["layout"]) == 2
    one = [t for x in packed().iter(state=job) for t in tokens(x)]
    assert Counter(before) + Counter(middle) + Counter(one) == reference
    four = [
        t for r in range(4) for x in packed(rank=r, world_size=4).iter(state=job) for t in tokens(x)
    ]
    assert Counter(four) == Counter(one)


def test_state_size_after_two_relanings_and_the_replay_stay_small() -> None:
    _, state8 = head(packed, 8, 10)
    loader = relaned(state8, packed, 3)
    for _ in range(3):
        next(loader)
    state3 = loader.state_dict()
    loader.close()
    loader = relaned(state3, packed, 6)
    for _ in range(3):
        next(loader)
    state6 = loader.state_dict()
    loader.close()
    size = len(json.dumps(state8))
    assert len(json.dumps(state6)) - size < 4096
    # later checkpoints replay no more than the in-flight epochs, whatever the step
    replays = []
    for step in (2, 40, 120):
        _, state = head(packed, 8, step)
        loader = relaned(state, packed, 3)
        next(loader)
        replays.append(loader.stats()["replayed"])
        loader.close()
    bound = 8 * 2 * 6 * 3  # lanes x epoch_chunks x chunk_size x pieces per document
    assert max(replays) <= bound, replays


def test_relane_false_keeps_the_lane_count_binding() -> None:
    _, state = head(packed, 8, 3)
    with pytest.raises(CheckpointMismatchError, match="relane=True"):
        packed(lanes=4, relane=False).iter(state=state)


def test_a_rank_state_of_a_multi_rank_job_must_be_merged_first() -> None:
    loader = iter(packed(lanes=8, rank=1, world_size=2))
    next(loader)
    state = loader.state_dict()
    loader.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CheckpointMismatchError, match="merge_states"):
            packed(lanes=3).iter(state=state)


def _component(dataset: int, n: int) -> ListSource:
    docs = [{**doc, "tokens": doc["tokens"] + dataset * 10**6} for doc in _docs(n)]
    return ListSource(docs, dataset_id=dataset, chunk_size=6)


def mixed(**kw: Any) -> zephon.Pipeline:
    source = MixtureSource(
        {"a": _component(1, 200), "b": _component(2, 200)}, {"a": 0.6, "b": 0.4}, chunk_size=6
    )
    ops = [
        fetch(),
        SplitTokens(12),
        shuffle(5, seed=1),
        pack_sequences(24, open_bins=3, pad_id=PAD),
        ensure_mixture({"a": 0.6, "b": 0.4}, buffer_size=6),
        batch(2),
    ]
    return zephon.Pipeline(source, ops, epoch_chunks=2, **kw)


@pytest.mark.parametrize(("old", "new"), [(8, 3), (2, 5)])
def test_running_totals_may_drop_other_records_but_never_deliver_one_twice(
    old: int, new: int
) -> None:
    everything = {t for doc in _docs(200) for t in doc["tokens"].tolist()}
    everything = {t + d * 10**6 for t in everything for d in (1, 2)}
    for step in (0, 4, 13):
        before, state = head(mixed, old, step)
        after = [t for item in relaned(state, mixed, new) for t in tokens(item)]
        delivered = Counter(before) + Counter(after)
        assert max(delivered.values()) == 1, f"step {step}: a token was delivered twice"
        assert set(delivered) <= everything


def test_an_unbounded_source_relanes_without_repeating_or_skipping_a_sample() -> None:
    def endless(**kw: Any) -> zephon.Pipeline:
        source = RangeSource(60, chunk_size=4, passes=None)
        return zephon.Pipeline(source, [fetch(), shuffle(3, seed=1)], epoch_chunks=2, **kw)

    loader = iter(endless(lanes=4))
    before = [next(loader).meta.cursor for _ in range(9)]
    state = loader.state_dict()
    loader.close()
    loader = relaned(state, endless, 3)
    after = [next(loader).meta.cursor for _ in range(300)]
    loader.close()
    seen = Counter((c.chunk_id, c.chunk_offset) for c in before + after)
    assert max(seen.values()) == 1
    # the 309 records cover every sample of the chunks well behind the frontier
    behind = max(chunk for chunk, _ in seen) // 2
    assert all((c, o) in seen for c in range(behind) for o in range(4))


def _resealed(state: dict, edit: Callable[[dict], None]) -> dict:
    body = json.loads(json.dumps({k: v for k, v in state.items() if k != "checksum"}))
    edit(body)
    return seal(body)


@pytest.mark.parametrize(
    "edit",
    [
        lambda b: b["layout"].pop(0),
        lambda b: b["layout"][0].pop("ends"),
        lambda b: b["layout"][0]["ends"].append(0),
        lambda b: b["layout"][0]["ends"].__setitem__(0, 10**6),
        lambda b: b["layout"][-1].__setitem__("lanes", 4),
        lambda b: b["lane_states"][0].__setitem__("run", [1, 0, 3]),  # not an earlier generation
        lambda b: b["lane_states"][0].__setitem__("run", [0, 9, 3]),  # no such lane
        lambda b: b["lane_states"][0]["run"].__setitem__(2, 0),  # ends before it starts
        lambda b: b["lane_states"][0].__setitem__("pending", [{"run": [0, 1, 2]}]),
        lambda b: b["lane_states"][0]["pending"].append(
            b["lane_states"][0]["pending"][0] | {"x": 1}
        ),
        lambda b: b["lane_states"][2].__setitem__("pending", b["lane_states"][0]["pending"]),
        lambda b: b["lane_states"][1]["pending"].append(b["lane_states"][1]["pending"][0]),
        lambda b: b["lane_states"][0]["pending"][0]["run"].__setitem__(2, 1),  # not what it kept
        lambda b: b["layout"][0]["ends"].__setitem__(3, b["layout"][0]["ends"][3] + 1),
    ],
)
def test_edited_lane_histories_and_runs_are_refused(edit: Callable[[dict], None]) -> None:
    _, state8 = head(packed, 8, 5)
    loader = relaned(state8, packed, 3)
    next(loader)
    state = loader.state_dict()
    loader.close()
    assert state["lane_states"][0]["run"] is not None and state["lane_states"][0]["pending"]
    assert state["lane_states"][2]["run"] is not None
    with pytest.raises(CheckpointCorruptError):
        packed(lanes=3).iter(state=_resealed(state, edit))


@pytest.mark.parametrize("which", [0, -1])
@pytest.mark.parametrize("taken", [0, 1], ids=["at-the-relaning", "one-item-later"])
def test_a_relaned_state_that_drops_an_inherited_run_is_refused_naming_it(
    which: int, taken: int
) -> None:
    _, state8 = head(packed, 8, 5)
    loader = relaned(state8, packed, 3)
    for _ in range(taken):
        next(loader)
    state = loader.state_dict()
    loader.close()
    dropped = state["lane_states"][0]["pending"][which]["run"]

    def drop(body: dict) -> None:
        body["lane_states"][0]["pending"].pop(which)

    with pytest.raises(CheckpointCorruptError, match=rf"lane {dropped[1]} of generation 0"):
        packed(lanes=3).iter(state=_resealed(state, drop))


def test_a_relaned_state_that_gives_a_run_to_two_lanes_is_refused() -> None:
    _, state8 = head(packed, 8, 5)
    loader = relaned(state8, packed, 3)
    state = loader.state_dict()
    loader.close()

    def duplicate(body: dict) -> None:
        body["lane_states"][1]["pending"].append(body["lane_states"][0]["pending"][0])

    with pytest.raises(CheckpointCorruptError, match="lane 3 of generation 0"):
        packed(lanes=3).iter(state=_resealed(state, duplicate))


def test_a_relaned_state_written_before_runs_were_stored_in_the_layout_still_loads() -> None:
    _, state8 = head(packed, 8, 5)
    loader = relaned(state8, packed, 3)
    state = loader.state_dict()
    rest = [tokens(item) for item in loader]
    assert "runs" in state["layout"][-1]
    older = _resealed(state, lambda body: body["layout"][-1].pop("runs"))
    assert [tokens(item) for item in packed(lanes=3).iter(state=older)] == rest


def test_the_warning_says_which_samples_a_stateful_operator_drops_can_differ() -> None:
    _, state = head(mixed, 8, 4)
    with pytest.warns(RelaneWarning) as shown:
        mixed(lanes=3).iter(state=state).close()
    (text,) = [str(w.message) for w in shown]
    assert "every sample of the pass" not in text and "every sample is still" not in text
    assert "every sample the pipeline delivers is delivered exactly once" in text
    assert "which samples they drop can differ" in text


@pytest.mark.parametrize("workers", ["inline", "thread"])
def test_a_relaned_rank_builds_its_lane_history_once_not_once_per_lane(
    workers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def make(lanes: int) -> zephon.Pipeline:
        ops = [fetch(), shuffle(5, seed=1), batch(2)]
        return zephon.Pipeline(
            RangeSource(4000, chunk_size=10), ops, lanes=lanes, epoch_chunks=2, workers=workers
        )

    built: list[int] = []
    init = Leftover.__init__

    def counted(self: Leftover, lanes: int, ends: list[int], size: int | None) -> None:
        built.append(lanes)
        init(self, lanes, ends, size)

    monkeypatch.setattr(Leftover, "__init__", counted)
    counts = {}
    for lanes in (12, 48):
        loader = make(8).iter()
        for _ in range(8 * 3):
            next(loader)
        state = loader.state_dict()
        loader.close()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RelaneWarning)
            relaned = make(lanes).iter(state=state)
        next(relaned)
        later = relaned.state_dict()
        relaned.close()
        built.clear()
        resumed = make(lanes).iter(state=later)
        next(resumed)
        resumed.close()
        counts[lanes] = len(built)
    assert counts[48] == counts[12], counts  # one lane history for the rank, whatever its lanes
