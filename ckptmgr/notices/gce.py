"""GCE metadata server: ``instance/preempted`` and ``instance/maintenance-event`` long polls."""

from __future__ import annotations

import os
import time
import urllib.parse

from ckptmgr.notices._http import Response, UnexpectedStatus, endpoint
from ckptmgr.notices.base import NoticeBoard, Watcher
from ckptmgr.notices.detect import on_gce

ENV_VAR = "GCE_METADATA_HOST"
DEFAULT_HOST = "metadata.google.internal"
HEADERS = {"Metadata-Flavor": "Google"}
#: The values of each watched key that mean "this VM is going away".
KEYS: dict[str, frozenset[str]] = {
    "preempted": frozenset({"TRUE"}),
    "maintenance-event": frozenset(
        {"TERMINATE_ON_HOST_MAINTENANCE", "SHUTDOWN_ON_HOST_MAINTENANCE"}
    ),
}
_PROBE_ATTEMPTS = 3  # a 503 answer during maintenance still proves the server is there


class GceWatcher(Watcher):
    """Long-polls one metadata key (``wait_for_change`` with the last ETag and a bounded
    ``timeout_sec``); posts ``"gce <key>=<value>"`` when the value turns into a bad one."""

    def __init__(
        self,
        board: NoticeBoard,
        key: str,
        *,
        auto: bool,
        poll_interval_s: float,
        request_timeout_s: float,
        long_poll_s: int,
    ) -> None:
        self.name = f"gce-{key}"
        super().__init__(
            board, auto=auto, poll_interval_s=poll_interval_s, request_timeout_s=request_timeout_s
        )
        self.key = key
        self._bad_values = KEYS[key]
        self._url = f"{endpoint(ENV_VAR, DEFAULT_HOST)}/computeMetadata/v1/instance/{key}"
        self._long_poll_s = long_poll_s
        self._etag: str | None = None
        self._was_bad = False
        self._quick_answers = 0  # long polls in a row answered within a second

    def present(self) -> bool:
        return bool(os.environ.get(ENV_VAR, "").strip()) or on_gce()

    def probe(self, timeout: float) -> None:
        for attempt in range(1, _PROBE_ATTEMPTS + 1):
            response = self.http.request("GET", self._url, HEADERS, timeout)
            if response.status == 503 and attempt < _PROBE_ATTEMPTS:
                if self.sleep(0.2 * attempt):
                    break
                continue
            if response.headers.get("Metadata-Flavor") != "Google":
                raise UnexpectedStatus(self._url + " (no Metadata-Flavor: Google)", response.status)
            self._observe(response)
            return
        raise UnexpectedStatus(self._url, 503)

    def poll(self) -> None:
        query = {"wait_for_change": "true", "timeout_sec": str(self._long_poll_s)}
        if self._etag:
            query["last_etag"] = self._etag
        url = f"{self._url}?{urllib.parse.urlencode(query)}"
        started = time.monotonic()
        response = self.http.request(
            "GET", url, HEADERS, self._long_poll_s + self.request_timeout_s
        )
        self._observe(response)
        # A long poll answers at once only when the value changed since last_etag; a server
        # that ignores wait_for_change (answering at once, with a new ETag or not) would make
        # this loop spin: a second quick answer in a row is paced.
        quick = time.monotonic() - started < 1.0
        self._quick_answers = self._quick_answers + 1 if quick else 0

    def pause_after_poll(self) -> float:
        return 0.0 if self._quick_answers <= 1 else self.poll_interval_s

    def _observe(self, response: Response) -> None:
        if response.status != 200:
            raise UnexpectedStatus(self._url, response.status)
        value = response.text
        self._etag = response.headers.get("ETag")
        bad = value in self._bad_values
        if bad and not self._was_bad:
            self.post(f"gce {self.key}={value}")
        self._was_bad = bad
