"""Specification of the packed records of finished bins (zephon/_core/packrows.pyx).

``reference_records`` below states the rule in plain Python, one line per decision; hypothesis
drives it and the compiled ``packed_records`` with the same bins (inputs with implicit and
explicit contributors, fragments that end their input or not, inputs of no, one or several
mixture components, side fields) and the results must be equal field by field. Bad input is
checked case by case.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon._core.packrows import packed_records
from zephon.ops.packing import _count_spread
from zephon.types import ContributorRef, SampleCursor, SampleMeta, SampleRecord

Spread = Callable[..., None]


def reference_records(
    blocks: list[np.ndarray],
    bin_records: list[list[SampleRecord]],
    frags: np.ndarray,
    lane_id: int,
    sides: tuple[tuple[str, bool], ...],
    spread: Spread,
) -> list[SampleRecord]:
    out = []
    at = 0
    for block, recs in zip(blocks, bin_records, strict=True):
        refs: list[ContributorRef] = []
        samples: dict[Hashable, int] = {}
        tokens: dict[Hashable, int] | None = {}
        primary = recs[0].meta.cursor.child(int(frags[at][0]))
        for rec in recs:
            start, size, n = (int(v) for v in frags[at])
            at += 1
            meta = rec.meta
            for ref in meta.contribution_refs():
                ends_input = start + size == n
                refs.append(ref if ends_input else ContributorRef(ref.cursor, False))
            sc, tc = meta.component_sample_counts, meta.component_token_counts
            if sc is None and tc is None:
                samples[meta.component] = samples.get(meta.component, 0) + 1
                tokens = None
            elif (sc is None or len(sc) == 1) and (tc is None or len(tc) == 1):
                comp = next(iter(sc if sc is not None else tc))  # type: ignore[arg-type]
                samples[comp] = samples.get(comp, 0) + 1
                if tc is None:
                    tokens = None
                elif tokens is not None:
                    tokens[comp] = tokens.get(comp, 0) + size
            else:
                if tc is None:
                    tokens = None
                spread(meta, n, start, size, samples, tokens)
        payload = {"tokens": block[0], "segment_ids": block[1], "positions": block[2]}
        for k, (name, is_float) in enumerate(sides, 3):
            payload[name] = block[k].view(np.float32) if is_float else block[k]
        meta = SampleMeta(
            primary,
            lane_id=lane_id,
            contributors=refs,
            component_sample_counts=samples,
            component_token_counts=tokens,
        )
        out.append(SampleRecord(meta, payload))
    assert at == len(frags)
    return out


def assert_same_records(got: list[SampleRecord], want: list[SampleRecord]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert type(g) is SampleRecord
        gm, wm = g.meta, w.meta
        assert gm.cursor == wm.cursor
        assert gm.lane_id == wm.lane_id
        assert gm.contributors == wm.contributors
        assert type(gm.contributors) is tuple
        assert gm.tags == wm.tags and not gm.is_tombstone and gm.component is None
        assert gm.component_sample_counts == wm.component_sample_counts
        assert gm.component_token_counts == wm.component_token_counts
        assert list(g.payload) == list(w.payload)
        for name, want_row in w.payload.items():
            row = g.payload[name]
            assert row.dtype == want_row.dtype and row.shape == want_row.shape
            assert np.array_equal(row.view(np.uint32), want_row.view(np.uint32))
            assert np.shares_memory(row, want_row)  # a view of the bin's block, not a copy
            assert row.flags.c_contiguous and row.flags.writeable


# --------------------------------------------------------------------------------------------------
# Inputs: records as a packer receives them, and the bins the fill hands over.

components = st.sampled_from([0, 1, "code", "docs"])
counts = st.dictionaries(components, st.integers(1, 9), min_size=1, max_size=3)


@st.composite
def input_records(draw: Any) -> SampleRecord:
    cursor = SampleCursor(
        draw(st.integers(0, 3)),
        draw(st.integers(0, 50)),
        (draw(st.integers(0, 2)), 0, draw(st.integers(0, 99))),
        draw(st.lists(st.integers(0, 5), max_size=2)),
    )
    contributors = draw(
        st.none()
        | st.lists(
            st.builds(
                ContributorRef,
                st.builds(
                    SampleCursor,
                    st.integers(0, 3),
                    st.integers(0, 50),
                    st.tuples(st.just(0), st.just(0), st.integers(0, 99)),
                ),
                st.booleans(),
            ),
            min_size=1,
            max_size=3,
        )
    )
    meta = SampleMeta(
        cursor,
        lane_id=draw(st.integers(0, 3)),
        contributors=contributors,
        component=draw(components),
        component_sample_counts=draw(st.none() | counts),
        component_token_counts=draw(st.none() | counts),
    )
    return SampleRecord(meta, {"tokens": np.zeros(1, dtype=np.int32)})


@st.composite
def fragment_rows(draw: Any) -> tuple[int, int, int]:
    n = draw(st.integers(0, 40))
    start = draw(st.integers(0, n))
    return start, draw(st.integers(0, n - start)), n


@st.composite
def handed_over_bins(draw: Any) -> tuple[Any, ...]:
    sides = tuple(
        (f"side{k}", is_float)
        for k, is_float in enumerate(draw(st.lists(st.booleans(), max_size=2)))
    )
    seq_len = draw(st.integers(1, 12))
    bin_records = draw(st.lists(st.lists(input_records(), min_size=1, max_size=3), max_size=4))
    n_frags = sum(map(len, bin_records))
    frags = np.array(
        draw(st.lists(fragment_rows(), min_size=n_frags, max_size=n_frags)), dtype=np.int64
    ).reshape(n_frags, 3)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    blocks = [
        rng.integers(-(2**31), 2**31, size=(3 + len(sides), seq_len), dtype=np.int32)
        for _ in bin_records
    ]
    return blocks, bin_records, frags, draw(st.integers(0, 7)), sides


@settings(max_examples=300, deadline=None)
@given(handed_over_bins())
def test_packed_records_match_the_reference(case: tuple[Any, ...]) -> None:
    blocks, bin_records, frags, lane_id, sides = case
    want = reference_records(blocks, bin_records, frags, lane_id, sides, _count_spread)
    got = packed_records(blocks, bin_records, frags, lane_id, sides, _count_spread)
    assert_same_records(got, want)


def test_the_payload_holds_its_block_alive_and_then_lets_it_go() -> None:
    rec = SampleRecord(SampleMeta(SampleCursor(0, 0, (0, 0, 0))), None)
    block = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=np.int32)
    alive = weakref.ref(block)
    frags = np.array([[0, 3, 3]], dtype=np.int64)
    (packed,) = packed_records([block], [[rec]], frags, 0, (), _count_spread)
    del block
    assert alive() is not None
    assert packed.payload["positions"].tolist() == [7, 8, 9]
    del packed
    assert alive() is None


# --------------------------------------------------------------------------------------------------
# Bad input: an error before anything is returned, never a record built from the wrong rows.

REC = SampleRecord(SampleMeta(SampleCursor(0, 0, (0, 0, 0))), None)
BLOCK = np.zeros((3, 4), dtype=np.int32)
ONE_ROW = np.array([[0, 4, 4]], dtype=np.int64)


@pytest.mark.parametrize(
    "block",
    [
        np.zeros((3, 4), dtype=np.int64),
        np.zeros((4, 3), dtype=np.int32).T,
        np.zeros((2, 4), dtype=np.int32),
        np.zeros(12, dtype=np.int32),
        [[0] * 4] * 3,
    ],
    ids=["int64", "not-contiguous", "too-few-rows", "flat", "a-list"],
)
def test_a_block_that_is_not_a_bins_is_refused(block: Any) -> None:
    with pytest.raises(TypeError, match="block"):
        packed_records([block], [[REC]], ONE_ROW, 0, (), _count_spread)


def test_a_block_without_its_side_rows_is_refused() -> None:
    with pytest.raises(TypeError, match="4 rows"):
        packed_records([BLOCK], [[REC]], ONE_ROW, 0, (("mask", False),), _count_spread)


@pytest.mark.parametrize(
    ("bin_records", "frags", "match"),
    [
        ([[REC]], np.zeros((0, 3), dtype=np.int64), "rows are left"),
        ([[REC]], np.array([[0, 4, 4], [0, 1, 1]], dtype=np.int64), "bins hold 1"),
        ([[]], ONE_ROW, "0 fragments"),
        ([[REC], [REC]], np.array([[0, 4, 4], [0, 1, 1]], dtype=np.int64), "fragment lists"),
        ([[REC]], np.array([[0, 4]], dtype=np.int64), "3 columns"),
    ],
    ids=["too-few-rows", "too-many-rows", "empty-bin", "more-lists-than-blocks", "two-columns"],
)
def test_fragments_and_rows_that_disagree_are_refused(
    bin_records: Any, frags: np.ndarray, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        packed_records([BLOCK], bin_records, frags, 0, (), _count_spread)


def test_other_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="lane_id"):
        packed_records([BLOCK], [[REC]], ONE_ROW, -1, (), _count_spread)
    with pytest.raises(TypeError):
        packed_records([BLOCK], [["not a record"]], ONE_ROW, 0, (), _count_spread)  # type: ignore[list-item]
    with pytest.raises((TypeError, ValueError)):
        packed_records([BLOCK], [[REC]], ONE_ROW.astype(np.int32), 0, (), _count_spread)
    with pytest.raises((TypeError, ValueError)):
        packed_records([BLOCK], [[REC]], np.asfortranarray(np.zeros((1, 3), np.int64))[:, ::-1],
                       0, (), _count_spread)  # fmt: skip
