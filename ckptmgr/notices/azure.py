"""Azure Scheduled Events: ``Preempt`` (spot eviction) and ``Terminate`` for this VM."""

from __future__ import annotations

import json
import os

from ckptmgr.notices._http import UnexpectedStatus, endpoint
from ckptmgr.notices.base import NoticeBoard, Watcher
from ckptmgr.notices.detect import on_azure

ENV_VAR = "AZURE_METADATA_ENDPOINT"
DEFAULT_ENDPOINT = "http://169.254.169.254"
HEADERS = {"Metadata": "true"}
EVENT_TYPES = frozenset({"Preempt", "Terminate"})
#: The first Scheduled Events request of a VM turns the service on and may take up to 2 minutes.
FIRST_REQUEST_TIMEOUT_S = 150.0


class AzureWatcher(Watcher):
    """Polls ``/metadata/scheduledevents`` every ``poll_interval_s``; posts ``"azure <Type>"``
    once per new ``EventId`` whose ``Resources`` name this VM (or are empty)."""

    name = "azure"

    def __init__(
        self, board: NoticeBoard, *, auto: bool, poll_interval_s: float, request_timeout_s: float
    ) -> None:
        super().__init__(
            board, auto=auto, poll_interval_s=poll_interval_s, request_timeout_s=request_timeout_s
        )
        base = endpoint(ENV_VAR, DEFAULT_ENDPOINT)
        self._name_url = f"{base}/metadata/instance/compute/name?api-version=2021-02-01&format=text"
        self._events_url = f"{base}/metadata/scheduledevents?api-version=2020-07-01"
        self._vm_name = ""
        self._seen: set[str] = set()
        self._first = True

    def present(self) -> bool:
        return bool(os.environ.get(ENV_VAR, "").strip()) or on_azure()

    def probe(self, timeout: float) -> None:
        response = self.http.request("GET", self._name_url, HEADERS, timeout)
        if response.status != 200:
            raise UnexpectedStatus(self._name_url, response.status)
        self._vm_name = response.text

    def poll(self) -> None:
        timeout = FIRST_REQUEST_TIMEOUT_S if self._first else self.request_timeout_s
        response = self.http.request("GET", self._events_url, HEADERS, timeout)
        if response.status != 200:
            raise UnexpectedStatus(self._events_url, response.status)
        self._first = False
        try:
            events = json.loads(response.body).get("Events") or []
        except (ValueError, AttributeError) as error:
            raise UnexpectedStatus(self._events_url + f" (bad JSON: {error})", 200) from None
        if not isinstance(events, list):  # a garbled answer: no usable answer this time
            raise UnexpectedStatus(self._events_url + " (Events is not a list)", 200)
        for event in events:
            if not isinstance(event, dict) or event.get("EventType") not in EVENT_TYPES:
                continue
            resources = _resource_names(event.get("Resources"))
            if resources and self._vm_name and self._vm_name not in resources:
                continue  # an event for another VM of the same scale set or availability set
            event_id = str(event.get("EventId", ""))
            if event_id in self._seen:
                continue
            self._seen.add(event_id)
            detail = f"EventId={event_id} NotBefore={event.get('NotBefore', '')}"
            self.post(f"azure {event['EventType']}", detail)


def _resource_names(resources: object) -> list[str]:
    """The VM names an event's ``Resources`` lists: a string is one name (not a text to search),
    anything but a list of names none (the event is taken to be for this VM: an extra
    checkpoint is cheaper than a missed eviction)."""
    if isinstance(resources, str):
        return [resources] if resources else []
    if isinstance(resources, list):
        return [name for name in resources if isinstance(name, str)]
    return []
