"""Process lanes with a head start: the loader reads the first lane while the workers start, and
the stream is the one inline lanes deliver, from the start and after a restore.

A head start only happens in a process that has not started a fork server yet, so each run is a
script in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from worker_kit import script_env

KIT = textwrap.dedent("""
    import os
    import time
    import numpy as np
    import zephon
    from zephon.ops import batch, fetch, map_transform, pack_sequences
    from zephon.sources.memory import RangeSource

    PACE = float(os.environ.get("HEAD_START_PACE", "0"))  # seconds a sample takes

    def tokens(payload):
        with open(os.environ["HEAD_START_LOG"], "a") as log:  # which process read this sample
            log.write(f"{os.getpid()} {payload['idx']}\\n")
        if PACE:
            time.sleep(PACE)
        idx = payload["idx"]
        return {"tokens": np.arange(idx, idx + 1 + idx * 7919 % 97, dtype=np.int32)}

    def pipeline(workers, **kw):
        return zephon.Pipeline(
            RangeSource(4000, chunk_size=512, shuffle=True, seed=5),
            [fetch(), map_transform(tokens), pack_sequences(128, open_bins=8, pad_id=0), batch(4)],
            lanes=2,
            workers=workers,
            processes=2,
            epoch_chunks=4,
            **kw,
        )
""")

SCRIPT = textwrap.dedent("""
    import json, os, sys, threading
    import zephon
    from head_kit import pipeline
    from pipeline_kit import fingerprint_item
    from worker_kit import worker_processes

    def main():
        mode, out = sys.argv[1], sys.argv[2]
        state = None
        if mode == "resume":
            state = zephon.load_checkpoint(os.path.join(os.path.dirname(out), "state.json"))
        kw = {"timeout": 60.0} if mode == "timeout" else {}
        loader = pipeline("inline" if mode == "inline" else "process", **kw).iter(state=state)
        items = []
        workers_at_first = None
        lanes_before_workers = set()  # lanes whose batches came before any worker existed
        workers_came = False
        with loader:
            for step, item in enumerate(loader, 1):
                items.append(repr(fingerprint_item(item)))
                if mode == "slow" and not workers_came:
                    # Workers are what the fork server forked: the server itself may only just
                    # be starting (before its exec it looks like this script).
                    workers = sum(p.ppid() != os.getpid() for p in worker_processes())
                    if step == 1:
                        workers_at_first = workers
                    if workers:  # from here on (until they finish and exit)
                        workers_came = True
                    else:
                        lanes_before_workers.update(r.meta.lane_id for r in item)
                if mode == "inline" and step == 23:
                    zephon.save_checkpoint(
                        os.path.join(os.path.dirname(out), "state.json"), loader.state_dict()
                    )
            counts = {
                op: (s["records_in"], s["items_out"])
                for op, s in loader.stats()["operators"].items()
            }
        with open(out, "w") as f:
            json.dump(
                {
                    "pid": os.getpid(),
                    "items": items,
                    "counts": counts,
                    "first": workers_at_first,
                    "lanes_before_workers": sorted(lanes_before_workers),
                    # zephon's threads still running once the loader is closed
                    "threads": [t.name for t in threading.enumerate() if "zephon" in t.name],
                },
                f,
            )

    if __name__ == "__main__":  # worker processes re-import this module
        main()
""")


pytestmark = pytest.mark.usefixtures("no_leftover_workers")


#: Seconds each sample takes in the runs with workers: the loader reads on until the workers can
#: start, and at this pace they still find most samples unread.
PACE = "0.0015"


def run_script(tmp_path, mode: str, pace: str = PACE) -> tuple[list[str], set[int], int, dict]:
    """The items a fresh interpreter delivers in ``mode``, the pids that read samples, its pid
    and its loader's operator counts."""
    reads, items, me, counts = run_logged(tmp_path, mode, pace)
    return items, {pid for pid, _ in reads}, me, counts


def run_logged(
    tmp_path, mode: str, pace: str = PACE
) -> tuple[list[tuple[int, int]], list[str], int, dict]:
    """``run_script``, with every read of a sample as (pid, idx), in the order they happened
    (each sample taking ``pace`` seconds, except inline)."""
    (tmp_path / "head_kit.py").write_text(KIT)
    # In "slow" mode the fork server takes seconds to start, as one importing torch might: every
    # process on the path imports sitecustomize at its start, and this one sleeps in the server.
    slow = "import sys, time\nif 'forkserver' in ' '.join(sys.orig_argv):\n    time.sleep(3)\n"
    (tmp_path / "sitecustomize.py").write_text(slow if mode == "slow" else "")
    (tmp_path / "train.py").write_text(SCRIPT)
    log = tmp_path / f"{mode}.log"
    env = script_env()
    tests = os.path.dirname(os.path.dirname(__file__))
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), tests, env["PYTHONPATH"]])
    env["HEAD_START_LOG"] = str(log)
    env["HEAD_START_PACE"] = "0" if mode == "inline" else pace
    out = tmp_path / f"{mode}.json"
    subprocess.run(
        [sys.executable, str(tmp_path / "train.py"), mode, str(out)], env=env, check=True,
        timeout=120,
    )  # fmt: skip
    got = json.loads(out.read_text())
    reads = [(int(p), int(i)) for p, i in (line.split() for line in log.read_text().splitlines())]
    return reads, got["items"], got["pid"], got["counts"]


@pytest.mark.skipif(sys.platform == "win32", reason="no fork server")
@pytest.mark.parametrize("mode", ["process", "slow"])  # slow: the loader reads both lanes ahead
def test_the_loader_reads_ahead_and_the_stream_is_unchanged(tmp_path, mode):
    full, _, _, counts = run_script(tmp_path, "inline")
    reads, items, me, got = run_logged(tmp_path, mode)
    assert items == full
    assert got == counts, "what the loader read ahead counts once in the operators' stats"
    assert len(reads) == len({idx for _, idx in reads}) == 4000, "no sample was read twice"
    readers = [pid for pid, _ in reads]
    assert readers[0] == me, "the loader's process read the first lane's first samples"
    assert len(set(readers) - {me}) == 2, "both lanes' workers read the rest"


@pytest.mark.skipif(sys.platform == "win32", reason="no fork server")
def test_the_first_lanes_worker_is_handed_what_the_loader_held_instead_of_reading_it_again(
    tmp_path,
):
    full, _, _, _ = run_script(tmp_path, "inline")
    reads, items, me, _ = run_logged(tmp_path, "process")
    assert items == full
    ahead = {idx for pid, idx in reads if pid == me}
    assert ahead, "the loader read ahead"
    again = [idx for pid, idx in reads if pid != me and idx in ahead]
    assert again == [], "samples the loader read were transformed again in a worker"
    assert len(reads) == len({idx for _, idx in reads}) == 4000


@pytest.mark.skipif(sys.platform == "win32", reason="no fork server")
def test_a_restore_with_a_head_start_continues_exactly(tmp_path):
    full, _, _, _ = run_script(tmp_path, "inline")  # saves the state after step 23
    tail, readers, me, _ = run_script(tmp_path, "resume")
    assert full[:23] + tail == full
    assert me in readers


@pytest.mark.skipif(sys.platform == "win32", reason="no fork server")
def test_with_a_timeout_every_sample_is_read_by_a_worker(tmp_path):
    full, _, _, _ = run_script(tmp_path, "inline")
    items, readers, me, _ = run_script(tmp_path, "timeout")
    assert items == full
    assert me not in readers, "nothing could interrupt an operator stuck in the loader's thread"


@pytest.mark.skipif(sys.platform == "win32", reason="no fork server")
def test_the_first_batch_does_not_wait_for_the_fork_server(tmp_path):
    full, _, _, _ = run_script(tmp_path, "inline")
    # The fork server sleeps 3 s before it can fork any worker.
    items, readers, me, _ = run_script(tmp_path, "slow")
    got = json.loads((tmp_path / "slow.json").read_text())
    assert got["first"] == 0, "the first batch came before any worker process existed"
    # and so did the second lane's first batches: the loader read that lane ahead too, its
    # worker waiting for the fork server like the first lane's
    assert got["lanes_before_workers"] == [0, 1]
    assert items == full
    assert me in readers and len(readers - {me}) == 2


@pytest.mark.skipif(sys.platform == "win32", reason="no fork server")
def test_the_loader_reads_on_until_the_workers_can_start(tmp_path):
    full, _, _, _ = run_script(tmp_path, "inline")
    # The fork server takes 3 s to start, and the lanes take the loader less: it reads them to
    # their ends itself, each sample once, and no worker runs them.
    reads, items, me, _ = run_logged(tmp_path, "slow", pace="0")
    assert items == full
    assert len(reads) == len({idx for _, idx in reads}) == 4000, "no sample was read twice"
    assert {pid for pid, _ in reads} == {me}
    got = json.loads((tmp_path / "slow.json").read_text())
    assert got["threads"] == [], "closing the loader ended the thread that starts the workers"


ARROW_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zephon
    from zephon.ops import batch, fetch, map_transform, pack_sequences
    from zephon.sources import ArrowSource

    class KeepingSource(ArrowSource):
        GROUP_CACHE = 1000  # every group read stays decoded, unless the caches are dropped
        opened = 0  # files opened for reading, in this process

        def open_file(self, path):
            KeepingSource.opened += 1
            return super().open_file(path)

    def tokens(row):
        time.sleep(0.001)  # the workers start before the loader could read every lane itself
        idx = row["idx"]
        return {"tokens": np.arange(idx, idx + 1 + idx % 37, dtype=np.int32)}

    def main():
        path = sys.argv[1]
        pq.write_table(pa.table({"idx": list(range(4000))}), path, row_group_size=100)
        src = KeepingSource(path, chunk_size=200)
        ops = [fetch(), map_transform(tokens), pack_sequences(64, open_bins=4, pad_id=0), batch(4)]
        pipeline = zephon.Pipeline(src, ops, lanes=2, workers="process", processes=2)
        at_start = KeepingSource.opened
        batches = 0
        with pipeline.iter() as loader:
            for _ in loader:
                batches += 1
                if batches == 100:  # the workers read; this loader runs on (its end drops too)
                    ahead = KeepingSource.opened - at_start
                    (row,) = src.read(np.array([[0, 0, 0]]))  # the loader's first read began here
                    again = KeepingSource.opened - at_start - ahead
        print(json.dumps({"batches": batches, "ahead": ahead, "row": row, "again": again}))

    if __name__ == "__main__":  # worker processes re-import this module
        main()
""")


@pytest.mark.skipif(sys.platform == "win32", reason="no fork server")
def test_once_the_workers_read_the_loader_keeps_nothing_it_read_ahead(tmp_path):
    script = tmp_path / "arrow_train.py"
    script.write_text(ARROW_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "rows.parquet")],
        env=script_env(), capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["batches"] > 100 and got["row"] == {"idx": 0}
    assert got["ahead"] > 0, "the loader read the first lane ahead from the file"
    assert got["again"] == 1, "a group the loader decoded was held after the workers took over"
