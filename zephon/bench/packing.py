"""Packing end to end: ``pack_sequences`` through a Pipeline against Grain's packers and
a pure-Python streaming first-fit, on the same pre-tokenized input, in the same process.

The workload: 20,000 sequences of uniform 1..511 tokens (``numpy.random.default_rng(0)``) packed
into bins of 1024 tokens with 64 open bins. Zephon's run is source iteration + ``fetch`` +
``pack_sequences`` (+ ``batch`` if asked) with an epoch (a flush of all open bins) every 4,096
sequences: chunks of 1,024 samples, 4 chunks per epoch. Tokens are int32 arrays made before the
clock starts, so tokenization is not measured; every packer builds the same payload (tokens,
segment ids, positions). Fill is input tokens / (packed records * seq_len).

Grain runs with ``ReadOptions(num_threads=0, prefetch_buffer_size=0)`` and ``shuffle_bins=False``:
its fastest configuration here (its default read threads only add overhead to an in-memory source).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import zephon
from zephon.bench.clock import start_clock
from zephon.ops import batch, fetch, pack_flat, pack_sequences, training_collate
from zephon.sources.memory import RangeSource

__all__ = [
    "image_comparison",
    "packing_comparison",
    "run_grain_pack",
    "run_python_first_fit",
    "run_zephon_pack",
    "side_field_comparison",
    "uniform_lengths",
]

SEQ_LEN = 1024
OPEN_BINS = 64
N_SEQUENCES = 20_000
EPOCH_SEQUENCES = 4096
CHUNK_SIZE = 1024
STRATEGIES = ("best_fit", "first_fit")


def uniform_lengths(n: int = N_SEQUENCES, seed: int = 0, high: int = 512) -> np.ndarray:
    """``n`` sequence lengths uniform in ``1..high-1`` from ``numpy.random.default_rng(seed)``."""
    return np.random.default_rng(seed).integers(1, high, size=n)


def token_payloads(lengths: Sequence[int] | np.ndarray) -> list[dict[str, np.ndarray]]:
    """Pre-tokenized payloads ``{"tokens": int32[length]}`` (token ids 0..length-1)."""
    return [{"tokens": np.arange(int(k), dtype=np.int32)} for k in lengths]


#: The side fields of the side-field workload and their padding: an int32 loss mask and
#: float32 per-token weights.
SIDE_FIELDS: dict[str, int | float] = {"loss_mask": 0, "weights": 0.0}


def side_payloads(lengths: Sequence[int] | np.ndarray) -> list[dict[str, np.ndarray]]:
    """``token_payloads`` plus the ``SIDE_FIELDS``: a loss mask (odd positions) and weights."""
    out = []
    for payload in token_payloads(lengths):
        tokens = payload["tokens"]
        payload["loss_mask"] = (tokens & 1).astype(np.int32)
        payload["weights"] = np.ones(len(tokens), dtype=np.float32)
        out.append(payload)
    return out


class PayloadAt:
    """``RangeSource`` ``make``: the precomputed payload of sample ``idx``."""

    def __init__(self, payloads: list[dict[str, np.ndarray]]):
        self.payloads = payloads

    def __call__(self, idx: int) -> dict[str, np.ndarray]:
        return self.payloads[idx]


def _fill(n_tokens: int, n_bins: int, seq_len: int) -> float:
    return n_tokens / (n_bins * seq_len) if n_bins else 0.0


def _result(n_tokens: int, n_bins: int, seconds: float, seq_len: int) -> dict[str, float]:
    return {
        "tokens_per_s": n_tokens / seconds,
        "fill": _fill(n_tokens, n_bins, seq_len),
        "seconds": seconds,
        "bins": n_bins,
    }


def zephon_pipeline(
    strategy: str,
    payloads: list[dict[str, np.ndarray]],
    *,
    seq_len: int = SEQ_LEN,
    open_bins: int = OPEN_BINS,
    epoch_sequences: int = EPOCH_SEQUENCES,
    batch_size: int | None = None,
    extra_fields: dict[str, int | float] | None = None,
    cut_to_fill: bool = False,
) -> zephon.Pipeline:
    """fetch -> pack_sequences (``strategy`` ``"best_fit"`` / ``"first_fit"``; ``"flat"`` for
    pack_flat) (-> batch) over ``payloads`` on one inline lane, an epoch every ``epoch_sequences``
    sequences (a multiple of the chunk size, ``min(1024, epoch_sequences)``)."""
    chunk = min(CHUNK_SIZE, epoch_sequences)
    if epoch_sequences % chunk:
        raise ValueError(f"epoch_sequences must be a multiple of {chunk}, got {epoch_sequences}")
    packer = (
        pack_flat(seq_len, pad_id=0, extra_fields=extra_fields)
        if strategy == "flat"
        else pack_sequences(
            seq_len,
            open_bins=open_bins,
            strategy=strategy,
            pad_id=0,
            extra_fields=extra_fields,
            cut_to_fill=cut_to_fill,
        )
    )
    ops: list[Any] = [fetch(), packer]
    if batch_size:
        ops.append(batch(batch_size))
    return zephon.Pipeline(
        RangeSource(len(payloads), make=PayloadAt(payloads), chunk_size=chunk),
        ops,
        epoch_chunks=epoch_sequences // chunk,
    )


def run_zephon_pack(
    strategy: str,
    lengths: Sequence[int] | np.ndarray,
    seq_len: int = SEQ_LEN,
    open_bins: int = OPEN_BINS,
    *,
    epoch_sequences: int = EPOCH_SEQUENCES,
    batch_size: int | None = None,
    payloads: list[dict[str, np.ndarray]] | None = None,
    extra_fields: dict[str, int | float] | None = None,
    cut_to_fill: bool = False,
) -> dict[str, float]:
    """Tokens/s and fill of ``pack_sequences`` end to end (source, fetch, pack, delivery; plus
    ``batch`` when ``batch_size`` is given; with ``extra_fields`` the payloads' side fields are
    packed too). Also ``seconds`` and ``bins`` (packed records)."""
    payloads = token_payloads(lengths) if payloads is None else payloads
    n_tokens = int(np.sum(lengths))
    pipeline = zephon_pipeline(
        strategy,
        payloads,
        seq_len=seq_len,
        open_bins=open_bins,
        epoch_sequences=epoch_sequences,
        batch_size=batch_size,
        extra_fields=extra_fields,
        cut_to_fill=cut_to_fill,
    )
    # Planning (which fingerprints the in-memory payloads, array by array) happens before the
    # clock starts, like building Grain's datasets; iteration, packing and delivery are timed.
    loader = pipeline.iter()
    start = start_clock()
    n_bins = 0
    with loader:
        for item in loader:
            n_bins += len(item) if batch_size else 1
    return _result(n_tokens, n_bins, time.perf_counter() - start, seq_len)


def run_grain_pack(
    strategy: str,
    lengths: Sequence[int] | np.ndarray,
    seq_len: int = SEQ_LEN,
    open_bins: int = OPEN_BINS,
    *,
    payloads: list[dict[str, np.ndarray]] | None = None,
) -> dict[str, float] | None:
    """Tokens/s and fill of Grain's ``BestFitPackIterDataset`` / ``FirstFitPackIterDataset`` on
    the same payloads (iteration from an in-memory ``MapDataset`` included); None when grain is
    not installed."""
    try:
        import grain
        from grain.experimental import BestFitPackIterDataset, FirstFitPackIterDataset
    except ImportError:
        return None
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    packer = BestFitPackIterDataset if strategy == "best_fit" else FirstFitPackIterDataset
    payloads = token_payloads(lengths) if payloads is None else payloads
    n_tokens = int(np.sum(lengths))
    options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    dataset = packer(
        grain.MapDataset.source(payloads).to_iter_dataset(options),
        length_struct={"tokens": seq_len},
        num_packing_bins=open_bins,
        shuffle_bins=False,
    )
    start = start_clock()
    n_bins = 0
    for _ in dataset:
        n_bins += 1
    return _result(n_tokens, n_bins, time.perf_counter() - start, seq_len)


class _Bin:
    __slots__ = ("positions", "room", "segment_ids", "segments", "tokens")

    def __init__(self, seq_len: int) -> None:
        self.tokens = np.zeros(seq_len, dtype=np.int32)
        self.segment_ids = np.zeros(seq_len, dtype=np.int32)
        self.positions = np.zeros(seq_len, dtype=np.int32)
        self.room = seq_len
        self.segments = 0


def python_first_fit(
    payloads: list[dict[str, np.ndarray]],
    seq_len: int = SEQ_LEN,
    open_bins: int = OPEN_BINS,
    epoch_sequences: int = EPOCH_SEQUENCES,
) -> list[dict[str, np.ndarray]]:
    """A pure-Python streaming first-fit packer (the shape of Grain's), with the rules and payload
    of ``pack_sequences``: a long sequence fills bins of its own, the fullest bin leaves when
    nothing fits, every bin leaves each ``epoch_sequences`` sequences."""
    out: list[dict[str, np.ndarray]] = []
    bins: list[_Bin] = []
    arange = np.arange(seq_len, dtype=np.int32)

    def emit(b: _Bin) -> None:
        out.append({"tokens": b.tokens, "segment_ids": b.segment_ids, "positions": b.positions})

    def place(b: _Bin, piece: np.ndarray) -> None:
        at = seq_len - b.room
        n = len(piece)
        b.segments += 1
        b.tokens[at : at + n] = piece
        b.segment_ids[at : at + n] = b.segments
        b.positions[at : at + n] = arange[:n]
        b.room -= n

    for i, payload in enumerate(payloads):
        tokens = payload["tokens"]
        while len(tokens) >= seq_len:
            full = _Bin(seq_len)
            place(full, tokens[:seq_len])
            emit(full)
            tokens = tokens[seq_len:]
        if len(tokens):
            target = next((b for b in bins if b.room >= len(tokens)), None)
            if target is None:
                if len(bins) == open_bins:
                    fullest = min(bins, key=lambda b: b.room)
                    bins.remove(fullest)
                    emit(fullest)
                target = _Bin(seq_len)
                bins.append(target)
            place(target, tokens)
            if target.room == 0:
                bins.remove(target)
                emit(target)
        if (i + 1) % epoch_sequences == 0:
            for b in bins:
                emit(b)
            bins = []
    for b in bins:
        emit(b)
    return out


def run_python_first_fit(
    lengths: Sequence[int] | np.ndarray,
    seq_len: int = SEQ_LEN,
    open_bins: int = OPEN_BINS,
    *,
    epoch_sequences: int = EPOCH_SEQUENCES,
    payloads: list[dict[str, np.ndarray]] | None = None,
) -> dict[str, float]:
    """Tokens/s and fill of ``python_first_fit`` on the same payloads (the in-process baseline)."""
    payloads = token_payloads(lengths) if payloads is None else payloads
    n_tokens = int(np.sum(lengths))
    start = start_clock()
    bins = python_first_fit(payloads, seq_len, open_bins, epoch_sequences)
    return _result(n_tokens, len(bins), time.perf_counter() - start, seq_len)


def packing_comparison(
    repeat: int = 5,
    *,
    lengths: Sequence[int] | np.ndarray | None = None,
    seq_len: int = SEQ_LEN,
    open_bins: int = OPEN_BINS,
    strategies: Sequence[str] = STRATEGIES,
) -> list[dict[str, Any]]:
    """One row per strategy: median tokens/s over ``repeat`` runs and fill of Zephon, Grain (None
    when not installed) and the Python first-fit baseline, and Zephon's speedup over each.

    The runs alternate (Zephon, Grain, Python, Zephon, ...) so that load on the machine falls on
    all of them alike. The target: ``speedup_vs_grain >= 10`` with ``zephon_fill`` above
    ``grain_fill``.
    """
    lengths = uniform_lengths() if lengths is None else np.asarray(lengths)
    payloads = token_payloads(lengths)
    rows = []
    for strategy in strategies:
        runs: dict[str, list[dict[str, float]]] = {"zephon": [], "grain": [], "python": []}
        for _ in range(repeat):
            runs["zephon"].append(
                run_zephon_pack(strategy, lengths, seq_len, open_bins, payloads=payloads)
            )
            grain_run = run_grain_pack(strategy, lengths, seq_len, open_bins, payloads=payloads)
            if grain_run is not None:
                runs["grain"].append(grain_run)
            runs["python"].append(
                run_python_first_fit(lengths, seq_len, open_bins, payloads=payloads)
            )
        row: dict[str, Any] = {
            "strategy": strategy,
            "sequences": len(lengths),
            "tokens": int(np.sum(lengths)),
            "repeat": repeat,
        }
        for name, results in runs.items():
            if not results:
                row[f"{name}_tokens_per_s"] = row[f"{name}_fill"] = None
                continue
            row[f"{name}_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in results)
            row[f"{name}_fill"] = results[0]["fill"]
        for name in ("grain", "python"):
            base = row[f"{name}_tokens_per_s"]
            row[f"speedup_vs_{name}"] = row["zephon_tokens_per_s"] / base if base else None
        rows.append(row)
    return rows


def side_field_comparison(
    repeat: int = 5,
    *,
    lengths: Sequence[int] | np.ndarray | None = None,
    strategies: Sequence[str] = ("best_fit", "flat"),
) -> list[dict[str, Any]]:
    """One row per packer: median seconds of packing tokens with the two ``SIDE_FIELDS`` against
    packing the same tokens alone, end to end, runs alternating; ``ratio``: the median of each
    round's with / without (target: at most 1.5)."""
    lengths = uniform_lengths() if lengths is None else np.asarray(lengths)
    plain = token_payloads(lengths)
    sided = side_payloads(lengths)
    rows = []
    for strategy in strategies:
        alone: list[float] = []
        with_sides: list[float] = []
        for _ in range(repeat):
            alone.append(run_zephon_pack(strategy, lengths, payloads=plain)["seconds"])
            with_sides.append(
                run_zephon_pack(strategy, lengths, payloads=sided, extra_fields=SIDE_FIELDS)[
                    "seconds"
                ]
            )
        rows.append(
            {
                "strategy": strategy,
                "sequences": len(lengths),
                "tokens_alone_s": statistics.median(alone),
                "with_sides_s": statistics.median(with_sides),
                # The median of the rounds' own ratios, as for the other ratio rows: a machine
                # whose speed drifts between rounds then moves both sides of a ratio alike.
                "ratio": statistics.median(w / a for w, a in zip(with_sides, alone)),
                "repeat": repeat,
            }
        )
    return rows


#: The image workload: a span of 66 tokens (start, 64 image tokens, end: a 224 x 224 image in
#: patches of 14 merged 2 x 2) a third of the way into every sequence of at least 100 tokens.
IMAGE_SPAN = 66


def image_payloads(
    lengths: Sequence[int] | np.ndarray, pixels: np.ndarray | None = None
) -> list[dict[str, Any]]:
    """``token_payloads`` with a loss mask, and one image (``pixels``, shared: a float32
    ``(3, 32, 32)`` by default) with its ``image_spans`` in every sequence of 100 tokens or
    more."""
    image = np.zeros((3, 32, 32), dtype=np.float32) if pixels is None else pixels
    out: list[dict[str, Any]] = []
    for tokens in token_payloads(lengths):
        payload: dict[str, Any] = dict(tokens)
        n = len(payload["tokens"])
        payload["loss_mask"] = np.ones(n, dtype=np.int32)
        held = n >= 100
        payload["images"] = [image] if held else []
        spans = [(n // 3, n // 3 + IMAGE_SPAN)] if held else []
        payload["image_spans"] = np.array(spans, dtype=np.int32).reshape(-1, 2)
        out.append(payload)
    return out


def run_pack_collate(
    payloads: list[dict[str, Any]], *, images: bool, batch_size: int = 8
) -> dict[str, float]:
    """Seconds (and rows) of ``fetch -> pack_sequences(1024, extra_fields={"loss_mask": 0})
    -> batch(collate=training_collate())`` over ``payloads``, with ``images="images"`` in the
    packer and the collate when ``images``, on one inline lane; planning is not timed."""
    where = "images" if images else None
    ops = [
        fetch(),
        pack_sequences(
            SEQ_LEN, open_bins=OPEN_BINS, pad_id=0, extra_fields={"loss_mask": 0}, images=where
        ),
        batch(batch_size, collate=training_collate(images=where)),
    ]
    pipeline = zephon.Pipeline(
        RangeSource(len(payloads), make=PayloadAt(payloads), chunk_size=CHUNK_SIZE),
        ops,
        epoch_chunks=EPOCH_SEQUENCES // CHUNK_SIZE,
    )
    loader = pipeline.iter()
    start = start_clock()
    rows = 0
    with loader:
        for item in loader:
            rows += len(item)
    return {"seconds": time.perf_counter() - start, "rows": rows}


def image_comparison(
    repeat: int = 5, *, lengths: Sequence[int] | np.ndarray | None = None
) -> dict[str, Any]:
    """Median seconds of packing and collating sequences that carry images (``image_payloads``)
    against the same tokens and masks without images, runs alternating; ``ratio``: the median
    of each round's with / without."""
    lengths = uniform_lengths() if lengths is None else np.asarray(lengths)
    with_images = image_payloads(lengths)
    plain = [
        {k: v for k, v in payload.items() if k in ("tokens", "loss_mask")}
        for payload in with_images
    ]
    alone: list[float] = []
    carried: list[float] = []
    for _ in range(repeat):
        alone.append(run_pack_collate(plain, images=False)["seconds"])
        carried.append(run_pack_collate(with_images, images=True)["seconds"])
    return {
        "sequences": len(lengths),
        "images": sum(len(p["images"]) for p in with_images),
        "text_only_s": statistics.median(alone),
        "with_images_s": statistics.median(carried),
        "ratio": statistics.median(w / a for w, a in zip(carried, alone)),
        "repeat": repeat,
    }
