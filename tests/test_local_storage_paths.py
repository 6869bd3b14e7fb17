"""The local storage's own paths (no fsspec call on the save path): creating the write directory
and listing what a save wrote give what fsspec's local file system gives; the commit's file work
(which the checkpoint daemon runs in process mode) on real files."""

from __future__ import annotations

import os
from pathlib import Path

import fsspec
import pytest

from ckptmgr.storage import (
    QUARANTINE_NAME,
    RECORD_NAME,
    AlreadyCommittedError,
    CheckpointStorage,
    commit_local_step,
)


def _fsspec_listing(path: Path) -> list[tuple[str, int]]:
    """What the listing gave when it went through fsspec's ``find``."""
    found = fsspec.filesystem("file").find(str(path), detail=True)
    prefix = str(path).rstrip("/") + "/"
    return sorted((name[len(prefix) :], int(info.get("size") or 0)) for name, info in found.items())


def _tree(root: Path) -> Path:
    """A write directory with what a save makes, nested files, an empty directory and symbolic
    links (to a file, to a directory, to nothing)."""
    write_dir = root / ".tmp-step_000000000003-abc"
    (write_dir / "sub" / "deeper").mkdir(parents=True)
    (write_dir / "empty").mkdir()
    (write_dir / "__0_0.distcp").write_bytes(b"x" * 1000)
    (write_dir / ".metadata").write_bytes(b"m" * 17)
    (write_dir / "objects-rank00000.json").write_bytes(b"{}")
    (write_dir / "sub" / "a").write_bytes(b"abc")
    (write_dir / "sub" / "deeper" / "b").write_bytes(b"")
    outside = root / "outside"
    outside.mkdir()
    (outside / "big").write_bytes(b"y" * 4321)
    os.symlink(outside / "big", write_dir / "to_file")
    os.symlink(outside, write_dir / "to_dir")
    os.symlink(root / "nothing", write_dir / "to_nothing")
    return write_dir


def test_list_files_gives_what_fsspec_find_gave(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path))
    write_dir = _tree(tmp_path)
    listed = [(entry.path, entry.size) for entry in storage.list_files(str(write_dir))]
    assert listed == _fsspec_listing(write_dir)
    assert ("sub/deeper/b", 0) in listed and ("to_file", 4321) in listed  # (it did look deep)
    assert ("to_nothing", 0) in listed and not any(name.startswith("to_dir/") for name, _ in listed)


def test_list_files_of_a_missing_directory_is_empty(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path))
    assert storage.list_files(str(tmp_path / "gone")) == []
    assert _fsspec_listing(tmp_path / "gone") == []


def test_list_files_makes_no_fsspec_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = CheckpointStorage(str(tmp_path))
    write_dir = _tree(tmp_path)

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("fsspec was called")

    monkeypatch.setattr(storage.fs, "find", refused)
    monkeypatch.setattr(storage.fs, "makedirs", refused)
    assert len(storage.list_files(str(write_dir))) == 8
    storage.prepare_write_dir(str(tmp_path / ".tmp-step_000000000004-def"))
    storage.ensure_dir(str(tmp_path / "a" / "b"))
    assert (tmp_path / ".tmp-step_000000000004-def").is_dir() and (tmp_path / "a" / "b").is_dir()


def test_prepare_write_dir_keeps_an_existing_directory(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path))
    path = tmp_path / ".tmp-step_000000000005-abc"
    storage.prepare_write_dir(str(path))
    (path / "x").write_bytes(b"1")
    storage.prepare_write_dir(str(path))  # exist_ok, as before
    storage.ensure_dir(str(path))
    assert (path / "x").read_bytes() == b"1"


def test_prepare_write_dir_under_a_file_raises(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path))
    (tmp_path / "blocker").write_bytes(b"")
    with pytest.raises(OSError):
        storage.prepare_write_dir(str(tmp_path / "blocker" / "inside"))


# -- the local commit's file work (commit_local_step), as the checkpoint daemon runs it ----------
def _write_dir_with_data(root: Path, name: str) -> Path:
    write_dir = root / name
    write_dir.mkdir()
    (write_dir / "__0_0.distcp").write_bytes(b"d" * 100)
    return write_dir


def test_commit_local_step_writes_the_record_and_renames(tmp_path: Path) -> None:
    write_dir = _write_dir_with_data(tmp_path, ".tmp-step_000000000007-abc")
    final = tmp_path / "step_000000000007"
    aside = tmp_path / "step_000000000007.quarantined-1"
    moved = commit_local_step(str(tmp_path), str(write_dir), str(final), str(aside), b"{record}")
    assert moved is False
    assert not write_dir.exists() and not aside.exists()
    assert (final / RECORD_NAME).read_bytes() == b"{record}"
    assert (final / "__0_0.distcp").read_bytes() == b"d" * 100


def test_commit_local_step_run_again_after_it_was_done_is_done(tmp_path: Path) -> None:
    """Run again after it got past the rename (as a caller that retries an interrupted commit
    would), the step holding this very record is this commit, done; another record is not."""
    write_dir = _write_dir_with_data(tmp_path, ".tmp-step_000000000007-abc")
    final = tmp_path / "step_000000000007"
    args = (str(tmp_path), str(write_dir), str(final), str(tmp_path / "aside"))
    assert commit_local_step(*args, b"{record}") is False
    assert commit_local_step(*args, b"{record}") is False  # again: nothing changes
    assert (final / RECORD_NAME).read_bytes() == b"{record}"
    with pytest.raises(FileNotFoundError):  # not this save's record: never taken as done
        commit_local_step(*args, b"{another record}")
    assert (final / RECORD_NAME).read_bytes() == b"{record}"


def test_commit_local_step_refuses_a_step_committed_by_another_writer(tmp_path: Path) -> None:
    final = tmp_path / "step_000000000007"
    final.mkdir()
    (final / RECORD_NAME).write_bytes(b"{theirs}")
    write_dir = _write_dir_with_data(tmp_path, ".tmp-step_000000000007-abc")
    with pytest.raises(AlreadyCommittedError):
        commit_local_step(
            str(tmp_path), str(write_dir), str(final), str(tmp_path / "aside"), b"{ours}"
        )
    assert (final / RECORD_NAME).read_bytes() == b"{theirs}"
    assert (write_dir / "__0_0.distcp").exists()  # left for the caller's discard


def test_commit_local_step_moves_a_quarantined_step_aside(tmp_path: Path) -> None:
    final = tmp_path / "step_000000000007"
    final.mkdir()
    (final / RECORD_NAME).write_bytes(b"{damaged}")
    (final / QUARANTINE_NAME).write_bytes(b"{}")
    aside = tmp_path / "step_000000000007.quarantined-1"
    write_dir = _write_dir_with_data(tmp_path, ".tmp-step_000000000007-abc")
    assert commit_local_step(str(tmp_path), str(write_dir), str(final), str(aside), b"{new}")
    assert (final / RECORD_NAME).read_bytes() == b"{new}"
    assert (aside / RECORD_NAME).read_bytes() == b"{damaged}"
    assert (aside / QUARANTINE_NAME).exists()


def test_commit_local_step_clears_remains_of_an_interrupted_delete(tmp_path: Path) -> None:
    final = tmp_path / "step_000000000007"
    final.mkdir()
    (final / "__0_0.distcp").write_bytes(b"old")  # no record: never listed
    write_dir = _write_dir_with_data(tmp_path, ".tmp-step_000000000007-abc")
    commit_local_step(str(tmp_path), str(write_dir), str(final), str(tmp_path / "a"), b"{r}")
    assert (final / "__0_0.distcp").read_bytes() == b"d" * 100
