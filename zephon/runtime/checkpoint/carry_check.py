"""A checkpoint's carry states, tried on copies of the operators before a lane starts.

``restore_carry`` runs on a lane's fresh operators (in a worker, for process lanes), long after
the state was loaded; an edited carry state would fail there with whatever the operator raises.
Restoring each one into a scratch copy of its operator while the state is checked turns that into
``CheckpointCorruptError`` naming the field, the operator and what it said. An operator with a
``setup`` is left to its lane: only a set-up copy (in its worker) is the operator that restores.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from zephon.errors import CheckpointCorruptError, ZephonError
from zephon.ops.base import Operator


def check_carries(lane_state: dict[str, Any], where: str, ops: Sequence[Operator]) -> None:
    """Every carry state of a checked lane state (its own window's and each pending run's)
    restores into a copy of its operator, and none is missing; ``CheckpointCorruptError`` for
    one that does not, or is."""
    windows = [(lane_state["carry"], f"{where}.carry")]
    windows += [
        (run["carry"], f"{where}.pending[{i}].carry") for i, run in enumerate(lane_state["pending"])
    ]
    for carry, at in windows:
        for i, state in enumerate(carry or ()):
            if ops[i].has_setup:
                continue
            if state is not None:
                _try_restore(ops[i], state, f"{at}[{i}]")
            elif _carries_from_the_start(ops[i]):
                raise CheckpointCorruptError(
                    f"loader state field {at}[{i}] must be the carry state of operator "
                    f"{ops[i].name!r}, which has one from its first epoch on: the checkpoint was "
                    "edited or damaged"
                )


def _carries_from_the_start(op: Operator) -> bool:
    """Whether a fresh copy of ``op`` already has a carry state: such an operator has one at
    every epoch marker after it (``ensure_mixture``'s totals)."""
    if type(op).carry_state is Operator.carry_state:
        return False
    return copy.deepcopy(op).carry_state() is not None


def _try_restore(op: Operator, state: dict[str, Any], where: str) -> None:
    if type(op).carry_state is Operator.carry_state:  # which always says None
        raise CheckpointCorruptError(
            f"loader state field {where} must be null: operator {op.name!r} carries no state"
        )
    if type(op).restore_carry is Operator.restore_carry:
        return  # the default ignores whatever it is given
    try:
        copy.deepcopy(op).restore_carry(state)
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(f"loader state field {where}: {exc}") from None
    except ZephonError:
        raise
    except Exception as exc:  # an operator of the user's: whatever it raises on a bad state
        raise CheckpointCorruptError(
            f"loader state field {where} is not a carry state operator {op.name!r} restores "
            f"({type(exc).__name__}: {exc}): the checkpoint was edited or damaged, or the "
            "operator changed how it reads its carry state"
        ) from None
