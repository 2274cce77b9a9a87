"""The children helpers: the bookkeeping of fan-out, packing and dropped records."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zephon.ops.children import pack_meta, spawn_child, tombstone_meta, tombstones_for_record
from zephon.types import ContributorRef, SampleCursor, SampleMeta, SampleRecord

ROOT = SampleCursor(7, 2, (0, 5, 42))
NEIGHBOUR = SampleCursor(7, 3, (0, 5, 43))


def plain_parent(**changes: object) -> SampleMeta:
    """A fetched record's meta: implicit contributor, with mixture heritage and a tag."""
    meta = SampleMeta(
        ROOT,
        lane_id=3,
        tags={"fetched"},
        component="web",
        component_sample_counts={"web": 1},
        component_token_counts={"web": 900},
    )
    return meta.replace(**changes)


def packed_parent() -> SampleMeta:
    """A packed record's meta: explicit contributors, one closing and one not."""
    return pack_meta(
        ROOT.child(0).child(0),
        [ContributorRef(ROOT.child(0), True), ContributorRef(NEIGHBOUR.child(0), False)],
        lane_id=1,
        component_sample_counts={"web": 2},
        component_token_counts={"web": 1024},
        tags={"packed"},
    )


# --- spawn_child ------------------------------------------------------------------------------


def test_child_cursor_extends_the_parent_lineage_by_its_index():
    assert spawn_child(plain_parent(), 4).cursor == SampleCursor(7, 2, (0, 5, 42), (4,))
    grandchild = spawn_child(spawn_child(plain_parent(), 1), 0)
    assert grandchild.cursor.lineage == (1, 0)
    assert grandchild.cursor.base_offset == (7, 2)


def test_child_copies_lane_component_and_component_counts():
    parent = plain_parent()
    child = spawn_child(parent, 0)
    assert child.lane_id == 3
    assert child.component == "web"
    assert child.component_sample_counts == {"web": 1}
    assert child.component_token_counts == {"web": 900}
    assert child.is_tombstone is False


def test_child_tags_are_the_union_of_the_parent_tags_and_new_ones():
    parent = plain_parent()
    assert spawn_child(parent, 0).tags == frozenset({"fetched"})
    assert spawn_child(parent, 0, tags=["split"]).tags == frozenset({"fetched", "split"})
    assert spawn_child(parent, 0, tags=set()).tags == frozenset({"fetched"})
    assert parent.tags == frozenset({"fetched"})


def test_child_of_an_implicit_parent_closes_its_own_cursor_only_when_last():
    parent = plain_parent()
    first = spawn_child(parent, 0)
    last = spawn_child(parent, 1, is_last_child=True)
    assert first.contribution_refs() == (ContributorRef(ROOT.child(0), False),)
    assert last.contribution_refs() == (ContributorRef(ROOT.child(1), True),)


def test_child_of_an_implicit_parent_is_not_closing_by_default():
    child = spawn_child(plain_parent(), 0)
    assert [ref.is_last_child for ref in child.contribution_refs()] == [False]


def test_last_child_inherits_the_closing_flag():
    parent = packed_parent()
    last = spawn_child(parent, 2, is_last_child=True)
    assert last.contribution_refs() == parent.contribution_refs()
    assert [r.is_last_child for r in last.contribution_refs()] == [True, False]


def test_earlier_children_of_an_explicit_parent_carry_non_closing_copies():
    parent = packed_parent()
    for idx in (0, 1):
        child = spawn_child(parent, idx)
        refs = child.contribution_refs()
        assert [r.cursor for r in refs] == [r.cursor for r in parent.contribution_refs()]
        assert [r.is_last_child for r in refs] == [False, False]
        assert child.cursor == parent.cursor.child(idx)


def test_splitting_a_split_record_never_closes_the_source_early():
    parent = plain_parent()
    first = spawn_child(parent, 0)
    second = spawn_child(parent, 1, is_last_child=True)
    grandchildren = [
        spawn_child(second, 0),
        spawn_child(second, 1, is_last_child=True),
    ]
    closing = [
        (m.cursor.lineage, r.cursor.lineage)
        for m in (first, *grandchildren)
        for r in m.contribution_refs()
        if r.is_last_child
    ]
    assert closing == [((1, 1), (1,))]


@given(st.integers(1, 6), st.integers(1, 4), st.booleans())
def test_a_fan_out_tree_closes_each_base_offset_exactly_once_and_last(
    n_children: int, n_grandchildren: int, packed: bool
):
    parent = packed_parent() if packed else plain_parent()
    leaves = []
    for i in range(n_children):
        child = spawn_child(parent, i, is_last_child=i == n_children - 1)
        for j in range(n_grandchildren):
            leaves.append(spawn_child(child, j, is_last_child=j == n_grandchildren - 1))
    closing_by_offset: dict[tuple[int, int], list[int]] = {}
    for position, leaf in enumerate(leaves):
        for ref in leaf.contribution_refs():
            if ref.is_last_child:
                closing_by_offset.setdefault(ref.base_offset, []).append(position)
    expected_offsets = {r.base_offset for r in parent.contribution_refs() if r.is_last_child}
    assert set(closing_by_offset) == expected_offsets
    for positions in closing_by_offset.values():
        assert positions == [len(leaves) - 1]


def test_spawn_child_rejects_a_negative_index():
    with pytest.raises(ValueError, match="child_idx"):
        spawn_child(plain_parent(), -1)


@pytest.mark.parametrize("last", [True, False])
def test_a_tombstone_has_no_children(last: bool):
    tomb = tombstone_meta(ContributorRef(ROOT, True), lane_id=3)
    with pytest.raises(ValueError, match="tombstone"):
        spawn_child(tomb, 0, is_last_child=last)


@pytest.mark.parametrize("tags", [{"split": 1}, "split", [1]])
def test_child_tags_that_would_lose_or_mangle_names_are_refused(tags: object):
    with pytest.raises(TypeError, match="spawn_child tags"):
        spawn_child(plain_parent(), 0, tags=tags)  # type: ignore[arg-type]


# --- pack_meta --------------------------------------------------------------------------------


def test_packed_meta_keeps_contributors_in_input_order():
    inputs = [
        SampleMeta(NEIGHBOUR),
        spawn_child(plain_parent(), 0),
        spawn_child(plain_parent(), 1, is_last_child=True),
    ]
    refs = [ref for meta in inputs for ref in meta.contribution_refs()]
    meta = pack_meta(NEIGHBOUR.child(0), iter(refs), lane_id=2)
    assert meta.contributors == tuple(refs)
    assert meta.contribution_refs() == (
        ContributorRef(NEIGHBOUR, True),
        ContributorRef(ROOT.child(0), False),
        ContributorRef(ROOT.child(1), True),
    )
    assert meta.cursor == NEIGHBOUR.child(0)
    assert meta.lane_id == 2
    assert meta.is_tombstone is False


def test_packed_meta_copies_the_component_counts():
    samples = {"web": 2, "books": 1}
    tokens = {"web": 700, "books": 324}
    meta = pack_meta(
        ROOT.child(0), [], lane_id=0, component_sample_counts=samples, component_token_counts=tokens
    )
    assert meta.component_sample_counts == samples
    assert meta.component_token_counts == tokens
    samples["web"] = 99  # the caller's dict is not shared
    assert meta.component_sample_counts == {"web": 2, "books": 1}


def test_packed_meta_without_counts_or_tags_has_none_and_empty_tags():
    meta = pack_meta(ROOT.child(0), [ContributorRef(ROOT, True)], lane_id=0)
    assert meta.component_sample_counts is None
    assert meta.component_token_counts is None
    assert meta.tags == frozenset()
    assert pack_meta(ROOT.child(0), [], lane_id=0, tags=["p"]).tags == frozenset({"p"})


@pytest.mark.parametrize("tags", [{"packed": 1}, "packed", [1]])
def test_packed_tags_that_would_lose_or_mangle_names_are_refused(tags: object):
    with pytest.raises(TypeError, match="pack_meta tags"):
        pack_meta(ROOT.child(0), [], lane_id=0, tags=tags)  # type: ignore[arg-type]


def test_packed_meta_rejects_contributors_that_are_not_refs():
    with pytest.raises(TypeError, match="contributors"):
        pack_meta(ROOT.child(0), [SampleMeta(ROOT).contribution_refs()], lane_id=0)  # type: ignore[list-item]


# --- tombstones -------------------------------------------------------------------------------


def test_tombstone_meta_carries_exactly_the_ref_it_owes():
    ref = ContributorRef(ROOT.child(2), True)
    meta = tombstone_meta(ref, lane_id=4)
    assert meta.is_tombstone is True
    assert meta.cursor == ref.cursor
    assert meta.contributors == (ref,)
    assert meta.lane_id == 4


def test_a_tombstone_carries_a_closing_ref_or_none_at_all():
    with pytest.raises(ValueError, match=r"is_last_child=False.*closes nothing"):
        tombstone_meta(ContributorRef(ROOT.child(2), False), lane_id=4)
    with pytest.raises(TypeError, match="ContributorRef"):
        tombstone_meta(ROOT, lane_id=4)  # type: ignore[arg-type]


def test_tombstones_for_a_dropped_plain_record_close_its_own_offset():
    record = SampleRecord(plain_parent(), {"text": "dropped"})
    [tomb] = tombstones_for_record(record)
    assert tomb.is_tombstone is True
    assert tomb.payload is None
    assert tomb.cursor == ROOT
    assert tomb.contribution_refs() == (ContributorRef(ROOT, True),)
    assert tomb.meta.lane_id == 3


def test_tombstones_for_a_dropped_packed_record_cover_only_its_closing_contributors():
    refs = [
        ContributorRef(ROOT.child(0), True),
        ContributorRef(NEIGHBOUR.child(1), False),
        ContributorRef(SampleCursor(8, 0, (1, 0, 0)), True),
    ]
    record = SampleRecord(pack_meta(ROOT.child(0).child(0), refs, lane_id=1), {"tokens": []})
    tombs = tombstones_for_record(record)
    assert [t.contribution_refs() for t in tombs] == [(refs[0],), (refs[2],)]
    assert [t.cursor for t in tombs] == [refs[0].cursor, refs[2].cursor]
    assert all(t.payload is None and t.is_tombstone and t.meta.lane_id == 1 for t in tombs)


def test_a_record_that_owes_nothing_needs_no_tombstones():
    early_child = SampleRecord(spawn_child(plain_parent(), 0), "first half")
    assert tombstones_for_record(early_child) == []
    closes_nothing = SampleRecord(SampleMeta(ROOT, contributors=()), None)
    assert tombstones_for_record(closes_nothing) == []


@given(
    st.integers(0, 10_000),
    st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 50), min_size=1),
)
def test_split_in_proportion_sums_to_n_and_follows_the_weights(n, weights):
    from fractions import Fraction

    from zephon.ops.children import split_in_proportion

    runs = split_in_proportion(n, weights)
    assert sum(amount for _, amount in runs) == n
    total = sum(weights.values())
    if total <= 0:
        assert runs == [(next(iter(weights)), n)]
        return
    assert [key for key, _ in runs] == list(weights)
    acc = 0
    done = 0
    for (_, amount), w in zip(runs, weights.values()):
        acc += w
        done += amount
        assert done == int(Fraction(n * acc, total))  # cumulative floor of the exact share
