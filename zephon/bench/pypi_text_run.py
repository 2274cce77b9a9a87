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

from pypi_common import one_pass_source, packed_tokens, timed_pass
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from zephon import Pipeline


def main(texts: str, tokenizer: str, seq_len: int, batch: int, eos: int) -> None:
    with open(texts, encoding="utf-8") as fh:
        docs = json.load(fh)
    rows = [{"text": text} for text in docs]
    pipeline = (
        Pipeline(one_pass_source("text", rows))
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
    delivered, seconds = timed_pass(pipeline, packed_tokens("input_ids"))
    print(json.dumps({"tokens": delivered, "documents": len(rows), "seconds": seconds}))


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], args[1], int(args[2]), int(args[3]), int(args[4]))
