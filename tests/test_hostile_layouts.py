"""A local root that holds what no save wrote: FIFOs, devices, links and odd names.

- A FIFO, a socket, a directory or a link to a device where a record (``commit.json``,
  ``owner.json``, ``quarantined.json``) is expected is refused at once: never waited on for a
  writer, never read until memory runs out. A commit record that can never be one (also a
  link that loops or leads nowhere) is damage: ``restore_latest`` falls back past it.
- Only a step's own directory name is a step: ``step_0000000000005`` (a zero too many), digits
  of another script, a trailing newline are other names, never listed, never deleted.
- Nothing is written through a link: a damaged step whose directory links to another root's
  step is skipped, not marked there. Deleting a link removes the link, not what it leads to.
- Trees nested deeper than Python's recursion limit are walked (a leftover's age, a step's files)
  and removed (a leftover swept, a step deleted).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptmgr import CheckpointManager, CommitRecord, CorruptCheckpointError
from ckptmgr.cli import main as cli_main
from ckptmgr.local_files import NotRegularFileError, read_regular_file, walk_files
from ckptmgr.storage import CheckpointStorage

STEPS = (1, 2, 3)
BOUND_S = 60.0  # what a call that should return at once gets before it counts as a hang


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:012d}"


def state_of(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), float(step))}


def save_steps(root: Path, steps: tuple[int, ...] = STEPS) -> None:
    with CheckpointManager(root, 1, chkpt_on_preemption=False) as manager:
        for step in steps:
            assert manager.save(step, state_of(step))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A local root with steps 1, 2 and 3 committed."""
    path = tmp_path / "run"
    save_steps(path)
    return path


@pytest.fixture
def fifos() -> Iterator[Callable[[Path], None]]:
    """Makes a FIFO at a path (replacing what is there). Afterwards each is opened for
    writing and closed, which ends a read that waits on it (the code before the fix)."""
    made: list[Path] = []

    def make(path: Path) -> None:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        os.mkfifo(path)
        made.append(path)

    yield make
    for path in made:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader, or gone
            pass


def bounded(call: Callable[[], Any]) -> Any:
    """``call()`` in a thread, failing the test if it has not returned within ``BOUND_S``;
    what it raised is raised here."""
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # (raised again below)
            outcome.append((False, exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    assert outcome, f"still waiting after {BOUND_S} s"
    returned, value = outcome[0]
    if not returned:
        raise value
    return value


def restore_latest(root: Path) -> tuple[int | None, torch.Tensor]:
    target = {"w": torch.zeros(64)}
    with CheckpointManager(root, 1, chkpt_on_preemption=False) as manager:
        step = manager.restore_latest(target)
    return step, target["w"]


# -- special files where a record is expected -----------------------------------------------------
def test_a_fifo_as_a_commit_record_is_damage_not_a_wait(
    root: Path, fifos: Callable[[Path], None], capsys: pytest.CaptureFixture[str]
) -> None:
    fifos(step_dir(root, 3) / "commit.json")
    assert bounded(lambda: cli_main(["ls", str(root), "--json"])) == 0
    rows = {row["step"]: row for row in json.loads(capsys.readouterr().out)["steps"]}
    assert sorted(rows) == list(STEPS) and "FIFO" in rows[3]["error"], rows
    assert bounded(lambda: cli_main(["verify", str(root)])) == 1
    assert "FIFO" in capsys.readouterr().out
    step, restored = bounded(lambda: restore_latest(root))
    assert step == 2 and torch.equal(restored, state_of(2)["w"])
    assert CheckpointStorage(str(root)).committed_steps() == [1, 2]  # 3 quarantined


def test_a_fifo_as_the_owner_record_fails_the_manager_at_once(
    root: Path, fifos: Callable[[Path], None]
) -> None:
    fifos(root / "owner.json")
    with pytest.raises(NotRegularFileError, match="FIFO"):
        bounded(lambda: CheckpointManager(root, 1, chkpt_on_preemption=False))


def test_a_fifo_as_a_quarantine_marker_is_listed_unreadable(
    root: Path, fifos: Callable[[Path], None], capsys: pytest.CaptureFixture[str]
) -> None:
    fifos(step_dir(root, 2) / "quarantined.json")
    assert bounded(lambda: cli_main(["ls", str(root), "--all", "--json"])) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["steps"] == [row for row in listed["steps"] if row["step"] != 2]
    assert {"name": step_dir(root, 2).name, "kind": "quarantined"}.items() <= next(
        row for row in listed["leftovers"] if row["kind"] == "quarantined"
    ).items(), listed


@pytest.mark.parametrize("kind", ["directory", "link to /dev/zero", "link loop", "dangling link"])
def test_a_commit_record_that_can_never_be_one_is_damage(root: Path, kind: str) -> None:
    record = step_dir(root, 3) / "commit.json"
    record.unlink()
    if kind == "directory":
        record.mkdir()
    elif kind == "link to /dev/zero":
        record.symlink_to("/dev/zero")
    elif kind == "link loop":
        record.symlink_to(record.name)
    else:
        record.symlink_to("no-such-file")
    assert CheckpointStorage(str(root)).committed_steps() == list(STEPS)
    with CheckpointManager(root, 1, chkpt_on_preemption=False, read_only=True) as manager:
        with pytest.raises(CorruptCheckpointError, match="commit record"):
            bounded(lambda: manager.restore(3, {"w": torch.zeros(64)}))
    step, restored = bounded(lambda: restore_latest(root))
    assert step == 2 and torch.equal(restored, state_of(2)["w"])


@pytest.mark.parametrize("kind", ["FIFO", "link to /dev/zero"])
@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_a_steps_file_that_is_no_regular_file_is_damage_not_a_wait(
    root: Path, fifos: Callable[[Path], None], kind: str, name: str
) -> None:
    """DCP's ``.metadata`` or a data file of step 3 made a FIFO or a link to ``/dev/zero``, its
    record saying 0 bytes (so that the size check passes): restore waited on the FIFO for a
    writer, or read ``/dev/zero`` for ever, and so did ``verify --deep``; both are damage
    now, and ``restore_latest`` falls back to step 2."""
    record_path = step_dir(root, 3) / "commit.json"
    record = CommitRecord.from_json(record_path.read_bytes())
    files = [
        entry.model_copy(update={"size": 0, "crc32": 0}) if entry.path == name else entry
        for entry in record.files
    ]
    assert files != record.files
    record_path.write_bytes(record.model_copy(update={"files": files}).to_json())
    path = step_dir(root, 3) / name
    if kind == "FIFO":
        fifos(path)
    else:
        path.unlink()
        path.symlink_to("/dev/zero")
    with CheckpointManager(root, 1, chkpt_on_preemption=False, read_only=True) as manager:
        with pytest.raises(CorruptCheckpointError, match=f"{name} is a "):
            bounded(lambda: manager.verify(3, deep=True))
    step, restored = bounded(lambda: restore_latest(root))
    assert step == 2 and torch.equal(restored, state_of(2)["w"])


def test_a_link_loop_among_a_steps_files_is_a_missing_file(root: Path) -> None:
    # os.path.getsize raised ELOOP (an OSError) out of the size check: verify aborted, and
    # restore raised a plain CheckpointError, so restore_latest did not fall back.
    (step_dir(root, 2) / "extra").symlink_to("extra")  # not in the record: ignored
    with CheckpointManager(root, 1, chkpt_on_preemption=False, read_only=True) as manager:
        manager.verify(2)
        data = step_dir(root, 3) / "__0_0.distcp"
        data.unlink()
        data.symlink_to(data.name)
        with pytest.raises(CorruptCheckpointError, match="missing"):
            manager.verify(3)
    step, restored = restore_latest(root)
    assert step == 2 and torch.equal(restored, state_of(2)["w"])


def test_a_link_loop_named_as_a_step_is_no_leftover(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its modification time raised ELOOP out of the leftover sweep: no manager could be made
    # on the root, and `ckptmgr ls --all` failed.
    step_dir(root, 901).symlink_to(step_dir(root, 901).name)
    assert CheckpointStorage(str(root)).leftovers() == []
    with CheckpointManager(root, 1, chkpt_on_preemption=False, leftover_grace_s=0) as manager:
        assert manager.all_steps() == list(STEPS)
    assert cli_main(["ls", str(root), "--all", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["leftovers"] == []
    assert step_dir(root, 901).is_symlink()


def test_a_dangling_commit_record_is_listed_and_never_swept(root: Path) -> None:
    # glob(3) lists it; the sweep took it for a missing record and removed the directory.
    record = step_dir(root, 3) / "commit.json"
    record.unlink()
    record.symlink_to("no-such-file")
    assert CheckpointStorage(str(root)).leftovers() == []
    with CheckpointManager(root, 1, chkpt_on_preemption=False, leftover_grace_s=0) as manager:
        assert manager.all_steps() == list(STEPS)
    assert record.is_symlink() and (step_dir(root, 3) / "__0_0.distcp").exists()


def test_reading_refuses_anything_but_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"record")
    assert read_regular_file(str(tmp_path / "file")) == b"record"
    (tmp_path / "zero").symlink_to("/dev/zero")
    for path, kind in [(tmp_path, "a directory"), (tmp_path / "zero", "a character device")]:
        with pytest.raises(NotRegularFileError, match=kind) as refused:
            read_regular_file(str(path))
        assert refused.value.errno == errno.EINVAL


@pytest.mark.parametrize("kind", ["file", "FIFO", "link to a file"])
def test_a_root_that_is_no_directory_is_named_so(
    tmp_path: Path, kind: str, fifos: Callable[[Path], None]
) -> None:
    # It raised FileExistsError: "File exists", of a root that was to be created.
    path = tmp_path / "run"
    if kind == "FIFO":
        fifos(path)
    else:
        (tmp_path / "file").write_bytes(b"")
        if kind == "file":
            (tmp_path / "file").rename(path)
        else:
            path.symlink_to(tmp_path / "file")
    with pytest.raises(NotADirectoryError, match="the checkpoint root is not a directory"):
        bounded(lambda: CheckpointManager(path, 1, chkpt_on_preemption=False))


# -- names that are not a step's own --------------------------------------------------------------
ALIASES = ["step_0000000000003", "step_" + "\u0663" * 12, "step_000000000003\n"]


@pytest.mark.parametrize("alias", ALIASES, ids=["zero too many", "arabic-indic", "newline"])
def test_another_spelling_of_a_step_is_no_step(root: Path, alias: str) -> None:
    """Such a directory was listed as step 3 while every read and delete went to
    ``step_000000000003``: with that one gone, restore_latest failed ("gone") instead of
    restoring step 2, a save of step 3 was skipped as already committed, and the sweep
    removed the directory, which the docs say of no other name."""
    shutil.copytree(step_dir(root, 3), root / alias)
    shutil.rmtree(step_dir(root, 3))
    (root / alias / "commit.json").unlink()  # as an interrupted save would leave it
    shutil.copy(step_dir(root, 2) / "commit.json", root / alias / "commit.json")
    assert CheckpointStorage(str(root)).committed_steps() == [1, 2]
    step, restored = restore_latest(root)
    assert step == 2 and torch.equal(restored, state_of(2)["w"])
    with CheckpointManager(root, 1, chkpt_on_preemption=False, leftover_grace_s=0) as manager:
        assert manager.save(3, state_of(3))
        assert manager.all_steps() == list(STEPS)
    assert (root / alias).is_dir()  # another name: never swept


# -- links ----------------------------------------------------------------------------------------
def test_a_damaged_step_linked_from_another_root_is_skipped_not_marked_there(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other = tmp_path / "other-run"
    save_steps(other, (5,))
    data = step_dir(other, 5) / "__0_0.distcp"
    data.write_bytes(b"\0" * data.stat().st_size)  # damaged, same size
    root = tmp_path / "run"
    save_steps(root, (1,))
    step_dir(root, 5).symlink_to(step_dir(other, 5))
    with caplog.at_level(logging.WARNING, logger="ckptmgr"):
        step, restored = restore_latest(root)
    assert step == 1 and torch.equal(restored, state_of(1)["w"])
    assert not (step_dir(other, 5) / "quarantined.json").exists()
    assert CheckpointStorage(str(other)).committed_steps() == [5]
    assert "is a symbolic link" in caplog.text and "is quarantined" not in caplog.text


def test_deleting_a_linked_step_removes_the_link_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other = tmp_path / "other-run"
    save_steps(other, (5,))
    before = sorted(path.name for path in step_dir(other, 5).iterdir())
    root = tmp_path / "run"
    save_steps(root, (1,))
    step_dir(root, 5).symlink_to(step_dir(other, 5))
    with CheckpointManager(root, 1, max_to_keep=1, chkpt_on_preemption=False) as manager:
        assert manager.all_steps() == [1, 5]
        with caplog.at_level(logging.WARNING, logger="ckptmgr"):
            assert manager.save(6, state_of(6))
        assert manager.all_steps() == [6]
    assert f"is a symbolic link (to {step_dir(other, 5)})" in caplog.text  # (its data stays)
    assert sorted(path.name for path in step_dir(other, 5).iterdir()) == before
    assert not [path for path in root.iterdir() if path.is_symlink()]


def test_a_file_with_a_step_name_is_left_alone(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # It was renamed to .deleting-step_... and could never be removed: a warning at every start.
    # Then it was swept as a step without its record; ckptmgr makes no such file: it is the
    # user's, and never deleted (test_a_users_files_under_the_root_are_no_leftovers).
    (root / "step_000000000007").write_bytes(b"not a step")
    for _ in range(2):
        with caplog.at_level(logging.WARNING, logger="ckptmgr"):
            CheckpointManager(root, 1, chkpt_on_preemption=False, leftover_grace_s=0).close()
    assert "could not remove" not in caplog.text
    assert sorted(path.name for path in root.iterdir() if path.name.startswith((".", "step_"))) == [
        step_dir(root, step).name for step in (*STEPS, 7)
    ]
    assert (root / "step_000000000007").read_bytes() == b"not a step"


LEASED_READ = """
import sys
from ckptmgr.local_files import open_step_file
with open_step_file(sys.argv[1], "leased.distcp") as stream:
    print("read", len(stream.read()))
"""


def test_a_step_file_under_a_kernel_lease_is_read_once_the_lease_breaks(tmp_path: Path) -> None:
    """A file under a write lease (as Samba's oplocks and NFS delegations take them): the
    non-blocking open that refuses FIFOs failed with BlockingIOError instead of waiting for
    the lease to be broken, as a plain open does."""
    import fcntl
    import signal

    from conftest import run_python

    path = tmp_path / "leased.distcp"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDWR)
    set_lease = getattr(fcntl, "F_SETLEASE", 1024)
    previous = signal.signal(signal.SIGIO, lambda *_: fcntl.fcntl(fd, set_lease, fcntl.F_UNLCK))
    try:
        try:
            fcntl.fcntl(fd, set_lease, fcntl.F_WRLCK)
        except OSError as exc:
            pytest.skip(f"no lease on this file system: {exc}")
        result = run_python(LEASED_READ, str(path), timeout=120)
    finally:
        signal.signal(signal.SIGIO, previous)
        os.close(fd)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "read 100"


def test_a_leftovers_age_is_its_own_not_that_of_what_its_links_lead_to(
    root: Path, tmp_path: Path
) -> None:
    """A leftover's age was the newest time of everything under it, links followed: a link to
    a file changed a moment ago kept a day-old leftover from being swept, a link to a big tree
    made every manager walk it (/usr: 4 s), and one to what cannot be read (EACCES) failed
    every manager of the root with a bare PermissionError."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "new").write_bytes(b"changed a moment ago")
    leftover = root / ".tmp-step_000000000009-0123456789abcdef"
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"half a save")
    (leftover / "link").symlink_to(outside / "new")
    day_ago = time.time() - 86400
    for path in (leftover / "__0_0.distcp", leftover / "link", leftover):
        os.utime(path, (day_ago, day_ago), follow_symlinks=False)
    linked = root / ".tmp-step_000000000010-0123456789abcdef"  # a leftover that is a link
    linked.symlink_to(outside / "new")
    os.utime(linked, (day_ago, day_ago), follow_symlinks=False)
    CheckpointManager(root, 1, chkpt_on_preemption=False, leftover_grace_s=3600).close()
    assert not leftover.exists() and not os.path.lexists(linked)
    assert (outside / "new").exists()


def test_a_users_files_under_the_root_are_no_leftovers(root: Path) -> None:
    """The sweep took every name starting with ``.tmp-`` or ``.deleting-`` for an interrupted
    save or delete, and a file named like a step for a step without its record: a user's
    ``.tmp-notes.txt``, ``.deleting-list.csv``, ``.tmp-my-dataset/`` and a file ``step_<N>``
    were deleted (format.md: anything else under the root is never deleted)."""
    day_ago = time.time() - 86400
    users = [".tmp-notes.txt", ".deleting-list.csv", ".tmp-my-dataset", step_dir(root, 7).name]
    for name in users:
        if name.endswith("dataset"):
            (root / name).mkdir()
            (root / name / "part-0").write_bytes(b"data")
            os.utime(root / name / "part-0", (day_ago, day_ago))
        else:
            (root / name).write_bytes(b"the user's")
        os.utime(root / name, (day_ago, day_ago))
    interrupted = [".tmp-step_000000000009-0123456789abcdef", ".deleting-step_000000000001-5"]
    for name in interrupted:
        (root / name).mkdir()
        (root / name / "__0_0.distcp").write_bytes(b"half")
        for path in (root / name / "__0_0.distcp", root / name):
            os.utime(path, (day_ago, day_ago))
    with CheckpointManager(root, 1, chkpt_on_preemption=False, leftover_grace_s=3600) as mgr:
        assert mgr.all_steps() == list(STEPS)
    left = {path.name for path in root.iterdir()}
    assert set(users) <= left, left
    assert not set(interrupted) & left, left


# -- deep trees -----------------------------------------------------------------------------------
def nest(top: Path, depth: int) -> Path:
    """``depth`` directories, one inside the other, under ``top`` (made with relative paths:
    the full path is longer than a system call takes); the innermost holds a file."""
    top.mkdir(parents=True, exist_ok=True)
    here = os.open(top, os.O_RDONLY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=here)
            inner = os.open("d", os.O_RDONLY, dir_fd=here)
            os.close(here)
            here = inner
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=here))
    finally:
        os.close(here)
    return top


def unnest(top: Path) -> None:
    """Remove what :func:`nest` made under ``top`` (``shutil.rmtree``, pytest's too, recurses
    on Python 3.11 and raises ``RecursionError``): the chain is shortened by one directory at
    a time, its rest moved up into place, so every path stays short."""
    while (top / "d" / "d").is_dir():
        os.rename(top / "d" / "d", top / "rest")
        shutil.rmtree(top / "d")
        os.rename(top / "rest", top / "d")
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def nested() -> Iterator[Callable[[Path], Path]]:
    """Makes a deep tree under a path (:func:`nest`), removed afterwards."""
    made: list[Path] = []

    def make(top: Path) -> Path:
        made.append(top)
        return nest(top, DEPTH)

    yield make
    for top in made:
        unnest(top)


DEPTH = 1200  # above Python's recursion limit (1000), where os.walk raised RecursionError


def test_a_tree_deeper_than_the_recursion_limit_is_walked(
    root: Path, nested: Callable[[Path], Path]
) -> None:
    nested(step_dir(root, 3) / "extra")
    assert len(list(walk_files(str(step_dir(root, 3) / "extra")))) == 1
    with CheckpointManager(root, 1, chkpt_on_preemption=False, read_only=True) as manager:
        manager.verify(3)
        restored = {"w": torch.zeros(64)}
        manager.restore(3, restored)
        assert torch.equal(restored["w"], state_of(3)["w"])
    leftover = nested(root / ".tmp-step_000000000009-x")  # its age: the newest time in it
    with CheckpointManager(
        root, 1, max_to_keep=1, chkpt_on_preemption=False, leftover_grace_s=0
    ) as manager:
        assert not leftover.exists()  # swept (shutil.rmtree raised RecursionError: a warning)
        assert manager.all_steps() == list(STEPS)
        assert manager.save(4, state_of(4))  # retention deletes step 3, deep tree and all
        assert manager.all_steps() == [4]
    assert sorted(path.name for path in root.iterdir() if path.name.startswith((".", "step_"))) == [
        step_dir(root, 4).name
    ]
