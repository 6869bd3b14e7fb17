"""How data files reach the store: uploaded while written on GCS, spooled then sent on S3.

Against the GCS emulator and moto's S3 server on 127.0.0.1, through the counting proxy. A data
file larger than one chunk goes to GCS as a resumable upload while DCP writes it (no temporary
file; a failed upload is cancelled and the file written again) and to S3 through the local
spool (s3fs sends its parts ten at a time). Small files are one request on both.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
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

from ckptmgr import CheckpointError, CheckpointManager, dcp_io, remote_write  # noqa: E402
from ckptmgr.storage import CheckpointStorage  # noqa: E402

pytestmark = [pytest.mark.cloud, pytest.mark.timeout(240)]
CHUNK = 256 * 1024  # GCS's smallest chunk of a resumable upload


def state_of(seed: int, numel: int = 300_000) -> dict[str, torch.Tensor]:
    """One data file of about 1.2 MB (over four chunks) and a few small tensors."""
    generator = torch.Generator().manual_seed(seed)
    state = {"large": torch.randn(numel, generator=generator)}
    state.update({f"small{i}": torch.randn(100, generator=generator) for i in range(5)})
    return state


def is_chunk(method: str, path: str) -> bool:
    """A chunk of a resumable GCS upload of a data file."""
    return method in ("POST", "PUT") and ".distcp" in path and "upload_id=" in path


def is_upload_start(method: str, path: str) -> bool:
    """The request that starts a data file's upload (or sends it whole)."""
    return is_data_upload(method, path) and "upload_id=" not in path


@pytest.fixture(name="spools")
def spools_fixture(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Temporary spool files made (a small spool limit and chunk, so 1.2 MB needs either)."""
    made: list[str] = []
    mkstemp = tempfile.mkstemp

    def recording(*args: Any, **kwargs: Any) -> tuple[int, str]:
        fd, path = mkstemp(*args, **kwargs)
        made.append(path)
        return fd, path

    monkeypatch.setattr(tempfile, "mkstemp", recording)
    monkeypatch.setattr(dcp_io, "SPOOL_MEMORY_BYTES", 64 * 1024)
    monkeypatch.setattr(remote_write, "UPLOAD_CHUNK_BYTES", CHUNK)
    return made


def manager(root: str, options: dict[str, Any]) -> CheckpointManager:
    return CheckpointManager(root, 1, storage_options=options, chkpt_on_preemption=False)


def restores_bit_exact(mgr: CheckpointManager, step: int) -> bool:
    state = {name: torch.zeros_like(value) for name, value in state_of(step).items()}
    mgr.restore(step, state)
    return all(torch.equal(state[name], value) for name, value in state_of(step).items())


def test_a_large_data_file_is_uploaded_while_written_on_gcs_and_spooled_on_s3(
    server: Server, root: str, proxy: FaultProxy, spools: list[str]
) -> None:
    with manager(root, server.storage_options(proxy.url)) as mgr:
        assert mgr.save(1, state_of(1))
        assert restores_bit_exact(mgr, 1)
    assert proxy.count(is_upload_start) == 1
    if server.kind == "gcs":
        assert spools == []  # nothing through local disk
        assert proxy.count(is_chunk) >= 1_200_000 // CHUNK
    else:
        assert len(spools) == 1


def test_a_small_data_file_is_one_request_on_both(
    server: Server, root: str, proxy: FaultProxy, spools: list[str]
) -> None:
    with manager(root, server.storage_options(proxy.url)) as mgr:
        assert mgr.save(1, state_of(1, numel=10_000))
        state = {name: torch.zeros_like(value) for name, value in state_of(1, 10_000).items()}
        mgr.restore(1, state)
    assert all(torch.equal(state[k], v) for k, v in state_of(1, 10_000).items())
    assert proxy.count(is_data_upload) == 1
    assert spools == []


def test_a_failed_gcs_upload_is_cancelled_and_the_file_written_again(
    server: Server, root: str, proxy: FaultProxy, spools: list[str]
) -> None:
    if server.kind != "gcs":
        pytest.skip("S3 data files are spooled and sent whole (test_cloud_faults)")
    # a chunk refused as often as the request level tries: the upload fails, and is retried
    proxy.set_faults(sequence=("503", "503", "503"), match=is_chunk)
    with manager(root, server.storage_options(proxy.url)) as mgr:
        assert mgr.save(1, state_of(1))
        proxy.set_faults()
        assert restores_bit_exact(mgr, 1)
    assert proxy.count(is_upload_start) == 2  # the file written twice
    assert proxy.count(lambda method, path: method == "DELETE" and "upload_id=" in path) == 1
    assert spools == []


def test_a_gcs_upload_that_keeps_failing_fails_the_save_and_leaves_no_data_object(
    server: Server, root: str, proxy: FaultProxy, spools: list[str]
) -> None:
    if server.kind != "gcs":
        pytest.skip("S3 data files are spooled and sent whole (test_cloud_faults)")
    with manager(root, server.storage_options(proxy.url)) as mgr:
        assert mgr.save(1, state_of(1))
        proxy.set_faults(permanent="403", match=is_chunk)
        with pytest.raises(CheckpointError, match="save of step 2 failed"):
            mgr.save(2, state_of(2))
        proxy.set_faults()
        assert mgr.all_steps() == [1]
        assert restores_bit_exact(mgr, 1)
    storage = CheckpointStorage(root, server.storage_options())
    names = [entry.path for entry in storage.list_files(storage.step_path(2))]
    assert not [name for name in names if name.endswith(".distcp")], names
    assert proxy.count(lambda method, path: method == "DELETE" and "upload_id=" in path) == 1
