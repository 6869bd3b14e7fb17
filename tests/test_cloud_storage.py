"""CheckpointManager on gs:// and s3://, against real servers on 127.0.0.1.

Every test runs twice: against the ``gcp-storage-emulator`` server (through gcsfs) and against
moto's S3 server (through s3fs). Requests are counted by a forwarding proxy where the test is
about what is sent: listing costs, the commit record written last and create-only, deletion
order, no ``.metadata.tmp`` rename.
"""

from __future__ import annotations

import json
import logging
import tempfile
import uuid
from pathlib import Path

import fsspec
import pytest
from _cloud_servers import (  # noqa: F401  (the *_fixture functions are fixtures)
    FaultProxy,
    Server,
    is_data_upload,
    is_listing,
    proxy_fixture,
    require_cloud_modules,
    root_fixture,
    server_fixture,
)

require_cloud_modules()

from _cloud_state import blank_like, differences, make_state  # noqa: E402
from conftest import checked_torch_only, run_python  # noqa: E402

from ckptmgr import (  # noqa: E402
    CheckpointError,
    CheckpointManager,
    StepNotFoundError,
    remote_filesystem,
    remote_read,
)
from ckptmgr.record import CommitRecord  # noqa: E402
from ckptmgr.storage import AlreadyCommittedError, CheckpointStorage  # noqa: E402

pytestmark = [pytest.mark.cloud, pytest.mark.timeout(240)]
CHILD_TIMEOUT_S = 180.0
TESTS = Path(__file__).resolve().parent  # the children import _cloud_state from here


def manager(root: str, options: dict, **kwargs: object) -> CheckpointManager:
    kwargs.setdefault("chkpt_on_preemption", False)
    return CheckpointManager(root, 1, storage_options=options, **kwargs)  # type: ignore[arg-type]


def restored(mgr: CheckpointManager, step: int) -> dict:
    state = blank_like(make_state(step))
    mgr.restore(step, state)
    return state


def objects_under(server: Server, root: str) -> list[str]:
    """Every object under ``root``, relative to it, read straight from the server."""
    storage = CheckpointStorage(root, server.storage_options())
    return sorted(entry.path for entry in storage.list_files(storage.root))


# -- save, restore, retention ----------------------------------------------------------------------
def test_sync_and_async_saves_restore_bit_exact_and_retention_deletes_old_steps(
    server: Server, root: str
) -> None:
    options = server.storage_options()
    with manager(root, options, max_to_keep=2) as mgr:
        assert mgr.save(1, make_state(1))
        assert mgr.save_async(2, make_state(2))
        assert mgr.save_async(3, make_state(3))
        mgr.join()
        assert mgr.save(4, make_state(4), metrics={"loss": 0.5})
        assert mgr.all_steps() == [3, 4]
        for step in (3, 4):
            assert differences(restored(mgr, step), make_state(step)) == []
        with pytest.raises(StepNotFoundError):
            mgr.restore(1, blank_like(make_state(1)))
    names = objects_under(server, root)
    assert {name.split("/")[0] for name in names} == {"step_000000000003", "step_000000000004"}
    assert "step_000000000004/commit.json" in names
    assert not any(".tmp" in name for name in names), names


def test_another_process_lists_restores_and_commits_and_this_one_sees_it_at_once(
    server: Server, root: str
) -> None:
    options = server.storage_options()
    with manager(root, options, max_to_keep=3) as mgr:
        for step in (10, 20, 30, 40):
            mgr.save_async(step, make_state(step))
        mgr.join()
        assert mgr.all_steps() == [20, 30, 40]
    storage = CheckpointStorage(root, options)
    assert storage.committed_steps() == [20, 30, 40]
    storage.fs.ls(storage.root)  # warm fsspec's listing cache with the current listing
    storage.fs.exists(f"{storage.step_path(50)}/commit.json")
    code = f"""
import json
from _cloud_state import blank_like, differences, make_state
from ckptmgr import CheckpointManager
with CheckpointManager({root!r}, 1, max_to_keep=3, chkpt_on_preemption=False,
                       storage_options={options!r}) as mgr:
    listed = mgr.all_steps()
    found = {{}}
    for step in listed:
        state = blank_like(make_state(step))
        mgr.restore(step, state)
        found[step] = differences(state, make_state(step))
    mgr.save(50, make_state(50))
    print(json.dumps({{"listed": listed, "differences": found, "after": mgr.all_steps()}}))
"""
    result = run_python(code, timeout=CHILD_TIMEOUT_S, cwd=TESTS)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["listed"] == [20, 30, 40]
    assert report["differences"] == {"20": [], "30": [], "40": []}
    assert report["after"] == [30, 40, 50]
    assert storage.committed_steps() == [30, 40, 50]  # despite the warm listing cache
    assert storage.read_record(50).step == 50


def test_a_step_listed_while_another_process_wrote_it_restores_once_committed(
    server: Server, root: str
) -> None:
    """s3fs keeps the listing of each directory of a tree it listed, never replaces it, and
    answers reads from it: step 2, listed here while another process was writing it, kept its
    listing without commit.json, and every read of that record in this process failed ('gone
    (deleted by another process?)'), even from a new manager; retention kept the step for ever.
    """
    options = server.storage_options()
    commit = f"""
import sys
from _cloud_state import make_state
from ckptmgr import CheckpointManager
with CheckpointManager({root!r}, 1, chkpt_on_preemption=False,
                       storage_options={options!r}) as mgr:
    for step in map(int, sys.argv[1:]):
        assert mgr.save(step, make_state(step))
"""
    committed = run_python(commit, "1", timeout=CHILD_TIMEOUT_S, cwd=TESTS)
    assert committed.returncode == 0, committed.stderr[-4000:]
    writer = fsspec.filesystem(
        fsspec.utils.get_protocol(root), skip_instance_cache=True, **options
    )  # another process's upload of step 2 under way: its data there, its record not yet
    writer.pipe_file(f"{root}/step_000000000002/objects-rank00000.json", b"{}")
    with manager(root, options, read_only=True) as reader:
        assert reader.all_steps() == [1]
        committed = run_python(commit, "2", timeout=CHILD_TIMEOUT_S, cwd=TESTS)
        assert committed.returncode == 0, committed.stderr[-4000:]
        state = blank_like(make_state(2))
        assert reader.restore_latest(state) == 2
        assert differences(state, make_state(2)) == []
    with manager(root, options, max_to_keep=1) as mgr:
        assert mgr.save(3, make_state(3))
        assert mgr.all_steps() == [3]


def test_a_store_that_accepts_and_never_answers_fails_the_listing_in_bounded_time(
    server: Server, root: str, proxy: FaultProxy
) -> None:
    """gcsfs handed its requests_timeout (None by default) to aiohttp, which turns aiohttp's own
    timeout off: a listing held by a server that never answered waited for ever (6 minutes
    and on), and RetryConfig's deadline could not end it. s3fs is bounded by botocore's."""
    import threading

    from ckptmgr import RetryConfig

    storage = CheckpointStorage(
        root,
        server.storage_options(proxy.url),
        RetryConfig(deadline_s=1.0, max_backoff_s=0.5),
        create=False,
    )
    outcome: list[BaseException | None] = []

    def list_steps() -> None:
        try:
            storage.committed_steps()
            outcome.append(None)
        except BaseException as exc:  # (whatever it is: recorded for the assertion)
            outcome.append(exc)

    proxy.hold(lambda method, path: True)
    try:
        lister = threading.Thread(target=list_steps, daemon=True)
        lister.start()
        lister.join(90.0)  # 15 s without a byte of the answer, then the deadline: no retry
        assert not lister.is_alive(), "the listing still waits for a server that never answers"
    finally:
        proxy.release(drop=True)
    assert len(outcome) == 1 and isinstance(outcome[0], (OSError, TimeoutError)), outcome


# -- what other tools leave in a bucket ------------------------------------------------------------
def keys_under(server: Server, root: str) -> list[str]:
    """Every key under ``root`` as the store lists it (folder markers too), relative to it."""
    storage = CheckpointStorage(root, server.storage_options(), create=False)
    return sorted(storage._find(storage.root))  # internal: the listing before any filter


def put_object(server: Server, root: str, name: str, data: bytes = b"") -> None:
    storage = CheckpointStorage(root, server.storage_options(), create=False)
    storage.fs.pipe_file(f"{storage.root}/{name}", data)


def test_a_folder_marker_in_a_step_is_swept_and_saving_the_step_works(
    server: Server, root: str
) -> None:
    """A console's "Create folder" marker (a key ending in /) in an uncommitted step: s3fs'
    batch delete dropped the /, so the sweep said it removed it and left it, and every save of
    the step failed at its commit (the marker listed as a file: "not inside its step")."""
    if server.kind == "gcs":
        pytest.skip("the GCS emulator keeps no key ending in / apart from the same key without")
    put_object(server, root, "step_000000000001/sub/")
    assert keys_under(server, root) == ["step_000000000001/sub/"]
    with manager(root, server.storage_options(), leftover_grace_s=0) as mgr:
        assert [key for key in keys_under(server, root) if key.startswith("step_")] == []
        assert mgr.save(1, make_state(1))
        put_object(server, root, "step_000000000001/notes/")  # in a committed step
        assert mgr.save(2, make_state(2))
    storage = CheckpointStorage(root, server.storage_options())
    storage.delete_step(1)
    assert [key for key in keys_under(server, root) if key.startswith("step_000000000001")] == []


def test_object_names_with_pattern_characters_are_deleted_as_they_are(
    server: Server, root: str
) -> None:
    """fs.rm takes a list's names for patterns: deleting a step whose objects included
    "notes[1].txt" deleted "notes1.txt" for it (S3), and left the literal object behind."""
    with manager(root, server.storage_options()) as mgr:
        assert mgr.save(1, make_state(1))
        assert mgr.save(2, make_state(2))
    for name in ("notes[1].txt", "notes1.txt", "a*b", "what?"):
        put_object(server, root, f"step_000000000001/{name}", b"x")
    CheckpointStorage(root, server.storage_options()).delete_step(1)
    assert [key for key in keys_under(server, root) if key.startswith("step_000000000001")] == []
    with manager(root, server.storage_options(), read_only=True) as reader:
        assert reader.all_steps() == [2]


@pytest.mark.parametrize("where", ["after the bucket", "inside the path"])
def test_a_root_with_an_empty_path_segment_is_refused_before_anything_is_written(
    server: Server, root: str, where: str
) -> None:
    """s3://bucket//run was taken: every save uploaded its data, then failed its commit
    ("CorruptCheckpointError('.metadata was written but storage does not hold it')": s3fs
    lists none of what it wrote there) and left the uploads behind. A root with '//' is
    refused when the manager is made, on GCS too (whose keys would begin with '/')."""
    bucket, _, name = root.partition("://")[2].partition("/")
    doubled = f"{server.scheme}://{bucket}//{name}" if where == "after the bucket" else root + "//x"
    with pytest.raises(CheckpointError, match="empty path segment"):
        manager(doubled, server.storage_options())
    bucket_root = f"{server.scheme}://{bucket}"
    assert [key for key in keys_under(server, bucket_root) if name in key] == []


def test_a_missing_bucket_is_named_and_not_created(server: Server) -> None:
    """A root in a bucket that does not exist (a typo): on S3 the manager created the bucket
    (s3fs' makedirs does, with the caller's rights and default settings); on GCS it raised a
    FileNotFoundError whose whole text was the upload's URL. Now neither store gets a bucket,
    and the error says the bucket is missing."""
    url = f"{server.scheme}://no-such-bucket-{uuid.uuid4().hex[:8]}/run"
    with pytest.raises(FileNotFoundError, match="its bucket does not exist"):
        manager(url, server.storage_options())
    storage = CheckpointStorage(server.root("x"), server.storage_options(), create=False)
    assert not storage.fs.exists(url.partition("://")[2].partition("/")[0])


# -- what goes over the wire ----------------------------------------------------------------------
def test_listing_costs_the_same_few_requests_for_2_and_for_8_steps(
    server: Server, root: str, proxy: FaultProxy
) -> None:
    options = server.storage_options(proxy.url)
    costs = {}
    with manager(root, options) as mgr:
        for step in range(8):
            mgr.save(step, make_state(step, size=256))
            if step + 1 not in (2, 8):
                continue
            storage = CheckpointStorage(root, options)
            proxy.clear()
            assert storage.committed_steps() == list(range(step + 1))
            listing = proxy.count()
            proxy.clear()
            assert storage.leftovers() == []
            leftovers = proxy.count()
            proxy.clear()
            with manager(root, options) as other:  # sweep leftovers and list: one listing
                assert other.all_steps() == list(range(step + 1))
            costs[step + 1] = (listing, leftovers, proxy.count(), proxy.count(is_listing))
    print(f"{server.kind}: requests (committed_steps, leftovers, new manager, listings): {costs}")
    assert costs[2] == costs[8], costs
    assert costs[8][:2] == (1, 1), costs
    assert costs[8][2] <= 3 and costs[8][3] == 1, costs


def test_storage_options_reach_the_manager_and_dcp(
    server: Server, root: str, proxy: FaultProxy
) -> None:
    with manager(root, server.storage_options(proxy.url)) as mgr:
        mgr.save(1, make_state(1))
        assert differences(restored(mgr, 1), make_state(1)) == []
    assert proxy.count(is_data_upload) == 1  # DCP's data file went through the proxy too
    assert proxy.count(lambda method, path: method == "GET" and ".distcp" in path) >= 1


def test_the_commit_record_is_the_last_write_and_is_create_only(
    server: Server, root: str, proxy: FaultProxy
) -> None:
    options = server.storage_options(proxy.url)
    with manager(root, options) as mgr:
        proxy.clear()
        mgr.save(5, make_state(5))
    writes = [s for s in proxy.seen if s.method in ("PUT", "POST") and s.status == 200]
    assert len(writes) >= 4, writes  # plain values, data, .metadata, record
    record_writes = [s for s in writes if _names(s.path, "commit.json")]
    assert record_writes == [writes[-1]], [s.path for s in writes]
    if server.kind == "gcs":  # the emulator ignores it; real GCS answers 412 when it exists
        assert "ifGenerationMatch=0" in record_writes[0].path
    paths = " ".join(s.path for s in proxy.seen)
    assert ".metadata.tmp" not in paths and "moveTo" not in paths and "rewriteTo" not in paths

    storage = CheckpointStorage(root, server.storage_options())
    record = storage.read_record(5)
    other = record.model_copy(update={"save_id": "0123456789abcdef"})
    if server.kind == "s3":  # moto honours If-None-Match: *, as S3 does
        with pytest.raises(AlreadyCommittedError):
            storage.commit(5, storage.step_path(5), other)
    storage.commit(5, storage.step_path(5), record)  # the same save's record: a retry that landed
    assert CheckpointStorage(root, options).read_record(5).save_id == record.save_id
    with pytest.raises(AlreadyCommittedError):
        storage.prepare_write_dir(storage.step_path(5))


def test_a_store_without_conditional_writes_commits_after_checking_for_a_record(
    server: Server, root: str, proxy: FaultProxy
) -> None:
    """A store that answers 501 (Not Implemented) to the conditional write of the commit record,
    as S3-compatible servers without conditional writes do, gets a check that no record exists
    and then a plain write: the step commits and restores bit for bit."""

    def record_write(method: str, path: str) -> bool:
        return method in ("PUT", "POST") and _names(path, "commit.json")

    options = server.storage_options(proxy.url)
    with manager(root, options) as mgr:
        proxy.clear()
        proxy.set_faults(sequence=("501",), match=record_write)
        assert mgr.save(5, make_state(5))
        assert mgr.all_steps() == [5]
        assert differences(restored(mgr, 5), make_state(5)) == []
    about_record = [s for s in proxy.seen if _names(s.path, "commit.json")]
    writes = [s for s in about_record if record_write(s.method, s.path)]
    assert [s.status for s in writes] == [501, 200], [(s.method, s.path) for s in about_record]
    between = about_record[about_record.index(writes[0]) + 1 : about_record.index(writes[1])]
    assert any(s.method in ("GET", "HEAD") for s in between), [(s.method, s.path) for s in between]
    if server.kind == "gcs":
        assert "ifGenerationMatch=0" in writes[0].path
        assert "ifGenerationMatch" not in writes[1].path


def _names(path: str, name: str) -> bool:
    return name in path or name.replace(".", "%2E") in path


def test_delete_removes_the_record_first_then_the_data_in_batches(
    server: Server, root: str, proxy: FaultProxy
) -> None:
    options = server.storage_options(proxy.url)
    with manager(root, options, num_of_threads=3) as mgr:
        mgr.save(1, make_state(1))
    storage = CheckpointStorage(root, options)
    proxy.clear()
    storage.delete_step(1)
    deletes = [s for s in proxy.seen if s.method == "DELETE" or "delete" in s.path]
    assert deletes and "commit.json" in deletes[0].path.replace("%2F", "/"), deletes
    if server.kind == "s3":  # one DeleteObjects request for every data object
        assert len(deletes) == 2 and deletes[1].method == "POST", deletes
    assert storage.committed_steps() == []
    assert objects_under(server, root) == []


def test_a_step_whose_data_delete_fails_is_no_longer_listed(
    server: Server, root: str, proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """Its record went first: the step is deleted (f2ccadf: no longer an error, a warning),
    and the next manager's sweep removes its data."""
    options = server.storage_options(proxy.url)
    with manager(root, options) as mgr:
        mgr.save(1, make_state(1))
        mgr.save(2, make_state(2))
    storage = CheckpointStorage(root, options)

    def data_delete(method: str, path: str) -> bool:
        deleting = method == "DELETE" or (method == "POST" and "delete" in path)
        return deleting and "commit.json" not in path.replace("%2F", "/")

    proxy.set_faults(permanent="403", match=data_delete)
    with caplog.at_level(logging.WARNING, logger="ckptmgr.storage"):
        storage.delete_step(1)
    assert "step 1 is deleted (its commit record is gone), but removing its files" in caplog.text
    proxy.set_faults()
    assert storage.committed_steps() == [2]
    assert [leftover.name for leftover in storage.leftovers()] == ["step_000000000001"]
    with manager(root, options, leftover_grace_s=0) as mgr:
        assert mgr.all_steps() == [2]
    assert {name.split("/")[0] for name in objects_under(server, root)} == {"step_000000000002"}


def test_an_interrupted_save_is_cleared_before_the_step_is_written_again(
    server: Server, root: str
) -> None:
    options = server.storage_options()
    storage = CheckpointStorage(root, options)
    stale = f"{storage.step_path(7)}/__0_0.distcp"
    storage.fs.pipe_file(stale, b"half of an old upload")
    unwritten = f"{storage.step_path(7)}/__5_0.distcp"  # (of a run with more ranks)
    storage.fs.pipe_file(unwritten, b"a file this save does not write")
    with manager(root, options) as mgr:  # too young to be swept: stays a leftover
        assert mgr.all_steps() == []
        assert mgr.save(7, make_state(7))
        assert differences(restored(mgr, 7), make_state(7)) == []
    storage.fs.invalidate_cache()
    assert not storage.fs.exists(unwritten)
    record = CommitRecord.from_json(storage.fs.cat_file(f"{storage.step_path(7)}/commit.json"))
    sizes = {entry.path: entry.size for entry in record.files}
    assert sizes["__0_0.distcp"] > len(b"half of an old upload")


def test_data_files_are_sent_whole_through_faults_and_leave_no_temporary_file(
    server: Server,
    root: str,
    proxy: FaultProxy,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """(On GCS and S3 data files never go through the spool: ``test_cloud_uploads.py``; the
    spool's temporary files of other stores: ``test_a_spooled_data_file_...`` there.)"""
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    monkeypatch.setattr(remote_filesystem, "SPOOL_MEMORY_BYTES", 4096)  # a spooled file would spill
    monkeypatch.setattr(tempfile, "tempdir", str(spool_dir))
    proxy.set_faults(sequence=("503", "reset", "503", "reset"), match=is_data_upload)
    with manager(root, server.storage_options(proxy.url), num_of_threads=2) as mgr:
        assert mgr.save(1, make_state(1, size=65536))
        state = blank_like(make_state(1, size=65536))
        mgr.restore(1, state)
        assert differences(state, make_state(1, size=65536)) == []
        record = CheckpointStorage(root, server.storage_options()).read_record(1)
    assert proxy.count(is_data_upload, "forwarded") == 2  # two data files, each sent whole
    assert max(f.size for f in record.files if f.path.endswith(".distcp")) > 4096
    assert list(spool_dir.iterdir()) == []  # spools are removed after the upload


def is_data_read(method: str, path: str) -> bool:
    """A request that reads a DCP data file."""
    return method == "GET" and ".distcp" in path


def test_a_data_file_is_restored_by_ranged_reads_each_retried_on_its_own(
    server: Server, root: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank's data file is read in windows, several at once, straight into the tensors; a
    failed read re-sends its own window, not the file."""
    window = 16384
    monkeypatch.setattr(remote_read, "WINDOW_BYTES", window)
    with manager(root, server.storage_options()) as mgr:
        assert mgr.save(1, make_state(1, size=65536))
    record = CheckpointStorage(root, server.storage_options()).read_record(1)
    sizes = [entry.size for entry in record.files if entry.path.endswith(".distcp")]
    windows = sum(-(-size // window) for size in sizes)
    assert windows >= 16
    proxy.set_faults(sequence=("503", None, None, "reset", "500"), match=is_data_read)
    state = blank_like(make_state(1, size=65536))
    with manager(root, server.storage_options(proxy.url)) as mgr:
        mgr.restore(1, state)
    assert differences(state, make_state(1, size=65536)) == []
    assert proxy.count(is_data_read, "forwarded") == windows
    assert proxy.count(is_data_read) == windows + 3


@checked_torch_only
def test_a_save_asks_the_store_nothing_about_metadata_it_is_about_to_write(
    server: Server, root: str, proxy: FaultProxy
) -> None:
    """Rank 0 listed and cleared the step directory before anyone writes: DCP's check for a
    ``.metadata`` there on every rank, and the check before replacing it, would each cost a
    read and listings (six requests per save on GCS, more per rank)."""
    with manager(root, server.storage_options(proxy.url)) as mgr:
        proxy.clear()
        assert mgr.save(1, make_state(1))
        asked = [
            s.path for s in proxy.seen if s.method in ("GET", "HEAD") and ".metadata" in s.path
        ]
        assert asked == []
        assert differences(restored(mgr, 1), make_state(1)) == []


def test_deep_verify_reads_data_files_by_ranged_reads_and_finds_a_flipped_bit(
    server: Server, root: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    window = 16384
    monkeypatch.setattr(remote_read, "WINDOW_BYTES", window)
    with manager(root, server.storage_options()) as mgr:
        assert mgr.save(1, make_state(1, size=65536))
    storage = CheckpointStorage(root, server.storage_options())
    record = storage.read_record(1)
    (data,) = [entry for entry in record.files if entry.path.endswith(".distcp")]
    with manager(root, server.storage_options(proxy.url)) as mgr:
        proxy.clear()
        mgr.verify(1, deep=True)
        assert proxy.count(is_data_read) == -(-data.size // window)
        path = f"{storage.step_path(1)}/{data.path}"
        damaged = bytearray(storage.fs.cat_file(path))
        damaged[data.size // 2] ^= 0x01
        storage.fs.pipe_file(path, bytes(damaged))
        mgr.verify(1)  # the same size: only the deep check reads the bytes
        with pytest.raises(CheckpointError, match=r"distcp has CRC-32") as caught:
            mgr.verify(1, deep=True)
        assert getattr(caught.value, "path", None) == data.path
