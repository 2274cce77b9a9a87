"""Screening a lane's items for retired samples: a record that carries one (as itself, or as a
contributor of a packed record) is replaced by a ``Retired`` control item at delivery, or by its
tombstone at fetch. Which ids are retired, and from where, is kept in the checkpoint
(``zephon.runtime.checkpoint.retired``)."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import numpy as np

from zephon._core.records import RecordRun, expand_runs
from zephon.errors import RetireWarning
from zephon.ops.children import tombstones_for_record
from zephon.runtime.checkpoint.retired import RetiredIds
from zephon.runtime.lanes.control import Retired
from zephon.types import SampleRecord

log = logging.getLogger("zephon")


def screen(ids: RetiredIds, items: list[Any]) -> list[Any]:
    """``items`` with every record that carries a retired sample replaced by ``Retired``
    (``items`` itself when none does). One look-up for all the records of the list.

    A record that also carries samples that are not retired (a row of an operator that cannot
    leave retired samples out, ``Operator.leave_out``) goes too, and a ``RetireWarning`` says
    that the others' parts in it are not delivered."""
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
            if found is MIXED:
                _warn_mixed(item)
            out.append(Retired(item))
    return out


MIXED = object()  # a record carrying retired samples and others


def _hits(ids: RetiredIds, items: list[Any]) -> dict[int, Any]:
    """Index in ``items`` -> which of its records are retired (a run's mask, else True, or
    ``MIXED`` when it carries samples that are not retired too)."""
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
        by_owner = np.asarray(owners)
        for i in np.unique(by_owner[found]).tolist():
            hit[i] = True if found[by_owner == i].all() else MIXED
    return hit


def _warn_mixed(record: SampleRecord) -> None:
    text = (
        f"record {record.meta.cursor!r} holds retired samples and others, and the operator that "
        "made it cannot leave retired samples out (Operator.leave_out): it is taken out whole, "
        "so the other samples' parts in it are not delivered. Implement leave_out in that "
        "operator to keep them"
    )
    log.warning(text)
    warnings.warn(text, RetireWarning, stacklevel=2)


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


def screened_out(items: list[Any], closed: np.ndarray, first: int) -> list[Any]:
    """Fetched ``items`` of one chunk (its offsets from ``first``) with the record at each
    offset ``closed`` says was consumed before a resume with changed operators replaced by
    ``Retired``: booked as delivered before, it never reaches an operator
    (``checkpoint.progress``)."""
    out: list[Any] = []
    for item in expand_runs(items):
        if (
            type(item) is SampleRecord
            and not item.meta.is_tombstone
            and closed[item.meta.cursor.chunk_offset - first]
        ):
            out.append(Retired(item))
        else:
            out.append(item)
    return out
