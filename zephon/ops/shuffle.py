"""``shuffle``: a seeded window shuffle, and ``HeldOffsets``, the bookkeeping every operator that
holds and reorders records needs so that a base offset never closes before its siblings leave.
"""

from __future__ import annotations

from collections.abc import Sequence

from zephon.ops.base import Operator, OpTraits, epoch_rng
from zephon.types import ContributorRef, SampleRecord

__all__ = ["HeldOffsets", "Shuffle", "shuffle"]

BaseOffset = tuple[int, int]

#: Random draws are taken from the generator in blocks of this many, so the shuffle does not
#: depend on how its input was cut into micro-batches.
_DRAW_BLOCK = 1024


class HeldOffsets:
    """Counts the base offsets carried by the records (or fragments) an operator holds, so that a
    reordering operator lets the closing contributor of a base offset leave with the *last* record
    carrying that offset, never before a sibling it still holds.

    ``hold(refs)`` when a record enters, ``release(refs)`` when it leaves (emitted or dropped):
    ``release`` returns the refs to emit, with a closing flag moved off a record that leaves while
    siblings are still held and onto the last sibling to leave; ``None`` when nothing changes.
    Invariant: when nothing is held, no closing flag is owed (``idle``).
    """

    __slots__ = ("_held", "_owed")

    def __init__(self) -> None:
        self._held: dict[BaseOffset, int] = {}
        self._owed: dict[BaseOffset, bool] = {}

    @property
    def idle(self) -> bool:
        """True when no record is held and no closing flag is waiting for one."""
        return not self._held and not self._owed

    def hold(self, refs: Sequence[ContributorRef]) -> None:
        """A record carrying ``refs`` entered the operator."""
        held = self._held
        for ref in refs:
            b = ref.base_offset
            held[b] = held.get(b, 0) + 1

    def release(self, refs: Sequence[ContributorRef]) -> tuple[ContributorRef, ...] | None:
        """A record carrying ``refs`` leaves; the refs it must carry, or ``None`` if unchanged."""
        held = self._held
        owed = self._owed
        for ref in refs:
            b = ref.base_offset
            left = held[b] - 1
            if left:
                held[b] = left
            else:
                del held[b]
        if len(refs) == 1:  # the common case, without the per-offset bookkeeping below
            ref = refs[0]
            b = ref.base_offset
            if b in held:
                if ref.is_last_child:
                    owed[b] = True
                    return (ContributorRef(ref.cursor, False),)
                return None
            if owed.pop(b, False) and not ref.is_last_child:
                return (ContributorRef(ref.cursor, True),)
            return None
        if owed or held:
            # Flags only move when a closing ref leaves while its offset is still held, an owed
            # offset's last holder leaves, or one record carries an offset after closing it.
            closed_here: list[BaseOffset] = []
            for ref in refs:
                b = ref.base_offset
                if ref.is_last_child:
                    if b in held or b in owed:
                        break
                    closed_here.append(b)
                elif (b in owed and b not in held) or b in closed_here:
                    break
            else:
                return None
        else:
            closed_here = []
            for ref in refs:
                b = ref.base_offset
                if ref.is_last_child:
                    closed_here.append(b)
                elif b in closed_here:
                    break
            else:
                return None
        last: dict[BaseOffset, int] = {}
        wants: dict[BaseOffset, bool] = {}
        for i, ref in enumerate(refs):
            b = ref.base_offset
            last[b] = i
            if ref.is_last_child:
                wants[b] = True
        out: list[ContributorRef] = []
        changed = False
        for i, ref in enumerate(refs):
            b = ref.base_offset
            close = False
            if last[b] == i and (wants.get(b, False) or b in owed):
                if b in held:
                    owed[b] = True
                else:
                    close = True
                    owed.pop(b, None)
            if close != ref.is_last_child:
                changed = True
                ref = ContributorRef(ref.cursor, close)
            out.append(ref)
        return tuple(out) if changed else None

    def release_record(self, rec: SampleRecord) -> SampleRecord:
        """``release`` for a whole record: the record itself, or a copy with the moved flags."""
        refs = self.release(rec.meta.contribution_refs())
        if refs is None:
            return rec
        return SampleRecord(rec.meta.replace(contributors=refs), rec.payload)


class Shuffle(Operator):
    """A window shuffle: once ``buffer_size`` records are held, each new record takes the place of a
    random held one, which leaves; ``flush`` emits the rest in random order.

    Randomness comes only from ``epoch_rng(seed, lane, epoch)``, drawn in fixed-size blocks, so the
    order is a pure function of (seed, lane, epoch, input order). A base offset closes with the last
    of its records to leave (``HeldOffsets``).
    """

    name = "shuffle"
    traits = OpTraits(preserves_cursor_order=False, stateful=True)

    def __init__(self, buffer_size: int, *, seed: int = 0):
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"shuffle: buffer_size must be an int >= 1, got {buffer_size!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"shuffle: seed must be an int >= 0, got {seed!r}")
        self.buffer_size = buffer_size
        self.seed = seed
        self._buf: list[SampleRecord] = []
        self._offsets = HeldOffsets()
        self._rng = epoch_rng(seed, 0, 0)
        self._draws: list[float] = []
        self._next_draw = 0

    def start_epoch(self, lane_id: int, epoch: int) -> None:
        super().start_epoch(lane_id, epoch)
        self._rng = epoch_rng(self.seed, lane_id, epoch)
        self._draws = []
        self._next_draw = 0

    def _draw(self, n: int) -> int:
        """A random index in ``[0, n)`` from the next draw of the current block."""
        if self._next_draw == len(self._draws):
            self._draws = self._rng.random(_DRAW_BLOCK).tolist()
            self._next_draw = 0
        u = self._draws[self._next_draw]
        self._next_draw += 1
        return min(int(u * n), n - 1)

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        buf = self._buf
        size = self.buffer_size
        offsets = self._offsets
        out: list[SampleRecord] = []
        for rec in records:
            offsets.hold(rec.meta.contribution_refs())
            if len(buf) < size:
                buf.append(rec)
                continue
            j = self._draw(size)
            leaving = buf[j]
            buf[j] = rec
            out.append(offsets.release_record(leaving))
        return out

    def flush(self) -> list[SampleRecord]:
        buf, self._buf = self._buf, []
        if not buf:
            return []
        order = self._rng.permutation(len(buf)).tolist()
        offsets = self._offsets
        return [offsets.release_record(buf[j]) for j in order]


def shuffle(buffer_size: int, *, seed: int = 0) -> Shuffle:
    """A window shuffle over ``buffer_size`` records, seeded per lane and epoch from ``seed``;
    1 -> 1, reorders, stateful (the window empties at every epoch boundary)."""
    return Shuffle(buffer_size, seed=seed)
