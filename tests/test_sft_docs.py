"""docs/sft.md runs as written: its code blocks, in order, in a fresh directory."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from worker_kit import script_env

pytest.importorskip("transformers")

PAGE = Path(__file__).resolve().parents[1] / "docs" / "sft.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_the_sft_page_runs_and_its_resumed_stream_is_identical(tmp_path: Path) -> None:
    blocks = BLOCK.findall(PAGE.read_text())
    assert len(blocks) >= 5, "the page lost its code blocks"
    script = tmp_path / "sft.py"
    script.write_text("\n".join(blocks))
    done = subprocess.run(
        [sys.executable, "-W", "ignore::UserWarning", str(script)],
        cwd=tmp_path,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "refused: pack_sequences" in done.stdout and "extra_fields" in done.stdout
    assert "resumed stream identical" in done.stdout
