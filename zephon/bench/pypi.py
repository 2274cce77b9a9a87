"""Running a benchmark script under the pure-Python loader published on PyPI as ``zephon``.

That package shares our import name, so it lives in a virtual environment of its own, e.g.
``python3 -m venv pypi-venv && pypi-venv/bin/pip install zephon numpy tokenizers transformers``
(the text pipeline's row needs the last two), whose interpreter ``ZEPHON_PYPI_PYTHON`` names.
Its scripts (``pypi_*_run.py`` beside this module) run there, in a separate process, and print
one JSON line of results.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["CHUNK", "pypi_python", "run_script", "whole_chunks"]

#: Records a PyPI zephon pass reads per chunk (its scripts' in-memory shards, ``pypi_common.py``);
#: it leaves out a last partial chunk, so each side is given whole chunks.
CHUNK = 1024


def pypi_python() -> str | None:
    """The PyPI zephon's interpreter (``$ZEPHON_PYPI_PYTHON``), or None."""
    return os.environ.get("ZEPHON_PYPI_PYTHON") or None


def whole_chunks(n: int) -> int:
    """The largest multiple of ``CHUNK`` not above ``n``: what a PyPI zephon pass reads whole."""
    return n - n % CHUNK


def run_script(
    name: str, args: list[str], python: str, *, cwd: str | os.PathLike[str] | None = None
) -> dict[str, Any]:
    """The JSON line that script ``name`` (beside this module) printed last, run by ``python``
    with ``args``; our own ``PYTHONPATH`` is left out, so that it imports the PyPI zephon."""
    script = Path(__file__).with_name(name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [python, str(script), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=600,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
