"""Re-laning: a job state taken with N lanes, continued on N' lanes, every sample exactly once.

What each old lane had in flight (its current epoch on the epoch path, its chunks up to the replay
cursor's on the monotone path, and any runs it had itself taken over) becomes a run that one new
lane, ``old % N'``, finishes under the old lane's identity (its chunks, seeds and carry state)
before it starts chunks of its own; the records already delivered are swallowed on the way, as on
any restore. Every chunk no old lane had taken is dealt to the new lanes in increasing order
(``layout.Leftover``). The batches differ from the uninterrupted run's; the samples do not.
"""

from __future__ import annotations

from typing import Any

from zephon.runtime.checkpoint.fields import encode_cursor, encode_run
from zephon.runtime.checkpoint.layout import Layout, Run


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
                [Run(gen, g, start, end, own.carry, own.cursor, own.count, own.digest, own.held)]
                if end > start
                else []
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
                "run": None,
                "pending": [],
            }
        )
    return new_layout, out
