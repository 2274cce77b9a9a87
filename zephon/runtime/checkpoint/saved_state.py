"""A loader or job state checked on its own, without the pipeline it belongs to: what
``zephon inspect`` shows and what ``merge_states`` merges passes the loader's own field checks
(``checkpoint.schema``) as far as they go without the pipeline.

Left to the loader, which has the pipeline: the source's size (whether a finished lane is at its
end, a snapshot's offset inside its chunk), the eviction path (a state without snapshots is
checked as a monotone one, which asks less), whether the pipeline is the state's
(``check_identity``), and what the operators make of their carry states.
"""

from __future__ import annotations

from typing import Any

from zephon.runtime.checkpoint.format import check_fingerprint
from zephon.runtime.checkpoint.retired import RetiredIds, decode_retirements
from zephon.runtime.checkpoint.schema import (
    check_history,
    check_int,
    check_keys,
    check_lane_list,
    check_lane_state,
    check_layout,
    check_next_lane,
    check_totals,
)


def check_saved_state(
    body: dict[str, Any], known: dict[str, RetiredIds] | None = None
) -> dict[str, Any]:
    """``body`` (``unseal``'s result), every field checked that can be without the pipeline;
    ``CheckpointCorruptError`` naming the first that is wrong. ``known``: retired ids checked
    already, by their packed text (the states of a job's ranks share them)."""
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
    lane_states = check_lane_list(body["lane_states"], len(ids))
    windows = [w for s in lane_states if type(s) is dict for w in (s, *_pending(s))]
    sizes = [len(w["carry"]) for w in windows if type(w.get("carry")) is list]
    sizes += [len(ops) for w in windows if (ops := _held_ops(w)) is not None]
    window: dict[str, Any] = {
        "layout": layout,
        # snapshots and what was consumed by position are kept on the epoch path only
        "monotone": all(
            w.get(key) is None for w in windows for key in ("held", "progress", "screened")
        ),
        "per_epoch": per_epoch,
        "n_ops": sizes[0] if sizes else 0,  # the operators' count, as the first list says
        "holdings": True,
    }
    checked = [
        check_lane_state(s, f"lane_states[{i}]", lane_id=g, **window)
        for i, (g, s) in enumerate(zip(ids, lane_states))
    ]
    if not job:  # a job's lanes are in step per rank, which the job state no longer says
        check_next_lane(body["next_lane"], checked)
    check_totals(body)
    for key in ("served", "step"):  # the items a rank handed over, a job's global step
        if key in body:
            check_int(body[key], key)
    check_history(body["history"], body["skip"])
    decode_retirements(body["retired"], known)
    return body


def _pending(lane_state: dict[str, Any]) -> list[dict[str, Any]]:
    pending = lane_state.get("pending")
    return [run for run in pending if type(run) is dict] if type(pending) is list else []


def _held_ops(window: dict[str, Any]) -> list[Any] | None:
    held = window.get("held")
    ops = held.get("ops") if type(held) is dict else None
    return ops if type(ops) is list else None
