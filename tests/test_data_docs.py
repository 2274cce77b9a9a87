"""docs/data.md runs as written, next to an MDS directory written by Mosaic's MDSWriter (the page
writes its own WebDataset shards, Lance dataset and LitData chunks with those formats' writers)."""

from __future__ import annotations

import json

import numpy as np
from docs_kit import run_page
from mds_kit import mds_writer


def test_the_data_page_runs(tmp_path):
    columns = {"idx": "int", "text": "str", "tokens": "ndarray:int32"}
    with mds_writer()(out=str(tmp_path / "mds"), columns=columns, compression="zstd") as out:
        for i in range(10):
            out.write({"idx": i, "text": f"row {i}", "tokens": np.arange(i + 1, dtype=np.int32)})
    done = run_page("data.md", tmp_path, min_blocks=3)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "[[5, 6, 7, 0], [8, 9, 0]]"
    mds, wds = lines[-12:-10]
    assert "10 [" in mds and "int32" in mds
    assert wds == "8 ['__key__', '__url__', 'txt', 'jpg'] str 100"
    batches = [json.loads(line.replace("'", '"')) for line in lines[-10:-8]]
    assert sorted(k for b in batches for k in b) == [f"{i:06d}" for i in range(8)]
    lance_counts, _lance_rows, litdata = lines[-8:-5]
    assert lance_counts == "10 3 1"
    assert "10 [" in litdata and "int32" in litdata
    assert lines[-5:] == [
        "TokenShardSource",
        "MDSSource",
        "WebDatasetSource",
        "LanceSource",
        "LitDataSource",
    ]
