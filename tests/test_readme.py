"""The README's code runs as written, in order, in a fresh directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from docs_kit import run_page

pytest.importorskip("torchdata")


def test_the_readme_snippets_run_as_written(tmp_path: Path) -> None:
    done = run_page("../README.md", tmp_path, min_blocks=3)
    assert done.returncode == 0, done.stderr
    assert "pack_sequences" in done.stdout  # the plan it describes
    assert done.stdout.rstrip().endswith("torch.Size([8, 2048])")
