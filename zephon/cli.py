"""Command line: ``zephon demo`` and ``zephon inspect CHECKPOINT``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import zephon


def inspect_checkpoint(path: str, out: Any = None) -> int:
    """Print what a checkpoint holds, readably."""
    out = out or sys.stdout
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
    sub.add_parser("demo", help="run, checkpoint, kill, restore, and prove the stream exact")
    insp = sub.add_parser("inspect", help="show what a checkpoint file holds")
    insp.add_argument("checkpoint")
    bench = sub.add_parser("bench", help="SPEC §5 benchmarks against same-process baselines")
    bench.add_argument("--quick", action="store_true", help="smaller sizes, a minute or two")
    args = parser.parse_args(argv)
    if args.command == "bench":
        from zephon.bench import run_bench

        return run_bench(quick=args.quick)
    if args.command == "demo":
        from zephon.demo import run_demo

        return run_demo()
    return inspect_checkpoint(args.checkpoint)


if __name__ == "__main__":
    sys.exit(main())
