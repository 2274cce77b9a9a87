"""The loader: round-robin delivery over lanes, stats, and the checkpoint state (SPEC §1.5, §2)."""

from __future__ import annotations

import warnings
from collections.abc import Hashable
from typing import Any

from zephon._core.delivery import DeliveryCounters
from zephon.errors import CheckpointCorruptError, CheckpointError, ContractWarning
from zephon.ops.mixture import MIXTURE_DROP_TAG
from zephon.planner import Plan
from zephon.runtime.checkpoint import STATE_FORMAT, STATE_VERSION, check_identity, seal, unseal
from zephon.runtime.delivery import LaneDelivery
from zephon.types import SampleMeta

_COUNTERS = ("delivered", "tombstones", "evicted", "violations", "max_inflight", "mixture_dropped")


def _counter(name: str) -> property:
    """A loader counter kept in the compiled ``DeliveryCounters`` the lanes' bookkeeping updates."""

    def get(self: Loader) -> int:
        return getattr(self.counts, name)

    def set_(self: Loader, value: int) -> None:
        setattr(self.counts, name, value)

    return property(get, set_, doc=f"The run's ``{name}`` counter.")


class Loader:
    """An iterator over what the training loop consumes: ``SampleBatch``es when the pipeline ends
    in ``batch``, else ``SampleRecord``s. Tombstones are never delivered.

    ``state_dict()`` is valid between any two ``next()`` calls; a loader built with it continues
    exactly where it was taken.
    """

    delivered = _counter("delivered")
    tombstones = _counter("tombstones")
    evicted = _counter("evicted")
    mixture_dropped = _counter("mixture_dropped")

    def __init__(self, plan: Plan):
        self.plan = plan
        self.counts = DeliveryCounters()
        self.counts.drop_tag = MIXTURE_DROP_TAG
        self.replayed = 0
        self.violations = 0
        self.max_inflight = 0
        self._warned: set[tuple] = set()
        self._started = False
        self._closed = False
        self.next_lane = 0
        self.lanes = [LaneDelivery(self, lane) for lane in range(plan.lanes)]

    # ----------------------------------------------------------------------------- iteration
    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> Any:  # SampleBatch when the pipeline ends in batch, else SampleRecord
        if self._closed:
            raise StopIteration
        lanes = self.lanes
        if not self._started:
            self._started = True
            for lane in lanes:  # every lane's worker starts working at once
                lane.start()
        n = len(lanes)
        try:
            for _ in range(n):  # one full round at most: each lane delivers or has ended
                lane = lanes[self.next_lane]
                self.next_lane = (self.next_lane + 1) % n
                out = lane.next_delivery()
                if out is not None:
                    return out
        except BaseException:
            self.close()
            raise
        raise StopIteration

    def close(self) -> None:
        """Stop every lane; the loader delivers nothing afterwards."""
        self._closed = True
        for lane in self.lanes:
            lane.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------- counters
    @property
    def mix_samples(self) -> dict[Hashable, int]:
        """Delivered samples per mixture component."""
        self.counts.flush()
        return self.counts.mix_samples

    @property
    def mix_tokens(self) -> dict[Hashable, int]:
        """Delivered tokens per mixture component (records that carry token counts)."""
        return self.counts.mix_tokens

    def count_delivered(self, meta: SampleMeta) -> None:
        self.counts.count_delivered(meta)

    def count_tombstone(self, meta: SampleMeta) -> None:
        self.counts.count_tombstone(meta)

    def count_violation(self, key: tuple, text: str) -> None:
        self.violations += 1
        warn_key = (key[0], key[1], key[3])  # one warning per kind, operator and epoch
        if warn_key not in self._warned:
            self._warned.add(warn_key)
            warnings.warn(text, ContractWarning, stacklevel=5)

    def note_inflight(self) -> None:
        inflight = sum(lane.table.n_inflight for lane in self.lanes)
        if inflight > self.max_inflight:
            self.max_inflight = inflight

    def stats(self) -> dict[str, Any]:
        """Counters of the run (SPEC §1.5); ``mixture`` is the realized share per component of
        delivered tokens, or of delivered samples when nothing carries token counts."""
        basis = self.mix_tokens if self.mix_tokens else self.mix_samples
        total = sum(basis.values())
        return {
            "delivered": self.delivered,
            "tombstones": self.tombstones,
            "replayed": self.replayed,
            "inflight_chunks": sum(lane.table.n_inflight for lane in self.lanes),
            "max_inflight_chunks": self.max_inflight,
            "evicted_chunks": self.evicted,
            "violations": self.violations,
            "mixture": {k: v / total for k, v in basis.items()} if total else {},
            "mixture_dropped": self.mixture_dropped,
            "bytes_held": sum(lane.table.bytes_held for lane in self.lanes),
            "eviction_path": self.plan.eviction_path,
        }

    # ----------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """A small JSON-serializable state; ``load_state_dict`` continues exactly from here."""
        plan = self.plan
        return seal(
            {
                "format": STATE_FORMAT,
                "version": STATE_VERSION,
                "fingerprint": plan.fingerprint,
                "pipeline": plan.fingerprint_parts,
                "rank": plan.rank,
                "world_size": plan.world_size,
                "lanes": plan.lanes,
                "next_lane": self.next_lane,
                "lane_states": [lane.state() for lane in self.lanes],
                "counters": {name: getattr(self, name) for name in _COUNTERS},
                "mixture": {
                    "samples": [[k, v] for k, v in self.mix_samples.items()],
                    "tokens": [[k, v] for k, v in self.mix_tokens.items()],
                },
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; only before the first ``next()``."""
        if self._started:
            raise CheckpointError("load_state_dict must be called before the first next()")
        body = unseal(state)
        plan = self.plan
        check_identity(body, plan.fingerprint_parts, plan.rank)
        try:
            lane_states = body["lane_states"]
            if len(lane_states) != plan.lanes:
                raise ValueError(f"{len(lane_states)} lane states for {plan.lanes} lanes")
            for lane, lane_state in zip(self.lanes, lane_states):
                lane.restore(lane_state)
            self.next_lane = int(body["next_lane"]) % plan.lanes
            for name in _COUNTERS:
                setattr(self, name, int(body["counters"][name]))
            self.counts.flush()
            self.counts.mix_samples = {_key(k): int(v) for k, v in body["mixture"]["samples"]}
            self.counts.mix_tokens = {_key(k): int(v) for k, v in body["mixture"]["tokens"]}
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptError(f"loader state is malformed: {exc!r}") from None


def _key(value: Any) -> Hashable:
    return tuple(value) if isinstance(value, list) else value
