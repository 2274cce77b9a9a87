# mypy: ignore-errors
# (checked against our own package of the same name, which has none of the names it uses)
"""Packing on the pure-Python loader published on PyPI as ``zephon``, run as a script by that
package's own interpreter, never imported by ours (the import names clash):

    PYPI_PYTHON pypi_pack_run.py TOKENS.idx SEQ_LEN OPEN_BINS BATCH

It reads the Megatron pair's documents into in-memory shards of 1,024 int32 arrays before the
clock starts (its best case: no I/O, no conversion), then times ``pack_flat(SEQ_LEN,
num_bins=OPEN_BINS, algorithm="best_fit") -> batch(BATCH)`` over one pass, and prints one JSON
line: tokens delivered (padding not counted), documents in and seconds.
"""

import json
import struct
import sys

import numpy as np
from pypi_common import one_pass_source, packed_tokens, timed_pass

from zephon import Pipeline


def main(idx: str, seq_len: int, open_bins: int, batch: int) -> None:
    with open(idx, "rb") as fh:
        raw = fh.read()
    docs = struct.unpack_from("<Q", raw, 18)[0]
    lengths = np.frombuffer(raw, "<i4", count=docs, offset=34)
    pointers = np.frombuffer(raw, "<i8", count=docs, offset=34 + 4 * docs) // 2
    tokens = np.memmap(idx[: -len(".idx")] + ".bin", dtype=np.uint16, mode="r")
    rows = [
        {"tokens": np.asarray(tokens[p : p + n], dtype=np.int32)}
        for p, n in zip(pointers.tolist(), lengths.tolist())
    ]
    pipeline = (
        Pipeline(one_pass_source("tokens", rows))
        .pack_flat(seq_len, num_bins=open_bins, algorithm="best_fit", pad_token_id=0)
        .batch(batch, drop_last=False)
    )
    delivered, seconds = timed_pass(pipeline, packed_tokens("tokens"))
    print(json.dumps({"tokens": delivered, "documents": int(docs), "seconds": seconds}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
