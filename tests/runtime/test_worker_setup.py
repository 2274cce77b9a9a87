"""How worker processes are set up: the plan loaded once per process, the fork server's preload
list taken from the plan, and the thread pools of tokenizers sized to the CPUs."""

from __future__ import annotations

import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from worker_kit import script_env

import zephon
from zephon.ops import batch, fetch, filter_records, map_transform, tokenize
from zephon.runtime.workers.fork_server import plan_modules
from zephon.runtime.workers.thread_budget import THREAD_VARIABLES, WIDENED, worker_environment
from zephon.sources import ArrowSource
from zephon.sources.memory import RangeSource

THREAD_NAMES = (*THREAD_VARIABLES, "TOKENIZERS_PARALLELISM")
KEPT = [name for name in THREAD_VARIABLES if name not in WIDENED]  # BLAS, OpenMP: never widened


pytestmark = pytest.mark.usefixtures("no_leftover_workers")


@pytest.fixture
def no_user_thread_settings(monkeypatch):
    for name in THREAD_NAMES:
        monkeypatch.delenv(name, raising=False)


def cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class LoadCounter:
    """Appends a line to ``path`` every time it is unpickled: how often a worker loads the plan."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (_loaded, (self.path,))

    def __deepcopy__(self, memo: dict) -> LoadCounter:  # each lane copies its operators
        return LoadCounter(self.path)


def _loaded(path: str) -> LoadCounter:
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")
    return LoadCounter(path)


class Tagged:
    """A map function that holds a ``LoadCounter`` (so it travels inside the plan)."""

    def __init__(self, counter: LoadCounter):
        self.counter = counter

    def __call__(self, payload: dict) -> dict:
        return {**payload, "pid": os.getpid()}


def thread_settings(payload: dict) -> dict:
    return {**payload, **{name: os.environ.get(name, "") for name in THREAD_NAMES}}


def test_grouped_lanes_load_the_plan_once_per_worker_process(tmp_path):
    log = tmp_path / "loads.txt"
    pipeline = zephon.Pipeline(
        RangeSource(256, chunk_size=16),
        [fetch(), map_transform(Tagged(LoadCounter(str(log)))), batch(4)],
        lanes=4,
        workers="process",
        processes=2,
    )
    with pipeline.iter() as loader:
        pids = {int(p) for b in loader for p in b.payload["pid"]}
    loads = log.read_text().split()
    assert len(pids) == 2  # four lanes on two worker processes
    assert sorted(int(p) for p in loads) == sorted(pids)  # one load in each, none per lane


def test_worker_environment_gives_each_worker_its_share_of_the_cpus(no_user_thread_settings):
    for processes in (1, 2, 3, 64):
        env = worker_environment(processes)
        threads = max(1, cpus() // processes)
        assert {env[name] for name in THREAD_VARIABLES} == {str(threads)}
        assert env["TOKENIZERS_PARALLELISM"] == ("true" if threads > 1 else "false")


def test_worker_environment_keeps_what_the_user_set():
    env = worker_environment(2, {"RAYON_NUM_THREADS": "7", "TOKENIZERS_PARALLELISM": "true"})
    assert env["RAYON_NUM_THREADS"] == "7" and env["TOKENIZERS_PARALLELISM"] == "true"
    assert env["OMP_NUM_THREADS"] == str(max(1, cpus() // 2))


def pipeline_of(fn, lanes: int = 2) -> zephon.Pipeline:
    return zephon.Pipeline(
        RangeSource(64, chunk_size=8),
        [fetch(), map_transform(fn), batch(8)],
        lanes=lanes,
        workers="process",
        processes=lanes,
    )


def test_worker_processes_run_with_the_sized_thread_pools(no_user_thread_settings):
    with pipeline_of(thread_settings).iter() as loader:
        batches = [b.payload for b in loader]
    share = worker_environment(2)
    # Each lane's first batch is made before any lane can end (a worker runs at most `prefetch`
    # lists ahead); after one worker ends, the other's tokenizer may take its CPUs.
    firsts = [next(b for b in batches if lane_of(b["idx"][0], 2) == lane) for lane in (0, 1)]
    assert [{name: b[name][0] for name in THREAD_NAMES} for b in firsts] == [share, share]
    assert all(set(b[name]) == {share[name]} for b in batches for name in KEPT)


def _collect(loader) -> dict[str, set[str]]:
    seen: dict[str, set[str]] = {name: set() for name in THREAD_NAMES}
    for b in loader:
        for name in THREAD_NAMES:
            seen[name].update(b.payload[name])
    return seen


def test_worker_processes_keep_the_users_thread_settings(monkeypatch, no_user_thread_settings):
    monkeypatch.setenv("RAYON_NUM_THREADS", "3")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    with pipeline_of(thread_settings).iter() as loader:
        seen = _collect(loader)
    assert seen["RAYON_NUM_THREADS"] == {"3"} and seen["TOKENIZERS_PARALLELISM"] == {"true"}


def lane_of(idx: int, lanes: int) -> int:
    """The lane that reads sample ``idx`` in these tests' pipelines (chunks of 8, in order)."""
    return (idx // 8) % lanes


def in_lane_0_or_its_first_chunk(payload: dict) -> bool:
    return lane_of(payload["idx"], 2) == 0 or payload["idx"] < 16


def lane_0_settings(pipeline: zephon.Pipeline) -> list[dict[str, str]]:
    """The thread settings lane 0's records saw, in order, while lane 1 ends after one batch."""
    with pipeline.iter() as loader:
        return [
            {name: b.payload[name][0] for name in THREAD_NAMES}
            for b in loader
            if lane_of(b.payload["idx"][0], 2) == 0
        ]


def uneven_lanes() -> zephon.Pipeline:
    return zephon.Pipeline(
        RangeSource(1024, chunk_size=8),
        [
            fetch(),
            filter_records(in_lane_0_or_its_first_chunk),
            map_transform(thread_settings),
            batch(8),
        ],
        lanes=2,
        workers="process",
        processes=2,
    )


def test_a_finished_worker_leaves_its_cpus_to_the_tokenizer_of_the_one_still_running(
    no_user_thread_settings,
):
    seen = lane_0_settings(uneven_lanes())
    two, one = worker_environment(2), worker_environment(1)
    assert seen[0] == two
    # Lane 1 ended at its second turn: lane 0's worker reads the news before its next list.
    assert seen[-1] == {**two, **{name: one[name] for name in WIDENED}}
    assert all(s[name] == two[name] for s in seen for name in KEPT)


def lane_0_longest(payload: dict) -> bool:
    """Four lanes: lane 1 keeps its first chunk, lanes 2 and 3 the first half."""
    lane = lane_of(payload["idx"], 4)
    return lane == 0 or payload["idx"] < (16 if lane == 1 else 512)


def test_a_worker_leaves_its_cpus_only_once_all_its_lanes_ended(no_user_thread_settings):
    pipeline = zephon.Pipeline(
        RangeSource(1024, chunk_size=8),
        [fetch(), filter_records(lane_0_longest), map_transform(thread_settings), batch(8)],
        lanes=4,
        workers="process",
        processes=2,  # lanes 0 and 1 on one worker, 2 and 3 on the other
    )
    with pipeline.iter() as loader:
        batches = [b.payload for b in loader]
    # Lane 1 ends first, but lane 0 keeps its worker busy until after lanes 2 and 3 have ended.
    later = [b for b in batches if lane_of(b["idx"][0], 4) in (2, 3)]
    share = worker_environment(2)
    assert len(later) == 32
    assert all(set(b[name]) == {share[name]} for b in later for name in THREAD_NAMES)


def test_a_finished_worker_leaves_the_users_thread_settings_alone(
    monkeypatch, no_user_thread_settings
):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("RAYON_NUM_THREADS", "1")
    seen = lane_0_settings(uneven_lanes())
    assert {s["TOKENIZERS_PARALLELISM"] for s in seen} == {"false"}
    assert {s["RAYON_NUM_THREADS"] for s in seen} == {"1"}


def blas_threads(payload: dict) -> dict:
    from threadpoolctl import threadpool_info

    pools = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
    return {**payload, "blas": max(pools)}


def test_worker_processes_size_the_blas_pool_the_fork_server_loaded(no_user_thread_settings):
    # numpy, and its BLAS with a pool as large as the machine, were loaded in the fork server
    # before any worker existed; each worker still runs its share of the CPUs.
    with pipeline_of(blas_threads).iter() as loader:
        seen = {int(n) for b in loader for n in b.payload["blas"]}
    assert seen == {int(worker_environment(2)["OPENBLAS_NUM_THREADS"])}


def test_the_preload_list_names_what_the_plan_holds(tmp_path):
    texts = [f"document {i} of the corpus" for i in range(50)]
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=16)
    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    plan = zephon.Pipeline(
        ArrowSource(path, chunk_size=16),
        [fetch(), tokenize(bpe, append_eos=False), map_transform(thread_settings), batch(2)],
        workers="process",
    ).compile()
    modules = plan_modules(plan)
    assert {"tokenizers", "pyarrow", "zephon.ops.tokenize", "zephon.sources.arrow"} <= set(modules)
    # Your own modules (this test's, holding the map function) are imported by the workers:
    # the fork server would run their top-level code.
    assert __name__ not in modules
    assert not {"builtins", "__main__", "zephon"} & set(modules)
    assert modules == sorted(modules) == plan_modules(plan)


# A fresh interpreter: the fork server preloads what the first plan of its process names.
PRELOAD_SCRIPT = """
import os, sys
import pyarrow as pa
import pyarrow.parquet as pq
import zephon
from zephon.ops import fetch, map_transform
from zephon.sources import ArrowSource, MixtureSource


def extensions(pid):
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-1] for line in f if "/pyarrow/" in line and ".so" in line}


class LoadedAfterFork:
    # The map function; it notes the modules there are when a worker loads the plan.

    def __getstate__(self):
        return {"sent": True}

    def __setstate__(self, state):
        self.before_reads = set(sys.modules)

    def __call__(self, payload):
        # The worker's parent is the fork server: what the worker mapped beyond it, it imported.
        return {
            "late": sorted(extensions(os.getpid()) - extensions(os.getppid())),
            "imported": sorted(set(sys.modules) - self.before_reads),
        }


def main():
    paths = [os.path.join(sys.argv[1], f"rows{k}.parquet") for k in range(2)]
    for path in paths:
        pq.write_table(pa.table({"x": list(range(64))}), path, row_group_size=16)
    if sys.argv[2] == "mixture":
        a, b = (ArrowSource(path, chunk_size=16, dataset_id=k) for k, path in enumerate(paths))
        source = MixtureSource({"a": a, "b": b}, {"a": 0.5, "b": 0.5}, chunk_size=16)
    else:
        source = ArrowSource(paths[0], chunk_size=16)
    pipeline = zephon.Pipeline(
        source,
        [fetch(), map_transform(LoadedAfterFork())],
        lanes=2,
        workers="process",
        timeout=60.0,  # no head start: every sample is read by a worker
    )
    late, imported = set(), set()
    with pipeline.iter() as loader:
        for record in loader:
            late.update(record.payload["late"])
            imported.update(record.payload["imported"])
    print(sorted(late))
    print(sorted(imported))


if __name__ == "__main__":
    main()
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/<pid>/maps")
@pytest.mark.parametrize("source", ["file", "mixture"])
def test_a_worker_reading_in_order_imports_nothing_after_its_fork(tmp_path, source):
    script = tmp_path / "preload_probe.py"
    script.write_text(PRELOAD_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), source],
        capture_output=True,
        text=True,
        env=script_env(),
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    extensions, modules = done.stdout.strip().splitlines()
    assert extensions == "[]"  # no pyarrow extension mapped after the fork
    assert modules == "[]"  # nor any module imported by the reads (numpy.ma by np.unique, once)
