"""A user's own pointer reader and grouper take the places of fetch and batch: the runtime asks
only for the roles (``PointerReader``, ``Grouper``), never for the built-ins."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from pipeline_kit import assert_resumes_at, run

import zephon
from zephon._core.records import records_for_chunk
from zephon.errors import PlanError
from zephon.ops.base import Operator, OpTraits
from zephon.ops.basic import fetch, map_transform
from zephon.sources.memory import RangeSource
from zephon.types import SampleBatch, SampleRecord


class SquaresReader(Operator):
    """Reads nothing from the source: the payload of pointer row (d, s, i) is {"sq": i * i}."""

    consumes_pointers = True
    traits = OpTraits(preserves_cursor_order=True, preserves_indexability=True)

    def bind(self, source: Any) -> None:
        self.source = source

    def fetch(self, chunk_id: int, pointers: np.ndarray, first_offset: int) -> list[SampleRecord]:
        payloads = [{"sq": int(i) * int(i)} for i in pointers[:, 2]]
        comps = self.source.components(pointers)
        return records_for_chunk(chunk_id, pointers, payloads, self.lane_id, comps, first_offset)


class SumGrouper(Operator):
    """Groups three records at a time into the sum of their squares."""

    groups_at_delivery = True
    traits = OpTraits(preserves_cursor_order=True)
    batch_size = 3
    drop_remainder = True

    def collate(self, records: list[SampleRecord]) -> Any:
        return sum(r.payload["sq"] for r in records)


def _pipeline() -> zephon.Pipeline:
    return zephon.Pipeline(RangeSource(50, chunk_size=7), [SquaresReader(), SumGrouper()], lanes=2)


def test_a_user_reader_and_grouper_run_and_resume() -> None:
    items = list(_pipeline())
    assert all(isinstance(b, SampleBatch) and len(b) == 3 for b in items)
    got = sorted(sum(r.cursor.sample_id[2] ** 2 for r in b) for b in items)
    assert got == sorted(b.payload for b in items)
    assert len(items) == 16  # 25 per lane, the remainder of one dropped
    full = run(iter(_pipeline()))
    assert_resumes_at(_pipeline(), [0, 1, 7, len(full)], full)


def test_a_reader_without_fetch_is_refused_by_the_planner() -> None:
    class NoFetch(Operator):
        consumes_pointers = True
        traits = OpTraits(preserves_cursor_order=True)

        def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
            return records

    with pytest.raises(PlanError, match="PointerReader"):
        zephon.Pipeline(RangeSource(5), [NoFetch()]).compile()


def test_a_grouper_without_collate_is_refused_by_the_planner() -> None:
    class NoCollate(Operator):
        groups_at_delivery = True
        traits = OpTraits(preserves_cursor_order=True)
        batch_size = 2
        drop_remainder = False

    with pytest.raises(PlanError, match="Grouper"):
        zephon.Pipeline(RangeSource(5), [fetch(), map_transform(dict), NoCollate()]).compile()
