"""Pipeline(on_error="skip"): a record that fetch or a stateless operator fails on is dropped with
its tombstones, reported with its cursor, and the same records are skipped on every run (after a
SIGKILL of the training process and a resume too); past max_skipped the run fails."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from worker_kit import script_env

import zephon
from zephon.errors import FetchError, OperatorError, PlanError
from zephon.ops import Operator, OpTraits, batch, fetch, map_transform, pack_sequences, tokenize
from zephon.sources import ArrowSource, JsonlSource
from zephon.testing import check_resume

pytestmark = pytest.mark.usefixtures("no_leftover_workers")

ROWS = 100
BAD = (5, 40, 77)  # rows whose text is null: chunk 0 (lane 0), chunk 1 (lane 1), chunk 2 (lane 0)
GOOD = sorted(set(range(ROWS)) - set(BAD))


def write_parquet(path: Path) -> Path:
    rows = [{"row": i, "text": None if i in BAD else f"document {i}"} for i in range(ROWS)]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=16)
    return path


def shout(payload: dict) -> dict:
    """A map that raises on the rows without text (defined here: process lanes pickle it)."""
    return {**payload, "text": payload["text"].upper()}


def pipeline(path: Path, **kwargs: Any) -> zephon.Pipeline:
    ops = kwargs.pop("ops", None) or [fetch(), tokenize(), batch(4)]
    kwargs = {"lanes": 2, "micro_batch": 8, "on_error": "skip", **kwargs}
    return zephon.Pipeline(ArrowSource(str(path), chunk_size=32), ops, **kwargs)


def rows_of(items: Any) -> list[int]:
    return [rec.payload["row"] for item in items for rec in item.records]


@pytest.fixture
def parquet(tmp_path: Path) -> Path:
    return write_parquet(tmp_path / "docs.parquet")


@pytest.mark.parametrize("workers", ["inline", "thread", "process"])
@pytest.mark.parametrize("failing", ["tokenize", "map_transform"])
def test_skip_delivers_every_other_record_once_and_reports_the_skips(
    parquet: Path, workers: str, failing: str, caplog: pytest.LogCaptureFixture
) -> None:
    ops = (
        [fetch(), map_transform(shout), tokenize(), batch(4)]
        if failing == "map_transform"
        else None
    )
    skipping = pipeline(parquet, workers=workers, ops=ops, on_error={failing: "skip"})
    with caplog.at_level(logging.WARNING, logger="zephon"), skipping.iter() as loader:
        delivered = rows_of(loader)
        skipped = loader.skipped()
        stats = loader.stats()
    assert sorted(delivered) == GOOD and len(delivered) == len(GOOD)
    assert stats["skipped"] == 3
    assert [s["sample_id"][2] for s in sorted(skipped, key=lambda s: s["sample_id"])] == list(BAD)
    for report in skipped:
        assert report["cursor"].sample_id == report["sample_id"]
        assert report["operator"].startswith(failing)
        assert report["error"].startswith(("TypeError", "AttributeError"))
        assert "NoneType" in report["error"]
    logged = [r.getMessage() for r in caplog.records if "skipped record" in r.getMessage()]
    assert len(logged) == 3
    for report in skipped:
        assert sum(f"record {report['cursor']!r}" in line for line in logged) == 1


def test_without_skipping_the_first_bad_record_ends_the_run(parquet: Path) -> None:
    with pytest.raises(OperatorError, match=r"failed on record SampleCursor\(0, 5,"):
        list(pipeline(parquet, on_error="raise"))


def test_past_max_skipped_the_run_fails_saying_the_limit_was_reached(parquet: Path) -> None:
    loader = pipeline(parquet, max_skipped=2).iter()
    delivered: list[int] = []
    with pytest.raises(OperatorError, match=r"max_skipped=2") as info:
        for item in loader:
            delivered += rows_of([item])
    assert "SampleCursor(2, 13," in str(info.value)  # the third bad row, 77
    assert loader.stats()["skipped"] == 2
    # The state still resumes right after the last batch handed over, here with a higher limit.
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    rest = rows_of(pipeline(parquet, max_skipped=3).iter(state=state))
    assert sorted(delivered + rest) == GOOD


def test_a_checkpoint_taken_without_skipping_resumes_with_it(parquet: Path) -> None:
    loader = pipeline(parquet, on_error="raise", micro_batch=4).iter()
    head = rows_of([next(loader)])  # rows 0..3: before the first bad row
    state = json.loads(json.dumps(loader.state_dict()))
    with pytest.raises(OperatorError):
        list(loader)
    resumed = pipeline(parquet, on_error="skip", max_skipped=3, micro_batch=4).iter(state=state)
    rest = rows_of(resumed)
    assert sorted(head + rest) == GOOD and len(head + rest) == len(GOOD)
    assert resumed.stats()["skipped"] == 3
    assert pipeline(parquet, on_error="raise").fingerprint == pipeline(parquet).fingerprint


def test_a_skip_before_a_checkpoint_is_counted_once_and_not_reported_again(
    parquet: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loader = pipeline(parquet).iter()
    head = rows_of([next(loader) for _ in range(6)])  # past rows 5 and 40, before 77
    assert loader.stats()["skipped"] == 2
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zephon"):
        resumed = pipeline(parquet).iter(state=state)
        rest = rows_of(resumed)
    assert sorted(head + rest) == GOOD
    assert resumed.stats()["skipped"] == 3
    assert [s["sample_id"][2] for s in resumed.skipped()] == [77]
    logged = [r.getMessage() for r in caplog.records if "skipped record" in r.getMessage()]
    assert len(logged) == 1 and "(0, 0, 77)" in logged[0]


class UpperAll(Operator):
    """A batched operator: one bad record makes the whole micro-batch's call raise."""

    traits = OpTraits(preserves_cursor_order=True, preserves_indexability=True)

    def process_many(self, records: list) -> list:
        return [r.with_payload({**r.payload, "text": r.payload["text"].upper()}) for r in records]


@pytest.mark.parametrize("workers", [None, 2])
def test_a_batched_operator_still_processes_the_rest_of_the_micro_batch(
    parquet: Path, workers: int | None
) -> None:
    op = UpperAll()
    if workers:  # the micro-batch is cut over a thread pool
        op.traits = OpTraits(preserves_cursor_order=True, workers=workers)
    with pipeline(parquet, ops=[fetch(), op, batch(4)]).iter() as loader:
        items = list(loader)
        skipped = loader.skipped()
    texts = {rec.payload["row"]: rec.payload["text"] for item in items for rec in item.records}
    assert sorted(texts) == GOOD
    assert all(texts[i] == f"DOCUMENT {i}" for i in GOOD)
    assert sorted(s["sample_id"][2] for s in skipped) == list(BAD)
    assert all(s["operator"] == "UpperAll" for s in skipped)


def test_skipping_on_the_epoch_path_resumes_exactly(parquet: Path) -> None:
    ops = [fetch(), tokenize(), pack_sequences(16), batch(2)]
    check_resume(pipeline(parquet, ops=ops, epoch_chunks=2, max_skipped=3))


def write_jsonl(path: Path) -> Path:
    lines = [
        "{not json\n" if i in BAD else json.dumps({"row": i, "text": f"document {i}"}) + "\n"
        for i in range(ROWS)
    ]
    path.write_text("".join(lines))
    return path


def test_a_line_that_is_not_json_is_skipped_at_fetch(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl")

    def jsonl(**kwargs: Any) -> zephon.Pipeline:
        source = JsonlSource(str(path), chunk_size=32)
        return zephon.Pipeline(source, [fetch(), batch(4)], lanes=2, micro_batch=8, **kwargs)

    with pytest.raises(FetchError, match="not valid JSON"):
        list(jsonl())
    with jsonl(on_error={"fetch": "skip"}).iter() as loader:
        delivered = rows_of(loader)
        skipped = loader.skipped()
    assert sorted(delivered) == GOOD
    assert sorted(s["sample_id"][2] for s in skipped) == list(BAD)
    assert all(s["operator"] == "fetch" and "not valid JSON" in s["error"] for s in skipped)


def test_a_storage_error_is_never_skipped(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl")
    source = JsonlSource(str(path), chunk_size=32)
    source.total_chunks()  # the line index is built: the file goes missing after
    path.unlink()
    with pytest.raises(FetchError, match=r"FileNotFoundError|No such file"):
        list(zephon.Pipeline(source, [fetch(), batch(4)], on_error="skip", lanes=2))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"on_error": "ignore"}, r"on_error must be one of \('raise', 'skip'\)"),
        ({"on_error": ["skip"]}, "on_error must be 'raise', 'skip' or a mapping"),
        ({"on_error": {"tokenize": "skip", "nope": "skip"}}, "names operator 'nope'"),
        ({"on_error": {"tokenize": True}}, r"on_error\['tokenize'\] must be one of"),
        ({"on_error": {"pack_sequences": "skip"}}, "keeps state"),
        ({"max_skipped": -1}, "max_skipped must be an int >= 0"),
        ({"max_skipped": True}, "max_skipped must be an int >= 0"),
    ],
)
def test_bad_on_error_values_are_refused(parquet: Path, kwargs: dict, message: str) -> None:
    ops = [fetch(), tokenize(), pack_sequences(16), batch(2)]
    with pytest.raises(PlanError, match=message):
        pipeline(parquet, ops=ops, **kwargs).compile()


def test_skip_for_the_whole_pipeline_leaves_stateful_operators_raising(parquet: Path) -> None:
    plan = pipeline(parquet, ops=[fetch(), tokenize(), pack_sequences(16), batch(2)]).compile()
    assert plan.skip_fetch_errors and plan.skip_errors == (True, False)
    assert "skips records that fail in: fetch, tokenize" in plan.describe()


# ----------------------------------------------------------------------------- a killed run
TRAIN = """
import json, logging, os, sys
import zephon
from zephon.ops import batch, fetch, tokenize
from zephon.sources import ArrowSource

def main():
    path, ckpt, workers = sys.argv[1:4]
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    pipeline = zephon.Pipeline(
        ArrowSource(path, chunk_size=32), [fetch(), tokenize(), batch(4)], lanes=2,
        micro_batch=8, workers=workers, on_error="skip",
    )
    state, rows = None, []
    if os.path.exists(ckpt):
        with open(ckpt) as f:
            saved = json.load(f)
        state, rows = saved["state"], saved["rows"]
    loader = pipeline.iter(state=state)
    for step, item in enumerate(loader):
        rows += [rec.payload["row"] for rec in item.records]
        with open(ckpt + ".tmp", "w") as f:  # the state and what was consumed, together
            json.dump({"state": loader.state_dict(), "rows": rows}, f)
        os.replace(ckpt + ".tmp", ckpt)
        print(step, flush=True)
        sys.stdin.readline()  # the test says when to go on (or kills us here)
    print("done", loader.stats()["skipped"], json.dumps(rows), flush=True)

if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("workers", ["inline", "process"])
def test_skips_survive_a_sigkill_of_the_training_process(
    parquet: Path, tmp_path: Path, workers: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN))
    ckpt = tmp_path / "ckpt.json"
    args = [sys.executable, str(script), str(parquet), str(ckpt), workers]

    def start() -> subprocess.Popen:
        return subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=script_env(),
        )

    first = start()
    assert first.stdin is not None and first.stdout is not None
    for step in range(6):  # past rows 5 and 40, before 77
        assert first.stdout.readline().strip() == str(step)
        if step < 5:
            first.stdin.write("\n")
            first.stdin.flush()
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert first.stderr is not None
    before = first.stderr.read()
    first.stdout.close()
    first.stdin.close()
    first.stderr.close()
    assert json.loads(ckpt.read_text())["state"]["tag_counts"] == [["skipped", 2]]

    second = subprocess.run(
        args, input="\n" * ROWS, capture_output=True, text=True, env=script_env(), timeout=120
    )
    assert second.returncode == 0, second.stderr
    done = second.stdout.strip().splitlines()[-1].split(" ", 2)
    assert done[:2] == ["done", "3"]
    rows = json.loads(done[2])
    assert sorted(rows) == GOOD and len(rows) == len(GOOD)
    logged = [line for line in (before + second.stderr).splitlines() if "skipped record" in line]
    assert len(logged) == 3
    for row in BAD:
        assert sum(f"(sample_id=(0, 0, {row}), file " in line for line in logged) == 1


@pytest.mark.parametrize("lanes", [1, 3])  # 1: lane 0 also finishes lane 1's run after its own
def test_a_relaned_run_does_not_report_a_skip_again(parquet: Path, lanes: int) -> None:
    loader = pipeline(parquet).iter()
    head = rows_of([next(loader) for _ in range(6)])  # past rows 5 and 40, before 77
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    with pytest.warns(zephon.RelaneWarning):
        relaned = pipeline(parquet, lanes=lanes).iter(state=state)
    rest = rows_of(relaned)
    assert sorted(head + rest) == GOOD and len(head + rest) == len(GOOD)
    assert [s["sample_id"][2] for s in relaned.skipped()] == [77]
