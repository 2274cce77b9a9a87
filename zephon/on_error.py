"""``Pipeline(on_error=..., max_skipped=...)``: which operators' failing records are skipped.

A policy is ``"raise"`` (the default: a failing record ends the run with ``OperatorError``) or
``"skip"`` (the record is dropped with its tombstones, logged and counted), for the whole
pipeline or per operator name (an operator a mapping does not name raises). Only ``fetch`` and
operators that keep no state can skip: after a failed call a stateful operator's state is
unknown, so its errors always raise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from zephon.errors import PlanError
from zephon.ops.base import Operator

POLICIES = ("raise", "skip")


def skip_policy(
    on_error: Any, max_skipped: Any, fetch: Operator, chain: Sequence[Operator]
) -> tuple[bool, tuple[bool, ...]]:
    """``(skip fetch errors, per chain operator whether it skips)``, or ``PlanError`` naming
    the bad value."""
    if max_skipped is not None and (type(max_skipped) is not int or max_skipped < 0):
        raise PlanError(
            f"Pipeline max_skipped must be an int >= 0 (or None for no limit), got {max_skipped!r}"
        )
    if isinstance(on_error, str):
        _check_policy(on_error, "Pipeline on_error")
        skip = on_error == "skip"
        # "skip" for the whole pipeline leaves stateful operators raising, as documented.
        return skip, tuple(skip and not op.traits.stateful for op in chain)
    if not isinstance(on_error, Mapping):
        raise PlanError(
            f"Pipeline on_error must be 'raise', 'skip' or a mapping of operator names to "
            f"them, got {on_error!r}"
        )
    ops = [fetch, *chain]
    for name, policy in on_error.items():
        _check_policy(policy, f"Pipeline on_error[{name!r}]")
        if not any(_named(op, name) for op in ops):
            raise PlanError(
                f"Pipeline on_error names operator {name!r}, which is neither the pipeline's "
                "reader nor one of the operators after it (a batch's collate cannot skip): "
                f"name one of {', '.join(repr(op.name) for op in ops)}"
            )

    def skips(op: Operator) -> bool:
        policy = [p for name, p in on_error.items() if _named(op, name)]
        if "skip" in policy and op.traits.stateful:
            raise PlanError(
                f"Pipeline on_error cannot skip what operator {op.name!r} fails on: it keeps "
                "state, which is unknown after a failed call. Move the work that fails into an "
                "operator that keeps no state before it (a map_transform), and skip there"
            )
        return "skip" in policy

    return skips(fetch), tuple(skips(op) for op in chain)


def _named(op: Operator, name: Any) -> bool:
    """Whether ``name`` names ``op``: its whole name, or the name without the parameters in
    parentheses (``"tokenize"`` for ``"tokenize(eos=256 '<eos>', ...)"``)."""
    return name == op.name or name == op.name.split("(", 1)[0]


def _check_policy(value: Any, where: str) -> None:
    if not isinstance(value, str) or value not in POLICIES:
        raise PlanError(f"{where} must be one of {POLICIES}, got {value!r}")
