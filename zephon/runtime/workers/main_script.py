"""Whether a worker process runs the training script again as it starts.

``multiprocessing`` starts a worker (fork server or spawn) by importing the parent's main script
again, as ``__mp_main__``, so that functions and classes defined there can be unpickled in it.
That costs every worker the script's top-level imports (``import torch`` alone takes seconds)
and re-runs whatever else the script does at module level. A worker needs the script only when
the plan refers to something defined in it; otherwise the script is left out of its start.
"""

from __future__ import annotations

import io
import pickle
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import spawn
from typing import Any

_MAIN_MODULES = ("__main__", "__mp_main__")
_MAIN_KEYS = ("init_main_from_path", "init_main_from_name")


class _PlanPickler(pickle.Pickler):
    """A pickler that notes whether what it pickles refers to the main script by name."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=5)
        self.refers_to_main = False

    def reducer_override(self, obj: Any) -> Any:
        # Classes and functions are pickled by module and name; instances through their class.
        by_name = isinstance(obj, (type, types.FunctionType))
        if by_name and getattr(obj, "__module__", None) in _MAIN_MODULES:
            self.refers_to_main = True
        return NotImplemented


def pickle_plan(plan: Any) -> tuple[bytes, bool]:
    """``plan`` pickled (protocol 5), and whether unpickling it needs the main script."""
    out = io.BytesIO()
    pickler = _PlanPickler(out)
    pickler.dump(plan)
    return out.getvalue(), pickler.refers_to_main


_starting = threading.local()  # set on the thread starting a worker that does without the script
_install_lock = threading.Lock()
_original_preparation: Any = None


def _preparation_data(name: str) -> dict[str, Any]:
    data = _original_preparation(name)
    if getattr(_starting, "without_main", False):
        for key in _MAIN_KEYS:
            data.pop(key, None)
    return data


@contextmanager
def main_script_left_out(leave_out: bool = True) -> Iterator[None]:
    """Within this block, a worker process started by this thread does not import the main
    script (its ``sys.path``, working directory and everything else it inherits stay)."""
    global _original_preparation
    if not leave_out:
        yield
        return
    with _install_lock:
        # Both the fork server's and spawn's start read the data through this module attribute;
        # the wrapper changes nothing for any other thread or any other process start.
        if _original_preparation is None:
            _original_preparation = spawn.get_preparation_data
            spawn.get_preparation_data = _preparation_data
    _starting.without_main = True
    try:
        yield
    finally:
        _starting.without_main = False
