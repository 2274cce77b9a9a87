"""``shuffle``: a seeded window shuffle, on the epoch eviction path.

Like every operator that reorders, it passes contributors through unchanged: a closing record may
leave before a sibling it still holds, which is fine on the epoch path (eviction waits for the epoch
marker, and only a second *closing* contributor or an evicted chunk is an early close).
"""

from __future__ import annotations

from typing import Any

from zephon.ops.base import Operator, OpTraits, epoch_rng
from zephon.types import SampleRecord
from zephon.validation import check_int

__all__ = ["Shuffle", "shuffle"]

#: Random draws are taken from the generator in blocks of this many, so the shuffle does not
#: depend on how its input was cut into micro-batches.
_DRAW_BLOCK = 1024


class Shuffle(Operator):
    """A window shuffle: once ``buffer_size`` records are held, each new record takes the place of a
    random held one, which leaves; ``flush`` emits the rest in random order.

    Randomness comes only from ``epoch_rng(seed, lane, epoch)``, drawn in fixed-size blocks, so the
    order is a pure function of (seed, lane, epoch, input order). Records leave unchanged.
    """

    name = "shuffle"
    traits = OpTraits(preserves_cursor_order=False, stateful=True)
    emits_received_records = True

    def __init__(self, buffer_size: int, *, seed: int = 0):
        self.buffer_size = check_int(buffer_size, "buffer_size", "shuffle", minimum=1)
        self.seed = check_int(seed, "seed", "shuffle", minimum=0)
        self._buf: list[SampleRecord] = []
        self._rng = epoch_rng(seed, 0, 0)
        self._draws: list[float] = []
        self._next_draw = 0
        self._block_state: dict[str, Any] | None = None  # the generator before the current block

    def start_epoch(self, lane_id: int, epoch: int) -> None:
        super().start_epoch(lane_id, epoch)
        self._rng = epoch_rng(self.seed, lane_id, epoch)
        self._draws = []
        self._next_draw = 0
        self._block_state = None

    def _draw(self, n: int) -> int:
        """A random index in ``[0, n)`` from the next draw of the current block."""
        if self._next_draw == len(self._draws):
            self._block_state = dict(self._rng.bit_generator.state)
            self._draws = self._rng.random(_DRAW_BLOCK).tolist()
            self._next_draw = 0
        u = self._draws[self._next_draw]
        self._next_draw += 1
        return min(int(u * n), n - 1)

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        buf = self._buf
        size = self.buffer_size
        out: list[SampleRecord] = []
        for rec in records:
            if len(buf) < size:
                buf.append(rec)
                continue
            j = self._draw(size)
            leaving = buf[j]
            buf[j] = rec
            out.append(leaving)
        return out

    def holdings(self) -> tuple[list[SampleRecord], dict[str, Any]]:
        """The window, and where the generator stands (its state before the current block of
        draws, and the next draw in it)."""
        return list(self._buf), {"block": self._block_state, "next": self._next_draw}

    def restore_holdings(self, records: list[SampleRecord], state: dict[str, Any]) -> None:
        if len(records) > self.buffer_size or not 0 <= state["next"] <= _DRAW_BLOCK:
            raise ValueError(f"shuffle: {len(records)} held records, next draw {state['next']}")
        self._buf = list(records)
        if state["block"] is not None:
            self._rng.bit_generator.state = state["block"]
            self._block_state = state["block"]
            self._draws = self._rng.random(_DRAW_BLOCK).tolist()
        self._next_draw = state["next"]

    def flush(self) -> list[SampleRecord]:
        buf, self._buf = self._buf, []
        if not buf:
            return []
        order = self._rng.permutation(len(buf)).tolist()
        return [buf[j] for j in order]


def shuffle(buffer_size: int, *, seed: int = 0) -> Shuffle:
    """A window shuffle over ``buffer_size`` records, seeded per lane and epoch from ``seed``;
    1 -> 1, reorders, stateful (the window empties at every epoch boundary)."""
    return Shuffle(buffer_size, seed=seed)
