"""Starting the disk's work on a data file while the rest of it is still being written.

For a data file written through the page cache: where the file system refuses direct writes,
or they are turned off (:mod:`ckptmgr.direct_write`, which is faster where it applies).

A file written with ``write`` calls and then fsynced keeps the disk idle until the fsync: the
kernel holds the written pages in memory (well under its dirty-page limits for a checkpoint
that fits in memory) and writes them out only when asked. Asking for each written stretch to
be written out at once (Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which queues the
writeback and returns) lets the disk write the first bytes while later ones are copied into the
page cache, and the final fsync waits for the last stretch only. PostgreSQL
(``checkpoint_flush_after``) and RocksDB (``bytes_per_sync``) do the same.

Measured on the benchmark machine (2 cores, ext4 on a virtual disk) by
``benchmarks/bench_write_behind.py``: 1152 MiB written in 16 MiB calls and fsynced took 0.78-0.82x
the time of the plain write (medians of per-round ratios, two runs of 7 rounds) with a writeback
started every 4, 8 or 16 MiB, 0.85-0.86x every 32 or 64 MiB, and 0.97x every 256 MiB. The cost:
the kernel's writeback now runs while the write calls do, on the same cores, so a compute-bound
loop beside a thread-mode save of 1 GiB lost about 0.3 s more per save there (docs/benchmarks.md,
"Full run at 55794b1").

Only a hint: where the call does not exist (not Linux) or fails, nothing happens, and the fsync
at the end makes the file durable either way.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import cast

WRITE_BEHIND_BYTES = 16 * 2**20
"""A written stretch of this many bytes is handed to the disk at once (see the module's note)."""

_SYNC_FILE_RANGE_WRITE = 2  # (linux/fs.h)


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError, TypeError):  # not Linux (or a libc without it)
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return cast(Callable[[int, int, int, int], int], function)


_SYNC_FILE_RANGE = _sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Ask the kernel to start writing the ``nbytes`` bytes at ``offset`` of the file open as
    ``fd`` to its disk, without waiting for them (the GIL is released during the call). True
    when the kernel took the request; False where the call is not available or was refused (a
    pipe, say): a hint only, never an error."""
    if _SYNC_FILE_RANGE is None or nbytes <= 0:
        return False
    return bool(_SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0)


class WriteBehind:
    """Starts the writeback of a file being appended to (from ``offset``) every ``stretch``
    bytes written (:data:`WRITE_BEHIND_BYTES` unless given).

    The writer asks :meth:`room` how much to write before the next start (so that a long
    ``write`` is cut where a stretch ends) and reports each write to :meth:`wrote`.
    """

    def __init__(self, fd: int, stretch: int | None = None, *, offset: int = 0) -> None:
        stretch = WRITE_BEHIND_BYTES if stretch is None else stretch
        if stretch <= 0:
            raise ValueError(f"stretch must be positive, not {stretch}")
        self._fd = fd
        self._stretch = stretch
        self._end = offset  # where the next byte is written
        self.handed_over = offset
        """Where the bytes end whose writeback was asked for (``offset`` at first)."""
        self.starts = 0
        """How many writebacks the kernel took (one per stretch where it has the call)."""

    def room(self) -> int:
        """Bytes to write before the current stretch is full."""
        return self._stretch - (self._end - self.handed_over)

    def wrote(self, count: int) -> None:
        """``count`` more bytes were appended; starts the writeback of a full stretch."""
        self._end += count
        if self._end - self.handed_over >= self._stretch:
            if start_writeback(self._fd, self.handed_over, self._end - self.handed_over):
                self.starts += 1
            self.handed_over = self._end
