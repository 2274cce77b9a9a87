"""The packers: ``pack_sequences`` (online best-fit / first-fit bins) and ``pack_flat`` (cut a
concatenated stream), on the compiled placement kernels of ``zephon._core.binfill`` and the
compiled token fill of ``zephon._core.packfill``: per micro-batch, Python makes one kernel call,
one fill call and, when bins close, one call that builds their records (``zephon._core.packrows``).

Both emit records with payload ``{"tokens", "segment_ids", "positions"}`` (``int32[seq_len]``):
segment ids number a bin's fragments 1, 2, 3 ... and are 0 on padding; positions restart at 0 for
each fragment. A packed record's primary cursor is ``first_input.cursor.child(frag_start)``; its
contributors are every fragment's refs, closing only for the fragment that ends its input.

Side fields (``extra_fields={"loss_mask": 0, ...}``): per-token arrays aligned with the token field
(a loss mask, labels, per-token weights) travel through the same fill: each fragment copies the
same range of them, so a split or a wrap cuts them where it cuts the tokens, and padding holds the
field's own value. An int padding value makes an ``int32`` field, a float a ``float32`` one. An
operator upstream that writes such fields (``tokenize_chat``: its loss mask) says so at plan time,
and a packer of its tokens that would drop one is a ``PlanError``: a lost mask means training on
every token.

The padding id is never a silent default: it is ``pad_id=``, or (``pad_id=None``) the padding
token of the tokenizer upstream, which ``tokenize`` publishes at plan time (``provides``) and
the planner hands to the packer (``use_upstream_facts``). Without either, planning fails with a
``PlanError`` saying to pass ``pad_id=``.

Images (``pack_sequences(..., images="images")``): inputs made by ``tokenize_chat`` or
``tokenize_interleaved`` with images carry their images in ``payload[images]`` and the token spans
standing for them in ``image_spans``. A row is never cut inside such a span (a sequence longer
than ``seq_len`` is cut before the span that would cross the cut, so its row leaves padded; a
``cut_to_fill`` head stops before it), and each row carries the images whose spans it holds, in
row order: ``payload[images]`` (a list), ``image_spans`` (``int32 (k, 2)``, row positions),
``image_sources`` (``int32 (k, 2)``: the segment id of the image's sequence in the row and the
image's index in that sequence) and ``image_grid_thw`` when the inputs have it. A span longer than
``seq_len`` is an error naming the sample. ``strategy="wrap"`` and ``pack_flat`` cut anywhere and
take no images.

Mixture heritage of a packed record: ``component_sample_counts`` counts fragments per component and
``component_token_counts`` counts tokens per component (``None`` when some input carries no token
counts, i.e. was not produced by ``tokenize``). An input's tokens are attributed to components by
laying its counts out in order (``component_token_counts``, else ``component_sample_counts`` scaled
to its length, else all of ``meta.component``): a fragment counts the tokens of each component its
token range overlaps, and one sample of each such component.
"""

from __future__ import annotations

import bisect
import copy
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Literal

import numpy as np

from zephon._core.binfill import BinPacker, FlatPacker
from zephon._core.packfill import BinFill, field_lengths, payload_fields, token_lengths
from zephon._core.packrows import packed_records
from zephon.errors import PlanError
from zephon.identity import identify
from zephon.ops.base import Operator, OpTraits, record_error
from zephon.ops.children import split_in_proportion, tombstones_for_record
from zephon.ops.vision import IMAGE_GRID_FIELD, IMAGE_SPANS_FIELD
from zephon.types import SampleMeta, SampleRecord
from zephon.validation import check_int

__all__ = ["GroupedPacker", "PackFlat", "PackSequences", "pack_flat", "pack_sequences"]

_STRATEGIES = ("best_fit", "first_fit", "wrap")
_BASE_FIELDS = ("tokens", "segment_ids", "positions")
_COUNTERS = ("rows", "real_tokens", "row_tokens")  # the names of a packer's counters()


def _checked_extra_fields(owner: str, field: str, extra: Any) -> dict[str, int | float]:
    """``extra_fields`` as a dict of side-field name -> padding value (an int32 or a float)."""
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise TypeError(
            f"{owner}: extra_fields must map field names to padding values, e.g. "
            f"{{'loss_mask': 0}}, got {type(extra).__name__}"
        )
    out: dict[str, int | float] = {}
    for name, pad in extra.items():
        if not isinstance(name, str):
            raise TypeError(f"{owner}: extra_fields names must be str, got {name!r}")
        if name in _BASE_FIELDS or name == field:
            raise ValueError(
                f"{owner}: extra_fields cannot carry {name!r}: the packed record makes "
                f"{', '.join(_BASE_FIELDS)} itself from {field!r}"
            )
        if isinstance(pad, (bool, np.bool_)) or not isinstance(
            pad, (int, float, np.integer, np.floating)
        ):
            raise TypeError(
                f"{owner}: the padding value of extra field {name!r} must be an int (an int32 "
                f"field) or a float (a float32 field), got {pad!r}"
            )
        if isinstance(pad, (float, np.floating)):
            out[name] = float(pad)
        else:
            out[name] = check_int(
                int(pad), f"extra_fields[{name!r}]", owner, minimum=-(2**31), maximum=2**31 - 1
            )
    return out


def _layout(meta: SampleMeta, n: int) -> list[tuple[Hashable, int]]:
    """How an input's ``n`` tokens split over components: consecutive (component, tokens) runs."""
    tokens = meta.component_token_counts
    if tokens is not None and sum(tokens.values()) == n:
        return list(tokens.items())
    weights = tokens if tokens is not None else meta.component_sample_counts
    if not weights:
        return [(meta.component, n)]
    return split_in_proportion(n, weights)


def _count_spread(
    meta: SampleMeta,
    n: int,
    start: int,
    size: int,
    samples: dict[Hashable, int],
    tokens: dict[Hashable, int] | None,
) -> None:
    """Add the counts of fragment ``[start, start+size)`` of an input spanning several components:
    the tokens of each component run it overlaps, and one sample of each such component."""
    runs = _layout(meta, n)
    if size == 0:  # an empty fragment still counts as a sample of the input's first component
        comp = runs[0][0]
        samples[comp] = samples.get(comp, 0) + 1
        if tokens is not None:
            tokens[comp] = tokens.get(comp, 0)
        return
    lo = 0
    for comp, run in runs:
        hi = lo + run
        overlap = min(hi, start + size) - max(lo, start)
        if overlap > 0:
            samples[comp] = samples.get(comp, 0) + 1
            if tokens is not None:
                tokens[comp] = tokens.get(comp, 0) + overlap
        lo = hi


def _consolidated(
    rows: np.ndarray,
    seq_len: int,
    head_of: Callable[[int, int, int], int] | None = None,
    max_segments: int | None = None,
) -> np.ndarray:
    """New placement rows for the fragments of ``rows`` (``BinFill.contents()`` rows: item,
    frag_start, frag_len, bin_id, bin_offset) in as few bins as their tokens need: each bin
    takes the largest fragment that fits until none does, then the head of the smallest one
    that does not fills its rest (one cut per bin; the tail goes back to be placed). Every bin
    is full but the last, unless ``max_segments`` ends it first: no bin takes more non-empty
    fragments than that, as no bin of the kernel does. Ties keep the fragments' order in
    ``rows``, so the result depends on the held bins alone. ``head_of(item, start, room)``: the
    longest head of at most ``room`` tokens that may be cut from a fragment (0: none; the next
    smallest is tried, and when no fragment can be cut the bin leaves with its room)."""
    pool = sorted((int(size), k, int(item), int(start)) for k, (item, start, size, _, _) in
                  enumerate(rows.tolist()))  # fmt: skip
    out: list[tuple[int, int, int, int, int]] = []
    cap = len(rows) if max_segments is None else max_segments
    bin_id = 0
    while pool:
        room = seq_len
        held = 0
        # Empty fragments join a full bin, and count as no sequence: a bin of them alone would
        # be a row of padding.
        while pool and ((held < cap and room) or not pool[0][0]):
            at = bisect.bisect_right(pool, (room, len(rows)))  # fragments that fit: pool[:at]
            if held == cap or not room:  # only an empty one still joins
                at = 1
            if at:
                size, _, item, start = pool.pop(at - 1)
            else:  # nothing fits: cut the smallest one that can be, its head fills the bin
                for j, (size, k, item, start) in enumerate(pool):  # noqa: B007 (used after)
                    head = room if head_of is None else head_of(item, start, room)
                    if head > 0:
                        break
                else:
                    break
                del pool[j]
                bisect.insort(pool, (size - head, k, item, start + head))
                size = head
            out.append((item, start, size, bin_id, seq_len - room))
            room -= size
            held += size > 0
        bin_id += 1
    return np.array(out, dtype=np.int64).reshape(-1, 5)


def _head_outside(spans: list[tuple[int, int]], start: int, head: int) -> int:
    """The longest head of at most ``head`` tokens from ``start`` whose end falls inside none
    of ``spans`` (sorted ``[lo, hi)`` ranges): a cut inside one moves back to its start."""
    end = start + head
    for lo, hi in spans:
        if lo < end < hi:
            return lo - start
    return head


def _whole_span_cuts(spans: list[tuple[int, int]], n: int, cap: int) -> list[int]:
    """Cut points ``0 = p0 < p1 < ... < pk`` of a sequence of ``n > cap`` tokens into pieces
    of at most ``cap`` but the last (``n - pk`` of at most ``cap``), each as long as it can be
    without ending inside a span (spans checked no longer than ``cap``)."""
    cuts = [0]
    while n - cuts[-1] > cap:
        cuts.append(cuts[-1] + _head_outside(spans, cuts[-1], cap))
    return cuts


class _Packer(Operator):
    """What both packers share: the token fill of their bins (``BinFill``, compiled) driven by the
    placement rows of their kernel, and the metadata of the packed records they emit."""

    seq_len: int
    field: str
    pad_id: int | None
    extra_fields: dict[str, int | float]
    _sides: tuple[tuple[str, Literal["int32", "float32"]], ...]
    _pad: int | None
    _kernel: Any
    _fill: BinFill | None
    ratios = {"fill": ("real_tokens", "row_tokens")}
    _rows = 0  # rows emitted, and the real tokens in them, since this copy was made
    _real_tokens = 0
    _retired: Callable[[np.ndarray], np.ndarray] | None = None  # ``leave_out``

    images: str | None = None
    cut_to_fill = False  # pack_sequences' option; the other packers never cut to fill
    _takes_images = False  # whether images= keeps spans whole (not where rows cut anywhere)

    def _setup(
        self,
        seq_len: int,
        field: str,
        pad_id: int | None,
        extra_fields: Any = None,
        images: str | None = None,
    ) -> None:
        seq_len = check_int(seq_len, "seq_len", self.name, minimum=1, maximum=2**31 - 1)
        if pad_id is not None:
            pad_id = check_int(pad_id, "pad_id", self.name, minimum=-(2**31), maximum=2**31 - 1)
        self.seq_len = seq_len
        self.field = field
        self.pad_id = pad_id  # as given: part of the fingerprint, never changed by planning
        self.extra_fields = _checked_extra_fields(self.name, field, extra_fields)
        # (name, dtype) per side field, in row order: an int padding makes an int32 row.
        self._sides = tuple(
            (name, "float32" if isinstance(pad, float) else "int32")
            for name, pad in self.extra_fields.items()
        )
        self._pad = pad_id  # the id padding is written with: pad_id, else the tokenizer's
        if images is not None and not isinstance(images, str):
            raise TypeError(
                f"{self.name}: images must name the payload field holding the images, got "
                f"{images!r}"
            )
        self.images = images
        self._fill = self._new_fill()

    def _new_fill(self, arenas_of: BinFill | None = None) -> BinFill | None:
        """An empty fill with this packer's padding (``None`` until a padding id is known),
        writing its rows into arenas of its own or into those of ``arenas_of``."""
        if self._pad is None:
            return None
        return BinFill(self.seq_len, self._pad, tuple(self.extra_fields.values()), arenas_of)

    def describe(self) -> dict[str, Any]:
        """As ``Operator.describe``; ``extra_fields`` counts only when there are some, so a packer
        without side fields keeps the fingerprint it had before they existed."""
        out = super().describe()
        if not self.extra_fields:
            del out["params"]["extra_fields"]
        if self.images is None:
            out["params"].pop("images", None)
        return out

    @property
    def effective_pad_id(self) -> int | None:
        """The id written on padding positions (``segment_ids == 0``): ``pad_id``, else the
        upstream tokenizer's padding id once the pipeline is planned (``None`` before)."""
        return self._pad

    def use_upstream_facts(self, facts: Mapping[str, Any]) -> None:
        """At plan time, with ``pad_id=None``: take the padding id the tokenizer upstream
        publishes for this packer's field, else raise a ``PlanError`` saying to pass
        ``pad_id=``. With any ``pad_id``: a ``PlanError`` when the operator that wrote this
        packer's tokens also wrote per-token side fields (``token_side_fields``) that
        ``extra_fields`` does not carry."""
        self._check_side_fields(facts)
        self._check_images(facts)
        if self.pad_id is not None:
            return
        pad = facts.get("pad_id")
        source = facts.get("pad_from")
        field = facts.get("token_field")
        if source is None:
            why = "no tokenizer upstream publishes one"
        elif field != self.field:
            why = f"it reads {self.field!r} while {source} writes {field!r}"
        elif pad is None:
            # A tokenizer without a padding token, or a source (TokenShardSource) given none.
            why = f"{source} publishes none: its tokenizer has no padding token, or it was "
            why += "given no pad_id="
        else:
            if self._pad != pad or self._fill is None:
                if self._fill is not None and self._fill.n_open:
                    raise RuntimeError(f"{self.name}: cannot re-plan a packer that holds open bins")
                self._pad = int(pad)
                self._fill = self._new_fill()
            return
        raise self._no_pad_error(why)

    def _check_side_fields(self, facts: Mapping[str, Any]) -> None:
        sides = facts.get("token_side_fields")
        if not sides or facts.get("token_field") != self.field:
            return
        if sides.get("field") != self.field or sides.get("source") != facts.get("pad_from"):
            return  # published by an operator that no longer writes this packer's tokens
        missing = [name for name in sides.get("fields", ()) if name not in self.extra_fields]
        if missing:
            pads = ", ".join(f"{name!r}: 0" for name in missing)
            raise PlanError(
                f"{self.name}: {sides['source']} writes the per-token field(s) "
                f"{', '.join(map(repr, missing))} next to {self.field!r}, and this packer would "
                f"drop them; pass extra_fields={{{pads}}} (the value is the padding) to carry them"
            )

    def _check_images(self, facts: Mapping[str, Any]) -> None:
        images = facts.get("image_fields")
        if not images or self.images is not None or facts.get("token_field") != self.field:
            return
        if images.get("field") != self.field or images.get("source") != facts.get("pad_from"):
            return  # published by an operator that no longer writes this packer's tokens
        how = (
            f"pass images={images['images']!r}"
            if self._takes_images
            else f"use pack_sequences(..., images={images['images']!r}) (best_fit or first_fit)"
        )
        raise PlanError(
            f"{self.name}: {images['source']} places images in {self.field!r}, and this packer "
            f"would drop them and could cut their token spans; {how}"
        )

    def _no_pad_error(self, why: str) -> PlanError:
        return PlanError(
            f"{self.name}: no padding id ({why}); pass pad_id= (padding positions are the ones "
            "with segment_ids == 0, so any id works if the loss masks them; the tokenizer's "
            "end-of-sequence id is a common choice)"
        )

    def _bins(self) -> BinFill:
        fill = self._fill
        if fill is None:  # used outside a pipeline, so never planned
            raise self._no_pad_error("this packer was not planned in a pipeline")
        return fill

    def _tokens_of(self, rec: SampleRecord) -> np.ndarray:
        """``rec``'s token field as a 1-D int32 array, or an ``OperatorError`` naming the record."""
        try:
            value = rec.payload[self.field]
        except (KeyError, TypeError, IndexError):
            payload = rec.payload
            fields = list(payload) if isinstance(payload, dict) else type(payload).__name__
            raise record_error(
                self, rec, KeyError(f"the payload has no field {self.field!r} (it has {fields})")
            ) from None
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
        if arr.dtype != np.int32:
            if arr.size == 0:
                arr = np.empty(0, dtype=np.int32)
            elif arr.dtype.kind not in "iu":
                raise record_error(
                    self, rec, TypeError(f"field {self.field!r} holds {arr.dtype}, not token ids")
                )
            else:
                lo, hi = int(arr.min()), int(arr.max())
                if lo < -(2**31) or hi >= 2**31:  # a cast would wrap them into other ids
                    raise record_error(
                        self, rec, ValueError(f"field {self.field!r} holds {lo}..{hi}, not int32")
                    )
                arr = arr.astype(np.int32)
        if arr.ndim != 1:
            raise record_error(
                self, rec, ValueError(f"field {self.field!r} has shape {arr.shape}, not 1-D")
            )
        return arr

    def _gather(self, records: list[SampleRecord]) -> tuple[list[np.ndarray], np.ndarray]:
        """The records' token arrays (1-D, contiguous int32, read in place by the fill) and their
        lengths."""
        field = self.field
        try:
            # Ready token arrays (checked in C) where payload_fields declined: mappings, sides.
            arrays = [rec.payload[field] for rec in records]
            return arrays, token_lengths(arrays)
        except (KeyError, TypeError, IndexError):
            arrays = [np.ascontiguousarray(self._tokens_of(rec)) for rec in records]
            return arrays, token_lengths(arrays)

    def _inputs(
        self, records: list[SampleRecord]
    ) -> tuple[list[np.ndarray], np.ndarray, list[list[np.ndarray]]]:
        """What ``BinFill.write`` reads of ``records``: their token arrays, the lengths of those,
        and per side field their arrays of it."""
        common = payload_fields(records, self.field, self._sides)
        if common is not None:
            return common
        arrays, lengths = self._gather(records)
        return arrays, lengths, self._gather_sides(records, lengths)

    def _gather_sides(
        self, records: list[SampleRecord], lengths: np.ndarray
    ) -> list[list[np.ndarray]]:
        """Per side field, the records' arrays of it (1-D, contiguous, the field's dtype, as long
        as their tokens), in the order of ``extra_fields``."""
        sides = []
        for name, dtype in self._sides:
            try:
                # Arrays of the right dtype and length already, when only another field is not.
                values = [rec.payload[name] for rec in records]
                if np.array_equal(field_lengths(values, dtype), lengths):
                    sides.append(values)
                    continue
            except (KeyError, TypeError, IndexError):
                pass
            sides.append(
                [self._side_of(rec, name, dtype, int(n)) for rec, n in zip(records, lengths)]
            )
        return sides

    def _side_of(self, rec: SampleRecord, name: str, dtype: str, n: int) -> np.ndarray:
        """``rec``'s side field ``name`` as a contiguous ``dtype`` array of ``n`` values, or an
        ``OperatorError`` naming the record."""
        payload = rec.payload
        try:
            value = payload[name]
        except (KeyError, TypeError, IndexError):
            fields = list(payload) if isinstance(payload, dict) else type(payload).__name__
            raise record_error(
                self,
                rec,
                KeyError(f"the payload has no extra field {name!r} (it has {fields})"),
            ) from None
        arr = np.asarray(value)
        kinds = "biuf" if dtype == "float32" else "biu"
        if arr.size and arr.dtype.kind not in kinds:
            raise record_error(
                self, rec, TypeError(f"extra field {name!r} holds {arr.dtype}, not {dtype} values")
            )
        if arr.ndim != 1 or len(arr) != n:
            raise record_error(
                self,
                rec,
                ValueError(
                    f"extra field {name!r} has shape {arr.shape}, but {self.field!r} has {n} "
                    "tokens; side fields hold one value per token"
                ),
            )
        if dtype == "int32" and arr.size and arr.dtype.kind != "b":
            lo, hi = int(arr.min()), int(arr.max())
            if lo < -(2**31) or hi >= 2**31:
                raise record_error(
                    self, rec, ValueError(f"extra field {name!r} holds {lo}..{hi}, not int32")
                )
        return np.ascontiguousarray(arr, dtype=np.float32 if dtype == "float32" else np.int32)

    def _place(self, records: list[SampleRecord]) -> list[SampleRecord]:
        """Hand the records to the kernel, fill their tokens into the bins, emit the closed bins."""
        if not records:
            return []
        fill = self._bins()
        arrays, lengths, sides = self._inputs(records)
        if self.images is None:
            placements, closed = self._kernel.add(lengths)
        else:
            placements, closed = self._add_keeping_spans(records, lengths)
        fill.write(placements, arrays, records, sides)
        return self._emit(closed) if len(closed) else []

    def _spans_of(self, rec: SampleRecord) -> list[tuple[int, int]]:
        """``rec``'s image spans, ``[lo, hi)`` token ranges (as checked when it was placed)."""
        payload = rec.payload
        value = payload.get(IMAGE_SPANS_FIELD) if isinstance(payload, dict) else None
        if value is None or not len(value):
            return []
        return [(lo, hi) for lo, hi in np.asarray(value).reshape(-1, 2).tolist()]

    def _checked_spans(self, rec: SampleRecord, n: int) -> list[tuple[int, int]]:
        """``_spans_of`` after checking them against ``rec``: sorted, disjoint, inside its
        ``n`` tokens, no longer than a row, one per image (an image without a span would be
        dropped); else an ``OperatorError``."""
        spans = self._spans_of(rec)
        value = rec.payload.get(self.images) if isinstance(rec.payload, dict) else None
        held = len(value) if isinstance(value, (list, tuple)) else int(value is not None)
        if not spans and not held:
            return spans
        why = None
        at = 0
        for lo, hi in spans:
            if not at <= lo < hi <= n:
                why = f"{IMAGE_SPANS_FIELD!r} holds {spans}, not sorted disjoint [start, end) "
                why += f"spans inside its {n} tokens"
                break
            if hi - lo > self.seq_len:
                why = f"its image span [{lo}, {hi}) is {hi - lo} tokens, longer than a row of "
                why += f"{self.seq_len}; raise seq_len or make the images smaller (resize_images)"
                break
            at = hi
        if why is None and held != len(spans):
            why = f"{IMAGE_SPANS_FIELD!r} holds {len(spans)} spans and field {self.images!r} "
            why += f"{held} images"
        if why is not None:
            raise record_error(self, rec, ValueError(why))
        return spans

    def _add_keeping_spans(
        self, records: list[SampleRecord], lengths: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The kernel's placement of ``records`` with no cut inside an image span. A sequence
        longer than ``seq_len`` is cut here, into pieces that end before the span a cut at
        ``seq_len`` would fall in, and handed to the kernel as the whole ``seq_len`` pieces it
        would make of it (each fills a bin of its own) plus its last piece; ``cut_to_fill``
        heads are kept out of spans by the kernel (``no_cut``)."""
        cap = self.seq_len
        virtual = np.array(lengths, dtype=np.int64)
        pieces: dict[int, list[int]] = {}
        no_cut = []
        for i, (rec, n) in enumerate(zip(records, lengths.tolist())):
            spans = self._checked_spans(rec, n)
            if not spans:
                continue
            shift = 0
            if n > cap:
                cuts = _whole_span_cuts(spans, n, cap)
                pieces[i] = cuts
                shift = (len(cuts) - 1) * cap - cuts[-1]
                virtual[i] = n + shift
                spans = [(lo, hi) for lo, hi in spans if lo >= cuts[-1]]
            no_cut += [(i, lo + shift, hi + shift) for lo, hi in spans]
        rows = np.array(no_cut, dtype=np.int64).reshape(-1, 3) if self.cut_to_fill else None
        placements, closed = self._kernel.add(virtual, rows)
        for r in np.flatnonzero(np.isin(placements[:, 0], list(pieces))).tolist():
            cuts = pieces[int(placements[r, 0])]
            whole = (len(cuts) - 1) * cap
            start = int(placements[r, 1])
            if start < whole:  # one of the whole pieces
                j = start // cap
                placements[r, 1:3] = (cuts[j], cuts[j + 1] - cuts[j])
            else:
                placements[r, 1] = start - whole + cuts[-1]
        return placements, closed

    def _attach_images(
        self, rows: list[SampleRecord], bin_records: list[list[SampleRecord]], frags: np.ndarray
    ) -> None:
        """Give each packed row the images whose spans its fragments hold, in row order."""
        assert self.images is not None
        at = 0
        for row, recs in zip(rows, bin_records):
            images: list[Any] = []
            spans: list[tuple[int, int]] = []
            sources: list[tuple[int, int]] = []
            grids: list[np.ndarray] = []
            offset = 0
            segment = 0  # the fill numbers non-empty fragments only
            for rec, (start, size, _) in zip(recs, frags[at : at + len(recs)].tolist()):
                segment += size > 0
                end = start + size
                own = self._spans_of(rec)
                inside = [k for k, (lo, _) in enumerate(own) if start <= lo < end]
                if inside:
                    value = rec.payload[self.images]
                    held = value if isinstance(value, (list, tuple)) else [value]
                    grid = rec.payload.get(IMAGE_GRID_FIELD)
                    shift = offset - start
                    for k in inside:
                        images.append(held[k])
                        spans.append((own[k][0] + shift, own[k][1] + shift))
                        sources.append((segment, k))
                        if grid is not None:
                            grids.append(np.asarray(grid[k]))
                offset += size
            at += len(recs)
            payload = row.payload
            payload[self.images] = images
            payload[IMAGE_SPANS_FIELD] = np.array(spans, dtype=np.int32).reshape(-1, 2)
            payload["image_sources"] = np.array(sources, dtype=np.int32).reshape(-1, 2)
            if grids or any(IMAGE_GRID_FIELD in r.payload for r in recs):
                payload[IMAGE_GRID_FIELD] = np.array(grids, dtype=np.int32).reshape(-1, 3)

    def _emit(self, bin_ids: np.ndarray) -> list[SampleRecord]:
        """The packed records of the bins ``bin_ids``, in that order: their payload blocks are
        handed over by the fill, not copied, and their metadata is built in C
        (``zephon._core.packrows``)."""
        blocks, bin_records, frags = self._bins().take(bin_ids)
        self._rows += len(blocks)
        self._real_tokens += int(frags[:, 1].sum())
        # Side rows in block order; float32 fields are views of their row's bits.
        sides = tuple((name, dtype == "float32") for name, dtype in self._sides)
        if self._retired is None:
            made = packed_records(blocks, bin_records, frags, self.lane_id, sides, _count_spread)
            if self.images is not None:
                self._attach_images(made, bin_records, frags)
            return made
        out: list[SampleRecord] = []
        at = 0
        for block, records in zip(blocks, bin_records):
            rows = frags[at : at + len(records)]
            at += len(records)
            gone = self._retired_inputs(records)
            if gone.any() and not gone.all():
                out += self._without(block, records, rows, gone, sides)
            else:  # a row of retired samples alone is left to delivery, which books it
                row = packed_records([block], [records], rows, self.lane_id, sides, _count_spread)
                if self.images is not None:
                    self._attach_images(row, [records], rows)
                out += row
        return out

    def leave_out(self, retired: Callable[[np.ndarray], np.ndarray]) -> bool:
        """Rows leave the fragments of retired samples out (see ``Operator.leave_out``)."""
        self._retired = retired
        return True

    def _retired_inputs(self, records: list[SampleRecord]) -> np.ndarray:
        """Per input of a bin, whether every sample it carries is retired."""
        assert self._retired is not None
        refs = [r.meta.contribution_refs() for r in records]
        ids = np.array([ref.cursor.sample_id for own in refs for ref in own], dtype=np.int64)
        found = self._retired(ids.reshape(-1, 3))
        ends = np.cumsum([len(own) for own in refs])
        return np.array([found[end - len(own) : end].all() for own, end in zip(refs, ends)])

    def _without(
        self,
        block: np.ndarray,
        records: list[SampleRecord],
        rows: np.ndarray,
        gone: np.ndarray,
        sides: tuple[tuple[str, bool], ...],
    ) -> list[SampleRecord]:
        """The row of a bin with the fragments of retired inputs (``gone``) left out: the others
        moved to its front in their order, segment ids renumbered, the rest padding; its primary
        cursor as if nothing were left out, so a replay meets the row where it was. Then the
        tombstones the left-out fragments owe (those that end their input)."""
        sizes = rows[:, 1]
        starts = np.cumsum(sizes) - sizes
        keep = ~gone
        columns = np.concatenate(  # some fragment is kept: the row mixes
            [np.arange(s, s + n, dtype=np.intp) for s, n, k in zip(starts, sizes, keep) if k]
        )
        pads = [self._pad, 0, 0]
        for name, is_float in sides:
            pad = self.extra_fields[name]
            pads.append(int(np.float32(pad).view(np.int32)) if is_float else int(pad))
        fresh = np.repeat(np.array(pads, dtype=np.int32)[:, None], block.shape[1], axis=1)
        fresh[:, : len(columns)] = block[:, columns]
        kept_sizes = sizes[keep & (sizes > 0)]  # empty fragments get no segment id
        self._real_tokens -= int(sizes[gone].sum())  # padding now (``counters``)
        fresh[1, : len(columns)] = np.repeat(np.arange(1, len(kept_sizes) + 1), kept_sizes)
        kept = [r for r, k in zip(records, keep.tolist()) if k]
        kept_rows = np.ascontiguousarray(rows[keep])
        (made,) = packed_records([fresh], [kept], kept_rows, self.lane_id, sides, _count_spread)
        if self.images is not None:  # the kept fragments' images, at their new places
            self._attach_images([made], [kept], kept_rows)
        meta = made.meta
        primary = records[0].meta.cursor.child(int(rows[0, 0]))
        out = [
            SampleRecord(
                SampleMeta(
                    primary,
                    lane_id=meta.lane_id,
                    contributors=meta.contributors,
                    component_sample_counts=meta.component_sample_counts,
                    component_token_counts=meta.component_token_counts,
                ),
                made.payload,
            )
        ]
        for rec, row, left_out in zip(records, rows.tolist(), gone.tolist()):
            if left_out and row[0] + row[1] == row[2]:  # the fragment that ends its input
                out += tombstones_for_record(rec)
        return out

    def counters(self) -> dict[str, int | float]:
        """The rows emitted, and their ``real_tokens`` of their ``row_tokens`` (the rest is
        padding): ``Loader.stats()`` gives their ratio as the packer's ``fill``."""
        return {
            "rows": self._rows,
            "real_tokens": self._real_tokens,
            "row_tokens": self._rows * self.seq_len,
        }

    def _leaving_bins(self) -> np.ndarray:
        """The ids of the bins a flush emits: every open one."""
        return self._kernel.flush()

    def _new_kernel(self) -> Any:
        """The placement kernel of this packer (abstract: each packer class provides its own)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _new_kernel (abstract)")

    def __getstate__(self) -> dict[str, Any]:
        # The compiled kernel and fill do not pickle; they are rebuilt empty. Copies (the lane
        # runner's fresh operators, check_operator) are taken between epochs, when no bin is open.
        if self._fill is not None and self._fill.n_open:
            raise RuntimeError(f"{self.name}: cannot copy or pickle a packer that holds open bins")
        state = dict(vars(self))
        del state["_kernel"], state["_fill"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self._kernel = self._new_kernel()
        self._fill = self._new_fill()

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        return self._place(records)

    def holdings(self) -> tuple[list[SampleRecord], dict[str, Any]]:
        """The inputs with a fragment in an open bin, the fragments' placement rows and the
        placement kernel's state (open bins, next bin id)."""
        fill = self._bins()
        rows, items = fill.contents()
        return items, {"rows": rows, "kernel": self._kernel.state()}

    def restore_holdings(self, records: list[SampleRecord], state: dict[str, Any]) -> None:
        rows = np.asarray(state["rows"], dtype=np.int64).reshape(-1, 5)
        if len(rows) and not 0 <= int(rows[:, 0].min()) <= int(rows[:, 0].max()) < len(records):
            raise ValueError(f"{self.name}: held rows name inputs outside 0..{len(records) - 1}")
        fill = self._bins()
        if len(rows):
            arrays, _, sides = self._inputs(records)
            fill.write(np.ascontiguousarray(rows), arrays, records, sides)
        self._kernel.restore(state["kernel"])

    def flush(self) -> list[SampleRecord]:
        closed = self._leaving_bins()
        out = self._emit(closed) if len(closed) else []
        # Bin ids restart at 0: bins never cross an epoch boundary.
        self._kernel.reset()
        if self._fill is not None:
            self._fill.clear()
        return out


class PackSequences(_Packer):
    """Packs token sequences into bins of ``seq_len`` with at most ``open_bins`` open bins
    (``BinPacker``), emitting a bin when it is full, when it holds ``max_segments`` sequences,
    when it must make room, or at a flush. With ``strategy="wrap"`` it concatenates and cuts
    (``FlatPacker``, as ``pack_flat``): every row is full but an epoch's last.

    Reorders (but ``"wrap"``): bins leave in the order they close, so the bin that closes a base
    offset may leave before a sibling's bin (fine on the epoch path, where eviction waits for the
    epoch marker).
    """

    name = "pack_sequences"
    traits = OpTraits(preserves_cursor_order=False, stateful=True)

    def __init__(
        self,
        seq_len: int,
        *,
        field: str = "tokens",
        open_bins: int = 64,
        strategy: str = "best_fit",
        pad_id: int | None = None,
        extra_fields: Mapping[str, int | float] | None = None,
        cut_to_fill: bool = False,
        max_segments: int | None = None,
        images: str | None = None,
    ):
        if strategy not in _STRATEGIES:
            raise ValueError(
                f"pack_sequences: strategy must be one of {_STRATEGIES}, got {strategy!r}"
            )
        open_bins = check_int(open_bins, "open_bins", "pack_sequences", minimum=1)
        if strategy == "wrap" and images is not None:
            raise ValueError(
                "pack_sequences: strategy='wrap' cuts the stream anywhere, also inside an "
                "image's tokens, so it takes no images; use best_fit or first_fit"
            )
        self._setup(seq_len, field, pad_id, extra_fields, images)
        if not isinstance(cut_to_fill, bool):
            raise TypeError(
                f"pack_sequences: cut_to_fill must be True or False, got {cut_to_fill!r}"
            )
        if max_segments is not None:
            max_segments = check_int(max_segments, "max_segments", "pack_sequences", minimum=1)
        if strategy == "wrap" and (cut_to_fill or max_segments is not None):
            raise ValueError(
                "pack_sequences: strategy='wrap' cuts the stream wherever a row is full, so it "
                "takes neither cut_to_fill nor max_segments; use best_fit or first_fit for those"
            )
        self.open_bins = open_bins
        self.strategy = strategy
        self._takes_images = strategy != "wrap"
        self.cut_to_fill = cut_to_fill
        self.max_segments = max_segments
        if strategy == "wrap":  # rows leave in stream order
            self.traits = OpTraits(preserves_cursor_order=True, stateful=True)
        self._kernel = self._new_kernel()

    def describe(self) -> dict[str, Any]:
        """As the packers' ``describe``; ``cut_to_fill`` and ``max_segments`` count only when
        set, so a packer without them keeps the fingerprint it had before they existed."""
        out = super().describe()
        if not self.cut_to_fill:
            del out["params"]["cut_to_fill"]
        if self.max_segments is None:
            del out["params"]["max_segments"]
        return out

    def _leaving_bins(self) -> np.ndarray:
        """Every open bin. With ``cut_to_fill`` the open bins' fragments are laid out again
        first, into as few full bins as their tokens need (``_consolidated``): the end of an
        epoch leaves at most one bin partly empty instead of every open one."""
        closed = self._kernel.flush()
        fill = self._fill
        if not self.cut_to_fill or fill is None or fill.n_open < 2:
            return closed
        rows, items = fill.contents()
        arrays, _, sides = self._inputs(items)
        head_of = None
        if self.images is not None:
            spans = [self._spans_of(rec) for rec in items]

            def head_of(item: int, start: int, room: int) -> int:
                return _head_outside(spans[item], start, room)

        rows = _consolidated(rows, self.seq_len, head_of, self.max_segments)
        fill.clear()
        fill.write(rows, arrays, items, sides)
        return np.arange(rows[-1, 3] + 1, dtype=np.int64)  # _consolidated numbers bins 0, 1, ...

    def _new_kernel(self) -> BinPacker | FlatPacker:
        if self.strategy == "wrap":
            return FlatPacker(self.seq_len)
        return BinPacker(
            self.seq_len,
            self.open_bins,
            self.strategy,  # type: ignore[arg-type]
            cut_to_fill=self.cut_to_fill,
            max_segments=self.max_segments,
        )


class PackFlat(_Packer):
    """Concatenates token sequences in arrival order and cuts the stream every ``seq_len`` tokens
    (``FlatPacker``); an input may wrap across several bins. A flush emits the partial last bin.

    Order-preserving: bins leave in stream order, so each base offset closes with its last record.
    """

    name = "pack_flat"
    traits = OpTraits(preserves_cursor_order=True, stateful=True)

    def __init__(
        self,
        seq_len: int,
        *,
        field: str = "tokens",
        pad_id: int | None = None,
        extra_fields: Mapping[str, int | float] | None = None,
    ):
        self._setup(seq_len, field, pad_id, extra_fields)
        self._kernel = self._new_kernel()

    def _new_kernel(self) -> FlatPacker:
        return FlatPacker(self.seq_len)


def pack_sequences(
    seq_len: int,
    *,
    field: str = "tokens",
    open_bins: int = 64,
    strategy: str = "best_fit",
    pad_id: int | None = None,
    extra_fields: Mapping[str, int | float] | None = None,
    cut_to_fill: bool = False,
    max_segments: int | None = None,
    group_by: str | Callable[[Any], Hashable] | None = None,
    images: str | None = None,
) -> Operator:
    """Pack ``payload[field]`` sequences into ``seq_len``-token bins, holding at most ``open_bins``
    open; ``strategy`` ``"best_fit"`` (tightest bin that fits) or ``"first_fit"``. A sequence
    longer than ``seq_len`` is cut into ``seq_len`` fragments that fill bins of their own, and its
    remainder is placed like any sequence. N -> 1, reorders, stateful; nothing is dropped.

    ``strategy="wrap"``: concatenate the sequences in arrival order and cut every ``seq_len``
    tokens, never waiting for a fit: every row is full but the last of an epoch, and sequences
    are cut across rows (order-preserving, like ``pack_flat``).

    ``max_segments``: a row holds at most that many sequences (fragments); it leaves once it
    has them, full or not (attention cost and position budgets of some models are per segment).
    An empty sequence joins a row without counting as one.

    ``group_by``: rows only mix sequences of one group: a payload field name (``"lang"``) or a
    function of the payload giving a str or int. Each group packs into bins of its own, with up
    to ``open_bins`` open bins each; an epoch's end flushes the groups in sorted order.

    ``cut_to_fill=True``: when a sequence fits in no open bin and one must leave, the head of the
    sequence fills that bin's rest first (it leaves full, not padded) and the rest is placed as
    usual; a row holds at most one piece of a cut sequence. At a flush (the epoch's end) the open
    bins' fragments are laid out again into full rows, each cut at most once, so only the last
    row of the flush is padded. Fill rises close to 1, at the price of documents split across
    rows (each piece keeps its contributors, so resume stays exact). The default keeps every
    document that fits in a row whole.

    Padding (``segment_ids == 0``) holds ``pad_id``; with ``pad_id=None`` the padding token of the
    ``tokenize`` upstream (``ByteTokenizer``: 257), and planning fails with a ``PlanError`` when
    there is none: pass ``pad_id=`` then (always, for tokens made without ``tokenize``).

    ``extra_fields`` (``{"loss_mask": 0, "weights": 0.0}``): per-token fields packed alongside,
    each padded with its value (an int: ``int32``, a float: ``float32``) and cut wherever the tokens
    are cut; every input must hold each of them, as long as its tokens.

    ``images`` (``"images"``): the payload field holding the images of inputs tokenized with
    images (``tokenize_chat`` / ``tokenize_interleaved``): no row is cut inside an image's token
    span and each row carries its images (see the module docstring)."""
    packer = PackSequences(
        seq_len,
        field=field,
        open_bins=open_bins,
        strategy=strategy,
        pad_id=pad_id,
        extra_fields=extra_fields,
        cut_to_fill=cut_to_fill,
        max_segments=max_segments,
        images=images,
    )
    return packer if group_by is None else GroupedPacker(packer, group_by)


def pack_flat(
    seq_len: int,
    *,
    field: str = "tokens",
    pad_id: int | None = None,
    extra_fields: Mapping[str, int | float] | None = None,
) -> PackFlat:
    """Concatenate ``payload[field]`` sequences in arrival order and cut every ``seq_len`` tokens;
    the partial last bin of an epoch is padded with ``pad_id``, or with ``pad_id=None`` the
    padding token of the ``tokenize`` upstream (a ``PlanError`` when there is none, as for
    ``pack_sequences``). ``extra_fields`` as for ``pack_sequences``: side fields wrap with the
    tokens. N -> 1, order-preserving, stateful."""
    return PackFlat(seq_len, field=field, pad_id=pad_id, extra_fields=extra_fields)


class GroupedPacker(Operator):
    """A packer per group (``pack_sequences(..., group_by=...)``): each input goes to the packer
    of its group, so a row only holds sequences of one group. The packers are copies of one
    planned template, made when their group first appears; an epoch's end flushes them in the
    groups' sorted order (str groups after int ones), which does not depend on when a group
    appeared, so a restore from what the packers hold continues the same stream. Their fills
    write rows into the template's arenas, one after another, and a flush drops the packers
    (keeping their counts): what the packer keeps does not grow with every group it ever saw."""

    traits = OpTraits(preserves_cursor_order=False, stateful=True)
    ratios = _Packer.ratios
    _retired: Callable[[np.ndarray], np.ndarray] | None = None  # ``leave_out``

    def __init__(self, packer: _Packer, group_by: str | Callable[[Any], Hashable]):
        if not (isinstance(group_by, str) or callable(group_by)):
            raise TypeError(
                f"{packer.name}: group_by must be a payload field name or a function of the "
                f"payload, got {group_by!r}"
            )
        self.name = packer.name
        self.packer = packer
        self.group_by = group_by
        self._groups: dict[int | str, _Packer] = {}
        # The counts of the packers flushes dropped.
        self._flushed: dict[str, int | float] = dict.fromkeys(_COUNTERS, 0)

    def describe(self) -> dict[str, Any]:
        """The template packer's identity with the grouping added."""
        out = self.packer.describe()
        out["class"] = f"{type(self).__module__}.{type(self).__qualname__}"
        out["params"]["group_by"] = identify(
            self.group_by, where=f"operator {self.name!r} parameter 'group_by'"
        )
        return out

    @property
    def effective_pad_id(self) -> int | None:
        """As ``PackSequences.effective_pad_id``."""
        return self.packer.effective_pad_id

    def use_upstream_facts(self, facts: Mapping[str, Any]) -> None:
        self.packer.use_upstream_facts(facts)

    def start_epoch(self, lane_id: int, epoch: int) -> None:
        super().start_epoch(lane_id, epoch)
        for packer in self._groups.values():
            packer.start_epoch(lane_id, epoch)

    def _group_of(self, rec: SampleRecord) -> int | str:
        try:
            if isinstance(self.group_by, str):
                group = rec.payload[self.group_by]
            else:
                group = self.group_by(rec.payload)
        except Exception as exc:
            raise record_error(self, rec, exc) from exc
        if isinstance(group, np.generic):
            group = group.item()
        if isinstance(group, bool) or not isinstance(group, (int, str)):
            raise record_error(
                self, rec, TypeError(f"its group is {group!r}; group_by must give a str or an int")
            )
        return group

    def leave_out(self, retired: Callable[[np.ndarray], np.ndarray]) -> bool:
        """Every group's rows leave retired samples out (see ``Operator.leave_out``)."""
        self._retired = retired
        for packer in self._groups.values():
            packer.leave_out(retired)
        return True

    def _packer_of(self, group: int | str) -> _Packer:
        packer = self._groups.get(group)
        if packer is None:
            packer = copy.deepcopy(self.packer)  # the planned template holds no bins
            packer._fill = packer._new_fill(arenas_of=self.packer._fill)
            packer.start_epoch(self.lane_id, self.epoch)
            if self._retired is not None:
                packer.leave_out(self._retired)
            self._groups[group] = packer
        return packer

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        by_group: dict[int | str, list[SampleRecord]] = {}
        for rec in records:
            by_group.setdefault(self._group_of(rec), []).append(rec)
        out: list[SampleRecord] = []
        for group, members in by_group.items():  # groups in order of first appearance
            out += self._packer_of(group).process_many(members)
        return out

    def counters(self) -> dict[str, int | float]:
        """Its group packers' counts, added up (those of the packers flushes dropped too)."""
        out: dict[str, int | float] = dict(self._flushed)
        for packer in self._groups.values():
            for name, value in packer.counters().items():
                out[name] += value
        return out

    def _in_order(self) -> list[tuple[int | str, _Packer]]:
        return sorted(self._groups.items(), key=lambda kv: (isinstance(kv[0], str), kv[0]))

    def flush(self) -> list[SampleRecord]:
        out: list[SampleRecord] = []
        for _, packer in self._in_order():
            out += packer.flush()
        # Every group's bins have left and its kernel starts again: a fresh copy of the template,
        # made when the group appears again, packs as this one would. Only the counts stay.
        for packer in self._groups.values():
            for name, value in packer.counters().items():
                self._flushed[name] += value
        self._groups.clear()
        return out

    def holdings(self) -> tuple[list[SampleRecord], dict[str, Any]]:
        """Every group's held inputs, one group after another, and per group its key, how many
        inputs it holds and its packer's state."""
        records: list[SampleRecord] = []
        groups = []
        for group, packer in self._in_order():
            held, state = packer.holdings()
            if held or state["kernel"] != packer._new_kernel().state():
                records += held
                groups.append([group, len(held), state])
        return records, {"groups": groups}

    def restore_holdings(self, records: list[SampleRecord], state: dict[str, Any]) -> None:
        at = 0
        for group, n, held_state in state["groups"]:
            if isinstance(group, bool) or not isinstance(group, (int, str)) or n < 0:
                raise ValueError(f"{self.name}: a held group {group!r} of {n!r} inputs")
            self._packer_of(group).restore_holdings(records[at : at + n], held_state)
            at += n
        if at != len(records):
            raise ValueError(f"{self.name}: {len(records)} held inputs for {at} in the groups")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(vars(self))
        state["_groups"] = {}  # copies are taken between epochs, when no group holds a bin
        state["_flushed"] = dict.fromkeys(_COUNTERS, 0)  # a copy counts from zero
        if any(p._fill is not None and p._fill.n_open for p in self._groups.values()):
            raise RuntimeError(f"{self.name}: cannot copy or pickle a packer that holds open bins")
        return state
