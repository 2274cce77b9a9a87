"""docs/sft.md runs as written: its code blocks, in order, in a fresh directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from docs_kit import run_page

pytest.importorskip("transformers")


def test_the_sft_page_runs_and_its_resumed_stream_is_identical(tmp_path: Path) -> None:
    done = run_page("sft.md", tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "refused: pack_sequences" in done.stdout and "extra_fields" in done.stdout
    assert "resumed stream identical" in done.stdout
