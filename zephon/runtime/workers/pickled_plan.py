"""What every worker process of one start receives: the plan pickled once (or an error naming
what cannot be pickled), the modules its fork server preloads and its thread budget."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from collections.abc import Callable
from typing import Any

from zephon.errors import PlanError
from zephon.plan import Plan
from zephon.runtime.workers.fork_server import plan_modules
from zephon.runtime.workers.main_script import pickle_plan
from zephon.runtime.workers.pipe_messages import pickle_error, unpicklable_part
from zephon.runtime.workers.process_group import ProcessGroup
from zephon.runtime.workers.process_main import EXIT_MAIN_REIMPORTED
from zephon.runtime.workers.stopping import WORKER_NAME
from zephon.runtime.workers.thread_budget import worker_environment


def unguarded_main() -> str:
    """Why a worker process could not start: the main script, imported again in it, started the
    pipeline once more."""
    script = getattr(sys.modules.get("__main__"), "__file__", None) or "the main script"
    return (
        f"workers='process' starts each worker process by importing {script} again, and its "
        "module-level code started the pipeline once more. Put the code that runs the pipeline "
        'under `if __name__ == "__main__":` (for example in a main() called from there)'
    )


def _refuse_unguarded_main() -> None:
    """Fail at once in a process that is re-running the main script as it starts as a worker."""
    me = mp.current_process()
    if not getattr(me, "_inheriting", False):  # multiprocessing's own "still bootstrapping" flag
        return
    if me.name.startswith(WORKER_NAME):
        os._exit(EXIT_MAIN_REIMPORTED)  # our lane reports it in the loader, once
    raise PlanError(unguarded_main())  # some other library's worker re-ran the script


def _refuse_daemonic_process() -> None:
    """Fail before any read in a daemonic process (a torch DataLoader worker, a
    ``multiprocessing.Pool`` worker), which multiprocessing forbids to start processes."""
    me = mp.current_process()
    if not me.daemon:
        return
    raise PlanError(
        f"workers='process' cannot start worker processes from {me.name}, a daemonic process "
        "(a torch DataLoader worker or a multiprocessing.Pool worker) that multiprocessing "
        "forbids to start processes of its own: give the DataLoader num_workers=0 (the lanes "
        "already parallelize), or use workers='thread' inside such a process"
    )


def unpicklable_culprit(
    plan: Plan, exc: Exception, dumps: Callable[[Any], Any] | None = None
) -> tuple[str, Exception]:
    """What of ``plan`` cannot be pickled (by ``dumps``: ``pickle`` unless given), as the
    message names it (``operator 'x' (#1), in its attribute fn.guard,``), and why; ``("it",
    exc)`` when no single part is to blame."""
    ops = [plan.fetch, *plan.chain, *((plan.batcher,) if plan.batcher else ())]
    parts: list[tuple[str, Any]] = [(f"the source ({type(plan.source).__name__})", plan.source)]
    parts += [(f"operator {op.name!r} (#{i})", op) for i, op in enumerate(ops)]
    for label, part in parts:
        error = pickle_error(part, dumps)
        if error is None:
            continue
        found = unpicklable_part(part, dumps=dumps)
        if found is not None:
            return f"{label}, in its attribute {found[0].lstrip('.')},", found[1]
        return label, error
    return "it", exc


def _unpicklable_message(plan: Plan, exc: Exception) -> str:
    what, exc = unpicklable_culprit(plan, exc)
    return (
        f"workers='process' needs a picklable pipeline, but {what} cannot be pickled "
        f"({type(exc).__name__}: {exc}): define operators and the callables they hold at module "
        "level instead of lambdas, closures or local classes, and open locks, files and "
        "connections in start_epoch or on first use rather than in __init__"
    )


class PlanParcel:
    """What every worker process of one ``open_lanes`` call receives: the plan pickled once
    (and whether unpickling it needs the main script), the modules its fork server preloads and
    the environment that sizes the workers' thread pools."""

    def __init__(self, plan: Plan):
        _refuse_unguarded_main()
        _refuse_daemonic_process()
        try:
            self.plan_bytes, self.needs_main = pickle_plan(plan)
        except Exception as exc:
            raise PlanError(_unpicklable_message(plan, exc)) from None
        self.preload = plan_modules(plan)
        self.environment = worker_environment(plan.processes)
        self.group = ProcessGroup(min(plan.processes, len(plan.rank_lanes)), self.environment)
