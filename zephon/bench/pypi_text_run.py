# mypy: ignore-errors
# (checked against our own package of the same name, which has none of the names it uses)
"""The text pipeline on the pure-Python loader published on PyPI as ``zephon``, run as a script
by that package's own interpreter, never imported by ours (the import names clash):

    PYPI_PYTHON pypi_text_run.py TEXTS.json TOKENIZER.json SEQ_LEN BATCH EOS_ID

It holds the documents (a JSON list of strings) as ``{"text": ...}`` payloads in in-memory
shards of 1,024 before the clock starts (its best case: no Parquet to read), then times one pass
of ``tokenize(field="text", special_tokens="eos", eos_token_id=EOS_ID) -> pack_flat(SEQ_LEN,
algorithm="best_fit_wrap") -> batch(BATCH)`` (``best_fit_wrap``: its best fit that splits a
document longer than a row instead of dropping it) with the ``tokenizers.Tokenizer`` of
``TOKENIZER.json`` in ``transformers``' ``PreTrainedTokenizerFast`` (the tokenizer it calls), and
prints one JSON line: tokens delivered (padding not counted), documents in and seconds.
"""

import json
import sys
import time

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from zephon import Pipeline
from zephon.io import Dataset, InMemoryShard
from zephon.work import MixtureSpec, StaticMixtureWorkSource


def main(texts: str, tokenizer: str, seq_len: int, batch: int, eos: int) -> None:
    with open(texts, encoding="utf-8") as fh:
        docs = json.load(fh)
    rows = [{"text": text} for text in docs]
    n = len(rows)
    shards = {k: InMemoryShard(rows[a : a + 1024]) for k, a in enumerate(range(0, n, 1024))}
    source = StaticMixtureWorkSource(
        datasets=[Dataset.from_dict("text", shards)],
        mixture=MixtureSpec({"text": 1.0}),
        chunk_size=1024,
        shuffle_shards=False,
        stop_after_passes=1,
    )
    pipeline = (
        Pipeline(source)
        .tokenize(
            PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(tokenizer)),
            field="text",
            special_tokens="eos",
            eos_token_id=eos,
            add_attention_mask=False,
        )
        .pack_flat(seq_len, algorithm="best_fit_wrap", pad_token_id=0)
        .batch(batch, drop_last=False)
    )
    delivered = 0
    began = time.perf_counter()
    for item in pipeline:
        for record in item.records:
            padding = record.meta.tags["_packing_metadata"]["padding_length"]
            delivered += len(record.payload["input_ids"]) - padding
    seconds = time.perf_counter() - began
    print(json.dumps({"tokens": delivered, "documents": n, "seconds": seconds}))


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], args[1], int(args[2]), int(args[3]), int(args[4]))
