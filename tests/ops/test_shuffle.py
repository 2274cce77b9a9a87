"""``shuffle``: a seeded window shuffle that passes every record through unchanged, so
each base offset is closed exactly once (a closing child may leave before its siblings: fine on the
epoch path)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from itertools import islice
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zephon
from zephon.ops import fetch, shuffle, tokenize
from zephon.sources.memory import RangeSource
from zephon.testing import check_operator
from zephon.types import SampleCursor, SampleMeta, SampleRecord


def records(n: int, chunk_size: int = 10) -> list[SampleRecord]:
    return [
        SampleRecord(SampleMeta(SampleCursor(i // chunk_size, i % chunk_size, (0, 0, i))), i)
        for i in range(n)
    ]


def run(op, recs, *, lane=0, epoch=0, micro=5):
    op = copy.deepcopy(op)
    op.start_epoch(lane, epoch)
    out = []
    for lo in range(0, len(recs), micro):
        out += op.process_many(recs[lo : lo + micro])
    return out + op.flush()


def order(out):
    return [r.payload for r in out]


@settings(max_examples=40)
@given(n=st.integers(0, 80), size=st.integers(1, 30), micro=st.integers(1, 12))
def test_the_output_is_a_permutation_of_the_input(n, size, micro):
    out = run(shuffle(size, seed=1), records(n), micro=micro)
    assert sorted(order(out)) == list(range(n))


@settings(max_examples=25)
@given(n=st.integers(0, 60), size=st.integers(1, 20), a=st.integers(1, 9), b=st.integers(1, 9))
def test_the_order_does_not_depend_on_micro_batches(n, size, a, b):
    recs = records(n)
    assert order(run(shuffle(size), recs, micro=a)) == order(run(shuffle(size), recs, micro=b))


def test_the_order_is_deterministic_per_seed_and_differs_per_seed_epoch_and_lane():
    recs = records(200)
    base = order(run(shuffle(32, seed=5), recs))
    assert base == order(run(shuffle(32, seed=5), recs))
    assert base != list(range(200))
    assert base != order(run(shuffle(32, seed=6), recs))
    assert base != order(run(shuffle(32, seed=5), recs, epoch=1))
    assert base != order(run(shuffle(32, seed=5), recs, lane=1))


def test_a_window_of_one_keeps_the_order():
    assert order(run(shuffle(1), records(30))) == list(range(30))


def test_records_move_at_most_a_window_ahead():
    # The window shuffle is local: a record leaves no earlier than buffer_size - 1 places before
    # the point where it arrived.
    out = order(run(shuffle(10, seed=2), records(300)))
    assert all(out.index(i) >= i - 9 for i in range(300))


def test_split_children_pass_through_unchanged_and_close_each_offset_once():
    texts = [{"text": "x" * k} for k in (0, 3, 17, 40, 9, 25)]
    recs = [
        SampleRecord(SampleMeta(SampleCursor(1, i, (0, 0, i)), component="a"), t)
        for i, t in enumerate(texts)
    ]
    children = tokenize(max_len=4, split_long_samples=True).process_many(recs)
    for seed in range(5):
        check_operator(shuffle(6, seed=seed), children)
        out = run(shuffle(6, seed=seed), children)
        assert sorted(map(id, out)) == sorted(map(id, children)), "the same record objects"
    check_operator(shuffle(3), records(25))


def test_traits_and_validation():
    op = shuffle(8, seed=3)
    assert not op.traits.preserves_cursor_order and op.traits.stateful
    assert op.describe()["params"] == {"buffer_size": 8, "seed": 3}
    with pytest.raises(ValueError, match="buffer_size"):
        shuffle(0)
    with pytest.raises(ValueError, match="seed"):
        shuffle(4, seed=-1)


def test_a_split_then_shuffled_pipeline_has_no_contract_violations_and_resumes():
    source = RangeSource(90, chunk_size=7, make=_doc)
    pipeline = zephon.Pipeline(
        source,
        [fetch(), tokenize(max_len=3, split_long_samples=True), shuffle(9, seed=4)],
        lanes=2,
        epoch_chunks=2,
        strict=True,
    )
    full = seen(iter(pipeline))
    assert len(full) > 90
    loader = iter(pipeline)
    head = seen(islice(loader, 41))
    state = json.loads(json.dumps(loader.state_dict()))
    assert head + seen(pipeline.iter(state=state)) == full
    assert loader.stats()["violations"] == 0


def seen(items: Iterable[Any]) -> list[tuple]:
    """Cursor and token bytes of each delivered record."""
    out = []
    for r in items:
        assert isinstance(r, SampleRecord)
        out.append((r.meta.cursor, r.payload["tokens"].tobytes()))
    return out


def _doc(idx: int) -> dict:
    return {"text": "y" * (idx % 11)}
