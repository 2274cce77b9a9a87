"""Talking to storage that is not a local disk: which errors are worth another attempt, the
retry loop with backoff and deadlines, and a bounded parallel map for metadata and read-ahead.

A transient error is an ``OSError`` whose message pyarrow's S3/GCS clients (or fsspec) give for
a server error (HTTP 5xx, throttling: 503 SlowDown or 429 Too Many Requests), a reset or refused
connection, or a timeout. Every other error is permanent. ``with_retries`` makes at most
``RetryPolicy.attempts`` attempts, sleeping ``backoff * 4**k`` seconds (capped at ``max_sleep``)
before attempt ``k + 1``, and starts none that could end past ``total_timeout`` seconds from the
first (an attempt waits at most ``timeout`` seconds for a request: the filesystem's client gives
up on it then, see ``zephon.sources.locations``). When it stops it raises ``FetchError`` naming
what it was doing, the attempts, the time waited, the deadline, and the last error. While it
runs, the operation is registered in ``zephon.sources.storage_waits``, so a lane's supervision
can name it.

``parallel_map`` runs at most ``threads`` calls at a time on threads it joins before returning
(named ``zephon-io-*``), so it leaves nothing running behind it, even when a call fails; once a
call has failed, no call that has not started yet is started.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from zephon.errors import FetchError
from zephon.sources.storage_waits import owner, run_for, waiting_on_storage

__all__ = ["RetryPolicy", "is_transient", "parallel_map", "with_retries"]

T = TypeVar("T")
R = TypeVar("R")

#: Fragments of the messages pyarrow's cloud filesystems (AWS SDK, curl) and fsspec clients give
#: for failures that another attempt may not meet.
_TRANSIENT_MARKERS = (
    "HTTP status 5",
    "HTTP response code 5",
    "HTTP status 429",  # Too Many Requests: how S3-compatible stores (MinIO, Ceph, R2) throttle
    "HTTP response code 429",
    "TooManyRequests",
    "Too Many Requests",
    "SLOW_DOWN",
    "SlowDown",
    "SERVICE_UNAVAILABLE",
    "ServiceUnavailable",
    "INTERNAL_FAILURE",
    "InternalError",
    "THROTTLING",
    "REQUEST_TIMEOUT",
    "NETWORK_CONNECTION",
    "curlCode: 7,",
    "curlCode: 28,",
    "curlCode: 52,",
    "curlCode: 55,",
    "curlCode: 56,",
    "Connection reset",
    "Connection refused",
    "timed out",
    "Timeout",
)
_TRANSIENT_ERRNOS = frozenset(
    {errno.ECONNRESET, errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EPIPE, errno.ECONNABORTED}
)


def is_transient(exc: BaseException) -> bool:
    """True for a storage error another attempt may not meet (see the module docstring)."""
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if not isinstance(exc, OSError):
        return False
    if exc.errno in _TRANSIENT_ERRNOS:
        return True
    text = str(exc)
    return any(marker in text for marker in _TRANSIENT_MARKERS)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a remote operation is attempted: ``timeout`` seconds at most
    for one request, ``total_timeout`` for every attempt of an operation together."""

    attempts: int = 4
    backoff: float = 0.05
    max_sleep: float = 2.0
    timeout: float = 60.0
    total_timeout: float = 180.0

    def sleeps(self) -> list[float]:
        """The pause before each attempt after the first."""
        return [min(self.max_sleep, self.backoff * 4**k) for k in range(self.attempts - 1)]

    def deadline(self) -> str:
        """The deadline as messages state it."""
        return f"{self.timeout:g} s a request, {self.total_timeout:g} s in all"


def with_retries(fn: Callable[[], R], what: Callable[[], str], policy: RetryPolicy) -> R:
    """``fn()``, attempted again after a transient error (see ``is_transient``) with backoff
    while another attempt can end within ``policy.total_timeout``; FetchError ``"{what()}: gave
    up after N attempts in S s (...)"`` when it stops. Any other exception passes through at
    once."""
    sleeps = policy.sleeps()
    began = time.monotonic()
    with waiting_on_storage(what, policy.deadline()):
        for attempt in range(policy.attempts):
            try:
                return fn()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                waited = time.monotonic() - began
                if (
                    attempt == policy.attempts - 1
                    or waited + sleeps[attempt] + policy.timeout > policy.total_timeout
                ):
                    raise _gave_up(what(), attempt + 1, waited, policy, exc) from exc
                time.sleep(sleeps[attempt])
    raise AssertionError("unreachable: the loop returns or raises")


def _gave_up(
    what: str, attempts: int, waited: float, policy: RetryPolicy, exc: Exception
) -> FetchError:
    return FetchError(
        f"{what}: gave up after {attempts} attempt{'s' if attempts > 1 else ''} in "
        f"{waited:.1f} s (storage deadline: {policy.deadline()}): {type(exc).__name__}: {exc}. "
        "Check that the storage endpoint answers; for a slow one, raise the source's "
        "timeout= or total_timeout="
    )


def parallel_map(fn: Callable[[T], R], items: Sequence[T], threads: int) -> list[R]:
    """``[fn(x) for x in items]``, at most ``threads`` at a time, in order. Once a call fails,
    calls not started yet are not started; the first failure (in ``items`` order) is raised
    after every started call has finished. Operations the calls start count as the caller's
    (``zephon.sources.storage_waits``)."""
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    who = owner()
    failed = threading.Event()

    def call(x: T) -> R | None:
        if failed.is_set():  # checked by the pool thread itself, before it takes on more work
            return None
        try:
            return run_for(who, fn, x)
        except BaseException:
            failed.set()
            raise

    with ThreadPoolExecutor(
        max_workers=min(threads, len(items)), thread_name_prefix="zephon-io"
    ) as pool:
        futures = [pool.submit(call, x) for x in items]
    error = next((f.exception() for f in futures if f.exception() is not None), None)
    if error is not None:
        raise error
    results: list[Any] = [f.result() for f in futures]  # none skipped, as none failed
    return results
