"""Mixture benchmark: how much of the tokenized work ``ensure_mixture`` throws away, with a
sample-weighted source against the token-aware one, on the same data.

Two Parquet datasets whose mean document lengths differ ~25x ("code": 200-1,000 words,
"docstrings": 5-40 words), a Hugging Face ``tokenizers`` BPE trained on them locally, weights
0.7 / 0.3 by tokens, and the pipeline ``MixtureSource -> fetch -> tokenize -> ensure_mixture ->
pack_sequences -> batch`` run to the end. For each way of weighing the source the run reports the
delivered token shares, the fraction of tokenized tokens ``ensure_mixture`` dropped (tokenized =
delivered + dropped: packing with split documents loses none) and the batches delivered.

Functions only: ``zephon bench`` (``report.mixture_rows``) and the asv suite call them; ``python
-m zephon.bench.mixture`` prints the table quoted in ``docs/mixtures.md``.
"""

from __future__ import annotations

import os
import random
import tempfile
import warnings
from typing import Any

WEIGHTS = {"code": 0.7, "docstrings": 0.3}
SEQ_LEN = 512
CODE_WORDS = ["def", "return", "self", "import", "for", "in", "if", "else", "x", "y", "=", "()"]
DOC_WORDS = ["the", "value", "of", "returns", "a", "list", "given", "when", "is", "none"]

__all__ = ["SEQ_LEN", "WEIGHTS", "mixture_pipeline", "run_mixture", "write_corpus"]


def write_corpus(directory: str, n_code: int = 4_000, n_docs: int = 30_000, seed: int = 0) -> Any:
    """Parquet files ``code.parquet`` and ``docstrings.parquet`` (columns ``text`` and
    ``n_tokens``, the BPE's token count of the text) in ``directory``, and the trained BPE."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    texts = {
        "code": [
            " ".join(rng.choices(CODE_WORDS, k=rng.randint(200, 1000))) for _ in range(n_code)
        ],
        "docstrings": [
            " ".join(rng.choices(DOC_WORDS, k=rng.randint(5, 40))) for _ in range(n_docs)
        ],
    }
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = [" ".join(words) for words in (CODE_WORDS, DOC_WORDS)] * 50
    trainer = trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<|endoftext|>", "<pad>"]
    )
    bpe.train_from_iterator(corpus, trainer)
    for name, docs in texts.items():
        lengths = [len(e.ids) for e in bpe.encode_batch(docs)]
        table = pa.table({"text": docs, "n_tokens": lengths})
        pq.write_table(table, os.path.join(directory, f"{name}.parquet"), row_group_size=500)
    return bpe


def mixture_pipeline(directory: str, bpe: Any, how: str, **kw: Any) -> Any:
    """The pipeline with the source weighed ``how``: ``"samples"``, ``"tokenizer"`` (by tokens,
    ratio calibrated with ``bpe``), ``"pinned"`` (by tokens, ``tokens_per_byte=`` given) or
    ``"length_column"`` (by tokens, from ``n_tokens``)."""
    import zephon
    from zephon.ops import batch, ensure_mixture, fetch, pack_sequences, tokenize
    from zephon.sources import ArrowSource, MixtureSource

    parts = {
        name: ArrowSource([os.path.join(directory, f"{name}.parquet")], dataset_id=i)
        for i, name in enumerate(sorted(WEIGHTS))
    }
    options: dict[str, Any] = {
        "samples": {},
        "tokenizer": {"by": "tokens", "tokenizer": bpe},
        "pinned": {"by": "tokens", "tokens_per_byte": {"code": 0.25, "docstrings": 0.21}},
        "length_column": {"by": "tokens", "length_column": "n_tokens"},
    }[how]
    source = MixtureSource(parts, WEIGHTS, chunk_size=256, **options)
    ops = [
        fetch(),
        tokenize(bpe, max_len=SEQ_LEN, split_long_samples=True),
        ensure_mixture(WEIGHTS, by="tokens"),
        pack_sequences(SEQ_LEN),
        batch(8),
    ]
    return zephon.Pipeline(source, ops, **kw)


def run_mixture(directory: str, bpe: Any, how: str, **kw: Any) -> dict[str, Any]:
    """Run the pipeline to the end: token shares delivered, fraction of tokenized tokens dropped,
    records tokenized and dropped, batches, and the source's sample shares."""
    from zephon.errors import MixtureDropWarning

    pipeline = mixture_pipeline(directory, bpe, how, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MixtureDropWarning)
        with iter(pipeline) as loader:
            batches = sum(1 for _ in loader)
            stats = loader.stats()
    comps = stats["mixture_components"]
    delivered = sum(c["tokens"] for c in comps.values())
    dropped = sum(c["dropped_tokens"] for c in comps.values())
    records = sum(c["samples"] + c["dropped_samples"] for c in comps.values())
    return {
        "how": how,
        "shares": {n: c["share"] for n, c in comps.items()},
        "dropped_fraction": dropped / (delivered + dropped),
        "tokens_tokenized": delivered + dropped,
        "tokens_dropped": dropped,
        "records_dropped": stats["mixture_dropped"],
        "fragments": records,
        "batches": batches,
        "sample_shares": pipeline.source.sample_shares(),
        "warned": any(issubclass(w.category, MixtureDropWarning) for w in caught),
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        bpe = write_corpus(directory)
        print("| source weighed by | code / docstrings token share | tokens dropped | batches |")
        print("|---|---|---|---|")
        for how in ("samples", "tokenizer", "pinned", "length_column"):
            r = run_mixture(directory, bpe, how)
            shares = f"{r['shares']['code']:.3f} / {r['shares']['docstrings']:.3f}"
            print(
                f"| {how} | {shares} | {r['dropped_fraction']:.1%} "
                f"({r['tokens_dropped']:,} of {r['tokens_tokenized']:,}) | {r['batches']:,} |"
            )


if __name__ == "__main__":
    main()
