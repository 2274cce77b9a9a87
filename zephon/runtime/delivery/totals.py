"""The running totals of a loader's delivery, and their part of a checkpoint.

What a rank delivered, dropped, evicted and violated since the run started (across restores):
``counters``, the counted tombstone tags (``tag_counts``, the skipped records among them) and
the delivered samples and tokens per mixture component (``mixture``). A job state's totals
belong to all its ranks: a rank resumed from one counts afresh.
"""

from __future__ import annotations

from typing import Any

from zephon._core.delivery import DeliveryCounters
from zephon.runtime.checkpoint.schema import check_totals, encode_pairs
from zephon.runtime.delivery.contracts import ContractPolicy


class RunTotals:
    """The totals of one loader: its lanes' shared ``DeliveryCounters``, the contract policy's
    violation count, the most chunks held in flight and the records replayed before the last
    restore."""

    def __init__(self, counts: DeliveryCounters, policy: ContractPolicy):
        self.counts = counts
        self.policy = policy
        self.max_inflight = 0
        self.restored_replayed = 0  # records replayed by the runs before this one

    def state(self, replayed: int) -> dict[str, Any]:
        """The ``counters``, ``tag_counts`` and ``mixture`` fields of a state; ``replayed``
        counts the records replayed since the first restore of the run."""
        counts = self.counts
        counts.flush()
        return {
            "counters": {
                "delivered": counts.delivered,
                "tombstones": counts.tombstones,
                "evicted": counts.evicted,
                "violations": self.policy.count,
                "max_inflight": self.max_inflight,
                "replayed": replayed,
            },
            "tag_counts": encode_pairs(counts.tag_counts),
            "mixture": {
                "samples": encode_pairs(counts.mix_samples),
                "tokens": encode_pairs(counts.mix_tokens),
            },
        }

    def restore(self, body: dict[str, Any], *, counted: bool) -> None:
        """Take the totals of state ``body`` (checked whether or not they are taken): only when
        they are this rank's own (``counted``), not a job's."""
        values, tag_counts, samples, tokens = check_totals(body)
        if not counted:
            return
        counts = self.counts
        counts.delivered = values["delivered"]
        counts.tombstones = values["tombstones"]
        counts.evicted = values["evicted"]
        self.policy.count = values["violations"]
        self.max_inflight = values["max_inflight"]
        self.restored_replayed = values["replayed"]
        counts.flush()
        counts.tag_counts = dict(tag_counts)
        counts.mix_samples = dict(samples)
        counts.mix_tokens = dict(tokens)
