"""For tests of reads and writes that go past the page cache (``O_DIRECT``): what of a file the
kernel holds in its page cache (Linux: ``mincore``), dropping a file from it, and a filesystem
that refuses ``O_DIRECT``."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path

import pytest

from ckptmgr.direct_io import open_for_direct_io


def resident_pages(paths: list[Path]) -> tuple[int, int]:
    """(pages of the files ``paths`` in the page cache, pages of those files), from the
    kernel."""
    resident = total = 0
    for path in paths:
        in_cache, pages = _resident_pages_of(path)
        resident += in_cache
        total += pages
    return resident, total


def _resident_pages_of(path: Path) -> tuple[int, int]:
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    if not size:
        return 0, 0
    with open(path, "rb") as handle:
        # (a private, writable mapping, so that ctypes can give its address; never written)
        mapping = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY)
    start = ctypes.c_char.from_buffer(mapping)
    vector = (ctypes.c_ubyte * pages)()
    failed = libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), vector)
    del start
    mapping.close()
    if failed:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(byte & 1 for byte in vector), pages


def drop_from_page_cache(path: Path) -> None:
    """Ask the kernel to drop ``path`` (a file, or every file under a directory) from its page
    cache (a hint: dirty or mapped pages stay)."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def refuse_o_direct_at_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: from now on (for the test), ``open`` with ``O_DIRECT`` fails with
    ``EINVAL``, as on tmpfs before Linux 6.6."""
    real_open = os.open

    def refusing_open(path: str | os.PathLike[str], flags: int, *args: int) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)


def skip_without_o_direct(directory: Path) -> None:
    """Skip the test where the filesystem of ``directory`` takes no ``O_DIRECT``."""
    probe = directory / ".o-direct-probe"
    probe.touch()
    try:
        fd = open_for_direct_io(probe, os.O_RDONLY)
    finally:
        probe.unlink()
    if fd is None:
        pytest.skip(f"{directory} takes no O_DIRECT")
    os.close(fd)
