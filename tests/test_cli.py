"""The command line: the demo tells the whole story and exits 0; inspect reads a checkpoint."""

from __future__ import annotations

import subprocess
import sys

import zephon
from zephon.cli import main
from zephon.ops import fetch
from zephon.sources import RangeSource


def test_demo_proves_the_resumed_stream_identical():
    done = subprocess.run(
        [sys.executable, "-m", "zephon", "demo"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Resumed stream identical to the uninterrupted run: YES" in done.stdout
    assert "packing fill" in done.stdout and "realized token mixture" in done.stdout


def test_inspect_shows_lanes_and_replay_positions(tmp_path, capsys):
    loader = iter(zephon.Pipeline(RangeSource(100, chunk_size=10), [fetch()], lanes=2))
    for _ in range(15):
        next(loader)
    path = tmp_path / "state.json"
    zephon.save_checkpoint(path, loader.state_dict())
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "2 lane(s)" in text and "lane 0:" in text and "lane 1:" in text
