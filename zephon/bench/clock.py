"""The start of a timed run."""

from __future__ import annotations

import gc
import time


def start_clock() -> float:
    """``time.perf_counter()``, after collecting what earlier runs left: a full collection of a
    process holding the bench's objects takes tens of milliseconds, as long as a whole short run,
    and would otherwise land in whichever run (ours or a baseline) happened to trigger it."""
    gc.collect()
    return time.perf_counter()
