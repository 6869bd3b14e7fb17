"""Checksums in the commit record, verify, restore_latest with quarantine, and safe loading.

Every test damages real files (bit flips, truncation, deletion, crafted pickles) and checks that
ckptmgr notices, names the file, and never runs code from the checkpoint.
"""

from __future__ import annotations

import functools
import json
import pathlib
import pickle
import subprocess
import sys
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import torch
from _dist_worker import FLAKY_PROTOCOL, FlakyLocalFileSystem
from conftest import REPO, run_python

from ckptmgr import (
    CheckpointError,
    CheckpointManager,
    CorruptCheckpointError,
    StepNotFoundError,
    cli,
)
from ckptmgr.record import CommitRecord, record_bytes
from ckptmgr.storage import CheckpointStorage, step_dir_name

N = 4096


def state_of(step: int) -> dict[str, object]:
    """A state whose values depend on ``step``."""
    return {
        "w": torch.arange(N, dtype=torch.float32) + step,
        "b": torch.full((7,), float(step)),
        "progress": {"step": step, "name": f"run-{step}"},
    }


def empty_state() -> dict[str, object]:
    """A state to restore into (every value differs from any saved one)."""
    return {"w": torch.zeros(N), "b": torch.zeros(7), "progress": {"step": -1, "name": ""}}


def assert_state_of(state: dict[str, object], step: int) -> None:
    expected = state_of(step)
    assert torch.equal(state["w"], expected["w"])  # type: ignore[arg-type]
    assert torch.equal(state["b"], expected["b"])  # type: ignore[arg-type]
    assert state["progress"] == expected["progress"]


def manager(root: str) -> CheckpointManager:
    return CheckpointManager(root, 1, chkpt_on_preemption=False)


@pytest.fixture(params=["local", "memory", "directories"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A checkpoint root on local disk (DCP's FileSystemWriter), in memory (the fsspec path
    through RetryingFileSystem, as for gs:// and s3://), or on the local disk behind another
    protocol (that path on a file system of real directories, as SFTP or HDFS)."""
    if request.param == "local":
        yield str(tmp_path / "ckpts")
        return
    if request.param == "directories":
        fsspec.register_implementation(FLAKY_PROTOCOL, FlakyLocalFileSystem, clobber=True)
        yield f"{FLAKY_PROTOCOL}://{tmp_path / 'ckpts'}"
        return
    name = f"/integrity-{uuid.uuid4().hex}"
    yield f"memory://{name}"
    fs = fsspec.filesystem("memory")
    if fs.exists(name):
        fs.rm(name, recursive=True)


def step_file(root: str, step: int, name: str) -> str:
    storage = CheckpointStorage(root)
    return storage.path(step_dir_name(step), name)


def read(root: str, step: int, name: str) -> bytes:
    storage = CheckpointStorage(root)
    return storage.fs.cat_file(step_file(root, step, name))


def write(root: str, step: int, name: str, data: bytes) -> None:
    storage = CheckpointStorage(root)
    storage.fs.pipe_file(step_file(root, step, name), data)


def flip_bit(root: str, step: int, name: str, offset: int | None = None) -> None:
    data = bytearray(read(root, step, name))
    index = len(data) // 2 if offset is None else offset
    data[index] ^= 0x10
    write(root, step, name, bytes(data))


def distcp_name(root: str, step: int) -> str:
    return next(f.path for f in record_of(root, step).files if f.path.endswith(".distcp"))


def record_of(root: str, step: int) -> CommitRecord:
    return CheckpointStorage(root).read_record(step)


# -- checksums in the record -----------------------------------------------------------------


def test_crc32_is_zlibs_in_any_pieces_and_any_buffer() -> None:
    """ckptmgr's CRC-32 (zlib-ng's, a dependency) gives zlib's values: whole, continued piece
    by piece, over a tensor's memory and over nothing."""
    import os

    from ckptmgr import integrity

    pytest.importorskip("zlib_ng")
    assert integrity._CRC32.__module__ == "zlib_ng.zlib_ng"
    data = os.urandom(3 * 2**20 + 17)
    assert integrity.crc32(data) == zlib.crc32(data)
    crc = 0
    for start in range(0, len(data), 1 << 18):
        crc = integrity.crc32(memoryview(data)[start : start + (1 << 18)], crc)
    assert crc == zlib.crc32(data)
    tensor = torch.randn(1000)
    view = memoryview(tensor.numpy())
    assert integrity.crc32(view) == zlib.crc32(view) == zlib.crc32(tensor.numpy().tobytes())
    assert integrity.crc32(b"") == 0 and integrity.crc32(b"", 12345) == 12345
    assert integrity.crc32(b"def", zlib.crc32(b"abc")) == zlib.crc32(b"abcdef")


def test_without_zlib_ng_the_checksums_are_zlibs_and_a_step_round_trips(tmp_path: Path) -> None:
    """Where zlib-ng cannot be imported, ckptmgr falls back to zlib: a save and a restore
    that checks every file work, with the same checksums."""
    code = f"""
import sys, zlib
sys.modules["zlib_ng"] = None  # (import zlib_ng raises ImportError)
import torch
from ckptmgr import CheckpointManager, integrity
assert integrity._CRC32 is zlib.crc32
with CheckpointManager({str(tmp_path)!r}, 1, chkpt_on_preemption=False) as mgr:
    mgr.save(1, {{"w": torch.arange(100.0), "b": torch.ones(3)}})
    target = {{"w": torch.zeros(100), "b": torch.zeros(3)}}
    mgr.restore(1, target)
    assert torch.equal(target["w"], torch.arange(100.0))
    mgr.verify(1, deep=True)  # (raises on damage)
print("ok")
"""
    result = run_python(code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
    with manager(str(tmp_path)) as mgr:  # (read where zlib-ng is)
        target = {"w": torch.zeros(100), "b": torch.zeros(3)}
        mgr.restore(1, target)
        assert torch.equal(target["b"], torch.ones(3))
        mgr.verify(1, deep=True)  # (raises on damage)


@pytest.mark.parametrize("use_async", [False, True])
def test_record_lists_every_file_with_its_size_and_crc32(root: str, use_async: bool) -> None:
    with manager(root) as mgr:
        if use_async:
            mgr.save_async(3, state_of(3))
            mgr.join()
        else:
            mgr.save(3, state_of(3))
    record = record_of(root, 3)
    names = {entry.path for entry in record.files}
    assert {".metadata", "objects-rank00000.json"} <= names
    assert any(name.endswith(".distcp") for name in names)
    for entry in record.files:
        data = read(root, 3, entry.path)
        assert entry.size == len(data)
        assert entry.crc32 == zlib.crc32(data), entry.path
    raw = json.loads(read(root, 3, "commit.json"))
    assert all(isinstance(entry["crc32"], int) for entry in raw["files"])


def test_records_without_checksums_still_restore_and_verify(root: str) -> None:
    with manager(root) as mgr:
        mgr.save(5, state_of(5))
    raw = json.loads(read(root, 5, "commit.json"))
    for entry in raw["files"]:
        del entry["crc32"]  # as written before ckptmgr stored checksums
    write(root, 5, "commit.json", record_bytes(raw))
    with manager(root) as mgr:
        mgr.verify(5, deep=True)
        state = empty_state()
        mgr.restore(5, state)
        assert_state_of(state, 5)


# -- verify ------------------------------------------------------------------------------------


def test_verify_checks_sizes_and_with_deep_checksums(root: str) -> None:
    with manager(root) as mgr:
        mgr.save(1, state_of(1))
        mgr.verify(1)
        mgr.verify(1, deep=True)
        name = distcp_name(root, 1)
        flip_bit(root, 1, name)
        mgr.verify(1)  # same size: the fast check cannot see a flipped bit
        with pytest.raises(CorruptCheckpointError, match="CRC-32") as caught:
            mgr.verify(1, deep=True)
        assert caught.value.path == name and caught.value.step == 1
        assert isinstance(caught.value, CheckpointError)


def test_verify_names_truncated_and_missing_files(root: str) -> None:
    with manager(root) as mgr:
        mgr.save(1, state_of(1))
        data = read(root, 1, "objects-rank00000.json")
        write(root, 1, "objects-rank00000.json", data[:-3])
        CheckpointStorage(root).fs.rm_file(step_file(root, 1, ".metadata"))
        with pytest.raises(CorruptCheckpointError) as caught:
            mgr.verify(1)
        message = str(caught.value)
        assert ".metadata missing" in message
        assert f"objects-rank00000.json has {len(data) - 3} bytes" in message
        with pytest.raises(StepNotFoundError):
            mgr.verify(2)


# -- restore checks what it reads -------------------------------------------------------------


@pytest.mark.parametrize("target", ["distcp", ".metadata", "objects-rank00000.json"])
def test_restore_detects_a_flipped_bit_and_names_the_file(root: str, target: str) -> None:
    with manager(root) as mgr:
        mgr.save(2, state_of(2))
        name = distcp_name(root, 2) if target == "distcp" else target
        flip_bit(root, 2, name)
        state = empty_state()
        with pytest.raises(CorruptCheckpointError, match=name.replace(".", r"\.")) as caught:
            mgr.restore(2, state)
        assert caught.value.path == name
        assert caught.value.step == 2


def test_restore_checks_the_size_of_every_file_even_unread_ones(root: str) -> None:
    with manager(root) as mgr:
        mgr.save(2, state_of(2))
        # A file this restore would never open: sizes of every file are checked anyway.
        write(root, 2, "objects-rank00007.json", b"{}")
        raw = json.loads(read(root, 2, "commit.json"))
        raw["files"].append({"path": "objects-rank00007.json", "size": 2})
        write(root, 2, "commit.json", record_bytes(raw))
        mgr.restore(2, empty_state())
        write(root, 2, "objects-rank00007.json", b"{")
        with pytest.raises(CorruptCheckpointError, match=r"objects-rank00007\.json has 1 bytes"):
            mgr.restore(2, empty_state())


# -- the record's own checksum (format 3) --------------------------------------------------------
def test_every_single_bit_flip_in_a_record_is_refused(tmp_path: Path) -> None:
    """A record ends with ``record_crc32``, the CRC-32 of its bytes before it: a flipped bit
    anywhere, which may leave valid JSON naming other tensors, shapes or offsets (format 3 names
    each tensor once), makes the record damaged."""
    root = str(tmp_path / "ckpts")
    with manager(root) as mgr:
        mgr.save(1, state_of(1), metrics={"loss": 0.5})
    data = read(root, 1, "commit.json")
    assert data.endswith(b'"record_crc32": %d\n}' % zlib.crc32(data[: data.rindex(b",")]))
    CommitRecord.from_json(data)
    for index in range(len(data)):
        for bit in (0, 5):
            damaged = bytearray(data)
            damaged[index] ^= 1 << bit
            with pytest.raises(ValueError):
                CommitRecord.from_json(bytes(damaged))


@pytest.mark.parametrize(
    "edit",
    ["no checksum", "bytes after it", "not a number", "truncated", "rewritten as json.dumps"],
)
def test_a_record_not_ending_with_its_checksum_is_refused(tmp_path: Path, edit: str) -> None:
    root = str(tmp_path / "ckpts")
    with manager(root) as mgr:
        mgr.save(1, state_of(1))
    data = read(root, 1, "commit.json")
    at = data.rindex(b",")
    if edit == "no checksum":
        damaged = data[:at] + b"\n}"
    elif edit == "bytes after it":
        damaged = data + b"\n"
    elif edit == "not a number":
        damaged = data[:-2] + b".0\n}"
    elif edit == "truncated":
        damaged = data[: len(data) // 2]
    else:
        damaged = json.dumps(json.loads(data)).encode()  # same content, other bytes
    if edit == "rewritten as json.dumps":
        assert json.loads(damaged) == json.loads(data)
    with pytest.raises(ValueError, match="Invalid JSON" if edit == "truncated" else "record_crc32"):
        CommitRecord.from_json(damaged)
    assert CommitRecord.from_json(record_bytes(json.loads(data))) == CommitRecord.from_json(data)


def test_a_tensor_renamed_in_the_record_is_damage_that_restore_latest_quarantines(
    root: str,
) -> None:
    """A bit flip that renames a packed tensor (found by the fuzz test: ``model/w`` became
    ``model/v``) reads as a valid table, and restore then said the state's key is missing from
    the checkpoint, a user error that restore_latest raised instead of falling back."""
    with manager(root) as mgr:
        mgr.save(1, state_of(1))
        mgr.save(2, state_of(2))
    data = read(root, 2, "commit.json")
    at = data.index(b'"names": ["') + len(b'"names": ["')
    assert data[at : at + 1] in (b"w", b"b")
    damaged = bytearray(data)
    damaged[at] ^= 0x01  # "w" -> "v", "b" -> "c"
    write(root, 2, "commit.json", bytes(damaged))
    with manager(root) as mgr:
        with pytest.raises(CorruptCheckpointError, match=r"commit record .* is damaged"):
            mgr.restore(2, empty_state())
        state = empty_state()
        assert mgr.restore_latest(state) == 1
        assert_state_of(state, 1)
    assert CheckpointStorage(root).quarantined_steps() == [2]


# -- restore_latest and quarantine ------------------------------------------------------------


def test_restore_latest_quarantines_a_damaged_step_and_restores_the_next_older(root: str) -> None:
    with manager(root) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, state_of(step))
        flip_bit(root, 30, distcp_name(root, 30))
        write(root, 20, "objects-rank00000.json", b"")  # truncated
        state = empty_state()
        assert mgr.restore_latest(state) == 10
        assert_state_of(state, 10)
        assert mgr.all_steps() == [10]
        assert mgr.latest_step() == 10
    storage = CheckpointStorage(root)
    assert storage.committed_steps() == [10]
    assert storage.quarantined_steps() == [20, 30]
    marker = json.loads(read(root, 30, "quarantined.json"))
    assert marker["step"] == 30 and "CRC-32" in marker["reason"]
    with manager(root) as mgr:  # a new manager never lists them either
        assert mgr.all_steps() == [10]
        state = empty_state()
        assert mgr.restore_latest(state) == 10
        with pytest.raises(StepNotFoundError):
            mgr.restore(30, state)


def test_quarantined_steps_survive_retention_and_a_new_save_moves_them_aside(root: str) -> None:
    with CheckpointManager(root, 1, max_to_keep=1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, state_of(1))
        mgr.save(2, state_of(2))
        assert mgr.all_steps() == [2]
        flip_bit(root, 2, ".metadata")
        assert mgr.restore_latest(empty_state()) is None
        assert mgr.all_steps() == []
        for step in (3, 4, 5):
            mgr.save(step, state_of(step))
        assert mgr.all_steps() == [5]
        storage = CheckpointStorage(root)
        assert storage.quarantined_steps() == [2]  # retention never deleted it
        mgr.save(2, state_of(2), force=True)  # the same step again: the damaged one moves aside
        assert 2 in mgr.all_steps()
        state = empty_state()
        mgr.restore(2, state)
        assert_state_of(state, 2)
    quarantined = storage.quarantined()
    assert [q.step for q in quarantined] == [2]
    assert quarantined[0].name.startswith("step_000000000002.quarantined-")
    assert ".metadata" in quarantined[0].reason
    assert storage.leftovers() == []  # not a leftover: the sweep never removes it


def test_restore_latest_raises_state_mismatches_without_quarantining(root: str) -> None:
    with manager(root) as mgr:
        mgr.save(1, state_of(1))
        with pytest.raises(CheckpointError) as caught:
            mgr.restore_latest({"not_in_checkpoint": torch.zeros(2)})
        assert not isinstance(caught.value, CorruptCheckpointError)
        assert mgr.all_steps() == [1]
        assert CheckpointStorage(root).quarantined_steps() == []


def test_restore_latest_returns_none_without_steps(root: str) -> None:
    with manager(root) as mgr:
        assert mgr.restore_latest(empty_state()) is None


def test_restore_latest_quarantines_an_unparseable_record(root: str) -> None:
    with manager(root) as mgr:
        mgr.save(1, state_of(1))
        mgr.save(2, state_of(2))
        write(root, 2, "commit.json", b'{"format_version": 1, "step": ')
        state = empty_state()
        assert mgr.restore_latest(state) == 1
        assert_state_of(state, 1)
    assert CheckpointStorage(root).quarantined_steps() == [2]


def reader(root: str) -> CheckpointManager:
    return CheckpointManager(root, 1, chkpt_on_preemption=False, read_only=True)


def step_exists(root: str, step: int) -> bool:
    storage = CheckpointStorage(root)
    return bool(storage.fs.exists(storage.step_path(step)))


def test_restore_latest_of_a_reader_finds_the_writers_newer_steps(root: str) -> None:
    """A read_only manager opened while step 1 was the newest restores the writer's step 2,
    though the writer's retention deleted step 1 since (the reader used to fail on step 1's
    missing commit record)."""
    with CheckpointManager(root, 1, max_to_keep=1, chkpt_on_preemption=False) as writer:
        writer.save(1, state_of(1))
        with reader(root) as follower:
            assert follower.all_steps() == [1]
            writer.save(2, state_of(2))
            assert not step_exists(root, 1)
            state = empty_state()
            assert follower.restore_latest(state) == 2
            assert_state_of(state, 2)
            assert follower.all_steps() == [2]
    assert not step_exists(root, 1)
    assert CheckpointStorage(root).quarantined_steps() == []


def deleted_once_its_record_is_read(monkeypatch: pytest.MonkeyPatch, doomed: int) -> list[int]:
    """Make ``doomed`` be deleted (as by another job's retention) once its commit record is read,
    before its files are (which a remote restore starts reading right after the record), once;
    the list returned then holds it."""
    original_read_record = CheckpointStorage.read_record
    deleted: list[int] = []

    def read_record_then_a_deletion(self: CheckpointStorage, step: int) -> CommitRecord:
        record = original_read_record(self, step)
        if step == doomed and not deleted:
            deleted.append(step)
            self.fs.rm(self.step_path(step), recursive=True)
        return record

    monkeypatch.setattr(CheckpointStorage, "read_record", read_record_then_a_deletion)
    return deleted


@pytest.mark.parametrize("call", ["restore", "verify"])
def test_a_step_deleted_while_it_is_read_is_not_found_not_damaged(
    root: str, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """A step another job deleted while restore or verify read it (an evaluator reading with
    read_only beside the training job) raised CorruptCheckpointError ("step 1 is damaged: ...
    missing") or DCP's errors: a false alarm of damage. StepNotFoundError says it is gone."""
    with manager(root) as mgr:
        for step in (1, 2):
            mgr.save(step, state_of(step))
    deleted = deleted_once_its_record_is_read(monkeypatch, 2)
    with reader(root) as follower:
        with pytest.raises(StepNotFoundError, match=r"step 2 \(it was deleted while it was be"):
            if call == "restore":
                follower.restore(2, empty_state())
            else:
                follower.verify(2, deep=True)
        assert deleted == [2]
        if call == "restore":
            assert follower.all_steps() == [1]
    assert CheckpointStorage(root).quarantined_steps() == []


def test_a_step_deleted_while_restore_latest_reads_it_is_skipped_not_quarantined(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When another job deletes the step being restored, restore_latest goes on to the next
    step; it does not take the missing files for damage and writes no quarantine marker into
    the deleted step (which would bring back its directory)."""
    with manager(root) as mgr:
        for step in (1, 2):
            mgr.save(step, state_of(step))
    deleted = deleted_once_its_record_is_read(monkeypatch, 2)
    with manager(root) as mgr:
        state = empty_state()
        assert mgr.restore_latest(state) == 1
        assert_state_of(state, 1)
        assert mgr.all_steps() == [1]
    assert deleted == [2]
    assert not step_exists(root, 2)
    assert CheckpointStorage(root).quarantined_steps() == []


def test_restore_latest_quarantines_nothing_where_the_listing_after_a_failure_fails(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step deleted while restore_latest read it, and then storage's listing failing: whether
    the step is gone or damaged is not known, so the listing's error is raised and nothing is
    quarantined (a marker written into the deleted step would bring its directory back)."""
    with manager(root) as mgr:
        for step in (1, 2):
            mgr.save(step, state_of(step))
    deleted = deleted_once_its_record_is_read(monkeypatch, 2)
    original_committed_steps = CheckpointStorage.committed_steps

    def listing_fails_after_the_deletion(self: CheckpointStorage) -> list[int]:
        if deleted:
            raise OSError("injected: the listing failed")
        return original_committed_steps(self)

    monkeypatch.setattr(CheckpointStorage, "committed_steps", listing_fails_after_the_deletion)
    with manager(root) as mgr:
        with pytest.raises(CheckpointError, match="could not list the steps"):
            mgr.restore_latest(empty_state())
        assert mgr._damaged == set()
    monkeypatch.undo()
    assert not step_exists(root, 2)
    assert CheckpointStorage(root).quarantined_steps() == []


def test_a_read_only_restore_latest_skips_a_damaged_step_without_marking_it(root: str) -> None:
    """read_only writes nothing to storage: a damaged step is skipped and no longer listed by
    that manager, but not quarantined in storage."""
    with manager(root) as mgr:
        for step in (1, 2):
            mgr.save(step, state_of(step))
    flip_bit(root, 2, distcp_name(root, 2))
    with reader(root) as follower:
        for _ in range(2):
            state = empty_state()
            assert follower.restore_latest(state) == 1
            assert_state_of(state, 1)
            assert follower.all_steps() == [1]
    storage = CheckpointStorage(root)
    assert storage.committed_steps() == [1, 2]
    assert storage.quarantined_steps() == []


# -- safe loading ------------------------------------------------------------------------------


class Payload:
    """Unpickling this would create a file: proof that code ran."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self) -> tuple[object, ...]:
        return (Path.touch, (Path(self.target),))


def forge(root: str, step: int, name: str, data: bytes, *, fix_record: bool) -> None:
    """Replace ``name``; with ``fix_record`` also forge its size and CRC-32 in the record, as an
    attacker who controls the bucket would."""
    write(root, step, name, data)
    if not fix_record:
        return
    raw = json.loads(read(root, step, "commit.json"))
    for entry in raw["files"]:
        if entry["path"] == name:
            entry["size"], entry["crc32"] = len(data), zlib.crc32(data)
    write(root, step, "commit.json", record_bytes(raw))


# GLOBAL pathlib.PurePosixPath, then BUILD with slot state {"with_name": OrderedDict}: pickle's
# BUILD sets attributes of the object below it, here a class of this process.
CLASS_CHANGING_METADATA = (
    b"cpathlib\nPurePosixPath\n(N}(Vwith_name\nccollections\nOrderedDict\nutb."
)


def test_crafted_metadata_changes_no_class_of_the_process(root: str) -> None:
    """A .metadata (its size and CRC forged in the record too) whose BUILD would set an
    attribute of a class the restricted unpickler hands out is refused, and the class is
    unchanged. The restore was refused, but PurePosixPath.with_name (every pathlib.Path's) was
    OrderedDict from then on."""
    with_name = pathlib.PurePosixPath.with_name
    try:
        with manager(root) as mgr:
            mgr.save(1, state_of(1))
            forge(root, 1, ".metadata", CLASS_CHANGING_METADATA, fix_record=True)
            with pytest.raises(CorruptCheckpointError, match="refusing to set attributes"):
                mgr.restore(1, empty_state())
        assert pathlib.PurePosixPath.with_name is with_name
    finally:
        pathlib.PurePosixPath.with_name = with_name  # type: ignore[method-assign]
    assert pathlib.PurePosixPath("/a/b.txt").with_name("c.txt") == pathlib.PurePosixPath("/a/c.txt")


@pytest.mark.parametrize("fix_record", [False, True])
def test_crafted_metadata_runs_nothing(root: str, tmp_path: Path, fix_record: bool) -> None:
    proof = tmp_path / "code-ran"
    with manager(root) as mgr:
        mgr.save(1, state_of(1))
        forge(root, 1, ".metadata", pickle.dumps(Payload(str(proof))), fix_record=fix_record)
        with pytest.raises(CorruptCheckpointError) as caught:
            mgr.restore(1, empty_state())
        if fix_record:
            assert "refusing to load pathlib.Path.touch" in str(caught.value) or "refusing" in str(
                caught.value
            )
        with pytest.raises(CorruptCheckpointError):
            mgr.verify(1, deep=True)
    assert not proof.exists()


def test_crafted_tensor_bytes_are_data_and_run_nothing(root: str, tmp_path: Path) -> None:
    """A pickle put in a data file (with a matching record) is read as tensor bytes: format 2
    data files are raw bytes, never unpickled. (Format 1 is covered in test_tensor_format.)"""
    proof = tmp_path / "code-ran"
    with manager(root) as mgr:
        mgr.save(1, state_of(1))
        name = distcp_name(root, 1)
        evil = pickle.dumps(Payload(str(proof)))
        crafted = evil + b"\0" * max(0, len(read(root, 1, name)) - len(evil))
        forge(root, 1, name, crafted, fix_record=True)
        state = empty_state()
        mgr.restore(1, state)
    assert not proof.exists()
    w, b = (bytes(state[key].untyped_storage()) for key in ("w", "b"))  # type: ignore[attr-defined]
    assert crafted in (w + b, b + w)


def test_crafted_objects_file_is_refused(root: str) -> None:
    with manager(root) as mgr:
        mgr.save(1, state_of(1))
        forge(root, 1, "objects-rank00000.json", b"[1, 2]", fix_record=True)
        with pytest.raises(CorruptCheckpointError, match="not a JSON object"):
            mgr.restore(1, empty_state())


@pytest.mark.parametrize(
    "value",
    [
        '{"__ckptmgr__": "dict", "items": [[{"a": 1}, 1]]}',  # an unhashable key
        '{"__ckptmgr__": "float"}',  # a field missing
        '{"__ckptmgr__": "int", "hex": "zz"}',
        '{"__ckptmgr__": "tuple", "items": 5}',
        '{"__ckptmgr__": "nothing we write"}',
    ],
    ids=["unhashable key", "missing field", "bad hex", "items no list", "unknown tag"],
)
def test_a_plain_value_ckptmgr_never_writes_is_damage_and_restore_latest_falls_back(
    root: str, value: str
) -> None:
    """Crafted plain values raised Python's bare KeyError, TypeError or ValueError from the
    restore, so restore_latest raised instead of falling back."""
    with manager(root) as mgr:
        mgr.save(1, state_of(1))
        mgr.save(2, state_of(2))
        crafted = '{"progress": {"step": 2, "name": ' + value + "}}"
        forge(root, 2, "objects-rank00000.json", crafted.encode(), fix_record=True)
        with pytest.raises(CorruptCheckpointError):
            mgr.restore(2, empty_state())
        state = empty_state()
        assert mgr.restore_latest(state) == 1
    assert_state_of(state, 1)


@pytest.mark.parametrize(
    "bad_path", ["../step_000000000002/.metadata", "/etc/passwd", "a/../../b", "", "C:\\x"]
)
def test_paths_in_a_record_never_leave_the_step_directory(root: str, bad_path: str) -> None:
    with manager(root) as mgr:
        mgr.save(1, state_of(1))
        raw = json.loads(read(root, 1, "commit.json"))
        raw["files"].append({"path": bad_path, "size": 1})
        write(root, 1, "commit.json", record_bytes(raw))
        with pytest.raises(CorruptCheckpointError, match="not inside its step directory"):
            mgr.restore(1, empty_state())
        raw["files"].pop()
        raw["object_files"] = [bad_path]
        write(root, 1, "commit.json", record_bytes(raw))
        with pytest.raises(CorruptCheckpointError, match="not inside its step directory"):
            mgr.restore(1, empty_state())


def test_paths_in_dcp_metadata_never_leave_the_step_directory(root: str) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from ckptmgr.safe_metadata import load_metadata_safely

    with manager(root) as mgr:
        mgr.save(1, state_of(1))
        metadata = load_metadata_safely(_BytesStream(read(root, 1, ".metadata")))
        for index, info in list(metadata.storage_data.items()):
            metadata.storage_data[index] = _StorageInfo(
                "../../outside.distcp", info.offset, info.length
            )
        forge(root, 1, ".metadata", pickle.dumps(metadata), fix_record=True)
        with pytest.raises(CorruptCheckpointError, match="not inside its step directory"):
            mgr.restore(1, empty_state())


class _BytesStream:
    def __init__(self, data: bytes) -> None:
        self._data = data

    def read(self) -> bytes:
        return self._data


# -- the command line ---------------------------------------------------------------------------


def test_verify_deep_refuses_metadata_naming_a_file_the_record_does_not_list(root: str) -> None:
    """.metadata naming a data file that the commit record does not list: restore refused it,
    while verify(deep=True) and ``ckptmgr verify --deep`` called the step sound."""
    from ckptmgr.cli import main as cli_main

    with manager(root) as mgr:
        mgr.save(1, state_of(1))
        metadata = pickle.loads(read(root, 1, ".metadata"))
        for info in metadata.storage_data.values():
            info.relative_path = "other.distcp"
        forge(root, 1, ".metadata", pickle.dumps(metadata), fix_record=True)
        named = r"other\.distcp, named by \.metadata, is not listed"
        with pytest.raises(CorruptCheckpointError, match=named):
            mgr.verify(1, deep=True)
        with pytest.raises(CorruptCheckpointError):
            mgr.restore(1, empty_state())
    if not root.startswith(("gs://", "s3://", "memory://")):
        assert cli_main(["verify", "--deep", root]) == 1


def test_plain_values_nested_too_deep_for_the_stack_are_no_damage(root: str) -> None:
    """Nesting deeper than the recursion limit allows from the caller's stack raises
    CheckpointError naming it, and is no damage: restore_latest quarantines nothing (how deep
    the caller's stack is decides it; a step restorable from a shallower one was quarantined)."""
    with manager(root) as mgr:
        mgr.save(1, state_of(1))
        mgr.save(2, state_of(2))
        deep = "[" * 100_000 + "]" * 100_000
        crafted = '{"progress": {"step": 2, "name": ' + deep + "}}"
        forge(root, 2, "objects-rank00000.json", crafted.encode(), fix_record=True)
        for restore in (mgr.restore_latest, functools.partial(mgr.restore, 2)):
            with pytest.raises(CheckpointError, match="deeper than Python's recursion limit") as e:
                restore(empty_state())
            assert not isinstance(e.value, CorruptCheckpointError)
        assert mgr.all_steps() == [1, 2]


REFUSED_METADATA_CHILD = r"""
import logging, sys, torch
from ckptmgr import CheckpointManager

logging.basicConfig(level=logging.INFO)
with CheckpointManager(sys.argv[1], 1, chkpt_on_preemption=False) as mgr:
    target = {"w": torch.zeros(4)}
    print("restored", mgr.restore_latest(target), flush=True)
"""


def test_a_refused_metadata_is_reported_once_without_dcps_tracebacks(tmp_path: Path) -> None:
    """DCP logs a failed read of ``.metadata`` twice with its traceback on the root logger
    (falling back to rank-local metadata, which ckptmgr never writes): for a damaged step
    restore_latest passed, two full tracebacks before ckptmgr's one line."""
    root = tmp_path / "run"
    with CheckpointManager(root, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, {"w": torch.ones(4)})
        mgr.save(2, {"w": torch.ones(4)})
    forge(str(root), 2, ".metadata", b"not a pickle", fix_record=True)
    result = run_python(REFUSED_METADATA_CHILD, str(root))
    assert result.returncode == 0, result.stderr
    assert "restored 1" in result.stdout
    assert "step 2 is damaged and is quarantined" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "Falling back" not in result.stderr, result.stderr


def test_only_dcps_own_fallback_warnings_are_filtered() -> None:
    """The filter keys on DCP's loader module by its path: a module of the user's own named
    state_dict_loader that logs a CorruptCheckpointError is heard."""
    import logging

    from ckptmgr.dcp_io import _not_ckptmgrs_refusal

    try:
        raise CorruptCheckpointError("step 7 is damaged")
    except CorruptCheckpointError:
        error = sys.exc_info()

    def record(path: str) -> logging.LogRecord:
        return logging.LogRecord("root", logging.WARNING, path, 1, "m", None, error)

    dcp = str(Path(torch.__file__).parent / "distributed/checkpoint/state_dict_loader.py")
    assert not _not_ckptmgrs_refusal(record(dcp))
    assert _not_ckptmgrs_refusal(record("/home/user/project/state_dict_loader.py"))


def test_cli_verify_reports_damage_with_exit_status_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ckptmgr verify``: one real process for the exit status of damage, the rest as
    ``cli.main`` calls here (every CLI process imports torch: seconds each)."""
    root = str(tmp_path / "ckpts")
    with manager(root) as mgr:
        mgr.save(1, state_of(1))
        mgr.save(2, state_of(2))
    code, out, err = cli_here(capsys, "verify", root, "--deep", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["deep"] is True
    assert [(row["step"], row["ok"]) for row in report["steps"]] == [(1, True), (2, True)]
    assert all(row["checksums"] == row["files"] for row in report["steps"])

    name = distcp_name(root, 2)
    flip_bit(root, 2, name)
    code, out, err = cli_here(capsys, "verify", root, "2")
    assert code == 0, err  # sizes only: a flipped bit is invisible
    deep = run_python(REPO / "ckptmgr" / "__main__.py", "verify", root, "2", "--deep", "--json")
    assert deep.returncode == 1
    row = json.loads(deep.stdout)["steps"][0]
    assert row["ok"] is False and row["problems"][0]["path"] == name
    assert "damaged step(s): [2]" in deep.stderr

    with manager(root) as mgr:
        assert mgr.restore_latest(empty_state()) == 1
    code, out, err = cli_here(capsys, "ls", root, "--all", "--json")
    assert code == 0, err
    ls_report = json.loads(out)
    assert [row["step"] for row in ls_report["steps"]] == [1]
    assert [(row["name"], row["kind"]) for row in ls_report["leftovers"]] == [
        ("step_000000000002", "quarantined")
    ]
    code, out, err = cli_here(capsys, "verify", root, "2", "--deep")
    assert code == 1 and "quarantined" in out


def cli_here(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``ckptmgr ARGV`` as ``cli.main`` in this process: its exit status, stdout and stderr."""
    capsys.readouterr()
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_verify_reports_a_step_deleted_while_it_is_checked_as_deleted_not_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ckptmgr verify` of a root that a job is writing: a step its retention deletes between
    the listing and the check is reported as deleted meanwhile, and the exit status is 0 (it
    was reported damaged, status 1). Fault injection: the check of step 1 deletes it first."""
    root = str(tmp_path / "ckpts")
    with manager(root) as mgr:
        for step in (1, 2):
            mgr.save(step, state_of(step))
    original = cli.verify_step

    def deleted_first(storage: CheckpointStorage, step: int, *args: object) -> object:
        if step == 1:
            storage.delete_step(1)  # the writing job's retention, just now
        return original(storage, step, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(cli, "verify_step", deleted_first)
    assert cli.main(["verify", root, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["deleted_meanwhile"] == [1]
    assert [(row["step"], row["ok"]) for row in report["steps"]] == [(2, True)]


# -- several ranks -------------------------------------------------------------------------------

TWO_RANKS = r"""
import os, socket, sys
import torch, torch.distributed as dist
import torch.multiprocessing as mp

def run(rank, port, root):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    body(rank, root)
    dist.destroy_process_group()

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=run, args=(r, port, sys.argv[1])) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(150)
    sys.exit(max(p.exitcode if p.exitcode is not None else 99 for p in procs))
"""
"""A 2-rank gloo job on 127.0.0.1 (spawned processes) that runs ``body(rank, root)`` on each
rank: a script is a ``body`` followed by this."""


def run_two_ranks(tmp_path: Path, body: str, root: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "two_ranks.py"
    script.write_text("import os, torch, torch.distributed as dist\n" + body + TWO_RANKS)
    return run_python(script, str(root), timeout=200)


DIST_SCRIPT = r"""
def body(rank, root):
    from ckptmgr import CheckpointManager, PerRank
    with CheckpointManager(root, 1, chkpt_on_preemption=False) as mgr:
        for step in (1, 2):
            mine = PerRank(torch.full((10,), float(rank)))
            state = {"w": torch.ones(100) * step, "r": mine, "x": rank}
            mgr.save_async(step, state)
        mgr.join()
        dist.barrier()
        if rank == 1:  # only rank 1 reads its plain values: only rank 1 sees the damage
            path = os.path.join(root, "step_000000000002", "objects-rank00001.json")
            data = open(path, "rb").read()
            open(path, "wb").write(data[:-1] + b" ")
        dist.barrier()
        state = {"w": torch.zeros(100), "r": PerRank(torch.zeros(10)), "x": -1}
        step = mgr.restore_latest(state)
        print(f"rank {rank} restored {step} x={state['x']} w={state['w'][0].item()} "
              f"r={state['r'].value[0].item()} steps={mgr.all_steps()}", flush=True)
"""


def test_two_ranks_record_every_ranks_checksums_and_agree_on_quarantine(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    result = run_two_ranks(tmp_path, DIST_SCRIPT, root)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        assert f"rank {rank} restored 1 x={rank} w=1.0 r={float(rank)} steps=[1]" in result.stdout
    record = CheckpointStorage(str(root)).read_record(1)
    names = {entry.path for entry in record.files}
    assert {"__0_0.distcp", "__1_0.distcp", "objects-rank00001.json", ".metadata"} <= names
    for entry in record.files:
        assert entry.crc32 == zlib.crc32((root / "step_000000000001" / entry.path).read_bytes())
    assert CheckpointStorage(str(root)).quarantined_steps() == [2]


DIST_FAILURE_SCRIPT = r"""
def body(rank, root):
    from ckptmgr import CheckpointError, CheckpointManager, PerRank
    from ckptmgr.storage import CheckpointStorage
    with CheckpointManager(root, 1, chkpt_on_preemption=False, collective_timeout_s=30) as mgr:
        mgr.save(1, {"w": torch.ones(100), "r": PerRank(torch.full((10,), float(rank)))})
        if rank == 1:  # fault injection: rank 1 alone cannot read its plain values
            def refused(self, *args, **kwargs):
                raise PermissionError("injected on rank 1: permission denied")
            CheckpointStorage.read_objects = refused
        state = {"w": torch.zeros(100), "r": PerRank(torch.zeros(10))}
        try:
            mgr.restore_latest(state)
            outcome = "restored"
        except Exception as exc:
            damaged = type(exc).__name__ == "CorruptCheckpointError"
            outcome = f"{type(exc).__name__} damaged={damaged}: {exc}"
        print(f"rank {rank} outcome: {outcome}", flush=True)
        print(f"rank {rank} steps={mgr.all_steps()}", flush=True)
"""


def test_two_ranks_restore_latest_raises_on_both_when_one_rank_fails_without_damage(
    tmp_path: Path,
) -> None:
    """An error on one rank that is no damage (here a PermissionError reading its file) makes
    restore_latest raise on both ranks, with nothing quarantined; the other rank used to look
    for the step in storage alone (a collective the failing rank had left), and hang. Both
    raise a CheckpointError (the failing rank's own cause is the PermissionError)."""
    root = tmp_path / "ckpts"
    result = run_two_ranks(tmp_path, DIST_FAILURE_SCRIPT, root)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        "rank 1 outcome: CheckpointError damaged=False: restore of step 1 failed: "
        "PermissionError: injected on rank 1"
    ) in result.stdout
    assert "rank 0 outcome: CheckpointError damaged=False: restore of step 1 failed" in (
        result.stdout
    )
    assert "rank 1: PermissionError: injected on rank 1" in result.stdout
    for rank in (0, 1):
        assert f"rank {rank} steps=[1]" in result.stdout
    assert CheckpointStorage(str(root)).quarantined_steps() == []


DIST_NOTHING_TO_LOAD_SCRIPT = r"""
def body(rank, root):
    from ckptmgr import CheckpointManager, PerRank
    with CheckpointManager(root, 1, chkpt_on_preemption=False, collective_timeout_s=30) as mgr:
        mgr.save(1, {"w": torch.ones(4), "x": rank, "r": PerRank(torch.full((3,), float(rank)))})
        plain = {"x": -1}
        mgr.restore(1, plain)  # no tensor on any rank
        mixed = {"x": -1} if rank == 0 else {"x": -1, "r": PerRank(torch.zeros(3))}
        mgr.restore(1, mixed)  # a tensor on rank 1 only
        r = mixed["r"].value.tolist() if "r" in mixed else None
        print(f"rank {rank} plain={plain['x']} mixed={mixed['x']} r={r}", flush=True)
"""


def test_two_ranks_restore_when_one_rank_has_no_tensor_to_load(tmp_path: Path) -> None:
    """restore is collective even for a rank whose state holds no tensor: it joins DCP's load
    with nothing to read, so the rank that does load is not left waiting (it timed out)."""
    result = run_two_ranks(tmp_path, DIST_NOTHING_TO_LOAD_SCRIPT, tmp_path / "ckpts")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0 plain=0 mixed=0 r=None" in result.stdout
    assert "rank 1 plain=1 mixed=1 r=[1.0, 1.0, 1.0]" in result.stdout


# -- the hashing stream of DCP's data files ------------------------------------------------------
class _PartialTarget:
    """A raw target that takes at most ``limit`` bytes per write, as a raw file may."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()

    def write(self, view: memoryview) -> int:
        taken = bytes(view.cast("B")[: self.limit])
        self.data += taken
        return len(taken)


@pytest.mark.parametrize("target", ["file", "partial"])
def test_hashing_writer_checksums_exactly_what_was_written(tmp_path: Path, target: str) -> None:
    """Writes below and above CRC_BESIDE_WRITE_BYTES (hashed while they are written, on a thread
    of their own), of bytes and of tensor memory, give the CRC-32 of every byte the target took,
    in order; so does a raw target that takes part of each large write."""
    from ckptmgr.integrity import CRC_BESIDE_WRITE_BYTES, HashingWriter

    gen = torch.Generator().manual_seed(3)
    big = CRC_BESIDE_WRITE_BYTES
    pieces = [
        b"head",
        torch.randint(0, 256, (big + 5,), dtype=torch.uint8, generator=gen).numpy(),
        b"",
        torch.randn(big // 4 * 3, generator=gen).numpy(),  # float32 memory, 3 MiB
        b"x" * 100,
    ]
    if target == "file":
        path = tmp_path / "data"
        with open(path, "wb") as handle:
            hashing = HashingWriter(handle)
            for piece in pieces:
                assert hashing.write(piece) == memoryview(piece).nbytes
        written = path.read_bytes()
    else:
        raw = _PartialTarget(big + big // 2)
        hashing = HashingWriter(raw)
        for piece in pieces:
            hashing.write(piece)
        written = bytes(raw.data)
        assert len(written) < sum(memoryview(piece).nbytes for piece in pieces)
    assert hashing.size == len(written)
    assert hashing.crc == zlib.crc32(written)


def test_a_data_file_gone_during_a_remote_restore_is_named_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A data file deleted after the listing that checked it (another job's retention, say) is
    found by a remote read only when it reads: that was reported as "a tensor file cannot be
    decoded: FileNotFoundError(...)", naming no file; it is "a data file is missing", with the
    file's name as ``path``, as on a local disk. Fault injection: the check of the files' sizes
    deletes the data file once it has passed."""
    root = f"memory://gone-{uuid.uuid4().hex}"
    real_check = CheckpointStorage.check_sizes

    def check_then_delete(self: CheckpointStorage, step: int, record: CommitRecord) -> None:
        real_check(self, step, record)
        self.fs.rm_file(f"{self.step_path(step)}/__0_0.distcp")

    with CheckpointManager(root, 1, chkpt_on_preemption=False) as mgr:
        assert mgr.save(1, {"w": torch.rand(100_000)})
        monkeypatch.setattr(CheckpointStorage, "check_sizes", check_then_delete)
        with pytest.raises(CorruptCheckpointError, match="a data file is missing") as raised:
            mgr.restore(1, {"w": torch.zeros(100_000)})
        assert raised.value.path == "__0_0.distcp"
    fsspec.filesystem("memory").rm(root.removeprefix("memory://"), recursive=True)
