"""Restoring from what the stateful operators hold: the plan decides when it can, the restore
replays at most a chunk instead of an epoch, the state stays small, and it is exact on every
worker kind. Plans with an operator that cannot describe itself keep the epoch replay."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from pipeline_kit import WindowShuffle, assert_resumes_at, fingerprint_item, run

import zephon
from zephon.compact import pack_ints, unpack_ints
from zephon.errors import OperatorError, ReplayDivergenceError
from zephon.ops import (
    Operator,
    OpTraits,
    batch,
    ensure_mixture,
    fetch,
    map_transform,
    pack_sequences,
    shuffle,
    tokenize,
)
from zephon.runtime.lanes.control import Holdings
from zephon.runtime.lanes.runner import SNAPSHOT_RECORDS, LaneRunner
from zephon.runtime.lanes.snapshots import flat_cursors, unpack_cursors
from zephon.sources import JsonlSource
from zephon.sources.memory import ListSource
from zephon.sources.mixture import MixtureSource
from zephon.types import SampleCursor


def _texts(dataset: int, n: int) -> ListSource:
    items = [{"text": "xy" * (3 + (i * 7919 + dataset) % 40)} for i in range(n)]
    return ListSource(items, dataset_id=dataset, chunk_size=32)


def text_pipeline(*middle: Operator, **kw: Any) -> zephon.Pipeline:
    source = MixtureSource(
        {"a": _texts(0, 600), "b": _texts(1, 600)}, {"a": 0.5, "b": 0.5}, chunk_size=32
    )
    ops = [fetch(), tokenize(max_len=40, split_long_samples=True), *middle, batch(4)]
    kw.setdefault("epoch_chunks", 32)  # epochs longer than the snapshot spacing
    return zephon.Pipeline(source, ops, lanes=2, **kw)


def held_ops() -> list[Operator]:
    return [
        ensure_mixture({"a": 0.5, "b": 0.5}, by="tokens", buffer_size=16),
        shuffle(64, seed=4),
        pack_sequences(128, open_bins=8),
    ]


def test_the_plan_restores_holdings_only_when_every_stateful_operator_can():
    assert text_pipeline(*held_ops()).compile().restores_holdings
    assert (
        "rebuilds what the stateful operators hold"
        in text_pipeline(*held_ops()).compile().describe()
    )
    # a user operator that cannot describe what it holds: epoch replay
    assert not text_pipeline(WindowShuffle(4), pack_sequences(128)).compile().restores_holdings
    # what a packer emits cannot be re-read: an operator holding packed rows needs the replay
    later = ensure_mixture({"a": 0.5, "b": 0.5}, buffer_size=4)
    assert not text_pipeline(pack_sequences(128), later).compile().restores_holdings


@pytest.mark.parametrize("steps", [[0, 1, 7, 30], [55, 80, 100, 109]])
def test_restores_from_holdings_continue_the_uninterrupted_stream(steps):
    pipeline = text_pipeline(*held_ops())
    full = run(iter(pipeline))
    assert len(full) >= max(steps)
    assert_resumes_at(pipeline, steps, full)


def test_the_replay_is_bounded_by_the_snapshot_spacing_whatever_the_step():
    def long_epochs(*ops: Operator) -> zephon.Pipeline:
        source = MixtureSource(
            {"a": _texts(0, 2500), "b": _texts(1, 2500)}, {"a": 0.5, "b": 0.5}, chunk_size=128
        )
        chain = [fetch(), tokenize(max_len=40, split_long_samples=True), *ops, batch(4)]
        return zephon.Pipeline(source, chain, lanes=2, epoch_chunks=8)

    held: list[int] = []
    replayed: list[int] = []
    for step in (60, 150, 250, 350):
        for ops, out in ((held_ops(), held), ([WindowShuffle(64), pack_sequences(128)], replayed)):
            pipeline = long_epochs(*ops)
            loader = iter(pipeline)
            for _ in range(step):
                next(loader)
            state = json.loads(json.dumps(loader.state_dict()))
            loader.close()
            resumed = pipeline.iter(state=state)
            next(resumed)
            out.append(resumed.stats()["replayed"])
            resumed.close()
    # lanes x (samples between snapshots + the piece read after the restore) x pieces a
    # document is split into: no operator is batch-sensitive, so no whole micro-batch is re-read
    bound = 2 * (2 * SNAPSHOT_RECORDS) * 3
    assert max(held) <= bound, held
    assert max(replayed) > 2 * max(held), (held, replayed)


class MicroBatchSize(Operator):
    """Batch-sensitive on purpose: each record learns the size of the micro-batch it came in."""

    name = "micro_batch_size"
    traits = OpTraits(preserves_cursor_order=True, batch_sensitive=True)

    def process_many(self, records: list) -> list:
        return [r.with_payload({**r.payload, "mb": len(records)}) for r in records]


def test_a_batch_sensitive_plan_snapshots_only_at_micro_batch_ends_and_resumes_exactly():
    # Pieces would change what MicroBatchSize sees; its micro-batches stay whole, and so does the
    # stream, on a restore too.
    source = ListSource([{"text": "ab" * (1 + i % 50)} for i in range(3000)], chunk_size=512)
    chain = [fetch(), tokenize(max_len=40), shuffle(64, seed=2), MicroBatchSize(), batch(4)]
    pipeline = zephon.Pipeline(source, chain, lanes=2, epoch_chunks=4)
    assert pipeline.compile().restores_holdings
    full = run(iter(pipeline))
    sizes = {int(size) for b in iter(pipeline) for size in b.payload["mb"]}
    assert max(sizes) == 256, sizes  # what the shuffle emits for a whole micro-batch
    assert_resumes_at(pipeline, [0, 3, 40, 200, len(full) - 2], full)


def snapshots_per_read(*ops: Operator) -> list[int]:
    """How many snapshots each item list of lane 0 carries, reading 3,000 tokens records."""
    tokens = [{"tokens": np.arange(1 + i % 50, dtype=np.int32)} for i in range(3000)]
    chain = [fetch(), *ops, pack_sequences(64, pad_id=0), batch(4)]
    plan = zephon.Pipeline(ListSource(tokens, chunk_size=512), chain, epoch_chunks=4).compile()
    assert plan.restores_holdings
    return [sum(type(item) is Holdings for item in items) for items in LaneRunner(plan, 0).run()]


def test_snapshots_are_close_only_where_a_restore_would_redo_a_transform():
    # With a transform (which keeps no state) a restore redoes its work: snapshots every
    # SNAPSHOT_RECORDS samples. A chain of holders alone only re-reads: one per micro-batch.
    assert max(snapshots_per_read(map_transform(dict))) == 256 // SNAPSHOT_RECORDS
    assert max(snapshots_per_read(shuffle(16, seed=1))) == 1
    pipeline = zephon.Pipeline(
        ListSource([{"tokens": np.arange(1 + i % 50, dtype=np.int32)} for i in range(3000)]),
        [fetch(), shuffle(16, seed=1), pack_sequences(64, pad_id=0), batch(4)],
        lanes=2,
        epoch_chunks=4,
    )
    full = run(iter(pipeline))
    assert_resumes_at(pipeline, [0, 5, 100, len(full) - 2], full)


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_holdings_restore_the_same_on_thread_and_process_lanes(workers):
    inline = text_pipeline(*held_ops())
    loader = iter(inline)
    head = [fingerprint_item(next(loader)) for _ in range(90)]
    state = json.loads(json.dumps(loader.state_dict()))
    rest = run(loader)
    assert any(lane["held"] for lane in state["lane_states"])
    assert head and run(text_pipeline(*held_ops(), workers=workers).iter(state=state)) == rest
    # and a state taken on those lanes resumes inline
    other = iter(text_pipeline(*held_ops(), workers=workers))
    for _ in range(90):
        next(other)
    state = json.loads(json.dumps(other.state_dict()))
    other.close()
    assert run(inline.iter(state=state)) == rest


def test_the_state_stays_small_with_64_open_bins_and_a_1024_record_shuffle():
    texts = [{"text": "lorem ipsum " * (5 + (i * 7919) % 300)} for i in range(20_000)]
    source = ListSource(texts, chunk_size=1024)
    ops = [fetch(), tokenize(), shuffle(1024, seed=1), pack_sequences(2048, open_bins=64), batch(8)]
    loader = iter(zephon.Pipeline(source, ops, lanes=1, epoch_chunks=8))
    sizes = []
    for i in range(1, 400):
        next(loader)
        if i % 50 == 0:
            state = loader.state_dict()
            if state["lane_states"][0]["held"] is not None:
                sizes.append(len(json.dumps(state["lane_states"][0])))
    loader.close()
    assert sizes, "no checkpoint fell after a snapshot"
    assert max(sizes) <= 16 * 1024, sizes


class _Drifts(Operator):
    """Pure on paper, but its output changes between the checkpoint and the restore: what a
    changed upstream (data or code) does to the records the holders must get back."""

    traits = OpTraits(preserves_cursor_order=True)
    extra = 0

    def process_many(self, records):
        grow = "z" * _Drifts.extra
        return [r.with_payload({"text": r.payload["text"] + grow}) for r in records]


def test_held_records_that_cannot_be_rebuilt_as_they_were_refuse_the_restore():
    source = MixtureSource(
        {"a": _texts(0, 600), "b": _texts(1, 600)}, {"a": 0.5, "b": 0.5}, chunk_size=32
    )
    ops = [fetch(), _Drifts(), tokenize(max_len=40, split_long_samples=True), *held_ops(), batch(4)]
    pipeline = zephon.Pipeline(source, ops, lanes=2, epoch_chunks=32)
    assert pipeline.compile().restores_holdings
    loader = iter(pipeline)
    for _ in range(90):
        next(loader)
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    assert all(lane["held"] for lane in state["lane_states"])
    _Drifts.extra = 90  # longer texts: tokenize splits them into other children
    try:
        with pytest.raises(ReplayDivergenceError, match=r"could not be rebuilt|not the ones"):
            run(pipeline.iter(state=state))
    finally:
        _Drifts.extra = 0


def test_the_codecs_round_trip_and_refuse_garbage():
    cursors = [SampleCursor(7, 3, (0, 0, 9), (2, 1)), SampleCursor(0, 0, (1, 0, 0))]
    assert unpack_cursors(pack_ints(flat_cursors(cursors))) == [(7, 3, (2, 1)), (0, 0, ())]
    values = np.arange(50, dtype=np.int64) * 3
    assert unpack_ints(pack_ints(values)).tolist() == values.tolist()
    for bad in ("x", "AAAA", 5, pack_ints([1, 2])[:-4]):
        with pytest.raises(ValueError):
            unpack_ints(bad)
    with pytest.raises(ValueError):
        unpack_ints(pack_ints([-1]))
    with pytest.raises(ValueError):
        unpack_cursors(pack_ints([3, 1, 5, 0]))  # a lineage of 5 that is not there


class _ReadSizes(Operator):
    """Keeps no state and changes nothing: notes how many records each call gets."""

    traits = OpTraits(preserves_cursor_order=True)
    seen: list[int] = []

    def process_many(self, records):
        _ReadSizes.seen.append(len(records))
        return records


def test_after_a_restore_the_chunk_is_read_in_pieces_until_its_end():
    # The first batch after a restore waits for what the lane reads after the snapshot: reads of
    # a piece each (not the rest of a micro-batch, or the next whole one, in the next chunk too)
    # keep that short. The first call after a restore is the rebuild of what the packer held;
    # every read after it holds at most one piece, and the stream goes on as it would have.
    tokens = [{"tokens": np.arange(1 + (i * 7919) % 90, dtype=np.int32)} for i in range(6000)]
    chain = [fetch(), _ReadSizes(), pack_sequences(256, pad_id=0, open_bins=8), batch(4)]
    pipeline = zephon.Pipeline(ListSource(tokens, chunk_size=1024), chain, epoch_chunks=6)
    assert pipeline.compile().restores_holdings
    full = run(iter(pipeline))
    after: list[list[int]] = []
    for step in range(3, len(full) - 1, 7):
        loader = iter(pipeline)
        head = run(loader, step)
        state = json.loads(json.dumps(loader.state_dict()))
        loader.close()
        _ReadSizes.seen = []
        resumed = pipeline.iter(state=state)
        first = fingerprint_item(next(resumed))
        after.append(_ReadSizes.seen[1:])
        assert [*head, first, *run(resumed)] == full, f"resume at step {step}"
    too_large = [sizes for sizes in after if max(sizes, default=0) > SNAPSHOT_RECORDS]
    assert not too_large, too_large


class HoldsFive(Operator):
    """Holds the last five records (emits the oldest); ``broken`` names what goes wrong in
    describing them: ``"raises"`` in ``holdings()``, ``"set"`` a state a checkpoint cannot hold."""

    traits = OpTraits(preserves_cursor_order=True, stateful=True)

    def __init__(self, broken: str = "") -> None:
        self.broken = broken
        self._held: list = []

    def process_many(self, records: list) -> list:
        self._held += records
        out, self._held = self._held[:-5], self._held[-5:]
        return out

    def flush(self) -> list:
        out, self._held = self._held, []
        return out

    def holdings(self) -> tuple[list, dict[str, Any]]:
        if self.broken == "raises":
            raise RuntimeError("cannot say what it holds")
        return list(self._held), {"seen": {1, 2}} if self.broken == "set" else {}

    def restore_holdings(self, records: list, state: dict[str, Any]) -> None:
        self._held = list(records)


@pytest.mark.parametrize("workers", ["inline", "process"])
def test_an_error_in_holdings_names_the_operator(workers):
    with pytest.raises(
        OperatorError,
        match=r"operator 'HoldsFive' failed in holdings\(\): RuntimeError: cannot say",
    ):
        list(text_pipeline(HoldsFive("raises"), workers=workers))


@pytest.mark.parametrize("workers", ["inline", "process"])
def test_holdings_whose_state_is_not_json_name_the_operator_at_the_checkpoint(workers):
    loader = iter(text_pipeline(HoldsFive("set"), workers=workers))
    for _ in range(SNAPSHOT_RECORDS * 2):
        next(loader)
    with pytest.raises(
        OperatorError,
        match=r"operator 'HoldsFive' described what it holds \(holdings\(\)\) with a state that "
        r"is not JSON data.*set",
    ):
        loader.state_dict()
    loader.close()


def test_a_restore_rebuilds_held_records_around_a_sample_skipped_at_fetch(tmp_path):
    # The shuffle holds records from both sides of line 71, which is not JSON and was skipped:
    # rebuilding them must not read it again.
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"i": i}) for i in range(600)]
    lines[70] = "{not json"
    path.write_text("\n".join(lines) + "\n")
    pipeline = zephon.Pipeline(
        JsonlSource(str(path), chunk_size=200),
        [fetch(), map_transform(dict), shuffle(50, seed=1), batch(4)],
        lanes=1,
        on_error="skip",
    )
    assert pipeline.compile().restores_holdings
    full = run(iter(pipeline))
    assert len(full) == 150
    assert_resumes_at(pipeline, [21, 30, 60], full)
