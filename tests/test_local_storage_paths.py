"""The local storage's own paths (no fsspec call on the save path): creating the write directory
and listing what a save wrote give what fsspec's local file system gives."""

from __future__ import annotations

import os
from pathlib import Path

import fsspec
import pytest

from ckptmgr.storage import CheckpointStorage


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
