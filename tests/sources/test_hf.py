"""HFDatasetSource refuses what is not one split of a ``datasets.Dataset``, saying what to pass."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from zephon.sources import HFDatasetSource

datasets = pytest.importorskip("datasets")


def test_a_dataset_dict_is_refused_naming_its_splits_and_how_to_pick_one(tmp_path):
    pq.write_table(pa.table({"text": ["a", "b", "c"]}), tmp_path / "rows.parquet")
    on_disk = datasets.Dataset.from_parquet(
        str(tmp_path / "rows.parquet"), cache_dir=str(tmp_path / "cache")
    )
    in_memory = datasets.Dataset.from_dict({"text": ["a", "b"]})
    for split in (on_disk, in_memory):
        both = datasets.DatasetDict({"train": split, "test": split})
        with pytest.raises(TypeError, match=r"DatasetDict with splits \['train', 'test'\]"):
            HFDatasetSource(both)
        with pytest.raises(TypeError, match=r"dataset\['train'\]"):
            HFDatasetSource(both)


def test_what_is_not_a_dataset_is_refused():
    with pytest.raises(TypeError, match=r"expected a datasets\.Dataset"):
        HFDatasetSource(["not", "a", "dataset"])


def test_the_split_offered_is_one_the_dict_has():
    only = datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": ["a"]})})
    with pytest.raises(TypeError, match=r"splits \['validation'\].*dataset\['validation'\]"):
        HFDatasetSource(only)
