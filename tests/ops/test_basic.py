"""The per-record operators of ``zephon.ops.basic``: a function of one payload, written as a
generator or coroutine function by mistake, is refused where it is given."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import zephon
from zephon.ops import fetch, filter_records, map_transform
from zephon.sources.memory import RangeSource


def is_even(payload: dict) -> Iterator[bool]:
    yield payload["idx"] % 2 == 0  # the mistake: yield for return


def tagged(payload: dict) -> Iterator[dict]:
    yield {**payload, "tag": 1}


async def fetched_score(payload: dict) -> dict:
    return payload


def test_a_generator_predicate_is_refused_rather_than_keeping_every_record():
    # Every generator is true: the filter kept all 20 records.
    with pytest.raises(TypeError, match=r"filter_records: is_even is a generator function"):
        filter_records(is_even)  # type: ignore[arg-type]


@pytest.mark.parametrize("fn", [tagged, fetched_score], ids=["generator", "coroutine"])
def test_a_map_whose_function_yields_or_awaits_is_refused(fn: Any):
    # Each payload became a generator (or coroutine) object, handed to the loop as it was.
    with pytest.raises(TypeError, match=rf"map_transform: {fn.__name__} is a"):
        map_transform(fn)


def test_plain_functions_still_filter_and_map():
    p = zephon.Pipeline(
        RangeSource(20, chunk_size=4),
        [fetch(), filter_records(lambda p: p["idx"] % 2 == 0), map_transform(dict)],
    )
    assert [r.payload["idx"] for r in p] == list(range(0, 20, 2))
