"""Preemption notice sources: real HTTP on 127.0.0.1, real files, real signals in a child."""

from __future__ import annotations

import logging
import math
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any

import pytest
from _metadata_server import GCE_PREFIX, FakeMetadataServer
from conftest import REPO
from pydantic import ValidationError

from ckptmgr.config import CheckpointConfig
from ckptmgr.notices.detect import AZURE_ASSET_TAG, on_aws, on_azure, on_gce
from ckptmgr.preemption import (
    PreemptionConfig,
    PreemptionMonitor,
    PreemptionNotice,
    WorkerSignalGuard,
)

POLL_S = 0.3
MARGIN_S = 2.0  # scheduling slack on a loaded 2-core machine
WAIT_S = 20.0  # bound on waits for things that should take milliseconds
ENV_VARS = ("GCE_METADATA_HOST", "AWS_EC2_METADATA_SERVICE_ENDPOINT", "AZURE_METADATA_ENDPOINT")
QUIET = {"signals": [], "gce": False, "aws": False, "azure": False, "tpu": False}


def wait_until(predicate: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` passes (a bounded wait)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def wait_for_notice(monitor: PreemptionMonitor, timeout: float) -> PreemptionNotice:
    assert wait_until(lambda: monitor.notified, timeout), (
        f"no notice within {timeout} s; sources: {monitor.sources}"
    )
    notice = monitor.notice
    assert notice is not None
    return notice


def closed_port() -> int:
    """A local port that nothing listens on (connections are refused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def our_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ckptmgr-preemption-")]


@pytest.fixture
def monitors() -> Iterator[Callable[..., PreemptionMonitor]]:
    """Builds monitors (quiet unless told otherwise) and closes them all at teardown."""
    made: list[PreemptionMonitor] = []

    def make(**settings: Any) -> PreemptionMonitor:
        monitor = PreemptionMonitor(PreemptionConfig(**{**QUIET, **settings}))
        made.append(monitor)
        return monitor

    yield make
    for monitor in made:
        monitor.close()


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeMetadataServer]:
    """The fake metadata server, with every endpoint variable pointing at it."""
    with FakeMetadataServer() as fake:
        monkeypatch.setenv("GCE_METADATA_HOST", fake.address)
        monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", fake.url)
        monkeypatch.setenv("AZURE_METADATA_ENDPOINT", fake.address)
        yield fake


def assert_watching(monitor: PreemptionMonitor, *names: str) -> None:
    states = monitor.wait_for_detection(WAIT_S)
    for name in names:
        assert states[name].state == "watching", states


# -- configuration -------------------------------------------------------------------------------
def test_defaults_match_the_issue() -> None:
    config = PreemptionConfig()
    assert config.signals == ["SIGTERM"]
    assert (config.gce, config.aws, config.azure, config.tpu) == ("auto",) * 4
    assert config.file is None
    assert config.poll_interval_s == 5.0
    assert config.exit_after_save is False


def test_signal_names_are_normalised_and_checked() -> None:
    config = PreemptionConfig(signals=["USR1", "sigterm", "SIGUSR1", "SIGINT"])
    assert config.signals == ["SIGUSR1", "SIGTERM", "SIGINT"]
    with pytest.raises(ValidationError, match="unknown signal name 'SIGNOPE'"):
        PreemptionConfig(signals=["SIGNOPE"])
    with pytest.raises(ValidationError, match="SIGKILL cannot be caught"):
        PreemptionConfig(signals=["SIGKILL"])


@pytest.mark.parametrize("name", ["gce", "aws", "azure", "tpu"])
@pytest.mark.parametrize("value", ["yes", "AUTO", 1, None, "true"])
def test_source_modes_are_true_false_or_auto(name: str, value: object) -> None:
    with pytest.raises(ValidationError, match=f'{name}[\\s\\S]*true, false or "auto"'):
        PreemptionConfig(**{name: value})
    for good in (True, False, "auto"):
        assert getattr(PreemptionConfig(**{name: good}), name) == good


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("poll_interval_s", 0),
        ("poll_interval_s", -1.0),
        ("poll_interval_s", math.nan),
        ("poll_interval_s", math.inf),
        ("request_timeout_s", 0),
        ("gce_long_poll_s", 0),
        ("gce_long_poll_s", 1.5),
        ("exit_after_save", "yes"),
        ("file", ""),
        ("signals", "SIGTERM"),
        ("unknown_setting", 1),
    ],
)
def test_invalid_values_name_the_setting(name: str, value: object) -> None:
    with pytest.raises(ValidationError, match=name):
        PreemptionConfig(**{name: value})


def test_config_is_frozen_and_nests_in_checkpoint_config(tmp_path: Path) -> None:
    config = PreemptionConfig(file=tmp_path / "preempt", exit_after_save=True)
    assert config.file == str(tmp_path / "preempt")
    with pytest.raises(ValidationError):
        config.poll_interval_s = 1.0  # type: ignore[misc]
    nested = CheckpointConfig(
        path=str(tmp_path), save_interval=1, preemption={"signals": ["USR1"], "gce": False}
    )
    assert nested.preemption.signals == ["SIGUSR1"]
    assert nested.preemption.gce is False


def test_cloud_detection_reads_dmi_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not on_gce(empty) and not on_aws(empty, empty / "uuid") and not on_azure(empty)
    gce_dir, aws_dir, xen_dir, azure_dir = (tmp_path / n for n in ("gce", "aws", "xen", "azure"))
    for directory in (gce_dir, aws_dir, xen_dir, azure_dir):
        directory.mkdir()
    (gce_dir / "product_name").write_text("Google Compute Engine\n")
    (aws_dir / "sys_vendor").write_text("Amazon EC2\n")
    (xen_dir / "uuid").write_text("ec2e1916-9099-7caf-fd21-012345abcdef\n")
    (azure_dir / "chassis_asset_tag").write_text(AZURE_ASSET_TAG + "\n")
    assert on_gce(gce_dir) and not on_aws(gce_dir, empty / "uuid") and not on_azure(gce_dir)
    assert on_aws(aws_dir, empty / "uuid") and not on_gce(aws_dir)
    assert on_aws(empty, xen_dir / "uuid")
    assert on_azure(azure_dir) and not on_gce(azure_dir)


# -- the fake server enforces the access rules of the real ones ----------------------------------
def test_fake_metadata_server_enforces_headers(server: FakeMetadataServer) -> None:
    def status(path: str, method: str = "GET", headers: dict[str, str] | None = None) -> int:
        request = urllib.request.Request(server.url + path, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=WAIT_S) as response:
                return int(response.status)
        except urllib.error.HTTPError as error:
            return error.code

    gce = GCE_PREFIX + "preempted"
    assert status(gce) == 403
    assert status(gce, headers={"Metadata-Flavor": "Google", "X-Forwarded-For": "1.2.3.4"}) == 403
    assert status(gce, headers={"Metadata-Flavor": "Google"}) == 200
    assert status("/latest/meta-data/spot/instance-action") == 401
    assert status("/latest/api/token", "PUT") == 400  # no TTL header
    assert status("/metadata/scheduledevents?api-version=2020-07-01") == 400
    events = "/metadata/scheduledevents?api-version=2020-07-01"
    assert status(events, headers={"Metadata": "true"}) == 200
    assert status("/metadata/scheduledevents", headers={"Metadata": "true"}) == 400


# -- GCE -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [True, "auto"])
def test_gce_preempted_gives_a_notice_within_the_poll_interval(
    server: FakeMetadataServer, monitors: Callable[..., PreemptionMonitor], mode: object
) -> None:
    monitor = monitors(gce=mode, poll_interval_s=POLL_S, gce_long_poll_s=30)
    assert_watching(monitor, "gce-preempted", "gce-maintenance-event")
    assert server.wait_for_hanging(2, WAIT_S), "the watchers never long-polled"
    assert not monitor.notified

    flipped_at = time.time()
    server.set_gce("preempted", "TRUE")
    notice = wait_for_notice(monitor, POLL_S + MARGIN_S)
    assert notice.source == "gce preempted=TRUE"
    assert notice.signum is None and notice.exit_code == 128 + signal.SIGTERM
    assert flipped_at <= notice.received_at <= flipped_at + POLL_S + MARGIN_S

    polls = [s for s in server.requests(GCE_PREFIX + "preempted") if "wait_for_change" in s.query]
    assert polls and all(
        s.query["wait_for_change"] == "true" and s.query["timeout_sec"] == "30" for s in polls
    )
    assert all("last_etag" in s.query for s in polls), "every long poll must send the ETag"
    assert server.count(status=403) == 0, "a request went out without Metadata-Flavor: Google"


def test_gce_maintenance_terminate_counts_and_migrate_does_not(
    server: FakeMetadataServer, monitors: Callable[..., PreemptionMonitor]
) -> None:
    monitor = monitors(gce=True, poll_interval_s=POLL_S)
    assert_watching(monitor, "gce-maintenance-event")
    key = GCE_PREFIX + "maintenance-event"
    answered = server.count(key)
    server.set_gce("maintenance-event", "MIGRATE_ON_HOST_MAINTENANCE")
    assert server.wait_for_requests(key, answered + 1, WAIT_S)  # the watcher saw MIGRATE
    assert server.wait_for_hanging(2, WAIT_S)  # ... and is waiting again
    assert not monitor.notified

    server.set_gce("maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")
    notice = wait_for_notice(monitor, POLL_S + MARGIN_S)
    assert notice.source == "gce maintenance-event=TERMINATE_ON_HOST_MAINTENANCE"


def test_gce_retries_503_answers(
    server: FakeMetadataServer, monitors: Callable[..., PreemptionMonitor]
) -> None:
    key = GCE_PREFIX + "preempted"
    monitor = monitors(gce=True, poll_interval_s=POLL_S, gce_long_poll_s=1)
    assert_watching(monitor, "gce-preempted")
    server.fail_next(3, 503, prefix=key)
    assert server.wait_for_requests(key, 3, WAIT_S, status=503)
    assert server.wait_for_requests(key, 1, WAIT_S, status=200)
    served = server.count(key, status=200)
    assert server.wait_for_requests(key, served + 1, WAIT_S, status=200), "no retry after 503s"
    assert monitor.sources["gce-preempted"].errors >= 3
    assert not monitor.notified

    server.set_gce("preempted", "TRUE")
    assert wait_for_notice(monitor, POLL_S + MARGIN_S).source == "gce preempted=TRUE"


def test_gce_notices_again_only_for_a_new_event(
    server: FakeMetadataServer, monitors: Callable[..., PreemptionMonitor]
) -> None:
    key = GCE_PREFIX + "preempted"
    monitor = monitors(gce=True, poll_interval_s=POLL_S, gce_long_poll_s=1)
    assert_watching(monitor, "gce-preempted")
    server.set_gce("preempted", "TRUE")
    wait_for_notice(monitor, POLL_S + MARGIN_S)
    monitor.clear()
    assert not monitor.notified and monitor.notice is None
    answered = server.count(key)
    assert server.wait_for_requests(key, answered + 2, WAIT_S)  # two more 1 s long polls
    assert not monitor.notified, "the same TRUE value was reported twice"

    server.set_gce("preempted", "FALSE")
    assert server.wait_for_requests(key, server.count(key) + 1, WAIT_S)
    server.set_gce("preempted", "TRUE")
    assert wait_for_notice(monitor, POLL_S + MARGIN_S).source == "gce preempted=TRUE"


# -- AWS -----------------------------------------------------------------------------------------
SPOT = "/latest/meta-data/spot/instance-action"


def test_aws_spot_instance_action_gives_a_notice_within_the_poll_interval(
    server: FakeMetadataServer, monitors: Callable[..., PreemptionMonitor]
) -> None:
    monitor = monitors(aws="auto", poll_interval_s=POLL_S)
    assert_watching(monitor, "aws")
    assert server.wait_for_requests(SPOT, 2, WAIT_S, status=404)
    assert not monitor.notified

    flipped_at = time.time()
    server.set_aws_action("terminate")
    notice = wait_for_notice(monitor, POLL_S + MARGIN_S)
    assert notice.source == "aws spot instance-action"
    assert "action=terminate" in notice.detail and "2026-11-22T12:49:33Z" in notice.detail
    assert notice.received_at - flipped_at <= POLL_S + MARGIN_S
    assert server.count(SPOT, status=401) == 0, "a poll went out without a valid token"
    assert server.count("/latest/api/token", status=200) == 1, "the token must be reused"


def test_aws_renews_a_rejected_token_and_notices_only_new_actions(
    server: FakeMetadataServer, monitors: Callable[..., PreemptionMonitor]
) -> None:
    monitor = monitors(aws=True, poll_interval_s=POLL_S)
    assert_watching(monitor, "aws")
    server.revoke_aws_tokens()
    assert server.wait_for_requests(SPOT, 1, WAIT_S, status=401)
    assert server.wait_for_requests("/latest/api/token", 2, WAIT_S, status=200)

    server.set_aws_action("terminate")
    wait_for_notice(monitor, POLL_S + MARGIN_S)
    monitor.clear()
    assert server.wait_for_requests(SPOT, server.count(SPOT, status=200) + 2, WAIT_S, 200)
    assert not monitor.notified, "the same instance-action was reported twice"

    server.set_aws_action(None)
    assert server.wait_for_requests(SPOT, server.count(SPOT, status=404) + 1, WAIT_S, 404)
    server.set_aws_action("stop", when="2026-11-22T13:00:00Z")
    notice = wait_for_notice(monitor, POLL_S + MARGIN_S)
    assert "action=stop" in notice.detail


# -- Azure ---------------------------------------------------------------------------------------
EVENTS = "/metadata/scheduledevents"


def test_azure_preempt_and_terminate_for_this_vm(
    server: FakeMetadataServer, monitors: Callable[..., PreemptionMonitor]
) -> None:
    monitor = monitors(azure="auto", poll_interval_s=POLL_S)
    assert_watching(monitor, "azure")
    server.add_azure_event("Preempt", resources=["vm1"])  # another VM of the scale set
    server.add_azure_event("Freeze")  # this VM, but it survives a freeze
    assert server.wait_for_requests(EVENTS, server.count(EVENTS) + 2, WAIT_S)
    assert not monitor.notified, monitor.notice

    flipped_at = time.time()
    event_id = server.add_azure_event("Preempt")
    notice = wait_for_notice(monitor, POLL_S + MARGIN_S)
    assert notice.source == "azure Preempt"
    assert f"EventId={event_id}" in notice.detail
    assert notice.received_at - flipped_at <= POLL_S + MARGIN_S

    monitor.clear()
    assert server.wait_for_requests(EVENTS, server.count(EVENTS) + 2, WAIT_S)
    assert not monitor.notified, "the same EventId was reported twice"
    server.add_azure_event("Terminate")
    assert wait_for_notice(monitor, POLL_S + MARGIN_S).source == "azure Terminate"
    assert server.count(status=400) == 0, "a request went out without Metadata: true"


def test_gce_paces_a_server_that_ignores_wait_for_change(
    server: FakeMetadataServer, monitors: Callable[..., PreemptionMonitor]
) -> None:
    """A server that answers each long poll at once with a new ETag (as if the value changed
    every time) is polled every poll_interval_s, not in a loop of a thousand requests a second
    (a quick answer with a new ETag made the next poll go at once)."""
    key = GCE_PREFIX + "preempted"
    server.gce_ignores_wait_for_change = True
    interval = 0.2
    monitor = monitors(gce=True, poll_interval_s=interval)
    assert_watching(monitor, "gce-preempted")
    start, started = server.count(key), time.monotonic()
    assert server.wait_for_requests(key, start + 8, WAIT_S)
    # Eight answers at once would take milliseconds; paced, at least 3 pauses lie between them.
    assert time.monotonic() - started >= 3 * interval, "the watcher polled in a loop"
    server.set_gce("preempted", "TRUE")
    assert wait_for_notice(monitor, interval + MARGIN_S).source == "gce preempted=TRUE"


def test_azure_retries_a_garbled_answer_and_reads_a_resource_as_one_name(
    server: FakeMetadataServer, monitors: Callable[..., PreemptionMonitor]
) -> None:
    """An answer whose Events is no list is retried (it stopped the watcher for good: a later
    Preempt was missed), and Resources given as a string is a VM's name, not a text searched
    for this VM's ("vm01" named this VM "vm0")."""
    events = "/metadata/scheduledevents"
    monitor = monitors(azure=True, poll_interval_s=POLL_S)
    assert_watching(monitor, "azure")
    server.fail_next(1, 200, prefix=events, body=b'{"Events": true}')
    server.add_azure_event("Preempt", resources="vm01")  # another VM
    assert server.wait_for_requests(events, server.count(events) + 3, WAIT_S)
    assert not monitor.notified, monitor.notice
    status = monitor.sources["azure"]
    assert status.state == "watching" and status.errors >= 1, status

    event_id = server.add_azure_event("Preempt", resources="vm0")
    notice = wait_for_notice(monitor, POLL_S + MARGIN_S)
    assert notice.source == "azure Preempt" and f"EventId={event_id}" in notice.detail


# -- the file trigger ----------------------------------------------------------------------------
def wait_for_polls(monitor: PreemptionMonitor, name: str, more: int) -> None:
    start = monitor.sources[name].polls
    assert wait_until(lambda: monitor.sources[name].polls >= start + more), monitor.sources


def test_file_trigger(tmp_path: Path, monitors: Callable[..., PreemptionMonitor]) -> None:
    trigger = tmp_path / "preempt-now"
    monitor = monitors(file=str(trigger), poll_interval_s=0.1)
    assert_watching(monitor, "file")
    wait_for_polls(monitor, "file", 2)
    assert not monitor.notified

    flipped_at = time.time()
    trigger.touch()
    notice = wait_for_notice(monitor, 0.1 + MARGIN_S)
    assert notice.source == f"file {trigger}"
    assert notice.received_at - flipped_at <= 0.1 + MARGIN_S

    monitor.clear()
    wait_for_polls(monitor, "file", 3)
    assert not monitor.notified, "the same file was reported twice"
    stat = trigger.stat()
    os.utime(trigger, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # touched again
    assert wait_for_notice(monitor, 0.1 + MARGIN_S).source == f"file {trigger}"


def test_a_trigger_file_made_right_after_the_start_is_a_notice(
    tmp_path: Path, monitors: Callable[..., PreemptionMonitor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file as it was at the start was looked at by the watcher's thread, whenever it first
    ran: a file made between the start and then was taken for a stale one and ignored (2 in
    30 managers made and the file touched at once; 15 in 50 bare monitors)."""
    from ckptmgr.notices.file import FileWatcher

    trigger = tmp_path / "preempt-now"
    made = threading.Event()
    real_probe = FileWatcher.probe

    def probe_once_the_file_is_made(self: FileWatcher, timeout: float) -> None:
        assert made.wait(WAIT_S)  # the watcher's thread is late: the file is there first
        real_probe(self, timeout)

    monkeypatch.setattr(FileWatcher, "probe", probe_once_the_file_is_made)
    monitor = monitors(file=str(trigger), poll_interval_s=0.1)
    trigger.touch()
    made.set()
    assert wait_for_notice(monitor, WAIT_S).source == f"file {trigger}"


def test_a_stale_trigger_file_is_ignored_until_touched(
    tmp_path: Path, monitors: Callable[..., PreemptionMonitor], caplog: pytest.LogCaptureFixture
) -> None:
    trigger = tmp_path / "left-over"
    trigger.touch()
    with caplog.at_level(logging.WARNING, logger="ckptmgr.preemption"):
        monitor = monitors(file=str(trigger), poll_interval_s=0.1)
        assert_watching(monitor, "file")
    assert "exists already" in caplog.text
    wait_for_polls(monitor, "file", 3)
    assert not monitor.notified

    trigger.unlink()
    wait_for_polls(monitor, "file", 1)
    trigger.touch()
    assert wait_for_notice(monitor, 0.1 + MARGIN_S).source == f"file {trigger}"


# -- "auto", start-up time and close() ----------------------------------------------------------
def test_auto_with_nothing_reachable_starts_fast_and_stays_quiet(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ENV_VARS:  # endpoints "set" (so detection probes them) but refusing connections
        monkeypatch.setenv(name, f"127.0.0.1:{closed_port()}")
    started = time.perf_counter()
    monitor = PreemptionMonitor(PreemptionConfig(signals=[]))  # every cloud "auto"
    constructed = time.perf_counter() - started
    try:
        states = monitor.wait_for_detection(WAIT_S)
        detected = time.perf_counter() - started
        assert constructed < 0.5, f"the constructor took {constructed:.3f} s"
        assert detected < 2.0, f"detection took {detected:.3f} s"
        assert set(states) == {"gce-preempted", "gce-maintenance-event", "aws", "azure"}
        assert {status.state for status in states.values()} == {"absent"}, states
        assert not monitor.notified and monitor.notice is None
    finally:
        monitor.close()
    assert not our_threads()


@pytest.mark.skipif(on_gce() or on_aws() or on_azure(), reason="this machine is a cloud VM")
def test_auto_off_cloud_does_no_network_io(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    started = time.perf_counter()
    with PreemptionMonitor(PreemptionConfig(signals=[])) as monitor:
        states = monitor.wait_for_detection(WAIT_S)
        elapsed = time.perf_counter() - started
        assert {status.state for status in states.values()} == {"absent"}, states
        assert all(status.errors == 0 for status in states.values())
        assert elapsed < 0.5, f"detection took {elapsed:.3f} s without any network I/O"


def test_auto_ignores_a_server_that_is_not_a_metadata_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, monitors: Callable[..., PreemptionMonitor]
) -> None:
    handler = partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as plain:
        thread = threading.Thread(target=plain.serve_forever, daemon=True)
        thread.start()
        try:
            address = f"127.0.0.1:{plain.server_address[1]}"
            for name in ENV_VARS:
                monkeypatch.setenv(name, address)
            monitor = monitors(gce="auto", aws="auto", azure="auto")
            states = monitor.wait_for_detection(WAIT_S)
            assert {status.state for status in states.values()} == {"absent"}, states
        finally:
            plain.shutdown()
            thread.join(timeout=10)


def test_an_explicit_source_keeps_retrying_an_unreachable_server(
    monkeypatch: pytest.MonkeyPatch, monitors: Callable[..., PreemptionMonitor]
) -> None:
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"127.0.0.1:{closed_port()}")
    monitor = monitors(aws=True, poll_interval_s=0.1)
    assert wait_until(lambda: monitor.sources["aws"].errors >= 3), monitor.sources
    status = monitor.sources["aws"]
    assert status.state == "detecting" and "Connection refused" in (status.last_error or "")
    assert not monitor.notified


def test_close_stops_every_thread_promptly_even_in_a_long_poll(
    server: FakeMetadataServer, tmp_path: Path
) -> None:
    config = PreemptionConfig(
        **{**QUIET, "gce": True, "aws": True, "azure": True},
        file=str(tmp_path / "trigger"),
        poll_interval_s=30.0,
        gce_long_poll_s=600,
    )
    monitor = PreemptionMonitor(config)
    assert_watching(monitor, "gce-preempted", "gce-maintenance-event", "aws", "azure", "file")
    assert server.wait_for_hanging(2, WAIT_S)  # both GCE watchers are inside a hanging GET
    threads = our_threads()
    assert len(threads) == 5

    started = time.perf_counter()
    monitor.close()
    elapsed = time.perf_counter() - started
    assert elapsed < 1.5, f"close() took {elapsed:.3f} s"
    assert not any(thread.is_alive() for thread in threads)
    assert {status.state for status in monitor.sources.values()} == {"stopped"}
    monitor.close()  # idempotent


# -- TPU / torch_xla -----------------------------------------------------------------------------
def torch_xla_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch_xla") is not None


@pytest.mark.skipif(torch_xla_importable(), reason="torch_xla is installed here")
def test_without_torch_xla_the_sync_manager_is_not_used() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionMonitor(PreemptionConfig(gce=False, aws=False, azure=False)) as monitor:
        assert not monitor.uses_xla
        assert monitor.xla_sync_point(7) is None
        assert monitor.handled_signals == ["SIGTERM"]  # SIGTERM stays ours without XLA
    assert signal.getsignal(signal.SIGTERM) is before

    with pytest.raises(RuntimeError, match="torch_xla"):
        PreemptionMonitor(PreemptionConfig(tpu=True, gce=False, aws=False, azure=False))
    assert signal.getsignal(signal.SIGTERM) is before, "a failed constructor left a handler"
    assert not our_threads()


def test_a_failed_save_at_the_xla_sync_point_is_tried_again_at_the_next_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """XLA's sync point is true at one step only; when the preemption save of that step fails,
    the notice stays pending and the next step saves (it was lost: no preemption checkpoint).
    torch_xla's binding is faked (its sync point is step 5), and the first commit fails."""
    import torch

    import ckptmgr.preemption as preemption
    from ckptmgr import CheckpointError, CheckpointManager
    from ckptmgr.notices.xla import XlaPreemptionSync

    class SyncPointAtStep5:  # torch_xla._XLAC once a SIGTERM reached a host
        def _sync_point_reached(self, step: int) -> bool:
            return step == 5

    monkeypatch.setattr(
        preemption,
        "activate_xla_preemption_sync",
        lambda mode: XlaPreemptionSync(SyncPointAtStep5()),
    )
    config = PreemptionConfig(gce=False, aws=False, azure=False)
    saved: list[tuple[int, bool]] = []
    with CheckpointManager(tmp_path, 1000, preemption=config) as mgr:
        real_commit = mgr._storage.commit
        failures = [OSError("injected: the store failed the commit")]

        def failing_once(*args: Any, **kwargs: Any) -> Any:
            if failures:
                raise failures.pop()
            return real_commit(*args, **kwargs)

        monkeypatch.setattr(mgr._storage, "commit", failing_once)
        for step in range(1, 11):
            if mgr.should_save(step):
                try:
                    saved.append((step, mgr.save(step, {"w": torch.zeros(2)})))
                except CheckpointError:
                    saved.append((step, False))
            if mgr.reached_preemption(step):
                break
        assert saved == [(5, False), (6, True)]
        assert mgr.all_steps() == [6] and mgr.reached_preemption(6)


# -- signals -------------------------------------------------------------------------------------
def test_off_the_main_thread_no_handler_is_installed(caplog: pytest.LogCaptureFixture) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    made: list[PreemptionMonitor] = []
    with caplog.at_level(logging.WARNING):
        thread = threading.Thread(
            target=lambda: made.append(PreemptionMonitor(PreemptionConfig(signals=["SIGUSR1"])))
        )
        thread.start()
        thread.join(timeout=WAIT_S)
    assert made, "the constructor failed off the main thread"
    try:
        assert "outside the main thread" in caplog.text
        assert made[0].handled_signals == []
        assert signal.getsignal(signal.SIGUSR1) is before
    finally:
        made[0].close()
    assert signal.getsignal(signal.SIGUSR1) is before


SIGNAL_CHILD = """
import signal, sys, time
from ckptmgr.preemption import PreemptionConfig, PreemptionMonitor

calls = []
previous = lambda signum, frame: calls.append(signum)
signal.signal(signal.SIGUSR1, previous)
# What SIGINT had before: Python's default handler, or SIG_IGN when this process was started as
# a background job of a shell without job control (which ignores SIGINT in its children).
int_before = signal.getsignal(signal.SIGINT)
monitor = PreemptionMonitor(PreemptionConfig(
    signals=["SIGUSR1", "SIGINT", "SIGTERM"], gce=False, aws=False, azure=False, tpu=False))
print("ready handled=" + ",".join(monitor.handled_signals), flush=True)
for _ in range(3):
    deadline = time.monotonic() + 120
    while not monitor.notified and time.monotonic() < deadline:  # the training loop
        time.sleep(0.005)
    notice = monitor.notice
    if notice is None:
        print("no notice", flush=True)
        sys.exit(3)
    print(f"notice source={notice.source.replace(' ', '_')} signum={notice.signum} "
          f"exit_code={notice.exit_code} previous_calls={len(calls)}", flush=True)
    monitor.clear()
    print(f"cleared notified={monitor.notified}", flush=True)
monitor.close()
print(f"closed usr1_restored={signal.getsignal(signal.SIGUSR1) is previous} "
      f"term_default={signal.getsignal(signal.SIGTERM) is signal.SIG_DFL} "
      f"int_restored={signal.getsignal(signal.SIGINT) is int_before}", flush=True)
"""


class LineReader:
    """Reads a stream's lines on a thread so that every wait for a line is bounded."""

    def __init__(self, stream: IO[str]) -> None:
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def next_fields(self, timeout: float = 120.0) -> dict[str, str]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line from the child within {timeout} s") from None
        assert line is not None, "the child closed its output early"
        return dict(word.partition("=")[::2] for word in line.split())


def test_signals_in_a_child_process_chain_clear_and_restore(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("w") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-c", SIGNAL_CHILD],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
    try:
        assert child.stdout is not None
        lines = LineReader(child.stdout)
        assert lines.next_fields() == {"ready": "", "handled": "SIGUSR1,SIGINT,SIGTERM"}
        for signum in (signal.SIGUSR1, signal.SIGINT, signal.SIGTERM):
            child.send_signal(signum)
            report = lines.next_fields()
            assert report == {
                "notice": "",
                "source": f"signal_{signum.name}",
                "signum": str(int(signum)),
                "exit_code": str(128 + signum),
                # Only SIGUSR1 had a Python handler before; SIGINT's default one is not called.
                "previous_calls": "1",
            }, f"{report}\n{stderr_path.read_text()}"
            assert lines.next_fields() == {"cleared": "", "notified": "False"}
        closed = lines.next_fields()
        assert closed == {
            "closed": "",
            "usr1_restored": "True",
            "term_default": "True",
            "int_restored": "True",
        }, closed
        assert child.wait(timeout=60) == 0, stderr_path.read_text()
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=30)
        if child.stdout is not None:
            child.stdout.close()


# -- the DataLoader worker guard (its real use is in test_preemption_dataloader.py) --------------
def test_worker_signal_guard_is_picklable_and_checks_names() -> None:
    """The names are checked as PreemptionConfig checks its own: "USR1" was a bare KeyError,
    a string ("SIGTERM") one KeyError per letter ('S'), and SIGKILL or SIGCHLD were taken."""
    guard = pickle.loads(pickle.dumps(WorkerSignalGuard(["SIGUSR2"], then=abs)))
    assert guard.signals == ("SIGUSR2",) and guard.then is abs
    assert WorkerSignalGuard(["usr1", "SIGUSR1", "TERM"]).signals == ("SIGUSR1", "SIGTERM")
    with pytest.raises(ValueError, match="unknown signal name 'SIGNOPE'"):
        WorkerSignalGuard(["SIGNOPE"])
    with pytest.raises(ValueError, match="SIGKILL cannot be caught"):
        WorkerSignalGuard(["SIGKILL"])
    with pytest.raises(ValueError, match="SIGCHLD is sent in normal operation"):
        WorkerSignalGuard(["SIGCHLD"])
    with pytest.raises(TypeError, match="not one string"):
        WorkerSignalGuard("SIGTERM")
