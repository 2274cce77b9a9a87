"""Talking to storage that is not a local disk: which errors are worth another attempt, the
retry loop with backoff, and a bounded parallel map for metadata and read-ahead.

A transient error is an ``OSError`` whose message pyarrow's S3/GCS clients (or fsspec) give for
a server error (HTTP 5xx, throttling), a reset or refused connection, or a timeout. Every other
error is permanent. ``with_retries`` makes at most ``RetryPolicy.attempts`` attempts, sleeping
``backoff * 4**k`` seconds (capped at ``max_sleep``) before attempt ``k + 1``; when the budget is
spent it raises ``FetchError`` naming what it was doing, and the last error.

``parallel_map`` runs at most ``threads`` calls at a time on threads it joins before returning
(named ``zephon-io-*``), so it leaves nothing running behind it, even when a call fails.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from zephon.errors import FetchError

__all__ = ["RetryPolicy", "is_transient", "parallel_map", "with_retries"]

T = TypeVar("T")
R = TypeVar("R")

#: Fragments of the messages pyarrow's cloud filesystems (AWS SDK, curl) and fsspec clients give
#: for failures that another attempt may not meet.
_TRANSIENT_MARKERS = (
    "HTTP status 5",
    "HTTP response code 5",
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
    """How often and how patiently a remote read is attempted again."""

    attempts: int = 4
    backoff: float = 0.05
    max_sleep: float = 2.0

    def sleeps(self) -> list[float]:
        """The pause before each attempt after the first."""
        return [min(self.max_sleep, self.backoff * 4**k) for k in range(self.attempts - 1)]


def with_retries(fn: Callable[[], R], what: Callable[[], str], policy: RetryPolicy) -> R:
    """``fn()``, attempted again after a transient error (see ``is_transient``) with backoff;
    FetchError ``"{what()}: gave up after N attempts: ..."`` when every attempt failed. Any other
    exception passes through at once."""
    sleeps = policy.sleeps()
    for attempt in range(policy.attempts):
        try:
            return fn()
        except Exception as exc:
            if not is_transient(exc):
                raise
            if attempt == policy.attempts - 1:
                raise FetchError(
                    f"{what()}: gave up after {policy.attempts} attempts: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            time.sleep(sleeps[attempt])
    raise AssertionError("unreachable: the loop returns or raises")


def parallel_map(fn: Callable[[T], R], items: Sequence[T], threads: int) -> list[R]:
    """``[fn(x) for x in items]``, at most ``threads`` at a time, in order; the first failure
    (in ``items`` order) is raised after every started call has finished."""
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(
        max_workers=min(threads, len(items)), thread_name_prefix="zephon-io"
    ) as pool:
        futures = [pool.submit(fn, x) for x in items]
        results: list[Any] = []
        error: BaseException | None = None
        for future in futures:
            try:
                results.append(future.result())
            except BaseException as exc:  # every call is waited for before anything is raised
                if error is None:
                    error = exc
        if error is not None:
            for future in futures:
                future.cancel()
            raise error
    return results
