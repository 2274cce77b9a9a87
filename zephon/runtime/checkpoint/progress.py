"""What a lane had consumed of its in-flight epoch, by position: for a resume with changed
operators behind one that reorders records.

A checkpoint says what a lane delivered in its retained epoch as the stream its operators make:
a replay cursor, and the count and digest of the records up to it. Changed operators make
another stream, and behind a reordering operator (a shuffle buffer, a best-fit packer, a
mixture evener) the delivered records cannot be found in it by their position. So on that path
a checkpoint also keeps ``progress``: the lane-local chunks of the epoch it had opened, the
offsets of them still open (not delivered or dropped), and which of those open samples had a
part delivered already (a sample split over several records).

A resume with changed operators turns that into a screen (``screened``): the run restarts at
the epoch's first chunk with the new operators, every sample closed at the checkpoint is taken
out at fetch and booked as delivered before (it never reaches an operator), and every other
sample goes through the new operators. The screen stays in the states taken after it until the
epoch's marker, so that a later resume re-makes the same stream. A sample partly delivered at
the checkpoint cannot be resumed that way (which of the new operators' parts were delivered
cannot be told): the run is then replayed as usual, which works only when the new operators
make the same records as the old ones.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from zephon.compact import pack_bits, pack_ints, unpack_bits, unpack_ints
from zephon.errors import CheckpointCorruptError
from zephon.runtime.checkpoint.layout import Run


@dataclass(frozen=True)
class EpochProgress:
    """Lane-local chunks ``[start, next)`` of an epoch were opened. ``chunks`` lists, per row, a
    chunk position with an open offset and how many of its first offsets ``open`` covers (up to
    its last open one): ``open`` is those bits, chunk after chunk (True: open). ``partial`` is
    the ``(position, offset)`` of each sample that had a part delivered and a part not: open, or
    closed by its last part while an earlier one still waited in an operator."""

    start: int
    next: int
    chunks: np.ndarray  # (rows, 2) int64: position, offsets covered
    open: np.ndarray  # bool, one per covered offset
    partial: np.ndarray  # (rows, 2) int64

    @classmethod
    def of_open(
        cls,
        start: int,
        nxt: int,
        positions: np.ndarray,
        offsets: np.ndarray,
        partial: set[tuple[int, int]],
        unfinished: set[tuple[int, int]] | frozenset[tuple[int, int]] = frozenset(),
    ) -> EpochProgress:
        """From the open offsets of the opened chunks, one ``(position, offset)`` per entry,
        and the samples of which a part was delivered (those still open are kept, and those in
        ``unfinished``: closed by their last part while an earlier part was not delivered)."""
        pos = np.asarray(positions, dtype=np.int64)
        off = np.asarray(offsets, dtype=np.int64)
        ids = np.unique(pos)
        lengths = np.array([int(off[pos == p].max()) + 1 for p in ids.tolist()], dtype=np.int64)
        bits = np.zeros(int(lengths.sum()), dtype=bool)
        begins = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        if len(pos):
            bits[begins[np.searchsorted(ids, pos)] + off] = True
        row = {p: (int(b), int(n)) for p, b, n in zip(ids.tolist(), begins, lengths)}
        still = sorted(
            {
                (p, o)
                for p, o in partial
                if p in row and o < row[p][1] and bits[row[p][0] + o]  # still open
            }
            | set(unfinished)
        )
        parts = np.array(still, dtype=np.int64).reshape(-1, 2)
        return cls(start, nxt, np.stack([ids, lengths], axis=1).reshape(-1, 2), bits, parts)

    def encode(self) -> dict[str, Any]:
        return {
            "next": self.next,
            "chunks": pack_ints(self.chunks.ravel()),
            "open": pack_bits(self.open),
            "partial": pack_ints(self.partial.ravel()),
        }

    @classmethod
    def decode(cls, value: Any, where: str, start: int, per_epoch: int) -> EpochProgress:
        """``value`` (a state's ``progress`` or ``screened``) for a window starting at lane
        chunk ``start``, every field checked."""
        if type(value) is not dict or set(value) != {"next", "chunks", "open", "partial"}:
            raise _corrupt(
                where, "must be null or an object with fields next, chunks, open, partial"
            )
        nxt = value["next"]
        if type(nxt) is not int or not start <= nxt <= start + per_epoch:
            raise _corrupt(
                f"{where}.next", f"must be a lane chunk in [{start}, {start + per_epoch}]: {nxt!r}"
            )
        chunks = _ints(value["chunks"], f"{where}.chunks", 2, "(chunk, offsets) pairs")
        if len(chunks) and bool((chunks[:, 1] < 1).any()):
            raise _corrupt(f"{where}.chunks", "covers no offset of a chunk")
        if len(np.unique(chunks[:, 0])) != len(chunks):
            raise _corrupt(f"{where}.chunks", "names a chunk twice")
        try:
            bits = unpack_bits(value["open"], int(chunks[:, 1].sum()))
        except ValueError as exc:
            raise _corrupt(f"{where}.open", str(exc)) from None
        parts = _ints(value["partial"], f"{where}.partial", 2, "(chunk, offset) pairs")
        return cls(start, nxt, chunks, bits, parts)

    @property
    def partly_delivered(self) -> set[tuple[int, int]]:
        """The ``(position, offset)`` of the open samples that had a part delivered."""
        return set(map(tuple, self.partial.tolist()))

    def closed(self, k: int, position: int, first: int, end: int) -> np.ndarray | None:
        """Which offsets ``[first, end)`` of lane chunk ``k`` (at ``position``) were closed at
        the checkpoint (a bool per offset), or None when none was."""
        if not self.start <= k < self.next:
            return None
        mask = np.ones(end - first, dtype=bool)
        rows = np.flatnonzero(self.chunks[:, 0] == position)
        if len(rows):
            row = int(rows[0])
            begin = int(self.chunks[:row, 1].sum())
            covered = int(self.chunks[row, 1])
            hi = min(end, covered)
            if first < hi:
                mask[: hi - first] = ~self.open[begin + first : begin + hi]
        return mask if mask.any() else None


def after_change(run: Run) -> Run:
    """``run`` as a resume with changed operators behind a reordering one continues it: from
    its epoch's first chunk, what was consumed by then screened out at fetch. When the
    checkpoint does not say what was consumed (an older state), or a sample was partly
    delivered, ``run`` as it is: its replay must then meet the delivered records again."""
    if run.cursor is None and run.held is None and run.screened is None:
        return run  # nothing of the epoch was delivered: the new operators start it
    progress = run.progress
    if progress is None or len(progress.partial):
        return run
    screened = replace(progress, partial=np.zeros((0, 2), dtype=np.int64))
    return replace(run, cursor=None, count=0, digest=0, held=None, progress=None, screened=screened)


def _ints(text: Any, where: str, width: int, what: str) -> np.ndarray:
    try:
        flat = unpack_ints(text)
    except ValueError as exc:
        raise _corrupt(where, str(exc)) from None
    if len(flat) % width:
        raise _corrupt(where, f"must hold {what}")
    return flat.reshape(-1, width).copy()


def _corrupt(where: str, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"loader state field {where} {what}")
