"""Storage deadlines: a server that accepts connections and never answers is a ``FetchError``
naming the URI, the operation and the time waited, within the source's deadline, wherever the
read runs (inline, thread and process lanes), at start-up and mid-run; and neither the S3
client's retries nor the pipeline's timeout hide it."""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from worker_kit import assert_no_leftover_workers, lane_threads, script_env, wait_until

import zephon
from zephon.errors import FetchError
from zephon.ops import batch, fetch
from zephon.sources import ArrowSource, JsonlSource

no_leftovers = pytest.fixture(autouse=True)(assert_no_leftover_workers)

#: Small deadlines keep the suite fast: 1 s a request, 3 s for an operation's attempts in all.
DEADLINE: dict[str, Any] = {"timeout": 1, "total_timeout": 3}
#: How long a test lets a deadline take before calling it not honoured: ten times over.
BOUND = 10 * DEADLINE["total_timeout"]
WORKERS = ["inline", "thread", "process"]


def upload(tmp_path: Path, bucket, prefix: str, files: int = 2, rows: int = 8) -> str:
    """``files`` Parquet files of ``rows`` rows in groups of 4, in the bucket; their URI."""
    local = tmp_path / prefix
    local.mkdir()
    for k in range(files):
        idx = list(range(k * rows, (k + 1) * rows))
        table = pa.table({"idx": idx, "text": [f"row {i}" for i in idx]})
        pq.write_table(table, local / f"part-{k}.parquet", row_group_size=4)
    return bucket.upload(local, prefix)


def stream(source, workers: str, **pipeline) -> list[int]:
    got: list[int] = []
    with zephon.Pipeline(source, [fetch(), batch(4)], workers=workers, **pipeline).iter() as it:
        for b in it:
            got += [int(i) for i in b.payload["idx"]]
    return got


def attempts_of(error: pytest.ExceptionInfo) -> int:
    """How many attempts the message says were made."""
    found = re.search(r"gave up after (\d+) attempts? in (\d+\.\d) s", str(error.value))
    assert found, str(error.value)
    return int(found.group(1))


@pytest.fixture
def stalled(bucket, failing_proxy):
    """The bucket behind a proxy that sources built from now on go through."""
    bucket.point_at(failing_proxy.endpoint)
    return failing_proxy


# ------------------------------------------------------------------------- start-up


@pytest.mark.parametrize("workers", WORKERS)
def test_a_listing_that_never_answers_is_a_fetch_error_within_the_deadline(
    tmp_path, bucket, stalled, workers
):
    uri = upload(tmp_path, bucket, "list")
    stalled.stall()
    began = time.monotonic()
    with pytest.raises(FetchError, match=rf"listing \['{uri}'\]: gave up after") as error:
        stream(ArrowSource(uri, **DEADLINE), workers)
    assert time.monotonic() - began < BOUND
    assert "1 s a request, 3 s in all" in str(error.value)
    # Each attempt was one request: the S3 client made no retries of its own; and an attempt
    # that could not end within the 3 s was not started (each takes 1 s at least).
    assert stalled.stalled == attempts_of(error) <= 2


@pytest.mark.parametrize("workers", WORKERS)
def test_a_footer_that_never_comes_is_a_fetch_error_naming_the_file(
    tmp_path, bucket, stalled, workers
):
    uri = upload(tmp_path, bucket, "meta")
    source = ArrowSource(uri, **DEADLINE)
    assert len(source.files()) == 2  # listed: the footers are read next
    stalled.stall()
    began = time.monotonic()
    with pytest.raises(
        FetchError, match=rf"metadata of '{uri}/part-[01]\.parquet': gave up after"
    ) as error:
        stream(source, workers)
    assert time.monotonic() - began < BOUND
    assert stalled.stalled == 2 * attempts_of(error)  # the two footers, read at once


def test_a_stalled_start_up_stops_every_file_still_waiting_its_turn(tmp_path, bucket, stalled):
    # Two threads for eight footers: once one fails, those not started yet are not started.
    uri = upload(tmp_path, bucket, "many", files=8, rows=4)
    source = ArrowSource(uri, threads=2, **DEADLINE)
    source.files()
    stalled.requests.clear()
    stalled.stall()
    with pytest.raises(FetchError, match="gave up after"):
        source.num_samples()
    tried = {request.rsplit("/", 1)[-1] for request in stalled.requests}
    assert len(tried) == 2, tried


# ------------------------------------------------------------------------- mid-run


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("readahead", [0, 64 << 20])
def test_a_row_group_read_that_never_answers_is_a_fetch_error_within_the_deadline(
    tmp_path, bucket, stalled, workers, readahead
):
    uri = upload(tmp_path, bucket, "read")
    source = ArrowSource(uri, chunk_size=4, readahead=readahead, **DEADLINE)
    assert source.num_samples() == 16  # the metadata is read; then the server stalls
    stalled.stall()
    began = time.monotonic()
    with pytest.raises(
        FetchError, match=rf"from '{uri}/part-[01]\.parquet': row group \d: gave up after"
    ):
        stream(source, workers, lanes=2)
    assert time.monotonic() - began < BOUND


def test_a_stalled_read_ahead_gives_up_with_its_first_failures(tmp_path, bucket, stalled):
    # Sixteen column chunks fetched ahead on two threads from a server that still answers
    # HEAD requests: once a fetch fails, the others are not made (each would wait out a whole
    # request's deadline).
    uri = upload(tmp_path, bucket, "ahead", files=1, rows=32)
    source = ArrowSource(uri, chunk_size=4, threads=2, **DEADLINE)
    assert source.num_samples() == 32
    stalled.stall(method="GET")
    with pytest.raises(FetchError, match=r"row group 0: gave up after") as error:
        source.read(np.array([[0, 0, 0]]))
    assert stalled.stalled <= 2 * attempts_of(error)


FIRST_READ = textwrap.dedent("""
    import sys
    import zephon
    from zephon.errors import FetchError
    from zephon.ops import batch, fetch, shuffle
    from zephon.sources import ArrowSource

    if __name__ == "__main__":  # worker processes import this module
        source = ArrowSource(sys.argv[1], chunk_size=4, readahead=0, timeout=1, total_timeout=3)
        source.num_samples()
        print("read", flush=True)
        sys.stdin.readline()  # the server stalls now
        try:
            # A shuffle holds records: the loader may read the lane ahead and hand them over.
            ops = [fetch(), shuffle(8, seed=1), batch(4)]
            with zephon.Pipeline(source, ops, workers="process").iter() as it:
                next(it)
        except FetchError as exc:
            print(exc, flush=True)
""")


def test_a_process_lanes_first_read_waits_on_storage_once(tmp_path, bucket, stalled):
    # In a fresh process the loader reads the first lane itself while the workers start (a
    # head start); what failed on storage there is not tried again by the worker.
    uri = upload(tmp_path, bucket, "first")
    (tmp_path / "first.py").write_text(FIRST_READ)
    with subprocess.Popen(
        [sys.executable, str(tmp_path / "first.py"), uri],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=script_env(),
        cwd=tmp_path,
    ) as script:
        assert script.stdin is not None and script.stdout is not None
        assert script.stdout.readline() == "read\n"
        stalled.stall()
        out, _ = script.communicate("go\n", timeout=BOUND)
    assert script.returncode == 0, out
    found = re.search(r"gave up after (\d+) attempts? in", out)
    assert found and f"'{uri}/part-0.parquet': row group 0" in out, out
    assert stalled.stalled == int(found.group(1))


def test_a_jsonl_block_that_never_comes_is_a_fetch_error(tmp_path, bucket, stalled):
    local = tmp_path / "j"
    local.mkdir()
    (local / "a.jsonl").write_text("".join(f'{{"idx": {i}}}\n' for i in range(10)))
    uri = bucket.upload(local, "j")
    source = JsonlSource(uri, **DEADLINE)
    assert source.num_samples() == 10
    stalled.stall()
    with pytest.raises(FetchError, match=rf"pointer \(0, 0, 3\) from '{uri}/a\.jsonl': gave up"):
        source.read(np.array([[0, 0, 3]]))


def test_a_source_sent_to_another_process_keeps_its_deadline(tmp_path, bucket, stalled):
    # pyarrow pickles an S3FileSystem without its retry strategy: the copy must still make
    # one request per attempt.
    uri = upload(tmp_path, bucket, "pickled", files=1)
    source = ArrowSource(uri, readahead=0, **DEADLINE)
    source.num_samples()
    copy = pickle.loads(pickle.dumps(source))
    stalled.stall()
    with pytest.raises(FetchError, match="row group 0: gave up after") as error:
        copy.read(np.array([[0, 0, 1]]))
    assert stalled.stalled == attempts_of(error)


# ------------------------------------------------------------------------- supervision


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_a_lane_timeout_while_waiting_on_storage_names_storage(tmp_path, bucket, stalled, workers):
    uri = upload(tmp_path, bucket, "sup")
    # Storage would wait longer than the pipeline: its timeout fires first, and says why.
    source = ArrowSource(uri, chunk_size=4, readahead=0, timeout=4, total_timeout=8)
    source.num_samples()
    stalled.stall()
    with pytest.raises(FetchError) as error:
        stream(source, workers, timeout=2)
    message = str(error.value)
    assert "produced nothing for 2 s, the pipeline's timeout" in message
    assert re.search(rf"waiting on storage for \d+\.\d s: .*'{uri}/part-[01]\.parquet'", message)
    assert "row group" in message and "4 s a request, 8 s in all" in message
    assert "operator" not in message and "SIGSTOP" not in message
    stalled.release()  # a worker thread cannot be interrupted: it ends once storage answers
    assert wait_until(lambda: not lane_threads(), BOUND)


@pytest.mark.parametrize("workers", WORKERS)
def test_a_request_that_stalled_once_is_tried_again_and_the_stream_is_whole(
    tmp_path, bucket, stalled, workers
):
    # Long enough a wait for a process lane's worker to tell the loader it waits on storage;
    # the retry gets its answer, and the lane goes on as if nothing happened.
    uri = upload(tmp_path, bucket, "once")
    source = ArrowSource(uri, chunk_size=4, readahead=0, timeout=1, total_timeout=6)
    source.num_samples()
    stalled.stall(1)
    pipeline = {"timeout": 10} if workers != "inline" else {}
    assert sorted(stream(source, workers, **pipeline)) == list(range(16))
    assert stalled.stalled == 1


# ------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"timeout": 0}, ValueError, "timeout must be a finite number of seconds > 0"),
        ({"timeout": float("inf")}, ValueError, "timeout must be a finite number"),
        ({"timeout": "1"}, TypeError, "timeout must be a number of seconds"),
        ({"total_timeout": True}, TypeError, "total_timeout must be a number of seconds"),
        ({"timeout": 5, "total_timeout": 2}, ValueError, "total_timeout=2 is shorter than"),
    ],
)
def test_deadlines_are_checked(tmp_path, kwargs, error, text):
    with pytest.raises(error, match=re.escape(f"ArrowSource: {text}")):
        ArrowSource(str(tmp_path), **kwargs)


def test_the_deadlines_are_not_part_of_the_fingerprint(tmp_path, bucket):
    uri = upload(tmp_path, bucket, "fp", files=1)
    assert ArrowSource(uri, **DEADLINE).describe() == ArrowSource(uri).describe()
