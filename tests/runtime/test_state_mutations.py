"""Every field of a real state, edited and re-sealed with a valid checksum: the edit is refused
(``CheckpointCorruptError``/``CheckpointMismatchError`` on load, or ``ReplayDivergenceError``
before anything is handed over), or the resumed stream is provably the same."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pipeline_kit import WindowShuffle, fingerprint_item

import zephon
from zephon.errors import CheckpointError, ReplayDivergenceError
from zephon.ops.basic import fetch, filter_records, map_transform
from zephon.ops.batching import batch
from zephon.runtime.checkpoint import seal
from zephon.sources.memory import RangeSource


def _double(payload: dict) -> dict:
    return {**payload, "twice": payload["idx"] * 2}


def _not_seven(payload: dict) -> bool:
    return payload["idx"] % 7 != 0


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
}
STEPS = {"epoch": 9, "indexable": 11, "monotone": 30}


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


@pytest.mark.parametrize("kind", sorted(PIPELINES))
def test_every_edited_field_is_refused_or_changes_nothing(kind: str) -> None:
    make = PIPELINES[kind]
    loader = iter(make())
    for _ in range(STEPS[kind]):
        next(loader)
    state = loader.state_dict()
    loader.close()
    expected = _stream(make().iter(state=state))
    assert expected, "the checkpoint must leave something to resume"
    outcomes = {"refused": 0, "diverged": 0, "same": 0}
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
        assert stream == expected, f"{where} was accepted and changed the stream"
        outcomes["same"] += 1
    assert outcomes["refused"] > 100
