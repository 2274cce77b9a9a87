"""A loader's metrics as a ``prometheus_client`` collector, for a registry of your own
(``serve_metrics`` needs no client library)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

from zephon.observability.families import Labels, extra_labels, metric_families
from zephon.observability.sources import StatsSource, stats_source

try:
    from prometheus_client.core import Metric
except ImportError as exc:  # pragma: no cover - what a missing extra says
    raise ImportError(
        "zephon.observability.prometheus needs prometheus_client: "
        'pip install "zephon-loader[metrics]"'
    ) from exc


class ZephonCollector:
    """A ``prometheus_client`` collector of loaders' metrics (``metric_families``), read afresh
    at every scrape; register it in any registry.

    ``labels`` are added to every sample of ``source``. One collector serves every loader of a
    process: ``add`` another one (an evaluation loader, ``labels={"loader": "eval"}``) to the
    same collector, since a registry takes a metric name from one collector only, and a scraper
    refuses an exposition that declares a metric twice. A loader added with the labels of one
    already there takes its place (the next run of a loop, that of the last)."""

    def __init__(self, source: Any, *, labels: Mapping[str, str] | None = None):
        self._lock = threading.Lock()  # a scrape may run while a loader is added
        self._sources: dict[tuple[tuple[str, str], ...], tuple[StatsSource, Labels]] = {}
        self.add(source, labels=labels)

    def add(self, source: Any, *, labels: Mapping[str, str] | None = None) -> None:
        """Report ``source``'s metrics too, with ``labels`` added to its samples, in place of a
        loader added with the same labels."""
        read = stats_source(source)  # a TypeError for what is not a loader, before anything
        extra = extra_labels(labels, "ZephonCollector")
        with self._lock:
            self._sources[tuple(sorted(extra.items()))] = (read, extra)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            sources = list(self._sources.values())
        merged: dict[str, Metric] = {}
        for source, extra in sources:
            for family in metric_families(source.read(), rank=source.rank):
                metric = merged.get(family.name)
                if metric is None:  # a counter's family is named without its samples' _total
                    name = family.name.removesuffix("_total")
                    metric = merged[family.name] = Metric(name, family.help, family.kind)
                for labels, value in family.samples:
                    metric.add_sample(family.name, {**labels, **extra}, value)
        yield from merged.values()
