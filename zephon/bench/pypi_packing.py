"""Packing on token shards against the pure-Python zephon on PyPI:
``fetch -> pack_sequences(2048) -> batch(8)`` over a Megatron pair read by ``TokenShardSource``,
and the PyPI zephon's ``pack_flat`` (best fit, 64 open bins, the same batch) over the same
documents, run by that package's own interpreter in a separate process (``pypi_pack_run.py``;
its import name is ours too, so it cannot share our process or our virtual environment).

``ZEPHON_PYPI_PYTHON`` names that interpreter (``zephon.bench.pypi``); without it the row is
not measured. Both sides count the tokens they deliver (padding not counted) per second.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

import zephon
from zephon.bench.pypi import run_script
from zephon.ops import batch, fetch, pack_sequences
from zephon.sources import TokenShardSource

__all__ = ["SEQ_LEN", "ours_tokens_per_second", "pypi_tokens_per_second"]

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


def pypi_tokens_per_second(idx: Path, python: str) -> tuple[float, int]:
    """``(tokens/s, tokens)`` delivered by the PyPI zephon's packing of the same documents,
    measured by ``python`` running ``pypi_pack_run.py``."""
    args = [str(idx), str(SEQ_LEN), str(OPEN_BINS), str(BATCH)]
    out = run_script("pypi_pack_run.py", args, python, cwd=idx.parent)
    return out["tokens"] / out["seconds"], int(out["tokens"])
