"""What an operator's ``process_many`` and ``flush`` hand back: a list of records and
tombstones, or a generator of them (a generator function is the natural way to write one), taken
alike; anything else is an ``OperatorError`` naming the operator and the method."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pipeline_kit import run

import zephon
from zephon.errors import OperatorError
from zephon.ops.base import Operator, OpTraits
from zephon.ops.basic import fetch
from zephon.ops.children import tombstones_for_record
from zephon.sources.memory import RangeSource
from zephon.types import SampleCursor, SampleRecord


class Reverses(Operator):
    """Holds every record of an epoch and emits them in reverse at its end."""

    traits = OpTraits(preserves_cursor_order=False, stateful=True)

    def __init__(self) -> None:
        self._held: list[SampleRecord] = []

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        self._held.extend(records)
        return []

    def flush(self) -> list[SampleRecord]:
        held, self._held = self._held, []
        return held[::-1]


class ReversesByGenerator(Reverses):
    def flush(self) -> Iterator[SampleRecord]:  # type: ignore[override]
        held, self._held = self._held, []
        yield from held[::-1]


class DropsThirds(Operator):
    """Drops every third record (with its tombstones); fails on sample 13."""

    traits = OpTraits(preserves_cursor_order=True)

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        out: list[SampleRecord] = []
        for rec in records:
            if rec.payload["idx"] == 13:
                raise ValueError("sample 13 is bad")
            out.extend(tombstones_for_record(rec) if rec.payload["idx"] % 3 == 0 else [rec])
        return out


class DropsThirdsByGenerator(DropsThirds):
    def process_many(self, records: list[SampleRecord]) -> Iterator[SampleRecord]:  # type: ignore[override]
        for rec in records:
            if rec.payload["idx"] == 13:
                raise ValueError("sample 13 is bad")
            yield from tombstones_for_record(rec) if rec.payload["idx"] % 3 == 0 else [rec]


def _pipeline(op: Operator, **kw: Any) -> zephon.Pipeline:
    return zephon.Pipeline(
        RangeSource(40, chunk_size=8), [fetch(), op], lanes=2, epoch_chunks=2, micro_batch=4, **kw
    )


@pytest.mark.parametrize("workers", ["inline", "process"])
def test_a_flush_written_as_a_generator_delivers_what_it_held(workers: str) -> None:
    expected = run(iter(_pipeline(Reverses(), workers=workers)))
    assert len(expected) == 40
    assert run(iter(_pipeline(ReversesByGenerator(), workers=workers))) == expected


@pytest.mark.parametrize("workers", ["inline", "process"])
def test_process_many_written_as_a_generator_runs_like_one_returning_a_list(
    workers: str,
) -> None:
    expected = run(iter(_pipeline(DropsThirds(), workers=workers, on_error="skip")))
    assert len(expected) == 40 - 14 - 1  # thirds dropped, sample 13 skipped
    got = run(iter(_pipeline(DropsThirdsByGenerator(), workers=workers, on_error="skip")))
    assert got == expected


def test_a_generator_that_raises_names_the_record_that_fails() -> None:
    with pytest.raises(OperatorError, match=r"failed on record SampleCursor\(1, 5,") as info:
        list(_pipeline(DropsThirdsByGenerator()))
    assert isinstance(info.value.cursor, SampleCursor) and info.value.cursor.sample_id[2] == 13


class ForgetsToReturn(Operator):
    traits = OpTraits(preserves_cursor_order=True)

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        out = list(records)  # noqa: F841 (the mistake: no return)
        return None  # type: ignore[return-value]


@pytest.mark.parametrize("workers", ["inline", "process"])
def test_process_many_returning_none_is_named(workers: str) -> None:
    with pytest.raises(
        OperatorError,
        match=r"operator 'ForgetsToReturn' returned None from process_many\(\) instead of a list",
    ) as info:
        list(_pipeline(ForgetsToReturn(), workers=workers))
    assert info.value.context["lane"] == 0
