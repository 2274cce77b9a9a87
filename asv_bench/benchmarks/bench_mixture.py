"""Mixtures: the fraction of tokenized tokens ``ensure_mixture`` drops when the source is weighed
by samples and when it is weighed by tokens (calibrated, pinned ratio, length column), on the
same two Parquet datasets whose documents differ ~25x in length (``zephon.bench.mixture``).

Target: by tokens, at most 5% dropped and token shares within 0.01 of 0.7 / 0.3.
"""

from __future__ import annotations

import tempfile
from typing import Any

from zephon.bench import mixture as mb


class DroppedTokens:
    """Fraction of the tokenized tokens dropped by ``ensure_mixture`` (lower is better)."""

    params = (["samples", "tokenizer", "pinned", "length_column"],)
    param_names = ["source"]
    timeout = 300

    def setup_cache(self) -> dict[str, Any]:
        results = {}
        with tempfile.TemporaryDirectory() as directory:
            bpe = mb.write_corpus(directory, 1_000, 8_000)
            for how in self.params[0]:
                results[how] = mb.run_mixture(directory, bpe, how)
        return results

    def track_dropped_fraction(self, results: dict[str, Any], how: str) -> float:
        return float(results[how]["dropped_fraction"])

    def track_code_share(self, results: dict[str, Any], how: str) -> float:
        return float(results[how]["shares"]["code"])

    def track_batches(self, results: dict[str, Any], how: str) -> int:
        return int(results[how]["batches"])
