"""Reading and walking a local checkpoint root without trusting what is in it.

A root may hold what no save wrote: a FIFO where a record is expected (a plain ``open`` and
``read`` of it waits for a writer for ever), a link to ``/dev/zero`` (read until memory runs
out), a tree nested deeper than Python's recursion limit (``os.walk`` recurses on Python 3.11).
These helpers read regular files only and walk trees with a loop.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Iterator
from typing import BinaryIO

from ckptmgr.errors import CorruptCheckpointError

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


LEASE_BREAK_WAIT_S = 90.0
"""How long an open waits for a file's lease to be broken (the kernel breaks one its holder
keeps after ``/proc/sys/fs/lease-break-time``, 45 s by default)."""


class NotRegularFileError(OSError):
    """A path that should be a file is something else (a directory, a FIFO, a device)."""


def open_regular_file(path: str | os.PathLike[str], *, buffering: int = -1) -> BinaryIO:
    """``open(path, "rb")`` of the regular file ``path`` (a link to one is followed). Anything
    else raises :class:`NotRegularFileError` before a byte is read: a FIFO is opened without
    waiting for a writer (``O_NONBLOCK``), a link to ``/dev/zero`` is not read for ever, and a
    socket cannot be opened at all (``ENXIO``, an ``OSError``)."""
    deadline = time.monotonic() + LEASE_BREAK_WAIT_S
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            break
        except BlockingIOError:  # a file under a lease (Samba, NFS), whose break this started
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)  # (opened again without O_NONBLOCK, a FIFO put there would hang)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
            raise NotRegularFileError(errno.EINVAL, f"{kind}, not a regular file", os.fspath(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def open_step_file(path: str | os.PathLike[str], name: str, *, buffering: int = -1) -> BinaryIO:
    """:func:`open_regular_file` of a step's file ``name``, where anything but a regular file
    is damage: ``CorruptCheckpointError`` naming it."""
    try:
        return open_regular_file(path, buffering=buffering)
    except NotRegularFileError as exc:
        raise CorruptCheckpointError(f"{name} is {exc.strerror}", path=name) from exc


def read_regular_file(path: str) -> bytes:
    """The bytes of the regular file ``path``, opened by :func:`open_regular_file`."""
    with open_regular_file(path) as handle:
        return handle.read()


def walk_files(top: str) -> Iterator[str]:
    """The path of every file under the directory ``top``, as ``os.walk(top)`` lists them
    (links to directories are not followed, and are not files; every other entry is; a
    directory that cannot be listed, ``top`` too, is skipped), with a loop instead of
    recursion."""
    pending = [top]
    while pending:
        directory = pending.pop()
        try:
            with os.scandir(directory) as listing:
                entries = list(listing)
        except OSError:
            continue
        for entry in entries:
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            if not is_dir:
                yield entry.path
            elif not entry.is_symlink():
                pending.append(entry.path)


def remove_tree_iteratively(top: str) -> None:
    """Remove the directory ``top`` and everything under it with a loop (links are removed,
    never followed): for a tree ``shutil.rmtree`` cannot remove for its depth. Raises the
    ``OSError`` of what cannot be removed."""
    pending = [top]
    while pending:
        directory = pending[-1]
        with os.scandir(directory) as listing:
            entries = list(listing)
        below = [entry.path for entry in entries if entry.is_dir(follow_symlinks=False)]
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                os.unlink(entry.path)
        if below:
            pending.extend(below)  # (this directory is listed again once they are gone)
        else:
            os.rmdir(directory)
            pending.pop()
