"""The loader's metrics as OpenTelemetry instruments: the same families, the same numbers as
the Prometheus endpoint serves."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest

import zephon
from zephon.observability import serve_metrics
from zephon.observability.families import catalogue
from zephon.ops import batch, fetch, pack_sequences, tokenize
from zephon.sources import ListSource, MixtureSource

prometheus_parser = pytest.importorskip("prometheus_client.parser")
metrics_sdk = pytest.importorskip("opentelemetry.sdk.metrics")
export = pytest.importorskip("opentelemetry.sdk.metrics.export")
pytestmark = pytest.mark.usefixtures("no_leftover_workers")


def texts(dataset_id: int, n: int) -> ListSource:
    return ListSource(
        [{"text": f"doc {dataset_id}-{i} " + "word " * (i % 23)} for i in range(n)],
        dataset_id=dataset_id,
        chunk_size=32,
    )


def otel_samples(reader) -> dict[tuple[str, tuple], float]:
    out = {}
    kinds = {}
    for resource in reader.get_metrics_data().resource_metrics:
        for scope in resource.scope_metrics:
            assert scope.scope.name == "zephon"
            for metric in scope.metrics:
                monotonic = getattr(metric.data, "is_monotonic", False)
                kinds[metric.name] = monotonic
                name = metric.name + "_total" if monotonic else metric.name
                for point in metric.data.data_points:
                    out[name, tuple(sorted(point.attributes.items()))] = point.value
    return out


def prometheus_samples(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in prometheus_parser.text_string_to_metric_families(text)
        for s in family.samples
    }


def moving(name: str) -> bool:
    return "seconds" in name or name == "zephon_lane_queued_item_lists"


def test_the_otel_reader_sees_the_numbers_of_the_prometheus_scrape():
    from zephon.observability.otel import register_metrics

    source = MixtureSource(
        {"a": texts(0, 400), "b": texts(1, 400)}, {"a": 0.5, "b": 0.5}, chunk_size=32
    )
    pipeline = zephon.Pipeline(
        source, [fetch(), tokenize(), pack_sequences(64), batch(4)], lanes=2, workers="process"
    )
    reader = export.InMemoryMetricReader()
    provider = metrics_sdk.MeterProvider(metric_readers=[reader])
    try:
        with pipeline.iter() as loader, serve_metrics(loader) as server:
            instruments = register_metrics(loader, provider)
            for _ in zip(range(20), loader):
                pass
            # the same numbers while the run goes on ...
            scraped = prometheus_samples(server.url)
            seen = otel_samples(reader)

            # (but time, and the lists the workers have ready, go on between two reads)
            def steady(samples: dict) -> dict:
                return {k: v for k, v in samples.items() if not moving(k[0])}

            assert steady(scraped) == steady(seen)
            for _ in loader:
                pass
            # ... and, every one of them, once it ended
            assert otel_samples(reader) == prometheus_samples(server.url)
    finally:
        provider.shutdown()
    assert len(instruments) == len(catalogue())
    names = {name for name, _ in scraped}
    assert {"zephon_trainer_wait_seconds_total", "zephon_packing_fill"} <= names
    assert "zephon_mixture_share_error" in names


def test_import_zephon_imports_no_opentelemetry():
    code = (
        "import sys, zephon, zephon.observability\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')], 'otel'\n"
        "assert 'zephon.observability.otel' not in sys.modules\n"
        "assert 'prometheus_client' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _delivered(reader) -> dict[tuple, float]:
    return {
        labels: value
        for (name, labels), value in otel_samples(reader).items()
        if name == "zephon_records_delivered_total"
    }


def test_a_later_loader_on_the_same_provider_is_reported_and_two_at_once_by_their_attributes():
    from zephon.observability.otel import register_metrics

    pipeline = zephon.Pipeline(texts(0, 200), [fetch(), batch(4)], lanes=2)
    reader = export.InMemoryMetricReader()
    provider = metrics_sdk.MeterProvider(metric_readers=[reader])
    rank = ("rank", "0")
    try:
        with pipeline.iter() as first:
            register_metrics(first, provider)
            for _ in zip(range(3), first):
                pass
            assert _delivered(reader) == {(rank,): 12}
        with pipeline.iter() as second:  # the next run of a loop: it replaces the first
            register_metrics(second, provider)
            next(second)
            assert _delivered(reader) == {(rank,): 4}
            with pipeline.iter() as evaluation:
                register_metrics(evaluation, provider, attributes={"loader": "eval"})
                for _ in zip(range(5), evaluation):
                    pass
                assert _delivered(reader) == {(rank,): 4, (("loader", "eval"), rank): 20}
            with pytest.raises(ValueError, match=r"attributes may not name \['lane', 'rank'\]"):
                register_metrics(second, provider, attributes={"rank": "1", "lane": "0"})
    finally:
        provider.shutdown()
