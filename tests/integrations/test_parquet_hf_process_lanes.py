"""Real data end to end: Parquet written by pyarrow, a Hugging Face BPE tokenizer trained here,
two process lanes. Every token the tokenizer produces for the corpus is delivered, exactly once."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import zephon
from zephon.ops import batch, fetch, pack_sequences, tokenize
from zephon.sources import ArrowSource

WORDS = [
    "the",
    "loader",
    "resumes",
    "exactly",
    "where",
    "training",
    "stopped",
    "and",
    "packs",
    "every",
    "token",
    "it",
    "reads",
]


def corpus(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(3, 40)))) for _ in range(n)]


def train_bpe(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=80, special_tokens=["[UNK]"]))
    return tok


def test_delivered_tokens_equal_the_tokenizers_counts_for_the_corpus(tmp_path):
    shards = [corpus(700, seed) for seed in (1, 2)]
    paths = []
    for i, texts in enumerate(shards):
        path = tmp_path / f"shard-{i}.parquet"
        pq.write_table(
            pa.table({"text": texts, "id": np.arange(len(texts))}), path, row_group_size=128
        )
        paths.append(path)
    bpe = train_bpe(shards[0] + shards[1])
    expected = sum(len(bpe.encode(t).ids) for texts in shards for t in texts)

    pipeline = zephon.Pipeline(
        ArrowSource(paths, chunk_size=100),
        [
            fetch(),
            tokenize(bpe, max_len=64, split_long_samples=True, append_eos=False),
            pack_sequences(128, pad_id=0),  # the BPE has no padding token
            batch(4),
        ],
        lanes=2,
        workers="process",
        epoch_chunks=3,
    )
    delivered = 0
    with pipeline.iter() as loader:
        for b in loader:
            delivered += int(np.count_nonzero(b.payload["segment_ids"]))
        stats = loader.stats()
    assert delivered == expected
    assert sum(stats["mixture"].values()) > 0.999  # token accounting reached delivery
    assert stats["violations"] == 0 and stats["inflight_chunks"] == 0
