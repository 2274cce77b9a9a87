"""What a run reports: stats() at any time (also after the end and after close), the ``zephon``
logger for starts and restores, and a warning when an operator's carry state grows too large."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from pipeline_kit import RunningTotal, fingerprint_item
from worker_kit import wait_until

import zephon
from zephon.ops import ensure_mixture, tokenize
from zephon.ops.base import Operator, OpTraits
from zephon.ops.basic import fetch, filter_records
from zephon.ops.batching import batch
from zephon.sources.memory import ListSource, RangeSource
from zephon.sources.mixture import MixtureSource
from zephon.types import SampleRecord

KEYS = {
    "delivered",
    "tombstones",
    "replayed",
    "inflight_chunks",
    "max_inflight_chunks",
    "evicted_chunks",
    "violations",
    "mixture",
    "mixture_samples",
    "mixture_tokens",
    "mixture_components",
    "bytes_held",
    "eviction_path",
    "dropped_at_end",
    "skipped",
    "operators",
    "sources",
    "lanes",
    "trainer_wait",
}


def _odd(payload: dict) -> bool:
    return payload["idx"] % 2 == 1


def _pipeline(**kw: Any) -> zephon.Pipeline:
    return zephon.Pipeline(
        RangeSource(100, chunk_size=10), [fetch(), filter_records(_odd), batch(5)], lanes=2, **kw
    )


def test_stats_before_during_after_the_end_and_after_close() -> None:
    loader = iter(_pipeline())
    assert set(loader.stats()) == KEYS
    assert loader.stats()["delivered"] == 0
    next(loader)
    during = loader.stats()
    assert during["delivered"] == 5
    assert during["lanes"][0]["delivered"] == 1
    rest = list(loader)
    after = loader.stats()
    assert after["delivered"] == 50
    assert after["tombstones"] == 50
    assert len(rest) == 9
    assert after["lanes"] == {
        0: {"delivered": 5, "ended": True, "buffered": 0, "queued": 0, "replay": None},
        1: {"delivered": 5, "ended": True, "buffered": 0, "queued": 0, "replay": None},
    }
    op = after["operators"]["filter_records(_odd)"]
    assert (op["records_in"], op["items_out"]) == (100, 100)  # 50 kept, 50 tombstones
    assert op["seconds"] >= 0
    assert after["trainer_wait"]["steps"] == 10  # the batches handed over
    loader.close()
    assert loader.stats() == after  # the time running stopped at the end of the stream


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_queued_counts_the_item_lists_a_worker_has_ready_and_keeps_the_stream(workers) -> None:
    expected = [fingerprint_item(x) for x in _pipeline()]
    loader = _pipeline(workers=workers, prefetch=2).iter()
    seen = [fingerprint_item(next(loader))]
    got_ahead = wait_until(
        lambda: max(lane["queued"] for lane in loader.stats()["lanes"].values()) >= 2, 60
    )
    assert got_ahead, "the workers never got ahead"
    for lane in loader.stats()["lanes"].values():
        assert 0 <= lane["queued"] <= 2  # never more than prefetch
    for item in loader:
        seen.append(fingerprint_item(item))
        loader.stats()  # receiving ahead for the count must not change what is delivered
    assert seen == expected
    assert all(lane["queued"] == 0 for lane in loader.stats()["lanes"].values())
    loader.close()


def test_per_component_counts_and_counted_tombstone_tags() -> None:
    def texts(d: int, n: int) -> ListSource:
        return ListSource([{"text": "x" * (1 + i % (5 + 20 * d))} for i in range(n)], dataset_id=d)

    parts = {"a": texts(0, 200), "b": texts(1, 200)}
    source = MixtureSource(parts, {"a": 0.5, "b": 0.5})
    ops = [fetch(), tokenize(), ensure_mixture({"a": 0.5, "b": 0.5}, buffer_size=16)]
    loader = iter(zephon.Pipeline(source, ops))
    with pytest.warns(zephon.MixtureDropWarning, match="dropped"):  # b is 8x longer
        items = list(loader)
    stats = loader.stats()
    assert sum(stats["mixture_samples"].values()) == len(items)
    assert sum(stats["mixture_tokens"].values()) == sum(len(r.payload["tokens"]) for r in items)
    assert stats["mixture_dropped"] == 400 - len(items)
    assert set(KEYS) < set(stats)
    # per component: delivered + dropped is everything tokenized (each text and its eos)
    comps = stats["mixture_components"]
    assert set(comps) == {"a", "b"}
    for name, src in parts.items():
        tokenized = sum(len(item["text"]) + 1 for item in src.items)
        entry = comps[name]
        assert entry["samples"] + entry["dropped_samples"] == 200
        assert entry["tokens"] + entry["dropped_tokens"] == tokenized
        assert entry["target"] == 0.5 and entry["share_of"] == "tokens"
        assert entry["share"] == pytest.approx(stats["mixture"][name])
    assert sum(c["dropped_samples"] for c in comps.values()) == stats["mixture_dropped"]


def test_restore_progress_and_the_log_say_what_is_replayed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    make = lambda: zephon.Pipeline(  # noqa: E731
        RangeSource(100, chunk_size=10), [fetch(), RunningTotal(), batch(4)], epoch_chunks=4
    )
    loader = iter(make())
    for _ in range(7):
        next(loader)
    state = loader.state_dict()
    with caplog.at_level(logging.INFO, logger="zephon"):
        resumed = make().iter(state=state)
        next(resumed)
    messages = "\n".join(r.getMessage() for r in caplog.records)
    assert "starting lanes 0..0 of 1" in messages
    assert "lane 0: replaying 28 record(s)" in messages
    assert resumed.stats()["replayed"] == 28
    assert resumed.stats()["lanes"][0]["replay"] is None  # done


class Hoarder(Operator):
    """Stateful: carries every idx it saw across epochs (a checkpoint that grows)."""

    traits = OpTraits(preserves_cursor_order=True, stateful=True)

    def __init__(self) -> None:
        self._seen: list[int] = []

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        self._seen.extend(r.payload["idx"] for r in records)
        return records

    def carry_state(self) -> dict:
        return {"seen": self._seen}

    def restore_carry(self, state: dict) -> None:
        self._seen = list(state["seen"])


def test_a_growing_carry_state_warns_once_naming_the_operator() -> None:
    pipeline = zephon.Pipeline(
        RangeSource(3000, chunk_size=100),
        [fetch(), Hoarder()],
        epoch_chunks=2,
        carry_warn_bytes=2000,
    )
    with pytest.warns(zephon.CarryStateWarning, match="'Hoarder' carries") as caught:
        list(pipeline)
    assert len([w for w in caught if issubclass(w.category, zephon.CarryStateWarning)]) == 1


def test_carry_warn_bytes_must_be_a_non_negative_int() -> None:
    with pytest.raises(zephon.PlanError, match="carry_warn_bytes"):
        _pipeline(carry_warn_bytes=-1).compile()


def test_a_restore_shows_its_replay_progress_only_when_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def make() -> zephon.Pipeline:
        return zephon.Pipeline(
            RangeSource(100, chunk_size=10), [fetch(), RunningTotal(), batch(4)], epoch_chunks=4
        )

    loader = iter(make())
    for _ in range(7):
        next(loader)
    state = loader.state_dict()
    next(make().iter(state=state))
    assert "replaying lane" not in capsys.readouterr().err  # off in the library
    zephon.show_progress(True)
    try:
        next(make().iter(state=state))
    finally:
        zephon.show_progress(False)
    assert "zephon: replaying lane 0" in capsys.readouterr().err
