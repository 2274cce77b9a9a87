"""Command line: ``zephon demo``, ``zephon inspect FILE``, ``zephon bench``, the views of a
running job (``zephon top``, ``zephon explain``, ``zephon report``) and ``--version``.

Every failure a user can cause (a missing or damaged file, a closed output pipe) is one line on
stderr and exit status 1, never a traceback.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import pickle
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import zephon
from zephon.errors import CheckpointError, ZephonError
from zephon.runtime.checkpoint.format import FILE_FORMAT, state_from_checkpoint_bytes, unseal
from zephon.runtime.checkpoint.history import described as described_history
from zephon.runtime.checkpoint.saved_state import check_saved_state
from zephon.runtime.checkpoint.schema import JOB_FORMAT, STATE_FORMAT
from zephon.sources.locations import UriFilesystems, filesystem_and_path

_STATE_FORMATS = (STATE_FORMAT, JOB_FORMAT)

#: The name Zephon is published under on the package index (it is imported as ``zephon``).
DISTRIBUTION = "zephon-loader"

DESCRIPTION = "Zephon: deterministic, checkpointable data pipelines for ML training loops."
EXAMPLES = """\
examples:
  zephon demo
  zephon inspect loader.json            a loader.state_dict() or save_checkpoint file
  zephon inspect checkpoint-1000.pt     a torch.save file holding a loader state
  zephon bench --quick
  zephon top 127.0.0.1:9400             a running job's loader (zephon.observability.serve_metrics)
  zephon report run.jsonl               plots of a zephon.observability.MetricsLog file
"""

_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default (zip) format
_PICKLE_MAGIC = b"\x80"  # torch.save's legacy format starts with a pickle protocol opcode
_MAX_DEPTH = 32


class InspectError(ZephonError):
    """A file ``zephon inspect`` cannot show; the message names the file and what is wrong."""


def _read(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the file ``path`` names: a local path, or a URI of object storage
    (``s3://...``, where ``zephon.save_checkpoint`` writes too)."""
    if isinstance(path, str) and UriFilesystems.is_uri(path):
        fs, where = filesystem_and_path(path, None, "zephon inspect")
        with fs.open_input_stream(where) as f:
            data: bytes = f.read()
            return data
    return Path(path).read_bytes()


def _torch_load(path: str | os.PathLike[str], raw: bytes) -> Any:
    """A ``torch.save`` file's content, loaded safely (``weights_only``: plain data and tensors,
    never arbitrary pickled code); torch is imported only here."""
    try:
        import torch
    except ImportError:
        raise InspectError(
            f"{path} looks like a torch.save file; reading it needs torch "
            f'(pip install "{DISTRIBUTION}[torch]")'
        ) from None
    try:
        with warnings.catch_warnings():  # torch's notes on pickle protocols are not for us
            warnings.simplefilter("ignore")
            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise InspectError(
            f"{path} is not a torch.save file of plain data and tensors (torch.load with "
            "weights_only=True refused it; inspect never runs pickled code)"
        ) from None
    except (RuntimeError, EOFError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InspectError(f"{path} could not be read as a torch.save file: {first}") from None


def _states_in(obj: Any, where: str = "", depth: int = 0) -> Iterator[tuple[str, Any]]:
    """Every loader state held in ``obj``, with its key path (``['train']['loader']``)."""
    if isinstance(obj, dict):
        if obj.get("format") in _STATE_FORMATS:
            yield where, obj
            return
        if depth < _MAX_DEPTH:
            for key, value in obj.items():
                yield from _states_in(value, f"{where}[{key!r}]", depth + 1)
    elif isinstance(obj, (list, tuple)) and depth < _MAX_DEPTH:
        for i, value in enumerate(obj):
            yield from _states_in(value, f"{where}[{i}]", depth + 1)


def read_states(path: str | os.PathLike[str]) -> list[tuple[str, dict[str, Any], Any]]:
    """The loader states in a JSON state file, a ``save_checkpoint`` file or a ``torch.save``
    file (under any key, nested too), each with its key path, unsealed and checked field by
    field as far as that goes without the pipeline (``check_saved_state``), and the version it
    was written in (it is read as the current one)."""
    raw = _read(path)
    if raw.startswith((_ZIP_MAGIC, _PICKLE_MAGIC)):
        content = _torch_load(path, raw)
    else:
        try:
            content = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise InspectError(
                f"{path} is neither a JSON loader state, a save_checkpoint file nor a "
                f"torch.save file ({exc})"
            ) from None
        if isinstance(content, dict) and content.get("format") == FILE_FORMAT:
            # verifies the file's own checksum
            content = state_from_checkpoint_bytes(raw, str(path))
    found = list(_states_in(content))
    if not found:
        raise InspectError(
            f"{path} holds no Zephon loader state (a dict with format {STATE_FORMAT!r}, "
            "looked for under every key)"
        )
    checked = []
    for where, state in found:
        try:  # an older version reads as the current one
            body = check_saved_state(unseal(state, _STATE_FORMATS))
            checked.append((where, body, state["version"]))
        except CheckpointError as exc:
            raise InspectError(f"{path}{where}: {exc}") from None
    return checked


def inspect_checkpoint(path: str | os.PathLike[str], out: Any = None) -> int:
    """Print the loader state(s) a checkpoint file holds, readably; returns the exit status."""
    out = out or sys.stdout
    for where, state, written in read_states(path):
        version = f"v{written}" + (
            f" (read as v{state['version']})" if written != state["version"] else ""
        )
        if state["format"] == JOB_FORMAT:
            print(f"{path}{where}: Zephon job state {version} (all ranks)", file=out)
            print(
                f"  pipeline fingerprint {state['fingerprint'][:16]}…, {state['lanes']} lane(s); "
                "resumes on any world size dividing the lanes",
                file=out,
            )
        else:
            print(f"{path}{where}: Zephon loader state {version}", file=out)
            lanes = [lane["lane"] for lane in state["lane_states"]]
            shown = f"lanes {lanes[0]}..{lanes[-1]}" if lanes else "no lanes"
            print(
                f"  pipeline fingerprint {state['fingerprint'][:16]}…, rank {state['rank']}"
                f"/{state['world_size']} runs {shown} of {state['lanes']} lane(s), next lane "
                f"{state['next_lane']}",
                file=out,
            )
        history = [gen["lanes"] for gen in state["layout"]]
        if len(history) > 1:
            steps = " -> ".join(str(n) for n in history)
            print(
                f"  lane history: {steps} lanes (re-laned {len(history) - 1} time(s); every "
                "sample once, batches changed at each re-laning)",
                file=out,
            )
        for line in described_history(state):
            print(f"  history: {line}", file=out)
        for lane in state["lane_states"]:
            where_lane = (
                "finished" if lane["finished"] else f"restarts at lane chunk {lane['start']}"
            )
            if lane["run"] is not None:
                gen, old, end = lane["run"]
                where_lane = (
                    f"finishing lane {old} of generation {gen} (its chunks "
                    f"{lane['start']}..{end - 1}), then {len(lane['pending'])} more taken-over "
                    "run(s) before its own chunks"
                )
            if lane.get("held") is not None:
                where_lane += (
                    f", rebuilds its operators from a snapshot at lane chunk {lane['held']['next']}"
                )
            if lane.get("screened") is not None:
                where_lane += (
                    ", takes out at fetch what it consumed of the epoch before a resume with "
                    "changed operators"
                )
            cursor = lane["cursor"]
            replay = (
                f"replays {lane['count']} record(s) up to cursor {cursor}"
                if cursor
                else "nothing to replay"
            )
            print(
                f"  lane {lane['lane']}: {lane['delivered']} item(s) delivered, {where_lane}, "
                f"{replay}",
                file=out,
            )
        print(f"  counters: {json.dumps(state['counters'])}", file=out)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zephon",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"{DISTRIBUTION} {zephon.__version__}"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    sub.add_parser(
        "demo",
        help="run, checkpoint, SIGKILL, restore, and prove the stream exact",
        description="Run a small pipeline on two process lanes, SIGKILL a training process "
        "mid-run, restore from its last checkpoint and compare the streams byte for byte.",
    )
    insp = sub.add_parser(
        "inspect",
        help="show the loader state in a checkpoint file",
        description="Show the loader state in FILE: a JSON file of loader.state_dict(), a "
        "zephon.save_checkpoint file, or a torch.save file holding a loader state under any "
        "key (torch is needed only for the last); a local path or a URI (s3://...).",
    )
    insp.add_argument("checkpoint", metavar="FILE")
    bench = sub.add_parser(
        "bench",
        help="run the performance benchmarks against their baselines",
        description="Run the performance benchmarks, each against a baseline in the same "
        "process, and print one table of medians, ratios and targets.",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="smaller sizes, a few minutes (the full run: about a quarter of an hour)",
    )
    top = sub.add_parser(
        "top",
        help="a live view of a running job's loader, from its metrics endpoint",
        description="Show a running job's lanes, operators, mixture and throughput, read from "
        "the endpoint zephon.observability.serve_metrics serves, redrawn until Ctrl-C.",
    )
    top.add_argument("endpoint", metavar="ADDR:PORT")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.add_argument("--interval", type=_seconds, default=2.0, help="seconds between frames")
    why = sub.add_parser(
        "explain",
        help="name a running job's bottleneck, from its metrics endpoint",
        description="Say where a running job's loader spends its time and what to change.",
    )
    why.add_argument("endpoint", metavar="ADDR:PORT")
    rep = sub.add_parser(
        "report",
        help="plot a run from its metrics log",
        description="Draw throughput, mixture shares against their targets, restores and "
        "operator time from a zephon.observability.MetricsLog file into one PNG.",
    )
    rep.add_argument("log", metavar="RUN.jsonl")
    rep.add_argument(
        "-o", "--output", metavar="PNG", help="where to write (default: beside the log)"
    )
    return parser


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (``--interval``); argparse names the option."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _bench(quick: bool) -> int:
    """``zephon bench``: every performance target against its baseline (``zephon.bench``)."""
    from zephon.bench.report import run_bench

    result: int = run_bench(quick=quick)
    return result


def _run(args: argparse.Namespace) -> int:
    if args.command in ("bench", "demo"):
        zephon.show_progress(True)  # the library keeps them off; the command line shows them
    if args.command == "bench":
        return _bench(quick=args.quick)
    if args.command == "demo":
        from zephon.demo import run_demo

        return run_demo()
    if args.command in ("top", "explain", "report"):
        return _observe(args)
    return inspect_checkpoint(args.checkpoint)


def _observe(args: argparse.Namespace) -> int:
    from zephon.observability import commands

    try:
        if args.command == "top":
            commands.top(args.endpoint, once=args.once, interval=args.interval)
        elif args.command == "explain":
            print(commands.explain_endpoint(args.endpoint))
        else:
            print(commands.report(args.log, args.output))
    except ImportError as exc:  # an optional extra that is not installed
        raise ZephonError(
            f'zephon {args.command} needs {exc.name}: pip install "{DISTRIBUTION}[metrics]"'
        ) from None
    return 0


def _fail(message: str) -> int:
    print(f"zephon: {message}", file=sys.stderr, flush=True)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """The ``zephon`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        status = _run(args)
        sys.stdout.flush()  # a closed pipe shows up here, not at interpreter exit
    except BrokenPipeError:
        # The reader left (`zephon inspect FILE | head`): no more output, and none at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return _fail("the output pipe was closed before everything was written")
    except FileNotFoundError as exc:
        return _fail(f"{exc.filename}: no such file")
    except OSError as exc:
        return _fail(f"{exc.filename or args.command}: {exc.strerror or exc}")
    except ZephonError as exc:
        return _fail(str(exc))
    return status


if __name__ == "__main__":
    sys.exit(main())
