"""Packing end to end: tokens/s and fill of ``pack_sequences`` / ``pack_flat`` through a
Pipeline (source iteration, fetch, packing and delivery), against Grain's packers and a pure-Python
streaming first-fit on the same input, in the same process.

The workload is ``zephon.bench.packing``'s: 20,000 pre-tokenized sequences of uniform 1..511
tokens (``default_rng(0)``) into bins of 1024, 64 open bins, an epoch (flush) every 4,096 sequences.
Run this file directly to print the comparison table.
"""

from __future__ import annotations

import zephon
from zephon.bench.packing import (
    SEQ_LEN,
    SIDE_FIELDS,
    image_comparison,
    image_payloads,
    packing_comparison,
    python_first_fit,
    run_grain_pack,
    run_pack_collate,
    run_zephon_pack,
    side_payloads,
    token_payloads,
    uniform_lengths,
    zephon_pipeline,
)


def _deliver_all(pipeline: zephon.Pipeline) -> int:
    with pipeline.iter() as loader:
        return sum(1 for _ in loader)


class PackEndToEnd:
    """Tokens/s and fill of the packers through a Pipeline (fetch -> pack), source included."""

    params = (["best_fit", "first_fit", "flat"],)
    param_names = ["packer"]
    timeout = 300

    def setup(self, packer: str) -> None:
        self.lengths = uniform_lengths()
        self.payloads = token_payloads(self.lengths)
        self.pipeline = zephon_pipeline(packer, self.payloads)

    def time_pipeline(self, packer: str) -> None:
        _deliver_all(self.pipeline)

    def track_tokens_per_second(self, packer: str) -> float:
        return run_zephon_pack(packer, self.lengths, payloads=self.payloads)["tokens_per_s"]

    track_tokens_per_second.unit = "tokens/s"  # type: ignore[attr-defined]

    def track_fill(self, packer: str) -> float:
        return run_zephon_pack(packer, self.lengths, payloads=self.payloads)["fill"]

    track_fill.unit = "fill"  # type: ignore[attr-defined]


class PackSideFields:
    """Packing an int32 loss mask and float32 weights with the tokens (``extra_fields``) against
    tokens alone, end to end (target: at most 1.5x the time)."""

    params = (["best_fit", "flat"],)
    param_names = ["packer"]
    timeout = 300

    def setup(self, packer: str) -> None:
        self.lengths = uniform_lengths()
        self.pipeline = zephon_pipeline(
            packer, side_payloads(self.lengths), extra_fields=SIDE_FIELDS
        )

    def time_pipeline_with_side_fields(self, packer: str) -> None:
        _deliver_all(self.pipeline)


class PackImages:
    """Packing and collating sequences that carry images (one 66-token span and its pixels in
    four of five sequences) against the same tokens and masks without images."""

    timeout = 300

    def setup(self) -> None:
        self.payloads = image_payloads(uniform_lengths())

    def time_pack_and_collate_with_images(self) -> None:
        run_pack_collate(self.payloads, images=True)

    def track_ratio_to_text_only(self) -> float:
        return float(image_comparison(repeat=1)["ratio"])

    track_ratio_to_text_only.unit = "ratio"  # type: ignore[attr-defined]


class PackVersusGrain:
    """``pack_sequences`` tokens/s over Grain's packer of the same strategy, measured back to back
    (target: >= 10x, with better fill). Skipped when grain is not installed."""

    params = (["best_fit", "first_fit"],)
    param_names = ["strategy"]
    timeout = 600
    number = 1
    repeat = 3

    def setup(self, strategy: str) -> None:
        self.lengths = uniform_lengths()
        self.payloads = token_payloads(self.lengths)
        if run_grain_pack(strategy, self.lengths[:8], payloads=self.payloads[:8]) is None:
            raise NotImplementedError("grain is not installed (pip install grain)")

    def track_speedup_over_grain(self, strategy: str) -> float:
        ours = run_zephon_pack(strategy, self.lengths, payloads=self.payloads)
        grain = run_grain_pack(strategy, self.lengths, payloads=self.payloads)
        assert grain is not None
        return ours["tokens_per_s"] / grain["tokens_per_s"]

    track_speedup_over_grain.unit = "x"  # type: ignore[attr-defined]

    def track_fill_over_grain(self, strategy: str) -> float:
        ours = run_zephon_pack(strategy, self.lengths, payloads=self.payloads)
        grain = run_grain_pack(strategy, self.lengths, payloads=self.payloads)
        assert grain is not None
        return ours["fill"] - grain["fill"]

    track_fill_over_grain.unit = "fill difference"  # type: ignore[attr-defined]


class PythonFirstFit:
    """The in-process baseline: pure-Python streaming first-fit on the same payloads."""

    timeout = 300

    def setup(self) -> None:
        self.payloads = token_payloads(uniform_lengths())

    def time_python_first_fit(self) -> None:
        python_first_fit(self.payloads)

    def track_fill(self) -> float:
        n_tokens = sum(len(p["tokens"]) for p in self.payloads)
        return n_tokens / (len(python_first_fit(self.payloads)) * SEQ_LEN)

    track_fill.unit = "fill"  # type: ignore[attr-defined]


def main(repeat: int = 5) -> None:
    """Print the comparison table of ``zephon.bench.packing.packing_comparison``."""
    for row in packing_comparison(repeat=repeat):
        grain = row["grain_tokens_per_s"]
        grain_text = (
            f"grain {grain / 1e6:6.2f} Mtok/s fill {row['grain_fill']:.4f}  "
            f"x{row['speedup_vs_grain']:.1f}"
            if grain
            else "grain not installed"
        )
        print(
            f"{row['strategy']:<10} zephon {row['zephon_tokens_per_s'] / 1e6:6.2f} Mtok/s "
            f"fill {row['zephon_fill']:.4f} | {grain_text} | python first-fit "
            f"{row['python_tokens_per_s'] / 1e6:6.2f} Mtok/s x{row['speedup_vs_python']:.1f}"
        )


if __name__ == "__main__":
    main()
