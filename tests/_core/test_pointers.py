"""The compiled pointer rows, made and checked, against the rules written out in Python."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from zephon._core.pointers import (
    first_foreign_row,
    index_range,
    index_rows,
    own_sample_indices,
    own_samples,
)


def reference(rows: np.ndarray, dataset_id: int, num_samples: int) -> int:
    """The first row naming another dataset or a sample outside ``[0, num_samples)``, else -1."""
    for i, (ds, _shard, idx) in enumerate(rows.tolist()):
        if ds != dataset_id or not 0 <= idx < num_samples:
            return i
    return -1


# Mostly rows of dataset 1 with samples near [0, 10), so that both outcomes are common.
values = st.one_of(st.integers(-2, 12), st.sampled_from([-(2**63), 2**63 - 1]))
row_arrays = hnp.arrays(np.int64, st.tuples(st.integers(0, 40), st.just(3)), elements=values)


@given(row_arrays, st.integers(-1, 2), st.integers(0, 11))
def test_the_first_foreign_row_is_the_one_the_rule_names(rows, dataset_id, num_samples):
    assert first_foreign_row(rows, dataset_id, num_samples) == reference(
        rows, dataset_id, num_samples
    )


@given(row_arrays, st.integers(0, 12))
def test_a_strided_view_is_read_as_the_rows_it_shows(rows, num_samples):
    every_other = rows[::2]
    assert first_foreign_row(every_other, 1, num_samples) == reference(every_other, 1, num_samples)


def test_rows_of_another_width_or_dtype_are_refused():
    with pytest.raises(ValueError, match="3 columns"):
        first_foreign_row(np.zeros((2, 4), dtype=np.int64), 0, 5)
    with pytest.raises(ValueError, match="mismatch"):
        first_foreign_row(np.zeros((2, 3), dtype=np.int32), 0, 5)
    with pytest.raises(ValueError):
        first_foreign_row(np.zeros(3, dtype=np.int64), 0, 5)


def reference_indices(rows: np.ndarray, dataset_id: int, num_samples: int) -> list[int] | int:
    """The sample indices as ints when every row is the source's, else the first foreign row."""
    bad = reference(rows, dataset_id, num_samples)
    return [idx for _ds, _shard, idx in rows.tolist()] if bad < 0 else bad


@given(row_arrays, st.integers(-1, 2), st.integers(0, 11), st.booleans())
def test_own_sample_indices_are_the_column_or_the_first_foreign_row(
    rows, dataset_id, num_samples, strided
):
    rows = rows[::2] if strided else rows
    got = own_sample_indices(rows, dataset_id, num_samples)
    assert got == reference_indices(rows, dataset_id, num_samples)
    assert isinstance(got, int) or all(type(i) is int for i in got)


@given(row_arrays, st.integers(-1, 2), st.integers(0, 11), st.sampled_from(["idx", "", "é"]))
def test_own_sample_indices_with_a_key_are_one_dict_per_index(rows, dataset_id, num_samples, key):
    got = own_sample_indices(rows, dataset_id, num_samples, key)
    expected = reference_indices(rows, dataset_id, num_samples)
    if isinstance(expected, int):
        assert got == expected
        return
    assert got == [{key: idx} for idx in expected]
    assert all(type(p) is dict and type(p[key]) is int for p in got)
    assert len({id(p) for p in got}) == len(got)  # a dict of its own each, free to change


@given(row_arrays, st.integers(-1, 2), st.integers(0, 11), st.booleans())
def test_own_samples_are_the_items_the_indices_name(rows, dataset_id, num_samples, strided):
    rows = rows[::2] if strided else rows
    items = [object() for _ in range(num_samples)]
    got = own_samples(rows, dataset_id, num_samples, items)
    expected = reference_indices(rows, dataset_id, num_samples)
    if isinstance(expected, int):
        assert got == expected
    else:
        assert type(got) is list and len(got) == len(expected)
        assert all(g is items[i] for g, i in zip(got, expected))  # the items themselves


def test_own_samples_refuse_a_list_shorter_than_the_samples():
    rows = np.array([[0, 0, 0]], dtype=np.int64)
    with pytest.raises(IndexError, match="3 samples, but the list holds 2"):
        own_samples(rows, 0, 3, ["a", "b"])
    with pytest.raises(TypeError):
        own_samples(rows, 0, 1, ("a",))  # type: ignore[arg-type]


def test_own_sample_indices_refuse_anything_but_int64_rows_of_three():
    bad: Any
    for bad in (
        np.zeros((2, 4), dtype=np.int64),
        np.zeros((2, 3), dtype=np.int32),
        np.zeros((2, 3), dtype=np.float64),
        np.zeros(3, dtype=np.int64),
        [[0, 0, 1]],
    ):
        with pytest.raises(ValueError, match="int64 array of shape"):
            own_sample_indices(bad, 0, 5)
        with pytest.raises(ValueError, match="int64 array of shape"):
            own_sample_indices(bad, 0, 5, "idx")
        with pytest.raises(ValueError, match="int64 array of shape"):
            own_samples(bad, 0, 5, [0] * 5)
    with pytest.raises(TypeError):
        own_sample_indices(np.zeros((2, 3), dtype=np.int64), 0, 5, b"idx")  # type: ignore[arg-type]


big = st.sampled_from([-(2**62), 2**62])


@given(st.integers(-50, 50) | big, st.integers(0, 300))
def test_an_index_range_is_numpys_arange(start, length):
    got = index_range(start, start + length)
    want = np.arange(start, start + length, dtype=np.int64)
    assert got.dtype == np.int64 and got.flags.writeable and np.array_equal(got, want)


def test_an_index_range_that_ends_before_it_starts_is_refused():
    assert index_range(7, 7).shape == (0,)
    with pytest.raises(ValueError, match="start <= stop"):
        index_range(8, 7)
    with pytest.raises(OverflowError):
        index_range(0, 2**63)


def reference_rows(dataset_id: int, indices: np.ndarray) -> np.ndarray:
    """One row ``(dataset_id, 0, idx)`` per index, in order."""
    return np.array([[dataset_id, 0, idx] for idx in indices.tolist()], dtype=np.int64).reshape(
        -1, 3
    )


@given(
    st.integers(-3, 3) | big,
    hnp.arrays(np.int64, st.integers(0, 60), elements=values),
    st.booleans(),
)
def test_index_rows_are_one_row_per_index(dataset_id, indices, strided):
    indices = indices[::2] if strided else indices
    got = index_rows(dataset_id, indices)
    assert got.dtype == np.int64 and got.shape == (len(indices), 3)
    assert np.array_equal(got, reference_rows(dataset_id, indices))
    assert got.flags.c_contiguous and got.flags.writeable


def test_index_rows_refuse_anything_but_one_dimension_of_int64():
    bad: Any
    for bad in (np.zeros(3, dtype=np.int32), np.zeros((2, 3), dtype=np.int64), [0, 1]):
        with pytest.raises((ValueError, TypeError)):
            index_rows(0, bad)
