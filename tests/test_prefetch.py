"""Read-ahead of a step's files at the start of a restore (ckptmgr.prefetch)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ckptmgr import CheckpointManager
from ckptmgr.prefetch import Prefetch

needs_fadvise = pytest.mark.skipif(
    not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this platform"
)


def _files(tmp_path: Path, sizes: dict[str, int]) -> Path:
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(os.urandom(size))
    (tmp_path / "subdir").mkdir()
    return tmp_path


@needs_fadvise
def test_every_file_is_asked_for_within_the_budget(tmp_path: Path) -> None:
    step = _files(tmp_path, {"a.distcp": 9 * 2**20 + 5, "b.distcp": 3, ".metadata": 100})
    prefetch = Prefetch(str(step))
    prefetch.join()
    assert prefetch.requested_bytes == 9 * 2**20 + 5 + 3 + 100


@needs_fadvise
def test_the_budget_caps_what_is_asked_for(tmp_path: Path) -> None:
    step = _files(tmp_path, {"a.distcp": 5000, "b.distcp": 5000, "c.distcp": 5000})
    prefetch = Prefetch(str(step), budget_bytes=7000)
    prefetch.join()
    assert prefetch.requested_bytes == 7000


@needs_fadvise
def test_files_read_past_the_page_cache_are_not_asked_for(tmp_path: Path) -> None:
    # (a direct read does not use cached pages: the disk would read them twice)
    step = _files(tmp_path, {"a.distcp": 5000, "b.distcp": 5000, ".metadata": 100, "c.json": 7})
    prefetch = Prefetch(str(step), skip_suffixes=(".distcp",))
    prefetch.join()
    assert prefetch.requested_bytes == 107


def test_a_missing_directory_is_no_error(tmp_path: Path) -> None:
    prefetch = Prefetch(str(tmp_path / "gone"))
    prefetch.join()
    assert prefetch.requested_bytes == 0


def test_no_budget_starts_no_thread(tmp_path: Path) -> None:
    prefetch = Prefetch(str(_files(tmp_path, {"a": 10})), budget_bytes=0)
    prefetch.join()
    assert prefetch.requested_bytes == 0


def test_restore_of_a_dropped_step_is_exact(tmp_path: Path) -> None:
    """A restore whose files were dropped from the page cache (so the read-ahead has work to do)
    still returns every byte."""
    state = {f"t{i}": torch.rand(i % 7 + 1) for i in range(300)}
    state["big"] = torch.rand(2**18)
    with CheckpointManager(tmp_path, save_interval=1) as manager:
        manager.save(3, state)
        for path in tmp_path.rglob("*"):
            if path.is_file() and hasattr(os, "posix_fadvise"):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        target = {key: torch.zeros_like(value) for key, value in state.items()}
        manager.restore(3, target)
    for key, value in state.items():
        assert torch.equal(target[key], value), key
