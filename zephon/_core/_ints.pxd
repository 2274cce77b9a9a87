# The one integer check of the compiled core: an argument that must be an int, as Python's
# ``zephon.validation.check_int`` does it for the rest of Zephon.
from cpython.number cimport PyNumber_Index


cdef inline object checked_int(object value, str owner, str name, object low, object high):
    """``value`` as a Python int in ``[low, high]`` (None: unbounded on that side). A bool or a
    float is refused like anything without ``__index__``: TypeError; out of range: ValueError;
    both name ``owner`` and ``name``."""
    if isinstance(value, (bool, float)):
        raise TypeError(f"{owner} {name} must be an int, got {value!r}")
    try:
        v = PyNumber_Index(value)
    except TypeError:
        raise TypeError(f"{owner} {name} must be an int, got {type(value).__name__}") from None
    if low is not None and v < low:
        raise ValueError(f"{owner} {name} must be >= {low}, got {v}")
    if high is not None and v > high:
        raise ValueError(f"{owner} {name} must be <= {high}, got {v}")
    return v
