"""check_operator catches each mistake an operator author can make, and passes correct operators."""

from __future__ import annotations

import pytest
from pipeline_kit import DropMultiples, PackPairs, SplitInChildren, WindowShuffle

from zephon.ops.base import Operator, OpTraits
from zephon.ops.basic import filter_records, map_transform
from zephon.ops.children import spawn_child
from zephon.testing import check_operator
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


@pytest.mark.parametrize(
    ("op", "message"),
    [
        (Forgetful(), r"never closed"),
        (BothClose(), r"closed by output 0"),
        (Duplicates(), r"emitted twice"),
        (Reverses(), r"preserves_cursor_order"),
        (Moody(), r"not deterministic"),
    ],
    ids=["missing-tombstone", "early-close", "duplicate-cursor", "false-order", "nondeterministic"],
)
def test_each_broken_rule_is_explained(op, message):
    with pytest.raises(AssertionError, match=message):
        check_operator(op, records())
