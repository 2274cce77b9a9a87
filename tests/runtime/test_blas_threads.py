"""Sizing the BLAS pool a process loaded before it knew its share of the CPUs."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np  # noqa: F401  (loads numpy's BLAS into this process)
from threadpoolctl import threadpool_info

from zephon.runtime.workers.blas_threads import loaded_libraries


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
