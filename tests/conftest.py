"""Test-suite settings: hypothesis runs derandomized so every run checks the same examples
(``ZEPHON_HYPOTHESIS=random`` draws new ones each run instead); a private metadata cache per
test; a real S3-compatible server (moto's server mode) on loopback, with a proxy in front of it
that can fail requests or stall them; a real GCS JSON-API server (gcp-storage-emulator) on
loopback."""

from __future__ import annotations

import http.client
import http.server
import logging
import math
import os
import re
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from net_kit import free_port
from worker_kit import allow_ray_daemons, allow_server, assert_no_leftover_workers

_PROFILE: dict[str, Any] = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow],
    "print_blob": True,
}
settings.register_profile("derandomized", derandomize=True, **_PROFILE)
# New examples every run, to look for cases the fixed ones miss; a failure prints the blob that
# replays it (``@reproduce_failure``).
settings.register_profile("random", derandomize=False, **_PROFILE)
settings.load_profile(os.environ.get("ZEPHON_HYPOTHESIS", "derandomized"))  # unknown names raise

# Google's client libraries look for credentials on the cloud's metadata server when nothing else
# gives them: no test, nor any worker process it starts, ever asks one beyond loopback.
os.environ["GCE_METADATA_ROOT"] = "127.0.0.1:9"
os.environ.pop("GOOGLE_APPLICATION_CREDENTIALS", None)


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch) -> Path:
    """Each test's metadata cache (``$ZEPHON_CACHE_DIR``) is its own, never ``~/.cache``."""
    where = tmp_path_factory.mktemp("zephon-cache")
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(where))
    return where


@pytest.fixture
def no_leftover_workers() -> Iterator[None]:
    """The test leaves no lane thread and no worker process behind (modules that start workers
    use it for every test: ``pytestmark = pytest.mark.usefixtures("no_leftover_workers")``)."""
    yield from assert_no_leftover_workers()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """The address of a local Ray cluster of 2 CPUs started once for the module that uses it (a
    start takes tens of seconds), shut down at the module's end: a process still connected to
    Ray cannot fork safely (the child's exit hangs in Ray's own shutdown), and later tests fork
    the test process. Its workers import the code under test."""
    import psutil
    import ray

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # The repository and the test directories pytest put on sys.path: operators defined in a
    # test module travel by reference, and the actors import them from there.
    ours = [root, *(p for p in sys.path if p.startswith(root + os.sep))]
    before = {p.pid for p in psutil.Process().children()}
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([*dict.fromkeys(ours), *([path] if path else [])])
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    finally:
        if path is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = path
    allow_ray_daemons({p.pid for p in psutil.Process().children()} - before)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        allow_ray_daemons(set())


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a moto S3 server started once for the whole test run."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


#: Longest a stalled request is held if nothing releases it (``FailingProxy.stop`` does).
STALL_LIMIT = 120.0


class FailingProxy:
    """A loopback HTTP proxy in front of the S3 server: it answers the next ``fail`` requests,
    every ranged GET starting at one of the byte offsets in ``fail_ranges``, and the next
    ``fail_paths[end]`` requests of a path ending with ``end``, with 503 SlowDown (or the
    ``fail_status`` set), and forwards every other one; it counts what it saw.

    ``stall()`` makes it a server that accepts connections and reads requests but never answers
    them (``stalled`` counts those held; ``stall(n, method)``: the next ``n`` only, of that
    method only) until ``release()``, which closes the held connections unanswered and forwards
    again; ``stop()`` releases them too, so no handler thread is left.
    """

    def __init__(self, upstream: str):
        self.upstream = upstream.removeprefix("http://")
        self.fail = 0
        self.fail_status = (503, "SlowDown")  # what a failed request is answered
        self.fail_ranges: set[int] = set()
        self.fail_paths: dict[str, int] = {}
        self.requests: list[str] = []
        self.failed = 0
        self.stalled = 0
        self._stall_next: float = 0
        self._stall_method: str | None = None
        self._released = threading.Event()
        self._held: list[threading.Thread] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                # One request per connection: once stopped, nothing is served on a kept one.
                self.close_connection = True
                proxy.requests.append(f"{self.command} {self.path}")
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if proxy._hold(self.command):
                    proxy._released.wait(STALL_LIMIT)
                    return  # the connection closes without an answer
                ranged = re.match(r"bytes=(\d+)-", self.headers.get("Range") or "")
                if (
                    proxy.fail > 0
                    or (ranged and int(ranged.group(1)) in proxy.fail_ranges)
                    or (proxy._fails_path(self.path))
                ):
                    proxy.fail = max(0, proxy.fail - 1)
                    proxy.failed += 1
                    status, code = proxy.fail_status
                    reply = (
                        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                        "<Message>Please reduce your request rate.</Message></Error>"
                    ).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(reply)))
                    self.send_header("Connection", "close")
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(reply)
                    return
                conn = http.client.HTTPConnection(proxy.upstream, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                    headers["Host"] = proxy.upstream
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status)
                keep_length = self.command == "HEAD"  # a HEAD reply says the object's length
                for k, v in resp.getheaders():
                    if k.lower() in ("transfer-encoding", "connection"):
                        continue
                    if k.lower() == "content-length" and not keep_length:
                        continue
                    self.send_header(k, v)
                if not keep_length:
                    self.send_header("Content-Length", str(len(data)))
                self.send_header("Connection", "close")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        self.port = free_port()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="test-s3-proxy")
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stall(self, n: float = math.inf, method: str | None = None) -> None:
        """Hold the next ``n`` requests (of ``method`` only, when given) unanswered, every one
        by default, until ``release``."""
        self._released.clear()
        self._stall_next = n
        self._stall_method = method

    def _hold(self, method: str) -> bool:
        # Whether the calling handler's request is to be held (counted once, whatever races).
        with self._lock:
            if self._stall_next <= 0 or self._stall_method not in (None, method):
                return False
            self._stall_next -= 1
            self.stalled += 1
            self._held.append(threading.current_thread())
            return True

    def _fails_path(self, path: str) -> bool:
        # Whether a request of ``path`` is one of the failures ``fail_paths`` asks for.
        with self._lock:
            for end, left in self.fail_paths.items():
                if left > 0 and path.endswith(end):
                    self.fail_paths[end] = left - 1
                    return True
        return False

    def release(self) -> None:
        """Close the held requests unanswered, wait for their handlers, and forward again."""
        with self._lock:
            self._stall_next = 0
            held, self._held = self._held, []
        self._released.set()
        for handler in held:
            handler.join(10)

    def stop(self) -> None:
        self.release()
        if self.thread.is_alive():
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(10)


class Bucket:
    """A fresh bucket on the S3 server and the environment pointing pyarrow at it."""

    scheme = "s3"

    def __init__(self, endpoint: str, monkeypatch: pytest.MonkeyPatch):
        import pyarrow.fs as pafs

        self.name = f"b-{uuid.uuid4().hex[:12]}"
        self.monkeypatch = monkeypatch
        self.point_at(endpoint)
        self.fs = pafs.S3FileSystem(endpoint_override=endpoint, allow_bucket_creation=True)
        self.fs.create_dir(self.name)

    def point_at(self, endpoint: str) -> None:
        """Sources built from now on reach the server through ``endpoint``."""
        for key, value in (
            ("AWS_ACCESS_KEY_ID", "testing"),
            ("AWS_SECRET_ACCESS_KEY", "testing"),
            ("AWS_REGION", "us-east-1"),
            ("AWS_EC2_METADATA_DISABLED", "true"),
            ("AWS_ENDPOINT_URL", endpoint),
        ):
            self.monkeypatch.setenv(key, value)
        self.monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)

    def upload(self, local: Path, prefix: str) -> str:
        """Copy every file below ``local`` to ``s3://bucket/prefix/...``; that URI."""
        for path in sorted(local.rglob("*")):
            if path.is_file() and not path.name.endswith((".zsum", ".zidx")):
                key = f"{self.name}/{prefix}/{path.relative_to(local).as_posix()}"
                with self.fs.open_output_stream(key) as out:
                    out.write(path.read_bytes())
        return f"s3://{self.name}/{prefix}"

    def overwrite(self, key: str, data: bytes) -> None:
        """Write ``data`` over the object ``key`` (a path inside the bucket)."""
        with self.fs.open_output_stream(f"{self.name}/{key}") as out:
            out.write(data)

    def etag(self, key: str) -> str:
        """The ETag of the object ``key`` now."""
        f = self.fs.open_input_file(f"{self.name}/{key}")
        try:
            return f.metadata()["ETag"].decode()
        finally:
            f.close()


@pytest.fixture
def bucket(moto_endpoint, monkeypatch) -> Bucket:
    return Bucket(moto_endpoint, monkeypatch)


@pytest.fixture
def failing_proxy(moto_endpoint) -> Iterator[FailingProxy]:
    proxy = FailingProxy(moto_endpoint)
    try:
        yield proxy
    finally:
        proxy.stop()


# The GCS server runs in a process of its own: pyarrow's GCS client keeps the GIL while it waits
# for an answer, so a server thread in the test process would never give one. It stops when its
# standard input closes, so it cannot outlive the test run.
_GCS_SERVER = """
import sys
from gcp_storage_emulator.server import create_server

server = create_server("127.0.0.1", int(sys.argv[1]), in_memory=True)
server.start()
print("ready", flush=True)
sys.stdin.read()
server.stop()
"""


@pytest.fixture(scope="session")
def gcs_endpoint() -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a GCS JSON-API server (gcp-storage-emulator) started once for
    the whole test run."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", _GCS_SERVER, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None and server.stdin is not None
    allow_server(server.pid)
    try:
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the GCS emulator did not start (exit status {server.wait(60)})")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stdin.close()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        server.stdout.close()


class GcsBucket:
    """A fresh bucket on the GCS server and the environment pointing the storage layer at it
    (``STORAGE_EMULATOR_HOST``); objects are written through the server's JSON API."""

    scheme = "gs"

    def __init__(self, endpoint: str, monkeypatch: pytest.MonkeyPatch):
        self.endpoint = endpoint
        self.name = f"b-{uuid.uuid4().hex[:12]}"
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
        monkeypatch.delenv("CLOUD_STORAGE_EMULATOR_ENDPOINT", raising=False)
        body = f'{{"name": "{self.name}"}}'.encode()
        self._send("/storage/v1/b?project=zephon-tests", body, "application/json")

    def _send(self, path: str, body: bytes, content_type: str) -> None:
        request = urllib.request.Request(
            self.endpoint + path, data=body, method="POST", headers={"Content-Type": content_type}
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            assert answer.status == 200, answer.read()

    def overwrite(self, key: str, data: bytes) -> None:
        """Write ``data`` over the object ``key`` (a path inside the bucket)."""
        name = urllib.parse.quote(key, safe="")
        path = f"/upload/storage/v1/b/{self.name}/o?uploadType=media&name={name}"
        self._send(path, data, "application/octet-stream")

    def upload(self, local: Path, prefix: str) -> str:
        """Copy every file below ``local`` to ``gs://bucket/prefix/...``; that URI."""
        for path in sorted(local.rglob("*")):
            if path.is_file() and not path.name.endswith((".zsum", ".zidx")):
                self.overwrite(f"{prefix}/{path.relative_to(local).as_posix()}", path.read_bytes())
        return f"gs://{self.name}/{prefix}"


@pytest.fixture
def gcs_bucket(gcs_endpoint, monkeypatch) -> GcsBucket:
    return GcsBucket(gcs_endpoint, monkeypatch)


@pytest.fixture(params=["s3", "gs"])
def store(request: pytest.FixtureRequest) -> Bucket | GcsBucket:
    """A fresh bucket on a real loopback server: S3 (moto) or GCS (gcp-storage-emulator)."""
    return request.getfixturevalue("bucket" if request.param == "s3" else "gcs_bucket")
