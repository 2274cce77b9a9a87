"""Command line: ``zephon demo`` and ``zephon inspect CHECKPOINT``."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zephon
from zephon.ops import batch, fetch, filter_records, map_transform
from zephon.sources import RangeSource


def _square(payload: dict) -> dict:
    return {"idx": payload["idx"], "square": payload["idx"] ** 2}


def _not_multiple_of_seven(payload: dict) -> bool:
    return payload["idx"] % 7 != 0


def demo_pipeline(n: int) -> zephon.Pipeline:
    """The demo's pipeline: a shuffled range through map, filter and batch on two lanes."""
    return zephon.Pipeline(
        RangeSource(n, chunk_size=512, shuffle=True, seed=7, passes=2),
        [fetch(), map_transform(_square), filter_records(_not_multiple_of_seven), batch(64)],
        lanes=2,
    )


def _ids(item: Any) -> list:
    return [(r.cursor.chunk_id, r.cursor.chunk_offset, r.cursor.lineage) for r in item]


def run_demo(n: int = 200_000, out: Any = sys.stdout) -> int:
    """Run, checkpoint mid-run, drop the loader, restore from the file and prove the rest equal."""
    pipeline = demo_pipeline(n)
    say = lambda text: print(text, file=out, flush=True)  # noqa: E731
    say(pipeline.compile().describe())
    start = time.perf_counter()
    reference = [_ids(b) for b in iter(pipeline)]
    elapsed = time.perf_counter() - start
    records = sum(len(b) for b in reference)
    say(
        f"uninterrupted: {len(reference)} batches, {records} records "
        f"in {elapsed:.2f} s ({records / elapsed:,.0f} records/s)"
    )

    stop_at = len(reference) // 2 + 17
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "loader.json"
        loader = iter(pipeline)
        head = []
        for step, item in enumerate(loader, 1):
            head.append(_ids(item))
            if step == stop_at:
                zephon.save_checkpoint(path, loader.state_dict())
                break
        loader.close()  # the "crash": everything in memory is gone
        say(f"checkpointed at batch {stop_at} ({path.stat().st_size} bytes), loader killed")
        resumed = pipeline.iter(state=zephon.load_checkpoint(path))
        tail = [_ids(b) for b in resumed]
    stats = resumed.stats()
    same = head + tail == reference
    say(f"resumed: {len(tail)} more batches, {stats['replayed']} records replayed to restore")
    say(f"resumed stream identical to the uninterrupted one: {'yes' if same else 'NO'}")
    say(f"stats: {json.dumps({k: v for k, v in stats.items() if k != 'mixture'})}")
    return 0 if same else 1


def inspect_checkpoint(path: str, out: Any = sys.stdout) -> int:
    """Print what a checkpoint holds, readably."""
    state = zephon.load_checkpoint(path)
    print(f"{path}: Zephon loader state v{state['version']}", file=out)
    print(
        f"  pipeline fingerprint {state['fingerprint'][:16]}…, rank {state['rank']}"
        f"/{state['world_size']}, {state['lanes']} lane(s), next lane {state['next_lane']}",
        file=out,
    )
    for lane in state["lane_states"]:
        where = "finished" if lane["finished"] else f"restarts at lane chunk {lane['start']}"
        cursor = lane["cursor"]
        replay = (
            f"replays {lane['count']} record(s) up to cursor {cursor}"
            if cursor
            else "nothing to replay"
        )
        print(f"  lane {lane['lane']}: {where}, {replay}", file=out)
    print(f"  counters: {json.dumps(state['counters'])}", file=out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zephon", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run, checkpoint, kill, restore, and prove the stream exact")
    demo.add_argument("--samples", type=int, default=200_000)
    insp = sub.add_parser("inspect", help="show what a checkpoint file holds")
    insp.add_argument("checkpoint")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return run_demo(args.samples)
    return inspect_checkpoint(args.checkpoint)


if __name__ == "__main__":
    sys.exit(main())
