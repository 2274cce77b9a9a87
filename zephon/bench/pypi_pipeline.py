"""The map pipeline against the pure-Python zephon on PyPI: ``fetch -> map_transform(square) ->
batch(32)`` over ``RangeSource(n)`` on one inline lane (``zephon.bench.pipeline``), and the PyPI
zephon's ``map_transform(square) -> batch(32)`` over the same payloads held in memory, run by that
package's own interpreter (``pypi_map_run.py``; ``zephon.bench.pypi``). Both count the records
they deliver per second; ours also collates each batch, the PyPI zephon's batches are lists.
"""

from __future__ import annotations

import time

from zephon.bench.pipeline import BATCH_SIZE, overhead_pipeline
from zephon.bench.pypi import run_script

__all__ = ["RUNNERS", "ours_records_per_second", "pypi_records_per_second"]

#: The PyPI zephon's runners measured: in the caller's thread, and the one it picks by default.
RUNNERS = ("inline", "default")


def ours_records_per_second(n: int) -> tuple[float, int]:
    """``(records/s, records)`` delivered by ``fetch -> map_transform(square) -> batch(32)`` over
    ``n`` records: the pipeline is made before the clock starts, as the PyPI zephon's is, and
    planning it is timed, as the PyPI zephon's is."""
    pipeline = overhead_pipeline(n)
    delivered = 0
    began = time.perf_counter()
    with pipeline.iter() as loader:
        for item in loader:
            delivered += len(item)
    return delivered / (time.perf_counter() - began), delivered


def pypi_records_per_second(n: int, python: str, runner: str) -> tuple[float, int]:
    """``(records/s, records)`` delivered by the PyPI zephon's map and batch over ``n`` records
    with its ``runner`` (one of ``RUNNERS``), measured by ``python`` running
    ``pypi_map_run.py``. It leaves out a last partial chunk of 1,024: give a multiple of it."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    out = run_script("pypi_map_run.py", [str(n), str(BATCH_SIZE), runner], python)
    return out["records"] / out["seconds"], int(out["records"])
