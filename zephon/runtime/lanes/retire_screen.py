"""Screening a lane's items for retired samples: a record that carries one (as itself, or as a
contributor of a packed record) is replaced by a ``Retired`` control item at delivery, or by its
tombstone at fetch. Which ids are retired, and from where, is kept in the checkpoint
(``zephon.runtime.checkpoint.retired``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from zephon._core.records import RecordRun, expand_runs
from zephon.ops.children import tombstones_for_record
from zephon.runtime.checkpoint.retired import RetiredIds
from zephon.runtime.lanes.control import Retired
from zephon.types import SampleRecord


def screen(ids: RetiredIds, items: list[Any]) -> list[Any]:
    """``items`` with every record that carries a retired sample replaced by ``Retired``
    (``items`` itself when none does). One look-up for all the records of the list."""
    hit = _hits(ids, items)
    if not hit:
        return items
    out: list[Any] = []
    for i, item in enumerate(items):
        found = hit.get(i)
        if found is None:
            out.append(item)
        elif type(item) is RecordRun:
            records = expand_runs([item])
            out.extend(Retired(r) if h else r for r, h in zip(records, found.tolist()))
        else:
            out.append(Retired(item))
    return out


def _hits(ids: RetiredIds, items: list[Any]) -> dict[int, Any]:
    """Index in ``items`` -> which of its records are retired (a run's mask, else True)."""
    hit: dict[int, Any] = {}
    found_ids: list[tuple[int, ...]] = []
    owners: list[int] = []
    for i, item in enumerate(items):
        kind = type(item)
        if kind is RecordRun:
            found = ids.contains(item.pointers)
            if found.any():
                hit[i] = found
        elif kind is SampleRecord and not item.meta.is_tombstone:
            for ref in item.meta.contribution_refs():
                found_ids.append(ref.cursor.sample_id)
                owners.append(i)
    if found_ids:
        found = ids.contains(np.array(found_ids, dtype=np.int64))
        for i in np.asarray(owners)[found].tolist():
            hit[i] = True
    return hit


def tombstoned(items: list[Any], ids: RetiredIds) -> list[Any]:
    """Fetched ``items`` with each retired sample's record replaced by its tombstone."""
    screened = screen(ids, items)
    if screened is items:
        return items
    out: list[Any] = []
    for item in screened:
        if type(item) is Retired:
            out.extend(tombstones_for_record(item.record))
        else:
            out.append(item)
    return out
