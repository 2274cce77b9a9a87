"""An operator's error, and a skipped record's report, name the file its sample came from and
the sample's place in that file, so that a user can find the bad sample in their data."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import zephon
from zephon.errors import OperatorError
from zephon.ops import batch, fetch, map_transform
from zephon.sources import JsonlSource, MixtureSource
from zephon.sources.arrow import ArrowSource
from zephon.sources.memory import RangeSource
from zephon.types import SampleCursor

KINDS = ["inline", "thread", "process"]


def parquet_files(root: Path) -> str:
    """Three files of 10 rows, ``x`` 0..29 in order."""
    for k in range(3):
        table = pa.table({"x": list(range(10 * k, 10 * k + 10))})
        pq.write_table(table, root / f"part-{k}.parquet", row_group_size=4)
    return str(root)


def fails_on_23(payload: dict[str, Any]) -> dict[str, Any]:
    if payload["x"] == 23:
        raise ValueError("x is 23")
    return payload


@pytest.mark.parametrize("workers", KINDS)
def test_an_operator_error_names_the_file_and_the_samples_place_in_it(tmp_path, workers):
    source = ArrowSource(parquet_files(tmp_path))
    pipeline = zephon.Pipeline(
        source, [fetch(), map_transform(fails_on_23), batch(4)], lanes=2, workers=workers
    )
    with pytest.raises(OperatorError) as info:
        list(pipeline)
    assert info.value.context["file"].endswith("part-2.parquet")  # x 20..29
    assert info.value.context["sample_in_file"] == 3
    assert "part-2.parquet', sample_in_file 3" in str(info.value)


def test_a_mixture_names_the_component_and_its_file(tmp_path):
    lines = tmp_path / "lines"
    lines.mkdir()
    (lines / "a.jsonl").write_text("".join(f'{{"x": {100 + i}}}\n' for i in range(40)))
    source = MixtureSource(
        {
            "parquet": ArrowSource(parquet_files(tmp_path)),
            "lines": JsonlSource(str(lines), dataset_id=1),
        },
        {"parquet": 0.5, "lines": 0.5},
    )
    pipeline = zephon.Pipeline(source, [fetch(), map_transform(fails_on_23)])
    with pytest.raises(OperatorError) as info:
        list(pipeline)
    context = info.value.context
    assert context["component"] == "parquet"
    assert context["file"].endswith("part-2.parquet") and context["sample_in_file"] == 3


def test_a_source_without_files_names_none(tmp_path):
    def fails_on_5(payload: dict[str, Any]) -> dict[str, Any]:
        if payload["idx"] == 5:
            raise ValueError("5")
        return payload

    pipeline = zephon.Pipeline(RangeSource(10, chunk_size=4), [fetch(), map_transform(fails_on_5)])
    with pytest.raises(OperatorError) as info:
        list(pipeline)
    cursor = info.value.cursor
    assert isinstance(cursor, SampleCursor) and cursor.sample_id[2] == 5
    assert "file" not in info.value.context


@pytest.mark.parametrize("workers", ["inline", "process"])
def test_a_skipped_records_report_names_its_file(tmp_path, workers, caplog):
    source = ArrowSource(parquet_files(tmp_path))
    pipeline = zephon.Pipeline(
        source,
        [fetch(), map_transform(fails_on_23), batch(4)],
        lanes=2,
        workers=workers,
        on_error="skip",
    )
    with caplog.at_level(logging.WARNING, logger="zephon"), pipeline.iter() as loader:
        delivered = [x for b in loader for x in b.payload["x"]]
        (report,) = loader.skipped()
    assert sorted(delivered) == [x for x in range(30) if x != 23]
    assert report["file"].endswith("part-2.parquet") and report["sample_in_file"] == 3
    assert "part-2.parquet', sample_in_file 3" in caplog.text
