"""gs:// and s3:// on a torch newer than the checked versions: DCP's own steps, the same steps.

On a torch outside ``torch_versions.CHECKED_TORCH`` (a release newer than the ones whose DCP code
was read), DCP's own ``finish`` writes ``.metadata`` as ``.metadata.tmp`` and renames it. On an
object store the rename would be a copy and a delete: the remote file system holds the file until
the rename and uploads it once, under its final name. These tests run against the real servers
on 127.0.0.1 (the GCS emulator, moto's S3), with the version the manager sees set past the range.
"""

from __future__ import annotations

import pytest
from _cloud_servers import (  # noqa: F401  (the *_fixture functions are fixtures)
    FaultProxy,
    Server,
    proxy_fixture,
    require_cloud_modules,
    root_fixture,
    server_fixture,
)

require_cloud_modules()

from _cloud_state import blank_like, differences, make_state  # noqa: E402

from ckptmgr import CheckpointManager, torch_versions  # noqa: E402
from ckptmgr.storage import CheckpointStorage  # noqa: E402


@pytest.fixture(autouse=True)
def unchecked_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The manager sees the torch version just after the checked range."""
    (_, high) = torch_versions.CHECKED_TORCH
    monkeypatch.setattr(torch_versions, "torch_version", lambda: (high[0], high[1] + 1))
    monkeypatch.setattr(torch_versions, "_told", False)


def _is_upload(method: str, path: str) -> bool:
    """An upload of any object (on GCS its name follows the path as ``#name=``)."""
    return method in ("POST", "PUT")


def _manager(root: str, server: Server, endpoint: str | None = None) -> CheckpointManager:
    return CheckpointManager(
        root,
        1,
        max_to_keep=2,
        chkpt_on_preemption=False,
        storage_options=server.storage_options(endpoint),
    )


def test_saves_and_restores_round_trip_and_metadata_is_uploaded_once_under_its_name(
    server: Server, root: str, proxy: FaultProxy
) -> None:
    assert not torch_versions.checked_torch()
    with _manager(root, server, proxy.url) as mgr:
        assert mgr.save(1, make_state(1))
        assert mgr.save_async(2, make_state(2))
        mgr.join()
        assert mgr.save_async(3, make_state(3))
        mgr.join()
        assert mgr.all_steps() == [2, 3]
        for step in (2, 3):
            state = blank_like(make_state(step))
            mgr.restore(step, state)
            assert differences(state, make_state(step)) == []
    # .metadata went up once per save, under its own name: never as .metadata.tmp (which a
    # rename would copy and delete on an object store)
    uploads = [seen.path for seen in proxy.seen if _is_upload(seen.method, seen.path)]
    metadata_uploads = [path for path in uploads if path.endswith("/.metadata")]
    assert len(metadata_uploads) == 3, uploads
    assert not any(".tmp" in path for path in uploads), uploads
    storage = CheckpointStorage(root, server.storage_options())
    names = sorted(entry.path for entry in storage.list_files(storage.root))
    assert "step_000000000003/.metadata" in names, names
    assert not any(".tmp" in name for name in names), names


def test_a_fresh_manager_restores_what_the_unchecked_torch_saved(server: Server, root: str) -> None:
    with _manager(root, server) as mgr:
        assert mgr.save(5, make_state(5))
    with _manager(root, server) as mgr:
        assert mgr.all_steps() == [5]
        state = blank_like(make_state(5))
        mgr.restore(5, state)
        assert differences(state, make_state(5)) == []
        mgr.verify(5, deep=True)
