"""LanceSource over datasets written by Lance's own writer (``lance.write_dataset``), locally and
on the loopback S3 server."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections import Counter
from functools import partial
from operator import itemgetter
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pytest
from format_kit import (
    assert_a_changed_dataset_is_refused,
    assert_a_copy_reads_the_same,
    assert_a_killed_worker_resumes_exactly,
    assert_columns_pick_and_order,
    assert_each_sample_twice,
    assert_resumes_exactly,
    assert_resumes_on_two_ranks_and_relanes,
    every_sample,
    stopped_after,
)
from pipeline_kit import run

import zephon
from zephon.errors import CheckpointMismatchError, FetchError
from zephon.ops import batch, fetch
from zephon.sources import LanceSource, open_source

N = 60


def table(lo: int, hi: int) -> pa.Table:
    idx = np.arange(lo, hi)
    return pa.table(
        {
            "idx": idx,
            "text": [f"row {i} é" for i in idx],
            "tokens": pa.array(
                [np.arange(i % 5, dtype=np.int32) + i for i in idx], pa.list_(pa.int32())
            ),
            "score": idx / 3,
        }
    )


def write(root: Path | str, lo: int = 0, hi: int = N, **kw: Any) -> str:
    options = {"max_rows_per_file": 16, "max_rows_per_group": 8, **kw}
    lance.write_dataset(table(lo, hi), str(root), **options)
    return str(root)


def assert_written(got: dict[str, Any]) -> None:
    i = got["idx"]
    assert got["text"] == f"row {i} é" and got["score"] == i / 3
    assert got["tokens"].dtype == np.int32
    np.testing.assert_array_equal(got["tokens"], np.arange(i % 5, dtype=np.int32) + i)


# --------------------------------------------------------------------------- coverage


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_row_once_per_pass_with_the_writers_values(tmp_path, shuffle):
    src = LanceSource(write(tmp_path / "d.lance"), chunk_size=7, shuffle=shuffle, passes=2)
    assert len(src.files()) == 4, "the rows should span several fragments"
    assert_each_sample_twice(src, N, itemgetter("idx"), assert_written)


def test_deleted_rows_are_not_samples(tmp_path):
    ds = lance.dataset(write(tmp_path / "d.lance"))
    ds.delete("idx % 10 = 3")
    got = every_sample(LanceSource(tmp_path / "d.lance", chunk_size=9, shuffle=True))
    assert sorted(g["idx"] for g in got) == [i for i in range(N) if i % 10 != 3]


def test_columns_pick_and_order_the_payload(tmp_path):
    source = partial(LanceSource, write(tmp_path / "d.lance"))
    assert_columns_pick_and_order(source, {"text": "row 0 é", "idx": 0})


def test_a_worker_reads_the_version_its_source_pinned(tmp_path):
    root = write(tmp_path / "d.lance")
    src = LanceSource(root, chunk_size=N)
    assert src.num_samples() == N and src.pinned_version == 1
    write(root, N, N + 5, mode="append")
    clone = pickle.loads(pickle.dumps(src))  # what a worker process receives
    assert [g["idx"] for g in clone.read(clone.chunk(0).pointers)] == list(range(N))
    assert LanceSource(root).num_samples() == N + 5


def test_a_version_that_does_not_exist_is_a_fetch_error_naming_it(tmp_path):
    root = write(tmp_path / "d.lance")
    with pytest.raises(FetchError, match=r"cannot open version 7 of .*d\.lance"):
        LanceSource(root, version=7).num_samples()


def test_import_zephon_does_not_import_lance():
    code = "import sys, zephon, zephon.sources; print('lance' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_open_source_picks_lance(tmp_path):
    root = write(tmp_path / "d.lance")
    src = open_source(root)
    assert type(src) is LanceSource and src.num_samples() == N
    renamed = tmp_path / "plain-name"
    os.rename(root, renamed)
    assert type(open_source(renamed)) is LanceSource


# --------------------------------------------------------------------------- pipelines


def pipeline(root: Path | str, **kw: Any) -> zephon.Pipeline:
    version = kw.pop("version", None)
    src = LanceSource(root, columns=["idx", "tokens"], chunk_size=5, shuffle=True, version=version)
    return zephon.Pipeline(src, [fetch(), batch(3)], **kw)


def delivered(items: list[Any]) -> Counter:
    return Counter(r.payload["idx"] for item in items for r in item)


def test_resumes_exactly_at_any_step(tmp_path):
    root = write(tmp_path / "d.lance")
    assert_resumes_exactly(partial(pipeline, root), lambda n: (0, 3, 9, n - 1))


@pytest.mark.usefixtures("no_leftover_workers")
def test_a_killed_worker_resumes_exactly(tmp_path):
    assert_a_killed_worker_resumes_exactly(partial(pipeline, write(tmp_path / "d.lance")), 4)


def test_a_job_of_four_ranks_resumes_on_two_and_relanes(tmp_path):
    make = partial(pipeline, write(tmp_path / "d.lance"))
    assert_resumes_on_two_ranks_and_relanes(make, delivered, Counter(range(N)))


@pytest.mark.parametrize("mode", ["append", "overwrite"])
def test_a_changed_dataset_is_refused_unless_the_version_is_pinned(tmp_path, mode):
    root = write(tmp_path / "d.lance")
    full = run(iter(pipeline(root)))
    head, state = stopped_after(partial(pipeline, root), 3)
    write(root, 0, N + 1, mode=mode)
    with pytest.raises(
        CheckpointMismatchError, match=r"'dataset_version': checkpoint 1, pipeline 2"
    ):
        iter(pipeline(root).iter(state=state))
    # The checkpoint's version is still there: pinned, the run finishes on it.
    assert head + run(pipeline(root, version=1).iter(state=state)) == full


def test_a_data_file_replaced_in_place_is_a_checkpoint_mismatch_naming_its_fragment(tmp_path):
    # Lance never rewrites a data file, but a copy tool can: same name, same size, other values.
    for name, seed in (("a.lance", 0), ("b.lance", 1)):
        values = pa.table({"x": np.random.default_rng(seed).random(40)})
        lance.write_dataset(values, str(tmp_path / name), max_rows_per_file=20)
    a, b = (lance.dataset(str(tmp_path / n)).get_fragments()[0] for n in ("a.lance", "b.lance"))
    target = tmp_path / "a.lance" / "data" / a.data_files()[0].path
    source = tmp_path / "b.lance" / "data" / b.data_files()[0].path
    assert target.stat().st_size == source.stat().st_size

    def pipe() -> zephon.Pipeline:
        return zephon.Pipeline(LanceSource(tmp_path / "a.lance", chunk_size=5), [fetch()])

    def replace() -> None:
        target.write_bytes(source.read_bytes())

    assert_a_changed_dataset_is_refused(pipe, replace, r"file 'fragment-0' changed")


# --------------------------------------------------------------------------- remote


def test_a_bucket_copy_delivers_the_local_rows(tmp_path, bucket):
    local = write(tmp_path / "d.lance")
    uri = bucket.upload(Path(local), "lance/d.lance")
    here = LanceSource(local, chunk_size=6, shuffle=True)
    there = LanceSource(uri, chunk_size=6, shuffle=True)
    got = assert_a_copy_reads_the_same(here, there, "idx")
    for g in got:
        assert_written(g)
    assert type(open_source(uri)) is LanceSource


def test_a_bucket_dataset_resumes_exactly(tmp_path, bucket):
    uri = write(f"s3://{bucket.name}/written.lance", storage_options={"allow_http": "true"})
    assert delivered(list(pipeline(uri))) == Counter(range(N))
    assert_resumes_exactly(partial(pipeline, uri), lambda n: (6,))


def test_process_lanes_start_without_lances_fork_warning(tmp_path):
    # Lance warns before every fork of a process that imported it; the fork server imports it
    # for the workers but never runs it (it forks from no Lance thread), so the warning, which
    # says to use a fork server, would only alarm. A fresh interpreter: its fork server is new.
    root = write(tmp_path / "ds.lance")
    code = (
        "import zephon\n"
        "from zephon.ops import batch, fetch\n"
        "from zephon.sources import LanceSource\n"
        f"pipeline = zephon.Pipeline(LanceSource({root!r}), [fetch(), batch(8)], lanes=2,"
        " workers='process')\n"
        "with pipeline.iter() as loader:\n"
        "    print(sum(len(b.payload['idx']) for b in loader))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == [str(N)]
    assert "fork-safe" not in done.stderr
