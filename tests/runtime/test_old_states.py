"""States written by an earlier Zephon (``old_states/``, written by ``old_states_kit.py`` with
state version 4) resume exactly: a rank's states at several steps, a job state, a state with
steps to skip and one with retired samples, of a text, mixture, packing and SFT pipeline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from old_states_kit import PIPELINES, stream_digest

HERE = Path(__file__).parent / "old_states"


def saved(name: str) -> dict[str, Any]:
    return json.loads((HERE / f"{name}.json").read_text())


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_the_pipeline_delivers_what_it_did_when_the_states_were_written(name):
    data = saved(name)
    full = list(iter(PIPELINES[name]()))
    assert (len(full), stream_digest(full)) == (data["items"], data["full"])


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_an_old_state_resumes_exactly_where_it_was_taken(name):
    data = saved(name)
    pipeline = PIPELINES[name]()
    assert set(data["states"]) == {"at 0", "at 3", "at 11", "job", "skip", "retired"}
    for key, entry in data["states"].items():
        with pipeline.iter(state=entry["state"]) as loader:
            rest = list(loader)
        assert stream_digest(rest) == entry["rest"], f"{name}: the state {key!r}"


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_an_old_state_resumed_saves_a_state_that_resumes_the_same_way(name):
    pipeline = PIPELINES[name]()
    for key, entry in saved(name)["states"].items():
        loader = pipeline.iter(state=entry["state"])
        head = [next(loader, None) for _ in range(2)]
        again = pipeline.iter(state=loader.state_dict())
        rest = [item for item in head if item is not None] + list(again)
        loader.close()
        assert stream_digest(rest) == entry["rest"], f"{name}: the state {key!r}, saved again"
