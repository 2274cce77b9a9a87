"""docs/tutorial.md runs as written: its code blocks, in order, in a fresh directory (blocks whose
first line is ``# file: NAME`` are written to that file), including the SIGKILL and resume."""

from __future__ import annotations

from pathlib import Path

import pytest
from docs_kit import run_page

pytest.importorskip("torchdata")


def test_the_tutorial_runs_and_its_resumed_stream_is_identical(tmp_path: Path) -> None:
    done = run_page("tutorial.md", tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "identical stream after SIGKILL and resume" in done.stdout
    assert "'<|endoftext|>'" in done.stdout and "'<pad>'" in done.stdout  # describe() shows ids
