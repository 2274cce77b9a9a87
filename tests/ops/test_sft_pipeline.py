"""A fine-tuning pipeline end to end: a mixture of two JSONL chat datasets -> tokenize_chat ->
pack_sequences with the loss mask -> batch(collate=training_collate()). Exact resume, the same
stream on inline, thread and process lanes, masks exact after packing, bounded memory."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from chat_kit import OURS, bpe, fast_tokenizer, reference
from pipeline_kit import assert_resumes_at, assert_resumes_twice, run

import zephon
from zephon.ops import batch, fetch, pack_flat, pack_sequences, tokenize_chat, training_collate
from zephon.sources import JsonlSource, MixtureSource

WORDS = [
    "hello",
    "world",
    "how",
    "are",
    "you",
    "today",
    "fine",
    "thanks",
    "quick",
    "brown",
    "fox",
    "lazy",
    "dog",
    "packing",
    "rows",
]


def conversation(rng: random.Random, turns: int) -> list[dict[str, str]]:
    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 12)))

    out = [{"role": "system", "content": text()}] if rng.random() < 0.3 else []
    for _ in range(turns):
        out += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
    return out


def write_dataset(path: Path, n: int, seed: int, turns: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    convs = [conversation(rng, rng.randint(1, turns)) for _ in range(n)]
    path.write_text("".join(json.dumps({"messages": c, "source": path.stem}) + "\n" for c in convs))
    return convs


def sft_pipeline(
    tmp: Path, n: int = 60, *, kind: str = "ours", flat: bool = False, **kw: Any
) -> tuple[zephon.Pipeline, dict[str, list]]:
    convs = {
        "short": write_dataset(tmp / "short.jsonl", n, 1, 2),
        "long": write_dataset(tmp / "long.jsonl", n, 2, 5),
    }
    source = MixtureSource(
        {
            "short": JsonlSource(tmp / "short.jsonl", dataset_id=1, chunk_size=8, passes=None),
            "long": JsonlSource(
                tmp / "long.jsonl", dataset_id=2, chunk_size=8, shuffle=True, seed=4
            ),
        },
        {"short": 0.6, "long": 0.4},
        chunk_size=10,
        seed=3,
    )
    chat = (
        tokenize_chat(bpe(), template=OURS, max_len=40, split_long_samples=True)
        if kind == "ours"
        else tokenize_chat(fast_tokenizer(), max_len=48)
    )
    packer = (
        pack_flat(32, extra_fields={"loss_mask": 0})
        if flat
        else pack_sequences(32, open_bins=4, extra_fields={"loss_mask": 0})
    )
    ops = [fetch(), chat, packer, batch(3, collate=training_collate())]
    options = {"lanes": 2, "epoch_chunks": 2, "micro_batch": 4, **kw}
    return zephon.Pipeline(source, ops, **options), convs


@pytest.mark.parametrize(("kind", "flat"), [("ours", False), ("jinja", True)])
def test_resume_at_any_step_continues_the_uninterrupted_stream(tmp_path, kind, flat):
    pipeline, _ = sft_pipeline(tmp_path, kind=kind, flat=flat)
    full = run(iter(pipeline))
    assert len(full) > 10
    assert_resumes_at(pipeline, [0, 1, 7, len(full) // 2, len(full) - 1, len(full)], full)
    assert_resumes_twice(pipeline, 3, len(full) // 3, full)


def test_the_stream_is_the_same_on_inline_thread_and_process_lanes_and_resumes_across(tmp_path):
    pipeline, _ = sft_pipeline(tmp_path)
    full = run(iter(pipeline))
    for workers in ("thread", "process"):
        pipeline.workers = workers
        with iter(pipeline) as loader:
            assert run(loader) == full, workers
    pipeline.workers = "process"
    step = len(full) // 3
    with iter(pipeline) as loader:
        head = run(loader, step)
        state = loader.state_dict()
    pipeline.workers = "thread"
    with pipeline.iter(state=state) as resumed:
        assert head + run(resumed) == full


def test_every_trained_token_of_every_conversation_arrives_once_with_its_mask(tmp_path):
    pipeline, convs = sft_pipeline(tmp_path, n=40)
    by_dataset = {1: convs["short"], 2: convs["long"]}
    trained = labelled = 0
    read: dict[tuple[int, int], Any] = {}  # base offset -> the sample read there
    with iter(pipeline) as loader:
        for item in loader:
            payload = item.payload
            trained += sum(int(r.payload["loss_mask"].sum()) for r in item)
            labelled += int((payload["labels"] != -100).sum())
            assert payload["cu_seqlens"][-1] == payload["input_ids"].size
            for rec in item:
                for ref in rec.contribution_refs():
                    read[(ref.cursor.chunk_id, ref.cursor.chunk_offset)] = ref.cursor.sample_id
    datasets = {dataset for dataset, _, _ in read.values()}
    assert datasets == {1, 2}
    expected = sum(
        sum(reference("ours", by_dataset[d][idx], ("assistant",))[1]) for d, _, idx in read.values()
    )
    assert trained == expected > 0
    # A trained token is a label unless it is the first token of a packed fragment.
    assert 0 < labelled <= trained


def test_peak_inflight_chunks_does_not_grow_with_the_run(tmp_path):
    peaks = []
    for n in (60, 240):
        (tmp_path / str(n)).mkdir()
        pipeline, _ = sft_pipeline(tmp_path / str(n), n=n)
        with iter(pipeline) as loader:
            for _ in loader:
                pass
            stats = loader.stats()
        assert stats["inflight_chunks"] == 0
        peaks.append(stats["max_inflight_chunks"])
    assert peaks[1] == peaks[0]


def test_batches_become_tensors_through_the_torch_integration(tmp_path):
    torch = pytest.importorskip("torch")
    from zephon.integrations.torch import as_torch_dataset

    pipeline, _ = sft_pipeline(tmp_path, n=20)
    first = next(iter(as_torch_dataset(pipeline)))
    assert first["labels"].dtype == torch.int64 and first["input_ids"].dtype == torch.int64
    assert first["cu_seqlens"].dtype == torch.int32 and isinstance(first["max_seqlen"], int)
    loss = torch.nn.functional.cross_entropy(
        torch.zeros(*first["labels"].shape, bpe().get_vocab_size()).flatten(0, 1),
        first["labels"].flatten(),
        ignore_index=-100,
    )
    assert torch.isfinite(loss)
