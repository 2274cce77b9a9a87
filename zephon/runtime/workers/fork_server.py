"""The fork server that starts worker processes, and what it imports before it forks any.

With ``forkserver``, starting a worker is safe when the loader's process has threads, and fast:
the server has imported ``zephon`` and the modules the plan needs once, before the first fork.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import sysconfig
import types
from collections.abc import Iterable
from typing import Any

from zephon.plan import Plan
from zephon.runtime.workers.main_script import main_script_left_out

_server_started = False  # this process started its fork server (it lives as long as we do)


def _has_fork_server() -> bool:
    return sys.platform != "win32" and "forkserver" in mp.get_all_start_methods()


def worker_context(preload: list[str] | None = None) -> Any:
    """The ``multiprocessing`` context to start a worker process with: the fork server where the
    platform has one (its first worker starts it, having imported ``zephon`` and ``preload``;
    the list only counts until then), else spawn."""
    global _server_started
    if _has_fork_server():
        _server_started = True
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["zephon", *(preload or [])])
        return ctx
    return mp.get_context("spawn")


def fork_server_cold() -> bool:
    """Whether this process has not started its fork server yet, on a platform that has one."""
    return not _server_started and _has_fork_server()


def _nothing() -> None:
    pass


def start_fork_server(preload: list[str]) -> None:
    """Start this process's fork server unless it runs, and return once it forks processes: it
    has imported ``preload`` (what the workers need). Nothing else tells when it is ready, so a
    process that does nothing is started (which starts the server) and joined."""
    probe = worker_context(preload).Process(target=_nothing, name="zephon-fork-server-probe")
    with main_script_left_out():  # the probe runs nothing of the training script
        probe.start()
    probe.join()


_WALK_DEPTH = 3  # source/operator -> its attributes -> theirs: where tokenizers and readers sit
_WALK_ITEMS = 8  # items looked at per list, tuple or dict (they are usually alike)


def plan_modules(plan: Plan) -> list[str]:
    """The modules whose classes and functions the plan's source and operators hold (a bounded
    walk of their attributes), and those their classes list in ``worker_modules``: what the fork
    server imports once instead of every worker."""
    found: set[str] = set()
    seen: set[int] = set()  # object identities, only to avoid walking an object twice

    def walk(obj: Any, depth: int) -> None:
        if id(obj) in seen or obj is None or type(obj) in _LEAVES:
            return
        seen.add(id(obj))
        owner = (
            obj
            if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType))
            else type(obj)
        )
        found.add(getattr(owner, "__module__", None) or "builtins")
        # A class that imports what it needs lazily (pyarrow for Arrow files) names it here.
        found.update(getattr(owner, "worker_modules", ()))
        if depth == 0:
            return
        if isinstance(obj, (list, tuple)):
            parts: Iterable[Any] = obj[:_WALK_ITEMS]
        elif isinstance(obj, dict):
            parts = list(obj.values())[:_WALK_ITEMS]
        elif isinstance(obj, types.FunctionType):
            parts = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
        else:
            parts = list(getattr(obj, "__dict__", {}).values())
        for part in parts:
            walk(part, depth - 1)

    for top in (plan.source, plan.fetch, *plan.chain, plan.batcher):
        walk(top, _WALK_DEPTH)
    return sorted(m for m in found if m != "zephon" and _installed(m))


_LEAVES = (int, float, bool, str, bytes, bytearray, complex)


def _installed(module: str) -> bool:
    """Whether ``module`` belongs to zephon, the standard library or an installed package
    (imported here already). Your own modules are left to the workers: the fork server would
    run their top-level code before any worker exists, and an error there would stop it."""
    top = module.split(".")[0]
    if top == "zephon":
        return True
    loaded = sys.modules.get(top)
    path = getattr(loaded, "__file__", None)
    if loaded is None or top in ("__main__", "__mp_main__"):
        return False
    if path is None:  # compiled into the interpreter (sys, _thread, ...): nothing to import
        return False
    where = os.path.realpath(path)
    return any(where.startswith(root + os.sep) for root in _library_roots())


def _library_roots() -> list[str]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.update(p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages"))
    return [os.path.realpath(r) for r in roots]


def _filled(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True
