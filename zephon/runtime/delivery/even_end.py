"""Even ends across ranks: how many items every lane hands over, so that every rank of a job
delivers the same number of global steps and none waits alone in a collective at the end of the
data.

A global step takes one item of every lane, so a job holds as many whole global steps as its
shortest lane has items. Every rank works that number out for all the job's lanes from the plan
alone, without communicating: it is known when each lane's item count follows from its chunks,
that is when every chain operator is 1 -> 1 (an indexable plan) and the source is finite. A
lane then delivers one record per sample of its chunks, or one batch per ``batch_size`` of them.
Chunks are dealt to lanes across pass boundaries, so a pass's remainder is delivered in the next
pass's global steps; only the end of the last pass can be uneven, and what the longer lanes hold
beyond the shortest is not delivered.

Retired samples (``retire=``) are not delivered, so a lane that holds more of them hands over
fewer items: every lane's count then drops by what its retired samples can take away at most
(all of them, in whole batches), the same on every rank, since each rank has the retired ids.

Plans whose item counts are unknown (they filter, split or pack) end their ranks together at
run time instead (``Loader.end_together``): one minimum all-reduce per item, with the job's own
collective. What the ranks with more data still hold then is dropped and counted, not carried:
the lanes already run on from one pass into the next, so the only uneven end is the end of the
last pass, and no later global step exists that could take it.
"""

from __future__ import annotations

import numpy as np

from zephon.plan import Plan
from zephon.runtime.checkpoint.layout import Layout
from zephon.runtime.checkpoint.retired import RetiredIds


def lane_items(plan: Plan, layout: Layout, retired: RetiredIds | None = None) -> list[int] | None:
    """Items each lane of the job hands over from the start of its generation to its end, or
    None when that is not known without running the lanes: an operator filters, splits or
    packs records, the source is unbounded, or the job was re-laned (what the new lanes finish
    of the old ones' runs depends on where the checkpoint was taken). With ``retired`` samples,
    the fewest items each lane can hand over: retired samples delivered before they were
    retired still count, the others do not."""
    total = plan.source.total_chunks()
    if not plan.indexable or layout.current or total is None:
        return None
    lanes = plan.lanes
    lengths = plan.source.chunk_lengths(np.arange(total, dtype=np.int64))
    records = _per_lane(lengths, lanes)
    gone = [0] * lanes
    if retired is not None and len(retired):
        hits = [int(retired.contains(plan.source.chunk(p).pointers).sum()) for p in range(total)]
        gone = _per_lane(np.array(hits, dtype=np.int64), lanes)
    batcher = plan.batcher
    if batcher is None:
        return [n - k for n, k in zip(records, gone)]
    size = batcher.batch_size
    # A batch gathers the records left, so k retired samples take at most ceil(k / size)
    # batches away from what the lane's records make.
    return [
        (n // size if batcher.drop_remainder else -(-n // size)) - -(-k // size)
        for n, k in zip(records, gone)
    ]


def _per_lane(counts: np.ndarray, lanes: int) -> list[int]:
    """``counts`` per chunk position summed per lane (position p goes to lane p % lanes)."""
    padded = np.zeros(-(-len(counts) // lanes) * lanes, dtype=np.int64)
    padded[: len(counts)] = counts
    return padded.reshape(-1, lanes).sum(axis=0).tolist()
