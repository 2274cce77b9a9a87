"""docs/data.md runs as written, next to an MDS directory written by Mosaic's MDSWriter (its
Lance and LitData examples write their own data with those formats' writers)."""

from __future__ import annotations

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
    mds, lance_counts, _lance_rows, litdata = lines[-8:-4]
    assert "10 [" in mds and "int32" in mds
    assert lance_counts == "10 3 1"
    assert "10 [" in litdata and "int32" in litdata
    assert lines[-4:] == ["TokenShardSource", "MDSSource", "LanceSource", "LitDataSource"]
