"""Real object-store servers on 127.0.0.1 for the cloud tests, and a fault-injecting proxy.

* GCS: the ``gcp-storage-emulator`` package's server, started as a subprocess on a free port and
  reached by gcsfs through ``STORAGE_EMULATOR_HOST`` (or ``endpoint_url`` to go through a proxy).
  ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` is set here, before anything imports gcsfs:
  otherwise gcsfs makes a gRPC call per bucket that the emulator cannot answer (60 s stalls).
* S3: ``moto``'s ``ThreadedMotoServer`` in this process, bound to 127.0.0.1, reached by s3fs with
  ``endpoint_url`` and dummy keys.
* :class:`FaultProxy`: a small HTTP proxy on 127.0.0.1 between a client and one of the servers.
  It forwards requests, counts them, answers chosen ones with 429/500/503/403 (in the store's
  own error format) or resets their connection, and can hold requests until released.

Nothing here reaches beyond the loopback interface; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import logging
import os
import random
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # before gcsfs is imported anywhere
for _name in [n for n in os.environ if n.startswith("AWS_")]:
    del os.environ[_name]  # never use a developer's real AWS profile or keys
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"  # no instance-metadata lookups

CLOUD_MODULES = ("gcsfs", "s3fs", "moto", "flask", "flask_cors", "gcp_storage_emulator")
BUCKET = "ckpt-bucket"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
UPSTREAM_TIMEOUT_S = 60.0
HOLD_TIMEOUT_S = 120.0


def require_cloud_modules() -> None:
    """Skip the calling test module when the cloud packages are missing; fail instead under CI."""
    missing = [name for name in CLOUD_MODULES if importlib.util.find_spec(name) is None]
    if not missing:
        return
    reason = f"cloud test packages not installed: {', '.join(missing)} (pip install -e '.[dev]')"
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the cloud tests, but {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0):
            return True
    except urllib.error.HTTPError:
        return True  # any HTTP answer means the server is up
    except (OSError, http.client.HTTPException):
        return False


@dataclass
class Server:
    """One running object-store server."""

    kind: str
    """``"gcs"`` or ``"s3"``."""
    url: str
    """``http://127.0.0.1:<port>``."""
    bucket: str
    stop: Callable[[], None]
    scheme: str = field(init=False)

    def __post_init__(self) -> None:
        self.scheme = "gs" if self.kind == "gcs" else "s3"

    def root(self, name: str) -> str:
        """A checkpoint root URL in the test bucket."""
        return f"{self.scheme}://{self.bucket}/{name}"

    def storage_options(self, endpoint: str | None = None) -> dict[str, Any]:
        """fsspec options that reach this server, or ``endpoint`` (a proxy in front of it)."""
        if self.kind == "gcs":
            options: dict[str, Any] = {"token": "anon", "project": "ckptmgr-test"}
            if endpoint is not None:
                options["endpoint_url"] = endpoint
            return options
        return {"key": "testing", "secret": "testing", "endpoint_url": endpoint or self.url}


def start_gcs_emulator(bucket: str = BUCKET) -> Server:
    """Start gcp-storage-emulator (in memory) on a free port; sets ``STORAGE_EMULATOR_HOST``."""
    last_error = ""
    for _ in range(3):  # the free port may be taken between probing and binding
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "gcp_storage_emulator",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--in-memory",
            "-q",
            "--default-bucket",
            bucket,
        ]
        process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and process.poll() is None:
            if _answers(f"{url}/storage/v1/b/{bucket}"):
                break
            time.sleep(0.1)
        if process.poll() is None and _answers(f"{url}/storage/v1/b/{bucket}"):
            os.environ["STORAGE_EMULATOR_HOST"] = url

            def stop(process: subprocess.Popen[str] = process) -> None:
                process.terminate()
                try:
                    process.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(STOP_TIMEOUT_S)

            return Server("gcs", url, bucket, stop)
        process.kill()
        _, stderr = process.communicate(timeout=STOP_TIMEOUT_S)
        last_error = stderr[-2000:]
    raise RuntimeError(f"the GCS emulator did not start: {last_error}")


def start_moto(bucket: str = BUCKET) -> Server:
    """Start moto's S3 server in a thread on 127.0.0.1 and create ``bucket``."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one INFO line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _answers(f"{url}/moto-api/"):
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError("moto's server did not answer")
        time.sleep(0.1)
    # moto keeps its state per process, not per server: start from an empty store
    reset = urllib.request.Request(f"{url}/moto-api/reset", method="POST")
    with urllib.request.urlopen(reset, timeout=START_TIMEOUT_S):
        pass
    import s3fs

    s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=url).mkdir(bucket)
    return Server("s3", url, bucket, server.stop)


# -- the fault-injecting proxy ---------------------------------------------------------------------
FAULTS = ("429", "500", "503", "reset")
"""Transient faults the proxy can inject; ``"403"`` is also accepted (a permanent one)."""
_HOP_HEADERS = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "expect",
}
_S3_CODES = {
    403: "AccessDenied",
    429: "SlowDown",
    500: "InternalError",
    501: "NotImplemented",  # S3's answer to a header it does not implement
    503: "SlowDown",
}


@dataclass
class Seen:
    """One request the proxy received, and what it did with it."""

    method: str
    path: str
    """The request path; for a GCS upload followed by ``#name=<object name>``."""
    action: str
    """``"forwarded"``, a status such as ``"503"``, or ``"reset"``."""
    status: int | None = None
    """The status returned to the client (None for a reset)."""
    expect_continue: bool = False
    """The request asked for ``100 Continue`` before sending its body."""


Matcher = Callable[[str, str], bool]
_GCS_UPLOAD_NAME = re.compile(rb'"name"\s*:\s*"([^"]+)"')


def _upload_name(body: bytes) -> str:
    """``#name=<object>`` for a GCS upload, whose object name is in the body, not the path."""
    match = _GCS_UPLOAD_NAME.search(body[:4096])
    return f"#name={match.group(1).decode(errors='replace')}" if match else ""


def matches_anything(method: str, path: str) -> bool:
    """The default matcher: every request."""
    return True


def is_data_upload(method: str, path: str) -> bool:
    """A request that uploads a DCP data file (GCS media upload or S3 PUT of ``*.distcp``)."""
    return method in ("POST", "PUT") and ".distcp" in path


def is_listing(method: str, path: str) -> bool:
    """A list-objects request (GCS ``GET .../o?...``, S3 ``GET /bucket?list-type=2``)."""
    if method != "GET":
        return False
    return bool(re.search(r"/o(\?|$)", path)) or "list-type=" in path


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 that forwards to ``upstream`` and injects faults.

    Faults are chosen per request, for requests that ``match``: first from ``sequence`` (one
    entry per matching request: a fault name, or None to forward), then with probability
    ``rate`` a fault drawn from ``kinds`` (seeded), and always ``permanent`` if it is set.
    """

    def __init__(self, upstream: str, flavor: str) -> None:
        if flavor not in ("gcs", "s3"):
            raise ValueError(f"flavor must be gcs or s3, got {flavor!r}")
        host, _, port = upstream.removeprefix("http://").partition(":")
        self.upstream = (host, int(port))
        self.flavor = flavor
        self.seen: list[Seen] = []
        self._lock = threading.Condition()
        self._rng = random.Random(0)
        self._rate = 0.0
        self._kinds: tuple[str, ...] = ("503",)
        self._sequence: list[str | None] = []
        self._permanent: str | None = None
        self._match: Matcher = matches_anything
        self._hold: Matcher | None = None
        self._released = threading.Event()
        self._drop_held = False
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    # -- configuration -------------------------------------------------------------------------
    def set_faults(
        self,
        *,
        rate: float = 0.0,
        kinds: tuple[str, ...] = ("503",),
        sequence: tuple[str | None, ...] = (),
        permanent: str | None = None,
        match: Matcher = matches_anything,
        seed: int = 0,
    ) -> None:
        """Replace the fault plan (see the class docstring); ``set_faults()`` forwards all."""
        with self._lock:
            self._rate = rate
            self._kinds = kinds
            self._sequence = list(sequence)
            self._permanent = permanent
            self._match = match
            self._rng = random.Random(seed)

    def hold(self, match: Matcher) -> None:
        """Keep requests that ``match`` waiting (unanswered) until :meth:`release`."""
        with self._lock:
            self._released.clear()
            self._drop_held = False
            self._hold = match

    def release(self, *, drop: bool = False) -> None:
        """Let held requests (and later ones) through; with ``drop``, reset the held ones."""
        with self._lock:
            self._hold = None
            self._drop_held = drop
            self._released.set()

    def clear(self) -> None:
        """Forget the requests seen so far."""
        with self._lock:
            self.seen.clear()

    def count(self, match: Matcher = matches_anything, action: str | None = None) -> int:
        """How many requests seen so far match (and had ``action``, if given)."""
        with self._lock:
            return sum(
                1
                for s in self.seen
                if match(s.method, s.path) and (action is None or s.action == action)
            )

    def wait_for(self, match: Matcher, count: int, timeout: float) -> bool:
        """Wait until ``count`` requests that ``match`` have arrived; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while sum(1 for s in self.seen if match(s.method, s.path)) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(remaining)
            return True

    def close(self) -> None:
        """Stop the proxy (held requests are released first)."""
        self.release()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(STOP_TIMEOUT_S)

    # -- request handling ----------------------------------------------------------------------
    def _decide(self, method: str, path: str) -> tuple[Seen, bool]:
        """(what is done, held) for one request, recorded in :attr:`seen`."""
        with self._lock:
            action = "forwarded"
            if self._match(method, path):
                if self._sequence:
                    action = self._sequence.pop(0) or "forwarded"
                elif self._permanent is not None:
                    action = self._permanent
                elif self._rate > 0 and self._rng.random() < self._rate:
                    action = self._rng.choice(self._kinds)
            held = self._hold is not None and self._hold(method, path)
            seen = Seen(method, path, action)
            self.seen.append(seen)
            self._lock.notify_all()
            return seen, held

    def _error_body(self, status: int) -> tuple[bytes, str]:
        if self.flavor == "gcs":
            body = {"error": {"code": status, "message": f"injected {status}", "errors": []}}
            return json.dumps(body).encode(), "application/json"
        code = _S3_CODES.get(status, "InternalError")
        xml = (
            '<?xml version="1.0" encoding="UTF-8"?>'
            f"<Error><Code>{code}</Code><Message>injected {status}</Message>"
            "<RequestId>ckptmgr-test</RequestId></Error>"
        )
        return xml.encode(), "application/xml"

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                return

            def _read_body(self) -> bytes:
                if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _reset(self) -> None:
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.close()

            def _answer(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                self.end_headers()
                if self.command != "HEAD" and body:
                    self.wfile.write(body)

            def _proxy(self) -> None:
                body = self._read_body()
                seen, held = proxy._decide(self.command, self.path + _upload_name(body))
                seen.expect_continue = self.headers.get("Expect", "").lower() == "100-continue"
                action = seen.action
                if held and (not proxy._released.wait(HOLD_TIMEOUT_S) or proxy._drop_held):
                    self._reset()
                    return
                if action == "reset":
                    self._reset()
                    return
                if action != "forwarded":
                    status = int(action)
                    error, content_type = proxy._error_body(status)
                    headers = [("Content-Type", content_type), ("Content-Length", str(len(error)))]
                    self._answer(status, headers, error)
                    seen.status = status
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
                connection = http.client.HTTPConnection(*proxy.upstream, timeout=UPSTREAM_TIMEOUT_S)
                try:
                    connection.request(self.command, self.path, body=body, headers=headers)
                    response = connection.getresponse()
                    data = response.read()
                    out = [
                        (k, v)
                        for k, v in response.getheaders()
                        if k.lower() not in _HOP_HEADERS and k.lower() != "content-length"
                    ]
                    length = str(len(data))
                    if self.command == "HEAD":  # no body: keep the object's size
                        length = response.getheader("Content-Length") or length
                    out.append(("Content-Length", length))
                    self._answer(response.status, out, data)
                    seen.status = response.status
                finally:
                    connection.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _proxy

        return Handler


@contextlib.contextmanager
def fault_proxy(server: Server) -> Iterator[FaultProxy]:
    """A :class:`FaultProxy` in front of ``server``, closed afterwards."""
    proxy = FaultProxy(server.url, server.kind)
    try:
        yield proxy
    finally:
        proxy.close()


# -- fixtures: import the *_fixture functions into a test module ---------------------------------
@pytest.fixture(name="server", scope="module", params=["gcs", "s3"])
def server_fixture(request: pytest.FixtureRequest) -> Iterator[Server]:
    """The GCS emulator, then moto's S3 server: each test that uses it runs once per store."""
    running = start_gcs_emulator() if request.param == "gcs" else start_moto()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(name="root")
def root_fixture(server: Server) -> str:
    """A fresh checkpoint root URL in the test bucket."""
    return server.root(f"run-{uuid.uuid4().hex[:12]}")


@pytest.fixture(name="proxy")
def proxy_fixture(server: Server) -> Iterator[FaultProxy]:
    """A fault proxy in front of ``server`` (forwarding everything until told otherwise)."""
    with fault_proxy(server) as running:
        yield running
