"""A token-aware source and ensure_mixture together: the mixture is right without throwing the
work away, ensure_mixture says when it has to, and a by-tokens source resumes exactly (also on
other worker kinds and world sizes)."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pipeline_kit import assert_resumes_at, fingerprint_item, run

import zephon
from zephon.ops import ByteTokenizer, batch, ensure_mixture, fetch, pack_sequences, tokenize
from zephon.sources import ArrowSource, ListSource, MixtureSource

WEIGHTS = {"code": 0.7, "docstrings": 0.3}
CODE = ["def", "return", "self", "import", "for", "in", "if", "else", "x", "y", "=", "()"]
DOCS = ["the", "value", "of", "returns", "a", "list", "given", "when", "is", "none"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """Parquet code (200-1,000 words) and docstrings (5-40 words): ~25x longer on average;
    ``n_tokens`` holds each text's BPE token count. And the BPE, trained here."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    where = tmp_path_factory.mktemp("mixture")
    rng = random.Random(0)
    texts = {
        "code": [" ".join(rng.choices(CODE, k=rng.randint(200, 1000))) for _ in range(1000)],
        "docstrings": [" ".join(rng.choices(DOCS, k=rng.randint(5, 40))) for _ in range(8000)],
    }
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<|endoftext|>", "<pad>"]
    )
    bpe.train_from_iterator([" ".join(CODE), " ".join(DOCS)] * 50, trainer)
    for name, docs in texts.items():
        lengths = [len(e.ids) for e in bpe.encode_batch(docs)]
        pq.write_table(
            pa.table({"text": docs, "n_tokens": lengths}),
            where / f"{name}.parquet",
            row_group_size=500,
        )
    return where, bpe


def parquet_pipeline(where: Path, bpe: Any, **source_kw: Any) -> zephon.Pipeline:
    parts = {
        name: ArrowSource([where / f"{name}.parquet"], dataset_id=i)
        for i, name in enumerate(sorted(WEIGHTS))
    }
    source = MixtureSource(parts, WEIGHTS, chunk_size=256, **source_kw)
    ops = [
        fetch(),
        tokenize(bpe, max_len=512, split_long_samples=True),
        ensure_mixture(WEIGHTS, by="tokens"),
        pack_sequences(512),
        batch(8),
    ]
    return zephon.Pipeline(source, ops)


def outcome(pipeline: zephon.Pipeline) -> tuple[dict[str, float], float, int]:
    """Delivered token shares, the fraction of tokenized tokens dropped, batches delivered."""
    with iter(pipeline) as loader:
        batches = sum(1 for _ in loader)
        comps = loader.stats()["mixture_components"]
    delivered = sum(c["tokens"] for c in comps.values())
    dropped = sum(c["dropped_tokens"] for c in comps.values())
    assert {c["target"] for c in comps.values()} == set(WEIGHTS.values())
    return {n: c["share"] for n, c in comps.items()}, dropped / (delivered + dropped), batches


def test_a_sample_weighted_source_makes_ensure_mixture_drop_most_tokens_and_warn(corpus) -> None:
    where, bpe = corpus
    with pytest.warns(zephon.MixtureDropWarning, match=r"dropped 9\d% of the tokens .*'code'"):
        shares, dropped, batches = outcome(parquet_pipeline(where, bpe))
    assert shares["code"] == pytest.approx(0.7, abs=0.015)
    assert dropped > 0.9  # the mixture is right, and most of the work was thrown away
    assert batches < 20


@pytest.mark.parametrize(
    "how",
    [
        {"tokenizer": "bpe"},
        {"tokens_per_byte": {"code": 0.25, "docstrings": 0.21}},
        {"length_column": "n_tokens"},
    ],
    ids=["calibrated", "pinned", "length_column"],
)
def test_a_token_aware_source_gets_the_token_shares_with_almost_nothing_dropped(
    corpus, how: dict[str, Any]
) -> None:
    where, bpe = corpus
    kw = {k: (bpe if v == "bpe" else v) for k, v in how.items()}
    shares, dropped, batches = outcome(parquet_pipeline(where, bpe, by="tokens", **kw))
    assert shares["code"] == pytest.approx(0.7, abs=0.01)
    assert shares["docstrings"] == pytest.approx(0.3, abs=0.01)
    assert dropped <= 0.05
    assert batches > 120  # ~8x the sample-weighted run on the same data


# ------------------------------------------------------------------ resume, workers, world sizes
def _texts(dataset: int, n: int, base: int) -> ListSource:
    items = [
        {"text": f"{'ab' * (base + (i * 7 + dataset) % (3 * base))} {dataset}-{i}"}
        for i in range(n)
    ]
    return ListSource(items, dataset_id=dataset, chunk_size=16)


def by_tokens(**kw: Any) -> zephon.Pipeline:
    source = MixtureSource(
        {"a": _texts(0, 400, 20), "b": _texts(1, 900, 2)},
        {"a": 0.6, "b": 0.4},
        chunk_size=16,
        by="tokens",
        tokenizer=ByteTokenizer(),
    )
    ops = [
        fetch(),
        tokenize(max_len=24, split_long_samples=True),
        ensure_mixture({"a": 0.6, "b": 0.4}, buffer_size=8),
        pack_sequences(32, open_bins=4),
        batch(2),
    ]
    return zephon.Pipeline(source, ops, epoch_chunks=3, **kw)


def test_a_by_tokens_pipeline_resumes_exactly_and_so_do_its_per_component_stats() -> None:
    whole = iter(by_tokens(lanes=2))
    full = run(whole)
    assert len(full) > 60
    assert_resumes_at(by_tokens(lanes=2), [0, 7, 31, len(full) - 1], full)
    head = iter(by_tokens(lanes=2))
    run(head, 31)
    state = json.loads(json.dumps(head.state_dict()))
    tail = by_tokens(lanes=2).iter(state=state)
    run(tail)
    expected = whole.stats()["mixture_components"]
    assert sum(c["dropped_tokens"] for c in expected.values()) > 0
    assert tail.stats()["mixture_components"] == expected


def test_the_stream_does_not_depend_on_the_worker_kind() -> None:
    reference = run(iter(by_tokens(lanes=2)))
    for workers in ("thread", "process"):
        assert run(iter(by_tokens(lanes=2, workers=workers))) == reference, workers


LANES = 4


def _global_steps(world: int, state: dict | None = None, done: int = 0) -> list[Counter]:
    """The global steps (after ``done`` of them, from ``state``) until the first lane ends."""
    streams = [
        [fingerprint_item(x) for x in by_tokens(lanes=LANES, rank=r, world_size=world).iter(state)]
        for r in range(world)
    ]
    per = LANES // world
    # the guarantee holds until the first lane ends (one rank per lane shows each lane's length)
    shortest = min(
        len(list(by_tokens(lanes=LANES, rank=r, world_size=LANES))) for r in range(LANES)
    )
    steps = min(min(len(s) for s in streams) // per, shortest - done)
    return [Counter(x for s in streams for x in s[k * per : (k + 1) * per]) for k in range(steps)]


def test_elastic_resume_keeps_the_global_steps_with_a_by_tokens_source() -> None:
    reference = _global_steps(1)
    assert len(reference) > 10
    for world in (2, 4):  # the same global steps until the first lane ends
        steps = _global_steps(world)
        assert len(steps) > 10
        assert steps == reference[: len(steps)], f"world_size={world}"
    # checkpoint on 2 ranks after 5 global steps, resume on 1 and on 4
    states = []
    for r in range(2):
        loader = iter(by_tokens(lanes=LANES, rank=r, world_size=2))
        for _ in range(5 * (LANES // 2)):
            next(loader)
        states.append(json.loads(json.dumps(loader.state_dict())))
    job = zephon.merge_states(states)
    for world in (1, 4):
        resumed = _global_steps(world, job, done=5)
        assert len(resumed) > 5
        assert resumed == reference[5 : 5 + len(resumed)], f"world_size={world}"


def test_the_warning_names_components_and_fraction_once_per_lane() -> None:
    parts = {"a": _texts(0, 400, 20), "b": _texts(1, 900, 2)}
    source = MixtureSource(parts, {"a": 0.5, "b": 0.5}, chunk_size=16)
    ops = [fetch(), tokenize(), ensure_mixture({"a": 0.5, "b": 0.5}, buffer_size=8)]
    with pytest.warns(zephon.MixtureDropWarning) as caught:
        list(zephon.Pipeline(source, ops, lanes=2))
    texts = [str(w.message) for w in caught if issubclass(w.category, zephon.MixtureDropWarning)]
    assert len(texts) == 2
    assert {t.split(" on lane ")[1].split(" ")[0] for t in texts} == {"0", "1"}
    for text in texts:
        assert "'a' " in text and "'b' " in text and "by='tokens'" in text


def test_a_token_weighted_source_is_not_told_to_weigh_by_tokens(corpus) -> None:
    where, bpe = corpus
    wrong = {"tokens_per_byte": {"code": 0.01, "docstrings": 0.9}}  # far from the BPE's counts
    with pytest.warns(zephon.MixtureDropWarning) as caught:
        outcome(parquet_pipeline(where, bpe, by="tokens", **wrong))
    (text,) = {str(w.message) for w in caught}
    assert "by='tokens')" not in text and "Weigh the source by tokens" not in text
    assert "already weighs by tokens" in text
    assert "tokenizer=" in text and "length_column=" in text


def test_other_weights_in_the_source_and_ensure_mixture_are_named(corpus) -> None:
    where, bpe = corpus
    parts = {
        name: ArrowSource([where / f"{name}.parquet"], dataset_id=i)
        for i, name in enumerate(sorted(WEIGHTS))
    }
    source = MixtureSource(parts, WEIGHTS, chunk_size=256, by="tokens", length_column="n_tokens")
    other = {"code": 0.2, "docstrings": 0.8}
    ops = [fetch(), tokenize(bpe, max_len=512, split_long_samples=True), ensure_mixture(other)]
    with pytest.warns(zephon.MixtureDropWarning) as caught:
        list(zephon.Pipeline(source, [*ops, batch(8)]))
    (text,) = {str(w.message) for w in caught}
    assert "same weights" in text and "by='tokens')" not in text
