"""Each pitfall of writing a pipeline, committed on purpose, is reported instead of losing data."""

from __future__ import annotations

import itertools

import pytest
from pipeline_kit import DropMultiples, SplitInChildren, WindowShuffle

import zephon
from zephon.errors import ContractViolation, ContractWarning, ReplayDivergenceError
from zephon.ops.base import Operator, OpTraits
from zephon.ops.basic import fetch
from zephon.ops.children import spawn_child
from zephon.sources.memory import RangeSource
from zephon.types import SampleRecord


class ClosesEveryChild(Operator):
    """Splits in two and marks BOTH children closing: the first closes its offset too early."""

    traits = OpTraits(preserves_cursor_order=True)

    def process_many(self, records):
        return [
            SampleRecord(spawn_child(r.meta, i, is_last_child=True), r.payload)
            for r in records
            for i in range(2)
        ]


class DropsWithoutTombstones(Operator):
    """A stateful filter that forgets the tombstones of what it drops."""

    traits = OpTraits(preserves_cursor_order=True, stateful=True)

    def process_many(self, records):
        return [r for r in records if r.payload["idx"] % 5]


class ReversesButClaimsOrder(Operator):
    """Reverses each micro-batch while claiming preserves_cursor_order=True."""

    traits = OpTraits(preserves_cursor_order=True)

    def process_many(self, records):
        return records[::-1]


_instances = itertools.count()


class UnstableLineage(Operator):
    """Derives the child index from how many instances were made: a non-deterministic cursor."""

    traits = OpTraits(preserves_cursor_order=True)

    def __init__(self):
        self.salt = 0

    def start_epoch(self, lane_id, epoch):
        super().start_epoch(lane_id, epoch)
        self.salt = next(_instances)

    def process_many(self, records):
        return [
            SampleRecord(spawn_child(r.meta, self.salt, is_last_child=True), r.payload)
            for r in records
        ]


class UnstableShuffle(WindowShuffle):
    """A window shuffle whose seed changes with every instance (like seeding from time)."""

    def start_epoch(self, lane_id, epoch):
        super().start_epoch(lane_id, epoch)
        from zephon.ops.base import epoch_rng

        self._rng = epoch_rng(next(_instances), lane_id, epoch)


def pipeline(op, *, strict, n=60, **kw):
    return zephon.Pipeline(RangeSource(n, chunk_size=8), [fetch(), op], strict=strict, **kw)


def test_early_close_raises_in_strict_mode_naming_the_operator():
    with pytest.raises(ContractViolation, match=r"ClosesEveryChild.*base offset \(0, 0\)"):
        list(pipeline(ClosesEveryChild(), strict=True))


def test_early_close_is_a_counted_warning_otherwise():
    loader = iter(pipeline(ClosesEveryChild(), strict=False))
    with pytest.warns(ContractWarning, match="early-close"):
        items = list(loader)
    assert len(items) == 120
    assert loader.stats()["violations"] == 60


def test_two_closing_records_for_one_offset_are_reported_on_the_epoch_path_too():
    p = zephon.Pipeline(
        RangeSource(60, chunk_size=8), [fetch(), ClosesEveryChild(), WindowShuffle(4)], strict=True
    )
    with pytest.raises(ContractViolation, match="ClosesEveryChild"):
        list(p)


def test_siblings_reordered_after_their_closing_record_are_fine_on_the_epoch_path():
    p = zephon.Pipeline(
        RangeSource(200, chunk_size=8),
        [fetch(), SplitInChildren(3), WindowShuffle(9)],
        strict=True,
    )
    assert len(list(p)) == sum(i % 3 + 1 for i in range(200))


def test_missing_tombstone_is_found_when_the_epoch_marker_arrives():
    with pytest.raises(ContractViolation, match=r"DropsWithoutTombstones.*\(0, 0\)"):
        list(pipeline(DropsWithoutTombstones(), strict=True))


def test_missing_tombstones_do_not_pin_memory_when_not_strict():
    loader = iter(pipeline(DropsWithoutTombstones(), strict=False, n=4000, epoch_chunks=2))
    with pytest.warns(ContractWarning, match="never closed"):
        delivered = sum(1 for _ in loader)
    stats = loader.stats()
    assert delivered == 3200
    assert stats["inflight_chunks"] == 0
    assert stats["max_inflight_chunks"] <= 2
    assert stats["violations"] == 250  # one per epoch


def test_a_correct_dropping_operator_raises_nothing_on_the_epoch_path():
    loader = iter(pipeline(DropMultiples(5), strict=True, n=200))
    ops_loader = zephon.Pipeline(
        RangeSource(200, chunk_size=8), [fetch(), DropMultiples(5), WindowShuffle(3)], strict=True
    )
    assert sum(1 for _ in ops_loader) == 160
    assert sum(1 for _ in loader) == 160


def test_false_order_claim_raises_in_strict_mode():
    with pytest.raises(ContractViolation, match=r"ReversesButClaimsOrder.*preserves_cursor_order"):
        list(pipeline(ReversesButClaimsOrder(), strict=True, micro_batch=4))


def test_false_order_claim_is_counted_otherwise():
    loader = iter(pipeline(ReversesButClaimsOrder(), strict=False, micro_batch=4))
    with pytest.warns(ContractWarning):
        list(loader)
    assert loader.stats()["violations"] > 0


def test_non_deterministic_cursor_makes_restore_raise_divergence():
    p = pipeline(UnstableLineage(), strict=False)
    loader = iter(p)
    for _ in range(13):
        next(loader)
    with pytest.raises(ReplayDivergenceError, match="lane 0"):
        list(p.iter(state=loader.state_dict()))


def test_non_deterministic_reordering_makes_restore_raise_divergence():
    p = pipeline(UnstableShuffle(6), strict=False, epoch_chunks=4)
    loader = iter(p)
    for _ in range(20):
        next(loader)
    with pytest.raises(ReplayDivergenceError):
        list(p.iter(state=loader.state_dict()))
