"""``ensure_mixture``: keeps the realized mixture of a lane's stream on its target weights by
choosing what to emit from a buffer, and dropping (with tombstones) what would overshoot.

It is a correction, not a sampler: when it has to drop a large part of its input the source is
far from the weights, and it says so once per lane (``MixtureDropWarning``).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections import deque
from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np

from zephon.errors import CheckpointCorruptError, MixtureDropWarning
from zephon.ops.base import Operator, OpTraits
from zephon.ops.basic import record_error
from zephon.ops.children import split_in_proportion, tombstone_meta
from zephon.types import ContributorRef, SampleMeta, SampleRecord
from zephon.validation import check_int

__all__ = ["DROP_WARN_FRACTION", "MIXTURE_DROP_TAG", "EnsureMixture", "ensure_mixture"]

log = logging.getLogger("zephon")

#: The tag on the first tombstone of every record ``ensure_mixture`` drops; delivery counts these
#: in ``stats()["mixture_dropped"]``. That tombstone also carries the dropped record's
#: ``component_token_counts`` / ``component_sample_counts``, which delivery adds up per component.
MIXTURE_DROP_TAG = "mixture_dropped"
#: Dropping more than this fraction of what it sees makes ``ensure_mixture`` warn (once per lane).
DROP_WARN_FRACTION = 0.2
#: The dropped fraction is looked at after this many buffers' worth of decisions, again at every
#: doubling, and at every flush once a buffer's worth was decided -- but never before
#: ``_MIN_DECISIONS`` records were emitted or dropped: a few records say nothing.
_FIRST_CHECK_BUFFERS = 8
_MIN_DECISIONS = 256

_BY = ("tokens", "samples")
_MANY = object()
_MAX_TOTAL = (1 << 62) - 1  # a larger running total in a checkpoint is damage, not a count


def _bad_carry(field: str, why: str) -> CheckpointCorruptError:
    """A carry state this operator never wrote, naming the field (``""``: the whole state)."""
    what = f"carry state field {field}" if field else "carry state"
    return CheckpointCorruptError(
        f"ensure_mixture: {what} {why}; the checkpoint was edited or damaged, resume from an "
        "unaltered one"
    )


class _Entry:
    """A buffered record with its measure: ``amounts`` per component, ``total``, and ``comp``
    (its only component, or ``_MANY``). ``seq`` is its arrival number, the tie-breaker; ``slot``
    its row in ``_Spanning`` when it spans several components."""

    __slots__ = ("amounts", "comp", "rec", "seq", "slot", "total")

    def __init__(self, seq: int, rec: SampleRecord, amounts: dict[Hashable, int]):
        self.seq = seq
        self.rec = rec
        self.amounts = amounts
        self.total = sum(amounts.values())
        self.comp: Any = next(iter(amounts)) if len(amounts) == 1 else _MANY
        self.slot = -1


class _Spanning:
    """The buffered records that span several components (packed rows), in arrival order, with
    their amounts in a matrix so that finding the best or worst of them costs a few array
    operations rather than a Python loop over the buffer.

    The array scores only narrow the choice: every record within a rounding margin of the best
    (or worst) array score is scored again exactly as one record at a time (``EnsureMixture
    ._score``), so the decisions are those of scoring each record in Python."""

    def __init__(self, components: list[Any]):
        self.index = {c: k for k, c in enumerate(components)}
        self.entries: list[_Entry] = []  # arrival order
        self.zero: list[_Entry] = []  # of them, those measuring nothing (always candidates)
        self._amounts = np.zeros((0, len(components)))
        self._has = np.zeros((0, len(components)), dtype=bool)  # components a record names
        self._totals = np.ones(0)
        self._live = np.zeros(0, dtype=bool)
        self._slots: list[Any] = []  # the entry in each row (None: a free row)
        self._free: list[int] = []

    def __bool__(self) -> bool:
        return bool(self.entries)

    def __iter__(self) -> Any:
        return iter(self.entries)

    def append(self, entry: _Entry) -> None:
        self.entries.append(entry)
        if not entry.total:
            self.zero.append(entry)
            return
        if not self._free:
            self._grow()
        slot = entry.slot = self._free.pop()
        row, has = self._amounts[slot], self._has[slot]
        row[:] = 0.0
        has[:] = False
        for comp, amount in entry.amounts.items():
            row[self.index[comp]] = amount
            has[self.index[comp]] = True
        self._totals[slot] = entry.total
        self._live[slot] = True
        self._slots[slot] = entry

    def remove(self, entry: _Entry) -> None:
        self.entries.remove(entry)
        if not entry.total:
            self.zero.remove(entry)
            return
        self._live[entry.slot] = False
        self._slots[entry.slot] = None
        self._free.append(entry.slot)
        entry.slot = -1

    def clear(self) -> None:
        for entry in self.entries:
            entry.slot = -1
        self.entries, self.zero = [], []
        self._live[:] = False
        self._slots = [None] * len(self._slots)
        self._free = list(range(len(self._slots) - 1, -1, -1))

    def _grow(self) -> None:
        old = len(self._slots)
        new = max(16, 2 * old)
        self._amounts = np.vstack([self._amounts, np.zeros((new - old, len(self.index)))])
        self._has = np.vstack([self._has, np.zeros((new - old, len(self.index)), dtype=bool)])
        self._totals = np.concatenate([self._totals, np.ones(new - old)])
        self._live = np.concatenate([self._live, np.zeros(new - old, dtype=bool)])
        self._slots += [None] * (new - old)
        self._free += range(new - 1, old - 1, -1)

    def near(
        self, deficits: dict[Any, float], highest: bool, among: np.ndarray | None = None
    ) -> list[_Entry]:
        """The records (of ``among``, a mask of rows) whose score may be the highest (or
        lowest): those within a rounding margin of it, and those measuring nothing."""
        live = self._live if among is None else among
        if not live.any():
            return list(self.zero)
        d = np.array([deficits[c] for c in self.index], dtype=np.float64)
        amounts = self._amounts
        num = amounts[:, 0] * d[0]
        for k in range(1, len(d)):
            num += amounts[:, k] * d[k]
        scores = num / self._totals
        # A score is a weighted mean of deficits: its rounding error is far below this margin.
        margin = 1e-9 * (float(np.abs(d).max()) + 1.0)
        if highest:
            scores[~live] = -np.inf
            found = np.flatnonzero(scores >= scores.max() - margin)
        else:
            scores[~live] = np.inf
            found = np.flatnonzero(scores <= scores.min() + margin)
        slots = self._slots
        return [slots[i] for i in found.tolist()] + self.zero

    def fitting(
        self,
        totals: dict[Any, int],
        grand: int,
        limit: dict[Any, float],
        deficits: dict[Any, float],
    ) -> list[_Entry]:
        """Of the records whose emission keeps each of their components' shares within
        ``limit``, those whose score may be the highest (and those measuring nothing). The
        shares are computed as one record at a time does (integers below 2**53 are exact as
        floats, and the division is the same correctly rounded one)."""
        live = self._live
        if not live.any():
            return list(self.zero)
        after = grand + self._totals
        fits = live & (after > 0)
        shares = np.array([totals[c] for c in self.index], dtype=np.float64) + self._amounts
        over = shares / np.where(after > 0, after, 1.0)[:, None] > np.array(
            [limit[c] for c in self.index]
        )
        fits &= ~(over & self._has).any(axis=1)
        return self.near(deficits, True, fits)


class EnsureMixture(Operator):
    """Corrects the mixture of the stream towards ``weights`` (by tokens or by samples).

    The rule, with ``t_c`` the measure emitted so far of component ``c`` (carried across epochs),
    ``T = sum(t_c)``, ``w_c`` the normalized weight and ``d_c = w_c * T - t_c`` its deficit:

    - A record's score is the deficit of its component (for a record spanning several components,
      e.g. a packed one, the measure-weighted mean of their deficits).
    - A record of weight-0 components only is dropped on arrival.
    - Once ``buffer_size`` records are buffered, each new record triggers one decision: the
      buffered record with the highest score is emitted if that score is >= 0 (its component is
      not above target); otherwise (buffer full, every buffered record above target) the record
      with the lowest score, i.e. of the most over-represented component, is dropped. Ties go to
      the earliest arrival.
    - At a flush: repeatedly emit the highest-scoring record if its score is >= 0, else the
      highest-scoring record whose emission keeps each of its components' shares within
      ``w_c + tolerance``; when none is left that fits, drop the rest (in arrival order).

    Dropped records leave their tombstones; the first of each is tagged ``"mixture_dropped"`` (a
    record that owes no closing tombstone still leaves one non-closing tagged tombstone) and
    carries the record's token and sample counts per component, so ``stats()["mixture_dropped"]``
    counts dropped records and ``stats()["mixture_components"]`` their tokens and samples.

    When the records it has dropped (of components with a weight) exceed ``DROP_WARN_FRACTION``
    of what it saw (measured like the weights, in tokens or samples), it warns once per lane with
    a ``MixtureDropWarning`` naming each component's dropped fraction. A record's measure is its
    ``component_token_counts`` (``by="tokens"``) or ``component_sample_counts`` (``by="samples"``),
    else one sample of ``meta.component`` with ``len(payload[field])`` tokens; a record with sample
    counts but no token counts has its tokens split in proportion to its sample counts.
    """

    name = "ensure_mixture"
    traits = OpTraits(preserves_cursor_order=False, stateful=True)
    counted_tags = (MIXTURE_DROP_TAG,)
    emits_received_records = True

    def __init__(
        self,
        weights: Mapping[Any, float],
        *,
        by: str = "tokens",
        buffer_size: int = 256,
        tolerance: float = 0.01,
        field: str = "tokens",
    ):
        if not isinstance(weights, Mapping) or not weights:
            raise ValueError(
                "ensure_mixture: weights must be a non-empty mapping component -> weight"
            )
        clean: dict[Any, float] = {}
        for comp, w in weights.items():
            if isinstance(w, bool) or not isinstance(w, (int, float)):
                raise TypeError(f"ensure_mixture: weight of {comp!r} must be a number, got {w!r}")
            if not math.isfinite(w) or w < 0:
                raise ValueError(f"ensure_mixture: weight of {comp!r} must be >= 0, got {w}")
            clean[comp] = float(w)
        total = sum(clean.values())
        if total <= 0:
            raise ValueError("ensure_mixture: at least one weight must be > 0")
        if by not in _BY:
            raise ValueError(f"ensure_mixture: by must be one of {_BY}, got {by!r}")
        buffer_size = check_int(buffer_size, "buffer_size", "ensure_mixture", minimum=1)
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or tolerance < 0:
            raise ValueError(f"ensure_mixture: tolerance must be a number >= 0, got {tolerance!r}")
        self.weights = clean
        self.by = by
        self.buffer_size = buffer_size
        self.tolerance = float(tolerance)
        self.field = field
        self._share = {c: w / total for c, w in clean.items()}
        self._totals: dict[Any, int] = dict.fromkeys(clean, 0)
        self._grand = 0
        self._queues: dict[Any, deque[_Entry]] = {c: deque() for c in clean}
        self._multi = _Spanning(list(clean))
        self._count = 0
        self._seq = 0
        # What it saw and dropped per weighted component, for the warning only (never carried).
        self._seen: dict[Any, int] = dict.fromkeys(clean, 0)
        self._dropped: dict[Any, int] = dict.fromkeys(clean, 0)
        self._decided = 0
        self._next_check = max(_FIRST_CHECK_BUFFERS * buffer_size, _MIN_DECISIONS)
        self._warned = False
        self._source_mixture: tuple[str, dict[Any, float]] | None = None  # the warning's advice

    def use_upstream_facts(self, facts: dict[str, Any]) -> None:
        """Notes how the source draws the mixture (``source_mixture``), for the warning."""
        self._source_mixture = facts.get("source_mixture")

    # ----------------------------------------------------------------------------- measure
    def _measure(self, rec: SampleRecord) -> dict[Hashable, int]:
        meta = rec.meta
        if self.by == "samples":
            counts = meta.component_sample_counts
            amounts = dict(counts) if counts else {meta.component: 1}
        else:
            tokens = meta.component_token_counts
            if tokens is not None:
                amounts = dict(tokens)
            else:
                n = self._length(rec)
                samples = meta.component_sample_counts
                if samples and len(samples) > 1:
                    amounts = dict(split_in_proportion(n, samples))
                elif samples:
                    amounts = {next(iter(samples)): n}
                else:
                    amounts = {meta.component: n}
        share = self._share
        for comp in amounts:
            if comp not in share:
                raise record_error(
                    self,
                    rec,
                    ValueError(
                        f"component {comp!r} has no weight (weights: {list(share)}); give every "
                        "component a weight (0 to drop it)"
                    ),
                )
        return amounts

    def _length(self, rec: SampleRecord) -> int:
        try:
            return len(rec.payload[self.field])
        except (KeyError, TypeError, IndexError):
            payload = rec.payload
            fields = list(payload) if isinstance(payload, dict) else type(payload).__name__
            raise record_error(
                self,
                rec,
                KeyError(
                    f"by='tokens' needs component_token_counts (set by tokenize) or a field "
                    f"{self.field!r} to count; the payload has {fields}"
                ),
            ) from None

    # ----------------------------------------------------------------------------- scores
    def _deficits(self) -> dict[Any, float]:
        grand = self._grand
        totals = self._totals
        return {c: w * grand - totals[c] for c, w in self._share.items()}

    @staticmethod
    def _score(entry: _Entry, deficits: dict[Any, float]) -> float:
        if entry.comp is not _MANY:
            return deficits[entry.comp]
        if entry.total:
            return sum(a * deficits[c] for c, a in entry.amounts.items()) / entry.total
        return sum(deficits[c] for c in entry.amounts) / len(entry.amounts)

    def _candidates(self, deficits: dict[Any, float], highest: bool) -> list[_Entry]:
        """The head of each component's queue (the earliest of equal scores) and the records
        spanning several components whose score may be the highest (or lowest)."""
        heads = [q[0] for q in self._queues.values() if q]
        return heads + self._multi.near(deficits, highest) if self._multi else heads

    def _best(self, deficits: dict[Any, float]) -> tuple[_Entry, float]:
        best: _Entry | None = None
        best_score = 0.0
        for e in self._candidates(deficits, True):
            s = self._score(e, deficits)
            if best is None or s > best_score or (s == best_score and e.seq < best.seq):
                best, best_score = e, s
        assert best is not None
        return best, best_score

    def _worst(self, deficits: dict[Any, float]) -> _Entry:
        worst: _Entry | None = None
        worst_score = 0.0
        for e in self._candidates(deficits, False):
            s = self._score(e, deficits)
            if worst is None or s < worst_score or (s == worst_score and e.seq < worst.seq):
                worst, worst_score = e, s
        assert worst is not None
        return worst

    # ----------------------------------------------------------------------------- leaving
    def _remove(self, entry: _Entry) -> None:
        if entry.comp is _MANY:
            self._multi.remove(entry)
        else:
            queue = self._queues[entry.comp]
            if queue[0] is entry:
                queue.popleft()
            else:
                queue.remove(entry)
        self._count -= 1

    def _emit(self, entry: _Entry) -> SampleRecord:
        totals = self._totals
        for comp, amount in entry.amounts.items():
            totals[comp] += amount
        self._grand += entry.total
        return entry.rec

    def _drop(self, rec: SampleRecord, amounts: dict[Hashable, int]) -> list[SampleRecord]:
        """The tombstones of a dropped record, the first tagged ``MIXTURE_DROP_TAG`` and carrying
        the record's tokens (its token counts, or its measure by tokens) and samples."""
        src = rec.meta
        tokens = src.component_token_counts
        if tokens is None and self.by == "tokens":
            tokens = amounts
        samples = src.component_sample_counts or {src.component: 1}
        metas = [tombstone_meta(r, src.lane_id) for r in src.contribution_refs() if r.is_last_child]
        if not metas:  # it owes none, but one that closes nothing still carries the counts
            ref = ContributorRef(src.cursor, False)
            metas = [
                SampleMeta(src.cursor, lane_id=src.lane_id, contributors=(ref,), is_tombstone=True)
            ]
        metas[0] = metas[0].replace(
            tags=metas[0].tags | {MIXTURE_DROP_TAG},
            component_token_counts=dict(tokens) if tokens else None,
            component_sample_counts=dict(samples),
        )
        return [SampleRecord(meta, None) for meta in metas]

    def _drop_entry(self, entry: _Entry) -> list[SampleRecord]:
        dropped = self._dropped
        for comp, amount in entry.amounts.items():
            dropped[comp] += amount
        return self._drop(entry.rec, entry.amounts)

    # ----------------------------------------------------------------------------- the warning
    def _decision_made(self) -> None:
        self._decided += 1
        if self._decided >= self._next_check:
            self._next_check *= 2
            self._check_drops()

    def _check_drops(self) -> None:
        """Warn (once) when more than ``DROP_WARN_FRACTION`` of what was seen was dropped."""
        if self._warned:
            return
        seen = sum(self._seen.values())
        dropped = sum(self._dropped.values())
        if not seen or dropped <= DROP_WARN_FRACTION * seen:
            return
        self._warned = True
        unit = "tokens" if self.by == "tokens" else "samples"
        parts = ", ".join(
            f"{c!r} {self._dropped[c] / n:.0%} of {n}" for c, n in self._seen.items() if n
        )
        text = (
            f"ensure_mixture dropped {dropped / seen:.0%} of the {unit} it saw on lane "
            f"{self.lane_id} ({parts}) to reach the weights {self._share}: its input is far from "
            f"them. {self._advice()}"
        )
        log.warning(text)
        warnings.warn(text, MixtureDropWarning, stacklevel=2)

    def _advice(self) -> str:
        """What to change, given how the source draws the mixture (``source_mixture``)."""
        source = self._source_mixture
        if source is None or source[0] != "tokens":
            return (
                "Weigh the source by tokens (MixtureSource(..., by='tokens') with "
                "length_column=, tokens_per_byte= or tokenizer=) so that ensure_mixture only "
                "trims the residual drift"
            )
        shares = source[1]
        if set(shares) != set(self._share) or any(
            abs(shares[c] - share) > 1e-9 for c, share in self._share.items()
        ):
            return (
                f"The source weighs by tokens towards {shares}: give it and ensure_mixture the "
                "same weights"
            )
        if self.by != "tokens":
            return (
                "The source weighs by tokens while ensure_mixture weighs samples: give "
                "ensure_mixture by='tokens' as well"
            )
        return (
            "The source already weighs by tokens, so its token estimates are far from the tokens "
            "that reach ensure_mixture: estimate them from the real thing (MixtureSource(..., "
            "tokenizer=) with the tokenizer of tokenize, or length_column= with each sample's "
            "token count) so that ensure_mixture only trims the residual drift"
        )

    # ----------------------------------------------------------------------------- operator
    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        out: list[SampleRecord] = []
        share = self._share
        for rec in records:
            amounts = self._measure(rec)
            if not amounts:  # measures nothing (e.g. empty counts): nothing to balance
                out.append(rec)
                continue
            if not any(share[c] for c in amounts):
                out.extend(self._drop(rec, amounts))
                continue
            seen = self._seen
            for comp, amount in amounts.items():
                seen[comp] += amount
            entry = _Entry(self._seq, rec, amounts)
            self._seq += 1
            if entry.comp is _MANY:
                self._multi.append(entry)
            else:
                self._queues[entry.comp].append(entry)
            self._count += 1
            if self._count >= self.buffer_size:
                deficits = self._deficits()
                best, score = self._best(deficits)
                if score >= 0:
                    self._remove(best)
                    out.append(self._emit(best))
                else:
                    worst = self._worst(deficits)
                    self._remove(worst)
                    out.extend(self._drop_entry(worst))
                self._decision_made()
        return out

    def flush(self) -> list[SampleRecord]:
        out: list[SampleRecord] = []
        limit = {c: w + self.tolerance for c, w in self._share.items()}
        while self._count:
            deficits = self._deficits()
            best, score = self._best(deficits)
            if score < 0:
                best = self._fitting(deficits, limit)  # type: ignore[assignment]
                if best is None:
                    break
            self._remove(best)
            out.append(self._emit(best))
            self._decided += 1
        rest = sorted(
            [e for q in self._queues.values() for e in q] + self._multi.entries, key=lambda e: e.seq
        )
        self._decided += len(rest)
        for entry in rest:
            out.extend(self._drop_entry(entry))
        for queue in self._queues.values():
            queue.clear()
        self._multi.clear()
        self._count = 0
        if self._decided >= max(self.buffer_size, _MIN_DECISIONS):
            self._check_drops()
        return out

    def _fitting(self, deficits: dict[Any, float], limit: dict[Any, float]) -> _Entry | None:
        """The highest-scoring buffered record whose emission keeps each of its components' share
        within ``w_c + tolerance`` (earliest on ties), or None."""
        totals = self._totals
        grand = self._grand
        found: _Entry | None = None
        found_score = 0.0
        for comp, queue in self._queues.items():
            if not queue:
                continue
            # (t + a) / (T + a) <= L  <=>  a <= (L*T - t) / (1 - L): the largest record that fits.
            cap = limit[comp]
            room = math.inf if cap >= 1 else (cap * grand - totals[comp]) / (1 - cap)
            entry = next((e for e in queue if e.total <= room and grand + e.total > 0), None)
            if entry is None:
                continue
            s = deficits[comp]
            if found is None or s > found_score or (s == found_score and entry.seq < found.seq):
                found, found_score = entry, s
        for e in self._multi.fitting(totals, grand, limit, deficits):
            after = grand + e.total
            if after <= 0 or any((totals[c] + a) / after > limit[c] for c, a in e.amounts.items()):
                continue
            s = self._score(e, deficits)
            if found is None or s > found_score or (s == found_score and e.seq < found.seq):
                found, found_score = e, s
        return found

    # ----------------------------------------------------------------------------- carry
    def carry_state(self) -> dict:
        """The running totals per component, as ``[component, total]`` pairs in weights order."""
        return {"totals": [[c, t] for c, t in self._totals.items()]}

    def restore_carry(self, state: dict) -> None:
        """Take back the running totals of ``carry_state``; ``CheckpointCorruptError`` naming
        the field for anything else (each weighted component once, totals >= 0)."""
        totals = dict.fromkeys(self.weights, 0)
        pairs = state.get("totals") if type(state) is dict and set(state) == {"totals"} else None
        if type(pairs) is not list:
            raise _bad_carry("", f"must be an object with one field, totals, got {state!r:.200}")
        seen: set[Any] = set()
        for i, pair in enumerate(pairs):
            if type(pair) is not list or len(pair) != 2:
                raise _bad_carry(f"totals[{i}]", f"must be a [component, total] pair: {pair!r:.80}")
            comp, total = pair
            key = tuple(comp) if type(comp) is list else comp
            try:
                known = key in totals
            except TypeError:  # an unhashable component: a list holding a list or an object
                known = False
            if not known or key in seen:
                again = "is carried twice" if known else "has no weight"
                raise _bad_carry(
                    f"totals[{i}][0]", f"component {comp!r:.80} {again} (weights: {list(totals)})"
                )
            if type(total) is not int or not 0 <= total <= _MAX_TOTAL:
                raise _bad_carry(
                    f"totals[{i}][1]", f"must be an integer in [0, {_MAX_TOTAL}], got {total!r:.80}"
                )
            seen.add(key)
            totals[key] = total
        missing = [c for c in totals if c not in seen]
        if missing:  # carry_state lists every weighted component
            raise _bad_carry("totals", f"has no total for the components {missing}")
        self._totals = totals
        self._grand = sum(totals.values())

    def holdings(self) -> tuple[list[SampleRecord], dict[str, Any]]:
        """The buffered records in arrival order, their arrival numbers, and the running totals
        and counters (components as ``[component, value]`` pairs: JSON keeps no int keys)."""
        entries = sorted(
            [e for queue in self._queues.values() for e in queue] + self._multi.entries,
            key=lambda e: e.seq,
        )

        def pairs(d: dict[Any, int]) -> list[list[Any]]:
            return [[list(c) if isinstance(c, tuple) else c, v] for c, v in d.items()]

        return [e.rec for e in entries], {
            "seqs": [e.seq for e in entries],
            "seq": self._seq,
            "totals": pairs(self._totals),
            "seen": pairs(self._seen),
            "dropped": pairs(self._dropped),
            "decided": self._decided,
            "next_check": self._next_check,
            "warned": self._warned,
        }

    def restore_holdings(self, records: list[SampleRecord], state: dict[str, Any]) -> None:
        seqs = state["seqs"]
        if len(seqs) != len(records) or len(records) >= self.buffer_size:
            raise ValueError(f"ensure_mixture: {len(records)} held records for {len(seqs)} seqs")

        def counts(pairs: list[list[Any]]) -> dict[Any, int]:
            out = dict.fromkeys(self.weights, 0)
            for comp, value in pairs:
                key = tuple(comp) if isinstance(comp, list) else comp
                if key not in out:
                    raise ValueError(f"ensure_mixture: held component {key!r} has no weight")
                out[key] = int(value)
            return out

        self._queues = {c: deque() for c in self.weights}
        self._multi = _Spanning(list(self.weights))
        for seq, rec in zip(seqs, records):
            entry = _Entry(int(seq), rec, self._measure(rec))
            if entry.comp is _MANY:
                self._multi.append(entry)
            else:
                self._queues[entry.comp].append(entry)
        self._count = len(records)
        self._seq = int(state["seq"])
        self._totals = counts(state["totals"])
        self._grand = sum(self._totals.values())
        self._seen = counts(state["seen"])
        self._dropped = counts(state["dropped"])
        self._decided = int(state["decided"])
        self._next_check = int(state["next_check"])
        self._warned = bool(state["warned"])

    def target_mixture(self) -> tuple[str, dict[Any, float]]:
        """``(by, normalized weights)``: the shares this operator steers the stream to."""
        return self.by, dict(self._share)

    def realized(self) -> dict[Any, float]:
        """The share of each component in what this operator has emitted so far (all 0 before)."""
        grand = self._grand
        return {c: (t / grand if grand else 0.0) for c, t in self._totals.items()}


def ensure_mixture(
    weights: Mapping[Any, float],
    *,
    by: str = "tokens",
    buffer_size: int = 256,
    tolerance: float = 0.01,
    field: str = "tokens",
) -> EnsureMixture:
    """Keep each lane's realized mixture on ``weights`` (by ``"tokens"`` or ``"samples"``): emit
    from a ``buffer_size`` buffer the record of the component furthest below target, drop (with
    tagged tombstones) what stays above it; totals survive epochs through ``carry_state``. 1 -> 0/1,
    reorders, stateful. See ``EnsureMixture`` for the exact rule."""
    return EnsureMixture(weights, by=by, buffer_size=buffer_size, tolerance=tolerance, field=field)
