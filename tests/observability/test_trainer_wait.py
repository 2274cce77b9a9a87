"""How long the training loop waited inside next(): counted per step in stats(), served as
metrics, and turned by explain into whether the loader is the bottleneck at all."""

from __future__ import annotations

import gc
import urllib.request
import weakref

import pytest
from pipeline_kit import busy

import zephon
from zephon.observability import serve_metrics
from zephon.ops import batch, fetch, map_transform, tokenize
from zephon.sources import ListSource, RangeSource

prometheus_parser = pytest.importorskip("prometheus_client.parser")
pytestmark = pytest.mark.usefixtures("no_leftover_workers")


def texts(n: int) -> ListSource:
    return ListSource([{"text": f"doc {i} " + "word " * (i % 17)} for i in range(n)], chunk_size=32)


def scraped(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    return {
        s.name: s.value
        for family in prometheus_parser.text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels.keys() - {"rank"}
    }


def test_every_step_is_counted_and_the_scrape_serves_the_waits_of_stats():
    pipeline = zephon.Pipeline(texts(600), [fetch(), tokenize(), batch(4)], lanes=2)
    with pipeline.iter() as loader, serve_metrics(loader) as server:
        before = loader.stats()["trainer_wait"]
        steps = sum(1 for _ in loader)
        waits = loader.stats()["trainer_wait"]
        got = scraped(server.url)
    assert before == {
        "seconds": 0.0,
        "steps": 0,
        "recent_seconds": 0.0,
        "recent_steps": 0,
        "elapsed": 0.0,
    }
    assert steps == 150 and waits["steps"] == steps and waits["recent_steps"] == 100
    # the first step waited for the lanes' first item lists: some time, however short
    assert 0 < waits["recent_seconds"] <= waits["seconds"] <= waits["elapsed"]
    assert got["zephon_trainer_wait_seconds_total"] == waits["seconds"]
    assert got["zephon_trainer_steps_total"] == steps
    assert got["zephon_trainer_wait_recent_seconds"] == waits["recent_seconds"]
    assert got["zephon_trainer_wait_recent_steps"] == 100
    # the stream ended: the time running stopped with it
    assert got["zephon_trainer_elapsed_seconds"] == waits["elapsed"]


def test_on_process_lanes_the_steps_are_the_batches_handed_over():
    pipeline = zephon.Pipeline(
        texts(600), [fetch(), tokenize(), batch(4)], lanes=2, workers="process"
    )
    with pipeline.iter() as loader:
        for _ in zip(range(30), loader):
            pass
        waits = loader.stats()["trainer_wait"]
        assert waits["steps"] == 30 and waits["recent_steps"] == 30
        assert 0 < waits["recent_seconds"] == waits["seconds"] <= waits["elapsed"]
        rest = sum(1 for _ in loader)
        assert loader.stats()["trainer_wait"]["steps"] == 30 + rest == 150


def test_explain_says_the_loader_is_the_bottleneck_and_names_the_slow_map():
    pipeline = zephon.Pipeline(
        texts(400),
        [fetch(), map_transform(busy, name="slow_map"), tokenize(), batch(4)],
        lanes=2,
        workers="inline",
    )
    with pipeline.iter() as loader:
        for _ in zip(range(60), loader):
            pass
        lines = loader.explain().splitlines()
    assert lines[0].startswith("The loader is the bottleneck: the trainer waited ")
    assert " in the last 60 steps (" in lines[0]
    assert lines[1].startswith("slow_map takes")


def train_step() -> int:
    x = 0
    for i in range(50_000):  # the training loop's own work, much slower than the loader's
        x += i
    return x


def test_explain_says_the_loader_keeps_up_when_the_training_loop_is_the_slow_side():
    pipeline = zephon.Pipeline(
        RangeSource(20_000, chunk_size=1024), [fetch(), batch(32)], lanes=2, workers="inline"
    )
    with pipeline.iter() as loader:
        for _ in zip(range(300), loader):
            train_step()
        waits = loader.stats()["trainer_wait"]
        first = loader.explain().splitlines()[0]
    assert first.startswith("The loader keeps up: the trainer waited ")
    assert " in the last 100 steps (" in first
    assert "The training loop, not the loader, sets the pace" in first
    assert waits["steps"] == 300 and waits["seconds"] < waits["elapsed"]


def test_a_loader_dropped_unclosed_goes_with_its_last_reference():
    # The waits point back at the loader for its steps: weakly, or the loader would live on in
    # a reference cycle (its workers too) until some later garbage collection.
    pipeline = zephon.Pipeline(RangeSource(1000, chunk_size=100), [fetch(), batch(10)], lanes=2)
    loader = pipeline.iter()
    next(loader)
    gone = weakref.ref(loader)
    was = gc.isenabled()
    gc.disable()
    try:
        del loader
        assert gone() is None
    finally:
        if was:
            gc.enable()
