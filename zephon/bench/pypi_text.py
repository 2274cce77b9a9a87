"""The text pipeline against the pure-Python zephon on PyPI, both over the same documents held in
memory: ours, ``fetch -> tokenize -> pack_sequences(2048) -> batch(8)`` on one inline lane, and
the PyPI zephon's ``tokenize -> pack_flat(2048, algorithm="best_fit_wrap") -> batch(8)`` with the
same tokenizer (in ``transformers``' ``PreTrainedTokenizerFast``, which it calls), run by that
package's own interpreter (``pypi_text_run.py``; ``zephon.bench.pypi``). Both append the
end-of-sequence id, cut no document away (its ``best_fit_wrap`` splits one longer than a row, as
ours does) and count the tokens they deliver (padding not counted) per second. The documents
fill whole chunks of 1,024: its pass leaves out a last partial one.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import zephon
from zephon.bench import text as tb
from zephon.bench.pypi import CHUNK, run_script, whole_chunks
from zephon.ops import batch, fetch, pack_sequences, tokenize
from zephon.sources.memory import ListSource

__all__ = ["corpus_documents", "ours_tokens_per_second", "pypi_tokens_per_second"]


def corpus_documents(data: str) -> list[str]:
    """The documents of the Parquet corpus ``data``, as many as fill whole chunks
    (``zephon.bench.pypi.whole_chunks``)."""
    import pyarrow.parquet as pq

    texts = pq.read_table(data, columns=["text"]).column(0).to_pylist()
    return texts[: whole_chunks(len(texts))]


def ours_tokens_per_second(texts: list[str], tokenizer: Any) -> tuple[float, int]:
    """``(tokens/s, tokens)`` delivered by ``fetch -> tokenize -> pack_sequences(2048) ->
    batch(8)`` over ``texts`` (the pipeline made before the clock starts, as the PyPI zephon's
    is)."""
    pipeline = zephon.Pipeline(
        ListSource([{"text": text} for text in texts], chunk_size=CHUNK),
        [fetch(), tokenize(tokenizer), pack_sequences(tb.SEQ_LEN), batch(tb.BATCH)],
    )
    run = tb.run_pipeline(pipeline)
    return run["tokens"] / run["seconds"], int(run["tokens"])


def pypi_tokens_per_second(
    texts: list[str], tokenizer_path: str, eos: int, python: str
) -> tuple[float, int]:
    """``(tokens/s, tokens)`` delivered by the PyPI zephon's text pipeline over ``texts``
    (handed over as JSON, read before its clock starts), measured by ``python`` running
    ``pypi_text_run.py``."""
    with tempfile.TemporaryDirectory() as tmp:
        docs = Path(tmp) / "texts.json"
        docs.write_text(json.dumps(texts), encoding="utf-8")
        args = [str(docs), tokenizer_path, str(tb.SEQ_LEN), str(tb.BATCH), str(eos)]
        out = run_script("pypi_text_run.py", args, python, cwd=tmp)
    return out["tokens"] / out["seconds"], int(out["tokens"])
