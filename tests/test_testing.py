"""check_operator catches each mistake an operator author can make, and passes correct operators."""

from __future__ import annotations

import random

import numpy as np
import pytest
from pipeline_kit import DropMultiples, PackPairs, RunningTotal, SplitInChildren, WindowShuffle

import zephon
from zephon.ops import pack_sequences, shuffle, tokenize
from zephon.ops.base import Operator, OpTraits
from zephon.ops.basic import fetch, filter_records, map_transform
from zephon.ops.batching import batch
from zephon.ops.children import pack_meta, spawn_child, tombstones_for_record
from zephon.sources.memory import ListSource, RangeSource
from zephon.testing import check_operator, check_resume
from zephon.types import SampleCursor, SampleMeta, SampleRecord


def records(n=12):
    return [SampleRecord(SampleMeta(SampleCursor(3, i, (0, 0, i))), {"idx": i}) for i in range(n)]


@pytest.mark.parametrize(
    "op",
    [
        SplitInChildren(),
        DropMultiples(3),
        WindowShuffle(4),
        PackPairs(),
        filter_records(lambda p: p["idx"] % 2),
        map_transform(lambda p: {"y": p["idx"]}),
        map_transform(lambda p: Box(p["idx"]), name="boxed"),
    ],
    ids=lambda op: op.name,
)
def test_correct_operators_pass(op):
    check_operator(op, records())


class Forgetful(Operator):
    traits = OpTraits(preserves_cursor_order=True)

    def process_many(self, recs):
        return recs[1:]


class BothClose(Operator):
    traits = OpTraits(preserves_cursor_order=True)

    def process_many(self, recs):
        return [
            SampleRecord(spawn_child(r.meta, i, is_last_child=True), None)
            for r in recs
            for i in range(2)
        ]


class Duplicates(Operator):
    traits = OpTraits(preserves_cursor_order=True)

    def process_many(self, recs):
        return recs + recs[:1]


class Reverses(Operator):
    traits = OpTraits(preserves_cursor_order=True)

    def process_many(self, recs):
        return recs[::-1]


class Moody(Operator):
    traits = OpTraits(preserves_cursor_order=False)
    calls = 0

    def process_many(self, recs):
        Moody.calls += 1
        return recs[::-1] if Moody.calls % 2 else recs


class Jitters(Operator):
    """Augments each payload with noise from an unseeded generator: the same cursors on every
    run, other payloads."""

    traits = OpTraits(preserves_cursor_order=True)

    def process_many(self, recs):
        return [r.with_payload({**r.payload, "noise": random.random()}) for r in recs]


class MergesPairsOfACall(Operator):
    """Merges the records of each call in pairs: its output depends on how records are grouped
    into calls, which it does not declare (batch_sensitive=False)."""

    traits = OpTraits(preserves_cursor_order=True)

    def process_many(self, recs):
        out = []
        for i in range(0, len(recs), 2):
            pair = recs[i : i + 2]
            refs = [ref for r in pair for ref in r.meta.contribution_refs()]
            meta = pack_meta(pair[0].meta.cursor.child(0), refs, lane_id=pair[0].meta.lane_id)
            out.append(SampleRecord(meta, [r.payload for r in pair]))
        return out


class TagsWhatItPasses(Operator):
    """Claims to emit the records it received unchanged, but tags them."""

    traits = OpTraits(preserves_cursor_order=True, stateful=True)
    emits_received_records = True

    def process_many(self, recs):
        return [r.with_payload({**r.payload, "tag": 1}) for r in recs]


class CountsInPlace(Operator):
    """Changes the payloads it is given instead of making new ones."""

    traits = OpTraits(preserves_cursor_order=True)

    def process_many(self, recs):
        for r in recs:
            r.payload["idx"] += 1  # the mistake: the source may hand this dict out again
        return recs


class Box:
    """A payload of a class without its own ``==``."""

    def __init__(self, idx: int) -> None:
        self.idx = idx


class ReorderedSiblings(Operator):
    """Splits in two, closing child first, and emits the non-closing sibling after it."""

    traits = OpTraits(preserves_cursor_order=False, stateful=True)

    def process_many(self, recs):
        out = []
        for r in recs:
            out.append(SampleRecord(spawn_child(r.meta, 1, is_last_child=True), None))
            out.append(SampleRecord(spawn_child(r.meta, 0), None))
        return out


def test_a_reordering_operator_may_emit_siblings_after_the_closing_record():
    check_operator(ReorderedSiblings(), records())


def test_an_order_preserving_operator_may_not():
    class Claims(ReorderedSiblings):
        traits = OpTraits(preserves_cursor_order=True)

    with pytest.raises(AssertionError, match="closed by output"):
        check_operator(Claims(), records())


class ForgetsToReturn(Operator):
    traits = OpTraits(preserves_cursor_order=True)

    def process_many(self, recs):
        [rec.payload for rec in recs]  # the mistake: no return


@pytest.mark.parametrize(
    ("op", "message"),
    [
        (Forgetful(), r"never closed"),
        (BothClose(), r"closed by output 0"),
        (Duplicates(), r"emitted twice"),
        (Reverses(), r"preserves_cursor_order"),
        (Moody(), r"not deterministic"),
        (ForgetsToReturn(), r"process_many\(\) returned None instead of a list"),
        (Jitters(), r"payloads are not deterministic.*output 0 \(SampleCursor\(3, 0,"),
        (MergesPairsOfACall(), r"other outputs when its records come one at a time.*output 0"),
        (TagsWhatItPasses(), r"sets emits_received_records but output 0 \(SampleCursor\(3, 0,"),
        (CountsInPlace(), r"changes the payload of input 0 \(SampleCursor\(3, 0,.*in place"),
    ],
    ids=[
        "missing-tombstone",
        "early-close",
        "duplicate-cursor",
        "false-order",
        "nondeterministic",
        "returns-none",
        "nondeterministic-payload",
        "undeclared-batch-sensitivity",
        "changes-what-it-passes-on",
        "changes-its-input",
    ],
)
def test_each_broken_rule_is_explained(op, message):
    with pytest.raises(AssertionError, match=message):
        check_operator(op, records())


class Doubles(Operator):
    """Says it only maps payloads; ``map_payloads`` and ``process_many`` are set per instance."""

    traits = OpTraits(preserves_cursor_order=True)
    maps_payloads = True

    def __init__(self, run_factor: int = 2, drops: bool = False) -> None:
        self.run_factor = run_factor
        self.drops = drops

    def map_payloads(self, run):
        return [{"y": p["idx"] * self.run_factor} for p in run.payloads]

    def process_many(self, recs):
        kept = recs[1:] if self.drops else recs
        return [r.with_payload({"y": r.payload["idx"] * 2}) for r in kept]


def test_a_payload_mapper_passes_when_both_paths_agree_and_is_explained_when_not():
    check_operator(Doubles(), records())
    with pytest.raises(AssertionError, match=r"other payloads than process_many for the 12"):
        check_operator(Doubles(run_factor=3), records())
    with pytest.raises(AssertionError, match="metadata unchanged"):
        check_operator(Doubles(drops=True), records())


class YieldsPayloads(Doubles):
    """Yields the payloads of a run, which the lane runner refuses (it takes a list)."""

    def map_payloads(self, run):
        return (p for p in super().map_payloads(run))


def test_a_payload_mapper_returning_other_than_a_list_is_explained():
    with pytest.raises(AssertionError, match=r"map_payloads returned generator, not a list"):
        check_operator(YieldsPayloads(), records())


class ForgetsItsTotal(Operator):
    """Stateful and in order: a running total of idx that it forgets to carry across epochs."""

    traits = OpTraits(preserves_cursor_order=True, stateful=True)

    def __init__(self) -> None:
        self._total = 0

    def process_many(self, recs):
        out = []
        for rec in recs:
            self._total += rec.payload["idx"]
            out.append(rec.with_payload({**rec.payload, "total": self._total}))
        return out


def test_check_operator_catches_a_carry_state_that_is_missing():
    with pytest.raises(AssertionError, match=r"ForgetsItsTotal: .*carry_state\(\).*returns None"):
        check_operator(ForgetsItsTotal(), records())


def test_check_operator_passes_an_operator_that_carries_its_state():
    check_operator(RunningTotal(), records())


def _resume_pipeline(op: Operator) -> zephon.Pipeline:
    return zephon.Pipeline(
        RangeSource(120, chunk_size=8), [fetch(), op, batch(3)], lanes=2, epoch_chunks=2
    )


def test_check_resume_names_the_operator_that_forgets_its_carry_state():
    with pytest.raises(AssertionError, match=r"item \d+ differs.*Suspect: ForgetsItsTotal"):
        check_resume(_resume_pipeline(ForgetsItsTotal()))


class ForgetfulDedup(Operator):
    """Drops a text it has delivered before, but its carry state forgets what it has seen."""

    name = "dedup"
    traits = OpTraits(preserves_cursor_order=True, stateful=True)

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def process_many(self, recs):
        out = []
        for rec in recs:
            text = rec.payload["text"]
            if text in self._seen:
                out.extend(tombstones_for_record(rec))
            else:
                self._seen.add(text)
                out.append(rec)
        return out


def test_check_resume_names_a_dedup_operator_that_forgets_its_carry_state():
    # Repeats come only from later chunks, so the operator is right within any one epoch.
    texts = [{"text": f"doc {i % 40}"} for i in range(160)]
    pipeline = zephon.Pipeline(
        ListSource(texts, chunk_size=8), [fetch(), ForgetfulDedup(), batch(2)], epoch_chunks=2
    )
    with pytest.raises(AssertionError, match=r"item \d+ differs.*Suspect: dedup"):
        check_resume(pipeline)


def test_check_resume_passes_the_built_ins():
    source = ListSource([{"text": "ab " * (1 + i % 9) + str(i)} for i in range(160)], chunk_size=16)
    pipeline = zephon.Pipeline(
        source,
        [
            fetch(),
            tokenize(max_len=8, split_long_samples=True),
            shuffle(6, seed=2),
            pack_sequences(16, open_bins=3, pad_id=0),
            batch(2),
        ],
        lanes=2,
        epoch_chunks=2,
    )
    check_resume(pipeline)
    check_resume(_resume_pipeline(RunningTotal()), steps=[0, 5, 17])


def _object_array_and_nan(payload: dict) -> dict:
    """A payload of kinds a pipeline hands over: an object array, a score that is not a number."""
    i = payload["idx"]
    texts = np.array(["doc", str(i)], dtype=object)
    return {**payload, "texts": texts, "score": float("nan") if i % 5 == 0 else i / 7}


def _tensor(payload: dict) -> dict:
    torch = pytest.importorskip("torch")
    return {**payload, "tensor": torch.arange(3) * payload["idx"]}


def _mapped(fn, grouped: bool) -> zephon.Pipeline:
    return zephon.Pipeline(
        RangeSource(40, chunk_size=8),
        [fetch(), map_transform(fn), *([batch(4)] if grouped else [])],
        lanes=2,
        epoch_chunks=2,
    )


@pytest.mark.parametrize("grouped", [False, True])
def test_check_resume_passes_a_correct_pipeline_of_object_arrays_and_nan(grouped):
    check_resume(_mapped(_object_array_and_nan, grouped), steps=[0, 3, 7])


@pytest.mark.parametrize("grouped", [False, True])
def test_check_resume_passes_a_correct_pipeline_of_tensors(grouped):
    pytest.importorskip("torch")
    check_resume(_mapped(_tensor, grouped), steps=[0, 3, 7])


def _frame(payload: dict) -> object:
    pd = pytest.importorskip("pandas")
    return pd.DataFrame({"idx": [payload["idx"]] * 2, "half": [payload["idx"] / 2] * 2})


def test_check_operator_and_check_resume_pass_a_correct_operator_of_data_frames():
    # A data frame's == compares element by element: no single truth to compare runs by.
    pytest.importorskip("pandas")
    check_operator(map_transform(_frame), records())
    check_resume(_mapped(_frame, grouped=False), steps=[0, 3, 7])


class TensorTotal(ForgetsItsTotal):
    """A running total it forgets to carry, handed over as a tensor."""

    def process_many(self, recs):
        torch = pytest.importorskip("torch")
        out = super().process_many(recs)
        return [r.with_payload({"total": torch.tensor([r.payload["total"]])}) for r in out]


def test_check_resume_still_sees_tensors_that_differ_after_a_resume():
    pytest.importorskip("torch")
    with pytest.raises(AssertionError, match=r"item \d+ differs.*Suspect: TensorTotal"):
        check_resume(_resume_pipeline(TensorTotal()), steps=[20])


class HoldsFiveForgetsItsCount(Operator):
    """Holds the last five records and numbers what it emits (those it flushes are "last");
    what it says it holds forgets the number, so a restore from a snapshot numbers from 0
    again."""

    traits = OpTraits(preserves_cursor_order=True, stateful=True)

    def __init__(self) -> None:
        self._held: list = []
        self._emitted = 0

    def _numbered(self, recs):
        out = []
        for rec in recs:
            out.append(rec.with_payload({**rec.payload, "n": self._emitted}))
            self._emitted += 1
        return out

    def process_many(self, recs):
        self._held += recs
        out, self._held = self._held[:-5], self._held[-5:]
        return self._numbered(out)

    def flush(self):
        out, self._held = self._held, []
        return [rec.with_payload({**rec.payload, "n": "last"}) for rec in out]

    def holdings(self):
        return list(self._held), {}

    def restore_holdings(self, recs, state):
        self._held = list(recs)


def test_check_resume_resumes_from_a_snapshot_of_a_small_source():
    # One snapshot, after 64 samples: only items 59 to 74 differ after a restore from it, and
    # none of the spread of steps (0, 1, 11, 26, 40, 53, 79, 80) falls among them.
    pipeline = zephon.Pipeline(
        RangeSource(80, chunk_size=80),
        [fetch(), map_transform(dict), HoldsFiveForgetsItsCount()],
    )
    assert pipeline.compile().restores_holdings
    with pytest.raises(AssertionError, match=r"item \d+ differs"):
        check_resume(pipeline)


SETUP_CALLS: list[str] = []


class Classified(Operator):
    """Loads its classifier in setup (as docs/operators.md shows), and carries a count."""

    traits = OpTraits(preserves_cursor_order=True, stateful=True)

    def __init__(self) -> None:
        self.model: dict[str, int] | None = None
        self.seen = 0

    def setup(self, ctx) -> None:
        SETUP_CALLS.append("setup")
        self.model = {"threshold": 2}

    def teardown(self) -> None:
        SETUP_CALLS.append("teardown")

    def process_many(self, records):
        assert self.model is not None, "process_many ran before setup"
        self.seen += len(records)
        return records

    def carry_state(self):
        return {"seen": self.seen}

    def restore_carry(self, state) -> None:
        self.seen = state["seen"]


def test_check_operator_sets_an_operator_with_setup_up_once_and_tears_it_down():
    SETUP_CALLS.clear()
    op = Classified()
    check_operator(op, records(6))
    assert op.model is None  # the operator as made is never set up: a copy of it is
    assert SETUP_CALLS == ["setup", "teardown"]


class ForgetsItsTotalWithAModel(ForgetsItsTotal):
    """ForgetsItsTotal, needing a model its setup loads."""

    def __init__(self) -> None:
        super().__init__()
        self.model: dict[str, int] | None = None

    def setup(self, ctx) -> None:
        self.model = {"scale": 1}

    def process_many(self, recs):
        assert self.model is not None, "process_many ran before setup"
        return super().process_many(recs)


def test_check_resume_names_the_suspect_of_a_pipeline_with_setup():
    with pytest.raises(
        AssertionError, match=r"item \d+ differs.*Suspect: ForgetsItsTotalWithAModel"
    ):
        check_resume(_resume_pipeline(ForgetsItsTotalWithAModel()))
