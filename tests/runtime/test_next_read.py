"""A first operator that releases the GIL (a Hugging Face tokenizer) works on a lane's next read
on a thread of its own while the current read is packed and delivered: the stream, the errors,
the skips and every resume stay what they are when it works in the lane's thread."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import zephon
from zephon.errors import FetchError, OperatorError
from zephon.ops import Operator, OpTraits, batch, fetch, pack_sequences, tokenize
from zephon.sources import ArrowSource, JsonlSource
from zephon.testing import check_resume
from zephon.types import SampleRecord

pytestmark = pytest.mark.usefixtures("no_leftover_workers")

ROWS = 1000
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


def document(i: int) -> str:
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(5 + i % 23))


@pytest.fixture(scope="module")
def parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("next_read") / "docs.parquet"
    rows = [{"row": i, "text": document(i)} for i in range(ROWS)]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=100)
    return path


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=80, special_tokens=["[UNK]", "[EOS]"])
    tok.train_from_iterator([document(i) for i in range(ROWS)], trainer)
    return tok


class OneByOne:
    """The same tokenizer called one text at a time from Python: it never runs ahead."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.eos_token_id = tok.token_to_id("[EOS]")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids


def text_pipeline(parquet: Path, tokenizer: Any, **kwargs: Any) -> zephon.Pipeline:
    kwargs = {"micro_batch": 100, **kwargs}
    return zephon.Pipeline(
        ArrowSource(str(parquet), columns=["row", "text"], chunk_size=200),
        [fetch(), tokenize(tokenizer, eos_id=1), pack_sequences(48, pad_id=1), batch(4)],
        **kwargs,
    )


def batches(pipeline: zephon.Pipeline) -> list[np.ndarray]:
    return [b.payload["tokens"].copy() for b in pipeline]


def ahead_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("zephon-ahead")]


def test_only_a_hugging_face_batch_encoder_says_it_releases_the_gil(bpe: Tokenizer) -> None:
    assert tokenize(bpe).releases_gil()
    assert not tokenize(OneByOne(bpe), eos_id=1).releases_gil()
    assert not tokenize().releases_gil()  # the byte tokenizer encodes in numpy


@pytest.mark.parametrize("lanes", [1, 3])
def test_the_stream_is_the_one_the_lane_makes_alone(parquet: Path, bpe: Tokenizer, lanes):
    ahead = batches(text_pipeline(parquet, bpe, lanes=lanes))
    alone = batches(text_pipeline(parquet, OneByOne(bpe), lanes=lanes))
    assert len(ahead) == len(alone) > 10
    for a, b in zip(ahead, alone, strict=True):
        np.testing.assert_array_equal(a, b)
    assert ahead_threads() == []


def test_a_loader_closed_early_leaves_no_thread_behind(parquet: Path, bpe: Tokenizer) -> None:
    loader = text_pipeline(parquet, bpe).iter()
    next(loader)
    next(loader)
    assert ahead_threads() != []  # the tokenizer runs ahead of the lane
    # As the lane's own thread: a call that never returns does not keep the process alive.
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("zephon-ahead"))
    loader.close()
    assert ahead_threads() == []


@pytest.mark.parametrize("workers", ["inline", "thread"])
def test_every_resume_is_exact(parquet: Path, bpe: Tokenizer, workers: str) -> None:
    check_resume(text_pipeline(parquet, bpe, lanes=2, workers=workers))


def test_a_shuffled_source_on_process_lanes_resumes_exactly(parquet: Path, bpe: Tokenizer):
    source = ArrowSource(str(parquet), columns=["row", "text"], chunk_size=200, shuffle=True)
    ops = [fetch(), tokenize(bpe, eos_id=1), pack_sequences(48, pad_id=1), batch(4)]
    pipeline = zephon.Pipeline(source, ops, lanes=2, workers="process", micro_batch=100)
    check_resume(pipeline, steps=[0, 3, 11])


THREADS: set[str] = set()


class Marked(Operator):
    """A pass-through first operator that says it releases the GIL, noting the threads it runs
    on (in ``THREADS``) and failing on the rows in ``bad``."""

    name = "marked"

    def __init__(self, bad: tuple[int, ...] = (), ahead: bool = True) -> None:
        self.bad = bad
        self.ahead = ahead
        self.traits = OpTraits(preserves_cursor_order=True)

    def releases_gil(self) -> bool:
        return self.ahead

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        THREADS.add(threading.current_thread().name)
        for rec in records:
            if rec.payload["row"] in self.bad:
                raise ValueError(f"row {rec.payload['row']} is bad")
        return [SampleRecord(r.meta, {**r.payload, "seen": 1}) for r in records]


def marked_pipeline(parquet: Path, op: Marked, **kwargs: Any) -> zephon.Pipeline:
    return zephon.Pipeline(
        ArrowSource(str(parquet), columns=["row", "text"], chunk_size=200),
        [fetch(), op, tokenize(), pack_sequences(48, pad_id=1), batch(4)],
        micro_batch=100,
        **kwargs,
    )


def rows_of(pipeline: zephon.Pipeline) -> list[list[int]]:
    return [b.payload["tokens"].tolist() for b in pipeline]


def test_the_calls_run_on_the_thread_ahead_but_the_first(parquet: Path) -> None:
    THREADS.clear()
    assert len(rows_of(marked_pipeline(parquet, Marked()))) > 10
    assert threading.current_thread().name in THREADS  # the lane's first read
    assert any(name.startswith("zephon-ahead-marked") for name in THREADS)
    THREADS.clear()
    rows_of(marked_pipeline(parquet, Marked(ahead=False)))
    assert {threading.current_thread().name} == THREADS


def test_an_error_ahead_is_raised_where_the_lane_reaches_it(parquet: Path) -> None:
    def run(ahead: bool) -> tuple[int, str]:
        delivered = 0
        with pytest.raises(OperatorError) as failed:
            for _ in marked_pipeline(parquet, Marked(bad=(430,), ahead=ahead)):
                delivered += 1
        return delivered, str(failed.value)

    assert run(True) == run(False)
    delivered, message = run(True)
    assert delivered > 0 and "row 430 is bad" in message and "marked" in message


def test_skipped_records_are_the_same(parquet: Path) -> None:
    def run(ahead: bool) -> tuple[list, int]:
        pipeline = marked_pipeline(parquet, Marked(bad=(3, 430, 431), ahead=ahead), on_error="skip")
        with pipeline.iter() as loader:
            tokens = [b.payload["tokens"].tolist() for b in loader]
            return tokens, loader.stats()["skipped"]

    assert run(True) == run(False)
    assert run(True)[1] == 3


def test_a_read_that_fails_ahead_fails_where_the_lane_reaches_it(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"row": i, "text": document(i)}) for i in range(ROWS)]
    lines[450] = "{not json"
    path.write_text("\n".join(lines) + "\n")

    def run(ahead: bool, **kwargs: Any) -> tuple[int, str]:
        ops = [fetch(), Marked(ahead=ahead), tokenize(), pack_sequences(48), batch(4)]
        pipeline = zephon.Pipeline(
            JsonlSource(str(path), chunk_size=200), ops, micro_batch=100, **kwargs
        )
        delivered, failed = 0, ""
        try:
            for _ in pipeline:
                delivered += 1
        except FetchError as exc:
            failed = str(exc)
        return delivered, failed

    assert run(True) == run(False)
    assert "not valid JSON" in run(True)[1]
    skipping = {"on_error": {"fetch": "skip"}}
    assert run(True, **skipping) == run(False, **skipping)
    assert run(True, **skipping)[1] == ""


class Meeting(Marked):
    """``Marked``, whose first two calls on a thread ahead each wait for the other to begin."""

    name = "meeting"

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        if threading.current_thread().name.startswith("zephon-ahead"):
            with MEETING["lock"]:
                MEETING["calls"] += 1
                first_two = MEETING["calls"] <= 2
            if first_two:
                MEETING["barrier"].wait()  # raises BrokenBarrierError if the other never comes
        return super().process_many(records)


MEETING: dict[str, Any] = {}


def test_the_next_reads_call_runs_beside_the_current_one(parquet: Path) -> None:
    MEETING.update(lock=threading.Lock(), calls=0, barrier=threading.Barrier(2, timeout=30))
    assert len(rows_of(marked_pipeline(parquet, Meeting()))) > 10
    assert MEETING["calls"] > 2
    assert not MEETING["barrier"].broken  # (a call that failed ahead is made again, alone)


def test_with_tokenizer_threads_off_the_calls_come_one_at_a_time(
    parquet: Path, bpe: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # as in a worker sized to one CPU
    loader = text_pipeline(parquet, bpe).iter()
    next(loader)
    next(loader)
    assert len(ahead_threads()) == 1
    loader.close()
    monkeypatch.delenv("TOKENIZERS_PARALLELISM")
    with text_pipeline(parquet, bpe).iter() as loader:
        next(loader)
        next(loader)
        assert len(ahead_threads()) == 2


def test_a_tokenizer_given_more_threads_midway_gets_a_second_call_ahead(
    parquet: Path, bpe: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As in a worker whose pool is widened once the other workers have finished
    # (``ProcessGroup.lane_ended``): from then on, calls overlap again; the stream stays the same.
    alone = rows_of(text_pipeline(parquet, OneByOne(bpe)))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    with text_pipeline(parquet, bpe).iter() as loader:
        got = [next(loader).payload["tokens"].tolist() for _ in range(2)]
        assert len(ahead_threads()) == 1
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
        got += [next(loader).payload["tokens"].tolist() for _ in range(6)]
        assert len(ahead_threads()) == 2
        got += [b.payload["tokens"].tolist() for b in loader]
    assert got == alone and ahead_threads() == []
