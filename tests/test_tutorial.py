"""docs/tutorial.md runs as written: its code blocks, in order, in a fresh directory (blocks whose
first line is ``# file: NAME`` are written to that file), including the SIGKILL and resume."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from worker_kit import script_env

pytest.importorskip("torchdata")

TUTORIAL = Path(__file__).resolve().parents[1] / "docs" / "tutorial.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_the_tutorial_runs_and_its_resumed_stream_is_identical(tmp_path: Path) -> None:
    script = []
    for block in BLOCK.findall(TUTORIAL.read_text()):
        first, _, rest = block.partition("\n")
        if first.startswith("# file: "):
            (tmp_path / first.removeprefix("# file: ").strip()).write_text(rest)
        else:
            script.append(block)
    assert len(script) >= 5, "the tutorial lost its code blocks"
    main = tmp_path / "tutorial.py"
    main.write_text("\n".join(script))
    done = subprocess.run(
        [sys.executable, "-W", "ignore::UserWarning", str(main)],
        cwd=tmp_path,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "identical stream after SIGKILL and resume" in done.stdout
    assert "'<|endoftext|>'" in done.stdout and "'<pad>'" in done.stdout  # describe() shows ids
