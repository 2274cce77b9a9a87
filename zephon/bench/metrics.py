"""What watching a run costs: the same pipeline drained with its metrics served and scraped every
50 ms, and without, in interleaved rounds.

The scraper is a process of its own, as Prometheus is: what it costs to send a request and parse
the reply is not the loader's, while everything the loader's process does to answer it is.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from typing import Any

SCRAPE_EVERY = 0.05  # seconds between two scrapes

# Reads a URL (start scraping it), "stop" (print the scrapes since the URL) or EOF from stdin.
_SCRAPER = f"""
import select, sys, urllib.request
url, count = None, 0
while True:
    ready, _, _ = select.select([sys.stdin], [], [], {SCRAPE_EVERY})
    if ready:
        line = sys.stdin.readline().strip()
        if not line:
            break
        if line == "stop":
            print(count, flush=True)
            url, count = None, 0
        else:
            url = line
    elif url is not None:
        with urllib.request.urlopen(url, timeout=30) as reply:
            reply.read()
        count += 1
"""


def _plus_one(payload: dict[str, Any]) -> dict[str, Any]:
    return {"x": payload["idx"] + 1}


def measure(n: int, rounds: int) -> dict[str, Any]:
    """``fetch -> map -> batch(32)`` over ``n`` records on 2 inline lanes, drained ``rounds``
    times without metrics and as often with them served and scraped, in turns: per round the
    wall and CPU seconds of this process (its metrics thread included) of each, and the scrapes
    answered in all."""
    import zephon
    from zephon.observability import serve_metrics
    from zephon.ops import batch, fetch, map_transform
    from zephon.sources import RangeSource

    pipeline = zephon.Pipeline(
        RangeSource(n, chunk_size=1024),
        [fetch(), map_transform(_plus_one), batch(32)],
        lanes=2,
    )

    def drain(loader: Any) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in loader:
            pass
        return time.perf_counter() - wall, time.process_time() - cpu

    scraper = subprocess.Popen(
        [sys.executable, "-c", _SCRAPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert scraper.stdin is not None and scraper.stdout is not None
    out: dict[str, Any] = {"off": [], "on": [], "scrapes": 0}
    try:
        for _ in range(rounds):
            with pipeline.iter() as loader:
                out["off"].append(drain(loader))
            # Only the stream is timed: starting and stopping the server is not per record.
            with pipeline.iter() as loader, serve_metrics(loader) as server:
                scraper.stdin.write(server.url + "\n")
                scraper.stdin.flush()
                out["on"].append(drain(loader))
                scraper.stdin.write("stop\n")
                scraper.stdin.flush()
                out["scrapes"] += int(scraper.stdout.readline())
    finally:
        scraper.stdin.close()
        scraper.wait(timeout=30)
    return out


def ratios(measured: dict[str, Any]) -> tuple[float, float]:
    """Throughput with metrics over throughput without, by the median wall time and by the
    median CPU time of the rounds."""
    off, on = measured["off"], measured["on"]
    wall = statistics.median(t for t, _ in off) / statistics.median(t for t, _ in on)
    cpu = statistics.median(c for _, c in off) / statistics.median(c for _, c in on)
    return wall, cpu
