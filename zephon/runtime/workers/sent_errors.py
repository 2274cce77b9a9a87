"""An error a worker sends to the loader (through a pipe, or Ray's object store): the error
itself when the loader can make it again from its pickle, else a ``ZephonError`` with its class,
text and place (a class whose ``__init__`` takes more than its message pickles, but does not
unpickle, and would fail in the loader naming neither itself nor the lane)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zephon.errors import ZephonError


def sendable(exc: BaseException, round_trip: Callable[[BaseException], Any]) -> BaseException:
    """``exc`` when ``round_trip(exc)`` (a dump and load, as the loader will load it) succeeds,
    else a ``ZephonError`` saying what it was."""
    try:
        round_trip(exc)
    except Exception as why:
        placed = isinstance(exc, ZephonError)  # its text without its place, which follows
        text = Exception.__str__(exc) if placed else str(exc)
        error = ZephonError(f"{type(exc).__name__}: {text} (unpicklable: {why})")
        if placed:
            error.add_context(**exc.__dict__.get("context", {}))
        return error
    return exc
