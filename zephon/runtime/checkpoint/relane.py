"""Re-laning: a job state taken with N lanes, continued on N' lanes, every sample exactly once.

What each old lane had in flight (its current epoch on the epoch path, its chunks up to the replay
cursor's on the monotone path, and any runs it had itself taken over) becomes a run that one new
lane, ``old % N'``, finishes under the old lane's identity (its chunks, seeds and carry state)
before it starts chunks of its own; the records already delivered are swallowed on the way, as on
any restore. Every chunk no old lane had taken is dealt to the new lanes in increasing order
(``layout.Leftover``). The batches differ from the uninterrupted run's; the samples do not.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import replace
from typing import Any

from zephon.errors import CheckpointMismatchError, RelaneWarning
from zephon.plan import Plan
from zephon.runtime.checkpoint.job import job_step, rank_served
from zephon.runtime.checkpoint.layout import Layout, Run
from zephon.runtime.checkpoint.schema import (
    JOB_FORMAT,
    JOB_KEYS,
    check_lane_list,
    check_lane_state,
    check_layout,
    check_next_lane,
    encode_cursor,
    encode_run,
)

log = logging.getLogger("zephon")


def relaned_state(body: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """``body`` (a state taken with another lane count, unsealed) as a job state of ``plan``'s
    lanes, every field it re-lanes checked; a ``RelaneWarning`` says what changes."""
    old = body["lanes"]
    if body["format"] != JOB_FORMAT and body.get("world_size") != 1:
        raise CheckpointMismatchError(
            f"this is the state of rank {body.get('rank')!r} of a job of "
            f"{body.get('world_size')!r} ranks with {old} lanes; to continue on "
            f"{plan.lanes} lanes, merge the states of all ranks with zephon.merge_states()"
        )
    layout = check_layout(body["layout"], old, plan.source.total_chunks())
    lane_states = check_lane_list(body["lane_states"], old)
    monotone = plan.eviction_path == "monotone"
    window: dict[str, Any] = {
        "layout": layout,
        "monotone": monotone,
        "per_epoch": plan.epoch_chunks,
        "n_ops": len(plan.chain),
        "holdings": plan.restores_holdings,
        "source": plan.source,
    }
    checked = [
        check_lane_state(s, f"lane_states[{g}]", lane_id=g, **window)
        for g, s in enumerate(lane_states)
    ]
    if body["format"] != JOB_FORMAT:
        check_next_lane(body["next_lane"], checked)
    new_layout, new_states = relane(
        checked,
        layout,
        plan.lanes,
        monotone=monotone,
        per_epoch=plan.epoch_chunks,
    )
    text = (
        f"re-laning a checkpoint of {old} lanes onto {plan.lanes} lanes: every sample the "
        "pipeline delivers is delivered exactly once, but the batches differ from here on "
        "(what was in flight finishes first, under the old lanes' seeds); operators that "
        "drop records by running totals (ensure_mixture) restart them on the new lanes, so "
        "which samples they drop can differ from the uninterrupted run's"
    )
    log.warning(text)
    warnings.warn(text, RelaneWarning, stacklevel=4)
    job = {k: v for k, v in body.items() if k in JOB_KEYS}
    step = job_step(body) if body["format"] == JOB_FORMAT else rank_served(body) // old
    return {
        **job,
        "format": JOB_FORMAT,
        "step": step,
        "lanes": plan.lanes,
        "layout": new_layout.encode(),
        "lane_states": new_states,
    }


def relane(
    lane_states: list[dict[str, Any]],
    layout: Layout,
    lanes: int,
    *,
    monotone: bool,
    per_epoch: int,
) -> tuple[Layout, list[dict[str, Any]]]:
    """The layout and lane states of ``lanes`` new lanes continuing checked ``lane_states`` (one
    per lane of ``layout``'s running generation, in lane order)."""
    gen = layout.current
    ends: list[int] = []
    handed: list[list[Run]] = []
    for g, state in enumerate(lane_states):
        geometry = layout.geometry(gen, g)
        runs: list[Run] = [] if state["finished"] else state["runs"]
        if not runs:
            ends.append(geometry.total or 0)
            handed.append([])
        elif runs[0].inherited:  # it had not started its own chunks
            ends.append(0)
            handed.append([run for run in runs if run.inherited])
        else:
            own = runs[0]
            start = own.start
            if monotone:
                end = start
                if own.cursor is not None:
                    k = geometry.local_index(own.cursor.chunk_id)
                    assert k is not None  # checked with the state
                    end = k + 1
            else:
                end = start + per_epoch
            if geometry.total is not None:
                end = min(end, geometry.total)
            ends.append(end)
            handed.append(
                [replace(own, gen=gen, lane=g, start=start, end=end)] if end > start else []
            )
    taken = [[run for g in range(h, len(handed), lanes) for run in handed[g]] for h in range(lanes)]
    new_layout = layout.closed(ends, lanes, [[(run.gen, run.lane) for run in t] for t in taken])
    new_gen = new_layout.current
    out = []
    for h, runs in enumerate(taken):
        if runs:
            first = encode_run(runs[0])
            out.append(
                {
                    "lane": h,
                    "finished": False,
                    "delivered": 0,
                    **{k: v for k, v in first.items() if k != "run"},
                    "run": first["run"],
                    "pending": [encode_run(run) for run in runs[1:]],
                }
            )
            continue
        total = new_layout.geometry(new_gen, h).total
        out.append(
            {
                "lane": h,
                "finished": total == 0,
                "delivered": 0,
                "start": 0,
                "cursor": encode_cursor(None),
                "count": 0,
                "digest": f"{0:016x}",
                "carry": None,
                "held": None,
                "progress": None,
                "screened": None,
                "changed": False,
                "run": None,
                "pending": [],
            }
        )
    return new_layout, out
