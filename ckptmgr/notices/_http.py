"""A tiny HTTP client for link-local metadata servers.

It never uses proxies (``HTTP_PROXY`` must not apply to 169.254.169.254), reads at most
:data:`MAX_BODY` bytes, and a request in flight can be aborted from another thread: :meth:`abort`
shuts its socket down, so a watcher blocked in a long poll stops at once.
"""

from __future__ import annotations

import http.client
import os
import socket
import threading
import urllib.parse
from dataclasses import dataclass

MAX_BODY = 64 * 1024

#: Errors that mean "no usable answer this time" (refused, reset, timed out, aborted, garbled).
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (OSError, http.client.HTTPException)


class RequestAborted(ConnectionAbortedError):
    """The request was aborted by :meth:`Requester.abort` (the watcher is stopping)."""


class UnexpectedStatus(OSError):
    """The server answered with a status the caller cannot use."""

    def __init__(self, url: str, status: int) -> None:
        super().__init__(f"HTTP {status} from {url}")
        self.status = status


@dataclass(frozen=True)
class Response:
    """Status, headers and (the first :data:`MAX_BODY` bytes of the) body of one answer."""

    status: int
    headers: http.client.HTTPMessage
    body: bytes

    @property
    def text(self) -> str:
        """The body decoded as UTF-8 (invalid bytes replaced), surrounding whitespace removed."""
        return self.body.decode("utf-8", errors="replace").strip()


def endpoint(env_var: str, default: str) -> str:
    """Base URL from ``env_var`` (``host[:port]`` or ``http://host[:port]``), else ``default``.

    Read at each call, so tests and users can set the variable before creating a monitor.
    """
    value = os.environ.get(env_var, "").strip() or default
    if "://" not in value:
        value = "http://" + value
    return value.rstrip("/")


class Requester:
    """Sends one request at a time; :meth:`abort` cancels the one in flight and all later ones."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._connection: http.client.HTTPConnection | None = None
        self._aborted = False

    def request(self, method: str, url: str, headers: dict[str, str], timeout: float) -> Response:
        """Send ``method url`` and read the answer; raises one of :data:`TRANSPORT_ERRORS`."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"metadata endpoints must be http:// URLs, got {url!r}")
        connection = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
        with self._lock:
            if self._aborted:
                raise RequestAborted("the watcher is stopping")
            self._connection = connection
        try:
            connection.connect()
            with self._lock:  # abort() may have run during connect(), before sock was set
                if self._aborted:
                    raise RequestAborted("the watcher is stopping")
            target = parts.path or "/"
            if parts.query:
                target += "?" + parts.query
            connection.request(method, target, headers=headers)
            answer = connection.getresponse()
            body = answer.read(MAX_BODY)
            return Response(answer.status, answer.headers, body)
        finally:
            with self._lock:
                self._connection = None
            connection.close()

    def abort(self) -> None:
        """Shut down the socket of the request in flight (if any) and refuse new requests."""
        with self._lock:
            self._aborted = True
            connection = self._connection
        sock = connection.sock if connection is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed or never connected
