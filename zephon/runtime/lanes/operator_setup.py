"""Operators' ``setup`` and ``teardown``, once per worker.

A worker sets up copies of the plan's operators once; every operator a lane of that worker
makes afterwards (a fresh chain per run, a copy to re-run a record) is a deep copy of the set-up
one that shares, by reference, every attribute ``setup`` set. So a model loaded in ``setup`` is
loaded once per worker, shared by its lanes, and never pickled with the plan: the plan's own
operators are never set up. Worker processes set up in ``worker_process``; inline and thread
lanes share one setup per loader in the training process (``in_process_setup``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from zephon.errors import OperatorError
from zephon.ops.base import Operator, OperatorContext
from zephon.plan import Plan

_log = logging.getLogger("zephon")


class OperatorSetup:
    """The set-up copies of one plan's chain (``plan.chain``) in one worker, and how lanes copy
    them."""

    def __init__(self, chain: Sequence[Operator], ctx: OperatorContext):
        where = f"{ctx.worker} lanes {list(ctx.lanes)}"
        self._ops = [lane_copy(op, op.name, where) for op in chain]
        self._shared: dict[int, Any] = {}  # id -> object: what setup set, shared by copies
        # Lane worker threads using the operators now, and whether they are to be torn down
        # once the last of them leaves (``release``).
        self._users = 0
        self._released = False
        self._users_lock = threading.Lock()
        done: list[Operator] = []
        self._finalizer = weakref.finalize(self, _tear_down, done)
        for op in self._ops:
            if not op.has_setup:
                continue
            before = dict(vars(op))
            try:
                op.setup(ctx)
            except Exception as exc:
                self.teardown()
                raise OperatorError(
                    f"setup of operator {op.name!r} failed on {ctx.worker} lanes "
                    f"{list(ctx.lanes)}: {type(exc).__name__}: {exc}",
                    operator=op.name,
                ) from exc
            done.append(op)
            for name, value in vars(op).items():
                if before.get(name, _MISSING) is not value:
                    self._shared[id(value)] = value

    def fresh(self, index: int) -> Operator:
        """A copy of chain operator ``index`` as set up, for a lane's new run."""
        return self.copy(self._ops[index])

    def copy(self, op: Operator) -> Operator:
        """A deep copy of ``op`` sharing what setup set (the memo maps each to itself)."""
        try:
            return copy.deepcopy(op, dict(self._shared))
        except Exception as exc:
            raise OperatorError(
                f"operator {op.name!r} cannot be copied for a lane after its setup: "
                f"{type(exc).__name__}: {exc}. A lane shares what setup assigned to an attribute "
                "of the operator (self.model = ...) and copies the rest: assign what setup "
                "loads (self.models = {...}) rather than putting it into an attribute made "
                "before (self.models[key] = ...)",
                operator=op.name,
            ) from exc

    def teardown(self) -> None:
        """Tear the set-up operators down, once (later calls do nothing)."""
        self._finalizer()

    @contextlib.contextmanager
    def used(self) -> Iterator[None]:
        """A lane's worker thread uses the operators inside this block: ``release`` leaves
        their teardown to it until it leaves (a thread busy inside an operator outlives the
        loader's ``close()``)."""
        with self._users_lock:
            self._users += 1
        try:
            yield
        finally:
            with self._users_lock:
                self._users -= 1
                last = self._released and not self._users
            if last:
                self.teardown()

    def release(self) -> None:
        """Tear down now, or as the last worker thread still using the operators leaves."""
        with self._users_lock:
            self._released = True
            idle = not self._users
        if idle:
            self.teardown()


_MISSING = object()


def lane_copy(op: Operator, label: str, where: str) -> Operator:
    """A deep copy of ``op`` for ``where`` (the lanes it is for); an ``OperatorError`` naming
    the operator and the attribute that cannot be copied when it cannot be."""
    try:
        return copy.deepcopy(op)
    except Exception as exc:
        attrs = getattr(op, "__dict__", {})
        part = next((f", in its attribute {k}" for k, v in attrs.items() if _uncopyable(v)), "")
        raise OperatorError(
            f"operator {label!r} cannot be copied for {where}{part} ({type(exc).__name__}: "
            f"{exc}): each lane runs its own copy of every operator (copy.deepcopy). Make locks, "
            "files, connections and generators in start_epoch or on first use rather than in "
            "__init__, and load what the lanes may share in setup()",
            operator=label,
        ) from exc


def _uncopyable(value: Any) -> bool:
    """Whether ``copy.deepcopy(value)`` fails."""
    try:
        copy.deepcopy(value)
    except Exception:
        return True
    return False


def _tear_down(done: list[Operator]) -> None:
    for op in reversed(done):
        try:
            op.teardown()
        except Exception as exc:  # the lanes are stopping anyway: say so, and go on
            _log.warning("teardown of operator %r failed: %s: %s", op.name, type(exc).__name__, exc)
    done.clear()


# Reentrant: a garbage collection during a setup made under it (a model's load allocates) may
# free another loader's plan, whose finalizer takes it again in the same thread to tear down.
_lock = threading.RLock()
_in_process: dict[int, OperatorSetup] = {}  # by id(plan): one per loader


def in_process_setup(plan: Plan, worker: str) -> OperatorSetup | None:
    """The setup inline and thread lanes of ``plan`` share in the training process (made on
    first use, torn down by ``release_in_process``, or when the plan is collected); None when
    no operator of the plan has one."""
    if not plan.sets_up:
        return None
    key = id(plan)
    with _lock:
        setup = _in_process.get(key)
        if setup is None:
            ctx = OperatorContext(
                worker, tuple(plan.rank_lanes), plan.rank, plan.world_size, os.getpid()
            )
            setup = OperatorSetup(plan.chain, ctx)
            _in_process[key] = setup
            weakref.finalize(plan, release_in_process_id, key)
        return setup


def release_in_process(plan: Plan) -> None:
    """Tear down the training process's setup of ``plan``, if it has one (once the lane worker
    threads still inside its operators have left them)."""
    release_in_process_id(id(plan))


def release_in_process_id(key: int) -> None:
    with _lock:
        setup = _in_process.pop(key, None)
    if setup is not None:
        setup.release()


def used(setup: OperatorSetup | None) -> contextlib.AbstractContextManager[None]:
    """``setup.used()``, or nothing to do without a setup."""
    return setup.used() if setup is not None else contextlib.nullcontext()
