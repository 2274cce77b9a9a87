"""Running a documentation page as written: its Python code blocks, in order, in a fresh
directory (a block whose first line is ``# file: NAME`` is written to that file instead)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from worker_kit import script_env

DOCS = Path(__file__).resolve().parents[1] / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def run_page(name: str, where: Path, *, min_blocks: int = 5) -> subprocess.CompletedProcess[str]:
    """Run ``docs/<name>`` in ``where``; the finished process (output captured as text)."""
    script = []
    for block in BLOCK.findall((DOCS / name).read_text()):
        first, _, rest = block.partition("\n")
        if first.startswith("# file: "):
            (where / first.removeprefix("# file: ").strip()).write_text(rest)
        else:
            script.append(block)
    assert len(script) >= min_blocks, f"{name} lost its code blocks"
    main = where / "page.py"
    main.write_text("\n".join(script))
    return subprocess.run(
        [sys.executable, "-W", "ignore::UserWarning", str(main)],
        cwd=where,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
