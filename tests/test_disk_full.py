"""Disk full: a save that runs out of space fails cleanly, and training goes on.

Three kinds of full storage, all real file systems:

* a **tmpfs** of a few MiB, mounted for the test (needs root or CAP_SYS_ADMIN; skipped otherwise).
  A ballast file fills it so that exactly ``d`` pages short of what one step needs are free. The
  sweep over ``d`` makes the write run out of space in every file of a save in turn: the commit
  record, DCP's ``.metadata``, the tensor data and the plain-values file;
* an **ext4 that runs out under the page cache**: a loop device over a sparse file on a small
  tmpfs (root only), where every ``write`` succeeds and the data fails to reach the disk, so the
  error comes from the fsync (after write-behind has started the writeback);
* a **byte-budget fsspec file system** (``tinydisk://``, a subclass of fsspec's in-memory file
  system) that raises ``OSError(ENOSPC)`` once the bytes it holds would exceed its capacity. It
  takes the object-store code path (the step is written in place, no rename), and it runs on any
  machine.

Every case checks the same contract: the save raises ``CheckpointError`` whose message says there
is no space and whose cause chain holds the ``ENOSPC`` ``OSError``; the failed step's files are
gone; every earlier step is listed and restores bit-exact; and once space is freed, the same step
saves and restores.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

from ckptmgr import CheckpointError, CheckpointManager, direct_write
from ckptmgr.lease import LEASE_NAME

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

TMPFS_BYTES = 4 * 1024 * 1024
PAGE = 4096
PROTOCOL = "tinydisk"
NO_SPACE = "No space left on device"


def make_state(step: int, n: int = 3000) -> dict[str, Any]:
    """A state whose every value is a function of ``step``: ~12 KB of float32 plus plain values."""
    return {
        "model": {
            "w": torch.arange(n, dtype=torch.float32) + step,
            "ids": torch.arange(64, dtype=torch.int64) * step,
        },
        "step": step,
        "name": f"step-{step}",
    }


def blank_state(n: int = 3000) -> dict[str, Any]:
    """The structure of :func:`make_state` with values no step has."""
    return {
        "model": {
            "w": torch.full((n,), -1.0),
            "ids": torch.full((64,), -1, dtype=torch.int64),
        },
        "step": -1,
        "name": "",
    }


def assert_restores(manager: CheckpointManager, step: int) -> None:
    """``step`` restores bit-exact into a blank state."""
    restored = blank_state()
    manager.restore(step, restored)
    expected = make_state(step)
    for key, tensor in expected["model"].items():
        got = restored["model"][key]
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), f"step {step}: {key}"
    assert (restored["step"], restored["name"]) == (expected["step"], expected["name"])


def error_chain(error: BaseException) -> list[BaseException]:
    """``error`` and everything it was raised from or while handling, outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def assert_no_space_error(error: CheckpointError, *, check_message: bool = True) -> None:
    """The error holds the ENOSPC OSError and (unless told otherwise) says so in its message."""
    chain = error_chain(error)
    assert any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in chain), (
        f"no ENOSPC OSError in the error chain: {[repr(e) for e in chain]}"
    )
    if check_message:
        assert NO_SPACE in str(error), f"the message does not say the disk is full: {error}"


def save_and_get_error(
    manager: CheckpointManager, step: int, *, use_async: bool, n: int = 3000
) -> CheckpointError:
    """Save ``step`` (sync or async + join); the save must fail with CheckpointError."""
    state = make_state(step, n)
    with pytest.raises(CheckpointError) as caught:
        if use_async:
            assert manager.save_async(step, state) is True
            manager.join()
        else:
            manager.save(step, state)
    return caught.value


# -- a real tmpfs ------------------------------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A freshly mounted tmpfs of TMPFS_BYTES; skipped where mounting is not allowed."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], timeout=30, check=False)


def free_bytes(path: Path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def fill_to(disk: Path, free: int) -> Path:
    """Write a ballast file so that exactly ``free`` bytes stay available on ``disk``."""
    ballast = disk / "ballast"
    ballast.unlink(missing_ok=True)
    size = free_bytes(disk) - free
    assert size >= 0, f"only {free_bytes(disk)} bytes free, wanted {free}"
    with open(ballast, "wb") as handle:
        handle.write(b"\0" * size)
        handle.flush()
        os.fsync(handle.fileno())
    assert free_bytes(disk) == free, f"{free_bytes(disk)} bytes free after the ballast, not {free}"
    return ballast


def only_committed_steps(root: Path) -> list[int]:
    """Every entry of ``root`` (but the owner lease) must be a committed step; their steps."""
    names = sorted(name for name in os.listdir(root) if name != LEASE_NAME)
    leftovers = [
        n for n in names if not (n.startswith("step_") and (root / n / "commit.json").exists())
    ]
    assert not leftovers, f"the failed save left files behind: {leftovers}"
    return [int(n.removeprefix("step_")) for n in names]


def step_pages(disk: Path, root: Path, step: int) -> int:
    """Pages that the files of one committed step take on ``disk``."""
    step_dir = root / f"step_{step:012d}"
    return sum(-(-entry.stat().st_size // PAGE) for entry in step_dir.iterdir())


def test_tmpfs_full_at_every_write_of_a_save(tmpfs: Path) -> None:
    """Short of 1, 2, ... pages: every file of the save in turn is the one that hits ENOSPC."""
    root = tmpfs / "ckpts"
    with CheckpointManager(root, save_interval=1, chkpt_on_preemption=False) as manager:
        before = free_bytes(tmpfs)
        assert manager.save(0, make_state(0))
        needed = before - free_bytes(tmpfs)
        pages = step_pages(tmpfs, root, 0)
        assert needed == pages * PAGE, f"a step took {needed} bytes, its files {pages} pages"
        assert pages >= 4, f"expected 4 files of at least a page each, got {pages} pages"

        # With exactly enough space the save succeeds: the sweep below fails for lack of space
        # and for nothing else.
        ballast = fill_to(tmpfs, needed)
        assert manager.save(1, make_state(1))
        ballast.unlink()

        committed = [0, 1]
        step = 2
        for short in range(1, pages + 1):
            for use_async in (False, True):
                ballast = fill_to(tmpfs, needed - short * PAGE)
                error = save_and_get_error(manager, step, use_async=use_async)
                assert_no_space_error(error, check_message=False)
                # The failed save left nothing: the root holds exactly the committed steps.
                assert only_committed_steps(root) == committed
                assert manager.all_steps() == committed
                for earlier in committed[-2:]:
                    assert_restores(manager, earlier)
                # Space comes back: the same step saves and restores; training goes on.
                ballast.unlink()
                assert manager.save(step, make_state(step)), f"step {step} after freeing space"
                committed.append(step)
                assert_restores(manager, step)
                step += 1
        assert only_committed_steps(root) == committed

    with CheckpointManager(root, save_interval=1, chkpt_on_preemption=False) as fresh:
        assert fresh.all_steps() == committed
        for earlier in committed:
            assert_restores(fresh, earlier)


def test_tmpfs_full_in_the_tensor_data_says_no_space(tmpfs: Path) -> None:
    """Running out of space inside DCP's tensor file: the message must say "No space left"."""
    root = tmpfs / "ckpts"
    with CheckpointManager(root, save_interval=1, chkpt_on_preemption=False) as manager:
        # The plain values fit; the 400 KB tensor file runs out of space in the middle of
        # torch.save, whose zip writer then raises a RuntimeError ("unexpected pos").
        fill_to(tmpfs, 8 * PAGE)
        for step, use_async in ((1, False), (2, True)):
            error = save_and_get_error(manager, step, use_async=use_async, n=100_000)
            assert_no_space_error(error)


def test_tmpfs_full_commit_record_says_no_space(tmpfs: Path) -> None:
    """Short of the last page (the commit record): the message already says why."""
    root = tmpfs / "ckpts"
    with CheckpointManager(root, save_interval=1, chkpt_on_preemption=False) as manager:
        before = free_bytes(tmpfs)
        assert manager.save(0, make_state(0))
        needed = before - free_bytes(tmpfs)
        fill_to(tmpfs, needed - PAGE)
        error = save_and_get_error(manager, 1, use_async=False)
        assert_no_space_error(error)
        assert only_committed_steps(root) == [0]


# -- an ext4 disk whose space runs out under the page cache -------------------------------------


@pytest.fixture
def thin_ext4(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB ext4 file system on a loop device whose backing file is sparse, on a tmpfs of
    16 MiB: ext4 sees free space (``write`` succeeds into the page cache), while writing the
    pages out to the disk fails once the tmpfs below is full (as on a thin-provisioned volume
    that ran out). Skipped where mounting is not allowed."""
    for tool in ("mount", "mkfs.ext4"):
        if shutil.which(tool) is None:
            pytest.skip(f"no {tool} command")
    backing, mount_point = tmp_path / "backing", tmp_path / "ext4"
    backing.mkdir()
    mount_point.mkdir()
    image = backing / "disk.img"

    def run(*command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)

    mounted: list[Path] = []
    try:
        result = run("mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(backing))
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.strip()}")
        mounted.append(backing)
        with open(image, "wb") as handle:
            handle.truncate(64 * 2**20)
        options = "lazy_itable_init=1,lazy_journal_init=1"
        result = run("mkfs.ext4", "-q", "-F", "-E", options, str(image))
        assert result.returncode == 0, result.stderr
        result = run("mount", "-o", "loop", str(image), str(mount_point))
        if result.returncode != 0:
            pytest.skip(f"cannot mount a loop device here: {result.stderr.strip()}")
        mounted.append(mount_point)
        yield mount_point
    finally:
        for path in reversed(mounted):
            run("umount", "-l", str(path))


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "page-cache"])
@pytest.mark.parametrize("mode", ["save", "thread", "process"])
def test_ext4_failing_to_write_back_fails_the_save_and_keeps_the_last_step(
    thin_ext4: Path, mode: str, direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second save's data cannot reach the disk. Written directly (ckptmgr.direct_write),
    the write itself fails; through the page cache (direct writes off), every ``write``
    succeeds and the error of the writeback (started early by write-behind, see
    ckptmgr.writeback) reaches the save through the fsync. Either way, in the checkpoint daemon
    too, the step is not committed, and the one before still restores."""
    monkeypatch.setattr(direct_write, "DIRECT_WRITES", direct)
    monkeypatch.setenv(direct_write.DIRECT_WRITES_VARIABLE, "1" if direct else "0")  # the daemon
    root = thin_ext4 / "ckpts"
    async_mode = "process" if mode == "process" else "thread"
    with CheckpointManager(
        root, save_interval=1, chkpt_on_preemption=False, async_mode=async_mode
    ) as manager:
        assert manager.save(0, make_state(0))
        large = 6 * 2**20  # 24 MiB of float32: more than the 16 MiB below ext4 can take
        error = save_and_get_error(manager, 1, use_async=mode != "save", n=large)
        chain = error_chain(error)
        assert any(
            isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EIO) for e in chain
        ), f"no ENOSPC or EIO OSError in the error chain: {[repr(e) for e in chain]}"
        assert manager.all_steps() == [0]
        assert not (root / f"step_{1:012d}").exists()
        assert_restores(manager, 0)


# -- an fsspec file system with a byte budget --------------------------------------------------


class TinyDiskFile(MemoryFile):
    """A memory file whose writes are charged against the file system's capacity."""

    def write(self, data: Any) -> int:
        TinyDisk.charge(len(memoryview(data).cast("B")))
        return super().write(data)


class TinyDisk(MemoryFileSystem):
    """fsspec's in-memory file system, with its own store and a capacity in bytes.

    A write that would make the stored bytes exceed ``capacity`` raises
    ``OSError(ENOSPC)``; deleting files frees their bytes. Class-level state, because fsspec
    caches one instance per thread and DCP writes from its own threads.
    """

    protocol = (PROTOCOL,)
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]
    capacity: ClassVar[int | None] = None
    refused: ClassVar[list[OSError]] = []

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str):
            path = path.removeprefix(f"{PROTOCOL}://")
        return super()._strip_protocol(path)

    @classmethod
    def used(cls) -> int:
        return sum(len(file.getvalue()) for file in cls.store.values())

    @classmethod
    def charge(cls, nbytes: int) -> None:
        """Raise ENOSPC if ``nbytes`` more would not fit."""
        if cls.capacity is not None and cls.used() + nbytes > cls.capacity:
            error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            cls.refused.append(error)
            raise error

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        writing = any(flag in mode for flag in "wxa+")
        data = kwargs.get("data")
        if writing and data:  # pipe_file passes the whole content at once
            self.charge(len(data))
        handle = super()._open(path, mode, **kwargs)
        if writing and type(handle) is MemoryFile:
            handle.__class__ = TinyDiskFile
        return handle


@pytest.fixture
def tinydisk() -> Iterator[type[TinyDisk]]:
    """The byte-budget file system, empty and unlimited, registered as ``tinydisk://``."""
    TinyDisk.store.clear()
    TinyDisk.pseudo_dirs[:] = [""]
    TinyDisk.capacity = None
    TinyDisk.refused.clear()
    TinyDisk.clear_instance_cache()
    fsspec.register_implementation(PROTOCOL, TinyDisk, clobber=True)
    yield TinyDisk
    TinyDisk.store.clear()
    TinyDisk.pseudo_dirs[:] = [""]
    TinyDisk.capacity = None
    TinyDisk.clear_instance_cache()


def stored_steps(fs: type[TinyDisk]) -> dict[str, list[str]]:
    """Top-level entry under the root -> the names of its files."""
    found: dict[str, list[str]] = {}
    for path in fs.store:
        parts = path.strip("/").split("/")
        if parts[1] == LEASE_NAME:
            continue
        found.setdefault(parts[1], []).append("/".join(parts[2:]))
    return found


def test_byte_budget_full_at_every_file_of_a_save(tinydisk: type[TinyDisk]) -> None:
    """A budget short of one step by 64 bytes up to the whole step: clean failure every time."""
    url = f"{PROTOCOL}://budget"
    with CheckpointManager(url, save_interval=1, chkpt_on_preemption=False) as manager:
        assert manager.save(0, make_state(0))
        step_files = {p: f for p, f in tinydisk.store.items() if "/step_000000000000/" in p}
        file_sizes = sorted(len(f.getvalue()) for f in step_files.values())
        per_step = sum(file_sizes)
        # Shortfalls that make each file in turn the one that no longer fits (the last file
        # written is the commit record, the first the plain values). The margin covers the few
        # bytes by which .metadata and commit.json differ from one step to the next.
        margin = 64
        cuts = [margin, *(sum(file_sizes[:i]) + margin for i in range(1, len(file_sizes)))]
        cuts = sorted({*cuts, per_step})
        committed = [0]
        step = 1
        for cut in cuts:
            for use_async in (False, True):
                tinydisk.refused.clear()
                tinydisk.capacity = tinydisk.used() + per_step - cut
                error = save_and_get_error(manager, step, use_async=use_async)
                assert tinydisk.refused, "the save failed, but not for lack of space"
                assert_no_space_error(error, check_message=False)
                assert any(e is tinydisk.refused[0] for e in error_chain(error))
                stored = stored_steps(tinydisk)
                assert sorted(stored) == [f"step_{s:012d}" for s in committed], (
                    f"the failed save of step {step} left files behind: {sorted(stored)}"
                )
                assert manager.all_steps() == committed
                assert_restores(manager, committed[-1])
                tinydisk.capacity = None  # space is back
                assert manager.save(step, make_state(step))
                committed.append(step)
                assert_restores(manager, step)
                step += 1

    with CheckpointManager(url, save_interval=1, chkpt_on_preemption=False) as fresh:
        assert fresh.all_steps() == committed
        for earlier in committed:
            assert_restores(fresh, earlier)


def test_byte_budget_full_plain_values_say_no_space(tinydisk: type[TinyDisk]) -> None:
    """No room at all: the first file (the plain values) fails and the message says why."""
    url = f"{PROTOCOL}://budget-msg"
    with CheckpointManager(url, save_interval=1, chkpt_on_preemption=False) as manager:
        assert manager.save(0, make_state(0))
        tinydisk.capacity = tinydisk.used()
        error = save_and_get_error(manager, 1, use_async=False)
        assert_no_space_error(error)
        tinydisk.capacity = None
        assert manager.save(1, make_state(1))
        assert manager.all_steps() == [0, 1]
