"""open_source: the right source for each layout, written by each format's own writer, and a
PlanError listing what was found for the layouts it cannot read."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from token_files import documents, flat_with_eos, write_megatron

from zephon.errors import PlanError
from zephon.sources import (
    ArrowSource,
    JsonlSource,
    LanceSource,
    LitDataSource,
    TokenShardSource,
    open_source,
)


def rows(src: Any) -> list[Any]:
    total = src.total_chunks()
    return [p for pos in range(total) for p in src.read(src.chunk(pos).pointers)]


def table(n: int) -> pa.Table:
    return pa.table({"idx": list(range(n)), "text": [f"row {i}" for i in range(n)]})


def test_parquet_and_feather_directories_open_as_arrow_sources(tmp_path):
    pq.write_table(table(5), tmp_path / "a.parquet")
    (tmp_path / "sub").mkdir()
    feather.write_feather(table(3), tmp_path / "sub" / "b.feather")
    src = open_source(tmp_path, chunk_size=4)
    assert type(src) is ArrowSource
    assert [r["idx"] for r in rows(src)] == [0, 1, 2, 3, 4, 0, 1, 2]
    assert type(open_source(tmp_path / "a.parquet")) is ArrowSource


def test_jsonl_files_open_as_jsonl_sources(tmp_path):
    (tmp_path / "x.jsonl").write_text("".join(json.dumps({"i": i}) + "\n" for i in range(4)))
    src = open_source(str(tmp_path), shuffle=True)
    assert type(src) is JsonlSource and src.shuffle
    assert sorted(r["i"] for r in rows(src)) == [0, 1, 2, 3]


def test_megatron_pairs_open_from_the_directory_the_bin_or_the_idx(tmp_path):
    docs = documents(0, 10)
    write_megatron(tmp_path / "m", [[d] for d in docs])
    for given in (tmp_path, tmp_path / "m.bin", tmp_path / "m.idx"):
        src = open_source(given)
        assert type(src) is TokenShardSource
        assert [r["tokens"].tolist() for r in rows(src)] == [d.tolist() for d in docs]


def test_lists_and_globs_of_megatron_bins_open_their_indexes(tmp_path):
    write_megatron(tmp_path / "a", [[d] for d in documents(0, 3)])
    write_megatron(tmp_path / "b", [[d] for d in documents(3, 4)])
    for given in ([tmp_path / "a.bin", tmp_path / "b.bin"], str(tmp_path / "*.bin")):
        src = open_source(given)
        assert type(src) is TokenShardSource
        assert [r["tokens"].tolist() for r in rows(src)] == [d.tolist() for d in documents(0, 7)]


def test_npy_files_open_as_token_shards_with_the_cut_given(tmp_path):
    np.save(tmp_path / "t.npy", flat_with_eos(documents(0, 5)).astype(np.int32))
    src = open_source(tmp_path / "t.npy", eos_id=0)
    assert type(src) is TokenShardSource and src.num_samples() == 5


def test_a_saved_hf_dataset_directory_opens_its_arrow_files(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"idx": list(range(7)), "text": ["a"] * 7})
    ds.save_to_disk(str(tmp_path / "saved"), num_shards=2)
    src = open_source(tmp_path / "saved", chunk_size=3)
    assert type(src) is ArrowSource
    assert [r["idx"] for r in rows(src)] == list(range(7))


def test_hf_uris_read_a_split_from_the_datasets_cache(tmp_path, monkeypatch):
    from datasets.arrow_writer import ArrowWriter

    build = tmp_path / "cache" / "org___corpus" / "en" / "1.0.0" / "abc123"
    build.mkdir(parents=True)
    for split, n in (("train", 6), ("test", 2)):
        with ArrowWriter(path=str(build / f"corpus-{split}.arrow")) as writer:
            for i in range(n):
                writer.write({"idx": i, "split": split})
            writer.finalize()
    (build / "dataset_info.json").write_text("{}")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    src = open_source("hf://org/corpus/en/train", chunk_size=4)
    assert type(src) is ArrowSource
    assert [(r["idx"], r["split"]) for r in rows(src)] == [(i, "train") for i in range(6)]
    with pytest.raises(PlanError, match=r"not in the Hugging Face datasets cache"):
        open_source("hf://org/corpus/train")  # subset "default" was never prepared
    with pytest.raises(PlanError, match=r"no build holds Arrow files of split 'dev'"):
        open_source("hf://org/corpus/en/dev")
    monkeypatch.delenv("HF_DATASETS_CACHE")
    (tmp_path / "cache").rename(tmp_path / "datasets")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # its datasets/ directory is the cache
    assert open_source("hf://org/corpus/en/test").num_samples() == 2


def test_a_directory_mixing_formats_is_a_plan_error_listing_them(tmp_path):
    pq.write_table(table(2), tmp_path / "a.parquet")
    (tmp_path / "b.jsonl").write_text('{"i": 1}\n')
    with pytest.raises(PlanError, match=r"mixes formats \(1 \.jsonl, 1 \.parquet\)"):
        open_source(tmp_path)


def test_a_json_file_beside_jsonl_files_is_not_read_as_a_sample(tmp_path):
    # JsonlSource lists .json files too: a metadata file beside the data would be read as
    # samples, so open_source refuses the directory and says how to pick the files.
    (tmp_path / "train.jsonl").write_text('{"i": 1}\n{"i": 2}\n')
    (tmp_path / "meta.json").write_text('{"license": "mit"}\n')
    with pytest.raises(PlanError, match=r"mixes formats \(1 \.json, 1 \.jsonl\).*\*\.jsonl"):
        open_source(tmp_path)
    src = open_source(str(tmp_path / "**" / "*.jsonl"))  # the glob the message suggests
    assert [r["i"] for r in rows(src)] == [1, 2]


def test_an_unknown_layout_is_a_plan_error_naming_what_was_found(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "blob.dat").write_bytes(b"\0")
    with pytest.raises(PlanError, match=r"no file of a readable format \(found 1 \.dat, 1 \.txt\)"):
        open_source(tmp_path)
    with pytest.raises(PlanError, match="cannot tell the format"):
        open_source(tmp_path / "notes.txt")
    with pytest.raises(PlanError, match="does not exist"):
        open_source(tmp_path / "nothing")


def test_lists_must_be_of_one_format(tmp_path):
    pq.write_table(table(2), tmp_path / "a.parquet")
    (tmp_path / "b.jsonl").write_text('{"i": 1}\n')
    assert type(open_source([tmp_path / "a.parquet"])) is ArrowSource
    with pytest.raises(PlanError, match="not of one readable format"):
        open_source([tmp_path / "a.parquet", tmp_path / "b.jsonl"])


def test_litdata_and_lance_layouts_get_their_sources(tmp_path):
    # The layouts alone decide (nothing is read yet); tests/sources/test_lance.py and
    # test_litdata.py open real datasets.
    lit = tmp_path / "lit"
    lit.mkdir()
    (lit / "index.json").write_text(json.dumps({"chunks": [], "config": {}}))
    assert type(open_source(lit)) is LitDataSource
    assert type(open_source(lit / "index.json")) is LitDataSource
    lance = tmp_path / "t.lance"
    (lance / "_versions").mkdir(parents=True)
    assert type(open_source(lance)) is LanceSource
    renamed = tmp_path / "renamed"
    (renamed / "_versions").mkdir(parents=True)
    (renamed / "data").mkdir()
    assert type(open_source(renamed)) is LanceSource


def test_a_bucket_directory_opens_like_the_local_one(tmp_path, bucket):
    pq.write_table(table(6), tmp_path / "a.parquet")
    uri = bucket.upload(tmp_path, "open")
    src = open_source(uri, cache_dir=tmp_path / "cache")
    assert type(src) is ArrowSource
    assert [r["idx"] for r in rows(src)] == list(range(6))


def test_a_saved_hf_dataset_in_a_bucket_opens_like_the_local_one(tmp_path, bucket):
    import datasets

    ds = datasets.Dataset.from_dict({"idx": list(range(9))})
    ds.save_to_disk(str(tmp_path / "saved"), num_shards=3)
    uri = bucket.upload(tmp_path / "saved", "saved")
    src = open_source(uri, cache_dir=tmp_path / "cache", chunk_size=4)
    assert type(src) is ArrowSource
    assert [r["idx"] for r in rows(src)] == list(range(9))
