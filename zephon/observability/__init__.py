"""See what a loader is doing: its counters as metrics your monitoring stack scrapes
(``serve_metrics``, Prometheus; ``metric_families`` for any other sink), a JSON-lines log of them
for runs without one (``MetricsLog``), and the bottleneck named in words (``explain``).

Nothing here runs unless you call it, and nothing here imports an optional dependency until it
needs it: ``ZephonCollector`` (``zephon.observability.prometheus``) needs ``prometheus_client`` (the
``metrics`` extra), ``zephon.observability.otel`` the OpenTelemetry SDK (the ``otel`` extra).
"""

from __future__ import annotations

from typing import Any

from zephon.observability.explain import explain
from zephon.observability.families import Family, metric_families
from zephon.observability.log import MetricsLog, read_metrics_log
from zephon.observability.sources import StatsSource, stats_source

__all__ = [
    "Family",
    "MetricsLog",
    "StatsSource",
    "explain",
    "metric_families",
    "read_metrics_log",
    "serve_metrics",
    "stats_source",
]


def serve_metrics(source: Any, port: int = 0, addr: str = "127.0.0.1") -> Any:
    """Serve ``source``'s metrics (a ``Loader``, a torch ``ZephonIterableDataset`` or a
    ``StatefulDataLoader`` around one) in the Prometheus text format at
    ``http://addr:port/metrics``, from a daemon thread; ``port=0`` picks a free port, ``addr``
    may be an IPv6 address (``"::"``: every address, IPv4 ones too). Returns a
    ``MetricsServer`` (``.url``, ``.port``, ``.close()``; a context manager)."""
    from zephon.observability.server import MetricsServer

    return MetricsServer(source, port=port, addr=addr)
