"""Argument checks shared by every part of Zephon: one wording and one exception type per kind of
mistake, so a wrong argument reads the same whichever constructor refused it.

A value of the wrong type raises ``TypeError``; a value of the right type outside its range raises
``ValueError`` (a caller that answers with one error class of its own, such as ``Pipeline`` with
``PlanError``, passes it as ``error``). Every message starts with the owner (the class or
function that took the argument) and names the parameter, e.g.
``"RangeSource: n must be an int, got 'x'"`` or ``"JsonlSource: chunk_size must be >= 1, got 0"``.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

__all__ = ["check_bool", "check_int", "check_seconds"]


def check_int(
    value: Any,
    what: str,
    owner: object,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    error: type[Exception] | None = None,
) -> int:
    """``value`` as a Python int within ``[minimum, maximum]`` (either bound optional).

    Anything with ``__index__`` counts as an int (numpy integers too) except booleans, which are
    refused so that ``passes=True`` is not silently ``1``. TypeError when ``value`` is not an int,
    ValueError when it is out of range; both name ``owner`` and ``what``. ``owner`` is a name, or
    an object whose ``str()`` is one: it is formatted only when the check fails. ``error``, when
    given, is raised instead of either.
    """
    if isinstance(value, (bool, np.bool_)):
        raise (error or TypeError)(f"{owner}: {what} must be an int, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise (error or TypeError)(f"{owner}: {what} must be an int, got {value!r}") from None
    if minimum is not None and v < minimum:
        raise (error or ValueError)(f"{owner}: {what} must be >= {minimum}, got {v}")
    if maximum is not None and v > maximum:
        raise (error or ValueError)(f"{owner}: {what} must be <= {maximum}, got {v}")
    return v


def check_bool(
    value: Any, what: str, owner: object, *, error: type[Exception] | None = None
) -> bool:
    """``value`` as a Python bool (``numpy.bool_`` accepted); TypeError (or ``error``) naming
    ``owner`` and ``what`` for anything else, including the ints 0 and 1."""
    if not isinstance(value, (bool, np.bool_)):
        raise (error or TypeError)(f"{owner}: {what} must be a bool, got {value!r}")
    return bool(value)


def check_seconds(
    value: Any, what: str, owner: object, *, error: type[Exception] | None = None
) -> float:
    """``value`` as a float number of seconds, finite and > 0; TypeError (a bool or anything
    that is not a real number) or ValueError (or ``error`` for both) naming ``owner`` and
    ``what``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise (error or TypeError)(f"{owner}: {what} must be a number of seconds, got {value!r}")
    seconds = float(value)
    if not 0 < seconds < math.inf:
        raise (error or ValueError)(
            f"{owner}: {what} must be a finite number of seconds > 0, got {value!r}"
        )
    return seconds
