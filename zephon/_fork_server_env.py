"""One-threaded BLAS in a fork server, set before numpy loads, and no warnings that a fork
server's forks are unsafe.

Worker processes are forked from a ``multiprocessing`` fork server that imports ``zephon`` (and
with it numpy) before it forks any. OpenBLAS starts its thread pool when it loads, as large as
the machine, and each new thread spins for about a tenth of a second before it sleeps; a forked
worker then has no pool, and the first call that sizes it to the worker's share of the CPUs
(``runtime.workers.blas_threads``) starts the whole pool again, spinning, and keeps the threads
it does not need. A server that loads its BLAS with one thread starts none, and a worker starts
only the threads of its share. The server computes nothing itself, so nothing else changes.
The setting is made here, as ``zephon`` (the server's first preload) is imported: the server
inherits the loader's environment, and changing the loader's to start it would race other threads.

Some libraries warn before every fork of a process that imported them (Lance: "not fork-safe ...
use spawn or forkserver"), for the threads their calls start. The server imports them for the
workers and calls nothing, so it forks from no such thread: the warning is silenced there
(``quiet_fork_warnings_in_fork_server``). A worker inherits the filter; it forks nothing itself.

Only in a process started with ``multiprocessing``'s fork server command line (the server, and a
process forked from it that imports ``zephon`` first), and only for variables the environment
does not set. A process forked from the server inherits them; a zephon worker sets its own.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import MutableMapping, Sequence

#: The variables that size a BLAS library's pool when it loads: OpenBLAS's (MKL sizes its pool
#: at its first call, in the worker, from the worker's own ``MKL_NUM_THREADS``).
BLAS_VARIABLES = ("OPENBLAS_NUM_THREADS",)

#: Warnings of modules that warn before every fork of a process that imported them (the module,
#: the start of the message): a fork server imports them and runs none of their code.
FORK_WARNINGS = (("lance", "lance is not fork-safe"),)

#: How ``multiprocessing`` starts its fork server: ``python -c`` with this command.
_SERVER_COMMAND = "from multiprocessing.forkserver import main;"


def is_fork_server(argv: Sequence[str] | None = None) -> bool:
    """Whether this process (its command line, ``argv``) is a ``multiprocessing`` fork server."""
    argv = sys.orig_argv if argv is None else argv
    return len(argv) >= 2 and argv[-2] == "-c" and argv[-1].startswith(_SERVER_COMMAND)


def one_blas_thread_in_fork_server(
    environ: MutableMapping[str, str] | None = None, argv: Sequence[str] | None = None
) -> list[str]:
    """In a fork server, set each of ``BLAS_VARIABLES`` the environment lacks to 1; the
    variables set (none elsewhere)."""
    if not is_fork_server(argv):
        return []
    environ = os.environ if environ is None else environ
    unset = [name for name in BLAS_VARIABLES if name not in environ]
    for name in unset:
        environ[name] = "1"
    return unset


def quiet_fork_warnings_in_fork_server(argv: Sequence[str] | None = None) -> bool:
    """In a fork server, ignore ``FORK_WARNINGS``; whether this process is one."""
    if not is_fork_server(argv):
        return False
    for module, message in FORK_WARNINGS:
        warnings.filterwarnings("ignore", message=message, module=module)
    return True
