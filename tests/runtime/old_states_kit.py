"""Four pipelines (text, mixture, packing, SFT) and the states an earlier Zephon wrote of them.

``python tests/runtime/old_states_kit.py DIR`` writes, with whichever Zephon is importable, one
JSON file per pipeline into DIR: a few states taken along its stream, each with a digest of what
the stream delivered after it. The files in ``tests/runtime/old_states/`` were written this way
by Zephon 0.2.0.dev0 before the checkpoint schema had one owner (state version 4);
``test_old_states.py`` checks that they still resume, exactly where they were taken. Only the
public API is used here, so the same pipelines are built by either version.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, models, pre_tokenizers

import zephon
from zephon.ops import (
    ChatTemplate,
    batch,
    ensure_mixture,
    fetch,
    pack_sequences,
    shuffle,
    tokenize,
    tokenize_chat,
)
from zephon.sources.memory import ListSource
from zephon.sources.mixture import MixtureSource
from zephon.types import SampleBatch

STEPS = (0, 3, 11)  # where the states are taken, in items handed over

TEMPLATE = ChatTemplate(roles={"user": "<u>", "assistant": "<a>"}, end_of_turn="<e>")


def _texts(n: int, dataset: int = 0) -> ListSource:
    items = [{"text": "ab" * (2 + (i * 7919 + dataset) % 13) + str(i)} for i in range(n)]
    return ListSource(items, dataset_id=dataset, chunk_size=8)


def text_pipeline() -> zephon.Pipeline:
    """Tokenized text, shuffled, in batches, over two lanes."""
    ops = [fetch(), tokenize(max_len=16, split_long_samples=True), shuffle(16, seed=3), batch(4)]
    return zephon.Pipeline(_texts(80), ops, lanes=2, epoch_chunks=2)


def mixture_pipeline() -> zephon.Pipeline:
    """Two datasets mixed half and half, held to the mixture by tokens."""
    source = MixtureSource({"a": _texts(60, 0), "b": _texts(60, 1)}, {"a": 0.5, "b": 0.5})
    ops = [
        fetch(),
        tokenize(max_len=24, split_long_samples=True),
        ensure_mixture({"a": 0.5, "b": 0.5}, by="tokens", buffer_size=8),
        batch(2),
    ]
    return zephon.Pipeline(source, ops, lanes=2, epoch_chunks=4)


def packing_pipeline() -> zephon.Pipeline:
    """Tokenized text packed into rows of 32 tokens."""
    ops = [fetch(), tokenize(max_len=16, split_long_samples=True), pack_sequences(32, open_bins=4)]
    return zephon.Pipeline(_texts(90), ops, lanes=2, epoch_chunks=2)


def _conversation(i: int) -> dict[str, Any]:
    turns = 1 + i % 3
    return {
        "messages": [
            message
            for t in range(turns)
            for message in (
                {"role": "user", "content": f"question {i}.{t}"},
                {"role": "assistant", "content": "answer " * (1 + (i + t) % 4)},
            )
        ]
    }


def _word_tokenizer() -> Tokenizer:
    """A word-level tokenizer with a fixed vocabulary (nothing trained, the same everywhere)."""
    words = ["[UNK]", "question", "answer", ".", *map(str, range(10)), "<u>", "<a>", "<e>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<u>", "<a>", "<e>"])
    return tok


def sft_pipeline() -> zephon.Pipeline:
    """Conversations tokenized through a chat template, packed with their loss masks."""
    source = ListSource([_conversation(i) for i in range(50)], chunk_size=6)
    ops = [
        fetch(),
        tokenize_chat(_word_tokenizer(), template=TEMPLATE, max_len=48),
        pack_sequences(64, open_bins=2, pad_id=0, extra_fields={"loss_mask": 0}),
    ]
    return zephon.Pipeline(source, ops, lanes=2, epoch_chunks=3)


PIPELINES: dict[str, Callable[[], zephon.Pipeline]] = {
    "text": text_pipeline,
    "mixture": mixture_pipeline,
    "packing": packing_pipeline,
    "sft": sft_pipeline,
}


def stream_digest(items: list[Any]) -> str:
    """A digest of what the training loop saw: every item's cursors and payload bytes."""
    h = hashlib.sha256()
    for item in items:
        records = list(item) if isinstance(item, SampleBatch) else [item]
        h.update(pickle.dumps([tuple(r.meta.cursor.sample_id) for r in records]))
        h.update(repr([r.meta.cursor for r in records]).encode())
        payload = item.payload
        for key in sorted(payload):
            value = payload[key]
            h.update(key.encode())
            h.update(value.tobytes() if hasattr(value, "tobytes") else repr(value).encode())
    return h.hexdigest()


def _taken(pipeline: zephon.Pipeline, step: int, retire: Any = None) -> dict[str, Any]:
    loader = iter(pipeline)
    if retire is not None:
        loader.retire(retire)
    for _ in range(step):
        next(loader)
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    return state


def write_states(name: str) -> dict[str, Any]:
    """States of pipeline ``name``: taken at ``STEPS``, merged into a job state, with steps to
    skip, with retired samples; each with the digest of what resuming from it delivered."""
    pipeline = PIPELINES[name]()
    states = {f"at {step}": _taken(pipeline, step) for step in STEPS}
    states["job"] = zephon.merge_states([states[f"at {STEPS[1]}"]])
    states["skip"] = zephon.skip_steps(states[f"at {STEPS[1]}"], 2)
    states["retired"] = _taken(pipeline, STEPS[1], retire=lambda sample_id: sample_id[2] % 5 == 0)
    full = list(iter(pipeline))
    taken = {}
    for key, state in states.items():
        with pipeline.iter(state=state) as loader:
            taken[key] = {"state": state, "rest": stream_digest(list(loader))}
    return {"pipeline": name, "items": len(full), "full": stream_digest(full), "states": taken}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for pipeline_name in PIPELINES:
        data = write_states(pipeline_name)
        (out / f"{pipeline_name}.json").write_text(json.dumps(data, sort_keys=True) + "\n")
        print(pipeline_name, data["items"], "items")
