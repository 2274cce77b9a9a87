"""map_batch: a function of a micro-batch's payloads, one new payload per record."""

from __future__ import annotations

import pytest

import zephon
from zephon.errors import OperatorError
from zephon.ops import batch, fetch, map_batch, map_transform
from zephon.sources import RangeSource
from zephon.testing import check_operator, check_resume
from zephon.types import SampleCursor, SampleMeta, SampleRecord


def squares(payloads):
    return [{"idx": p["idx"], "sq": p["idx"] ** 2} for p in payloads]


def square(payload):
    return {"idx": payload["idx"], "sq": payload["idx"] ** 2}


def centred(payloads):  # depends on the whole micro-batch
    mean = sum(p["idx"] for p in payloads) / len(payloads)
    return [{"idx": p["idx"], "c": p["idx"] - mean} for p in payloads]


def pipeline(op, **kw):
    return zephon.Pipeline(
        RangeSource(1000, chunk_size=64, shuffle=True, seed=3), [fetch(), op, batch(8)], **kw
    )


def payloads_of(p):
    return [dict(zip(b.payload, vals)) for b in p for vals in zip(*b.payload.values())]


@pytest.mark.parametrize("workers", ["inline", "thread", "process"])
def test_map_batch_delivers_what_map_transform_does(workers):
    got = payloads_of(pipeline(map_batch(squares), lanes=2, workers=workers))
    assert got == payloads_of(pipeline(map_transform(square), lanes=2))
    assert len(got) == 1000


def test_map_batch_resumes_exactly_also_when_batch_sensitive():
    check_resume(pipeline(map_batch(squares), lanes=2, micro_batch=16), steps=[0, 7, 40, 125])
    check_resume(
        pipeline(map_batch(centred, batch_sensitive=True), lanes=2, micro_batch=16),
        steps=[0, 7, 40, 125],
    )


def test_map_batch_passes_check_operator():
    records = [
        SampleRecord(SampleMeta(SampleCursor(0, i, (0, 0, i))), {"idx": i}) for i in range(10)
    ]
    check_operator(map_batch(squares), records)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (lambda ps: ps[:-1], r"returned \d+ payloads for \d+"),
        (lambda ps: {"a": 1}, "returned dict, not a list of payloads"),
        (lambda ps: 1 / 0, "ZeroDivisionError"),
    ],
)
def test_a_wrong_result_names_the_operator_and_the_micro_batch(fn, message):
    with pytest.raises(OperatorError, match=rf"'bad'.*micro-batch of \d+ records from .*{message}"):
        list(pipeline(map_batch(fn, name="bad")))


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="callable"):
        map_batch(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="batch_sensitive"):
        map_batch(squares, batch_sensitive=1)  # type: ignore[arg-type]
