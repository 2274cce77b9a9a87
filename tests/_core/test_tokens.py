"""The compiled token-id conversion against the rule written out in Python."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon._core.records import counted_meta
from zephon._core.tokens import UNDECIDED, document_views, int32_ids, tokenized_records
from zephon.types import ContributorRef, SampleCursor, SampleMeta, SampleRecord

ID_LIMIT = 2**31


def reference(ids: list[int], eos: int | None, limit: int | None) -> np.ndarray:
    """Every id checked, the eos appended, then the cut: the rule, one step at a time."""
    for i, value in enumerate(ids):
        if not 0 <= value < ID_LIMIT:
            raise ValueError(f"token ids include {value} (at {i}), outside [0, 2**31)")
    out = ids + ([] if eos is None else [eos])
    if limit is not None:
        out = out[:limit]
    return np.array(out, dtype=np.int32)


good_ids = st.lists(st.integers(0, ID_LIMIT - 1), max_size=40)
any_ids = st.lists(
    st.one_of(
        st.integers(0, 50),
        st.sampled_from([-1, -(2**30), 2**30 - 1, 2**30, ID_LIMIT, ID_LIMIT - 1, 2**64]),
    ),
    max_size=20,
)
eos_ids = st.one_of(st.none(), st.integers(0, ID_LIMIT - 1))
limits = st.one_of(st.none(), st.integers(0, 45))


@given(good_ids, eos_ids, limits)
def test_ids_are_converted_as_the_rule_says(ids, eos, limit):
    got = int32_ids(ids, eos, limit)
    want = reference(ids, eos, limit)
    assert got.dtype == np.int32 and got.flags.c_contiguous and got.flags.writeable
    assert got.base is None  # a new array of its own
    np.testing.assert_array_equal(got, want)


@given(any_ids, eos_ids, limits)
def test_an_id_outside_int32_fails_like_the_rule_even_when_the_cut_leaves_it_out(ids, eos, limit):
    try:
        want: Any = reference(ids, eos, limit)
    except ValueError as exc:
        with pytest.raises(ValueError) as got:
            int32_ids(ids, eos, limit)
        assert str(got.value) == str(exc)  # the first bad id, and where it is
        return
    np.testing.assert_array_equal(int32_ids(ids, eos, limit), want)


@pytest.mark.parametrize("item", [True, np.int64(3), 3.0, "3", None])
def test_a_list_holding_anything_but_exact_ints_is_left_to_the_general_path(item):
    assert int32_ids([1, item, 2], 0, None) is UNDECIDED


@pytest.mark.parametrize(
    ("eos", "limit", "error"),
    [
        (-1, None, ValueError),
        (ID_LIMIT, None, ValueError),
        (0, -1, ValueError),
        ("0", None, TypeError),
    ],
)
def test_a_bad_eos_or_limit_is_refused(eos, limit, error):
    with pytest.raises(error):
        int32_ids([1, 2], eos, limit)


def test_only_a_list_is_taken():
    with pytest.raises(TypeError):
        int32_ids((1, 2), None, None)  # type: ignore[arg-type]


# ------------------------------------------------------------------- records of one tokenizer call
class Encoding:
    """What a Hugging Face tokenizer returns per text: an object whose ``ids`` is a list."""

    def __init__(self, ids: Any):
        self.ids = ids


def counted_reference(meta: SampleMeta, n_tokens: int) -> SampleMeta:
    """The meta a tokenized record carries: its own, heading one sample of its component."""
    comp = meta.component
    return SampleMeta(
        meta.cursor,
        lane_id=meta.lane_id,
        contributors=meta.contributors,
        tags=meta.tags,
        component=comp,
        component_sample_counts={comp: 1},
        component_token_counts={comp: n_tokens},
    )


def records_reference(
    records: list[SampleRecord], encoded: list[Any], field: str, eos: int | None, limit: int | None
) -> list[SampleRecord]:
    """Record by record until the first one left to the general path: ids that are not a list
    of exact ints in range, or a payload that is not a dict."""
    out = []
    for rec, result in zip(records, encoded, strict=True):
        if type(rec.payload) is not dict:
            break
        if type(result) is np.ndarray:
            if not taken_as_is(result):
                break
            ids = result.tolist()
        else:
            ids = result if type(result) is list else getattr(result, "ids", None)
            if type(ids) is not list:
                break
        if any(type(i) is not int or not 0 <= i < ID_LIMIT for i in ids):
            break
        tokens = reference(ids, eos, limit)
        out.append(
            SampleRecord(counted_reference(rec.meta, len(tokens)), {**rec.payload, field: tokens})
        )
    return out


def taken_as_is(ids: np.ndarray) -> bool:
    """An array the compiled pass converts itself: 1-D, C-contiguous, aligned, native int32 or
    int64."""
    native = ids.dtype.byteorder in "=|"
    return (
        ids.ndim == 1
        and ids.flags.c_contiguous
        and ids.flags.aligned
        and native
        and ids.dtype.type in (np.int32, np.int64)
    )


def a_record(i: int, component: Any, payload: Any, tags: frozenset[str]) -> SampleRecord:
    cursor = SampleCursor(7, i, (0, 3, 100 + i))
    parent = ContributorRef(SampleCursor(6, i, (0, 3, 100 + i)), True)
    meta = SampleMeta(
        cursor,
        lane_id=2,
        contributors=(parent,) if i % 2 else None,
        tags=tags,
        component=component,
        component_sample_counts={"stale": 9},
        component_token_counts={"stale": 9},
    )
    return SampleRecord(meta, payload)


array_values = st.lists(st.sampled_from([0, 1, 255, 2**31 - 1, -1, 2**31]), max_size=12)
array_kinds = st.sampled_from(
    [
        np.dtype(np.int32),
        np.dtype(np.int64),
        np.dtype(np.uint8),
        np.dtype(np.uint32),
        np.dtype(">i4"),
        np.dtype(np.float32),
    ]
)


def as_array(values: list[int], dtype: np.dtype, layout: str) -> np.ndarray:
    """``values`` (cast where they fit, wrapped where they do not) as an array: flat, every
    second item of a longer one (not contiguous), or a column."""
    if layout == "strided":
        return np.repeat(np.array(values).astype(dtype), 2)[::2]
    arr = np.array(values).astype(dtype)
    return arr.reshape(-1, 1) if layout == "column" else arr


odd_ids = st.one_of(
    good_ids,
    any_ids,
    st.builds(as_array, array_values, array_kinds, st.sampled_from(["flat", "strided", "column"])),
    st.just((1, 2)),
    st.just([1, np.int64(2)]),
    st.just([True]),
)
results = st.tuples(odd_ids, st.booleans()).map(lambda t: Encoding(t[0]) if t[1] else t[0])
payloads: st.SearchStrategy[Any] = st.one_of(
    st.just({"text": "abc", "n": 1}),
    st.just({"tokens": "old", "text": "x"}),  # the output field exists already: it is replaced
    st.just({}),
    st.just(("text",)),
    st.none(),
)
calls = st.lists(
    st.tuples(results, payloads, st.sampled_from([None, "web", 3]), st.sampled_from(["", "ab"])),
    max_size=12,
)


@given(calls, eos_ids, limits)
def test_a_calls_records_are_made_as_the_rule_says_up_to_the_first_irregular_one(call, eos, limit):
    records = [
        a_record(i, comp, payload, frozenset(tags))
        for i, (_, payload, comp, tags) in enumerate(call)
    ]
    encoded = [result for result, *_ in call]
    want = records_reference(records, encoded, "tokens", eos, limit)
    got = tokenized_records(records, encoded, "tokens", eos, limit)
    assert len(got) == len(want)
    for g, w, source in zip(got, want, records):
        assert g.meta == w.meta
        assert list(g.payload) == list(w.payload)  # the keys in the same order
        assert {k: v for k, v in g.payload.items() if k != "tokens"} == {
            k: v for k, v in w.payload.items() if k != "tokens"
        }
        np.testing.assert_array_equal(g.payload["tokens"], w.payload["tokens"])
        assert g.payload["tokens"].dtype == np.int32
        assert g.payload is not source.payload  # the record read keeps its own payload


@pytest.mark.parametrize("layout", ["flat", "strided", "column"])
@pytest.mark.parametrize("dtype", ["int32", "int64", "uint8", "uint32", ">i4", "<i8", "float32"])
@settings(max_examples=30)  # each of the 21 layouts and kinds
@given(values=array_values)
def test_arrays_are_taken_as_is_only_when_flat_native_int32_or_int64_in_range(
    layout, dtype, values
):
    # The array, then a list the pass always takes: where the pass stops shows up as a count.
    ids = [as_array(values, np.dtype(dtype), layout), [5, 6]]
    records = [a_record(i, "web", {"text": "x"}, frozenset()) for i in range(2)]
    want = records_reference(records, ids, "tokens", 0, None)
    got = tokenized_records(records, ids, "tokens", 0, None)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.meta == w.meta
        np.testing.assert_array_equal(g.payload["tokens"], w.payload["tokens"])
        assert g.payload["tokens"].dtype == np.int32 and g.payload["tokens"].base is None


def test_a_call_with_fewer_results_than_records_is_refused():
    records = [a_record(i, None, {"text": "a"}, frozenset()) for i in range(3)]
    with pytest.raises(ValueError, match="2 results for 3 records"):
        tokenized_records(records, [[1], [2]], "tokens", None, None)


@pytest.mark.parametrize(
    ("eos", "limit", "error"), [(-1, None, ValueError), (0, -1, ValueError), ("0", None, TypeError)]
)
def test_a_bad_eos_or_limit_is_refused_for_a_whole_call(eos, limit, error):
    records = [a_record(0, None, {"text": "a"}, frozenset())]
    with pytest.raises(error):
        tokenized_records(records, [[1]], "tokens", eos, limit)


def test_anything_but_records_is_refused():
    with pytest.raises(TypeError):
        tokenized_records([{"text": "a"}], [[1]], "tokens", None, None)  # type: ignore[list-item]


@given(st.sampled_from([None, "web", 3]), st.integers(0, 10**6))
def test_the_counted_meta_is_the_one_the_constructor_builds(component, n):
    meta = a_record(1, component, {}, frozenset({"t"})).meta
    assert counted_meta(meta, n) == counted_reference(meta, n)


# --- document_views: a block of neighbouring documents cut into one payload per document -------


@st.composite
def cuts(draw: st.DrawFn) -> tuple[np.ndarray, list[int], list[int], list[int], int]:
    """A block, spans inside it (any order, overlapping or not), where each goes in a list."""
    dtype = draw(st.sampled_from([np.int32, np.int64, np.uint16]))
    block = np.arange(draw(st.integers(0, 40)), dtype=dtype)
    n = draw(st.integers(0, 8))
    starts = draw(st.lists(st.integers(0, len(block)), min_size=n, max_size=n))
    lengths = [draw(st.integers(0, len(block) - s)) for s in starts]
    slots = n + draw(st.integers(0, 3))
    positions = draw(st.permutations(range(slots)))[:n]
    return block, positions, starts, lengths, slots


@given(cuts(), st.booleans())
def test_each_document_is_the_views_slice_of_the_block(drawn: Any, read_only: bool) -> None:
    block, positions, starts, lengths, slots = drawn
    block.flags.writeable = not read_only
    out: list[Any] = [None] * slots
    i64 = np.int64
    document_views(out, np.array(positions, i64), block, np.array(starts, i64),
                   np.array(lengths, i64), "tokens")  # fmt: skip
    expected: list[Any] = [None] * slots
    for p, s, n in zip(positions, starts, lengths, strict=True):
        expected[p] = {"tokens": block[s : s + n]}
    for got, want in zip(out, expected, strict=True):
        if want is None:
            assert got is None
            continue
        assert list(got) == ["tokens"]
        view = got["tokens"]
        assert view.dtype == block.dtype and view.tolist() == want["tokens"].tolist()
        assert view.base is block and view.flags.writeable == (not read_only)
        if view.size:
            assert np.shares_memory(view, block)


def test_the_views_keep_the_block_alive() -> None:
    out: list[Any] = [None] * 2
    block = np.arange(6, dtype=np.int32)
    document_views(out, np.array([1, 0]), block, np.array([0, 2]), np.array([2, 4]), "t")
    del block
    np.ones(1 << 16, dtype=np.int32)  # what would reuse freed memory
    assert out[0]["t"].tolist() == [2, 3, 4, 5] and out[1]["t"].tolist() == [0, 1]


@pytest.mark.parametrize(
    ("positions", "starts", "lengths", "error"),
    [
        ([0], [4], [3], "document 0 spans 4..7 outside a block of 6"),
        ([0], [-1], [1], "outside a block of 6"),
        ([0], [0], [-1], "outside a block of 6"),
        ([2], [0], [1], "position 2 outside a list of 2"),
        ([0, 1], [0], [1, 1], "2 positions, 1 starts and 2 lengths"),
    ],
)
def test_a_span_or_position_out_of_range_places_nothing(positions, starts, lengths, error):
    out: list[Any] = [None, None]
    block = np.arange(6, dtype=np.int32)
    with pytest.raises(ValueError, match=error):
        document_views(out, np.array(positions), block, np.array(starts), np.array(lengths), "t")
    assert out == [None, None]


@pytest.mark.parametrize(
    "block", [np.zeros((2, 3), np.int32), np.arange(8, dtype=np.int32)[::2], np.zeros(3, ">i4")]
)
def test_only_a_flat_contiguous_native_block_is_cut(block: np.ndarray) -> None:
    with pytest.raises(ValueError, match="1-D C-contiguous array of a native dtype"):
        document_views([None], np.array([0]), block, np.array([0]), np.array([1]), "t")
