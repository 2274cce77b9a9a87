"""HFDatasetSource refuses what is not one split of a ``datasets.Dataset``, saying what to pass."""

from __future__ import annotations

from typing import Any

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


def saved(tmp_path) -> Any:
    rows = datasets.Dataset.from_dict({"a": [0, 1, 2], "b": ["r0", "r1", "r2"]})
    rows.save_to_disk(str(tmp_path / "saved"))
    return datasets.load_from_disk(str(tmp_path / "saved"))


def test_columns_renamed_or_added_in_memory_are_refused_saying_to_save_the_dataset(tmp_path):
    # rename_columns, add_column and a concatenation of columns change the dataset's columns in
    # memory only: its cache files keep the old ones, so reading them would give the values under
    # other names (a swap), or each file's rows as rows of their own.
    ds = saved(tmp_path)
    datasets.Dataset.from_dict({"d": [4, 5, 6]}).save_to_disk(str(tmp_path / "other"))
    other = datasets.load_from_disk(str(tmp_path / "other"))
    swapped = ds.rename_columns({"a": "b", "b": "a"})
    assert swapped[0] == {"b": 0, "a": "r0"}
    for changed, how in (
        (swapped, "rename_columns"),
        (ds.add_column("c", [7, 8, 9]), "in memory"),
        (datasets.concatenate_datasets([ds.select_columns(["a"]), other], axis=1), "axis=1"),
    ):
        with pytest.raises(ValueError, match=rf"{how}.*save_to_disk"):
            HFDatasetSource(changed)


def test_columns_removed_or_selected_in_memory_read_the_columns_left(tmp_path):
    ds = saved(tmp_path)
    for kept in (ds.remove_columns(["a"]), ds.select_columns(["b"])):
        src = HFDatasetSource(kept)
        assert src.read(src.chunk(0).pointers) == [{"b": "r0"}, {"b": "r1"}, {"b": "r2"}]
