"""``Pipeline(ray_options=...)``: how each Ray lane's actor is placed, checked when the pipeline is
planned (without importing Ray) so that a misspelt key fails before any actor starts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zephon.errors import PlanError
from zephon.validation import check_int

#: The keys ``ray_options`` accepts, each passed to the actor's ``.options()`` as is.
RAY_OPTION_KEYS = ("num_cpus", "memory", "resources", "scheduling_strategy", "runtime_env")
#: The scheduling strategies Ray names by a string; any other is a strategy object
#: (``PlacementGroupSchedulingStrategy``, ``NodeAffinitySchedulingStrategy``), checked by Ray.
NAMED_STRATEGIES = ("DEFAULT", "SPREAD")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def check_ray_options(options: Mapping[str, Any] | None, workers: str) -> dict[str, Any] | None:
    """``options`` as a plain dict once every key and value is one Ray lanes accept; a
    ``PlanError`` naming the key otherwise, or when given for lanes that are not Ray's."""
    if options is None:
        return None
    if workers != "ray":
        raise PlanError(
            f"Pipeline: ray_options applies to workers='ray' only, got workers={workers!r}: "
            "drop ray_options or run the lanes on Ray"
        )
    if not isinstance(options, Mapping):
        raise PlanError(f"Pipeline: ray_options must be a mapping, got {options!r}")
    unknown = [key for key in options if key not in RAY_OPTION_KEYS]
    if unknown:
        raise PlanError(
            f"Pipeline: ray_options has unknown key(s) {', '.join(map(repr, unknown))}: it accepts "
            f"{', '.join(RAY_OPTION_KEYS)}"
        )
    checked = dict(options)
    if "memory" in checked:
        memory = checked["memory"]
        check_int(memory, "ray_options['memory']", "Pipeline", minimum=1, error=PlanError)
    problem = _problem(checked)
    if problem is not None:
        key, wanted = problem
        raise PlanError(f"Pipeline: ray_options[{key!r}] must be {wanted}, got {checked[key]!r}")
    return checked


def _problem(options: dict[str, Any]) -> tuple[str, str] | None:
    """The first key whose value Ray would refuse, and what it must be."""
    if "num_cpus" in options and not _number(options["num_cpus"]):
        return "num_cpus", "a number of CPUs >= 0 per lane's actor"
    resources = options.get("resources")
    if "resources" in options and not (
        isinstance(resources, Mapping)
        and all(isinstance(k, str) and _number(v) for k, v in resources.items())
    ):
        return "resources", "a mapping of resource names to amounts >= 0"
    strategy = options.get("scheduling_strategy")
    if isinstance(strategy, str) and strategy not in NAMED_STRATEGIES:
        return "scheduling_strategy", f"one of {NAMED_STRATEGIES} or a Ray strategy object"
    if "scheduling_strategy" in options and strategy is None:
        return "scheduling_strategy", f"one of {NAMED_STRATEGIES} or a Ray strategy object"
    if "runtime_env" in options and not isinstance(options["runtime_env"], Mapping):
        return "runtime_env", "a mapping (Ray's runtime_env: env_vars, pip, working_dir, ...)"
    return None
