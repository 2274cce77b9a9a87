"""Packing on token shards against the pure-Python zephon on PyPI:
``fetch -> pack_sequences(2048) -> batch(8)`` over a Megatron pair read by ``TokenShardSource``,
and the PyPI zephon's ``pack_flat`` (best fit, 64 open bins, the same batch) over the same
documents, run by that package's own interpreter in a separate process (``pypi_pack_run.py``;
its import name is ours too, so it cannot share our process or our virtual environment).

``ZEPHON_PYPI_PYTHON`` names that interpreter (e.g. a venv made with ``python3 -m venv
pypi-venv && pypi-venv/bin/pip install zephon numpy``); without it the row is not measured.
Both sides count the tokens they deliver (padding not counted) per second.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np

import zephon
from zephon.ops import batch, fetch, pack_sequences
from zephon.sources import TokenShardSource

__all__ = ["SEQ_LEN", "ours_tokens_per_second", "pypi_python", "pypi_tokens_per_second"]

SEQ_LEN = 2048
OPEN_BINS = 64
BATCH = 8


def ours_tokens_per_second(idx: Path) -> tuple[float, int]:
    """``(tokens/s, tokens)`` delivered by ``fetch -> pack_sequences(SEQ_LEN) -> batch(BATCH)``
    over the Megatron pair at ``idx`` (the shard's metadata read before the clock starts);
    nothing is dropped, so the tokens are all the input's."""
    source = TokenShardSource(idx, chunk_size=1024)
    source.num_samples()
    ops = [fetch(), pack_sequences(SEQ_LEN, open_bins=OPEN_BINS, pad_id=0), batch(BATCH)]
    pipeline = zephon.Pipeline(source, ops)  # built before the clock, as the PyPI zephon's is
    delivered = 0
    began = time.perf_counter()
    with pipeline.iter() as loader:
        for item in loader:
            delivered += int(np.count_nonzero(item.payload["segment_ids"]))  # 0: padding
    return delivered / (time.perf_counter() - began), delivered


def pypi_python() -> str | None:
    """The PyPI zephon's interpreter (``$ZEPHON_PYPI_PYTHON``), or None."""
    return os.environ.get("ZEPHON_PYPI_PYTHON") or None


def pypi_tokens_per_second(idx: Path, python: str) -> tuple[float, int]:
    """``(tokens/s, tokens)`` delivered by the PyPI zephon's packing of the same documents,
    measured by ``python`` running ``pypi_pack_run.py``."""
    script = Path(__file__).with_name("pypi_pack_run.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [python, str(script), str(idx), str(SEQ_LEN), str(OPEN_BINS), str(BATCH)],
        capture_output=True,
        text=True,
        env=env,
        cwd=idx.parent,
        timeout=600,
        check=True,
    )
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return out["tokens"] / out["seconds"], int(out["tokens"])
