"""How many threads each worker process's own pools (a tokenizer's, BLAS's) may start, so that
the workers together fit the CPUs."""

from __future__ import annotations

import os

#: The thread pools of tokenizers and numerical libraries, by the variables that size them.
THREAD_VARIABLES = (
    "RAYON_NUM_THREADS",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS says, else all of them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def worker_environment(processes: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables each of ``processes`` worker processes sets before its lanes run, so that
    the workers' own thread pools (an HF tokenizer's, BLAS's) fit the CPUs together: each worker
    gets ``cpus // processes`` threads (at least 1), and a tokenizer runs single-threaded when
    that is 1. A variable the user set in the loader's environment keeps the user's value."""
    environ = dict(os.environ) if environ is None else environ
    threads = max(1, usable_cpus() // max(1, processes))
    wanted = {name: str(threads) for name in THREAD_VARIABLES}
    wanted["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    return {name: environ.get(name, value) for name, value in wanted.items()}


#: The thread variables a worker may be given more of when other workers have finished: the
#: tokenizer's, whose output does not depend on how many threads encode. BLAS and OpenMP keep
#: their first size, as a reduction's result can depend on how it was split.
WIDENED = ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM")
