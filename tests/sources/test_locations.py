"""Where data can be (directories, globs, lists, URIs) and the identity that survives moving it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import zephon
from zephon.errors import CheckpointMismatchError, FetchError
from zephon.ops import batch, fetch
from zephon.sources import ArrowSource, HFDatasetSource, JsonlSource


def tree(root: Path) -> Path:
    for rel, rows in (
        ("x/b.parquet", 4),
        ("x/a.parquet", 3),
        ("y/z/c.parquet", 5),
        ("d.parquet", 2),
    ):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        start = sum(map(ord, rel)) * 10
        pq.write_table(pa.table({"idx": list(range(start, start + rows))}), root / rel)
    (root / "x" / "notes.txt").write_text("not data")
    (root / "_SUCCESS").write_text("")
    (root / "x" / ".hidden.parquet").write_bytes(b"")
    return root


def test_a_directory_is_its_data_files_at_any_depth_sorted(tmp_path):
    root = tree(tmp_path / "data")
    src = ArrowSource(root)
    assert src.names == ["d.parquet", "x/a.parquet", "x/b.parquet", "y/z/c.parquet"]
    assert src.root == str(root) and src.num_samples() == 14


def test_globs_and_mixed_lists_resolve_in_order(tmp_path):
    root = tree(tmp_path / "data")
    assert ArrowSource(str(root / "x" / "*.parquet")).names == ["a.parquet", "b.parquet"]
    assert ArrowSource(str(root / "**" / "*.parquet")).names == [
        "d.parquet",
        "x/a.parquet",
        "x/b.parquet",
        "y/z/c.parquet",
    ]
    assert ArrowSource(str(root / "*" / "[ab].parquet")).names == ["x/a.parquet", "x/b.parquet"]
    mixed = ArrowSource([f"file://{root / 'y'}", root / "d.parquet", str(root / "x" / "b*")])
    assert mixed.names == ["y/z/c.parquet", "d.parquet", "x/b.parquet"]
    with pytest.raises(ValueError, match=r"d\.parquet.*given twice"):
        ArrowSource([root, root / "d.parquet"]).num_samples()
    with pytest.raises(FetchError, match="matches no file"):
        ArrowSource(str(root / "*.jsonl")).num_samples()
    with pytest.raises(FetchError, match="holds no file ending with"):
        JsonlSource(root).num_samples()


def fingerprint(src) -> str:
    return zephon.Pipeline(src, [fetch(), batch(2)]).fingerprint


def test_relative_absolute_and_moved_paths_keep_one_fingerprint(tmp_path, monkeypatch):
    root = tree(tmp_path / "data")
    first = fingerprint(ArrowSource(root))
    monkeypatch.chdir(tmp_path)
    assert fingerprint(ArrowSource("data")) == first
    assert fingerprint(ArrowSource(f"file://{root}")) == first
    moved = Path(shutil.copytree(root, tmp_path / "elsewhere" / "mount"))
    assert fingerprint(ArrowSource(moved)) == first
    files = sorted(p for p in moved.rglob("*.parquet") if not p.name.startswith("."))
    assert fingerprint(ArrowSource(files)) == first  # a list: names relative to its common dir


def checkpoint(src_factory):
    with zephon.Pipeline(src_factory(), [fetch(), batch(2)]).iter() as loader:
        next(loader)
        return json.loads(json.dumps(loader.state_dict()))


@pytest.mark.parametrize("change", ["appended", "rewritten", "added", "removed"])
def test_changed_data_is_refused_naming_the_file(tmp_path, change):
    root = tree(tmp_path / "data")
    state = checkpoint(lambda: ArrowSource(root))
    target = root / "x" / "b.parquet"
    if change == "appended":
        pq.write_table(pa.table({"idx": list(range(9))}), target)
        expect = r"file 'x/b\.parquet' changed .*: rows 4 -> 9, size"
    elif change == "rewritten":
        pq.write_table(pa.table({"idx": [7, 6, 5, 4]}), target)
        expect = r"file 'x/b\.parquet' changed .*: footer"
    elif change == "added":
        shutil.copy(target, root / "x" / "e.parquet")
        expect = r"file 'x/e\.parquet' is in the pipeline but not in the checkpoint"
    else:
        os.unlink(target)
        expect = r"file 'x/b\.parquet' is in the checkpoint but not in the pipeline"
    with pytest.raises(CheckpointMismatchError, match=expect):
        zephon.Pipeline(ArrowSource(root), [fetch(), batch(2)]).iter(state=state)


def test_a_mismatch_names_the_operator_and_parameter():
    from zephon.sources import RangeSource

    state = checkpoint(lambda: RangeSource(10))
    with pytest.raises(
        CheckpointMismatchError,
        match=r"operator #1 \(batch\) parameter 'batch_size': checkpoint 2, pipeline 3",
    ):
        zephon.Pipeline(RangeSource(10), [fetch(), batch(3)]).iter(state=state)


def test_a_hugging_face_dataset_gives_the_stream_of_its_parquet_files(tmp_path):
    datasets = pytest.importorskip("datasets")
    idx = list(range(57))
    table = pa.table({"idx": idx, "text": [f"t{i}" for i in idx]})
    parquet = tmp_path / "p"
    parquet.mkdir()
    pq.write_table(table.slice(0, 30), parquet / "0.parquet", row_group_size=8)
    pq.write_table(table.slice(30), parquet / "1.parquet", row_group_size=8)
    ds = datasets.Dataset.from_parquet(
        [str(parquet / "0.parquet"), str(parquet / "1.parquet")], cache_dir=str(tmp_path / "c")
    )
    hf = HFDatasetSource(ds, chunk_size=5, shuffle=True, seed=2)
    local = ArrowSource(parquet, chunk_size=5, shuffle=True, seed=2)

    def rows(src):
        with zephon.Pipeline(src, [fetch(), batch(4)]).iter() as loader:
            return [
                (int(i), t)
                for b in loader
                for i, t in zip(b.payload["idx"], b.payload["text"], strict=True)
            ]

    assert rows(hf) == rows(local)
    assert all(f.endswith(".arrow") for f in hf.paths)
    with pytest.raises(ValueError, match="flatten_indices"):
        HFDatasetSource(ds.select([9, 2]))
    with pytest.raises(ValueError, match="has 3 rows but its cache files hold 57"):
        HFDatasetSource(ds.select(range(3))).num_samples()


def test_a_uri_made_a_path_object_is_refused_naming_the_uri(tmp_path, monkeypatch):
    # Path("gs://bucket/data") is "gs:/bucket/data"; read as a local path it would be a
    # directory "gs:" under the working directory, and a drive letter or a file URI is not.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"JsonlSource: 'gs:/bucket/data' looks like the URI "):
        JsonlSource(Path("gs://bucket/data"))
    with pytest.raises(ValueError, match=r"'s3://bucket/a\.jsonl' made into a path"):
        JsonlSource([str(tmp_path / "x.jsonl"), Path("s3://bucket/a.jsonl")])
    (tmp_path / "file:").mkdir()
    (tmp_path / "x.jsonl").write_text('{"a": 1}\n')
    assert JsonlSource(Path((tmp_path / "x.jsonl").as_uri())).total_chunks() == 1


@pytest.mark.parametrize("uri", ["s3://bucket/cache", Path("gs://bucket/cache")])
def test_a_local_cache_given_a_uri_is_refused_not_made_a_directory_here(tmp_path, monkeypatch, uri):
    from zephon.sources import ShardCache

    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.jsonl").write_text('{"a": 1}\n')
    with pytest.raises(ValueError, match=r"ShardCache: the cache is on this machine's filesystem"):
        ShardCache(uri, max_bytes=2**20)
    with pytest.raises(ValueError, match=r"JsonlSource: cache_dir is on this machine's file"):
        JsonlSource(str(tmp_path / "x.jsonl"), cache_dir=uri)
    with pytest.raises(ValueError, match=r"JsonlSource: index_dir is on this machine's file"):
        JsonlSource(str(tmp_path / "x.jsonl"), index_dir=uri)
    assert [p.name for p in tmp_path.iterdir()] == ["x.jsonl"]
