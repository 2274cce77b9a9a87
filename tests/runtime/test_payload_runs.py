"""Runs of fetched records through ``maps_payloads`` operators, batching and delivery: the stream,
the checkpoints' resumes, operator counts and errors are those of the same records one by one."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pipeline_kit import assert_resumes_at, run

import zephon
from zephon.errors import OperatorError
from zephon.ops.base import Operator, OpTraits
from zephon.ops.basic import fetch, map_transform
from zephon.ops.batching import batch, default_collate
from zephon.sources.memory import RangeSource
from zephon.types import JoinedRuns, RecordRun, SampleRecord


def double(payload: dict) -> dict:
    return {"idx": payload["idx"], "x": payload["idx"] * 2}


class OneByOne(Operator):
    """``double`` as an operator that only takes records: the reference path."""

    name = "double"
    traits = OpTraits(preserves_cursor_order=True, preserves_indexability=True)

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        return [r.with_payload(double(r.payload)) for r in records]


def pipeline(op: Operator, **kw: Any) -> zephon.Pipeline:
    return zephon.Pipeline(RangeSource(500, chunk_size=64), [fetch(), op, batch(24)], lanes=2, **kw)


@pytest.mark.parametrize("workers", ["inline", "process"])
def test_runs_deliver_what_records_one_by_one_deliver_and_resume_exactly(workers: str) -> None:
    by_run = pipeline(map_transform(double), workers=workers)
    full = run(iter(by_run))
    assert full == run(iter(pipeline(OneByOne(), workers=workers)))
    loader = iter(by_run)
    head = run(loader, 7)  # inside a run: the batch after it is the rest of a split
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    assert head + run(by_run.iter(state=state)) == full


def test_operator_counts_are_those_of_the_records() -> None:
    counts = []
    for op in (map_transform(double), OneByOne()):
        loader = iter(pipeline(op))
        run(loader)
        counts.append(
            [(s["records_in"], s["items_out"]) for s in loader.stats()["operators"].values()]
        )
    assert counts[0] == counts[1] == [(500, 500)]


def test_a_failing_map_names_the_record_it_failed_on() -> None:
    def fails_at_77(payload: dict) -> dict:
        if payload["idx"] == 77:
            raise KeyError("no such thing")
        return payload

    with pytest.raises(OperatorError, match=r"sample_id=\(0, 0, 77\)\).*KeyError"):
        run(iter(pipeline(map_transform(fails_at_77, name="picky"))))


class WrongLength(Operator):
    name = "wrong"
    traits = OpTraits(preserves_cursor_order=True)
    maps_payloads = True

    def map_payloads(self, run: RecordRun) -> list[Any]:
        return run.payloads[:-1]

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        return records


def test_a_payload_mapper_that_loses_a_payload_is_an_operator_error() -> None:
    with pytest.raises(OperatorError, match=r"'wrong' mapped a run of 64 records .* one payload"):
        run(iter(pipeline(WrongLength())))


class FlagOnly(OneByOne):
    """Says it only maps payloads and keeps the default ``map_payloads`` (from process_many)."""

    maps_payloads = True


def test_the_default_map_payloads_is_process_many_on_the_runs_records() -> None:
    assert run(iter(pipeline(FlagOnly()))) == run(iter(pipeline(OneByOne())))
    loader = iter(pipeline(FlagOnly()))
    run(loader)
    assert [s["records_in"] for s in loader.stats()["operators"].values()] == [500]


@pytest.mark.parametrize("size", [24, 150])  # crosses the end of a read; spans several reads
def test_a_batch_across_runs_hands_its_collate_the_runs_joined(size: int) -> None:
    seen: list[type] = []

    def collate(records: Any) -> Any:
        seen.append(type(records))
        return default_collate(records)

    def batched(op: Operator, collate: Any = None) -> zephon.Pipeline:
        return zephon.Pipeline(
            RangeSource(500, chunk_size=64),
            [fetch(), op, batch(size, collate=collate)],
            micro_batch=32,
        )

    full = run(iter(batched(map_transform(double), collate)))
    assert JoinedRuns in seen and SampleRecord not in seen
    seen.clear()
    assert full == run(iter(batched(OneByOne(), collate)))
    assert set(seen) == {list}  # records one by one: the reference
    assert_resumes_at(batched(map_transform(double)), [1, 2, len(full) - 1], full)
