"""A JSON-lines log of a loader's counters, for runs without a monitoring stack (and for
``zephon report``): one line per write, ``{"time", "elapsed", "rank", "step", "stats"}``."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from zephon.errors import ZephonError
from zephon.observability.sources import stats_source
from zephon.sources.locations import local_path

log = logging.getLogger("zephon")


class MetricsLog:
    """Appends ``source``'s ``stats()`` to ``path`` as JSON lines: at every ``write()`` (with the
    training step, when you pass it), and every ``interval`` seconds from a daemon thread when
    ``interval`` is given. ``close()`` (or leaving the ``with`` block) writes a last line and
    stops the thread. Each line is written whole and flushed, so a reader never sees half of
    one, even while the run goes on."""

    def __init__(self, source: Any, path: str | os.PathLike[str], *, interval: float | None = None):
        if interval is not None and (isinstance(interval, bool) or not interval > 0):
            raise ValueError(
                f"MetricsLog: interval must be a positive number of seconds, got {interval!r}"
            )
        self.source = stats_source(source)
        self.path = Path(local_path(path, "MetricsLog", "the log, a file appended line by line,"))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if interval is not None:
            self._thread = threading.Thread(
                target=self._every, args=(interval,), name="zephon-metrics-log", daemon=True
            )
            self._thread.start()

    def write(self, step: int | None = None) -> None:
        """Append one line with the counters as they are now."""
        line = {
            "time": time.time(),
            "elapsed": time.monotonic() - self._start,
            "rank": self.source.rank,
            "step": step,
            "stats": self.source.read(),
        }
        text = json.dumps(line, default=str, allow_nan=False) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(text)
                self._file.flush()

    def _every(self, interval: float) -> None:
        while not self._closed.wait(interval):
            try:
                self.write()
            except Exception as exc:  # that line is lost, not the log
                log.warning(
                    "MetricsLog(%r): no line this time, stats() failed: %s: %s",
                    str(self.path),
                    type(exc).__name__,
                    exc,
                )

    def close(self) -> None:
        """Write a last line, stop the thread, close the file (also when that line fails)."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.write()
        finally:
            with self._lock:
                self._file.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The lines of a ``MetricsLog`` file, in order (a last line cut short by a crash is left
    out); ``ZephonError`` naming the file and the line when one is not a ``MetricsLog`` line."""
    out = []
    with open(path, "rb") as f:  # each line decoded on its own, so an error names its line
        for number, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                continue
            try:
                out.append(_metrics_line(json.loads(raw.decode("utf-8"))))
            except (UnicodeDecodeError, ValueError, RecursionError) as exc:
                raise ZephonError(
                    f"{path} line {number} is not a line of a zephon.observability.MetricsLog: "
                    f"{exc}"
                ) from None
    return out


def _metrics_line(line: Any) -> dict[str, Any]:
    """``line`` when it has the fields ``MetricsLog.write`` writes; ValueError otherwise."""
    if not isinstance(line, dict) or not set(line) >= _LINE_KEYS:
        raise ValueError(f"it is not an object with the fields {sorted(_LINE_KEYS)}")
    if not isinstance(line["stats"], dict):
        raise ValueError("its stats are not an object")
    return line


_LINE_KEYS = {"time", "elapsed", "rank", "step", "stats"}
