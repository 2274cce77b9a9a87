"""MixtureSource: several indexed sources interleaved at sample level by weight.

What the weights weigh. With ``by="samples"`` (the default) the *sample shares* ``s_c`` are the
normalized weights. With ``by="tokens"`` they are chosen so that the expected *token* shares are
the weights: ``s_c`` is proportional to ``w_c / cost_c``, where ``cost_c`` is the component's mean
tokens per sample, estimated once at construction (``zephon.sources.token_costs``) and part of
``describe()``. The layout below only ever sees the (exact, rational) ``s_c``.

How the mixture is laid out, all in closed form so ``chunk(k)`` costs O(chunk) for any ``k``:

- **Counts.** Component ``c`` holds ``A_c(T)`` of the first ``T = k * chunk_size`` mixture samples,
  where ``A(T)`` is the largest-remainder (Hamilton) apportionment of ``T`` by the sample
  shares: ``floor(s_c * T)`` each, the leftover samples to the largest fractional parts, ties by
  component name. So at every whole-chunk boundary each count is within one sample of
  ``s_c * T``. Chunk ``k`` holds ``A_c((k+1)*chunk_size) - A_c(k*chunk_size)`` samples of ``c``;
  this never goes negative because every non-zero weight must give at least one sample per chunk
  (``s_c * chunk_size >= 1``, checked at construction).
- **Slots.** Inside chunk ``k``, the ``i``-th of component ``c``'s ``m_c`` samples sits at key
  ``(i + u) / m_c``, with ``u`` in (0, 1) drawn from (seed, k, c's name) through the fixed 64-bit
  mixer; slots are sorted by key, ties by name. Each component is thus spread evenly over the chunk
  (one sample per ``1/m_c`` of it), with a seeded jitter.
- **Streams.** The ``j``-th sample of ``c`` is its *global* stream position ``j``: pass
  ``j // num_samples()`` at pass-order position ``j % num_samples()`` (through its ``samples`` and
  ``pointer_rows``), so a component's own shuffle and passes are honoured; ``passes=None`` is
  endless.
- **End** (``on_exhausted``). ``"stop"`` (the default): the mixture ends at the first sample that
  would read past the end of a component with a non-zero weight; the last chunk is the same slot
  layout, truncated. ``"repeat"``: a component that runs out is read again from its first pass,
  and the mixture ends where the last one to run out would start over. ``"redistribute"``: the
  chunk in which a component runs out drops its further slots, and from the next chunk on its
  share is spread over the components still running (in proportion to theirs), until all have
  run out; each such stretch of chunks is a *phase* with shares of its own, so any chunk is
  still computed on its own. With endless non-zero components the mixture is unbounded (for
  ``"stop"`` only when they are all endless). A mixture has one pass.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from zephon.errors import FetchError
from zephon.identity import identify
from zephon.sources.base import IndexedSource, WorkSource, check_pointers
from zephon.sources.permutation import derive_key
from zephon.sources.source_io import merge_counters
from zephon.sources.token_costs import TokenCost, estimate_cost, quantize
from zephon.types import WorkChunk
from zephon.validation import check_int

__all__ = ["MixtureSource"]

_UNIT = 2.0**-53
_BY = ("samples", "tokens")
_ON_EXHAUSTED = ("stop", "redistribute", "repeat")


@dataclass(frozen=True)
class _Phase:
    """A stretch of whole chunks laid out with one set of sample shares (``redistribute`` has a
    phase per set of components still running; the other policies have one)."""

    first_chunk: int  # the mixture chunk it starts at
    first_sample: int  # mixture samples before it
    shares: tuple[Fraction, ...]
    base: tuple[int, ...]  # each component's samples before it
    chunks: int | None  # its chunks; None when it runs on
    samples: int | None  # its samples (its last chunk may be short); None when it runs on


class MixtureSource(WorkSource):
    """Samples of several ``IndexedSource`` components interleaved so that each component's share of
    every whole-chunk prefix is within one sample of its sample share; a chunk mixes components.

    ``by="samples"``: the sample shares are the normalized weights. ``by="tokens"``: they are
    ``w_c / cost_c`` normalized, so the expected token shares are the weights; ``cost_c`` (mean
    tokens per sample) is the mean of ``length_column`` over a fixed sample of the component's
    records, or the mean UTF-8 bytes of ``text_field`` times a tokens-per-byte ratio: pinned
    (``tokens_per_byte=``, a number or a dict per component) or calibrated by ``tokenizer`` on
    ``calibration_size`` of those records; plus ``added_tokens`` (the end-of-sequence id
    ``tokenize`` appends) and, with ``image_tokens`` (a function of a raw record, such as
    ``zephon.ops.image_token_counter``), the mean image tokens of those records. See
    ``zephon.sources.token_costs``.

    ``on_exhausted`` says what happens when a component runs out: ``"stop"`` the mixture,
    ``"repeat"`` the component (until the last one runs out), or ``"redistribute"`` its weight
    over the others (until all have run out).

    Invariant: each component's samples appear in its own stream order, each stream position at most
    once (with ``"repeat"``, once per time it is read through), and never past the end of a finite
    component (see the module docstring for the layout).
    """

    def __init__(
        self,
        components: Mapping[str, IndexedSource],
        weights: Mapping[str, float],
        *,
        seed: int = 0,
        chunk_size: int = 1024,
        by: str = "samples",
        length_column: str | None = None,
        tokens_per_byte: float | Mapping[str, float] | None = None,
        tokenizer: Any = None,
        text_field: str = "text",
        added_tokens: int = 1,
        image_tokens: Callable[[Any], int] | None = None,
        estimate_size: int = 1024,
        calibration_size: int = 256,
        on_exhausted: str = "stop",
    ) -> None:
        if on_exhausted not in _ON_EXHAUSTED:
            raise ValueError(
                f"MixtureSource: on_exhausted must be one of {_ON_EXHAUSTED}, got {on_exhausted!r}"
            )
        self.on_exhausted = on_exhausted
        if not isinstance(components, Mapping) or not components:
            raise ValueError("MixtureSource: components must be a non-empty mapping name -> source")
        for name, src in components.items():
            if not isinstance(name, str):
                raise TypeError(f"MixtureSource: component names must be str, got {name!r}")
            if not isinstance(src, IndexedSource):
                raise TypeError(
                    f"MixtureSource: component {name!r} must be an IndexedSource "
                    f"(RangeSource, ListSource, ...), got {type(src).__name__}"
                )
        self.seed = check_int(seed, "seed", "MixtureSource")
        self.chunk_size = check_int(chunk_size, "chunk_size", "MixtureSource", minimum=1)
        names = sorted(components)
        self._names: tuple[str, ...] = tuple(names)
        self._sources: tuple[IndexedSource, ...] = tuple(components[n] for n in names)

        owner: dict[int, str] = {}
        for name, src in zip(names, self._sources, strict=True):
            if src.dataset_id in owner:
                raise ValueError(
                    f"MixtureSource: components {owner[src.dataset_id]!r} and {name!r} share "
                    f"dataset_id {src.dataset_id}; give each component its own dataset_id"
                )
            owner[src.dataset_id] = name
        self._index_of_id = {did: names.index(name) for did, name in owner.items()}
        self._announced: dict[int, None] = {}  # chunk positions handed to ``upcoming`` lately

        self._weights = self._check_weights(weights)
        if by not in _BY:
            raise ValueError(f"MixtureSource: by must be one of {_BY}, got {by!r}")
        self.by = by
        self._costs: dict[str, TokenCost] = {}
        # checked whatever ``by`` is: an argument is refused the same way wherever it is used
        added = check_int(added_tokens, "added_tokens", "MixtureSource", minimum=0)
        size = check_int(estimate_size, "estimate_size", "MixtureSource", minimum=1)
        calibrate = check_int(calibration_size, "calibration_size", "MixtureSource", minimum=1)
        if by == "tokens":
            self._estimate: dict[str, Any] = {
                "length_column": length_column,
                "text_field": text_field,
                "added_tokens": added,
                "estimate_size": size,
                "calibration_size": calibrate,
            }
            if image_tokens is not None:
                if not callable(image_tokens):
                    raise TypeError(
                        "MixtureSource: image_tokens must be a function of a raw record giving "
                        f"its image tokens (e.g. image_token_counter(...)), got {image_tokens!r}"
                    )
                # only when given: the estimates of mixtures without images keep their identity
                self._estimate["image_tokens"] = identify(
                    image_tokens, where="MixtureSource parameter 'image_tokens'"
                )
            pinned = self._check_ratios(tokens_per_byte)
            for name, src, w in zip(names, self._sources, self._weights, strict=True):
                if w:
                    self._costs[name] = estimate_cost(
                        name,
                        src,
                        length_column=length_column,
                        text_field=text_field,
                        tokens_per_byte=pinned.get(name),
                        tokenizer=tokenizer,
                        estimate_size=size,
                        calibration_size=calibrate,
                        added_tokens=added,
                        image_tokens=image_tokens,
                    )
            raw = [
                Fraction(w) / self._costs[n].tokens_per_sample if w else Fraction(0)
                for n, w in zip(names, self._weights, strict=True)
            ]
        else:
            given = {
                "length_column": length_column,
                "tokens_per_byte": tokens_per_byte,
                "tokenizer": tokenizer,
                "image_tokens": image_tokens,
            }
            used = [k for k, v in given.items() if v is not None]
            if used:
                raise ValueError(
                    f"MixtureSource: {', '.join(used)} only apply with by='tokens' (by={by!r} "
                    "apportions samples)"
                )
            raw = [Fraction(w) for w in self._weights]
        total = sum(raw)
        self._shares = tuple(r / total for r in raw)
        # Pre-tokenized components sharing one token field: fetch counts their tokens.
        fields = {src.token_field for src in self._sources}
        self.token_field = fields.pop() if len(fields) == 1 else None
        for name, share in zip(names, self._shares, strict=True):
            if share and share * self.chunk_size < 1:
                per_chunk = float(share * self.chunk_size)
                raise ValueError(
                    f"MixtureSource: the weight of {name!r} gives it {per_chunk:.3g} samples per "
                    f"chunk of {self.chunk_size}; a non-zero weight needs at least one per chunk: "
                    f"use chunk_size >= {math.ceil(1 / share)}, a larger weight, or weight 0"
                )
        self._slot_tags = tuple(f"mixture-slot:{name}" for name in names)
        self._limits = tuple(
            self._available(src) if share else 0
            for src, share in zip(self._sources, self._shares, strict=True)
        )
        empty = [n for n, limit, w in zip(names, self._limits, self._weights) if w and limit == 0]
        if empty and on_exhausted == "repeat":
            raise ValueError(
                f"MixtureSource: on_exhausted='repeat' cannot repeat the empty component(s) "
                f"{empty}: give them weight 0"
            )
        if on_exhausted == "redistribute":
            self._phases = self._redistributed_phases()
            last = self._phases[-1]
            self._total = None if last.samples is None else last.first_sample + last.samples
        else:
            self._total = self._find_total()
            chunks = None if self._total is None else -(-self._total // self.chunk_size)
            self._phases = (_Phase(0, 0, self._shares, (0,) * len(names), chunks, self._total),)

    def _check_weights(self, weights: Mapping[str, float]) -> tuple[float, ...]:
        if not isinstance(weights, Mapping):
            raise TypeError("MixtureSource: weights must be a mapping name -> weight")
        for key in weights:
            if key not in self._names:
                raise ValueError(
                    f"MixtureSource: weight {key!r} names no component (components: "
                    f"{list(self._names)})"
                )
        out = []
        for name in self._names:
            if name not in weights:
                raise ValueError(f"MixtureSource: component {name!r} has no weight")
            w = weights[name]
            if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, float, np.number)):
                raise TypeError(f"MixtureSource: weight {name!r} must be a number, got {w!r}")
            wf = float(w)
            if not math.isfinite(wf) or wf < 0:
                raise ValueError(f"MixtureSource: weight {name!r} must be finite and >= 0, got {w}")
            out.append(wf)
        if not any(out):
            raise ValueError("MixtureSource: at least one weight must be > 0")
        return tuple(out)

    def _check_ratios(self, ratios: float | Mapping[str, float] | None) -> dict[str, Fraction]:
        # Pinned tokens-per-byte ratios per component, exact and rounded like calibrated ones.
        if ratios is None:
            return {}
        if isinstance(ratios, Mapping):
            for key in ratios:
                if key not in self._names:
                    raise ValueError(
                        f"MixtureSource: tokens_per_byte names {key!r}, which is no component "
                        f"(components: {list(self._names)})"
                    )
            given = dict(ratios)
        else:
            given = dict.fromkeys(self._names, ratios)
        out = {}
        for name, r in given.items():
            if isinstance(r, (bool, np.bool_)) or not isinstance(r, (int, float, np.number)):
                raise TypeError(
                    f"MixtureSource: tokens_per_byte of {name!r} must be a number, got {r!r}"
                )
            if not math.isfinite(float(r)) or float(r) <= 0:
                raise ValueError(
                    f"MixtureSource: tokens_per_byte of {name!r} must be finite and > 0, got {r}"
                )
            out[name] = quantize(Fraction(float(r)))
        return out

    # -- layout -------------------------------------------------------------------------------

    def _apportion(self, slots: int, shares: tuple[Fraction, ...] | None = None) -> list[int]:
        # Hamilton apportionment of ``slots`` by the exact (rational) shares; ties by name order.
        floors: list[int] = []
        remainders: list[Fraction] = []
        for share in self._shares if shares is None else shares:
            exact = share * slots
            whole = exact.numerator // exact.denominator
            floors.append(whole)
            remainders.append(exact - whole)
        left = slots - sum(floors)
        for i in sorted(range(len(floors)), key=lambda i: (-remainders[i], i))[:left]:
            floors[i] += 1
        return floors

    def _layout(self, k: int, phase: _Phase | None = None) -> tuple[np.ndarray, list[int]]:
        # The component index of each slot of full chunk k (of ``phase``, the first by default),
        # and each component's count before it.
        phase = phase or self._phases[0]
        local = (k - phase.first_chunk) * self.chunk_size
        before = self._apportion(local, phase.shares)
        after = self._apportion(local + self.chunk_size, phase.shares)
        keys: list[np.ndarray] = []
        ids: list[np.ndarray] = []
        for i, (a, b) in enumerate(zip(before, after, strict=True)):
            m = b - a
            if m <= 0:
                continue
            u = ((derive_key(self.seed, k, self._slot_tags[i]) >> 11) + 0.5) * _UNIT
            keys.append((np.arange(m, dtype=np.float64) + u) / m)
            ids.append(np.full(m, i, dtype=np.int64))
        key_arr = np.concatenate(keys)
        id_arr = np.concatenate(ids)
        return id_arr[np.lexsort((id_arr, key_arr))], [b + c for b, c in zip(phase.base, before)]

    def _available(self, src: IndexedSource) -> int | None:
        n = src.num_samples()
        if n == 0:
            return 0
        return None if src.passes is None else n * src.passes

    def _end_of(self, i: int, phase: _Phase) -> int | None:
        """The first slot of ``phase`` (counted from its start) at which component ``i`` would
        read past its end, or None when it never does there."""
        avail = self._limits[i]
        share = phase.shares[i]
        if not share or avail is None:
            return None
        left = avail - phase.base[i]
        cs = self.chunk_size
        lo = 0
        hi = math.ceil((left + 1) / (share * cs))  # floor(share*hi*cs) > left there
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._apportion(mid * cs, phase.shares)[i] <= left:
                lo = mid
            else:
                hi = mid
        layout, before = self._layout(phase.first_chunk + lo, phase)
        return lo * cs + int(np.flatnonzero(layout == i)[avail - before[i]])

    def _find_total(self) -> int | None:
        # stop: the first slot at which a weighted component would read past its end; repeat:
        # the last such slot, when every finite component has been read once (an endless
        # weighted component makes a repeating mixture unbounded).
        phase = _Phase(0, 0, self._shares, (0,) * len(self._names), None, None)
        ends = [self._end_of(i, phase) for i in range(len(self._names))]
        found = [e for e in ends if e is not None]
        if self.on_exhausted == "stop":
            return min(found) if found else None
        endless = any(
            share and avail is None for share, avail in zip(self._shares, self._limits, strict=True)
        )
        return None if endless or not found else max(found)

    def _redistributed_phases(self) -> tuple[_Phase, ...]:
        """The phases of a ``redistribute`` mixture: each ends with the chunk in which one of
        its components runs out (that chunk keeps the others' slots and drops the rest of its
        own); the next one shares that component's weight out over those still running."""
        n = len(self._names)
        phases: list[_Phase] = []
        base = [0] * n
        first_chunk = first_sample = 0
        running = [i for i in range(n) if self._shares[i] and self._limits[i] != 0]
        while running:
            total = sum(self._shares[i] for i in running)
            shares = tuple(
                self._shares[i] / total if i in running else Fraction(0) for i in range(n)
            )
            phase = _Phase(first_chunk, first_sample, shares, tuple(base), None, None)
            ends = [e for e in (self._end_of(i, phase) for i in running) if e is not None]
            if not ends:
                phases.append(phase)
                break
            chunks = min(ends) // self.chunk_size + 1
            counts = self._apportion(chunks * self.chunk_size, shares)
            after = [
                b + c if limit is None else min(b + c, limit)
                for b, c, limit in zip(base, counts, self._limits, strict=True)
            ]
            samples = sum(after) - sum(base)
            phases.append(_Phase(first_chunk, first_sample, shares, tuple(base), chunks, samples))
            running = [i for i in running if after[i] != self._limits[i]]
            base, first_chunk, first_sample = after, first_chunk + chunks, first_sample + samples
        if not phases:  # every weighted component is empty
            phases.append(_Phase(0, 0, self._shares, (0,) * n, 0, 0))
        return tuple(phases)

    def _phase_of(self, chunk: int) -> _Phase:
        at = bisect.bisect_right([p.first_chunk for p in self._phases], chunk) - 1
        return self._phases[at]

    def _slots(self, k: int) -> tuple[np.ndarray, list[int]]:
        """Chunk ``k``'s slots as laid out (``_layout``), cut where the mixture ends; in the last
        chunk of a ``redistribute`` phase without the slots of components that ran out."""
        phase = self._phase_of(k)
        layout, before = self._layout(k, phase)
        if self.on_exhausted != "redistribute":
            if self._total is not None:
                layout = layout[: self._total - k * self.chunk_size]
        elif phase.chunks is not None and k == phase.first_chunk + phase.chunks - 1:
            keep = np.ones(len(layout), dtype=bool)
            for i, limit in enumerate(self._limits):
                where = np.flatnonzero(layout == i)
                if limit is not None and before[i] + len(where) > limit:
                    keep[where[limit - before[i] :]] = False
            layout = layout[keep]
        return layout, before

    # -- the protocol -------------------------------------------------------------------------

    def provides(self) -> dict[str, Any]:
        """The plan-time facts of the components when they all publish the same ones (token
        shards with one field and one pad id), else none."""
        facts = [src.provides() for src in self._sources]
        return facts[0] if all(f == facts[0] for f in facts) else {}

    def target_mixture(self) -> tuple[str, dict[str, float]]:
        """``(by, normalized weights)``: what the weights ask of the delivered stream."""
        total = sum(self._weights)
        return self.by, {n: w / total for n, w in zip(self._names, self._weights, strict=True)}

    def sample_shares(self) -> dict[str, float]:
        """Each component's share of the samples (the weights by samples, the token-aware shares
        by tokens)."""
        return {n: float(s) for n, s in zip(self._names, self._shares, strict=True)}

    def token_costs(self) -> dict[str, TokenCost]:
        """The estimated token cost of each weighted component (empty with ``by="samples"``)."""
        return dict(self._costs)

    @property
    def names(self) -> tuple[str, ...]:
        """Component names, in name order (the order used for every tie)."""
        return self._names

    def total_samples(self) -> int | None:
        """Samples in the whole mixture, or None when it is unbounded."""
        return self._total

    def num_chunks(self) -> int | None:
        """Chunks in the whole mixture, or None when it is unbounded: ``ceil(total_samples() /
        chunk_size)``, the last one short; with ``redistribute`` the chunk in which a component
        runs out is short too."""
        last = self._phases[-1]
        return None if last.chunks is None else last.first_chunk + last.chunks

    def chunk_lengths(self, positions: np.ndarray) -> np.ndarray:
        """``len(chunk(p).pointers)`` for each position, from the phases alone (no chunk is
        built, no component asked): every chunk is full but the last of each phase, the one in
        which a component runs out (or the mixture ends)."""
        p = np.asarray(positions, dtype=np.int64)
        if p.size and int(p.min()) < 0:
            raise ValueError(f"{self!r}: chunk position {int(p.min())} is negative")
        total = self.total_chunks()
        if total is not None and p.size and int(p.max()) >= total:
            raise IndexError(
                f"{self!r}: chunk position {int(p.max())} is past the end ({total} chunks)"
            )
        out = np.full(p.shape, self.chunk_size, dtype=np.int64)
        for phase in self._phases:
            if phase.chunks is not None and phase.samples is not None and phase.chunks:
                last = phase.first_chunk + phase.chunks - 1
                out[p == last] = phase.samples - (phase.chunks - 1) * self.chunk_size
        return out

    def component_counts(self, slots: int) -> dict[str, int]:
        """How many samples of each component the first ``slots`` mixture samples hold (equal to
        counting them in the chunks, in O(chunk))."""
        slots = check_int(slots, "slots", "MixtureSource.component_counts", minimum=0)
        if self._total is not None and slots > self._total:
            raise IndexError(f"{self!r}: only {self._total} samples, asked for {slots}")
        at = bisect.bisect_right([p.first_sample for p in self._phases], slots) - 1
        phase = self._phases[at]
        k, r = divmod(slots - phase.first_sample, self.chunk_size)
        if phase.chunks is not None and k == phase.chunks:  # the phase's end: the next one's start
            k, r = k - 1, self.chunk_size
        local = self._apportion(k * self.chunk_size, phase.shares)
        counts = [b + c for b, c in zip(phase.base, local, strict=True)]
        if r:
            layout, _ = self._slots(phase.first_chunk + k)
            counts = [c + int(np.count_nonzero(layout[:r] == i)) for i, c in enumerate(counts)]
        return dict(zip(self._names, counts, strict=True))

    def chunk(self, position: int) -> WorkChunk:
        """Mixture chunk ``position``: its slot layout filled from each component's stream."""
        p = self._check_position(position)
        layout, before = self._slots(p)
        rows = np.empty((len(layout), 3), dtype=np.int64)
        repeat = self.on_exhausted == "repeat"
        for i, src in enumerate(self._sources):
            where = layout == i
            count = int(np.count_nonzero(where))
            if count:
                rows[where] = _stream_rows(src, before[i], count, repeat)
        return WorkChunk(p, rows)

    def read(self, pointers: np.ndarray) -> list[Any]:
        """Payloads in row order: rows grouped by dataset_id, each group read by its component."""
        rows = check_pointers(pointers, self)
        out: list[Any] = [None] * len(rows)
        ids = rows[:, 0]
        for did in sorted(set(ids.tolist())):  # not np.unique: it imports numpy.ma in a worker
            where = np.flatnonzero(ids == did)
            i = self._component_of(did, rows[where[0]])
            payloads = self._sources[i].read(rows[where])
            for w, value in zip(where.tolist(), payloads, strict=True):
                out[w] = value
        return out

    def origin(self, pointer: np.ndarray) -> dict[str, Any]:
        """The component of the pointer row's sample, and where that component says it lives."""
        row = np.asarray(pointer, dtype=np.int64).reshape(3)
        i = self._component_of(int(row[0]), row)
        return {"component": self._names[i], **self._sources[i].origin(row)}

    def drop_read_caches(self) -> None:
        """Each component forgets what its reads kept."""
        for src in self._sources:
            src.drop_read_caches()

    def read_ahead_chunks(self) -> int:
        """The most chunks ahead any component wants to hear of."""
        return max((src.read_ahead_chunks() for src in self._sources), default=0)

    def upcoming(self, positions: Sequence[int]) -> None:
        """Each component fetches ahead what its rows of these chunks read."""
        total = self.total_chunks()
        for p in positions:
            if p < 0 or (total is not None and p >= total) or p in self._announced:
                continue
            rows = self.chunk(p).pointers
            taken = [src.read_ahead(rows[rows[:, 0] == src.dataset_id]) for src in self._sources]
            if not all(taken):
                return  # a queue is full: later chunks announce the rest again
            self._announced[p] = None
            while len(self._announced) > 256:
                self._announced.pop(next(iter(self._announced)))

    def io_counters(self) -> dict[str, dict[str, int]]:
        """The components' counters, summed where two share a dataset root."""
        return merge_counters(src.io_counters() for src in self._sources)

    def components(self, pointers: np.ndarray) -> list[Any]:
        """The component name of each pointer row (by its dataset_id)."""
        rows = check_pointers(pointers, self)
        names = self._names
        index_of = self._index_of_id
        out = []
        for row in rows.tolist():
            i = index_of.get(row[0])
            if i is None:
                raise ValueError(f"{self!r}: pointer {tuple(row)} belongs to no component")
            out.append(names[i])
        return out

    def _component_of(self, dataset_id: int, row: np.ndarray) -> int:
        i = self._index_of_id.get(dataset_id)
        if i is None:
            raise FetchError(
                f"{self!r} cannot read pointer {tuple(row.tolist())}: dataset_id {dataset_id} "
                f"belongs to no component ({dict(zip(self._names, self._ids(), strict=True))})"
            )
        return i

    def _ids(self) -> list[int]:
        return [src.dataset_id for src in self._sources]

    def describe(self) -> dict[str, Any]:
        """Class, component names, weights and ``by``, each component's ``describe()``, seed and
        chunk_size; by tokens also the estimate's parameters, each component's token cost and the
        resulting sample shares (so a changed estimate changes the fingerprint)."""
        out = {
            "class": f"{type(self).__module__}.{type(self).__qualname__}",
            "names": list(self._names),
            "weights": dict(zip(self._names, self._weights, strict=True)),
            "by": self.by,
            "components": {
                n: s.describe() for n, s in zip(self._names, self._sources, strict=True)
            },
            "seed": self.seed,
            "chunk_size": self.chunk_size,
            "total_samples": self._total,
        }
        if self.on_exhausted != "stop":  # the default keeps the identity it had before
            out["on_exhausted"] = self.on_exhausted
        if self.by == "tokens":
            out["estimate"] = dict(self._estimate)
            out["token_costs"] = {n: c.describe() for n, c in self._costs.items()}
            out["sample_shares"] = self.sample_shares()
        return out

    def __repr__(self) -> str:
        weights = ", ".join(f"{n}={w:g}" for n, w in zip(self._names, self._weights, strict=True))
        return (
            f"MixtureSource({weights} by {self.by}; chunk_size={self.chunk_size}, seed={self.seed})"
        )


def _stream_rows(src: IndexedSource, start: int, count: int, repeat: bool = False) -> np.ndarray:
    # Pointer rows of stream positions [start, start + count) of a component: its passes
    # concatenated (and, repeating, read again from its first pass once they are all read). A
    # short component may be crossed several times within one chunk.
    n = src.num_samples()
    parts = []
    j, end = start, start + count
    while j < end:
        q, pos = divmod(j, n)
        if repeat and src.passes is not None:
            q %= src.passes
        stop = min(n, pos + end - j)
        parts.append(src.pointer_rows(src.samples(q, pos, stop)))
        j += stop - pos
    return np.concatenate(parts)
