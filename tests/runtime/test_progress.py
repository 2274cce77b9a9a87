"""What a lane consumed of its epoch by position (zephon/runtime/checkpoint/progress.py): the
ranges a checkpoint keeps say exactly which offsets were open, and a damaged field is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import zephon
from zephon.compact import pack_bits, pack_ints
from zephon.errors import CheckpointCorruptError
from zephon.ops.basic import fetch
from zephon.ops.batching import batch
from zephon.ops.shuffle import shuffle
from zephon.runtime.checkpoint.layout import Run
from zephon.runtime.checkpoint.progress import EpochProgress, after_change
from zephon.sources.memory import RangeSource
from zephon.types import SampleCursor

SIZES = [7, 3, 9]  # offsets of lane chunks 4, 5, 6 (at positions 40, 50, 60)


@st.composite
def epochs(draw: st.DrawFn) -> tuple[int, set[tuple[int, int]], set[tuple[int, int]]]:
    """Chunks opened (lane chunks 4 .. 4 + opened), which of their offsets are open, and which
    of those had a part delivered."""
    opened = draw(st.integers(0, len(SIZES)))
    cells = [(40 + 10 * k, o) for k in range(opened) for o in range(SIZES[k])]
    open_ = set(draw(st.lists(st.sampled_from(cells), unique=True))) if cells else set()
    partial = set(draw(st.lists(st.sampled_from(sorted(open_)), unique=True))) if open_ else set()
    return opened, open_, partial


@given(epochs(), st.integers(0, 8), st.integers(0, 8))
def test_the_offsets_closed_are_exactly_those_opened_and_not_open(
    epoch: tuple[int, set[tuple[int, int]], set[tuple[int, int]]], first: int, width: int
) -> None:
    opened, open_, partial = epoch
    pairs = sorted(open_)
    progress = EpochProgress.of_open(
        4,
        4 + opened,
        np.array([p for p, _ in pairs], dtype=np.int64),
        np.array([o for _, o in pairs], dtype=np.int64),
        partial | {(99, 0)},  # a sample closed since: not kept
    )
    again = EpochProgress.decode(progress.encode(), "progress", 4, 4)
    assert again.partly_delivered == partial
    for k, size in enumerate(SIZES):
        lo = min(first, size)
        hi = min(size, lo + width)
        position = 40 + 10 * k
        got = again.closed(4 + k, position, lo, hi)
        expected = [k < opened and (position, o) not in open_ for o in range(lo, hi)]
        assert (got.tolist() if got is not None else [False] * (hi - lo)) == expected


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("next", 9, r"progress.next must be a lane chunk in \[4, 8\]"),
        ("next", "5", r"progress.next"),
        ("chunks", pack_ints([40, 0]), r"progress.chunks covers no offset"),
        ("chunks", pack_ints([40]), r"progress.chunks must hold \(chunk, offsets\) pairs"),
        ("chunks", pack_ints([40, 3, 40, 2]), r"progress.chunks names a chunk twice"),
        ("open", pack_bits(np.ones(9, dtype=bool)), r"progress.open not 3 packed bits"),
        ("open", "not base64!", r"progress.open"),
        ("partial", pack_ints([40]), r"progress.partial must hold \(chunk, offset\) pairs"),
        ("partial", 1, r"progress.partial"),
    ],
)
def test_a_damaged_field_is_refused_naming_it(field: str, value: object, message: str) -> None:
    good = EpochProgress.of_open(4, 5, np.array([40]), np.array([2]), set()).encode()
    with pytest.raises(CheckpointCorruptError, match=message):
        EpochProgress.decode({**good, field: value}, "progress", 4, 4)


def test_a_run_goes_on_by_position_unless_a_sample_was_partly_delivered() -> None:
    cursor = SampleCursor(40, 2, (0, 0, 2))
    clean = EpochProgress.of_open(4, 5, np.array([40]), np.array([5]), set())
    split = EpochProgress.of_open(4, 5, np.array([40]), np.array([5]), {(40, 5)})
    run = Run(0, 1, 4, None, [None], cursor, 3, 77, None, clean)
    moved = after_change(run)
    assert (moved.cursor, moved.count, moved.progress, moved.start) == (None, 0, None, 4)
    assert moved.screened is not None and moved.screened.next == 5
    assert after_change(Run(0, 1, 4, None, [None], cursor, 3, 77, None, split)).cursor == cursor
    assert after_change(Run(0, 1, 4, None, [None], cursor, 3, 77, None, None)).cursor == cursor


def test_a_lane_reading_a_chunk_of_a_million_samples_resumes() -> None:
    def make() -> zephon.Pipeline:
        ops = [fetch(), shuffle(64, seed=1), batch(4)]
        return zephon.Pipeline(RangeSource(2_000_000, chunk_size=1_000_000), ops, lanes=1)

    full = make().iter()
    head = [next(full) for _ in range(100)]
    reference = [list(next(full).payload["idx"]) for _ in range(50)]
    full.close()
    loader = make().iter()
    for _ in head:
        next(loader)
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    assert state["lane_states"][0]["progress"] is not None  # its open offsets, as bits
    resumed = make().iter(state=state)
    assert [list(next(resumed).payload["idx"]) for _ in range(50)] == reference
    resumed.close()


def test_the_open_offsets_of_a_large_chunk_are_read_back() -> None:
    offsets = np.arange(900_000, 1_000_000, dtype=np.int64)  # the end of the chunk still open
    progress = EpochProgress.of_open(4, 5, np.full(len(offsets), 40), offsets, set())
    again = EpochProgress.decode(progress.encode(), "progress", 4, 4)
    assert np.array_equal(again.open, progress.open)
