"""Sizing a BLAS thread pool that a worker process inherits already loaded.

A worker process is forked from a server that imported numpy before the worker existed, and
numpy's BLAS (OpenBLAS in its wheels, MKL in some builds) reads its thread count from the
environment once, when it loads: a worker's ``OPENBLAS_NUM_THREADS`` comes too late. The server
loads it with one thread (``zephon._fork_server_env``), and ``limit_loaded_blas`` tells each BLAS
library loaded in this process how many threads to use, through the function the library exports
for it (in a forked OpenBLAS the call starts the pool: the threads of this worker's share).
"""

from __future__ import annotations

import ctypes
import os

#: Per library (a part of its file name): the variable that sizes it, and the names its
#: "set the number of threads" function has in different builds (numpy's and scipy's wheels
#: rename OpenBLAS's symbols).
_SETTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "openblas": (
        "OPENBLAS_NUM_THREADS",
        (
            "openblas_set_num_threads",
            "openblas_set_num_threads64_",
            "scipy_openblas_set_num_threads64_",
            "scipy_openblas_set_num_threads",
        ),
    ),
    "mkl_rt": ("MKL_NUM_THREADS", ("MKL_Set_Num_Threads",)),
}


def loaded_libraries(maps: str = "/proc/self/maps") -> list[str]:
    """The paths of the shared libraries mapped into this process, in the order first seen
    (empty where the system has no ``/proc``)."""
    try:
        with open(maps) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    fields = (line.split(maxsplit=5) for line in lines)
    paths = (f[5] for f in fields if len(f) == 6 and f[5].startswith("/") and ".so" in f[5])
    return list(dict.fromkeys(paths))


def _threads(value: str | None) -> int | None:
    try:
        n = int(value or "")
    except ValueError:
        return None  # not a count (a list of levels, say): the library reads it as it likes
    return n if n >= 1 else None


def limit_loaded_blas(environment: dict[str, str]) -> list[str]:
    """Give each loaded BLAS library the thread count its variable has in ``environment``; the
    libraries changed. A library without a known setter, or a variable that is not a positive
    count, is left as it is."""
    wanted = {
        part: (n, setters)
        for part, (variable, setters) in _SETTERS.items()
        if (n := _threads(environment.get(variable))) is not None
    }
    changed = []
    for path in loaded_libraries():
        name = os.path.basename(path).lower()
        for part, (threads, setters) in wanted.items():
            if part in name and _set_threads(path, setters, threads):
                changed.append(path)
    return changed


def _set_threads(path: str, setters: tuple[str, ...], threads: int) -> bool:
    """Call the first of ``setters`` that the library at ``path`` exports; whether one was."""
    try:
        library = ctypes.CDLL(path)  # loaded already: a handle on the same copy
    except OSError:  # the file was replaced or removed since it was loaded
        return False
    setter = next((getattr(library, s) for s in setters if hasattr(library, s)), None)
    if setter is None:
        return False
    setter(ctypes.c_int(threads))
    return True
