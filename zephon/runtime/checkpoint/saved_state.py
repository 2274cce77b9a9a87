"""A loader or job state checked on its own, without the pipeline it belongs to: what
``zephon inspect`` shows and what ``merge_states`` merges passes the loader's own field checks
(``runtime.state``) as far as they go without the pipeline.

Left to the loader, which has the pipeline: the source's size (whether a finished lane is at its
end, a snapshot's offset inside its chunk), the eviction path (a state without snapshots is
checked as a monotone one, which asks less), whether the pipeline is the state's
(``check_identity``), and what the operators make of their carry states.
"""

from __future__ import annotations

from typing import Any

from zephon.errors import CheckpointCorruptError
from zephon.runtime.checkpoint.fields import (
    COUNTERS,
    check_int,
    check_lane_state,
    check_layout,
    check_pairs,
    check_turn,
    corrupt,
)
from zephon.runtime.checkpoint.format import JOB_FORMAT, check_fingerprint
from zephon.runtime.checkpoint.history import check_history
from zephon.runtime.checkpoint.retired import decode_retirements

#: The fields of a rank's state, and of a job state (``merge_states``).
STATE_KEYS = frozenset(
    {
        "format",
        "version",
        "fingerprint",
        "pipeline",
        "rank",
        "world_size",
        "lanes",
        "next_lane",
        "layout",
        "lane_states",
        "counters",
        "tag_counts",
        "mixture",
        "history",
        "skip",
        "retired",
    }
)
JOB_KEYS = STATE_KEYS - {"rank", "world_size", "next_lane"}
# Written since states count global steps; a state without them is read the way it was written.
NEWER_STATE_KEYS = frozenset({"served"})
NEWER_JOB_KEYS = frozenset({"step"})


def check_keys(body: dict[str, Any]) -> bool:
    """Whether ``body`` (unsealed) is a job state; ``CheckpointCorruptError`` unless it has
    exactly the fields of its format (those written since global steps are counted may be
    missing)."""
    job = body["format"] == JOB_FORMAT
    keys = JOB_KEYS if job else STATE_KEYS
    newer = NEWER_JOB_KEYS if job else NEWER_STATE_KEYS
    if not keys <= set(body) <= keys | newer:
        raise CheckpointCorruptError(
            f"loader state must have exactly the fields {sorted(keys | newer)}, got {sorted(body)}"
        )
    return job


def check_totals(
    body: dict[str, Any],
) -> tuple[dict[str, int], list[tuple[Any, int]], list[tuple[Any, int]], list[tuple[Any, int]]]:
    """The running totals of a state, checked: counters, tag counts, mixture samples and
    tokens."""
    counters = body["counters"]
    if type(counters) is not dict or set(counters) != set(COUNTERS):
        raise corrupt("counters", f"must have exactly the fields {list(COUNTERS)}")
    values = {name: check_int(counters[name], f"counters.{name}") for name in COUNTERS}
    tag_counts = check_pairs(body["tag_counts"], "tag_counts")
    mixture = body["mixture"]
    if type(mixture) is not dict or set(mixture) != {"samples", "tokens"}:
        raise corrupt("mixture", "must have exactly the fields samples and tokens")
    samples = check_pairs(mixture["samples"], "mixture.samples")
    tokens = check_pairs(mixture["tokens"], "mixture.tokens")
    return values, tag_counts, samples, tokens


def check_saved_state(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` (``unseal``'s result), every field checked that can be without the pipeline;
    ``CheckpointCorruptError`` naming the first that is wrong."""
    job = check_keys(body)
    lanes = check_int(body["lanes"], "lanes", 1)
    check_fingerprint(body)
    per_epoch = check_int(body["pipeline"].get("epoch_chunks"), "pipeline.epoch_chunks", 1)
    layout = check_layout(body["layout"], lanes, None)
    if job:
        ids = range(lanes)
    else:
        world_size = check_int(body["world_size"], "world_size", 1, lanes)
        rank = check_int(body["rank"], "rank", 0, world_size - 1)
        per_rank = lanes // world_size
        ids = range(rank * per_rank, (rank + 1) * per_rank)
    lane_states = body["lane_states"]
    if type(lane_states) is not list or len(lane_states) != len(ids):
        raise corrupt("lane_states", f"must be a list of {len(ids)} lane states")
    windows = [w for s in lane_states if type(s) is dict for w in (s, *_pending(s))]
    sizes = [len(w["carry"]) for w in windows if type(w.get("carry")) is list]
    sizes += [len(ops) for w in windows if (ops := _held_ops(w)) is not None]
    window: dict[str, Any] = {
        "layout": layout,
        "monotone": all(w.get("held") is None for w in windows),  # snapshots: the epoch path
        "per_epoch": per_epoch,
        "n_ops": sizes[0] if sizes else 0,  # the operators' count, as the first list says
        "holdings": True,
    }
    checked = [
        check_lane_state(s, f"lane_states[{i}]", lane_id=g, **window)
        for i, (g, s) in enumerate(zip(ids, lane_states))
    ]
    if not job:  # a job's lanes are in step per rank, which the job state no longer says
        check_turn(check_int(body["next_lane"], "next_lane", 0, len(ids) - 1), checked)
    check_totals(body)
    for key in ("served", "step"):  # the items a rank handed over, a job's global step
        if key in body:
            check_int(body[key], key)
    check_history(body["history"], body["skip"])
    decode_retirements(body["retired"])
    return body


def _pending(lane_state: dict[str, Any]) -> list[dict[str, Any]]:
    pending = lane_state.get("pending")
    return [run for run in pending if type(run) is dict] if type(pending) is list else []


def _held_ops(window: dict[str, Any]) -> list[Any] | None:
    held = window.get("held")
    ops = held.get("ops") if type(held) is dict else None
    return ops if type(ops) is list else None
