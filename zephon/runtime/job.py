"""Job states: the states of every rank of a job merged into one, which resumes on any number of
ranks that divides the job's lane count.

A rank's state holds its own lanes, keyed by global lane id. Merging checks that the states come
from one pipeline, that every lane is there exactly once, and that the ranks were checkpointed at
the same global step; the result holds all lanes, and each rank of the next run picks its own.
"""

from __future__ import annotations

from collections import Counter
from itertools import islice
from typing import Any

from zephon.errors import CheckpointError, CheckpointMismatchError
from zephon.runtime.checkpoint import JOB_FORMAT, STATE_FORMAT, STATE_VERSION, seal, unseal
from zephon.runtime.saved_state import check_saved_state
from zephon.runtime.state import COUNTERS, check_int, check_pairs, corrupt, encode_pairs

_SHOWN = 8  # missing lanes or ranks named in an error


def merge_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One job state from the states of all ranks of a job (any order).

    Raises ``CheckpointMismatchError`` when the states come from different pipelines and
    ``CheckpointError`` naming the problem when ranks or lanes are missing or duplicated, or the
    ranks were checkpointed at different global steps.
    """
    bodies = [check_saved_state(unseal(state)) for state in states]
    if not bodies:
        raise CheckpointError("merge_states needs the state of every rank, got none")
    first = bodies[0]
    for body in bodies[1:]:
        if body.get("fingerprint") != first.get("fingerprint"):
            raise CheckpointMismatchError(
                f"the states of rank {first.get('rank')!r} and rank {body.get('rank')!r} come "
                "from different pipelines (fingerprints differ)"
            )
    lanes = check_int(first.get("lanes"), "lanes", 1)
    if any(body.get("layout") != first.get("layout") for body in bodies):
        raise CheckpointError(
            "the states of the ranks hold different lane histories (layout): they were not taken "
            "in one run of the job"
        )
    sizes = {body.get("world_size") for body in bodies}
    if len(sizes) != 1:
        raise CheckpointError(f"the states were taken under different world sizes: {sizes}")
    world_size = check_int(sizes.pop(), "world_size", 1, lanes)
    ranks = Counter(body.get("rank") for body in bodies)
    duplicated = [r for r, n in ranks.items() if n > 1]
    if duplicated:
        raise CheckpointError(f"merge_states got rank(s) {duplicated} more than once")
    by_lane: dict[int, dict[str, Any]] = {}
    for body in bodies:
        lane_states = body.get("lane_states")
        if type(lane_states) is not list:
            raise corrupt("lane_states", "must be a list")
        for lane_state in lane_states:
            g = lane_state.get("lane") if type(lane_state) is dict else None
            if type(g) is not int or not 0 <= g < lanes:
                raise corrupt("lane_states[].lane", f"must be a lane of 0..{lanes - 1}: {g!r}")
            if g in by_lane:
                raise CheckpointError(f"lane {g} is in the states of two ranks")
            by_lane[g] = lane_state
    if len(by_lane) < lanes:
        raise CheckpointError(_missing(lanes, by_lane, world_size, ranks))
    _check_same_step(bodies)
    counters = {name: 0 for name in COUNTERS}
    tags: Counter[Any] = Counter()
    samples: Counter[Any] = Counter()
    tokens: Counter[Any] = Counter()
    for body in bodies:
        for name in COUNTERS:
            value = check_int(body["counters"][name], f"counters.{name}")
            counters[name] = (
                max(counters[name], value) if name == "max_inflight" else (counters[name] + value)
            )
        tags.update(dict(check_pairs(body["tag_counts"], "tag_counts")))
        samples.update(dict(check_pairs(body["mixture"]["samples"], "mixture.samples")))
        tokens.update(dict(check_pairs(body["mixture"]["tokens"], "mixture.tokens")))
    return seal(
        {
            "format": JOB_FORMAT,
            "version": STATE_VERSION,
            "fingerprint": first["fingerprint"],
            "pipeline": first["pipeline"],
            "lanes": lanes,
            "layout": first["layout"],
            "lane_states": [by_lane[g] for g in range(lanes)],
            "counters": counters,
            "tag_counts": encode_pairs(tags),
            "mixture": {
                "samples": encode_pairs(samples),
                "tokens": encode_pairs(tokens),
            },
        }
    )


def _missing(lanes: int, by_lane: dict[int, Any], world_size: int, ranks: Counter[Any]) -> str:
    """Which lanes, and the states of which ranks, are missing: the first few of each (a state
    may claim a job of millions of lanes)."""

    def first(n: int, present: Any) -> str:
        shown = list(islice((i for i in range(n) if i not in present), _SHOWN))
        missing = n - len(present)
        return f"{shown}" if missing <= _SHOWN else f"{shown[:-1]} and {missing - _SHOWN + 1} more"

    absent = world_size - len(ranks)
    return f"lanes {first(lanes, by_lane)} of the job's {lanes} are missing" + (
        f" (no state of rank(s) {first(world_size, ranks)})" if absent > 0 else ""
    )


def _check_same_step(bodies: list[dict[str, Any]]) -> None:
    """Every rank completed the same number of rounds over its lanes that have not ended."""
    steps = {}
    for body in bodies:
        open_counts = [s["delivered"] for s in body["lane_states"] if not s.get("finished")]
        if open_counts:
            steps[body["rank"]] = min(open_counts)
    if len(set(steps.values())) > 1:
        shown = ", ".join(f"rank {r} at step {s}" for r, s in sorted(steps.items()))
        raise CheckpointError(f"the ranks were checkpointed at different global steps: {shown}")


def rank_turn(lane_states: list[dict[str, Any]]) -> int:
    """Where a rank's round-robin over ``lane_states`` (checked, in lane order) stands: the first
    lane that has not ended and delivered fewer items than the ones before it (0 when all are
    level)."""
    open_counts = [(i, s["delivered"]) for i, s in enumerate(lane_states) if not s["finished"]]
    if not open_counts:
        return 0
    top = max(n for _, n in open_counts)
    return next((i for i, n in open_counts if n < top), 0)


__all__ = ["STATE_FORMAT", "merge_states", "rank_turn"]
