"""Specification of the source protocol's shared argument checks (``zephon.sources.base`` and the
``zephon.validation`` helper it uses): one wording and one exception type per kind of mistake."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zephon.sources.base as base
import zephon.validation as validation
from zephon.sources import ArrowSource, JsonlSource, MixtureSource, RangeSource


def test_check_int_lives_in_validation_and_stays_importable_from_base():
    assert base.check_int is validation.check_int


@pytest.mark.parametrize(
    ("value", "kwargs", "error", "message"),
    [
        (3, {}, None, None),
        (np.int16(3), {"minimum": 3, "maximum": 3}, None, None),
        (True, {}, TypeError, r"^Own: n must be an int, got True$"),
        (np.True_, {}, TypeError, r"^Own: n must be an int, got np\.True_$"),
        (2.0, {}, TypeError, r"^Own: n must be an int, got 2\.0$"),
        ("3", {}, TypeError, r"^Own: n must be an int, got '3'$"),
        (2, {"minimum": 3}, ValueError, r"^Own: n must be >= 3, got 2$"),
        (4, {"maximum": 3}, ValueError, r"^Own: n must be <= 3, got 4$"),
    ],
)
def test_check_int_takes_ints_and_refuses_the_rest_with_one_wording(value, kwargs, error, message):
    if error is None:
        got = validation.check_int(value, "n", "Own", **kwargs)
        assert got == 3 and type(got) is int
    else:
        with pytest.raises(error, match=message):
            validation.check_int(value, "n", "Own", **kwargs)


def test_check_bool_takes_bools_only():
    assert validation.check_bool(np.True_, "flag", "Own") is True
    with pytest.raises(TypeError, match=r"^Own: flag must be a bool, got 1$"):
        validation.check_bool(1, "flag", "Own")


def sources(tmp_path: Path, **kwargs: Any) -> list[tuple[str, Any]]:
    (tmp_path / "a.jsonl").write_text("1\n")
    return [
        ("RangeSource", lambda: RangeSource(4, **kwargs)),
        ("JsonlSource", lambda: JsonlSource(tmp_path / "a.jsonl", **kwargs)),
        ("ArrowSource", lambda: ArrowSource(tmp_path / "a.parquet", **kwargs)),
        (
            "MixtureSource",
            lambda: MixtureSource({"a": RangeSource(4)}, {"a": 1.0}, **kwargs),
        ),
    ]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"chunk_size": 0}, ValueError, "chunk_size must be >= 1, got 0"),
        ({"chunk_size": 2.5}, TypeError, "chunk_size must be an int, got 2.5"),
        ({"seed": "x"}, TypeError, "seed must be an int, got 'x'"),
    ],
)
def test_every_source_words_a_bad_integer_argument_the_same_way(tmp_path, kwargs, error, message):
    for name, make in sources(tmp_path, **kwargs):
        with pytest.raises(error) as info:
            make()
        assert str(info.value) == f"{name}: {message}"


def test_chunk_positions_and_sample_ranges_must_be_ints(tmp_path):
    src = RangeSource(10, chunk_size=4)
    with pytest.raises(TypeError, match="chunk position must be an int, got True"):
        src.chunk(True)
    with pytest.raises(ValueError, match="chunk position must be >= 0, got -1"):
        src.chunk(-1)
    with pytest.raises(TypeError, match=r"start must be an int, got 1\.5"):
        src.samples(0, 1.5, 3)  # type: ignore[arg-type]
    with pytest.raises(IndexError, match="pass 1 does not exist"):
        src.samples(1, 0, 3)
    assert src.samples(np.int64(0), np.int32(1), 3).tolist() == [1, 2]
