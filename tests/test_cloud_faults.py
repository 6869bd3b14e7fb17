"""Transient and permanent storage faults, injected by a proxy between the client and the server.

The proxy answers chosen requests with 429/500/503 in the store's own error format, resets their
connections, or answers 403 for good. With transient faults every save commits and restores bit
for bit, and each retry is logged with its cause; with a permanent 403 a save fails at once with a
``CheckpointError``, nothing new is listed, and earlier steps are intact.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter

import pytest
from _cloud_servers import (  # noqa: F401  (the *_fixture functions are fixtures)
    FaultProxy,
    Server,
    is_data_upload,
    proxy_fixture,
    require_cloud_modules,
    root_fixture,
    server_fixture,
)

require_cloud_modules()

from _cloud_state import blank_like, differences, make_state  # noqa: E402

from ckptmgr import CheckpointError, CheckpointManager  # noqa: E402
from ckptmgr.storage import CheckpointStorage  # noqa: E402

pytestmark = [pytest.mark.cloud, pytest.mark.timeout(240)]
TRANSIENT = ("429", "500", "503", "reset")
RETRY_LOGGER = "ckptmgr.retry"


def manager(root: str, options: dict, **kwargs: object) -> CheckpointManager:
    kwargs.setdefault("chkpt_on_preemption", False)
    return CheckpointManager(root, 1, storage_options=options, **kwargs)  # type: ignore[arg-type]


def check_restores(mgr: CheckpointManager, steps: list[int]) -> None:
    for step in steps:
        state = blank_like(make_state(step))
        mgr.restore(step, state)
        assert differences(state, make_state(step)) == [], f"step {step}"


def retry_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == RETRY_LOGGER]


def test_every_save_commits_and_restores_with_20_percent_of_requests_failing(
    server: Server, root: str, proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=RETRY_LOGGER)
    options = server.storage_options(proxy.url)
    proxy.set_faults(rate=0.2, kinds=TRANSIENT, seed=5)
    with manager(root, options, max_to_keep=3) as mgr:
        for step in range(1, 7):
            if step % 2:
                assert mgr.save(step, make_state(step))
            else:
                assert mgr.save_async(step, make_state(step))
        mgr.join()
        assert mgr.all_steps() == [4, 5, 6]
        check_restores(mgr, [4, 5, 6])
    with manager(root, options) as mgr:  # a new manager, through the same faults
        assert mgr.all_steps() == [4, 5, 6]
        check_restores(mgr, [6])
    injected = Counter(s.action for s in proxy.seen if s.action != "forwarded")
    total = len(proxy.seen)
    print(f"{server.kind}: {total} requests, injected {dict(injected)}")
    assert sum(injected.values()) >= 0.1 * total and len(injected) == len(TRANSIENT), injected
    messages = retry_messages(caplog)
    # every injected status is logged as a retry; some resets of reused keep-alive connections
    # are retried by aiohttp itself before ckptmgr sees them
    assert len(messages) >= injected["429"] + injected["500"] + injected["503"], messages[:5]
    causes = " ".join(messages)
    assert all(f"HTTP {status}" in causes for status in (429, 500, 503)), messages[:10]
    assert re.search(r"(Connection|Disconnected|reset)", causes), messages[:10]
    proxy.set_faults()
    assert CheckpointStorage(root, server.storage_options()).committed_steps() == [4, 5, 6]


def test_a_burst_longer_than_the_request_retries_is_retried_by_the_operation(
    server: Server, root: str, proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=RETRY_LOGGER)
    options = server.storage_options(proxy.url)

    def record_upload(method: str, path: str) -> bool:
        return method in ("PUT", "POST") and "commit.json" in path

    with manager(root, options) as mgr:
        proxy.set_faults(sequence=("503",) * 4, match=record_upload)  # 3 tries per request
        assert mgr.save(1, make_state(1))
        # aiohttp may retry a reset of a reused connection once on its own: 6 resets outlast
        # 3 tries per request even then
        proxy.set_faults(sequence=("reset",) * 6, match=is_data_upload)
        assert mgr.save(2, make_state(2))
        proxy.set_faults()
        check_restores(mgr, [1, 2])
    assert proxy.count(record_upload, "503") == 4
    assert proxy.count(is_data_upload, "reset") == 6
    messages = retry_messages(caplog)
    operation = [m for m in messages if m.startswith("storage: write commit record")]
    assert operation and "attempt 1 of 5" in operation[0] and "HTTP 503" in operation[0], messages
    uploads = [m for m in messages if m.startswith("storage: upload") and ".distcp" in m]
    assert uploads and "attempt 1 of 5" in uploads[0], messages
    assert CheckpointStorage(root, server.storage_options()).committed_steps() == [1, 2]


def test_a_burst_on_the_owner_lease_is_retried_by_the_operation(
    server: Server, root: str, proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """The owner lease's record is read by storage operations like any other: a burst of 503s
    longer than one request's tries neither fails the manager's start (the lease acquired) nor
    retention after a commit (the lease confirmed before deleting), which the next save or join
    then raised although the step was committed."""
    caplog.set_level(logging.WARNING, logger=RETRY_LOGGER)
    options = server.storage_options(proxy.url)

    def lease_read(method: str, path: str) -> bool:
        return method == "GET" and "owner.json" in path

    proxy.set_faults(sequence=("503",) * 4, match=lease_read)  # 3 tries per request
    # (a heartbeat long after the test: only the start and retention read the record)
    with manager(root, options, max_to_keep=1, lease_timeout_s=600) as mgr:
        assert proxy.count(lease_read, "503") == 4
        assert mgr.save(1, make_state(1))
        proxy.set_faults(sequence=("503",) * 4, match=lease_read)
        assert mgr.save(2, make_state(2))  # commits, then retention deletes step 1
        mgr.join()
        assert proxy.count(lease_read, "503") == 8
        assert mgr.all_steps() == [2]
        proxy.set_faults()
        check_restores(mgr, [2])
    messages = retry_messages(caplog)
    for what in ("storage: acquire the owner lease", "storage: read the owner lease"):
        found = [m for m in messages if m.startswith(what)]
        assert found and "attempt 1 of 5" in found[0] and "HTTP 503" in found[0], messages
    assert CheckpointStorage(root, server.storage_options()).committed_steps() == [2]


def test_a_permanent_403_fails_fast_lists_nothing_and_keeps_earlier_steps(
    server: Server, root: str, proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=RETRY_LOGGER)
    options = server.storage_options(proxy.url)

    def upload(method: str, path: str) -> bool:
        return method in ("PUT", "POST") and "delete" not in path

    with manager(root, options) as mgr:
        assert mgr.save(1, make_state(1))
        proxy.clear()
        proxy.set_faults(permanent="403", match=upload)
        started = time.monotonic()
        with pytest.raises(CheckpointError, match=r"save of step 2 failed") as failure:
            mgr.save(2, make_state(2))
        elapsed = time.monotonic() - started
        assert mgr.all_steps() == [1]
        forbidden = Counter(s.path for s in proxy.seen if s.action == "403")
        assert forbidden and max(forbidden.values()) == 1, forbidden  # no retry of a 403
        assert elapsed < 10, elapsed
        assert isinstance(failure.value.__cause__, OSError)  # PermissionError on S3
        assert re.search(r"Forbidden|AccessDenied|403", str(failure.value)), str(failure.value)
        assert retry_messages(caplog) == []
        proxy.set_faults()
        check_restores(mgr, [1])
    storage = CheckpointStorage(root, server.storage_options())
    assert storage.committed_steps() == [1]
    with manager(root, options) as mgr:
        assert mgr.all_steps() == [1]


def test_a_save_refused_at_its_first_request_carries_the_stores_error(
    server: Server, root: str, proxy: FaultProxy
) -> None:
    """Revoked credentials: every request answered 403. The save failed while preparing its
    directory, and its CheckpointError had no __cause__ (rank 0's error was sent to the ranks
    as text, and raised as such), unlike failures later in the save."""
    options = server.storage_options(proxy.url)
    with manager(root, options) as mgr:
        assert mgr.save(1, make_state(1))
        proxy.set_faults(permanent="403")
        with pytest.raises(CheckpointError, match=r"could not prepare step 2") as failure:
            mgr.save(2, make_state(2))
        assert isinstance(failure.value.__cause__, OSError), repr(failure.value.__cause__)
        proxy.set_faults()
        assert mgr.all_steps() == [1]
