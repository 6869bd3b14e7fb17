"""How data files reach the store: uploaded while they are written, on GCS and on S3.

Against the GCS emulator and moto's S3 server on 127.0.0.1, through the counting proxy. A data
file larger than one chunk goes as a resumable upload (GCS) or a multipart upload with parts
sent at once (S3) while DCP writes it: no temporary file; an upload that fails is cancelled and
the file written again; one that keeps failing leaves no object. Small files are one request.
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

from ckptmgr import CheckpointError, CheckpointManager, remote_filesystem, remote_write  # noqa: E402
from ckptmgr.storage import CheckpointStorage  # noqa: E402

pytestmark = [pytest.mark.cloud, pytest.mark.timeout(240)]
CHUNK = {"gcs": 256 * 1024, "s3": 5 * 2**20}  # the smallest chunk (GCS) and part (S3)


def state_of(seed: int, numel: int) -> dict[str, torch.Tensor]:
    """One data file of ``numel`` float32 values and a few small tensors."""
    generator = torch.Generator().manual_seed(seed)
    state = {"large": torch.randn(numel, generator=generator)}
    state.update({f"small{i}": torch.randn(100, generator=generator) for i in range(5)})
    return state


def large(server: Server) -> int:
    """Values of a data file of four and a half chunks."""
    return CHUNK[server.kind] * 9 // 2 // 4


def is_chunk(method: str, path: str) -> bool:
    """A chunk of a resumable GCS upload, or a part of an S3 multipart upload, of a data file."""
    return (
        method in ("POST", "PUT")
        and ".distcp" in path
        and ("upload_id=" in path or "partNumber=" in path)
    )


def is_upload_start(method: str, path: str) -> bool:
    """The request that starts a data file's upload (or sends it whole)."""
    return is_data_upload(method, path) and "upload_id=" not in path and "uploadId=" not in path


def is_second_part(method: str, path: str) -> bool:
    """Part 2 of an S3 multipart upload of a data file."""
    return is_chunk(method, path) and "partNumber=2&" in f"{path}&"


def is_cancel(method: str, path: str) -> bool:
    """A cancelled upload: GCS's delete of the upload session, S3's abort."""
    return method == "DELETE" and ("upload_id=" in path or "uploadId=" in path)


def record_temporary_files(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths of the temporary files ``tempfile.mkstemp`` makes from now on."""
    made: list[str] = []
    mkstemp = tempfile.mkstemp

    def recording(*args: Any, **kwargs: Any) -> tuple[int, str]:
        fd, path = mkstemp(*args, **kwargs)
        made.append(path)
        return fd, path

    monkeypatch.setattr(tempfile, "mkstemp", recording)
    return made


@pytest.fixture(name="spools")
def spools_fixture(server: Server, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Temporary spool files made (a small spool limit and chunk, so that a data file of a
    few chunks would need either)."""
    made = record_temporary_files(monkeypatch)
    monkeypatch.setattr(remote_filesystem, "SPOOL_MEMORY_BYTES", 64 * 1024)
    monkeypatch.setattr(remote_write, "UPLOAD_CHUNK_BYTES", CHUNK[server.kind])
    monkeypatch.setattr(remote_write, "PARTS_IN_FLIGHT", 2)
    return made


def manager(root: str, options: dict[str, Any]) -> CheckpointManager:
    return CheckpointManager(root, 1, storage_options=options, chkpt_on_preemption=False)


def restores_bit_exact(mgr: CheckpointManager, step: int, numel: int) -> bool:
    state = {name: torch.zeros_like(value) for name, value in state_of(step, numel).items()}
    mgr.restore(step, state)
    return all(torch.equal(state[name], value) for name, value in state_of(step, numel).items())


def test_a_large_data_file_is_uploaded_in_chunks_while_written(
    server: Server, root: str, proxy: FaultProxy, spools: list[str]
) -> None:
    numel = large(server)
    with manager(root, server.storage_options(proxy.url)) as mgr:
        assert mgr.save(1, state_of(1, numel))
        assert restores_bit_exact(mgr, 1, numel)
    assert spools == []  # nothing through local disk
    assert proxy.count(is_upload_start) == 1
    assert proxy.count(is_chunk) == 5  # four and a half chunks
    assert proxy.count(is_cancel) == 0


def test_a_small_data_file_is_one_request(
    server: Server, root: str, proxy: FaultProxy, spools: list[str]
) -> None:
    with manager(root, server.storage_options(proxy.url)) as mgr:
        assert mgr.save(1, state_of(1, numel=10_000))
        assert restores_bit_exact(mgr, 1, 10_000)
    assert proxy.count(is_data_upload) == 1
    assert spools == []


def test_a_failed_upload_is_cancelled_and_the_file_written_again(
    server: Server,
    root: str,
    proxy: FaultProxy,
    spools: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    numel = large(server)
    monkeypatch.setattr(remote_write, "PARTS_IN_FLIGHT", 1)  # (the faults hit one part)
    # a chunk refused as often as the request level tries: the upload fails, and is retried
    proxy.set_faults(sequence=("503", "503", "503"), match=is_chunk)
    with manager(root, server.storage_options(proxy.url)) as mgr:
        assert mgr.save(1, state_of(1, numel))
        proxy.set_faults()
        assert restores_bit_exact(mgr, 1, numel)
    assert proxy.count(is_upload_start) == 2  # the file written twice
    assert proxy.count(is_cancel) == 1
    assert spools == []


def test_an_upload_that_keeps_failing_fails_the_save_and_leaves_no_data_object(
    server: Server, root: str, proxy: FaultProxy, spools: list[str]
) -> None:
    numel = large(server)
    with manager(root, server.storage_options(proxy.url)) as mgr:
        assert mgr.save(1, state_of(1, numel))
        proxy.set_faults(permanent="403", match=is_chunk)
        with pytest.raises(CheckpointError, match="save of step 2 failed"):
            mgr.save(2, state_of(2, numel))
        proxy.set_faults()
        assert mgr.all_steps() == [1]
        assert restores_bit_exact(mgr, 1, numel)
    storage = CheckpointStorage(root, server.storage_options())
    names = [entry.path for entry in storage.list_files(storage.step_path(2))]
    assert not [name for name in names if name.endswith(".distcp")], names
    assert proxy.count(is_cancel) == 1


def test_s3_parts_are_sent_at_once(
    server: Server, root: str, proxy: FaultProxy, spools: list[str]
) -> None:
    if server.kind != "s3":
        pytest.skip("a GCS resumable upload takes its chunks one after the other")
    numel = large(server)
    with manager(root, server.storage_options(proxy.url)) as mgr:
        proxy.hold(is_chunk)
        try:
            assert mgr.save_async(1, state_of(1, numel))
            # the second part (of PARTS_IN_FLIGHT) is sent before the first is answered
            assert proxy.wait_for(is_second_part, 1, timeout=30)
        finally:
            proxy.release()
        mgr.join()
        assert mgr.all_steps() == [1]
        assert restores_bit_exact(mgr, 1, numel)


def test_a_spooled_data_file_of_another_store_spills_to_a_temporary_file_then_removed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """Stores other than GCS and S3 (here fsspec's memory://) keep the spool: memory up to
    ``SPOOL_MEMORY_BYTES``, then a temporary file, removed after the upload."""
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    made = record_temporary_files(monkeypatch)
    monkeypatch.setattr(tempfile, "tempdir", str(spool_dir))
    monkeypatch.setattr(remote_filesystem, "SPOOL_MEMORY_BYTES", 64 * 1024)
    with manager(f"memory://spool-{tmp_path.name}", {}) as mgr:
        assert mgr.save(1, state_of(1, 100_000))
        assert restores_bit_exact(mgr, 1, 100_000)
    assert len(made) == 1 and made[0].startswith(str(spool_dir))
    assert list(spool_dir.iterdir()) == []


def test_the_checkpoint_daemon_uploads_while_writing_too(
    server: Server, root: str, proxy: FaultProxy
) -> None:
    """``async_mode="process"``: the daemon writes and uploads (at the default chunk size: it
    is a process of its own), and its steps restore bit-exact."""
    numel = remote_write.UPLOAD_CHUNK_BYTES * 5 // 4 // 4  # a chunk and a quarter
    with CheckpointManager(
        root,
        1,
        storage_options=server.storage_options(proxy.url),
        chkpt_on_preemption=False,
        async_mode="process",
    ) as mgr:
        for step in (1, 2):
            assert mgr.save_async(step, state_of(step, numel))
            mgr.join()
        assert mgr.all_steps() == [1, 2]
        assert restores_bit_exact(mgr, 2, numel)
    assert proxy.count(is_upload_start) == 2
    assert proxy.count(is_chunk) == 4  # two chunks of each step's data file
