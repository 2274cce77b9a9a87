"""Handing memory the process freed back to the operating system.

C allocators keep freed memory for reuse: glibc's ``malloc`` holds on to free pages between live
allocations of its heap, and Arrow's memory pool to whole segments. A worker process that
tokenized a chunk of documents can sit on tens of MiB it will not need again before its working
set grows back. ``give_back`` returns such memory in processes Zephon owns, where the allocator's
locks are not shared with a training loop: a worker process as its lane starts a chunk, and the
loader's process once, when a head start is over.
"""

from __future__ import annotations

import sys
import time
from typing import Any

_trim: Any = None  # glibc's malloc_trim, looked up on first use; False where there is none
_last = float("-inf")  # when ``give_back_at_most_every`` last gave back (monotonic seconds)


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


def give_back() -> None:
    """Return free heap pages (glibc) and Arrow's unused pool memory to the operating system."""
    trim = _malloc_trim()
    if trim:
        trim(0)
    arrow = sys.modules.get("pyarrow")
    if arrow is not None:
        arrow.default_memory_pool().release_unused()


def give_back_at_most_every(seconds: float) -> None:
    """``give_back``, unless this process did within the last ``seconds``: a trim walks the
    whole heap, so small chunks each giving back would spend more time there than reading."""
    global _last
    now = time.monotonic()
    if now - _last >= seconds:
        _last = now
        give_back()
