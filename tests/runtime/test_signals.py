"""A signal handler and the loader: a preemption notice (SIGTERM on most clusters) that arrives
while ``next()`` is working runs its handler in the middle of a step. Taking the state there is
refused with what to do instead, and the way it says works: a flag, and the state taken in the
training loop once ``next()`` has returned, resumes the run exactly."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import zephon
from zephon.ops.basic import fetch, map_transform
from zephon.ops.batching import batch
from zephon.sources.memory import RangeSource

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="no SIGUSR1")

NOTICE_AT = 45  # the sample whose transform the notice interrupts


armed: list[bool] = []  # one notice comes while it holds True (``uninterrupted_then_armed``)


def notice_during(payload: dict) -> dict:
    # The notice arrives while the step transforms this sample: its handler runs right here,
    # in the main thread, in the middle of next().
    if payload["idx"] == NOTICE_AT and armed:
        armed.clear()  # once: a resumed run meets no notice
        signal.raise_signal(signal.SIGUSR1)
    return payload


def notice_from_the_lane(payload: dict) -> dict:
    # On a thread lane the notice comes while the main thread most likely waits inside next()
    # for this lane's items (the sleep), else between two items: either way the state a handler
    # gets, or its refusal, must leave the run exact.
    if payload["idx"] == NOTICE_AT and armed:
        armed.clear()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
    return payload


def pipeline(
    batch_size: int | None,
    transform: Callable[[dict], dict] = notice_during,
    workers: str = "inline",
) -> zephon.Pipeline:
    ops: list = [fetch(), map_transform(transform)]
    if batch_size is not None:
        ops.append(batch(batch_size))
    source = RangeSource(120, chunk_size=16, shuffle=True, seed=3)
    return zephon.Pipeline(source, ops, lanes=2, workers=workers)


def uninterrupted_then_armed(make: Callable[[], zephon.Pipeline]) -> list:
    """The sample ids ``make()``'s pipeline delivers without a notice; the next run gets one."""
    full = ids(make().iter())
    armed.append(True)
    return full


def ids(items: Any) -> list:
    """Each item's sample ids: an int for a record, a list for a batch."""
    return [np.asarray(item.payload["idx"]).tolist() for item in items]


@pytest.fixture
def on_notice() -> Iterator[list]:
    """SIGUSR1 runs each callable appended to the list."""
    handlers: list = []
    before = signal.signal(signal.SIGUSR1, lambda *_: [h() for h in handlers])
    try:
        yield handlers
    finally:
        armed.clear()
        signal.signal(signal.SIGUSR1, before)


@pytest.mark.parametrize("batch_size", [None, 4])
def test_a_state_taken_in_a_signal_handler_inside_next_is_refused_with_what_to_do(
    on_notice: list, batch_size: int | None
) -> None:
    full = uninterrupted_then_armed(lambda: pipeline(batch_size))
    loader = pipeline(batch_size).iter()
    on_notice.append(loader.state_dict)
    got: list = []
    with pytest.raises(zephon.ZephonError) as failed:
        for item in loader:
            got += ids([item])
    refused = failed.value.__cause__
    assert isinstance(refused, RuntimeError)
    assert "signal handler" in str(refused) and "set a flag" in str(refused)
    # The interrupted step delivered nothing, and the loader's state is still the one after the
    # last item it handed over.
    state = loader.state_dict()
    loader.close()
    assert got + ids(pipeline(batch_size).iter(state=state)) == full


@pytest.mark.parametrize("batch_size", [None, 4])
def test_a_flag_set_by_the_handler_and_the_state_taken_after_next_resumes_exactly(
    on_notice: list, batch_size: int | None
) -> None:
    full = uninterrupted_then_armed(lambda: pipeline(batch_size))
    notice: list[bool] = []
    on_notice.append(lambda: notice.append(True))
    got: list = []
    with pipeline(batch_size).iter() as loader:
        for item in loader:
            got += ids([item])
            if notice:  # the training loop saves its model and the loader's state here
                state = loader.state_dict()
                break
    assert notice and 0 < len(got) < len(full)
    assert got + ids(pipeline(batch_size).iter(state=state)) == full


def test_a_handler_that_catches_the_refusal_leaves_the_run_going_and_a_state_it_got_is_exact(
    on_notice: list,
) -> None:
    def lane_pipeline() -> zephon.Pipeline:
        return pipeline(4, notice_from_the_lane, workers="thread")

    full = uninterrupted_then_armed(lane_pipeline)
    got: list = []
    taken: list = []  # (items delivered then, the state)
    refused: list[RuntimeError] = []

    def save() -> None:
        try:
            taken.append((len(got), loader.state_dict()))
        except RuntimeError as exc:
            refused.append(exc)

    on_notice.append(save)
    with lane_pipeline().iter() as loader:
        for item in loader:
            got += ids([item])
    assert got == full  # the handler's call, refused or not, changed nothing
    assert len(taken) + len(refused) == 1  # refused in each of 12 runs tried here
    if refused:
        assert "set a flag" in str(refused[0])
    else:
        ((delivered, state),) = taken
        assert got[:delivered] + ids(lane_pipeline().iter(state=state)) == full
