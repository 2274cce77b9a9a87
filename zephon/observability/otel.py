"""A loader's metrics as OpenTelemetry instruments: the families of ``metric_families`` (the ones
the Prometheus endpoint serves), declared as observable counters and gauges on a
``MeterProvider`` you give, and read from ``stats()`` whenever the provider's readers collect.

One design, two sinks: an instrument is named as its family (a counter without the ``_total``
that OpenTelemetry's exporters add back), has the family's help as its description and the
family's labels as its attributes, ``rank`` among them.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from zephon.observability.families import Labels, catalogue, extra_labels, metric_families
from zephon.observability.sources import stats_source

try:
    from opentelemetry.metrics import CallbackOptions, Instrument, MeterProvider, Observation
except ImportError as exc:  # pragma: no cover - what a missing extra says
    raise ImportError(
        'zephon.observability.otel needs the OpenTelemetry SDK: pip install "zephon-loader[otel]"'
    ) from exc

#: A reading older than this many seconds is never used (a collection observes every
#: instrument back to back, well within it).
FRESH_FOR = 0.5


class _Reading:
    """One ``stats()`` for all the instruments of a collection: read again when an instrument
    it already answered asks again (the next collection), or once ``FRESH_FOR`` has passed."""

    def __init__(self, source: Any):
        self.source = stats_source(source)
        self._lock = threading.Lock()  # readers may collect from threads of their own
        self._at = -float("inf")
        self._samples: dict[str, list[tuple[Labels, float]]] = {}
        self._answered: set[str] = set()

    def samples(self, name: str) -> list[tuple[Labels, float]]:
        with self._lock:
            now = time.monotonic()
            if name in self._answered or now - self._at > FRESH_FOR:
                families = metric_families(self.source.read(), rank=self.source.rank)
                self._samples = {f.name: f.samples for f in families}
                self._answered = set()
                self._at = now
            self._answered.add(name)
            return self._samples.get(name, [])


def _unit(name: str) -> str:
    for suffix, unit in (("_seconds", "s"), ("_bytes", "By")):
        if name.removesuffix("_total").endswith(suffix):
            return unit
    return "1"


class _Registered:
    """The instruments declared on one ``MeterProvider`` and the loaders they report, by their
    ``attributes`` (the SDK keeps the first instrument of a name and drops the callbacks of any
    later one, so the instruments are declared once and observe every loader registered)."""

    def __init__(self, meter_provider: MeterProvider):
        self._lock = threading.Lock()
        self.readings: dict[tuple[tuple[str, str], ...], tuple[_Reading, Labels]] = {}
        meter = meter_provider.get_meter("zephon")
        self.instruments: list[Instrument] = []
        for name, kind, help in catalogue():

            def observe(options: CallbackOptions, name: str = name) -> Iterable[Observation]:
                with self._lock:
                    readings = list(self.readings.values())
                return [
                    Observation(value, {**labels, **attributes})
                    for reading, attributes in readings
                    for labels, value in reading.samples(name)
                ]

            if kind == "counter":
                instrument: Any = meter.create_observable_counter(
                    name.removesuffix("_total"), [observe], unit=_unit(name), description=help
                )
            else:
                instrument = meter.create_observable_gauge(
                    name, [observe], unit=_unit(name), description=help
                )
            self.instruments.append(instrument)

    def add(self, reading: _Reading, attributes: Labels) -> None:
        """Report ``reading`` with ``attributes``, in place of any loader registered with them."""
        with self._lock:
            self.readings[tuple(sorted(attributes.items()))] = (reading, attributes)


_registered: weakref.WeakKeyDictionary[Any, _Registered] = weakref.WeakKeyDictionary()
_registering = threading.Lock()


def register_metrics(
    source: Any, meter_provider: MeterProvider, *, attributes: Mapping[str, str] | None = None
) -> list[Instrument]:
    """Declare ``source``'s metrics (a ``Loader``, the torch dataset of
    ``zephon.integrations.torch`` or a DataLoader around it) on ``meter_provider`` as
    observable instruments, under the meter ``"zephon"``; returns the instruments. Each
    collection reads ``stats()`` once for all of them.

    ``attributes`` are added to every observation: loaders registered on one provider with the
    same attributes replace each other (the next run of a loop takes the place of the last),
    with different ones (``{"loader": "eval"}``) they are reported side by side."""
    reading = _Reading(source)  # a TypeError for what is not a loader, before anything
    extra = extra_labels(attributes, "register_metrics", "attributes")
    with _registering:
        registered = _registered.get(meter_provider)
        if registered is None:
            registered = _registered[meter_provider] = _Registered(meter_provider)
    registered.add(reading, extra)
    return list(registered.instruments)
