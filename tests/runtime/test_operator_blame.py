"""Which record an operator's error names. A run that fails on a bad record is mended by retiring
or fixing that record, so the error may name one only when it is to blame: the one that fails
when called again alone. When the records of a micro-batch fail only together (a call too large
for memory, a failure that comes and goes), or the operator keeps state and cannot be called
again, the error names the micro-batch and no record."""

from __future__ import annotations

import multiprocessing
import sys
import threading

import numpy as np
import pytest

import zephon
from zephon.errors import OperatorError, ZephonError
from zephon.ops.base import Operator, OpTraits
from zephon.ops.basic import fetch
from zephon.sources.memory import RangeSource
from zephon.types import SampleCursor

KINDS = ["inline", "thread", "process"]


class FailsOn13(Operator):
    """Fails on any call that holds sample 13: the record to blame."""

    traits = OpTraits(preserves_cursor_order=True)

    def process_many(self, records: list) -> list:
        if any(r.payload["idx"] == 13 for r in records):
            raise ValueError("sample 13 is bad")
        return records


class FailsOnMany(Operator):
    """Fails on any call of more than 4 records, as a call too large for memory does."""

    traits = OpTraits(preserves_cursor_order=True)

    def process_many(self, records: list) -> list:
        if len(records) > 4:
            raise MemoryError(f"no room for {len(records)} records")
        return records


class KeepsStateFailsOn13(FailsOn13):
    traits = OpTraits(preserves_cursor_order=True, stateful=True)


class KeepsStateExitsOn13(Operator):
    traits = OpTraits(preserves_cursor_order=True, stateful=True)

    def process_many(self, records: list) -> list:
        if any(r.payload["idx"] == 13 for r in records):
            sys.exit(3)
        return records


def run(op: Operator, workers: str, micro_batch: int = 8, on_error: str = "raise") -> None:
    source = RangeSource(40, chunk_size=8)
    ops = [fetch(), op]
    list(zephon.Pipeline(source, ops, workers=workers, micro_batch=micro_batch, on_error=on_error))


@pytest.mark.parametrize("workers", KINDS)
def test_the_record_that_fails_alone_is_named(workers: str) -> None:
    with pytest.raises(OperatorError, match=r"failed on record SampleCursor\(1, 5,") as info:
        run(FailsOn13(), workers)
    assert isinstance(info.value.cursor, SampleCursor) and info.value.cursor.sample_id[2] == 13
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("workers", KINDS)
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_records_that_fail_only_together_name_the_micro_batch_and_no_record(
    workers: str, on_error: str
) -> None:
    with pytest.raises(OperatorError) as info:
        run(FailsOnMany(), workers, on_error=on_error)  # skipping finds no record to skip
    text = str(info.value)
    assert (
        "micro-batch of 8 records, SampleCursor(0, 0," in text and "to SampleCursor(0, 7," in text
    )
    assert "no record is to blame" in text and "MemoryError: no room for 8 records" in text
    assert "failed on record" not in text and info.value.cursor is None
    assert not multiprocessing.active_children()


def test_an_operator_that_keeps_state_names_the_micro_batch_and_says_why() -> None:
    with pytest.raises(OperatorError) as info:
        run(KeepsStateFailsOn13(), "inline")
    text = str(info.value)
    assert "micro-batch of 8 records, SampleCursor(1, 0," in text and "it keeps state" in text
    assert "failed on record" not in text and info.value.cursor is None


def test_the_only_record_of_a_call_is_named_even_by_an_operator_that_keeps_state() -> None:
    with pytest.raises(OperatorError, match=r"failed on record SampleCursor\(1, 5,") as info:
        run(KeepsStateFailsOn13(), "inline", micro_batch=1)
    assert isinstance(info.value.cursor, SampleCursor) and info.value.cursor.sample_id[2] == 13


@pytest.mark.parametrize(
    ("micro_batch", "named"), [(8, "a micro-batch of 8 records,"), (1, "record")]
)
def test_an_exit_names_the_record_only_when_it_is_the_one(micro_batch: int, named: str) -> None:
    with pytest.raises(
        OperatorError, match=rf"called sys.exit\(3\) on {named} SampleCursor\(1, "
    ) as info:
        run(KeepsStateExitsOn13(), "inline", micro_batch=micro_batch)
    assert (info.value.cursor is None) == (micro_batch > 1)


class FailsInHook(Operator):
    """Keeps a running count; raises in the one hook named ``hook``."""

    traits = OpTraits(preserves_cursor_order=True, stateful=True)

    def __init__(self, hook: str) -> None:
        self.hook = hook
        self._seen = 0

    def _fail(self, hook: str) -> None:
        if hook == self.hook:
            raise RuntimeError(f"broken {hook}")

    def start_epoch(self, lane_id: int, epoch: int) -> None:
        super().start_epoch(lane_id, epoch)
        self._fail("start_epoch")

    def process_many(self, records: list) -> list:
        self._seen += len(records)
        return records

    def flush(self) -> list:
        self._fail("flush")
        return []

    def carry_state(self) -> dict:
        self._fail("carry_state")
        return {"seen": self._seen}

    def restore_carry(self, state: dict) -> None:
        self._seen = state["seen"]

    def counters(self) -> dict:
        self._fail("counters")
        return {"seen": self._seen}


@pytest.mark.parametrize("workers", ["inline", "process"])
@pytest.mark.parametrize("hook", ["start_epoch", "flush", "carry_state", "counters"])
def test_an_error_in_an_operator_hook_names_the_operator_the_hook_and_the_lane(
    hook: str, workers: str
) -> None:
    with pytest.raises(
        OperatorError, match=rf"operator 'FailsInHook' failed in {hook}\(\): RuntimeError: broken"
    ) as info:
        run(FailsInHook(hook), workers)
    assert info.value.context["lane"] == 0
    assert not multiprocessing.active_children()


class CarriesNumpy(FailsInHook):
    """Carries its count as a numpy integer, which a checkpoint (JSON) cannot hold."""

    def carry_state(self) -> dict:
        return {"seen": np.int64(self._seen)}


@pytest.mark.parametrize("workers", ["inline", "process"])
def test_a_carry_state_that_is_not_json_names_the_operator_and_the_value(workers: str) -> None:
    with pytest.raises(
        OperatorError,
        match=r"operator 'CarriesNumpy' returned a carry_state\(\) that is not JSON data.*int64",
    ) as info:
        run(CarriesNumpy(""), workers)
    assert info.value.context["lane"] == 0


class QuotaExceeded(ZephonError):
    """A user's own error class, whose constructor takes more than the message."""

    def __init__(self, message: str, limit: int) -> None:
        super().__init__(message)
        self.limit = limit


class RaisesItsOwnError(Operator):
    traits = OpTraits(preserves_cursor_order=True)

    def process_many(self, records: list) -> list:
        if any(r.payload["idx"] == 13 for r in records):
            raise QuotaExceeded("quota of 12 samples exceeded", 12)
        return records


def test_a_zephon_error_of_the_users_that_pickle_cannot_rebuild_still_reaches_the_loop() -> None:
    # Pickled in the worker, it could not be made again in the loader (its __init__ needs the
    # limit), which ended the run with a TypeError about __init__ instead of the error.
    with pytest.raises(ZephonError, match=r"QuotaExceeded: quota of 12 samples exceeded") as info:
        run(RaisesItsOwnError(), "process")
    assert info.value.context["lane"] == 0
    assert info.value.context["operator"] == "RaisesItsOwnError"
    assert not multiprocessing.active_children()


class CountsAName(FailsInHook):
    """Reports the name of its model among its counts, which stats() cannot add up."""

    def counters(self) -> dict:
        return {"seen": self._seen, "model": "bert-base"}


@pytest.mark.parametrize("workers", ["inline", "process"])
def test_counters_that_are_not_numbers_name_the_operator(workers: str) -> None:
    with pytest.raises(
        OperatorError,
        match=r"operator 'CountsAName' returned counters\(\) that are not all numbers: "
        r"'model': 'bert-base'",
    ) as info:
        run(CountsAName(""), workers)
    assert info.value.context["lane"] == 0


class TakesItsInput(Operator):
    """Consumes the list it is given (``pop``) and fails on sample 13."""

    traits = OpTraits(preserves_cursor_order=True)

    def process_many(self, records: list) -> list:
        out = []
        while records:
            rec = records.pop(0)
            if rec.payload["idx"] == 13:
                raise ValueError("sample 13 is bad")
            out.append(rec)
        return out


def test_an_operator_that_empties_its_input_list_still_has_the_failing_record_named() -> None:
    # The runner looked for the culprit in the list the operator had emptied up to it.
    with pytest.raises(OperatorError, match=r"failed on record SampleCursor\(1, 5,") as info:
        run(TakesItsInput(), "inline")
    assert isinstance(info.value.cursor, SampleCursor) and info.value.cursor.sample_id[2] == 13


def test_an_operator_that_empties_its_input_list_still_has_the_failing_record_skipped() -> None:
    loader = zephon.Pipeline(
        RangeSource(40, chunk_size=8), [fetch(), TakesItsInput()], on_error="skip"
    ).iter()
    delivered = [r.payload["idx"] for r in loader]
    assert delivered == [i for i in range(40) if i != 13]
    assert loader.stats()["operators"]["TakesItsInput"]["records_in"] == 40


class LocksItsCache(FailsOn13):
    """Makes its lock in start_epoch, as a lane's copy should: the running operator cannot be
    copied any more."""

    def start_epoch(self, lane_id: int, epoch: int) -> None:
        super().start_epoch(lane_id, epoch)
        self._guard = threading.Lock()

    def process_many(self, records: list) -> list:
        with self._guard:
            return super().process_many(records)


def test_an_operator_holding_a_lock_still_has_the_record_that_fails_alone_named() -> None:
    # Calling a copy of it on each record failed at the copy, which blamed the first record.
    with pytest.raises(OperatorError, match=r"failed on record SampleCursor\(1, 5,") as info:
        run(LocksItsCache(), "inline")
    assert isinstance(info.value.cursor, SampleCursor) and info.value.cursor.sample_id[2] == 13
