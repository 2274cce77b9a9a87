"""A process lane's first reads, done in the loader's process while the worker processes start.

A worker process is a fresh interpreter that imports the plan's modules before it reads anything:
a fraction of a second in which the first batches could only wait. Instead, the loader reads the
lane delivered from first itself while the workers start on a thread
(``feeds.WorkerStarts``), and so any other lane it needs before the fork server can fork
that lane's worker. Such a lane's worker is started afterwards, from the last snapshot
(``Holdings``) of what the loader read, as a restore would, except that the worker is handed the
records the operators held there instead of reading and transforming them again. The lane's stream
is the same item for item: what the loader read goes out first, without waiting for any worker,
and the worker's items follow.

Only where nothing is lost by it: the plan snapshots its holders (no epoch replay to redo), has no
``timeout`` (nothing could interrupt a stuck operator in the loader's process), every lane has a
worker process of its own, and this process has not started a fork server before (a warm one
starts workers at once). A read that fails, or that gives no snapshot to continue from, is left
to the worker, which meets it again and reports it as usual; but a ``FetchError`` is raised
here, as the worker would wait on storage as long again before reporting it.
"""

from __future__ import annotations

from typing import Any

from zephon._core.records import RecordRun
from zephon.errors import FetchError
from zephon.plan import Plan
from zephon.runtime.lanes.control import Holdings, LaneEnd, RunStart
from zephon.runtime.lanes.runner import LaneRunner
from zephon.runtime.lanes.snapshots import kept_records, packed
from zephon.runtime.workers.fork_server import fork_server_cold
from zephon.types import SampleRecord


def applies(plan: Plan, n_lanes: int) -> bool:
    """Whether starting ``n_lanes`` process lanes of ``plan`` gains from a head start."""
    return (
        plan.timeout is None
        and plan.restores_holdings
        and not plan.sets_up  # a process lane's operators are set up in its worker only
        and n_lanes <= plan.processes
        and fork_server_cold()
    )


#: At most this many item lists are read ahead (a lane that emits nothing for long is left to its
#: worker).
MAX_LISTS = 16


def read_ahead(plan: Plan, lane_id: int, start: dict[str, Any]) -> tuple[list, dict | None] | None:
    """Read lane ``lane_id`` from ``start`` (a runner start) until an item list ends with a
    snapshot and a first batch's worth of records came before it, or the lane ends: the items
    read, and the runner start that continues after them (None after the lane's end); None when
    no list did within ``MAX_LISTS``, a run's start came first, or the lane failed other than
    reading its data (a ``FetchError`` is raised)."""
    need = plan.batcher.batch_size if plan.batcher is not None else 1
    runner = LaneRunner(plan, lane_id, **start, overlap=False)  # it stops early
    stream = runner.run()
    items: list = []
    kept: list = []
    ready = 0  # real records among items
    try:
        for _ in range(MAX_LISTS):
            got = next(stream)
            if any(type(item) is RunStart for item in got):
                return None  # the next run comes first: leave it to the worker
            items += got
            if got and type(got[-1]) is LaneEnd:  # the whole lane was read here
                return items, None
            ready += sum(
                len(item)
                if type(item) is RecordRun
                else type(item) is SampleRecord and not item.meta.is_tombstone
                for item in got
            )
            # A list that ends with a snapshot: the runner's stats are the snapshot's too.
            if ready >= need and got and type(got[-1]) is Holdings:
                kept = kept_records(runner.ops)  # what the snapshot describes, as it is
                break
        else:
            return None
    except FetchError:
        raise
    except Exception:  # the worker meets it again, and reports it with its lane
        return None
    finally:
        stream.close()
    snapshot: Holdings = items[-1]
    held = {
        "next": snapshot.next_local,
        "offset": snapshot.offset,
        "ops": packed(snapshot.ops, runner.labels),
        "kept": kept,
    }
    first, *rest = runner.runs
    resumed = {
        **start,
        "runs": [{**first, "held": held}, *rest],
        "skip_offset": 0,  # the snapshot says where the chunk was read up to
        "op_stats": runner.stats_now(),
    }
    return items, resumed
