"""What the worker tests check after each test: no lane thread and no worker process is left."""

from __future__ import annotations

import array
import contextlib
import os
import threading
import time
from collections.abc import Iterator

import psutil

import zephon

# Started once per test process by multiprocessing and shared by every later worker: not a leak.
_MULTIPROCESSING_SERVICES = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")
# The daemons of the local Ray cluster the test run started (``ray_cluster``), kept for the whole
# run: they and the worker processes they start are Ray's, not leaks (Ray lanes' actors are
# checked through Ray instead).
_ray_daemons: set[int] = set()
# Servers started once for the whole test run in processes of their own (``gcs_endpoint``).
_servers: set[int] = set()


def allow_ray_daemons(pids: set[int]) -> None:
    """Leave these processes (the local Ray cluster's daemons) and their descendants out of
    ``worker_processes``; an empty set takes the allowance back."""
    _ray_daemons.clear()
    _ray_daemons.update(pids)


def allow_server(pid: int) -> None:
    """Leave this process (a server the test run keeps for its whole length) out of
    ``worker_processes``."""
    _servers.add(pid)


def _ray_processes() -> set[int]:
    found = set()
    for pid in _ray_daemons:
        with contextlib.suppress(psutil.NoSuchProcess):
            found.add(pid)
            found.update(p.pid for p in psutil.Process(pid).children(recursive=True))
    return found


def lane_threads() -> list[threading.Thread]:
    """Threads Zephon started in this process (lane workers, operator pools) still running."""
    return [t for t in threading.enumerate() if t.name.startswith("zephon-")]


def worker_processes() -> list[psutil.Process]:
    """Descendants of this process except multiprocessing's fork server and resource tracker,
    and the local Ray cluster's processes (``allow_ray_daemons``).

    The services are told apart from the workers by being direct children: a worker forked by
    the fork server has the same command line as the server itself.
    """
    me = psutil.Process()
    services = set()
    for child in me.children():
        with contextlib.suppress(psutil.NoSuchProcess):
            if any(service in " ".join(child.cmdline()) for service in _MULTIPROCESSING_SERVICES):
                services.add(child.pid)
    services |= _ray_processes() | _servers
    return [p for p in me.children(recursive=True) if p.pid not in services]


def script_env() -> dict[str, str]:
    """The environment for a script run in a subprocess: it and every worker process it starts
    (the fork server included, which ignores the script's own ``sys.path``) import the zephon
    under test rather than another installed copy."""
    root = os.path.dirname(os.path.dirname(zephon.__file__))
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


def wait_until(condition, seconds: float) -> bool:
    """Poll ``condition`` until it holds or ``seconds`` pass; whether it held."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@contextlib.contextmanager
def finishes_within(seconds: float) -> Iterator[None]:
    """The block must end within ``seconds``: a deadline ten times what it takes on a quiet
    machine, so that only a hang (or a wait for a stuck worker) fails it, never a busy machine."""
    start = time.monotonic()
    yield
    took = time.monotonic() - start
    assert took < seconds, f"took {took:.2f} s, past its deadline of {seconds} s"


def unread_bytes(lane) -> int:
    """Bytes a process lane's worker has written to its pipe that the loader has not read yet."""
    import fcntl  # POSIX only; conftest imports this module on every platform
    import termios

    count = array.array("i", [0])
    fcntl.ioctl(lane._conn.fileno(), termios.FIONREAD, count)
    return count[0]


def blocked_sending(*lanes) -> bool:
    """Whether the workers of these process lanes are each in the middle of a message too large
    for the pipe to hold (the pipe is full: a worker goes on only once the loader reads)."""
    return all(unread_bytes(lane) >= 64 * 1024 for lane in lanes)


def assert_no_leftover_workers() -> Iterator[None]:
    """Fixture body: the test must leave no ``zephon-*`` thread and no worker process behind."""
    yield
    threads = lane_threads()
    processes = worker_processes()
    for proc in processes:  # so that one leak fails one test, not every test after it
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(processes, timeout=5)
    assert not threads, f"lane threads left running: {[t.name for t in threads]}"
    assert not processes, f"worker processes left running: {[p.pid for p in processes]}"
