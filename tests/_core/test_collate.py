"""The compiled default-collate loop against the rule written out in Python."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon._core.collate import UNDECIDED, collate_dicts, collate_run
from zephon.ops.batching import _column, collate_by_rule, collate_payloads, default_collate
from zephon.types import RecordRun


class Subclassed(dict):
    """A dict subclass: the compiled loop leaves it to the rule."""


def same(a: Any, b: Any) -> bool:
    """Equal results of the same types (arrays: same dtype, shape and values)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return (
            a.dtype.str == b.dtype.str
            and a.shape == b.shape
            and a.flags.c_contiguous == b.flags.c_contiguous
            and a.tobytes() == b.tobytes()
            and (not np.ma.isMaskedArray(a) or a.mask.tolist() == b.mask.tolist())
        )
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(x is y or same(x, y) for x, y in zip(a, b))
    return bool(a == b) or (a != a and b != b)


def outcome(fn: Any, payloads: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(payloads)
    except Exception as exc:
        return type(exc).__name__, str(exc)


values = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-5, max_value=5),
    st.floats(allow_nan=True),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
    st.sampled_from([np.int32(3), np.float32(1.5), np.bool_(True), np.str_("s")]),
    st.integers(0, 3).map(lambda n: np.arange(n, dtype=np.int64)),
    st.integers(0, 2).map(lambda n: np.zeros(n, dtype=np.float32)),
    st.sampled_from(["<i4", ">i4", "U2", "O", "?", "M8[s]"]).map(lambda d: np.zeros((2, 2), d)),
    st.just(np.arange(8, dtype=np.int16).reshape(2, 4)[:, ::2]),  # not contiguous, shape (2, 2)
    st.just(np.ones((2, 2), np.int16).T),  # Fortran order
    st.just(np.asarray(5.0)),  # 0-d
    st.just(np.ma.masked_array([1, 2], mask=[False, True])),  # a subclass
)
# Equal keys that are different objects (str built at run time), ints equal to floats and bools.
keys = st.sampled_from(["a", "b", "".join(["a"]), "".join(["b", ""]), 1, 1.0, True, 2])


@st.composite
def payload(draw: Any) -> Any:
    ks = draw(st.lists(keys, max_size=3))
    d = {k: draw(values) for k in ks}
    kind = draw(st.sampled_from(["dict"] * 8 + ["sub", "list", "int"]))
    if kind == "sub":
        return Subclassed(d)
    if kind == "list":
        return list(d.values())
    return 7 if kind == "int" else d


@st.composite
def batches(draw: Any) -> list[Any]:
    """Payloads that mostly share keys and value types, so that columns do get built."""
    shared = draw(st.booleans())
    if not shared:
        return draw(st.lists(payload(), max_size=6))
    ks = draw(st.lists(keys, min_size=1, max_size=3, unique=True))
    kinds = {k: draw(values) for k in ks}
    n = draw(st.integers(1, 6))
    out = []
    for _ in range(n):
        row = {k: draw(st.just(kinds[k]) | values) if draw(st.booleans()) else kinds[k] for k in ks}
        out.append(row)
    return out


@settings(max_examples=400, deadline=None)
@given(batches())
def test_compiled_collate_matches_the_rule(payloads):
    got, want = outcome(collate_payloads, payloads), outcome(collate_by_rule, payloads)
    assert got[0] == want[0]
    if got[0] == "ok":
        assert same(got[1], want[1]), (got, want)
    else:
        assert got[1] == want[1]


def test_ints_columns_int64_floats_float64_bools_bool():
    out = collate_payloads([{"i": 1, "f": 0.5, "b": True}, {"i": -2, "f": 2.0, "b": False}])
    assert out["i"].dtype == np.int64 and out["i"].tolist() == [1, -2]
    assert out["f"].dtype == np.float64 and out["f"].tolist() == [0.5, 2.0]
    assert out["b"].dtype == np.bool_ and out["b"].tolist() == [True, False]


def test_equal_keys_that_are_different_strings_still_make_columns():
    key = "".join(["to", "kens"])
    assert key is not "tokens"  # noqa: F632 - built at run time on purpose
    out = collate_payloads([{"tokens": 1}, {key: 2}])
    assert isinstance(out, dict) and out["tokens"].tolist() == [1, 2]


def test_an_int_outside_int64_names_the_field():
    with pytest.raises(OverflowError, match="field 'h'"):
        collate_payloads([{"h": 1}, {"h": 2**63}])


def test_a_list_that_is_not_dicts_is_left_to_the_rule_and_kept():
    payloads = [1, 2]
    assert collate_dicts(payloads, _column) is UNDECIDED
    assert collate_payloads(payloads) is payloads


def test_bad_input_raises_type_error():
    with pytest.raises(TypeError):
        collate_dicts((1, 2), _column)  # type: ignore[arg-type]


def test_int64_bounds_fill_the_column_and_one_past_names_the_field():
    low, high = -(2**63), 2**63 - 1
    out = collate_payloads([{"a": 0.5, "b": low}, {"a": 1.5, "b": high}])
    assert out["b"].dtype == np.int64 and out["b"].tolist() == [low, high]
    assert out["a"].tolist() == [0.5, 1.5]
    # Past the bound in a later row and a later column: the error still names the field.
    with pytest.raises(OverflowError, match="field 'b'"):
        collate_payloads([{"a": 1, "b": 1}, {"a": 2, "b": low - 1}])


def test_a_row_whose_value_changes_type_leaves_the_column_a_list():
    out = collate_payloads([{"a": 1, "b": 2}, {"a": 3, "b": 4.0}])
    assert out["a"].dtype == np.int64 and out["b"] == [2, 4.0]


def test_a_key_whose_hash_mutates_the_batch_does_not_crash_the_compiled_loop():
    payloads: list[Any] = []

    class Hostile:
        def __hash__(self) -> int:
            payloads.clear()  # drops every dict the loop is reading
            return 1

        def __eq__(self, other: object) -> bool:
            payloads.clear()
            return self is other

    key = Hostile()
    for _ in range(50):  # a read of freed memory need not fail the first time
        payloads[:] = [{"a": 1, key: 2} for _ in range(32)]
        collate_dicts(payloads, _column)  # the batch's only references are in the list
        assert payloads == []


def test_a_subclass_row_after_a_plain_array_is_stacked_by_numpy():
    plain = np.arange(2, dtype=np.int64)
    masked = np.ma.masked_array(np.arange(2, dtype=np.int64), mask=[False, True])
    payloads = [{"a": plain}, {"a": masked}]
    got, want = collate_payloads(payloads), collate_by_rule(payloads)
    assert same(got, want), (got, want)


@settings(max_examples=300, deadline=None)
@given(batches(), st.lists(payload(), max_size=3), st.lists(payload(), max_size=3))
def test_a_part_of_a_run_collates_as_its_payloads_do(
    payloads: list[Any], before: list[Any], after: list[Any]
) -> None:
    # The part's payloads sit in the middle of the run's list: read there, not copied first.
    whole = [*before, *payloads, *after]
    pointers = np.zeros((len(whole), 3), dtype=np.int64)
    part = RecordRun(0, pointers, whole, 0, None)
    if payloads and before:
        part = part.split(len(before))[1]
    if payloads and after:
        part = part.split(len(payloads))[0]
    if not payloads:
        part = RecordRun(0, pointers[:0], [], 0, None)
    assert part.payloads == payloads
    got, want = outcome(default_collate, part), outcome(collate_by_rule, payloads)
    assert got[0] == want[0]
    assert same(got[1], want[1]) if got[0] == "ok" else got[1] == want[1], (got, want)
    kernel = outcome(lambda p: collate_run(p, _column), part)  # or it leaves the batch to the rule
    assert kernel == ("ok", UNDECIDED) or kernel[0] == want[0]


def test_a_run_whose_payloads_stay_a_list_gives_a_list_of_them():
    payloads: list[Any] = [{"a": 1}, {"b": 2}, 3]
    run = RecordRun(0, np.zeros((3, 3), dtype=np.int64), payloads, 0, None)
    assert collate_run(run.split(2)[0], _column) == payloads[:2]
    assert collate_run(run, _column) is UNDECIDED  # not all dicts: the rule decides


def packed_rows(n: int) -> list[np.ndarray]:
    """The token rows of ``n`` packed records, in the order a packer emitted them (each input
    fills a row of its own)."""
    from zephon.ops import pack_sequences
    from zephon.types import SampleCursor, SampleMeta, SampleRecord

    inputs = [
        SampleRecord(SampleMeta(SampleCursor(0, i, (0, 0, i))), {"tokens": np.full(6, i, np.int32)})
        for i in range(n)
    ]
    return [rec.payload["tokens"] for rec in pack_sequences(6, pad_id=-1).process_many(inputs)]


def test_rows_a_packer_handed_over_back_to_back_collate_into_a_view_of_them() -> None:
    rows = packed_rows(5)
    (out,) = collate_dicts([{"t": r} for r in rows], _column).values()
    assert same(out, np.stack(rows))
    assert np.shares_memory(out, rows[0]) and out.flags.writeable and out.flags.c_contiguous


@pytest.mark.parametrize(
    "pick",
    [
        pytest.param(lambda rows: rows[::-1], id="reversed"),
        pytest.param(lambda rows: [rows[0], rows[2]], id="a-gap"),
        pytest.param(lambda rows: [rows[0], rows[1][:-1]], id="not-a-whole-row"),
        pytest.param(lambda rows: [rows[0], rows[1].copy()], id="one-a-copy"),
        pytest.param(lambda rows: [np.asarray(r).view() for r in rows], id="views-of-views"),
    ],
)
def test_rows_not_back_to_back_in_one_arena_are_copied(pick: Any) -> None:
    values = pick(packed_rows(4))
    out = collate_payloads([{"t": v} for v in values])["t"]
    if all(v.shape == values[0].shape for v in values):
        assert same(out, np.stack(values))
        assert not any(np.shares_memory(out, v) for v in values)


def test_consecutive_views_of_a_users_array_are_copied() -> None:
    # Nothing says a user's array will not change after the batch: only a packer's arena is used.
    data = np.arange(12, dtype=np.int32).reshape(3, 4)
    out = collate_payloads([{"t": row} for row in data])["t"]
    assert same(out, data.copy()) and not np.shares_memory(out, data)


def test_read_only_rows_are_copied_into_a_writeable_batch() -> None:
    rows = packed_rows(3)
    for r in rows:
        r.flags.writeable = False
    out = collate_payloads([{"t": r} for r in rows])["t"]
    assert out.flags.writeable and not np.shares_memory(out, rows[0])
