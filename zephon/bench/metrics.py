"""What watching a run costs: the same pipeline drained with its metrics served and scraped every
50 ms, and without, in interleaved rounds.

The scraper is a process of its own, as Prometheus is: what it costs to send a request and parse
the reply is not the loader's, while everything the loader's process does to answer it is.
"""

from __future__ import annotations

import math
import select
import statistics
import subprocess
import sys
import time
from typing import Any

from zephon.bench.clock import start_clock
from zephon.errors import ZephonError

SCRAPE_EVERY = 0.05  # seconds between two scrapes

# Reads lines from stdin: a URL (start scraping it every SCRAPE_EVERY seconds), "stop" (print
# the scrapes since the URL) or nothing (stdin closed: exit). Lines are read from the pipe's file
# descriptor, as a URL and its "stop" may come in one read.
_SCRAPER = f"""
import os, select, sys, urllib.request
url, count, pending = None, 0, b""
while True:
    ready, _, _ = select.select([0], [], [], {SCRAPE_EVERY})
    if not ready:
        if url is not None:
            with urllib.request.urlopen(url, timeout=30) as reply:
                reply.read()
            count += 1
        continue
    got = os.read(0, 4096)
    if not got:
        break
    *lines, pending = (pending + got).split(b"\\n")
    for line in lines:
        if line == b"stop":
            print(count, flush=True)
            url, count = None, 0
        else:
            url = line.decode()
"""
#: Seconds the scraper has to answer "stop" (a scrape under way finishes first).
ANSWER_DEADLINE = 60.0


def _plus_one(payload: dict[str, Any]) -> dict[str, Any]:
    return {"x": payload["idx"] + 1}


def measure(n: int, rounds: int) -> dict[str, Any]:
    """``fetch -> map -> batch(32)`` over ``n`` records on 2 inline lanes, drained ``rounds``
    times without metrics and as often with them served and scraped, in pairs (which of the two
    goes first alternates): per round the wall and CPU seconds of this process (its metrics
    thread included) of each, and the scrapes answered in all."""
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
        wall, cpu = start_clock(), time.process_time()
        for _ in loader:
            pass
        return time.perf_counter() - wall, time.process_time() - cpu

    def plain() -> None:
        with pipeline.iter() as loader:
            out["off"].append(drain(loader))

    def watched() -> None:
        # Only the stream is timed: starting and stopping the server is not per record.
        with pipeline.iter() as loader, serve_metrics(loader) as server:
            _say(scraper, server.url)
            out["on"].append(drain(loader))
            _say(scraper, "stop")
            out["scrapes"] += _answer(scraper)

    scraper = subprocess.Popen(
        [sys.executable, "-c", _SCRAPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert scraper.stdin is not None and scraper.stdout is not None
    out: dict[str, Any] = {"off": [], "on": [], "scrapes": 0}
    try:
        for i in range(rounds):
            for run in (plain, watched) if i % 2 == 0 else (watched, plain):
                run()
    finally:
        scraper.stdin.close()
        scraper.wait(timeout=30)
    return out


def _say(scraper: subprocess.Popen, line: str) -> None:
    assert scraper.stdin is not None
    scraper.stdin.write(line + "\n")
    scraper.stdin.flush()


def _answer(scraper: subprocess.Popen) -> int:
    """The scrapes the scraper counted, once it answers "stop"; a ``ZephonError`` if it does not
    within ``ANSWER_DEADLINE``."""
    assert scraper.stdout is not None
    ready, _, _ = select.select([scraper.stdout], [], [], ANSWER_DEADLINE)
    if not ready:
        raise ZephonError(
            f"zephon bench (metrics): the scraper process did not answer within "
            f"{ANSWER_DEADLINE:.0f} s; is the loopback interface up?"
        )
    return int(scraper.stdout.readline())


def ratios(measured: dict[str, Any]) -> tuple[float, float]:
    """Throughput with metrics over throughput without, by wall time and by CPU time, from the
    pairs of rounds (run back to back, so both saw the same load on the machine): the median
    ratio of the pairs that ran without metrics first, and of those that ran them second, and
    the geometric mean of the two, so that whichever runs first in a pair gains or loses nothing
    by it."""
    pairs = list(zip(measured["off"], measured["on"], strict=True))
    out = []
    for i in (0, 1):  # wall, CPU
        by_order = [
            statistics.median(off[i] / on[i] for off, on in pairs[first::2]) for first in (0, 1)
        ]
        out.append(math.sqrt(by_order[0] * by_order[1]))
    return out[0], out[1]
