"""Every field of a real state, edited and re-sealed with a valid checksum: the edit is refused
(``CheckpointCorruptError``/``CheckpointMismatchError`` on load, or ``ReplayDivergenceError``
before anything is handed over), or the resumed stream is provably the same. ``zephon inspect``
shows none of them with a traceback, and refuses every one the loader finds corrupt but for the
few checks that need the pipeline."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pipeline_kit import WindowShuffle, fingerprint_item

import zephon
from zephon.cli import main
from zephon.compact import pack_ints, pack_json, unpack_json
from zephon.errors import (
    CheckpointCorruptError,
    CheckpointError,
    ReplayDivergenceError,
    ZephonError,
)
from zephon.ops import ensure_mixture, pack_sequences, shuffle, tokenize
from zephon.ops.basic import fetch, filter_records, map_transform
from zephon.ops.batching import batch
from zephon.runtime.checkpoint.format import seal
from zephon.sources.memory import ListSource, RangeSource
from zephon.sources.mixture import MixtureSource


def _double(payload: dict) -> dict:
    return {**payload, "twice": payload["idx"] * 2}


def _not_seven(payload: dict) -> bool:
    return payload["idx"] % 7 != 0


def _texts(dataset: int, n: int = 80, chunk_size: int = 8) -> ListSource:
    items = [{"text": "xy" * (3 + (i * 7919 + dataset) % 20)} for i in range(n)]
    return ListSource(items, dataset_id=dataset, chunk_size=chunk_size)


PIPELINES: dict[str, Callable[[], zephon.Pipeline]] = {
    # epoch path: a reordering, stateful operator and a final batch
    "epoch": lambda: zephon.Pipeline(
        RangeSource(150, chunk_size=10),
        [fetch(), WindowShuffle(4, seed=3), batch(4)],
        lanes=2,
        epoch_chunks=2,
    ),
    # monotone and indexable: restore skips at the source
    "indexable": lambda: zephon.Pipeline(
        RangeSource(150, chunk_size=16), [fetch(), map_transform(_double), batch(3)], lanes=2
    ),
    # monotone, not indexable: the replay filter
    "monotone": lambda: zephon.Pipeline(
        RangeSource(150, chunk_size=16), [fetch(), filter_records(_not_seven)], lanes=2
    ),
    # epoch path with snapshots of what the shuffle holds: packed records, state, open offsets
    "held": lambda: zephon.Pipeline(
        RangeSource(150, chunk_size=10),
        [fetch(), shuffle(8, seed=3), batch(4)],
        lanes=2,
        epoch_chunks=4,
        micro_batch=8,
    ),
    # ensure_mixture's running totals carried across epochs
    "mixture": lambda: zephon.Pipeline(
        MixtureSource({"a": _texts(0), "b": _texts(1)}, {"a": 0.5, "b": 0.5}, chunk_size=8),
        [fetch(), tokenize(max_len=40), ensure_mixture({"a": 0.5, "b": 0.5}, buffer_size=4)],
        lanes=2,
        epoch_chunks=1,
    ),
}
STEPS = {"epoch": 9, "indexable": 11, "monotone": 30, "held": 9, "mixture": 25}
# What ``zephon inspect`` cannot check without the pipeline: what an operator makes of its carry
# state (and how many operators there are), whether a lane starts an epoch (the eviction path),
# and, on the source-skip path, the replay cursor's sample and count.
NEEDS_THE_PIPELINE = {"carry", "start", "cursor", "count"}


def _paths(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """Every path into a JSON value, containers included."""
    yield path
    if isinstance(value, dict):
        for key in value:
            yield from _paths(value[key], (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _paths(item, (*path, i))


def _get(value: Any, path: tuple) -> Any:
    for key in path:
        value = value[key]
    return value


def _edits(value: Any) -> list[Any]:
    out: list[Any] = [None, "x", True, 1.5, [], {}]
    if type(value) is int:
        out += [value + 1, value - 1, -1, 2**70, str(value)]
    elif type(value) is bool:
        out += [not value, str(value).lower(), int(value)]
    elif isinstance(value, str):
        out += ["", value[:-1], value + "0", value.upper()]
    elif isinstance(value, list):
        out += [value[:-1], [*value, *value[-1:]], list(reversed(value))]
    elif isinstance(value, dict):
        out += [{k: v for k, v in list(value.items())[:-1]}, {**value, "extra": 1}]
    return [e for e in out if not (type(e) is type(value) and e == value)]


def _mutations(state: dict) -> Iterator[tuple[tuple, Any, dict]]:
    body = {k: v for k, v in state.items() if k != "checksum"}
    for path in _paths(body):
        if not path:
            continue
        for edit in _edits(_get(body, path)):
            mutated = copy.deepcopy(body)
            _get(mutated, path[:-1])[path[-1]] = edit
            yield path, edit, seal(mutated)


def _stream(loader: Any) -> list[tuple]:
    return [fingerprint_item(item) for item in loader]


def _carried_total(path: tuple) -> bool:
    """Whether ``path`` is one of ensure_mixture's carried running totals: an edit to another
    integer is another valid state (nothing but the checksum, which a re-sealed state passes,
    says what the totals were), and the resumed stream steers the mixture from those totals."""
    return len(path) == 7 and path[::2] == ("lane_states", "carry", "totals", 1)


def _state(kind: str) -> dict[str, Any]:
    loader = iter(PIPELINES[kind]())
    for _ in range(STEPS[kind]):
        next(loader)
    state = loader.state_dict()
    loader.close()
    return state


@pytest.mark.filterwarnings("ignore::zephon.errors.MixtureDropWarning")
@pytest.mark.parametrize("kind", sorted(PIPELINES))
def test_every_edited_field_is_refused_or_changes_nothing(kind: str) -> None:
    make = PIPELINES[kind]
    state = _state(kind)
    expected = _stream(make().iter(state=state))
    assert expected, "the checkpoint must leave something to resume"
    outcomes = {"refused": 0, "diverged": 0, "same": 0, "other totals": 0}
    for path, edit, mutated in _mutations(state):
        where = f"{'.'.join(map(str, path))} = {edit!r}"
        try:
            resumed = make().iter(state=mutated)
        except CheckpointError:
            outcomes["refused"] += 1
            continue
        except Exception as exc:
            raise AssertionError(f"{where}: {type(exc).__name__}: {exc}") from exc
        stream: list[tuple] = []
        try:
            stream.extend(fingerprint_item(item) for item in resumed)
        except ReplayDivergenceError:
            assert not stream, f"{where}: diverged after {len(stream)} items were handed over"
            outcomes["diverged"] += 1
            continue
        except Exception as exc:
            raise AssertionError(f"{where}: {type(exc).__name__}: {exc}") from exc
        if _carried_total(path) and stream != expected:
            outcomes["other totals"] += 1  # another valid state: the mixture steers from there
            continue
        assert stream == expected, f"{where} was accepted and changed the stream"
        outcomes["same"] += 1
    assert outcomes["refused"] > 100


def _inspected(state: dict[str, Any], path: Path, capsys: Any) -> bool:
    """Whether ``zephon inspect`` shows ``state`` (a refusal is one line, never a traceback)."""
    path.write_text(json.dumps(state))
    status = main(["inspect", str(path)])
    err = capsys.readouterr().err
    if status:
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return status == 0


def _loads(make: Callable[[], zephon.Pipeline], state: dict[str, Any]) -> bool | None:
    """Whether the loader takes ``state`` (None: refused as another pipeline's); its first item
    too, where operators get their carry states and snapshots."""
    try:
        loader = make().iter(state=state)
    except CheckpointCorruptError:
        return False
    except CheckpointError:
        return None
    try:
        next(loader, None)
    except ZephonError:  # a divergence, or an operator refusing what it was given back
        pass
    finally:
        loader.close()
    return True


@pytest.mark.filterwarnings("ignore::zephon.errors.MixtureDropWarning")
@pytest.mark.parametrize("kind", sorted(PIPELINES))
def test_inspect_refuses_what_the_loader_finds_corrupt_without_a_traceback(
    kind: str, tmp_path: Path, capsys: Any
) -> None:
    state = _state(kind)
    assert _inspected(state, tmp_path / "state.json", capsys)
    missed = []
    for path, edit, mutated in _mutations(state):
        shown = _inspected(mutated, tmp_path / "state.json", capsys)
        if shown and _loads(PIPELINES[kind], mutated) is False:
            field = next((p for p in path[2:] if type(p) is str), None) if len(path) > 2 else None
            if path[0] != "lane_states" or field not in NEEDS_THE_PIPELINE:
                missed.append(f"{'.'.join(map(str, path))} = {edit!r}")
    assert not missed, f"inspect showed states the loader refuses as corrupt: {missed}"


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=10,
)


@pytest.fixture(scope="module")
def held_state() -> dict[str, Any]:
    return _state("held")


@settings(max_examples=150)
@given(
    field=st.sampled_from(["records", "open", "state", "next", "offset"]),
    ints=st.lists(st.integers(0, 2**62), max_size=12),
    value=_JSON,
)
def test_any_snapshot_content_is_taken_or_refused_never_failing_raw(
    held_state: dict[str, Any], tmp_path_factory: Any, field: str, ints: list[int], value: Any
) -> None:
    body = copy.deepcopy({k: v for k, v in held_state.items() if k != "checksum"})
    held = body["lane_states"][0]["held"]
    holder = next(e for e in held["ops"] if e is not None)
    if field in ("records", "state"):
        holder[field] = pack_ints(ints) if field == "records" else pack_json(value)
    else:
        held[field] = pack_ints(ints) if field == "open" else value
    mutated = seal(body)
    path = tmp_path_factory.mktemp("inspect") / "state.json"
    path.write_text(json.dumps(mutated))
    assert main(["inspect", str(path)]) in (0, 1)  # anything else raises through main
    _loads(PIPELINES["held"], mutated)  # anything but a Zephon error raises here


def _holders() -> zephon.Pipeline:
    """Every built-in operator that describes what it holds, in one chain with snapshots."""
    texts = {name: _texts(i, 600, 32) for i, name in enumerate("ab")}
    return zephon.Pipeline(
        MixtureSource(texts, {"a": 0.5, "b": 0.5}, chunk_size=32),
        [
            fetch(),
            tokenize(max_len=40, split_long_samples=True),
            ensure_mixture({"a": 0.5, "b": 0.5}, buffer_size=16),
            shuffle(64, seed=4),
            pack_sequences(128, open_bins=8),
            batch(4),
        ],
        lanes=2,
        epoch_chunks=32,
    )


@pytest.fixture(scope="module")
def holders_state() -> dict[str, Any]:
    loader = iter(_holders())
    for _ in range(30):
        next(loader)
    state = loader.state_dict()
    loader.close()
    assert state["lane_states"][0]["held"] is not None
    return state


@pytest.mark.filterwarnings("ignore::zephon.errors.MixtureDropWarning")
@settings(max_examples=200)
@given(
    holder=st.integers(0, 2),
    key=st.integers(0, 20),
    value=_JSON | st.sampled_from([float("inf"), float("nan"), 2**70, -1, [[2**70] * 5]]),
)
def test_any_held_operator_state_is_taken_or_refused_never_failing_raw(
    holders_state: dict[str, Any], holder: int, key: int, value: Any
) -> None:
    body = copy.deepcopy({k: v for k, v in holders_state.items() if k != "checksum"})
    entry = [e for e in body["lane_states"][0]["held"]["ops"] if e is not None][holder]
    state = unpack_json(entry["state"])
    state[sorted(state)[key % len(state)]] = value
    entry["state"] = pack_json(state)
    _loads(_holders, seal(body))  # anything but a Zephon error raises here
