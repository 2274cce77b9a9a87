"""Which process a source's counters come from, as the loader tells its workers apart."""

from __future__ import annotations

import os
import subprocess
import sys

from zephon.sources.source_io import process_key

_KEY = "from zephon.sources.source_io import process_key; print(process_key())"


def test_a_process_started_elsewhere_is_told_apart_even_with_the_same_pid():
    # A Ray lane's worker on another machine may have the pid of the loader's process: the
    # loader would take its counters for its own and leave them out of stats()["sources"].
    # Each interpreter's key carries a token of its own beside the pid.
    ours = process_key()
    theirs = [
        subprocess.run(
            [sys.executable, "-c", _KEY], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    ]
    tokens = {key.rsplit("-", 1)[0] for key in [ours, *theirs]}
    assert len(tokens) == 3
    assert ours.endswith(f"-{os.getpid()}")


def test_a_forked_worker_keeps_the_token_and_is_told_apart_by_its_pid():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its key, and out
        os.write(write, process_key().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 200).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert child == f"{process_key().rsplit('-', 1)[0]}-{pid}"
