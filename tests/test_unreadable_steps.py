"""A committed step is never taken for a missing one, and a delete that is done is not a failure.

- A step directory or commit record that cannot be looked at (no permission, an I/O error)
  fails the listing of a local root, instead of the step being left out of it, and swept as a
  leftover (renamed to ``.deleting-...``, then removed) by the next manager.
- ``ckptmgr ls`` lists a step whose commit record cannot be read as unreadable, ``verify``
  reports it, and ``prune`` keeps it (retention never deletes what it cannot judge).
- A step that another process deletes at the same time (two ``ckptmgr prune`` at once) is
  deleted, not a failure of either.
- A step whose files could not all be removed once it was no longer listed is deleted: a
  warning says so, and its files are a leftover that the next manager's sweep removes.

Permissions are checked for real where they can be (not root, or root that drops its power to
ignore them with ``setpriv``); the same faults are also injected, so every test runs anywhere.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from conftest import REPO, run_bounded
from fsspec.implementations.memory import MemoryFileSystem

from ckptmgr import CheckpointManager, local_glob, pruning
from ckptmgr import storage as storage_module
from ckptmgr.cli import main as cli_main
from ckptmgr.storage import CheckpointStorage

STEPS = (1, 2, 3)
TIMEOUT_S = 120.0


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:012d}"


def state_of(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), float(step))}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A local root with steps 1, 2 and 3 committed."""
    path = tmp_path / "run"
    with CheckpointManager(path, 1, chkpt_on_preemption=False) as manager:
        for step in STEPS:
            assert manager.save(step, state_of(step))
    return path


def assert_whole(root: Path, steps: tuple[int, ...] = STEPS) -> None:
    """Every one of ``steps`` listed and restored bit for bit; nothing moved aside."""
    assert not list(root.glob(".deleting-*"))
    with CheckpointManager(root, 1, chkpt_on_preemption=False, read_only=True) as manager:
        assert manager.all_steps() == list(steps)
        for step in steps:
            restored = {"w": torch.zeros(64)}
            manager.restore(step, restored)
            assert torch.equal(restored["w"], state_of(step)["w"])


# -- with real permissions -----------------------------------------------------------------


def unprivileged(command: list[str], probe: Path) -> list[str]:
    """``command`` run without the power to ignore file permissions: as it is when this is not
    root, under ``setpriv`` (its capabilities dropped) when it is. Skips the test where
    neither makes ``probe`` (a file of mode 000) unreadable."""
    if os.geteuid() != 0:
        prefix: list[str] = []
    else:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("root without setpriv: permissions cannot be checked here")
        prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search"]
    probe.write_bytes(b"x")
    probe.chmod(0)
    try:
        opened = subprocess.run(
            [*prefix, sys.executable, "-c", f"open({str(probe)!r}).read()"],
            capture_output=True,
            timeout=TIMEOUT_S,
        )
    finally:
        probe.chmod(0o600)
    if opened.returncode == 0:
        pytest.skip("file permissions are not enforced here")
    return [*prefix, *command]


def run_unprivileged(command: list[str], probe: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    return run_bounded(unprivileged(command, probe), timeout=TIMEOUT_S, env=env)


OPEN_THE_ROOT = r"""
import sys

from ckptmgr import CheckpointManager

try:
    manager = CheckpointManager(sys.argv[1], 1, chkpt_on_preemption=False, leftover_grace_s=0)
except Exception as exc:
    print(type(exc).__name__, exc)
else:
    print("listed", manager.all_steps())
    manager.close()
"""


@pytest.fixture
def restore_modes(root: Path) -> Iterator[None]:
    yield
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def test_a_step_directory_without_permission_fails_the_listing_and_is_not_swept(
    root: Path, tmp_path: Path, restore_modes: None
) -> None:
    # Before, the step was left out (os.path.exists answers False for EACCES), taken for an
    # uncommitted leftover, and renamed to .deleting-... by the sweep: lost from the listing
    # for good, and removed entirely by a later sweep once readable again.
    step_dir(root, 2).chmod(0)
    opened = run_unprivileged([sys.executable, "-c", OPEN_THE_ROOT, str(root)], tmp_path / "p")
    assert opened.returncode == 0, opened.stderr
    assert opened.stdout.startswith("PermissionError"), opened.stdout
    assert "step_000000000002" in opened.stdout
    listed = run_unprivileged([sys.executable, "-m", "ckptmgr", "ls", str(root)], tmp_path / "p")
    assert listed.returncode == 1, listed.stdout
    assert "Permission denied" in listed.stderr and "step_000000000002" in listed.stderr
    step_dir(root, 2).chmod(0o755)
    assert_whole(root)


def test_a_commit_record_without_permission_is_listed_unreadable_and_kept_by_prune(
    root: Path, tmp_path: Path, restore_modes: None
) -> None:
    (step_dir(root, 2) / "commit.json").chmod(0)
    cli = [sys.executable, "-m", "ckptmgr"]
    listed = run_unprivileged([*cli, "ls", str(root), "--json"], tmp_path / "p")
    assert listed.returncode == 0, listed.stderr
    rows = {row["step"]: row for row in json.loads(listed.stdout)["steps"]}
    assert sorted(rows) == list(STEPS)
    assert "Permission denied" in rows[2]["error"]
    verified = run_unprivileged([*cli, "verify", str(root), "--json"], tmp_path / "p")
    assert verified.returncode == 1, verified.stderr
    errors = {row["step"]: row["error"] for row in json.loads(verified.stdout)["steps"]}
    assert errors[1] is None and errors[3] is None and "Permission denied" in errors[2]
    pruned = run_unprivileged([*cli, "prune", str(root), "--keep-latest", "1"], tmp_path / "p")
    assert pruned.returncode == 0, pruned.stderr
    (step_dir(root, 2) / "commit.json").chmod(0o644)
    assert_whole(root, (2, 3))


# -- with injected faults --------------------------------------------------------------------


def refuse_to_look_in(monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
    """What a directory without permission does, wherever it is renamed to: ``os.stat`` and
    ``os.lstat`` of anything in it, and listing it, fail with EACCES; the C library's glob, as
    it does for a directory it cannot open, cannot answer (the listing is then made in
    Python)."""
    real_stat, real_scandir, real_listdir = os.stat, os.scandir, os.listdir
    refused = (real_stat(directory).st_dev, real_stat(directory).st_ino)

    def is_refused(path: Any) -> bool:
        try:
            found = os.fstat(path) if isinstance(path, int) else real_stat(path)
        except OSError:
            return False
        return (found.st_dev, found.st_ino) == refused

    def denied(path: Any) -> PermissionError:
        return PermissionError(errno.EACCES, "Permission denied (injected)", str(path))

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if isinstance(path, (str, os.PathLike)) and is_refused(os.path.dirname(path)):
            raise denied(path)
        return real_stat(path, *args, **kwargs)

    def lstat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        return stat(path, *args, follow_symlinks=False, **kwargs)

    def scandir(path: Any = ".") -> Any:
        if is_refused(path):
            raise denied(path)
        return real_scandir(path)

    def listdir(path: Any = ".") -> list[Any]:
        if is_refused(path):
            raise denied(path)
        return real_listdir(path)

    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(os, "lstat", lstat)
    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(os, "listdir", listdir)
    monkeypatch.setattr(local_glob, "match", lambda directory, pattern: None)


def test_a_step_that_cannot_be_looked_at_fails_the_listing_and_is_not_swept(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_to_look_in(monkeypatch, step_dir(root, 2))
    with pytest.raises(PermissionError, match="step_000000000002"):
        CheckpointManager(root, 1, chkpt_on_preemption=False, leftover_grace_s=0)
    with pytest.raises(PermissionError, match="step_000000000002"):
        CheckpointStorage(str(root)).leftovers()
    monkeypatch.undo()
    assert_whole(root)


def test_a_commit_record_that_cannot_be_read_is_listed_unreadable_and_kept_by_prune(
    root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_read = CheckpointStorage._read_bytes
    record = str(step_dir(root, 2) / "commit.json")

    def read_bytes(self: CheckpointStorage, path: str) -> bytes:
        if path == record:
            raise PermissionError(errno.EACCES, "Permission denied (injected)", path)
        return real_read(self, path)

    monkeypatch.setattr(CheckpointStorage, "_read_bytes", read_bytes)
    assert cli_main(["ls", str(root), "--json"]) == 0
    rows = {row["step"]: row for row in json.loads(capsys.readouterr().out)["steps"]}
    assert sorted(rows) == list(STEPS) and "Permission denied" in rows[2]["error"]
    assert cli_main(["verify", str(root)]) == 1
    assert "Permission denied" in capsys.readouterr().out
    assert cli_main(["prune", str(root), "--keep-latest", "1"]) == 0
    monkeypatch.undo()
    assert_whole(root, (2, 3))


def test_a_step_deleted_meanwhile_by_another_process_is_deleted(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two `ckptmgr prune` at once: both found step 1, the other renamed it away first, and
    # this one's rename failed with FileNotFoundError, reported as a failed delete.
    real_rename = os.rename

    def rename_after_another_deleter(source: Any, target: Any) -> None:
        if ".deleting-" in os.fspath(target) and os.path.exists(source):
            real_rename(source, f"{target}-by-another-process")
        real_rename(source, target)

    monkeypatch.setattr(os, "rename", rename_after_another_deleter)
    storage = CheckpointStorage(str(root))
    pruning.delete_steps(storage, [1])
    monkeypatch.undo()
    assert storage.committed_steps() == [2, 3]


def test_two_prunes_at_once_both_succeed(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root, 1, chkpt_on_preemption=False) as manager:
        for step in range(1, 61):
            assert manager.save(step, {"w": torch.full((4,), float(step))})
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    command = [sys.executable, "-m", "ckptmgr", "prune", str(root), "--keep-latest", "1"]
    prunes = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    for prune in prunes:
        _, stderr = prune.communicate(timeout=TIMEOUT_S)
        assert prune.returncode == 0, stderr.decode()
    assert CheckpointStorage(str(root)).committed_steps() == [60]


def test_a_step_whose_files_cannot_all_be_removed_is_deleted_and_swept_later(
    root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Before, the delete raised ("could not delete step(s) [1] ...; they stay in storage")
    # for a step that was no longer listed: renamed to .deleting-... before its files went.
    real_rmtree = shutil.rmtree

    def rmtree(path: Any, ignore_errors: bool = False, **kwargs: Any) -> None:
        if ".deleting-" in os.fspath(path):
            if ignore_errors:
                return
            raise PermissionError(errno.EACCES, "Permission denied (injected)", os.fspath(path))
        real_rmtree(path, ignore_errors=ignore_errors, **kwargs)

    monkeypatch.setattr(storage_module.shutil, "rmtree", rmtree)
    storage = CheckpointStorage(str(root))
    deleted: list[int] = []
    with caplog.at_level(logging.WARNING, logger="ckptmgr.storage"):
        pruning.delete_steps(storage, [1], on_deleted=deleted.append)
    assert deleted == [1]
    assert storage.committed_steps() == [2, 3]
    assert "removing its files failed" in caplog.text
    assert [leftover.name.split("-")[0] for leftover in storage.leftovers()] == [".deleting"]
    monkeypatch.undo()
    with CheckpointManager(root, 1, chkpt_on_preemption=False, leftover_grace_s=0) as manager:
        assert manager.all_steps() == [2, 3]
    assert not list(root.glob(".deleting-*"))


class DataUndeletableFileSystem(MemoryFileSystem):
    """The in-memory file system, whose data files cannot be deleted (permission denied)."""

    protocol = "undeletable-data"
    root_marker = "/"

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        paths = [path] if isinstance(path, str) else list(path)
        if any(str(p).endswith(".distcp") for p in paths):
            raise PermissionError(errno.EACCES, "Permission denied (injected)", str(paths[0]))
        super().rm(path, recursive=recursive, maxdepth=maxdepth)


def test_a_remote_step_whose_files_cannot_all_be_removed_is_deleted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fsspec.register_implementation(
        DataUndeletableFileSystem.protocol, DataUndeletableFileSystem, clobber=True
    )
    DataUndeletableFileSystem.store.clear()
    DataUndeletableFileSystem.pseudo_dirs[:] = [""]
    url = f"{DataUndeletableFileSystem.protocol}://run"
    try:
        with caplog.at_level(logging.WARNING, logger="ckptmgr.storage"):
            with CheckpointManager(url, 1, max_to_keep=1, chkpt_on_preemption=False) as manager:
                assert manager.save(1, state_of(1))
                assert manager.save(2, state_of(2))  # deletes step 1: its record goes
                manager.join()  # (no failure reported)
                assert manager.all_steps() == [2]
        assert "removing its files under" in caplog.text
        with CheckpointManager(url, 1, chkpt_on_preemption=False, read_only=True) as manager:
            assert manager.all_steps() == [2]
    finally:
        DataUndeletableFileSystem.store.clear()
        DataUndeletableFileSystem.pseudo_dirs[:] = [""]
