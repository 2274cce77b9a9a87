"""Files cut into fixed-size blocks, each with a content digest: how sources of formats without
their own checksums (token shards, MDS shards) identify a file and read byte spans of it remotely.

``block_table`` digests a whole file once, in ``block`` bytes per range (the last one shorter).
``read_spans`` reads byte spans through whole blocks, one ranged read per run of neighbouring
blocks, each block compared with its digest before any byte of it is returned.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zephon.sources.files import DigestTable

__all__ = ["ChangedBlock", "block_table", "read_spans", "regular_table"]


class ChangedBlock(Exception):
    """A block whose bytes no longer match its digest: ``block`` and its ``(start, end)``."""

    def __init__(self, block: int, start: int, end: int):
        super().__init__(f"block {block} (bytes {start}..{end})")
        self.block = block
        self.start = start
        self.end = end


def regular_table(size: int, block: int, digests: Any) -> DigestTable:
    """The table of a ``size``-byte file in ``block``-byte ranges with these digests."""
    edges = np.arange(0, size, block, dtype=np.int64)
    return DigestTable(edges, np.minimum(block, size - edges), digests)


def block_table(fh: Any, size: int, block: int) -> DigestTable:
    """The digests of a file object's ``size`` bytes in ``block``-byte ranges (read in full)."""
    edges = np.arange(0, size, block, dtype=np.int64)

    def read_at(offset: int, nbytes: int) -> Any:
        fh.seek(offset)
        return fh.read(nbytes)

    return DigestTable.build(read_at, edges, np.minimum(block, size - edges))


def read_spans(
    fh: Any, table: DigestTable, block: int, starts: list[int], ends: list[int]
) -> list[bytes]:
    """The bytes ``[starts[k], ends[k])`` of a pyarrow file (``read_at``), read in whole checked
    blocks; ``ChangedBlock`` for a block whose digest no longer matches."""
    wanted = sorted(
        {
            b
            for a, e in zip(starts, ends, strict=True)
            if e > a
            for b in range(a // block, (e - 1) // block + 1)
        }
    )
    got: dict[int, memoryview] = {}
    k = 0
    while k < len(wanted):
        m = k + 1
        while m < len(wanted) and wanted[m] == wanted[m - 1] + 1:
            m += 1
        first, _ = table.span(wanted[k])
        _, last = table.span(wanted[m - 1])
        data = memoryview(fh.read_at(last - first, first))
        for b in wanted[k:m]:
            lo, hi = table.span(b)
            piece = data[lo - first : hi - first]
            if not table.matches(b, piece):
                raise ChangedBlock(b, lo, hi)
            got[b] = piece
        k = m
    out = []
    for a, e in zip(starts, ends, strict=True):
        if e <= a:
            out.append(b"")
            continue
        out.append(
            b"".join(
                bytes(got[b][max(a, b * block) - b * block : min(e, (b + 1) * block) - b * block])
                for b in range(a // block, (e - 1) // block + 1)
            )
        )
    return out
