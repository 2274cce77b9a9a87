"""``RecordRun`` (zephon/_core/records.pyx): a run of root records kept as columns must be, record
for record, what building each record with the public constructors gives; and so must everything
made from it (splits, new payloads, pickles, batches). A run with token counts (a pre-tokenized
source's, ``counted_run``) is its records each given ``counted_meta``."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zephon._core.records import (
    JoinedRuns,
    count_closing,
    counted_meta,
    counted_run,
    expand_runs,
    make_batch,
    map_run,
)
from zephon.types import RecordRun, SampleCursor, SampleMeta, SampleRecord


def reference(
    chunk_id: int,
    pointers: Any,
    payloads: list,
    lane: int,
    comps: list | None,
    first: int,
    tokens: list[int] | None = None,
) -> list[tuple[SampleMeta, Any]]:
    """Each record's meta and payload, built field by field (no components: the dataset id;
    with ``tokens``, each record one sample of its component that many tokens long)."""
    out = []
    for i, row in enumerate(pointers):
        meta = SampleMeta(
            SampleCursor(chunk_id, first + i, (int(row[0]), int(row[1]), int(row[2])), ()),
            lane_id=lane,
            component=int(row[0]) if comps is None else comps[i],
        )
        out.append((meta if tokens is None else counted_meta(meta, tokens[i]), payloads[i]))
    return out


def seen(records: Sequence[SampleRecord]) -> list[tuple[SampleMeta, Any]]:
    return [(r.meta, r.payload) for r in records]


@st.composite
def runs(draw: st.DrawFn, min_size: int = 1) -> tuple[RecordRun, list[tuple[SampleMeta, Any]]]:
    n = draw(st.integers(min_size, 12))
    rows = draw(st.lists(st.tuples(*[st.integers(0, 2**40)] * 3), min_size=n, max_size=n))
    pointers = np.array(rows, dtype=np.int64).reshape(n, 3)
    chunk_id, lane, first = (
        draw(st.integers(0, 2**40)),
        draw(st.integers(0, 9)),
        draw(st.integers(0, 1000)),
    )
    payloads = [{"i": i} for i in range(n)]
    comps = draw(st.none() | st.lists(st.sampled_from([None, "web", 3]), min_size=n, max_size=n))
    tokens = draw(st.none() | st.lists(st.integers(0, 2**40), min_size=n, max_size=n))
    run = RecordRun(chunk_id, pointers, payloads, lane, comps, first, tokens)
    return run, reference(chunk_id, pointers, payloads, lane, comps, first, tokens)


@given(runs())
def test_a_runs_records_are_the_records_built_field_by_field(drawn: Any) -> None:
    run, expected = drawn
    assert len(run) == len(expected)
    assert seen(run.records()) == expected
    assert seen(list(run)) == expected
    assert seen([run[i] for i in range(len(run))]) == expected
    assert seen([run[-1]]) == expected[-1:]
    assert seen(run[1::2]) == expected[1::2]
    for rec in run:
        assert rec.meta.contributors is None and not rec.is_tombstone
        assert rec.payload is expected[rec.meta.cursor.chunk_offset - run.first_offset][1]
    assert isinstance(run, Sequence)


@given(runs(min_size=2), st.data())
def test_a_split_run_is_the_same_records_in_two_runs(drawn: Any, data: st.DataObject) -> None:
    run, expected = drawn
    k = data.draw(st.integers(1, len(run) - 1))
    head, tail = run.split(k)
    assert seen(head) == expected[:k] and seen(tail) == expected[k:]
    assert tail.first_offset == run.first_offset + k
    assert tail.pointers.tolist() == run.pointers[k:].tolist()
    if len(tail) > 1:  # a tail splits again, as delivery does batch after batch
        a, b = tail.split(1)
        assert seen(a) + seen(b) == expected[k:]


@given(runs())
def test_a_run_survives_pickle_and_with_payloads_keeps_its_records(drawn: Any) -> None:
    run, expected = drawn
    parts = [run] if len(run) == 1 else list(run.split(len(run) // 2 or 1))
    for part in parts:
        back = pickle.loads(pickle.dumps(part))
        assert seen(back) == seen(part)
    new = run.with_payloads([{"n": i} for i in range(len(run))])
    assert [r.meta for r in new] == [m for m, _ in expected]
    assert [r.payload for r in new] == [{"n": i} for i in range(len(run))]
    if len(run) > 1:  # a part's new payloads keep the part's own counts
        tail = run.split(1)[1].with_payloads([{"n": i} for i in range(len(run) - 1)])
        assert [r.meta for r in tail] == [m for m, _ in expected[1:]]


@given(runs(), st.data())
def test_a_counted_run_is_its_records_each_given_counted_meta(
    drawn: Any, data: st.DataObject
) -> None:
    run, _ = drawn
    lengths = data.draw(st.lists(st.integers(0, 9), min_size=len(run), max_size=len(run)))
    plain = run.with_payloads([{"tokens": [7] * k} for k in lengths])
    plain = RecordRun(  # the same run without counts, as fetch reads it
        plain.chunk_id,
        plain.pointers,
        plain.payloads,
        plain.lane_id,
        # Components left out where they are the dataset ids, as a single source's are.
        None if run.components == [int(p[0]) for p in run.pointers] else plain.components,
        plain.first_offset,
    )
    for part in [plain] if len(plain) == 1 else [plain, plain.split(1)[1]]:
        counted = counted_run(part, "tokens")
        expected = [counted_meta(r.meta, len(r.payload["tokens"])) for r in part]
        counts = counted.token_counts
        assert counts is not None and counts.tolist() == [len(p["tokens"]) for p in part.payloads]
        assert [r.meta for r in counted] == expected
        assert [r.payload for r in counted] == part.payloads
        assert [r.meta for r in pickle.loads(pickle.dumps(counted))] == expected
    assert run.token_counts is None or len(run.token_counts) == len(run)


def test_a_run_refuses_token_counts_that_do_not_fit_it() -> None:
    rows = np.zeros((2, 3), dtype=np.int64)
    with pytest.raises(ValueError, match="2 records but token_counts of shape"):
        RecordRun(0, rows, [None, None], 0, None, 0, [1, 2, 3])
    with pytest.raises(ValueError, match="token_counts must be >= 0"):
        RecordRun(0, rows, [None, None], 0, None, 0, [1, -1])
    with pytest.raises(KeyError):
        counted_run(RecordRun(0, rows, [{"a": 1}, {"a": 2}], 0, None), "tokens")


def test_a_run_split_out_of_range_or_given_the_wrong_payloads_says_so() -> None:
    run = RecordRun(0, np.zeros((3, 3), dtype=np.int64), [1, 2, 3], 0, [None] * 3)
    for k in (0, 3, -1):
        with pytest.raises(ValueError, match=r"splits at 1\.\.2"):
            run.split(k)
    with pytest.raises(ValueError, match="2 payloads for a run of 3"):
        run.with_payloads([1, 2])
    with pytest.raises(IndexError):
        run[3]


def test_a_run_rejects_what_records_for_chunk_rejects() -> None:
    one = np.zeros((1, 3), dtype=np.int64)
    with pytest.raises(ValueError, match="shape"):
        RecordRun(0, np.zeros((1, 2), dtype=np.int64), [None], 0, [None])
    with pytest.raises(ValueError, match="1 pointers but 2 payloads"):
        RecordRun(0, one, [None, None], 0, [None])
    with pytest.raises(ValueError, match="1 pointers but 2 payloads and 1 components"):
        RecordRun(0, one, [None, None], 0, None)  # components from the dataset ids
    with pytest.raises(ValueError, match="row 0"):
        RecordRun(0, np.array([[0, 0, -1]]), [None], 0, [None])
    for chunk_id, lane, first in ((-1, 0, 0), (0, -1, 0), (0, 0, -1)):
        with pytest.raises(ValueError, match=">= 0"):
            RecordRun(chunk_id, one, [None], lane, [None], first)


@given(st.lists(runs() | st.sampled_from(["control", None]), max_size=6))
def test_expand_runs_puts_each_runs_records_in_its_place(items: list) -> None:
    mixed = [x[0] if isinstance(x, tuple) else x for x in items]
    expected = [y for x in items for y in (x[1] if isinstance(x, tuple) else [x])]
    out = expand_runs(mixed)
    assert [seen([r])[0] if isinstance(r, SampleRecord) else r for r in out] == expected
    assert count_closing([r for r in mixed if isinstance(r, RecordRun)]) == sum(
        isinstance(r, SampleRecord) for r in out
    )
    if not any(isinstance(x, RecordRun) for x in mixed):
        assert out is mixed


@given(
    st.lists(st.integers(-5, 20), min_size=1, max_size=30),
    st.data(),
    st.sampled_from([None, 7, 13]),
)
def test_map_run_is_a_list_comprehension_over_any_part_of_a_run_that_stops_at_none_or_an_error(
    values: list[int], data: st.DataObject, bad: int | None
) -> None:
    def fn(v: int) -> Any:
        if v < 0:
            return None
        if v == bad:
            raise KeyError(v)
        return v * 2

    run = RecordRun(0, np.zeros((len(values), 3), dtype=np.int64), values, 0, None)
    lo = data.draw(st.integers(0, len(values) - 1))
    hi = data.draw(st.integers(lo + 1, len(values)))
    part = run.split(lo)[1] if lo else run
    part = part.split(hi - lo)[0] if hi < len(values) else part
    out, i, exc = map_run(fn, part)
    mine = values[lo:hi]  # the part's payloads, sitting in the middle of the run's list
    stop = next((k for k, v in enumerate(mine) if v < 0 or v == bad), len(mine))
    assert i == stop and out[:i] == [v * 2 for v in mine[:i]]
    if stop == len(mine):
        assert exc is None and out == [v * 2 for v in mine]
    else:
        assert (exc is None) == (mine[stop] < 0)
    with pytest.raises(TypeError):
        map_run(fn, values)  # type: ignore[arg-type]


@given(runs())
def test_a_batch_made_of_a_run_shows_its_records_and_pickles_like_one_of_records(
    drawn: Any,
) -> None:
    run, expected = drawn
    batch = make_batch(run, "payload")
    assert len(batch) == len(expected)
    assert seen(batch.records) == expected
    assert seen(list(batch)) == expected and batch.records is batch.records
    back = pickle.loads(pickle.dumps(make_batch(run, "payload")))
    assert seen(back.records) == expected and back.payload == "payload"


@given(st.lists(runs(), min_size=1, max_size=4), st.data())
def test_joined_runs_are_their_runs_records_one_after_another(
    drawn: list, data: st.DataObject
) -> None:
    joined = JoinedRuns([run for run, _ in drawn])
    expected = [pair for _, pairs in drawn for pair in pairs]
    assert len(joined) == len(expected) and isinstance(joined, Sequence)
    assert seen(joined.records()) == expected and seen(list(joined)) == expected
    i = data.draw(st.integers(-len(expected), len(expected) - 1))
    assert seen([joined[i]]) == [expected[i]]
    assert seen(joined[1::3]) == expected[1::3]
    assert joined.payloads == [p for _, p in expected]
    assert [len(r) for r in joined.runs] == [len(pairs) for _, pairs in drawn]
    assert seen(pickle.loads(pickle.dumps(joined))) == expected
    batch = make_batch(joined, "payload")
    assert len(batch) == len(expected) and seen(batch.records) == expected
    assert seen(pickle.loads(pickle.dumps(batch)).records) == expected


def test_joined_runs_refuse_what_is_not_a_run_and_indices_out_of_range() -> None:
    run = RecordRun(0, np.zeros((2, 3), dtype=np.int64), ["a", "b"], 0, None)
    with pytest.raises(TypeError, match="item 1 must be a RecordRun"):
        JoinedRuns([run, run[0]])  # type: ignore[list-item]
    joined = JoinedRuns([run, run])
    for index in (4, -5):
        with pytest.raises(IndexError, match="of 4 joined records"):
            joined[index]
    assert len(JoinedRuns([])) == 0 and JoinedRuns([]).payloads == []
