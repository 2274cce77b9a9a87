"""A loader's metrics as a ``prometheus_client`` collector, for a registry of your own
(``serve_metrics`` needs no client library)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from zephon.observability.families import metric_families
from zephon.observability.sources import stats_source

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
except ImportError as exc:  # pragma: no cover - what a missing extra says
    raise ImportError(
        "zephon.observability.prometheus needs prometheus_client: "
        'pip install "zephon-loader[metrics]"'
    ) from exc


class ZephonCollector:
    """A ``prometheus_client`` collector of one loader's metrics (``metric_families``), read
    afresh at every scrape; register it in any registry."""

    def __init__(self, source: Any):
        self.source = stats_source(source)

    def collect(self) -> Iterator[Metric]:
        for family in metric_families(self.source.read(), rank=self.source.rank):
            labels = sorted(family.samples[0][0])
            if family.kind == "counter":
                metric: Any = CounterMetricFamily(
                    family.name.removesuffix("_total"), family.help, labels=labels
                )
            else:
                metric = GaugeMetricFamily(family.name, family.help, labels=labels)
            for sample_labels, value in family.samples:
                metric.add_metric([sample_labels[k] for k in labels], value)
            yield metric
