"""A free loopback port, for the servers and process groups the tests start on 127.0.0.1, and
the ranks of such a process group run as scripts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(script: Path, world: int, *args: str, timeout: float) -> list[tuple[int, str, str]]:
    """``python script <url> <rank> *args`` for every rank of ``world``, meeting at a free
    loopback port: each rank's exit status, output and errors. A rank not done within
    ``timeout`` seconds raises ``subprocess.TimeoutExpired``; every rank still running is killed
    either way."""
    url = f"tcp://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), url, str(r), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        for r in range(world)
    ]
    try:
        done = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [(proc.returncode, out, err) for proc, (out, err) in zip(procs, done, strict=True)]
