# mypy: ignore-errors
# (checked against our own package of the same name, which has none of the names it uses)
"""The map pipeline on the pure-Python loader published on PyPI as ``zephon``, run as a script by
that package's own interpreter, never imported by ours (the import names clash):

    PYPI_PYTHON pypi_map_run.py RECORDS BATCH RUNNER

It holds ``{"idx": i}`` for ``i < RECORDS`` in in-memory shards of 1,024 before the clock starts
(its best case: the payloads exist already), then times ``map_transform(square) ->
batch(BATCH)`` over one pass with its ``RUNNER`` (``inline``, or ``default``: the runner it picks
itself), and prints one JSON line: records delivered and seconds. ``square`` is the map function
of ``zephon.bench.pipeline``.
"""

import json
import sys

from pypi_common import one_pass_source, timed_pass

from zephon import Pipeline


def square(payload):
    idx = payload["idx"]
    return {"idx": idx, "square": idx * idx}


def main(records: int, batch: int, runner: str) -> None:
    rows = [{"idx": i} for i in range(records)]
    pipeline = (
        Pipeline(one_pass_source("range", rows)).map_transform(square).batch(batch, drop_last=False)
    )
    if runner != "default":
        pipeline = pipeline.options(runner=runner)
    delivered, seconds = timed_pass(pipeline, lambda item: len(item.records))
    print(json.dumps({"records": delivered, "seconds": seconds}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
