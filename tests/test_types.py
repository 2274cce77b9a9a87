"""WorkChunk: a unit of work, one (dataset_id, shard_id, sample_idx) row per sample."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from zephon.types import WorkChunk


def test_work_chunk_holds_its_position_and_int64_pointer_rows():
    pointers = np.array([[0, 5, 42], [0, 5, 43]], dtype=np.int64)
    chunk = WorkChunk(3, pointers)
    assert chunk.position == 3
    assert chunk.pointers.dtype == np.int64
    assert chunk.pointers.shape == (2, 3)
    np.testing.assert_array_equal(chunk.pointers, pointers)
    assert len(chunk) == 2


def test_other_integer_dtypes_and_nested_lists_become_int64():
    for pointers in (np.array([[1, 2, 3]], dtype=np.int32), np.array([[1, 2, 3]], np.uint16)):
        chunk = WorkChunk(0, pointers)
        assert chunk.pointers.dtype == np.int64
        np.testing.assert_array_equal(chunk.pointers, [[1, 2, 3]])
    from_list = WorkChunk(0, [[1, 2, 3], [4, 5, 6]])  # type: ignore[arg-type]
    assert from_list.pointers.dtype == np.int64 and len(from_list) == 2


def test_an_empty_chunk_has_length_zero():
    chunk = WorkChunk(0, np.zeros((0, 3), dtype=np.int64))
    assert len(chunk) == 0
    assert chunk.pointers.shape == (0, 3)


@pytest.mark.parametrize("shape", [(3,), (2, 2), (2, 4), (1, 3, 1), (0,)])
def test_pointers_of_the_wrong_shape_are_rejected(shape: tuple[int, ...]):
    with pytest.raises(ValueError, match="shape"):
        WorkChunk(0, np.zeros(shape, dtype=np.int64))


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.bool_, np.str_, object])
def test_pointers_that_are_not_integers_are_rejected(dtype: Any):
    with pytest.raises(TypeError, match="integers"):
        WorkChunk(0, np.ones((2, 3), dtype=dtype))


@pytest.mark.parametrize("position", [-1, -100])
def test_a_negative_position_is_rejected(position: int):
    with pytest.raises(ValueError, match="position"):
        WorkChunk(position, np.zeros((1, 3), dtype=np.int64))


@pytest.mark.parametrize("position", [1.5, "1", None])
def test_a_position_that_is_not_an_int_is_rejected(position: Any):
    with pytest.raises(TypeError, match="position"):
        WorkChunk(position, np.zeros((1, 3), dtype=np.int64))


def test_position_is_a_plain_int():
    chunk = WorkChunk(np.int64(4), np.zeros((1, 3), dtype=np.int64))
    assert chunk.position == 4 and type(chunk.position) is int


def test_chunks_are_equal_when_position_and_pointers_are_equal():
    pointers = np.array([[0, 5, 42]], dtype=np.int64)
    assert WorkChunk(1, pointers) == WorkChunk(1, pointers.copy())
    assert WorkChunk(1, pointers) == WorkChunk(1, pointers.astype(np.int32))
    assert WorkChunk(1, pointers) != WorkChunk(2, pointers)
    assert WorkChunk(1, pointers) != WorkChunk(1, pointers + 1)
    assert WorkChunk(1, pointers) != WorkChunk(1, np.zeros((0, 3), dtype=np.int64))
    assert WorkChunk(1, pointers) != (1, pointers)


def test_chunks_are_not_hashable_because_their_array_is_mutable():
    with pytest.raises(TypeError):
        hash(WorkChunk(0, np.zeros((1, 3), dtype=np.int64)))


def test_chunk_repr_names_its_position_and_size():
    chunk = WorkChunk(5, np.zeros((4, 3), dtype=np.int64))
    assert repr(chunk) == "WorkChunk(position=5, 4 samples)"
