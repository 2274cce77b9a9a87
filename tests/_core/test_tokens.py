"""The compiled token-id conversion against the rule written out in Python."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zephon._core.tokens import UNDECIDED, int32_ids

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
    st.one_of(st.integers(0, 50), st.sampled_from([-1, ID_LIMIT, ID_LIMIT - 1, 2**64])),
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
