"""Skipped records at delivery: counted, logged once and kept (the latest few) as they are
handed over; refused past the plan's ``max_skipped``.

A lane sends a ``control.Skipped`` item ahead of a skipped record's tombstones. Delivery admits
it as it arrives (``admit``: the limit is checked there, before anything of it is booked) and
books it with what it is handed over with (``book``). Items the replay filter swallows were
booked before the checkpoint and are neither: the count comes back with the checkpoint.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from zephon._core.delivery import DeliveryCounters
from zephon.errors import OperatorError
from zephon.runtime.lanes.control import Skipped
from zephon.sources.base import WorkSource, sample_origin

log = logging.getLogger("zephon")

#: Where a checkpoint keeps the count, among the counted tombstone tags (``tag_counts``): a
#: state without it (taken before skipping existed) counts from 0.
SKIPPED = "skipped"
#: How many of the latest skipped records ``Loader.skipped()`` keeps.
KEEP = 1000


class SkipLog:
    """The skipped records of a loader (all its lanes): the count, kept in ``counters``
    (restored with a checkpoint), and the latest ``KEEP`` of them."""

    def __init__(
        self,
        counters: DeliveryCounters,
        limit: int | None,
        source: WorkSource | None = None,
    ):
        self.counters = counters
        self.limit = limit
        self.source = source  # says where a sample lives (``WorkSource.origin``)
        self.held = 0  # admitted, waiting in a pending batch to be booked
        self.latest: collections.deque[dict[str, Any]] = collections.deque(maxlen=KEEP)

    @property
    def count(self) -> int:
        """Records skipped (booked) since the run started, across restores."""
        return self.counters.tag_counts.get(SKIPPED, 0)

    def admit(self, item: Skipped, lane_id: int) -> None:
        """``item`` arrived at delivery: ``OperatorError`` when skipping it would pass the limit."""
        limit = self.limit
        if limit is not None and self.count + self.held >= limit:
            cursor = item.cursor
            raise OperatorError(
                f"operator {item.operator!r} failed on record {cursor!r} "
                f"(sample_id={cursor.sample_id}): {item.error}. Not skipped: the limit of "
                f"max_skipped={limit} skipped records was reached. Fix the data or the "
                "operator, or raise Pipeline(max_skipped=...)",
                operator=item.operator,
                cursor=cursor,
            ).add_context(lane=lane_id, **sample_origin(self.source, cursor))
        self.held += 1

    def book(self, item: Skipped, lane_id: int) -> None:
        """``item`` is handed over: count it, log it and keep it."""
        self.held = max(0, self.held - 1)
        tags = self.counters.tag_counts
        tags[SKIPPED] = tags.get(SKIPPED, 0) + 1
        cursor = item.cursor
        where = sample_origin(self.source, cursor)
        log.warning(
            "lane %d: skipped record %r (sample_id=%s%s): operator %r failed: %s (%d skipped)",
            lane_id,
            cursor,
            cursor.sample_id,
            "".join(f", {k} {v!r}" for k, v in where.items()),
            item.operator,
            item.error,
            tags[SKIPPED],
        )
        self.latest.append(
            {
                "lane": lane_id,
                "cursor": cursor,
                "sample_id": cursor.sample_id,
                **where,
                "operator": item.operator,
                "error": item.error,
            }
        )
