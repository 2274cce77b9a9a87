"""A loader's metrics in the Prometheus text format, served on a port of its own.

The server shares the interpreter with the training loop, so what it costs is the time it holds
the GIL, and every time it takes the GIL back from the training loop's thread (each system call
gives it up, and getting it back from a busy thread takes a forced switch). It is built to do both
as rarely as possible: its thread sleeps in ``accept`` until a scrape (or ``close()``) arrives,
and a scrape is one read of the request, one ``stats()``, one write of the whole reply, rendered
straight from ``metric_families`` without the per-sample objects of a client library, and the
close. A client's deadline is the kernel's (``SO_RCVTIMEO``, ``SO_SNDTIMEO``), not Python's,
which would wait in ``poll`` before every read and write: one more switch each.
"""

from __future__ import annotations

import contextlib
import functools
import math
import socket
import struct
import sys
import threading
from collections.abc import Iterable
from typing import Any

from zephon.observability.families import Family, metric_families
from zephon.observability.sources import stats_source

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_MAX_REQUEST = 64 * 1024  # a scrape's request is a few hundred bytes
_CLIENT_DEADLINE = 10.0  # seconds a client has to send its request and read the reply


def render(families: Iterable[Family]) -> bytes:
    """``families`` in the Prometheus text exposition format (version 0.0.4)."""
    out: list[str] = []
    for family in families:
        out.append(_head(family.name, family.kind, family.help))
        for labels, value in family.samples:
            inner = ",".join([f'{k}="{_escape(v)}"' for k, v in labels.items()])
            out.append(f"{family.name}{{{inner}}} {_number(value)}\n")
    return "".join(out).encode("utf-8")


@functools.cache  # a loader's families are always the same few dozen
def _head(name: str, kind: str, help: str) -> str:
    help_text = help.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n"


def _escape(value: str) -> str:
    if "\\" not in value and "\n" not in value and '"' not in value:
        return value  # ranks, lanes and most names
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _set_deadline(conn: socket.socket, seconds: float) -> None:
    """Make every read and write on ``conn`` fail after ``seconds``: the kernel's deadline, a
    ``struct timeval`` in ``SO_RCVTIMEO`` and ``SO_SNDTIMEO`` (Windows takes milliseconds there:
    Python's own timeout instead)."""
    if sys.platform == "win32":
        conn.settimeout(seconds)
        return
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def _number(value: float) -> str:
    if value in (math.inf, -math.inf):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


class MetricsServer:
    """Serves one loader's metrics at ``url`` (``GET /metrics``) from a daemon thread until
    ``close()``; every scrape reads ``stats()`` afresh."""

    def __init__(self, source: Any, *, port: int = 0, addr: str = "127.0.0.1"):
        self.source = stats_source(source)
        ipv6 = ":" in addr  # an IPv6 address; "::" is every address, IPv4 ones too
        self._listener = socket.create_server(
            (addr, port),
            family=socket.AF_INET6 if ipv6 else socket.AF_INET,
            dualstack_ipv6=addr == "::" and socket.has_dualstack_ipv6(),
        )
        self.addr = addr
        self.port = int(self._listener.getsockname()[1])
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="zephon-metrics", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """Where the metrics are: ``http://addr:port/metrics`` (``http://[addr]:port/metrics``
        for an IPv6 address)."""
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (InterruptedError, ConnectionAbortedError):  # a client gave up meanwhile
                continue
            except OSError:
                if self._closed:
                    return
                raise
            if self._closed:  # close() connected to wake us
                conn.close()
                return
            # OSError: the client went away or missed its deadline; its scrape is lost, not
            # the server
            with conn, contextlib.suppress(OSError):
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        _set_deadline(conn, _CLIENT_DEADLINE)
        request = b""
        while b"\r\n\r\n" not in request and len(request) < _MAX_REQUEST:
            part = conn.recv(4096)
            if not part:
                return
            request += part
        method, _, rest = request.partition(b" ")
        path = rest.split(b" ", 1)[0].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            status, body, kind = "405 Method Not Allowed", b"GET /metrics only\n", "text/plain"
        elif path.rstrip(b"/") not in (b"", b"/metrics"):
            status, body, kind = "404 Not Found", b"the metrics are at /metrics\n", "text/plain"
        else:
            source = self.source
            try:
                status, kind = "200 OK", CONTENT_TYPE
                body = render(metric_families(source.read(), rank=source.rank))
            except Exception as exc:  # this scrape fails, not the endpoint
                status, kind = "500 Internal Server Error", "text/plain"
                body = f"stats() failed: {type(exc).__name__}: {exc}\n".encode()
        head = (
            f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode("ascii")
        conn.sendall(head if method == b"HEAD" else head + body)

    def close(self) -> None:
        """Stop serving and join the thread."""
        if self._closed:
            return
        self._closed = True
        # The thread waits in accept(): a connection of our own wakes it (failing that, on
        # Linux, shutting the listener down does).
        try:
            socket.create_connection((self.addr, self.port), timeout=_CLIENT_DEADLINE).close()
        except OSError:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
        self._thread.join()
        self._listener.close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
