"""``batch`` and its default collation: arrays of one shape stack, numeric and bool scalar columns
become numpy arrays, strings and mixed columns stay lists, anything that is not a dict of one key
order stays the list it was."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import zephon
from zephon.errors import OperatorError
from zephon.ops import batch, fetch
from zephon.ops.batching import collate_payloads, default_collate
from zephon.sources import RangeSource
from zephon.types import SampleCursor, SampleMeta, SampleRecord


def test_python_int_columns_collate_to_int64_arrays():
    out = collate_payloads([{"idx": 3}, {"idx": -1}, {"idx": 2**40}])
    assert isinstance(out["idx"], np.ndarray) and out["idx"].dtype == np.int64
    assert out["idx"].tolist() == [3, -1, 2**40]


def test_python_float_columns_collate_to_float64_and_bools_to_bool_arrays():
    out = collate_payloads([{"w": 0.5, "keep": True}, {"w": 2.0, "keep": False}])
    assert out["w"].dtype == np.float64 and out["w"].tolist() == [0.5, 2.0]
    assert out["keep"].dtype == np.bool_ and out["keep"].tolist() == [True, False]


def test_numpy_scalar_columns_keep_their_dtype():
    out = collate_payloads(
        [{"a": np.int32(1), "b": np.float32(0.5)}, {"a": np.int32(7), "b": np.float32(1.5)}]
    )
    assert (out["a"].dtype, out["b"].dtype) == (np.int32, np.float32)
    assert out["a"].tolist() == [1, 7] and out["b"].tolist() == [0.5, 1.5]


def test_strings_and_mixed_columns_stay_lists():
    out = collate_payloads(
        [
            {"name": "a", "mixed": 1, "num": 1, "none": None},
            {"name": "b", "mixed": 1.5, "num": True, "none": None},
        ]
    )
    assert out == {"name": ["a", "b"], "mixed": [1, 1.5], "num": [1, True], "none": [None, None]}


def test_a_column_of_ints_too_large_for_int64_is_an_error_naming_the_field():
    with pytest.raises(OverflowError, match=r"field 'h'.*int64.*collate="):
        collate_payloads([{"h": 1}, {"h": 2**64}])


def test_arrays_of_one_shape_and_dtype_stack_and_others_stay_lists():
    a, b = np.arange(3, dtype=np.int32), np.arange(3, 6, dtype=np.int32)
    out = collate_payloads([{"t": a, "r": a}, {"t": b, "r": np.arange(2, dtype=np.int32)}])
    assert out["t"].shape == (2, 3) and out["t"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert isinstance(out["r"], list) and len(out["r"]) == 2


def test_payloads_that_are_not_dicts_of_one_key_order_stay_lists():
    assert collate_payloads([1, 2]) == [1, 2]
    assert collate_payloads([{"a": 1}, {"b": 2}]) == [{"a": 1}, {"b": 2}]
    assert collate_payloads([{"a": 1, "b": 2}, {"b": 2, "a": 1}]) == [
        {"a": 1, "b": 2},
        {"b": 2, "a": 1},
    ]
    assert collate_payloads([]) == []


def test_default_collate_collates_the_records_payloads():
    recs = [
        SampleRecord(SampleMeta(SampleCursor(0, i, (0, 0, i))), {"idx": i, "name": f"s{i}"})
        for i in range(3)
    ]
    out = default_collate(recs)
    assert out["idx"].tolist() == [0, 1, 2] and out["name"] == ["s0", "s1", "s2"]
    assert default_collate(tuple(recs))["idx"].dtype == np.int64


def make(idx: int) -> dict[str, Any]:
    return {"idx": idx, "score": idx / 4, "name": f"s{idx}"}


def test_batches_delivered_by_a_pipeline_hold_numpy_columns():
    pipeline = zephon.Pipeline(RangeSource(10, make=make, chunk_size=4), [fetch(), batch(4)])
    batches = [b.payload for b in pipeline]
    assert [p["idx"].tolist() for p in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert batches[0]["score"].dtype == np.float64 and batches[0]["name"][0] == "s0"


def test_a_collate_error_names_the_batch_operator():
    pipeline = zephon.Pipeline(
        RangeSource(4, make=lambda i: {"h": 2**70 if i == 3 else i}, chunk_size=4),
        [fetch(), batch(4)],
    )
    with pytest.raises(OperatorError, match=r"'batch' failed to collate.*field 'h'"):
        list(pipeline)


def test_batch_size_must_be_at_least_one():
    # the same wording and type as every constructor argument (zephon.validation)
    with pytest.raises(ValueError, match=r"^batch: batch_size must be >= 1, got 0$"):
        batch(0)
    with pytest.raises(TypeError, match=r"^batch: batch_size must be an int, got 2\.5$"):
        batch(2.5)  # type: ignore[arg-type]


def test_the_default_collate_enters_the_fingerprint_by_name_a_passed_one_by_its_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fingerprint(collate: Any = None) -> str:
        return zephon.Pipeline(RangeSource(8), [fetch(), batch(4, collate=collate)]).fingerprint

    def mine(records: Any) -> Any:
        return default_collate(records)

    default, passed = fingerprint(), fingerprint(mine)
    # Another version of the library's collate: checkpoints taken before it still load.
    monkeypatch.setattr(default_collate, "__code__", (lambda records: list(records)).__code__)
    assert fingerprint() == default
    monkeypatch.setattr(mine, "__code__", (lambda records: list(records)).__code__)
    assert fingerprint(mine) != passed  # a function the user passes still goes by its code
