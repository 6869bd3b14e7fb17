"""A fake cloud metadata server on 127.0.0.1 for the preemption tests (real HTTP, in a thread).

It speaks the parts of three protocols that ckptmgr uses, with their access rules:

- GCE: ``GET /computeMetadata/v1/instance/<key>`` needs ``Metadata-Flavor: Google`` (403
  without it, or with ``X-Forwarded-For``); answers carry an ``ETag``; ``wait_for_change=true``
  with ``last_etag`` equal to the current ETag blocks until the value changes or
  ``timeout_sec`` passes (a different ``last_etag`` answers at once).
- AWS IMDSv2: ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds`` gives a
  token; ``GET /latest/meta-data/spot/instance-action`` needs ``X-aws-ec2-metadata-token``
  (401 without a valid one), then 404 until an action is set, then JSON.
- Azure: ``GET /metadata/scheduledevents?api-version=...`` and
  ``GET /metadata/instance/compute/name?...`` need ``Metadata: true`` (400 without it).

``fail_next(n, code, prefix)`` injects failures; ``count(...)`` and ``wait_for_requests(...)``
let tests synchronise on what the watcher did instead of sleeping.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

GCE_PREFIX = "/computeMetadata/v1/instance/"
MAX_WAIT_S = 30.0  # a hanging GET without timeout_sec is capped here


@dataclass
class Seen:
    """One request as the server saw it."""

    method: str
    path: str
    query: dict[str, str]
    status: int
    at: float = field(default_factory=time.monotonic)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Clients that abort a hanging GET (a watcher being closed) are expected here."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FakeMetadataServer:
    """GCE, AWS and Azure metadata endpoints on one ``ThreadingHTTPServer``."""

    def __init__(self, vm_name: str = "vm0") -> None:
        self.vm_name = vm_name
        self._cond = threading.Condition()
        self._gce: dict[str, tuple[str, int]] = {
            "preempted": ("FALSE", 0),
            "maintenance-event": ("NONE", 0),
        }
        self._aws_action: dict[str, str] | None = None
        self._aws_tokens: set[str] = set()
        self._azure_events: list[dict[str, Any]] = []
        self._azure_incarnation = 1
        # (path prefix, status, body), consumed in order
        self._failures: list[tuple[str, int, bytes]] = []
        #: GCE answers at once, each time with a new ETag (a server ignoring wait_for_change)
        self.gce_ignores_wait_for_change = False
        self._seen: list[Seen] = []
        self._stopping = False
        self._hanging = 0  # GCE requests blocked in wait_for_change right now
        self._server = _QuietServer(("127.0.0.1", 0), self._handler_class())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """``127.0.0.1:<port>``, the form GCE_METADATA_HOST takes."""
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://{self.address}"

    def __enter__(self) -> FakeMetadataServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()  # release hanging GETs
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    # -- control ---------------------------------------------------------------------------------
    def set_gce(self, key: str, value: str) -> None:
        """Change a GCE key; a new ETag wakes the hanging GETs."""
        with self._cond:
            _, version = self._gce[key]
            self._gce[key] = (value, version + 1)
            self._cond.notify_all()

    def set_aws_action(self, action: str | None, when: str = "2026-11-22T12:49:33Z") -> None:
        """Schedule a spot interruption (``"terminate"``, ``"stop"``...) or cancel it (None)."""
        with self._cond:
            self._aws_action = None if action is None else {"action": action, "time": when}

    def revoke_aws_tokens(self) -> None:
        """Make every issued IMDSv2 token invalid (as if it expired)."""
        with self._cond:
            self._aws_tokens.clear()

    def add_azure_event(self, event_type: str, resources: list[str] | str | None = None) -> str:
        """Schedule an Azure event for ``resources`` (default: this VM); returns its EventId."""
        event_id = secrets.token_hex(8).upper()
        with self._cond:
            self._azure_events.append(
                {
                    "EventId": event_id,
                    "EventType": event_type,
                    "ResourceType": "VirtualMachine",
                    "Resources": [self.vm_name] if resources is None else resources,
                    "EventStatus": "Scheduled",
                    "NotBefore": "Sun, 22 Nov 2026 12:48:03 GMT",
                    "Description": "",
                    "EventSource": "Platform",
                    "DurationInSeconds": -1,
                }
            )
            self._azure_incarnation += 1
        return event_id

    def fail_next(
        self, count: int, status: int = 503, prefix: str = "/", body: bytes = b"injected failure"
    ) -> None:
        """Answer the next ``count`` requests whose path starts with ``prefix`` with ``status``
        (and ``body``: a garbled answer with status 200)."""
        with self._cond:
            self._failures.extend([(prefix, status, body)] * count)

    # -- observation -----------------------------------------------------------------------------
    def requests(self, prefix: str = "/", status: int | None = None) -> list[Seen]:
        """The requests answered so far whose path starts with ``prefix`` (and had ``status``)."""
        with self._cond:
            return [
                seen
                for seen in self._seen
                if seen.path.startswith(prefix) and (status is None or seen.status == status)
            ]

    def count(self, prefix: str = "/", status: int | None = None) -> int:
        """How many requests :meth:`requests` would return."""
        return len(self.requests(prefix, status))

    def wait_for_requests(
        self, prefix: str, at_least: int, timeout: float, status: int | None = None
    ) -> bool:
        """Wait until :meth:`count` reaches ``at_least``; True if it did within ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.count_locked(prefix, status) < at_least:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def wait_for_hanging(self, at_least: int, timeout: float) -> bool:
        """Wait until ``at_least`` GCE requests are blocked in ``wait_for_change``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._hanging < at_least:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def count_locked(self, prefix: str, status: int | None) -> int:
        """:meth:`count` for callers that hold the lock."""
        return sum(
            1
            for seen in self._seen
            if seen.path.startswith(prefix) and (status is None or seen.status == status)
        )

    # -- serving ---------------------------------------------------------------------------------
    def _gce_etag(self, key: str) -> str:
        value, version = self._gce[key]
        return hashlib.sha1(f"{key}:{version}:{value}".encode()).hexdigest()[:16]

    def _take_failure(self, path: str) -> tuple[int, bytes] | None:
        for index, (prefix, status, body) in enumerate(self._failures):
            if path.startswith(prefix):
                del self._failures[index]
                return status, body
        return None

    def _record(self, method: str, path: str, query: dict[str, str], status: int) -> None:
        with self._cond:
            self._seen.append(Seen(method, path, query, status))
            self._cond.notify_all()

    def _handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        parts = urllib.parse.urlsplit(request.path)
        path = parts.path
        query = dict(urllib.parse.parse_qsl(parts.query))
        with self._cond:
            injected = self._take_failure(path)
        headers: dict[str, str] = {}
        if injected is not None:
            status, body = injected
            if path.startswith(GCE_PREFIX):
                headers["Metadata-Flavor"] = "Google"
        elif path.startswith(GCE_PREFIX) or path == "/":
            status, body, headers = self._gce_answer(request, method, path, query)
        elif path.startswith("/latest/"):
            status, body = self._aws_answer(request, method, path)
        elif path.startswith("/metadata/"):
            status, body = self._azure_answer(request, method, path, query)
        else:
            status, body = 404, b"not found"
        self._record(method, path, query, status)
        request.send_response(status)
        for name, value in headers.items():
            request.send_header(name, value)
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)

    def _gce_answer(
        self, request: BaseHTTPRequestHandler, method: str, path: str, query: dict[str, str]
    ) -> tuple[int, bytes, dict[str, str]]:
        flavor = {"Metadata-Flavor": "Google"}
        if (
            request.headers.get("Metadata-Flavor") != "Google"
            or request.headers.get("X-Forwarded-For") is not None
        ):
            return 403, b"Missing Metadata-Flavor:Google header.", flavor
        if method != "GET":
            return 405, b"method not allowed", flavor
        if path == "/":
            return 200, b"computeMetadata/\n", flavor
        key = path[len(GCE_PREFIX) :]
        with self._cond:
            if key not in self._gce:
                return 404, b"not found", flavor
            if query.get("wait_for_change") == "true" and self.gce_ignores_wait_for_change:
                value, version = self._gce[key]
                self._gce[key] = (value, version + 1)
            elif query.get("wait_for_change") == "true":
                timeout = min(float(query.get("timeout_sec", MAX_WAIT_S)), MAX_WAIT_S)
                deadline = time.monotonic() + timeout
                last = query.get("last_etag")
                self._hanging += 1
                self._cond.notify_all()
                while (
                    (last is None or last == self._gce_etag(key))
                    and not self._stopping
                    and time.monotonic() < deadline
                ):
                    start_version = self._gce[key][1]
                    self._cond.wait(deadline - time.monotonic())
                    if last is None and self._gce[key][1] != start_version:
                        break
                self._hanging -= 1
            value = self._gce[key][0]
            etag = self._gce_etag(key)
        return 200, value.encode(), {**flavor, "ETag": etag, "Content-Type": "text/plain"}

    def _aws_answer(
        self, request: BaseHTTPRequestHandler, method: str, path: str
    ) -> tuple[int, bytes]:
        with self._cond:
            if path == "/latest/api/token":
                if method != "PUT":
                    return 405, b""
                ttl = request.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
                if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                    return 400, b""
                token = secrets.token_urlsafe(24)
                self._aws_tokens.add(token)
                return 200, token.encode()
            if request.headers.get("X-aws-ec2-metadata-token") not in self._aws_tokens:
                return 401, b""
            if path == "/latest/meta-data/spot/instance-action" and method == "GET":
                if self._aws_action is None:
                    return 404, b"Not Found"
                return 200, json.dumps(self._aws_action).encode()
            return 404, b"Not Found"

    def _azure_answer(
        self, request: BaseHTTPRequestHandler, method: str, path: str, query: dict[str, str]
    ) -> tuple[int, bytes]:
        if request.headers.get("Metadata") != "true" or request.headers.get("X-Forwarded-For"):
            return 400, b'{"error": "Bad request. Required metadata header not specified"}'
        if "api-version" not in query:
            return 400, b'{"error": "Bad request. api-version was not specified"}'
        with self._cond:
            if path == "/metadata/scheduledevents" and method == "GET":
                document = {
                    "DocumentIncarnation": self._azure_incarnation,
                    "Events": list(self._azure_events),
                }
                return 200, json.dumps(document).encode()
            if path == "/metadata/instance/compute/name" and method == "GET":
                return 200, self.vm_name.encode()
        return 404, b"not found"

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                server._handle(self, "GET")

            def do_PUT(self) -> None:
                server._handle(self, "PUT")

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: the tests assert on :meth:`FakeMetadataServer.requests` instead."""

        return Handler
