"""Helpers that build the metadata of derived records: children, packed records, tombstones.

They keep the one invariant fan-out depends on: for each base offset of a lane, exactly one record
or tombstone eventually carries its closing contributor, and never before its siblings.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Any

from zephon._core.records import as_tags
from zephon.types import ContributorRef, SampleCursor, SampleMeta, SampleRecord

__all__ = ["pack_meta", "spawn_child", "tombstone_meta", "tombstones_for_record"]


def spawn_child(
    parent: SampleMeta,
    child_idx: int,
    *,
    is_last_child: bool = False,
    tags: Iterable[str] | None = None,
) -> SampleMeta:
    """Metadata for child ``child_idx`` of ``parent`` (lineage extended by ``child_idx``).

    Only the child marked ``is_last_child`` may close anything: for a parent with explicit
    contributors (a split or packed record) it keeps their flags, every other child gets
    non-closing copies, so splitting again can never close a source early. A tombstone has no
    children (ValueError): it stands for no payload, only for the ref a dropped record owed.
    """
    if parent.is_tombstone:
        raise ValueError(
            f"spawn_child: the parent {parent.cursor!r} is a tombstone, which has no children; "
            "pass tombstones on as they are"
        )
    extra = as_tags(tags, "spawn_child")
    cursor = parent.cursor.child(child_idx)
    if parent.contributors is None:
        contributors: tuple[ContributorRef, ...] = (ContributorRef(cursor, is_last_child),)
    elif is_last_child:
        contributors = parent.contributors
    else:
        contributors = tuple(
            ref if not ref.is_last_child else ContributorRef(ref.cursor, False)
            for ref in parent.contributors
        )
    return SampleMeta(
        cursor,
        lane_id=parent.lane_id,
        contributors=contributors,
        tags=parent.tags | extra if extra else parent.tags,
        component=parent.component,
        component_sample_counts=parent.component_sample_counts,
        component_token_counts=parent.component_token_counts,
    )


def pack_meta(
    primary_cursor: SampleCursor,
    contributors: Iterable[ContributorRef],
    *,
    lane_id: int,
    component_sample_counts: Mapping[Any, int] | None = None,
    component_token_counts: Mapping[Any, int] | None = None,
    tags: Iterable[str] | None = None,
) -> SampleMeta:
    """Metadata for a record made of several inputs (packing).

    ``primary_cursor`` is the packed record's replay identity and must be unique in the lane;
    ``contributors`` are every input's ``contribution_refs()``, kept in input order.
    """
    return SampleMeta(
        primary_cursor,
        lane_id=lane_id,
        contributors=tuple(contributors),
        tags=as_tags(tags, "pack_meta"),
        component_sample_counts=(
            None if component_sample_counts is None else dict(component_sample_counts)
        ),
        component_token_counts=(
            None if component_token_counts is None else dict(component_token_counts)
        ),
    )


def tombstone_meta(ref: ContributorRef, lane_id: int) -> SampleMeta:
    """Metadata of a tombstone: a payload-less record carrying one closing ref a dropped record
    owed. A ref that closes nothing owes no tombstone (ValueError)."""
    if not isinstance(ref, ContributorRef):
        raise TypeError(f"tombstone_meta: ref must be a ContributorRef, got {ref!r}")
    if not ref.is_last_child:
        raise ValueError(
            f"tombstone_meta: {ref!r} has is_last_child=False: it closes nothing, so no "
            "tombstone is owed for it (tombstones_for_record makes one per closing ref)"
        )
    return SampleMeta(ref.cursor, lane_id=lane_id, contributors=(ref,), is_tombstone=True)


def tombstones_for_record(record: SampleRecord) -> list[SampleRecord]:
    """One tombstone per closing contributor of ``record`` (``[]`` when it owes none).

    Emit these whenever an operator drops a record, whatever eviction path the pipeline is on.
    """
    lane = record.meta.lane_id
    return [
        SampleRecord(tombstone_meta(ref, lane), None)
        for ref in record.contribution_refs()
        if ref.is_last_child
    ]


def split_in_proportion(n: int, weights: Mapping[Hashable, int]) -> list[tuple[Hashable, int]]:
    """``n`` (tokens) split over the keys of ``weights`` in proportion to them, as consecutive
    ``(key, amount)`` runs in the weights' order. Cumulative floors: the amounts sum to ``n``
    exactly, and the split is the same wherever it is computed. All of ``n`` goes to the first
    key when the weights sum to zero or less."""
    total = sum(weights.values())
    if total <= 0:
        return [(next(iter(weights)), n)]
    runs: list[tuple[Hashable, int]] = []
    acc = prev = 0
    for key, w in weights.items():
        acc += w
        bound = n * acc // total
        runs.append((key, bound - prev))
        prev = bound
    return runs
