"""Writers of pre-tokenized files for the tests: Megatron's indexed dataset in its documented
layout (written with numpy, as megatron-core's ``_IndexWriter`` lays it out) and flat arrays."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

#: megatron-core's ``DType`` codes of the dtypes the tests write.
MEGATRON_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int32): 4, np.dtype(np.uint16): 8}
MEGATRON_CODES[np.dtype(np.int64)] = 5


def write_megatron(
    prefix: Path, documents: list[list[np.ndarray]], dtype: type = np.uint16
) -> Path:
    """``<prefix>.bin`` and ``<prefix>.idx``: each document a list of sequences, written back to
    back; the index holds the header (magic, version 1, dtype code, sequence and document-entry
    counts), the int32 sequence lengths, the int64 byte pointers and the int64 document indices
    (the first sequence of each document, then the sequence count). Returns the ``.idx`` path."""
    dt = np.dtype(dtype)
    sequences = [np.asarray(s, dtype=dt) for doc in documents for s in doc]
    lengths = np.array([s.size for s in sequences], dtype="<i4")
    pointers = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)[:-1])) * dt.itemsize
    doc_index = np.concatenate(([0], np.cumsum([len(doc) for doc in documents]))).astype("<i8")
    little = dt.newbyteorder("<")
    Path(f"{prefix}.bin").write_bytes(b"".join(s.astype(little).tobytes() for s in sequences))
    counts = struct.pack("<QBQQ", 1, MEGATRON_CODES[dt], len(lengths), len(doc_index))
    header = b"MMIDIDX\x00\x00" + counts
    body = lengths.tobytes() + pointers.astype("<i8").tobytes() + doc_index.tobytes()
    idx = Path(f"{prefix}.idx")
    idx.write_bytes(header + body)
    return idx


def documents(start: int, n: int, scale: int = 500) -> list[np.ndarray]:
    """Documents ``start .. start+n-1``; token ``j`` of document ``d`` is ``d * scale + j + 1``
    (never 0, the end-of-sequence id of the flat files), lengths 1 .. 37."""
    return [
        np.arange(1, 2 + (d * 7) % 37, dtype=np.int64) + d * scale for d in range(start, start + n)
    ]


def flat_with_eos(docs: list[np.ndarray], eos: int = 0) -> np.ndarray:
    """The documents back to back, each followed by ``eos``."""
    return np.concatenate([np.append(d, eos) for d in docs])
