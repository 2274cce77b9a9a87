"""A checkpoint resumes only on data of the content it was taken on: a file rewritten with the
same size, row counts and footer is refused at resume on a fresh copy of the data, after its
sidecar is deleted, and in a bucket read through a new cache directory; a copy of equal content
under another root resumes exactly."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
from pipeline_kit import run_with_timeout

import zephon
from zephon.errors import CheckpointMismatchError, FetchError
from zephon.ops import batch, fetch
from zephon.sources import ArrowSource, HFDatasetSource, JsonlSource

ROWS, GROUP = 40, 8
FORMATS = ("parquet", "arrow_file", "arrow_stream", "jsonl")
SUFFIX = {"parquet": "parquet", "arrow_file": "arrow", "arrow_stream": "arrows", "jsonl": "jsonl"}


def order(reordered: bool) -> list[int]:
    """Row numbers in file order: reversed inside each group of ``GROUP`` when ``reordered``."""
    if not reordered:
        return list(range(ROWS))
    return [j for s in range(0, ROWS, GROUP) for j in reversed(range(s, s + GROUP))]


def write_file(path: Path, fmt: str, reordered: bool) -> Path:
    """``ROWS`` rows in groups of ``GROUP``, uncompressed and without statistics or
    dictionaries: reordering them keeps every size, offset and footer byte."""
    rows = order(reordered)
    table = pa.table({"idx": np.asarray(rows, dtype=np.int64), "text": [f"r{i:03d}" for i in rows]})
    if fmt == "parquet":
        pq.write_table(
            table,
            path,
            row_group_size=GROUP,
            compression="none",
            use_dictionary=False,
            write_statistics=False,
        )
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps({"idx": i, "text": f"r{i:03d}"}) + "\n" for i in rows))
    else:
        new = ipc.new_file if fmt == "arrow_file" else ipc.new_stream
        with new(str(path), table.schema) as writer:
            for b in table.to_batches(max_chunksize=GROUP):
                writer.write_batch(b)
    return path


def footer(path: Path, fmt: str) -> bytes:
    """The bytes the old identity was made of: the footer (a stream: its schema message)."""
    data = path.read_bytes()
    if fmt == "parquet":
        return data[-8 - struct.unpack("<I", data[-8:-4])[0] :]
    if fmt == "arrow_file":
        return data[-10 - struct.unpack("<i", data[-10:-6])[0] :]
    return data[:200]


def dataset(root: Path, fmt: str, reordered: bool = False) -> Path:
    """Two files under ``root``: ``a`` (the one rewritten) and ``b``, named with the format's
    suffix."""
    root.mkdir(parents=True, exist_ok=True)
    write_file(root / f"a.{SUFFIX[fmt]}", fmt, reordered)
    write_file(root / f"b.{SUFFIX[fmt]}", fmt, False)
    return root


def make(fmt: str, where: str, **kwargs) -> zephon.sources.WorkSource:
    source = JsonlSource if fmt == "jsonl" else ArrowSource
    return source(where, chunk_size=GROUP, **kwargs)


def idx(b) -> list[int]:
    return [int(i) for i in b.payload["idx"]]


def head(source: zephon.sources.WorkSource) -> tuple[list[int], dict]:
    """The first three batches and the state after them."""
    with zephon.Pipeline(source, [fetch(), batch(4)]).iter() as loader:
        got = [i for _ in range(3) for i in idx(next(loader))]
        return got, json.loads(json.dumps(loader.state_dict()))


def tail(source: zephon.sources.WorkSource, state: dict) -> list[int]:
    with zephon.Pipeline(source, [fetch(), batch(4)]).iter(state=state) as loader:
        return [i for b in loader for i in idx(b)]


def refused(source: Callable[[], zephon.sources.WorkSource], state: dict, name: str) -> None:
    def scenario() -> None:
        with pytest.raises(
            CheckpointMismatchError, match=rf"file '{name}' changed .*content_sha256"
        ):
            tail(source(), state)

    run_with_timeout(scenario)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_fresh_copy_with_a_same_footer_rewrite_is_refused_and_an_equal_one_resumes(tmp_path, fmt):
    first = dataset(tmp_path / "first", fmt)
    got, state = run_with_timeout(lambda: head(make(fmt, str(first))))
    changed = dataset(tmp_path / "changed", fmt, reordered=True)
    name = f"a.{SUFFIX[fmt]}"
    assert (changed / name).stat().st_size == (first / name).stat().st_size
    if fmt != "jsonl":
        assert footer(changed / name, fmt) == footer(first / name, fmt)
    refused(lambda: make(fmt, str(changed)), state, name)
    equal = dataset(tmp_path / "elsewhere" / "equal", fmt)
    assert got + run_with_timeout(lambda: tail(make(fmt, str(equal)), state)) == [
        *range(ROWS),
        *range(ROWS),
    ]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_same_footer_rewrite_in_place_is_refused_once_its_sidecar_is_deleted(tmp_path, fmt):
    root = dataset(tmp_path / "data", fmt)
    _, state = run_with_timeout(lambda: head(make(fmt, str(root))))
    write_file(root / f"a.{SUFFIX[fmt]}", fmt, reordered=True)
    for sidecar in root.glob("a.*.z*"):
        sidecar.unlink()
    refused(lambda: make(fmt, str(root)), state, f"a.{SUFFIX[fmt]}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_bucket_copy_rewritten_is_refused_through_a_new_cache_dir(tmp_path, bucket, fmt):
    local = dataset(tmp_path / "data", fmt)
    uri = bucket.upload(local, "corpus")
    got, state = run_with_timeout(
        lambda: head(make(fmt, uri, cache_dir=tmp_path / "cache-1", threads=4))
    )
    bucket.upload(dataset(tmp_path / "changed", fmt, reordered=True), "corpus")
    refused(lambda: make(fmt, uri, cache_dir=tmp_path / "cache-2"), state, f"a.{SUFFIX[fmt]}")
    copy = bucket.upload(local, "copy")
    rest = run_with_timeout(lambda: tail(make(fmt, copy, cache_dir=tmp_path / "cache-3"), state))
    assert got + rest == [*range(ROWS), *range(ROWS)]


def test_a_hugging_face_dataset_saved_again_with_reordered_rows_is_refused(tmp_path):
    datasets = pytest.importorskip("datasets")

    def saved(where: Path, reordered: bool) -> Path:
        rows = order(reordered)
        ds = datasets.Dataset.from_dict({"idx": rows, "text": [f"r{i:03d}" for i in rows]})
        ds.save_to_disk(str(where))
        return where

    def source(where: Path) -> HFDatasetSource:
        return HFDatasetSource(datasets.load_from_disk(str(where)), chunk_size=GROUP)

    first = saved(tmp_path / "first", reordered=False)
    got, state = run_with_timeout(lambda: head(source(first)))
    changed = saved(tmp_path / "changed", reordered=True)
    [name] = {Path(p).name for p in source(changed).paths}
    refused(lambda: source(changed), state, name)
    shutil.copytree(first, tmp_path / "elsewhere" / "copy", ignore=shutil.ignore_patterns("*.zsum"))
    rest = run_with_timeout(lambda: tail(source(tmp_path / "elsewhere" / "copy"), state))
    assert got + rest == list(range(ROWS))


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_store_giving_no_version_or_mtime_is_judged_by_content(tmp_path, fmt):
    import fsspec

    memory = fsspec.filesystem("memory")  # its listing has no mtime, its info no version
    local = dataset(tmp_path / "data", fmt)
    changed = dataset(tmp_path / "changed", fmt, reordered=True)
    name = f"a.{SUFFIX[fmt]}"

    def put(where: Path) -> None:
        for file in ("a", "b"):
            path = where / f"{file}.{SUFFIX[fmt]}"
            memory.pipe(f"/{tmp_path.name}/{path.name}", path.read_bytes())

    put(local)
    uri = f"memory:///{tmp_path.name}"
    src = make(fmt, uri)
    _, state = run_with_timeout(lambda: head(src))
    put(changed)
    # Running: the digests refuse what changed. At resume: digested again, the content differs.
    with pytest.raises(FetchError, match=rf"{name}.*(changed since|no longer matches)"):
        src.read(src.chunk(0).pointers)
    refused(lambda: make(fmt, uri), state, name)


def _as_taken_before_content_identity(state: dict, source) -> dict:
    """``state`` as a checkpoint taken before file contents entered the fingerprint: each
    file's description without its ``content_sha256``, beside its footer."""
    from zephon.identity import identify
    from zephon.plan import digest
    from zephon.runtime.checkpoint.format import seal

    def strip(value):
        if isinstance(value, list):
            return [strip(v) for v in value]
        if isinstance(value, dict):
            keep = {k: strip(v) for k, v in value.items()}
            if "footer" in keep:
                keep.pop("content_sha256", None)
            return keep
        return value

    pipeline = dict(state["pipeline"])
    pipeline["source"] = digest(strip(identify(source.describe())))
    pipeline.pop("described", None)
    return seal({**state, "pipeline": pipeline, "fingerprint": digest(pipeline)})


def test_a_checkpoint_from_before_content_identity_resumes_with_a_warning(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    import zephon
    from zephon.ops import batch, fetch
    from zephon.sources import ArrowSource

    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"x": list(range(300))}), path, row_group_size=50)

    def make() -> zephon.Pipeline:
        return zephon.Pipeline(
            ArrowSource([str(path)], chunk_size=32), [fetch(), batch(4)], lanes=2
        )

    with make().iter() as loader:
        head = [b.payload["x"].tolist() for _, b in zip(range(9), loader)]
        state = loader.state_dict()
    old = _as_taken_before_content_identity(state, make().compile().source)
    assert old["fingerprint"] != state["fingerprint"]
    with pytest.warns(zephon.UnverifiedContentWarning, match="cannot be checked"):
        resumed = make().iter(state=old)
    with resumed:
        tail = [b.payload["x"].tolist() for b in resumed]
    with make().iter() as full:
        assert head + tail == [b.payload["x"].tolist() for b in full]
    # A layout that differs is still refused, old checkpoint or not.
    pq.write_table(pa.table({"x": list(range(301))}), path, row_group_size=50)
    with pytest.raises(zephon.CheckpointMismatchError):
        make().iter(state=old)
