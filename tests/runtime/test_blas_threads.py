"""Sizing the BLAS pool a process loaded before it knew its share of the CPUs, and the fork
server loading it with one thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np  # noqa: F401  (loads numpy's BLAS into this process)
import pytest
from threadpoolctl import threadpool_info

import zephon
from zephon._fork_server_env import BLAS_VARIABLES, is_fork_server, one_blas_thread_in_fork_server
from zephon.ops.basic import fetch, map_transform
from zephon.runtime.workers.blas_threads import _SETTERS, loaded_libraries
from zephon.runtime.workers.thread_budget import worker_environment
from zephon.sources.memory import RangeSource


def test_loaded_libraries_lists_numpys_blas():
    blas = {p["filepath"] for p in threadpool_info() if p["user_api"] == "blas"}
    assert blas and blas <= set(loaded_libraries())


def test_without_a_maps_file_no_library_is_listed(tmp_path):
    assert loaded_libraries(str(tmp_path / "missing")) == []


def limited(environment: dict[str, str]) -> dict:
    """In a fresh interpreter (this one's pool is left alone): numpy loaded, then
    ``limit_loaded_blas(environment)``; the libraries changed and the BLAS pools' sizes."""
    code = (
        "import json, numpy\n"
        "from threadpoolctl import threadpool_info\n"
        "from zephon.runtime.workers.blas_threads import limit_loaded_blas\n"
        f"changed = limit_loaded_blas({environment!r})\n"
        "sizes = [p['num_threads'] for p in threadpool_info() if p['user_api'] == 'blas']\n"
        "print(json.dumps({'changed': changed, 'sizes': sizes}))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "OPENBLAS_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    result: dict = json.loads(done.stdout)
    return result


def test_a_loaded_pool_takes_the_size_its_variable_gives():
    got = limited({"OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    assert got["changed"] and got["sizes"] == [1] * len(got["sizes"])


def test_a_variable_that_is_not_a_count_leaves_the_pool_alone():
    got = limited({"OPENBLAS_NUM_THREADS": "4,2", "MKL_NUM_THREADS": "0"})
    assert got["changed"] == [] and got["sizes"] == limited({})["sizes"]


SERVER_ARGV = [
    sys.executable,
    "-c",
    "from multiprocessing.forkserver import main; main(5, 6, ['zephon'], **{})",
]


def test_a_fork_server_is_known_by_its_command_line():
    assert is_fork_server(SERVER_ARGV)
    assert is_fork_server([sys.executable, "-X", "dev", *SERVER_ARGV[1:]])
    assert not is_fork_server([sys.executable, "train.py"])
    assert not is_fork_server([sys.executable, "-c", "import zephon"])
    assert not is_fork_server([sys.executable, "-c"])
    assert not is_fork_server(sys.orig_argv)  # this test run


def test_a_fork_server_loads_blas_with_one_thread_unless_the_user_sized_it():
    environ = {"OMP_NUM_THREADS": "4"}
    assert one_blas_thread_in_fork_server(environ, SERVER_ARGV) == ["OPENBLAS_NUM_THREADS"]
    assert environ == {"OMP_NUM_THREADS": "4", "OPENBLAS_NUM_THREADS": "1"}
    sized = {"OPENBLAS_NUM_THREADS": "3"}
    assert one_blas_thread_in_fork_server(sized, SERVER_ARGV) == []
    assert sized == {"OPENBLAS_NUM_THREADS": "3"}
    assert set(BLAS_VARIABLES) <= {variable for variable, _ in _SETTERS.values()}


def test_elsewhere_the_environment_is_left_alone():
    environ: dict[str, str] = {}
    assert one_blas_thread_in_fork_server(environ, [sys.executable, "train.py"]) == []
    assert environ == {}


def threads_in_worker(payload: dict) -> dict:
    """The worker's threads: those the OS runs, and those Python started."""
    return {**payload, "os": len(os.listdir("/proc/self/task")), "py": threading.active_count()}


@pytest.mark.usefixtures("no_leftover_workers")
def test_a_worker_runs_the_blas_threads_of_its_share_and_no_more():
    # Numpy loaded in the fork server; each worker sizes its BLAS pool to its share of the CPUs
    # (one thread, its own, on two CPUs), and no pool of the machine's size waits idle beside it.
    pipeline = zephon.Pipeline(
        RangeSource(8, chunk_size=2),
        [fetch(), map_transform(threads_in_worker)],
        lanes=2,
        workers="process",
    )
    share = int(worker_environment(pipeline.compile().processes)["OPENBLAS_NUM_THREADS"])
    with pipeline.iter() as loader:
        seen = {(r.payload["os"], r.payload["py"]) for r in loader}
    assert seen and all(native == python + share - 1 for native, python in seen), (share, seen)
