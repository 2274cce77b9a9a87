"""Job states: the states of every rank of a job merged into one, which resumes on any number of
ranks that divides the job's lane count.

A rank's state holds its own lanes, keyed by global lane id. Merging checks that the states come
from one pipeline, that every lane is there exactly once, and that the ranks were checkpointed at
the same global step; the result holds all lanes, and each rank of the next run picks its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from itertools import islice
from typing import Any

from zephon.errors import CheckpointError, CheckpointMismatchError
from zephon.runtime.checkpoint.dataloader_state import unwrapped
from zephon.runtime.checkpoint.format import seal, unseal
from zephon.runtime.checkpoint.retired import RetiredIds, merge_retired
from zephon.runtime.checkpoint.saved_state import check_saved_state
from zephon.runtime.checkpoint.schema import (
    COUNTERS,
    JOB_FORMAT,
    STATE_FORMAT,
    STATE_VERSION,
    check_int,
    check_pairs,
    corrupt,
    encode_pairs,
)

_SHOWN = 8  # missing lanes or ranks named in an error
_PER_VALUE = 3  # ranks named for each global step or world size when many ranks share one


def merge_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One job state from the states of all ranks of a job (any order): each a loader's state, or
    a torchdata ``StatefulDataLoader``'s around a Zephon dataset (its dataset's is merged).

    Raises ``CheckpointMismatchError`` when the states come from different pipelines and
    ``CheckpointError`` naming the problem when ranks or lanes are missing or duplicated, or the
    ranks were checkpointed at different global steps.
    """
    known: dict[str, RetiredIds] = {}  # the retired ids every rank holds, decoded once
    bodies = [_rank_body(i, state, known) for i, state in enumerate(states)]
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
    if any(b.get(key) != first.get(key) for b in bodies for key in ("history", "skip")):
        raise CheckpointError(
            "the states of the ranks hold different histories (operator changes, skipped steps, "
            "retired samples): they were not taken in one run of the job, or its ranks were "
            "resumed differently: give every rank the same allow_changes=, retire= and "
            "skip_steps"
        )
    retired = merge_retired([body.get("retired") for body in bodies], known)
    sizes = {body.get("world_size") for body in bodies}
    if len(sizes) != 1:
        shown = _ranks_by(
            [(b["rank"], b["world_size"]) for b in bodies],
            lambda r, w: f"rank {r} of {w}",
            lambda n, w: f"and {n} more of {w}",
        )
        raise CheckpointError(f"the states were taken under different world sizes: {shown}")
    world_size = check_int(sizes.pop(), "world_size", 1, lanes)
    ranks = Counter(body.get("rank") for body in bodies)
    duplicated = [r for r, n in ranks.items() if n > 1]
    if duplicated:
        raise CheckpointError(
            f"merge_states got rank(s) {_first(sorted(duplicated))} more than once"
        )
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
    step = _job_step(bodies, lanes // world_size)
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
            "step": step,
            "lane_states": [by_lane[g] for g in range(lanes)],
            "counters": counters,
            "tag_counts": encode_pairs(tags),
            "mixture": {
                "samples": encode_pairs(samples),
                "tokens": encode_pairs(tokens),
            },
            "history": first["history"],
            "skip": first["skip"],
            "retired": retired,
        }
    )


def _rank_body(i: int, state: Any, known: dict[str, RetiredIds]) -> dict[str, Any]:
    """The ``i``-th state given to ``merge_states``, unsealed and checked; an error says which
    state it is."""
    state = unwrapped(state)  # a StatefulDataLoader's state: its dataset's
    if isinstance(state, dict) and state.get("format") == JOB_FORMAT:
        raise CheckpointError(
            f"merge_states takes the state of each rank (loader.state_dict()): state #{i} is a "
            "job state, merged already. Resume from it, or merge the states it was merged from"
        )
    try:
        return check_saved_state(unseal(state), known)
    except CheckpointError as exc:
        raise exc.add_context(state=i) from None


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


def _first(ranks: list[Any]) -> str:
    """``ranks``, or the first few of them and how many more (a job may have thousands)."""
    if len(ranks) <= _SHOWN:
        return f"{ranks}"
    return f"{ranks[: _SHOWN - 1]} and {len(ranks) - _SHOWN + 1} others"


def _ranks_by(
    pairs: list[tuple[Any, Any]], name: Callable[[Any, Any], str], more: Callable[[int, Any], str]
) -> str:
    """``name(rank, value)`` for every ``(rank, value)`` pair, in rank order; of a job of many
    ranks only the first few ranks of each value (``more`` says how many others share it) and
    the first few values, so the ranks that differ from the rest are named and the text stays
    short."""
    pairs = sorted(pairs, key=lambda pair: pair[0])
    if len(pairs) <= _SHOWN:
        return ", ".join(name(r, value) for r, value in pairs)
    groups: dict[Any, list[Any]] = {}
    for r, value in pairs:
        groups.setdefault(value, []).append(r)
    parts = []
    for value, group in islice(groups.items(), _SHOWN):
        text = ", ".join(name(r, value) for r in group[:_PER_VALUE])
        if len(group) > _PER_VALUE:
            text += f" {more(len(group) - _PER_VALUE, value)}"
        parts.append(text)
    rest = sum(len(group) for group in islice(groups.values(), _SHOWN, None))
    return ", ".join(parts) + (f" and {rest} more ranks" if rest else "")


def rank_served(body: dict[str, Any]) -> int:
    """How many items a rank's ``next()`` calls handed over, counted in global steps of its world
    size (``served``; a state written before it was stored: the sum of its lanes' items)."""
    if "served" in body:
        return check_int(body["served"], "served")
    lane_states = body.get("lane_states")
    if type(lane_states) is not list:
        raise corrupt("lane_states", "must be a list")
    return sum(
        check_int(s.get("delivered") if type(s) is dict else None, "lane_states[].delivered")
        for s in lane_states
    )


def _job_step(bodies: list[dict[str, Any]], per_rank: int) -> int:
    """The global step every rank that still has a lane running was checkpointed at; a rank's
    step is what its ``next()`` calls handed over divided by its lanes, so lanes that ended (the
    rank's other lanes then deliver more per round) do not move it."""
    steps: dict[Any, tuple[int, int]] = {}
    for body in bodies:
        if any(not s.get("finished") for s in body["lane_states"]):
            steps[body["rank"]] = divmod(rank_served(body), per_rank)
    inside = {r: m for r, (_, m) in steps.items() if m}
    advice = (
        "A job state holds whole global steps: take it right after an optimizer step (after a "
        "multiple of lanes // world_size items on every rank), or resume each rank from its own "
        "state on the same world size"
    )
    if len({step for step, _ in steps.values()}) > 1:
        shown = _ranks_by(
            [(r, s) for r, (s, _) in steps.items()],
            lambda r, s: f"rank {r} at step {s}",
            lambda n, s: f"and {n} more at step {s}",
        )
        parts = _ranks_by(
            list(inside.items()),
            lambda r, m: f"rank {r} {m} items into it",
            lambda n, m: f"and {n} more",
        )
        raise CheckpointError(
            f"the ranks were checkpointed at different global steps: {shown}"
            + (f" ({parts}; a global step is {per_rank} items per rank). {advice}" if parts else "")
        )
    if inside and len(bodies) > 1:  # one rank's position inside a step resumes on its own
        step = next(iter(steps.values()))[0]
        shown = _ranks_by(
            list(inside.items()),
            lambda r, m: f"rank {r} had handed over {m}",
            lambda n, m: f"and {n} more",
        )
        raise CheckpointError(
            f"the ranks were checkpointed inside a global step: global step {step} is "
            f"{per_rank} items per rank, and {shown}. {advice}"
        )
    if steps:
        return next(iter(steps.values()))[0]
    return max((rank_served(body) // per_rank for body in bodies), default=0)


def items_into_step(state: dict[str, Any]) -> int:
    """How many of its items of the current global step a rank of a job of several ranks had
    handed over when ``state`` (its own, unsealed) was taken: 0 between global steps, for a
    rank whose lanes all ended, and for a job of one rank."""
    lanes, world_size = state.get("lanes"), state.get("world_size")
    lane_states = state.get("lane_states")
    if type(lanes) is not int or type(world_size) is not int or type(lane_states) is not list:
        return 0
    if lanes < 1 or not 1 < world_size <= lanes:
        return 0  # one rank alone waits for no other
    if all(type(s) is dict and s.get("finished") is True for s in lane_states):
        return 0
    try:
        return rank_served(state) % (lanes // world_size)
    except CheckpointError:
        return 0  # a damaged state: the merge says what is wrong with it, on every rank


def job_step(body: dict[str, Any]) -> int:
    """The global step a job state was merged at (``step``; a job state written before it was
    stored: the fewest items of a lane that had not ended, as merges then checked)."""
    if "step" in body:
        return check_int(body["step"], "step")
    open_counts = [
        s["delivered"]
        for s in body["lane_states"]
        if type(s) is dict and not s.get("finished") and type(s.get("delivered")) is int
    ]
    return min(open_counts, default=0)


def state_step(body: dict[str, Any]) -> int:
    """The global step an unsealed state (a rank's or a job's) stands at: the job's ``step``, or
    the items the rank handed over in global steps of its world size; the same on every rank of a
    job in lockstep, whichever lanes ended or were re-laned (0 for a state too damaged to say,
    which its load refuses)."""
    try:
        if body.get("format") == JOB_FORMAT:
            return job_step(body)
        lanes, world_size = body.get("lanes"), body.get("world_size")
        if type(lanes) is not int or type(world_size) is not int or not 1 <= world_size <= lanes:
            return 0
        return rank_served(body) // (lanes // world_size)
    except (CheckpointError, KeyError, TypeError):
        return 0


def rank_turn(lane_states: list[dict[str, Any]]) -> int:
    """Where a rank's round-robin over ``lane_states`` (checked, in lane order) stands: the first
    lane that has not ended and delivered fewer items than the ones before it (0 when all are
    level)."""
    open_counts = [(i, s["delivered"]) for i, s in enumerate(lane_states) if not s["finished"]]
    if not open_counts:
        return 0
    top = max(n for _, n in open_counts)
    return next((i for i, n in open_counts if n < top), 0)


__all__ = [
    "STATE_FORMAT",
    "items_into_step",
    "job_step",
    "merge_states",
    "rank_served",
    "rank_turn",
    "state_step",
]
