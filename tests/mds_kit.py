"""Mosaic's own MDS writer, loaded without the ``streaming`` package's ``__init__`` (which imports
torchvision): stub package modules for ``streaming`` and ``streaming.base`` whose ``__path__`` is
the installed package, so only the writer's own imports run."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any


def mds_writer() -> Any:
    """``streaming.base.format.mds.writer.MDSWriter`` of the installed streaming-community."""
    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        assert spec is not None and spec.submodule_search_locations, "streaming-community missing"
        (base,) = spec.submodule_search_locations
        for name, where in (("streaming", base), ("streaming.base", f"{base}/base")):
            stub = types.ModuleType(name)
            stub.__path__ = [where]
            sys.modules[name] = stub
    return importlib.import_module("streaming.base.format.mds.writer").MDSWriter
