"""The worked examples of records and their sample lifecycles hold as drawn."""

from __future__ import annotations

import itertools
import random

from zephon._core.cursor import sort_cursors
from zephon.ops.children import pack_meta, spawn_child, tombstones_for_record
from zephon.types import ContributorRef, SampleCursor, SampleMeta, SampleRecord

# Input (chunk 7, offset 2): cursor = (cid=7, off=2, lineage=(), sample_id=(ds0, sh5, 42))
INPUT = SampleMeta(SampleCursor(7, 2, (0, 5, 42)))


def split_in_three(parent: SampleMeta) -> list[SampleMeta]:
    """What tokenize(split_long_samples=True) does to a document that makes three sequences."""
    return [spawn_child(parent, i, is_last_child=i == 2) for i in range(3)]


def test_tokenizer_split_makes_three_children_with_one_lineage_index_each():
    children = split_in_three(INPUT)
    assert [c.cursor for c in children] == [
        SampleCursor(7, 2, (0, 5, 42), (0,)),
        SampleCursor(7, 2, (0, 5, 42), (1,)),
        SampleCursor(7, 2, (0, 5, 42), (2,)),
    ]
    assert [c.cursor.sort_key for c in children] == [
        (7, 2, (0,), (0, 5, 42)),
        (7, 2, (1,), (0, 5, 42)),
        (7, 2, (2,), (0, 5, 42)),
    ]
    assert all(c.cursor.sample_id == (0, 5, 42) for c in children)


def test_split_children_share_the_base_offset_but_not_the_cursor():
    children = split_in_three(INPUT)
    assert {c.cursor.base_offset for c in children} == {(7, 2)}
    assert len({c.cursor for c in children}) == 3


def test_only_the_last_split_child_signals_it_is_the_last_one():
    children = split_in_three(INPUT)
    flags = [[ref.is_last_child for ref in c.contribution_refs()] for c in children]
    assert flags == [[False], [False], [True]]


def test_splitting_child_one_again_makes_grandchildren_one_zero_and_one_one():
    children = split_in_three(INPUT)
    grandchildren = [spawn_child(children[1], j, is_last_child=j == 1) for j in range(2)]
    assert [g.cursor.lineage for g in grandchildren] == [(1, 0), (1, 1)]
    # child 1 was not the last child, so neither of its children may close (7, 2)
    assert not any(r.is_last_child for g in grandchildren for r in g.contribution_refs())


def test_only_the_last_grandchild_of_the_last_child_could_close_the_offset():
    children = split_in_three(INPUT)
    leaves = [spawn_child(child, j, is_last_child=j == 1) for child in children for j in range(2)]
    closing = [
        leaf.cursor.lineage
        for leaf in leaves
        if any(r.is_last_child for r in leaf.contribution_refs())
    ]
    assert closing == [(2, 1)]
    assert [r.base_offset for r in leaves[-1].contribution_refs()] == [(7, 2)]


def test_packing_two_children_of_different_offsets_closes_both():
    first = SampleMeta(SampleCursor(7, 2, (0, 5, 42)).child(0), contributors=None)
    second = SampleMeta(SampleCursor(7, 3, (0, 5, 43)).child(0), contributors=None)
    packed = pack_meta(
        first.cursor.child(0),
        [ref for meta in (first, second) for ref in meta.contribution_refs()],
        lane_id=0,
    )
    assert packed.cursor.sort_key[:3] == (7, 2, (0, 0))
    assert packed.cursor == SampleCursor(7, 2, (0, 5, 42), (0, 0))
    assert packed.contribution_refs() == (
        ContributorRef(SampleCursor(7, 2, (0, 5, 42), (0,)), True),
        ContributorRef(SampleCursor(7, 3, (0, 5, 43), (0,)), True),
    )
    assert [r.base_offset for r in packed.contribution_refs()] == [(7, 2), (7, 3)]


def test_a_dropped_record_owes_a_tombstone_for_its_base_offset():
    dropped = SampleRecord(SampleMeta(SampleCursor(10, 5, (0, 0, 77))), {"text": "duplicate"})
    [tombstone] = tombstones_for_record(dropped)
    assert tombstone.is_tombstone
    assert tombstone.payload is None
    assert [(r.base_offset, r.is_last_child) for r in tombstone.contribution_refs()] == [
        ((10, 5), True)
    ]


def test_the_split_example_from_the_page_runs_as_written():
    parent = SampleRecord(INPUT, "a long document")
    sequences = ["a long", " docu", "ment"]
    out = []
    for i, sequence in enumerate(sequences):
        meta = spawn_child(
            parent.meta,
            child_idx=i,
            is_last_child=(i == len(sequences) - 1),
        )
        out.append(SampleRecord(meta=meta, payload=sequence))
    assert [r.payload for r in out] == sequences
    assert [r.cursor.lineage for r in out] == [(0,), (1,), (2,)]


def test_sorting_a_shuffled_mix_keeps_each_base_offset_together_and_in_lineage_order():
    roots = [
        SampleCursor(chunk, offset, (dataset, 0, 1000 - 10 * chunk - offset))
        for chunk in (3, 7, 10)
        for offset in range(4)
        for dataset in (0, 1)
    ]
    family = []
    for root in roots:
        family.append(root)
        for i in range(3):
            family.append(root.child(i))
            family.extend(root.child(i).child(j) for j in range(2))
    mixed = list(family)
    random.Random(0).shuffle(mixed)

    for ordered in (sorted(mixed), sort_cursors(mixed)):
        groups = [base for base, _ in itertools.groupby(c.base_offset for c in ordered)]
        assert len(groups) == len(set(groups)), "a base offset is split into several runs"
        assert groups == sorted(groups)
        for _, run in itertools.groupby(ordered, key=lambda c: c.base_offset):
            lineages = [c.lineage for c in run]
            assert lineages == sorted(lineages)
            # the two sample ids of one offset interleave by lineage, not by sample id
            assert lineages[:2] == [(), ()]
            assert lineages[2:4] == [(0,), (0,)]
