"""Operators' setup and teardown: once per worker, in the worker, shared by its lanes, never
pickled; torn down once per worker on close, at the end and on an error."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from pipeline_kit import run_with_timeout

import zephon
from zephon.errors import OperatorError, PlanError
from zephon.ops import Operator, OperatorContext, OpTraits, batch, fetch
from zephon.ops.basic import Fetch
from zephon.ops.batching import Batch
from zephon.sources import RangeSource

pytestmark = pytest.mark.usefixtures("no_leftover_workers")

MODEL_BYTES = 50 * 1024 * 1024


class Unpicklable:
    """A 50 MB model that refuses to be pickled (the plan must never carry it)."""

    def __init__(self) -> None:
        self.weights = bytearray(MODEL_BYTES)

    def __reduce__(self) -> Any:
        raise TypeError("the model must never be pickled")


class Scored(Operator):
    """Loads a model in setup, notes each setup and teardown as a file, tags every record with
    the worker's pid and the model's identity."""

    traits = OpTraits(preserves_cursor_order=True)

    def __init__(self, notes: str, fail_on: int | None = None) -> None:
        self.notes = notes
        self.fail_on = fail_on
        self.model: Unpicklable | None = None

    def setup(self, ctx: OperatorContext) -> None:
        self.model = Unpicklable()
        Path(self.notes, f"setup-{os.getpid()}-{id(self.model)}").write_text(
            f"{ctx.worker} {list(ctx.lanes)} {ctx.rank} {ctx.world_size} "
            f"{threading.current_thread() is threading.main_thread()}"
        )

    def teardown(self) -> None:
        Path(self.notes, f"teardown-{os.getpid()}-{id(self.model)}").touch()

    def process_many(self, records):
        assert self.model is not None, "setup ran before the lane"
        out = []
        for rec in records:
            if rec.payload["idx"] == self.fail_on:
                raise RuntimeError("a bad record")
            out.append(
                rec.with_payload({**rec.payload, "worker": os.getpid(), "model": id(self.model)})
            )
        return out


def notes_of(where: Path, kind: str) -> list[str]:
    return sorted(p.name for p in where.iterdir() if p.name.startswith(kind))


def pipeline(notes: Path, **kw: Any) -> zephon.Pipeline:
    return zephon.Pipeline(
        RangeSource(400, chunk_size=16),
        [fetch(), Scored(str(notes), kw.pop("fail_on", None)), batch(4)],
        lanes=4,
        **kw,
    )


def rows(p: zephon.Pipeline) -> list[tuple[int, int, int]]:
    with p.iter() as loader:
        return [
            r
            for b in loader
            for r in zip(b.payload["idx"], b.payload["worker"], b.payload["model"])
        ]


def test_process_workers_load_the_model_once_each_share_it_and_never_pickle_it(tmp_path):
    got = rows(pipeline(tmp_path, workers="process", processes=2))
    assert sorted(i for i, _, _ in got) == list(range(400))
    setups = notes_of(tmp_path, "setup")
    assert len(setups) == 2  # once per worker process, whatever the lanes per worker
    assert {(w, m) for _, w, m in got} == {tuple(map(int, s.split("-")[1:])) for s in setups}
    assert all(Path(tmp_path, s).read_text().startswith("process [") for s in setups)
    assert notes_of(tmp_path, "teardown") == [s.replace("setup", "teardown") for s in setups]
    assert os.getpid() not in {w for _, w, _ in got}  # nothing ran in the training process


@pytest.mark.parametrize("workers", ["inline", "thread"])
def test_inline_and_thread_lanes_share_one_setup_in_the_training_process(tmp_path, workers):
    got = rows(pipeline(tmp_path, workers=workers, processes=2))
    assert sorted(i for i, _, _ in got) == list(range(400))
    (setup,) = notes_of(tmp_path, "setup")
    # inline lanes run in the training loop's thread; a thread lane's worker thread sets up
    on_main = workers == "inline"
    assert Path(tmp_path, setup).read_text() == f"{workers} [0, 1, 2, 3] 0 1 {on_main}"
    assert {(w, m) for _, w, m in got} == {tuple(map(int, setup.split("-")[1:]))}
    assert notes_of(tmp_path, "teardown") == [setup.replace("setup", "teardown")]


@pytest.mark.parametrize("workers", ["inline", "process"])
def test_teardown_runs_once_per_worker_on_close_and_on_an_error(tmp_path, workers):
    closed, failed = tmp_path / "closed", tmp_path / "failed"
    closed.mkdir()
    failed.mkdir()
    with pipeline(closed, workers=workers, processes=2).iter() as loader:
        next(loader)
    assert len(notes_of(closed, "teardown")) == len(notes_of(closed, "setup")) >= 1
    with pytest.raises(OperatorError, match="a bad record"):
        rows(pipeline(failed, workers=workers, processes=2, fail_on=37))
    assert len(notes_of(failed, "teardown")) == len(notes_of(failed, "setup")) >= 1


class BrokenSetup(Operator):
    traits = OpTraits(preserves_cursor_order=True)

    def setup(self, ctx: OperatorContext) -> None:
        raise FileNotFoundError("classifier.bin")

    def process_many(self, records):
        return records


@pytest.mark.parametrize("workers", ["inline", "thread", "process"])
def test_a_failing_setup_names_the_operator(workers):
    p = zephon.Pipeline(
        RangeSource(10), [fetch(), BrokenSetup(), batch(2)], lanes=2, workers=workers
    )
    with pytest.raises(
        OperatorError, match=r"setup of operator 'BrokenSetup' failed.*classifier\.bin"
    ):
        list(p)


def test_a_plan_with_setup_resumes_exactly(tmp_path):
    p = pipeline(tmp_path, workers="process", processes=2)
    with p.iter() as loader:
        head = [b.payload["idx"].tolist() for _, b in zip(range(20), loader)]
        state = loader.state_dict()
    with p.iter() as again:
        full = [b.payload["idx"].tolist() for b in again]
    with p.iter(state=state) as resumed:
        tail = [b.payload["idx"].tolist() for b in resumed]
    assert head + tail == full


class DecodingFetch(Fetch):
    """A reader that would load a decoder in setup: never run for the pipeline's reader."""

    def setup(self, ctx: OperatorContext) -> None:
        self.decoder = Unpicklable()


class CountingBatch(Batch):
    """A grouper with a teardown: never run for the pipeline's grouper."""

    def teardown(self) -> None:
        raise AssertionError("never called")


@pytest.mark.parametrize(
    ("ops", "named"),
    [
        ([DecodingFetch(), batch(2)], r"operator #0 \(DecodingFetch\) reads pointers"),
        ([fetch(), CountingBatch(2)], r"operator #1 \(CountingBatch\) groups records"),
    ],
    ids=["reader", "grouper"],
)
def test_a_reader_or_grouper_with_setup_is_refused_rather_than_never_set_up(ops, named):
    p = zephon.Pipeline(RangeSource(10), ops, lanes=2, workers="inline")
    with pytest.raises(PlanError, match=named + ".*setup.*teardown"):
        p.compile()


class HeldInside(Operator):
    """Holds its lane's worker thread inside ``process_many`` from the second chunk on, until
    the test lets it go; notes whether its model was torn down under it."""

    traits = OpTraits(preserves_cursor_order=True)
    inside = threading.Event()
    proceed = threading.Event()
    notes: list[str] = []

    def __init__(self) -> None:
        self.model: dict[str, bool] | None = None

    def setup(self, ctx: OperatorContext) -> None:
        self.model = {"alive": True}

    def teardown(self) -> None:
        assert self.model is not None
        self.model["alive"] = False
        self.notes.append("teardown")

    def process_many(self, records):
        assert self.model is not None
        if records and records[0].payload["idx"] >= 8:
            type(self).inside.set()
            assert type(self).proceed.wait(60)
        self.notes.append("used" if self.model["alive"] else "used after teardown")
        return records


def test_thread_lanes_are_torn_down_only_once_their_thread_left_the_operators():
    HeldInside.notes.clear()
    HeldInside.inside.clear()
    HeldInside.proceed.clear()
    p = zephon.Pipeline(
        RangeSource(64, chunk_size=8), [fetch(), HeldInside(), batch(4)], lanes=1, workers="thread"
    )
    loader = p.iter()
    try:
        next(loader)
        assert HeldInside.inside.wait(60)
        loader.close()  # the worker thread is inside process_many: close does not wait for it
        assert "teardown" not in HeldInside.notes
    finally:
        HeldInside.proceed.set()
    for thread in threading.enumerate():
        if thread.name.startswith("zephon-lane-"):
            thread.join(60)
    assert HeldInside.notes[-2:] == ["used", "teardown"]
    assert HeldInside.notes.count("teardown") == 1


def test_a_failing_setup_of_thread_lanes_sharing_a_thread_names_the_operator():
    p = zephon.Pipeline(
        RangeSource(10), [fetch(), BrokenSetup(), batch(2)], lanes=4, workers="thread", processes=2
    )
    with pytest.raises(
        OperatorError, match=r"setup of operator 'BrokenSetup' failed.*classifier\.bin"
    ):
        list(p)


class ByLanguage(Operator):
    """Fills, in setup, a dict made in ``__init__`` (a change in place, not an assignment)."""

    traits = OpTraits(preserves_cursor_order=True)

    def __init__(self) -> None:
        self.models: dict[str, Unpicklable] = {}

    def setup(self, ctx: OperatorContext) -> None:
        self.models["en"] = Unpicklable()

    def process_many(self, records):
        return records


@pytest.mark.parametrize("workers", ["inline", "thread", "process"])
def test_an_operator_its_setup_left_uncopyable_is_named_with_the_way_out(workers):
    # A lane copies the set-up operator, sharing only the attributes setup assigned: the dict
    # filled in place is copied, and the model in it cannot be.
    p = zephon.Pipeline(
        RangeSource(40, chunk_size=8), [fetch(), ByLanguage(), batch(4)], lanes=2, workers=workers
    )
    with pytest.raises(
        OperatorError,
        match=r"operator 'ByLanguage' cannot be copied for a lane after its setup.*"
        r"TypeError: the model must never be pickled.*assign",
    ):
        list(p)


class CollectsInSetup(Operator):
    """Loads a model in setup; the allocations of a real load may run a garbage collection
    there, which this one does outright."""

    traits = OpTraits(preserves_cursor_order=True)

    def setup(self, ctx: OperatorContext) -> None:
        self.model = list(range(1000))
        gc.collect()

    def process_many(self, records):
        return records


def test_a_collection_in_setup_that_frees_an_abandoned_loader_does_not_hang():
    # The abandoned loader's plan is freed by the collection inside the second loader's setup,
    # and tearing its setup down must not wait for the setup in progress.
    p = zephon.Pipeline(RangeSource(16, chunk_size=4), [fetch(), CollectsInSetup()], lanes=1)
    abandoned = p.iter()
    next(abandoned)
    cycle: list[Any] = [abandoned]
    cycle.append(cycle)  # reachable only from a cycle, freed by the next collection
    del abandoned, cycle

    def second_run() -> int:
        with p.iter() as loader:
            return len(list(loader))

    assert run_with_timeout(second_run, 60) == 16


class GuardsItsCache(Operator):
    """Makes a lock in ``__init__``, which no lane can copy."""

    traits = OpTraits(preserves_cursor_order=True)

    def __init__(self) -> None:
        self._guard = threading.Lock()

    def process_many(self, records):
        return records


class GuardsItsCacheWithAModel(GuardsItsCache):
    def setup(self, ctx: OperatorContext) -> None:
        self.model = Unpicklable()


@pytest.mark.parametrize("workers", ["inline", "thread"])
@pytest.mark.parametrize(
    ("op", "where"),
    [(GuardsItsCache, "lane 0"), (GuardsItsCacheWithAModel, r"\w+ lanes \[0\]")],
    ids=["without-setup", "with-setup"],
)
def test_an_operator_a_lane_cannot_copy_is_named_with_its_attribute_and_the_way_out(
    workers, op, where
):
    p = zephon.Pipeline(RangeSource(40, chunk_size=8), [fetch(), op(), batch(4)], workers=workers)
    with pytest.raises(
        OperatorError,
        match=rf"operator '{op.__name__}' cannot be copied for {where}, in its attribute _guard "
        r"\(TypeError: cannot pickle '_thread.lock' object\).*start_epoch",
    ):
        list(p)
