"""The local listing through the C library's glob (ckptmgr.local_glob): the same steps as the
listing in Python, for any root name, without a ``stat`` per step from Python."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptmgr import local_glob
from ckptmgr.record import QUARANTINE_NAME, RECORD_NAME
from ckptmgr.storage import CheckpointStorage, step_dir_name

needs_glob = pytest.mark.skipif(not local_glob.available(), reason="no glob(3) here (not Linux)")

ROOT_NAMES = ["plain", "with [brackets] and *stars*?", "back\\slash [a-z]", "ünïcode ∂"]


def _touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"{}")


def _populate(root: Path) -> None:
    """Committed, quarantined, half-made and foreign entries, as a long-lived root has them."""
    for step in (1, 2, 5, 100, 10**13):
        _touch(root / step_dir_name(step) / RECORD_NAME)
    _touch(root / step_dir_name(5) / QUARANTINE_NAME)
    (root / step_dir_name(7)).mkdir()  # no record: not committed
    _touch(root / step_dir_name(8) / QUARANTINE_NAME)  # a marker without a record
    _touch(root / f".tmp-{step_dir_name(9)}-abc" / RECORD_NAME)
    _touch(root / f".deleting-{step_dir_name(3)}-123" / RECORD_NAME)
    _touch(root / f"{step_dir_name(4)}.quarantined-99" / RECORD_NAME)
    _touch(root / "step_12" / RECORD_NAME)  # not a step directory's name
    _touch(root / "notes" / RECORD_NAME)
    (root / step_dir_name(11)).write_bytes(b"a file, not a directory")
    _touch(root / step_dir_name(12) / "deeper" / RECORD_NAME)  # not committed


def _listed_in_python(root: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int]]:
    with monkeypatch.context() as patch:
        patch.setattr(local_glob, "_FUNCTIONS", None)
        assert local_glob.match(str(root), "*") is None
        storage = CheckpointStorage(str(root))
        return storage.committed_steps(), storage.quarantined_steps()


@needs_glob
@pytest.mark.parametrize("name", ROOT_NAMES)
def test_glob_lists_what_python_lists_for_any_root_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    root = tmp_path / name
    _populate(root)
    sibling = name.replace("[", "").replace("]", "")  # what the name, read as a pattern, matches
    if sibling != name:
        _touch(tmp_path / sibling / step_dir_name(6) / RECORD_NAME)  # never listed
    storage = CheckpointStorage(str(root))
    assert storage.committed_steps() == [1, 2, 100, 10**13]
    assert storage.quarantined_steps() == [5]
    assert (storage.committed_steps(), storage.quarantined_steps()) == _listed_in_python(
        root, monkeypatch
    )


@needs_glob
def test_match_escapes_the_directory_and_says_none_where_it_is_missing(tmp_path: Path) -> None:
    root = tmp_path / "r[ab]"
    _touch(root / step_dir_name(1) / RECORD_NAME)
    _touch(tmp_path / "ra" / step_dir_name(2) / RECORD_NAME)
    assert local_glob.match(str(root), f"step_*/{RECORD_NAME}") == [
        f"{step_dir_name(1)}/{RECORD_NAME}"
    ]
    assert local_glob.match(str(root) + "/", f"step_*/{QUARANTINE_NAME}") == []
    assert local_glob.match(str(tmp_path / "missing"), "*") is None


@needs_glob
def test_the_listing_makes_no_stat_per_step_from_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for step in range(1, 51):
        _touch(tmp_path / step_dir_name(step) / RECORD_NAME)
    storage = CheckpointStorage(str(tmp_path))
    calls: list[str] = []
    real_exists, real_stat = os.path.exists, os.stat

    def counting_exists(path: object) -> bool:
        calls.append(str(path))
        return real_exists(path)  # type: ignore[arg-type]

    def counting_stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        calls.append(str(path))
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os.path, "exists", counting_exists)
    monkeypatch.setattr(os, "stat", counting_stat)
    assert storage.committed_steps() == list(range(1, 51))
    monkeypatch.undo()
    assert calls == []


@pytest.mark.parametrize("use_glob", [True, False])
def test_an_empty_missing_or_file_root_lists_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, use_glob: bool
) -> None:
    if not use_glob:
        monkeypatch.setattr(local_glob, "_FUNCTIONS", None)
    elif not local_glob.available():
        pytest.skip("no glob(3) here (not Linux)")
    storage = CheckpointStorage(str(tmp_path / "root"))  # makes the root
    assert storage.committed_steps() == []
    (tmp_path / "root").rmdir()
    assert storage.committed_steps() == []
    (tmp_path / "root").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        storage.committed_steps()
