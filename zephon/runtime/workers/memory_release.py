"""Handing memory the process freed back to the operating system.

C allocators keep freed memory for reuse: glibc's ``malloc`` holds on to free pages between live
allocations of its heap, and Arrow's memory pool to whole segments. A worker process that
tokenized a chunk of documents can sit on tens of MiB it will not need again before its working
set grows back. ``give_back`` returns such memory in processes Zephon owns, where the allocator's
locks are not shared with a training loop: a worker process as its lane starts a chunk and
whenever its memory has grown far beyond what it held after the last give-back, and the loader's
process once, when a head start is over.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from typing import Any

_trim: Any = None  # glibc's malloc_trim, looked up on first use; False where there is none
_last = float("-inf")  # when ``give_back_at_most_every`` last gave back (monotonic seconds)
_held_after: int | None = None  # ``private_resident_bytes()`` right after the last give-back
# What ``give_back_once_grown`` found at its last two calls: a worker calls it after each item
# list, and a list that only announces a chunk (right after the chunk's give-back) holds little.
_recently: collections.deque[int] = collections.deque(maxlen=2)
# Several lanes of a worker process check their growth on threads of their own: one at a time.
_checking = threading.Lock()
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _malloc_trim() -> Any:
    global _trim
    if _trim is None:
        _trim = False
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                trim = ctypes.CDLL(None).malloc_trim
            except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
                pass
            else:
                trim.argtypes = [ctypes.c_size_t]
                trim.restype = ctypes.c_int
                _trim = trim
    return _trim


def private_resident_bytes() -> int | None:
    """This process's resident memory that is its own (not file-backed or shared: heap, Arrow's
    pool, thread stacks); None where ``/proc`` does not say."""
    try:
        with open("/proc/self/statm", "rb") as f:
            _, resident, shared, *_ = f.read().split()
    except (OSError, ValueError):
        return None
    return (int(resident) - int(shared)) * _PAGE


def give_back() -> None:
    """Return free heap pages (glibc), Arrow's unused pool memory and the packers' spare arenas
    to the operating system."""
    global _held_after
    trim = _malloc_trim()
    if trim:
        trim(0)
    arrow = sys.modules.get("pyarrow")
    if arrow is not None:
        arrow.default_memory_pool().release_unused()
    packfill = sys.modules.get("zephon._core.packfill")
    if packfill is not None:  # the packers' spare arenas, kept warm for the next ones
        packfill.release_warm_arenas()
    _held_after = private_resident_bytes()


def give_back_once_grown(limit: int) -> None:
    """``give_back`` once this process holds ``limit`` bytes more than right after it last gave
    back (or than at its first call), and more than at each of its two calls before. What an
    unusually large piece of work took (one huge document's tokenization) goes back soon after;
    what the usual work takes again and again stays mapped, as handing it back would cost a page
    fault per page each time it is touched again (measured from the last give-back alone, every
    item list of decoded images after a chunk's give-back would pay for its pixels' pages
    twice)."""
    global _held_after
    held = private_resident_bytes()
    if held is None:
        return
    with _checking:
        grown = all(held - seen >= limit for seen in _recently)
        _recently.append(held)
        if _held_after is None:
            _held_after = held
        elif held - _held_after >= limit and grown:
            give_back()


def give_back_at_most_every(seconds: float) -> None:
    """``give_back``, unless this process did within the last ``seconds``: a trim walks the
    whole heap, so small chunks each giving back would spend more time there than reading."""
    global _last
    now = time.monotonic()
    if now - _last >= seconds:
        _last = now
        give_back()
