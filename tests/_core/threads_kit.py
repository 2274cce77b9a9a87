"""Hammering one kernel object from several threads, in a child process.

A kernel that corrupts memory under concurrent use may abort the interpreter; running the threads
in a child keeps that a failed test instead of a dead test session, and a timeout turns a
deadlock into a failure too. The child gets ``hammer(n_threads, work)`` and prints one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import zephon

REPO = Path(zephon.__file__).resolve().parent.parent

PRELUDE = '''
import json, queue, sys, threading
import numpy as np

def hammer(n_threads, work):
    """Run work(t) for t in range(n_threads) together; the exceptions they raised, as text."""
    # Short GIL turns: the threads interleave more often, and one that never blocks holds the GIL
    # for 0.2 ms at a turn instead of 5 ms, so the others are not starved.
    sys.setswitchinterval(2e-4)
    errors = []
    start = threading.Barrier(n_threads)

    def run(t):
        start.wait()
        try:
            work(t)
        except BaseException as exc:
            errors.append(f"thread {t}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return errors
'''


def run_threads(script: str, timeout: float = 300.0) -> dict[str, Any]:
    """Run ``script`` (after the prelude) in a fresh interpreter importing this checkout's
    ``zephon``; its last stdout line, parsed as JSON. Fails if the child dies or hangs."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, (
        f"the child process died with return code {done.returncode}:\n{done.stderr[-3000:]}"
    )
    return json.loads(done.stdout.strip().splitlines()[-1])
