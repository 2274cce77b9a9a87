"""A loader's metrics in the Prometheus text format, served on a port of its own."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from zephon.observability.families import metric_families
from zephon.observability.sources import stats_source

try:
    from prometheus_client.core import (
        CollectorRegistry,
        CounterMetricFamily,
        GaugeMetricFamily,
        Metric,
    )
    from prometheus_client.exposition import make_wsgi_app
except ImportError as exc:  # pragma: no cover - what a missing extra says
    raise ImportError(
        "zephon.observability.serve_metrics needs prometheus_client: "
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


class MetricsServer:
    """Serves one loader's metrics at ``url`` from a daemon thread until ``close()``."""

    def __init__(self, source: Any, *, port: int = 0, addr: str = "127.0.0.1"):
        from wsgiref.simple_server import WSGIRequestHandler, make_server

        class _Quiet(WSGIRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # no line per scrape
                pass

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ZephonCollector(source))
        self._server = make_server(addr, port, make_wsgi_app(self.registry), handler_class=_Quiet)
        self.addr = addr
        self.port = int(self._server.server_port)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            args=(0.05,),  # how soon close() is answered
            name="zephon-metrics",
            daemon=True,
        )
        self._thread.start()

    @property
    def url(self) -> str:
        """Where the metrics are: ``http://addr:port/metrics``."""
        return f"http://{self.addr}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and join the thread."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
