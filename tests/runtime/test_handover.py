"""The loader's compiled step (``zephon._core.handover``): handing over the head of a run without
a Python frame must deliver, book and report exactly what the lane's Python delivery does for
every batch (the reference: ``hand_over_head`` switched off, so that every step goes through
``LaneDelivery.next_delivery``, the pending batch and the batcher's hand-over)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pipeline_kit import DropMultiples, fingerprint_item

import zephon
from zephon._core.handover import LaneOutlet, LoaderStep, StepLock
from zephon.errors import OperatorError
from zephon.ops.basic import fetch, map_transform
from zephon.ops.batching import batch
from zephon.runtime.delivery.lane_delivery import LaneDelivery
from zephon.sources.memory import RangeSource


def double(payload: dict) -> dict:
    return {"idx": payload["idx"], "x": 2 * payload["idx"]}


def steps(loader: Any) -> Iterator[tuple[tuple, str]]:
    """Each delivery with the loader's state right after it (as JSON text)."""
    for item in loader:
        yield fingerprint_item(item), json.dumps(loader.state_dict(), sort_keys=True)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(0, 300),
    chunk_size=st.sampled_from([7, 32, 64]),
    micro_batch=st.sampled_from([8, 16, 256]),
    batch_size=st.none() | st.integers(1, 40),  # None: records handed over one by one
    lanes=st.integers(1, 3),
    drop=st.booleans(),
    drop_remainder=st.booleans(),
)
def test_the_compiled_step_delivers_and_books_what_the_python_step_does(
    n: int,
    chunk_size: int,
    micro_batch: int,
    batch_size: int | None,
    lanes: int,
    drop: bool,
    drop_remainder: bool,
) -> None:
    def pipeline() -> zephon.Pipeline:
        ops: list[Any] = [fetch(), map_transform(double)]
        if drop:  # tombstones between the records: batches that are not one run
            ops.append(DropMultiples(5))
        if batch_size is not None:
            ops.append(batch(batch_size, drop_remainder=drop_remainder))
        return zephon.Pipeline(
            RangeSource(n, chunk_size=chunk_size), ops, lanes=lanes, micro_batch=micro_batch
        )

    compiled = list(steps(iter(pipeline())))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LaneDelivery, "hand_over_head", nothing_to_hand_over)
        reference = list(steps(iter(pipeline())))
    assert compiled == reference


def nothing_to_hand_over(self: LaneDelivery) -> None:
    return None


@pytest.mark.parametrize("batched", [True, False], ids=["batches", "records"])
def test_the_python_step_is_what_the_reference_runs(batched: bool) -> None:
    # The reference above must really bypass the compiled hand-over, and the compiled step must
    # really skip the Python method, for batches and for records handed over one by one.
    calls = []
    original = LaneDelivery.next_delivery

    def counted(self: LaneDelivery) -> Any:
        calls.append(1)
        return original(self)

    ops: list[Any] = [fetch(), batch(8)] if batched else [fetch()]
    pipeline = zephon.Pipeline(RangeSource(64, chunk_size=64), ops)
    items = 8 if batched else 64
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LaneDelivery, "next_delivery", counted)
        assert len(list(iter(pipeline))) == items
        fast = len(calls)
        calls.clear()
        mp.setattr(LaneDelivery, "hand_over_head", nothing_to_hand_over)
        assert len(list(iter(pipeline))) == items
    assert fast < items <= len(calls)  # most compiled steps never reach Python


def test_a_collate_that_fails_in_the_compiled_step_names_the_batch_and_books_nothing() -> None:
    def picky(records: Any) -> Any:
        if records[0].payload["idx"] >= 16:
            raise ValueError("not this one")
        return len(records)

    loader = iter(
        zephon.Pipeline(RangeSource(64, chunk_size=64), [fetch(), batch(8, collate=picky)])
    )
    assert [next(loader).payload, next(loader).payload] == [8, 8]
    before = loader.state_dict()
    with pytest.raises(OperatorError, match=r"8 records starting at .*sample_id=\(0, 0, 16\).*not"):
        next(loader)
    assert loader.state_dict() == before  # the failed batch was not booked
    with pytest.raises(zephon.errors.ZephonError, match="failed earlier"):
        next(loader)
    loader.close()


class Step(LoaderStep):
    def _start_or_refuse(self) -> None:
        pass

    def _note_inflight(self) -> None:
        pass

    def _fail(self, exc: BaseException) -> None:
        self._failure = exc

    def _release_source(self) -> None:
        pass


def test_the_compiled_bases_refuse_what_is_not_a_lane() -> None:
    step = Step()
    step.lanes = [object()]  # type: ignore[list-item]
    step._started = True
    with pytest.raises(TypeError, match="LaneOutlet"):
        next(step)
    assert isinstance(step._failure, TypeError)  # a failed step is a failed loader
    assert Outlet().hand_over_head() is None  # no batcher, no feed: nothing to hand over


class Outlet(LaneOutlet):
    def next_delivery(self) -> None:
        return None


def test_a_hook_the_subclass_left_out_is_refused_by_name() -> None:
    step = Step()
    step.lanes = [LaneOutlet()]  # type: ignore[abstract]  # (a type checker refuses it too)
    step._started = True
    with pytest.raises(NotImplementedError, match=r"LaneOutlet must define next_delivery\(\)"):
        next(step)
    with pytest.raises(NotImplementedError, match=r"LoaderStep must define _fail\(\)"):
        LoaderStep()._fail(ValueError())  # type: ignore[abstract]


def test_the_step_lock_makes_another_thread_wait_and_refuses_the_thread_holding_it() -> None:
    lock = StepLock()
    order: list[str] = []
    with lock:
        assert lock.locked()
        with pytest.raises(RuntimeError, match="the loader was called again"):
            lock.__enter__()  # the same thread again: an error, not a hang

        def other() -> None:
            with lock:
                order.append("other")

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(0.2)
        assert thread.is_alive()  # waiting for the lock, with the GIL let go
        order.append("holder")
    thread.join(5)
    assert order == ["holder", "other"] and not lock.locked()


def test_a_loader_step_on_the_same_thread_inside_a_step_is_refused() -> None:
    # A training loop's callback that calls next() from inside a step (here: the lane's own
    # next_delivery) gets an error naming the loader, where a plain lock would hang.
    inner: list[BaseException] = []

    class Reentrant(Outlet):
        def next_delivery(self) -> None:
            try:
                next(step)
            except RuntimeError as exc:
                inner.append(exc)
            return None

    lane = Reentrant()
    lane.book = SimpleNamespace(found=[], opened=False)  # nothing to report
    step = Step()
    step.lanes = [lane]
    step._started = True
    with pytest.raises(StopIteration):
        next(step)
    assert len(inner) == 1 and "called again" in str(inner[0])
    assert not step._lock.locked()
