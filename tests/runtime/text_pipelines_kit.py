"""The text and mixture pipelines every lane kind is checked on: tokenize, shuffle and batch over
in-memory texts, and two datasets mixed half and half by tokens."""

from __future__ import annotations

from typing import Any

import zephon
from zephon.ops import batch, ensure_mixture, fetch, shuffle, tokenize
from zephon.sources.memory import ListSource
from zephon.sources.mixture import MixtureSource


def texts(dataset: int, n: int) -> ListSource:
    """``n`` texts of dataset ``dataset``, of 4 to 76 characters (chunks of 16)."""
    items = [{"text": "ab" * (2 + (i * 7919 + dataset) % 37)} for i in range(n)]
    return ListSource(items, dataset_id=dataset, chunk_size=16)


def text_pipeline(n: int, **kw: Any) -> zephon.Pipeline:
    """``n`` texts tokenized (long ones split), shuffled and batched by 4; epochs of 4 chunks."""
    ops = [fetch(), tokenize(max_len=24, split_long_samples=True), shuffle(16, seed=3), batch(4)]
    return zephon.Pipeline(texts(0, n), ops, **{"epoch_chunks": 4, **kw})


def mixture_pipeline(n: int, **kw: Any) -> zephon.Pipeline:
    """Two datasets of ``n`` texts each, mixed half and half by tokens and batched by 4."""
    source = MixtureSource(
        {"a": texts(0, n), "b": texts(1, n)}, {"a": 0.5, "b": 0.5}, chunk_size=16
    )
    ops = [
        fetch(),
        tokenize(max_len=24),
        ensure_mixture({"a": 0.5, "b": 0.5}, by="tokens", buffer_size=8),
        batch(4),
    ]
    return zephon.Pipeline(source, ops, epoch_chunks=4, **kw)
