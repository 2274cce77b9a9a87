"""Progress bars for long waits (a restore's replay, the demo, the benchmarks), through tqdm when
it is installed (``pip install "zephon-loader[progress]"``). Off in the library until
``show_progress()`` is called; the command line turns them on."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["bar", "progress_shown", "show_progress"]

_enabled = False


def show_progress(enabled: bool = True) -> None:
    """Show progress bars on stderr from now on (or stop showing them)."""
    global _enabled
    _enabled = enabled


def progress_shown() -> bool:
    """Whether progress bars are shown (``show_progress``)."""
    return _enabled


def bar(total: int | None, desc: str, unit: str = "rec") -> Any:
    """A tqdm bar (of ``total`` steps, unknown when None) when progress is shown and tqdm is
    installed, else ``None`` (callers skip their updates, so a hidden bar costs nothing)."""
    if not _enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, leave=False, file=sys.stderr, unit=unit)
