"""Remote operations in progress, so that whoever supervises a thread can say it is waiting on
storage (which URI, which operation, for how long) rather than blame an operator.

``with_retries`` registers each remote operation for its whole life, retries included, under
its *owner*: the thread that started it, or for a call ``parallel_map`` runs on a pool thread,
the thread that called ``parallel_map``. ``longest_wait(owner)`` is what a lane's supervision
asks when the lane has produced nothing for too long.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["StorageWait", "longest_wait", "owner", "run_for", "waiting_on_storage"]

R = TypeVar("R")


@dataclass(frozen=True)
class StorageWait:
    """One remote operation in progress: what it is (it names the URI), for how long it had
    been waited on when asked, and the deadline it runs under."""

    what: str
    waited: float
    deadline: str
    token: int  # tells one operation from the next of the same text


_lock = threading.Lock()
_waits: dict[int, tuple[int, Callable[[], str], float, str]] = {}  # token -> owner, what, began
_tokens = itertools.count()
_local = threading.local()


def owner() -> int:
    """Who the calling thread works for: the thread ``run_for`` says, else itself."""
    who: int | None = getattr(_local, "owner", None)
    return threading.get_ident() if who is None else who


def run_for(who: int, fn: Callable[[Any], R], item: Any) -> R:
    """``fn(item)`` with the operations it starts counted as ``who``'s (a pool thread's call)."""
    _local.owner = who
    try:
        return fn(item)
    finally:
        _local.owner = None


@contextlib.contextmanager
def waiting_on_storage(what: Callable[[], str], deadline: str) -> Iterator[None]:
    """Register a remote operation for the time of the ``with`` block. ``what()`` is formatted
    only when someone asks, so registering costs no formatting."""
    token = next(_tokens)
    entry = (owner(), what, time.monotonic(), deadline)
    with _lock:
        _waits[token] = entry
    try:
        yield
    finally:
        with _lock:
            del _waits[token]


def longest_wait(who: int | None) -> StorageWait | None:
    """The operation of ``who`` (None: of anyone) in progress for the longest, or None."""
    with _lock:
        found = [
            (began, token, what, deadline)
            for token, (by, what, began, deadline) in _waits.items()
            if who is None or by == who
        ]
    if not found:
        return None
    began, token, what, deadline = min(found, key=lambda entry: entry[0])
    try:
        text = what()
    except Exception:  # a description that cannot be made must not hide the wait itself
        text = "a remote operation"
    return StorageWait(text, time.monotonic() - began, deadline, token)
