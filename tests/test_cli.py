"""The command line, run as a user runs it (a subprocess): the demo tells the whole story and exits
0; ``--version`` and ``--help`` are plain; ``inspect`` reads a loader state from a JSON file, a
``save_checkpoint`` file or a ``torch.save`` file (under any key), and every failure is one
friendly line on stderr with a non-zero exit, never a traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import zephon
from zephon.cli import DISTRIBUTION, main
from zephon.ops import batch, fetch
from zephon.runtime.checkpoint.format import seal, unseal
from zephon.runtime.checkpoint.schema import STATE_VERSION
from zephon.sources import RangeSource

REPO = Path(__file__).resolve().parents[1]


def zephon_cli(
    *args: str, timeout: float = 120, **streams: Any
) -> subprocess.CompletedProcess[str]:
    """``python -m zephon ARGS`` from the checkout; stdout and stderr captured unless given."""
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **streams}
    return subprocess.run(
        [sys.executable, "-m", "zephon", *args], text=True, timeout=timeout, cwd=REPO, **streams
    )


def one_friendly_line(done: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a failed command (no traceback)."""
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def loader_state(lanes: int = 2, steps: int = 15) -> dict[str, Any]:
    loader = iter(zephon.Pipeline(RangeSource(100, chunk_size=10), [fetch()], lanes=lanes))
    for _ in range(steps):
        next(loader)
    state = loader.state_dict()
    loader.close()
    return state


@pytest.mark.slow
def test_demo_proves_the_resumed_stream_identical():
    done = zephon_cli("demo", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Resumed stream identical to the uninterrupted run: YES" in done.stdout
    assert "packing fill" in done.stdout and "realized token mixture" in done.stdout


def test_version_names_the_distribution_and_its_version():
    done = zephon_cli("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{DISTRIBUTION} {zephon.__version__}"


def test_help_lists_every_command_in_plain_text():
    done = zephon_cli("--help")
    assert done.returncode == 0, done.stderr
    for command in ("demo", "inspect", "bench"):
        assert f"  {command} " in done.stdout, done.stdout
    for command in ("", "demo", "inspect", "bench"):
        text = zephon_cli(*([command] if command else []), "--help").stdout
        assert "``" not in text and "SPEC" not in text, text


def test_inspect_reads_a_plain_json_state_file(tmp_path):
    path = tmp_path / "state.json"
    path.write_text(json.dumps(loader_state()))
    done = zephon_cli("inspect", str(path))
    assert done.returncode == 0, done.stderr
    assert f"Zephon loader state v{STATE_VERSION}" in done.stdout
    assert "2 lane(s)" in done.stdout and "lane 0:" in done.stdout and "lane 1:" in done.stdout


def test_inspect_reads_a_save_checkpoint_file(tmp_path):
    path = tmp_path / "loader.json"
    zephon.save_checkpoint(path, loader_state(lanes=3))
    done = zephon_cli("inspect", str(path))
    assert done.returncode == 0, done.stderr
    assert "3 lane(s)" in done.stdout and "lane 2:" in done.stdout


def test_inspect_shows_lanes_and_replay_positions_in_process(tmp_path, capsys):
    path = tmp_path / "state.json"
    zephon.save_checkpoint(path, loader_state())
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "2 lane(s)" in text and "replays" in text


def test_inspect_shows_the_lane_history_of_a_relaned_state(tmp_path, capsys):
    pipeline = zephon.Pipeline(RangeSource(100, chunk_size=10), [fetch()], lanes=3)
    with pytest.warns(zephon.RelaneWarning):
        loader = pipeline.iter(state=loader_state(lanes=2, steps=3))
    next(loader)
    zephon.save_checkpoint(tmp_path / "state.json", loader.state_dict())
    loader.close()
    assert main(["inspect", str(tmp_path / "state.json")]) == 0
    text = capsys.readouterr().out
    assert "lane history: 2 -> 3 lanes (re-laned 1 time(s)" in text
    assert "finishing lane 0 of generation 0" in text


# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates with a UserWarning.
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_inspect_finds_a_loader_state_nested_in_a_torch_save_file(tmp_path):
    torch = pytest.importorskip("torch")
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    from zephon.integrations.torch import as_torch_dataset

    pipeline = zephon.Pipeline(RangeSource(40, chunk_size=5), [fetch(), batch(4)], lanes=2)
    dataloader = stateful.StatefulDataLoader(
        as_torch_dataset(pipeline), batch_size=None, num_workers=0
    )
    it = iter(dataloader)
    for _ in range(3):
        next(it)
    path = tmp_path / "step-3.pt"
    torch.save(
        {"model": {"w": torch.zeros(3)}, "step": 3, "train": {"data": dataloader.state_dict()}},
        path,
    )
    done = zephon_cli("inspect", str(path))
    assert done.returncode == 0, done.stderr
    assert "['train']['data']" in done.stdout and "2 lane(s)" in done.stdout


def test_inspect_of_a_json_file_never_imports_torch(tmp_path):
    path = tmp_path / "state.json"
    path.write_text(json.dumps(loader_state()))
    code = (
        "import sys; from zephon.cli import main; "
        f"assert main(['inspect', {str(path)!r}]) == 0; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=REPO)


def test_inspect_a_missing_file_prints_one_line_and_fails(tmp_path):
    missing = tmp_path / "missing.json"
    line = one_friendly_line(zephon_cli("inspect", str(missing)))
    assert str(missing) in line and "no such file" in line.lower()


@pytest.mark.parametrize(
    "content",
    [b"not json at all", b'{"step": 3}', b"\x80\x04garbage", b"[" * 100_000 + b"]" * 100_000],
    ids=["not-json", "no-state", "not-a-torch-file", "nested-too-deep"],
)
def test_inspect_a_file_without_a_loader_state_prints_one_line_and_fails(tmp_path, content):
    path = tmp_path / "thing.bin"
    path.write_bytes(content)
    line = one_friendly_line(zephon_cli("inspect", str(path)))
    assert str(path) in line


def test_inspect_a_damaged_state_prints_one_line_and_fails(tmp_path):
    state = loader_state()
    state["next_lane"] = 1 - state["next_lane"]
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    assert "checksum" in one_friendly_line(zephon_cli("inspect", str(path)))


def test_inspect_into_a_closed_pipe_prints_one_line_and_fails(tmp_path):
    path = tmp_path / "state.json"
    path.write_text(json.dumps(loader_state()))
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `zephon inspect state.json | head` once head has exited
    try:
        done = zephon_cli("inspect", str(path), stdout=write_end, stderr=subprocess.PIPE)
    finally:
        os.close(write_end)
    assert "pipe" in one_friendly_line(done).lower()


def test_inspect_shows_a_job_state_readably(tmp_path):
    states = []
    for rank in range(2):
        pipeline = zephon.Pipeline(
            zephon.sources.RangeSource(40, chunk_size=4),
            [zephon.ops.fetch()],
            lanes=4,
            rank=rank,
            world_size=2,
        )
        loader = iter(pipeline)
        for _ in range(6):
            next(loader)
        states.append(loader.state_dict())
    path = tmp_path / "job.json"
    path.write_text(json.dumps(zephon.merge_states(states)))
    done = zephon_cli("inspect", str(path))
    assert done.returncode == 0, done.stderr
    assert "Zephon job state" in done.stdout
    assert "4 lane(s); resumes on any world size dividing the lanes" in done.stdout
    assert done.stdout.count("item(s) delivered") == 4


def test_inspect_shows_what_was_done_to_a_run(tmp_path, capsys):
    pipeline = zephon.Pipeline(RangeSource(100, chunk_size=10), [fetch()], lanes=2)
    loader = pipeline.iter(state=loader_state(lanes=2, steps=3), retire=[(0, 0, 50)])
    next(loader)
    state = zephon.skip_steps(loader.state_dict(), 2)
    loader.close()
    zephon.save_checkpoint(tmp_path / "state.json", state)
    assert main(["inspect", str(tmp_path / "state.json")]) == 0
    text = capsys.readouterr().out
    assert "history: at global step 1: retired 1 sample(s)" in text
    assert "history: at global step 2: skipped 2 global step(s)" in text
    assert "still to skip before the next item: 2 global step(s)" in text


def _resealed(edit: Any) -> dict[str, Any]:
    """A real state, edited by ``edit`` and sealed again: its checksum is valid."""
    body = {k: v for k, v in loader_state().items() if k != "checksum"}
    edit(body)
    return seal(body)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda s: s["lane_states"][0].pop("cursor"), r"lane_states\[0\] must have exactly"),
        (lambda s: s["lane_states"][1].update(delivered=-3), r"lane_states\[1\]\.delivered"),
        (lambda s: s["lane_states"][0].update(cursor=[0, 1, "x", []]), r"cursor\[2\]"),
        (lambda s: s.update(layout=[]), "layout must be a non-empty list"),
        (lambda s: s.update(counters="x"), "counters must have exactly the fields"),
        (lambda s: s.update(next_lane=7), r"next_lane must be in \[0, 1\]"),
        (lambda s: s["pipeline"].update(lanes=3), "fingerprint does not match"),
    ],
    ids=["missing", "negative", "cursor", "layout", "counters", "next_lane", "pipeline"],
)
def test_inspect_of_a_resealed_malformed_state_names_the_field_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Any, field: str
) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps(_resealed(edit)))
    assert main(["inspect", str(path)]) == 1
    out, err = capsys.readouterr()
    assert not out  # nothing of it shown as if it were valid
    assert re.search(field, err) and str(path) in err, err


@pytest.mark.parametrize(
    ("content", "named"),
    [
        (b'{"time": 1, "elapsed": 0.5, "rank": 0, "step": 1, "stats": {}}\nnot json\n', "line 2"),
        (b'{"a": 1}\n{"b": 2}\n', "line 1"),
        (b"\xff\xfe binary \x00\n" * 3, "line 1"),
    ],
    ids=["damaged-line", "other-json-lines", "binary"],
)
def test_report_of_a_file_that_is_not_a_metrics_log_prints_one_line_and_fails(
    tmp_path, content, named
):
    path = tmp_path / "run.jsonl"
    path.write_bytes(content)
    line = one_friendly_line(zephon_cli("report", str(path)))
    assert str(path) in line and named in line


def test_inspect_names_the_version_a_state_was_written_in(tmp_path, capsys):
    body = unseal(loader_state())
    old = {k: v for k, v in body.items() if k not in ("history", "skip", "retired", "served")}
    path = tmp_path / "state.json"
    path.write_text(json.dumps(seal({**old, "version": 3})))
    assert main(["inspect", str(path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith(f"Zephon loader state v3 (read as v{STATE_VERSION})")


@pytest.mark.parametrize("interval", ["-1", "0", "nan", "inf", "soon"])
def test_top_refuses_an_interval_that_is_not_a_positive_number_of_seconds(interval, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["top", "127.0.0.1:9", "--interval", interval])
    assert exited.value.code == 2
    assert "--interval: must be a positive number of seconds" in capsys.readouterr().err
