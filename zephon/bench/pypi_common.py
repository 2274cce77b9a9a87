# mypy: ignore-errors
# (checked against our own package of the same name, which has none of the names it uses)
"""What the ``pypi_*_run.py`` scripts share. They run under the PyPI zephon's interpreter and
import this by its file name (a script's own directory comes first on ``sys.path``); our package
never imports it, since the ``zephon`` it uses is the PyPI one."""

import time

from zephon.io import Dataset, InMemoryShard
from zephon.work import MixtureSpec, StaticMixtureWorkSource

#: Records per in-memory shard and per chunk; a pass leaves out a last partial chunk.
CHUNK = 1024


def one_pass_source(name, rows):
    """``rows`` (payload dicts) as dataset ``name`` in in-memory shards of ``CHUNK``, read once,
    in order."""
    starts = range(0, len(rows), CHUNK)
    shards = {k: InMemoryShard(rows[a : a + CHUNK]) for k, a in enumerate(starts)}
    return StaticMixtureWorkSource(
        datasets=[Dataset.from_dict(name, shards)],
        mixture=MixtureSpec({name: 1.0}),
        chunk_size=CHUNK,
        shuffle_shards=False,
        stop_after_passes=1,
    )


def timed_pass(pipeline, count):
    """``(total, seconds)``: ``count(item)`` summed over one pass of ``pipeline``, timed from
    its start (planning included) to its end."""
    total = 0
    began = time.perf_counter()
    for item in pipeline:
        total += count(item)
    return total, time.perf_counter() - began


def packed_tokens(field):
    """A ``count`` for ``timed_pass``: the tokens of ``field`` in a batch of packed records,
    padding left out."""

    def count(item):
        n = 0
        for record in item.records:
            padding = record.meta.tags["_packing_metadata"]["padding_length"]
            n += len(record.payload[field]) - padding
        return n

    return count
