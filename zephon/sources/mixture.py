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
- **End.** The mixture ends at the first sample that would read past the end of a component with a
  non-zero weight; the last chunk is the same slot layout, truncated. With only endless non-zero
  components the mixture is unbounded. A mixture has one pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import numpy as np

from zephon.errors import FetchError
from zephon.sources.base import IndexedSource, WorkSource, check_pointers
from zephon.sources.permutation import derive_key
from zephon.sources.token_costs import TokenCost, estimate_cost, quantize
from zephon.types import WorkChunk
from zephon.validation import check_int

__all__ = ["MixtureSource"]

_UNIT = 2.0**-53
_BY = ("samples", "tokens")


class MixtureSource(WorkSource):
    """Samples of several ``IndexedSource`` components interleaved so that each component's share of
    every whole-chunk prefix is within one sample of its sample share; a chunk mixes components.

    ``by="samples"``: the sample shares are the normalized weights. ``by="tokens"``: they are
    ``w_c / cost_c`` normalized, so the expected token shares are the weights; ``cost_c`` (mean
    tokens per sample) is the mean of ``length_column`` over a fixed sample of the component's
    records, or the mean UTF-8 bytes of ``text_field`` times a tokens-per-byte ratio: pinned
    (``tokens_per_byte=``, a number or a dict per component) or calibrated by ``tokenizer`` on
    ``calibration_size`` of those records; plus ``added_tokens`` (the end-of-sequence id
    ``tokenize`` appends). See ``zephon.sources.token_costs``.

    Invariant: each component's samples appear in its own stream order, each stream position at most
    once, and never past the end of a finite component (see the module docstring for the layout).
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
        estimate_size: int = 1024,
        calibration_size: int = 256,
    ) -> None:
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

        self._weights = self._check_weights(weights)
        if by not in _BY:
            raise ValueError(f"MixtureSource: by must be one of {_BY}, got {by!r}")
        self.by = by
        self._costs: dict[str, TokenCost] = {}
        if by == "tokens":
            added = check_int(added_tokens, "added_tokens", "MixtureSource", minimum=0)
            size = check_int(estimate_size, "estimate_size", "MixtureSource", minimum=1)
            calibrate = check_int(calibration_size, "calibration_size", "MixtureSource", minimum=1)
            self._estimate: dict[str, Any] = {
                "length_column": length_column,
                "text_field": text_field,
                "added_tokens": added,
                "estimate_size": size,
                "calibration_size": calibrate,
            }
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
        for name, share in zip(names, self._shares, strict=True):
            if share and share * self.chunk_size < 1:
                per_chunk = float(share * self.chunk_size)
                raise ValueError(
                    f"MixtureSource: the weight of {name!r} gives it {per_chunk:.3g} samples per "
                    f"chunk of {self.chunk_size}; a non-zero weight needs at least one per chunk: "
                    f"use chunk_size >= {math.ceil(1 / share)}, a larger weight, or weight 0"
                )
        self._slot_tags = tuple(f"mixture-slot:{name}" for name in names)
        self._total = self._find_total()

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

    def _apportion(self, slots: int) -> list[int]:
        # Hamilton apportionment of ``slots`` by the exact (rational) shares; ties by name order.
        floors: list[int] = []
        remainders: list[Fraction] = []
        for share in self._shares:
            exact = share * slots
            whole = exact.numerator // exact.denominator
            floors.append(whole)
            remainders.append(exact - whole)
        left = slots - sum(floors)
        for i in sorted(range(len(floors)), key=lambda i: (-remainders[i], i))[:left]:
            floors[i] += 1
        return floors

    def _layout(self, k: int) -> tuple[np.ndarray, list[int]]:
        # The component index of each slot of full chunk k, and each component's count before it.
        before = self._apportion(k * self.chunk_size)
        after = self._apportion((k + 1) * self.chunk_size)
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
        return id_arr[np.lexsort((id_arr, key_arr))], before

    def _available(self, src: IndexedSource) -> int | None:
        n = src.num_samples()
        if n == 0:
            return 0
        return None if src.passes is None else n * src.passes

    def _find_total(self) -> int | None:
        # The largest S such that no component's count within the first S slots exceeds what it
        # has: per finite component, binary-search the last whole chunk that fits, then find the
        # first slot of the next sample inside that chunk.
        total: int | None = None
        cs = self.chunk_size
        for i, (src, share) in enumerate(zip(self._sources, self._shares, strict=True)):
            avail = self._available(src)
            if not share or avail is None:
                continue
            lo = 0
            hi = math.ceil((avail + 1) / (share * cs))  # floor(share*hi*cs) > avail there
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if self._apportion(mid * cs)[i] <= avail:
                    lo = mid
                else:
                    hi = mid
            layout, before = self._layout(lo)
            end = lo * cs + int(np.flatnonzero(layout == i)[avail - before[i]])
            total = end if total is None else min(total, end)
        return total

    # -- the protocol -------------------------------------------------------------------------

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
        """``ceil(total_samples() / chunk_size)``, or None when unbounded; the last may be short."""
        if self._total is None:
            return None
        return -(-self._total // self.chunk_size)

    def component_counts(self, slots: int) -> dict[str, int]:
        """How many samples of each component the first ``slots`` mixture samples hold (equal to
        counting them in the chunks, in O(chunk))."""
        slots = check_int(slots, "slots", "MixtureSource.component_counts", minimum=0)
        if self._total is not None and slots > self._total:
            raise IndexError(f"{self!r}: only {self._total} samples, asked for {slots}")
        k, r = divmod(slots, self.chunk_size)
        counts = self._apportion(k * self.chunk_size)
        if r:
            layout, _ = self._layout(k)
            counts = [c + int(np.count_nonzero(layout[:r] == i)) for i, c in enumerate(counts)]
        return dict(zip(self._names, counts, strict=True))

    def chunk(self, position: int) -> WorkChunk:
        """Mixture chunk ``position``: its slot layout filled from each component's stream."""
        p = self._check_position(position)
        layout, before = self._layout(p)
        if self._total is not None:
            layout = layout[: self._total - p * self.chunk_size]
        rows = np.empty((len(layout), 3), dtype=np.int64)
        for i, src in enumerate(self._sources):
            where = layout == i
            count = int(np.count_nonzero(where))
            if count:
                rows[where] = _stream_rows(src, before[i], count)
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

    def drop_read_caches(self) -> None:
        """Each component forgets what its reads kept."""
        for src in self._sources:
            src.drop_read_caches()

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


def _stream_rows(src: IndexedSource, start: int, count: int) -> np.ndarray:
    # Pointer rows of stream positions [start, start + count) of a component: its passes
    # concatenated. A short component may be crossed several times within one chunk.
    n = src.num_samples()
    parts = []
    j, end = start, start + count
    while j < end:
        q, pos = divmod(j, n)
        stop = min(n, pos + end - j)
        parts.append(src.pointer_rows(src.samples(q, pos, stop)))
        j += stop - pos
    return np.concatenate(parts)
