"""docs/vision.md runs as written: its code blocks, in order, in a fresh directory, including the
SIGKILL and resume of a vision-language training loop whose resumed stream, pixels included,
must equal the uninterrupted one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from docs_kit import run_page

pytest.importorskip("torchdata")
pytest.importorskip("PIL")
pytest.importorskip("webdataset")


def test_the_vision_tutorial_runs_and_its_resumed_stream_is_identical(tmp_path: Path) -> None:
    done = run_page("vision.md", tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "identical stream, pixels included, after SIGKILL and resume" in done.stdout
    assert "pixel_values (" in done.stdout and "image_grid_thw (" in done.stdout
    assert "WebDataset shards: the same batches, pixels included" in done.stdout
    assert "position_ids (3, 4, 96)" in done.stdout  # the M-RoPE section ran
    assert re.search(r"patches \(\d+, 294\) float32", done.stdout)  # and the patches one
