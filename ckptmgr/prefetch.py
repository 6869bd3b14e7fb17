"""Read-ahead of a local step's files while a restore does its Python work.

A restore first parses the commit record and matches the state against it (per-tensor Python
work: tens of milliseconds for a state of many thousand small tensors) and only then reads the
data. Asking the kernel to read the files ahead (``POSIX_FADV_WILLNEED``) as the restore starts
lets the disk work during that time, so the later reads come from the page cache.

Only the first :data:`PREFETCH_BUDGET_BYTES` of a step are asked for: the Python work before the
reads is per tensor, not per byte, so a checkpoint of large tensors has little of it to hide, and
reading gigabytes ahead could evict pages before the restore reads them. It is a hint only: any
error is ignored, and where the call does not exist (macOS) nothing is done.

Where the restore reads data files past the page cache (direct reads on,
:mod:`ckptmgr.direct_read`), they are not asked for: a direct read does not use cached pages, so
the disk would read them twice.
"""

from __future__ import annotations

import os
import threading

PREFETCH_BUDGET_BYTES = 64 * 2**20
"""At most this many bytes of a step's files are read ahead: about what a disk reads (at 1-2
GB/s) during the 50 ms of Python work that a restore of 20,000 small tensors does first. In an
A/B run of a 1 GiB restore here, reading 256 MiB ahead made no difference beyond the noise."""
_HINT_BYTES = 4 * 2**20
"""Bytes per hint: Linux 6.x reads only part of a longer range asked for in one call (seen here:
a 20 MiB hint left most of the file to be read later; 4 MiB hints read all of it)."""


class Prefetch:
    """Read-ahead of the files of one local step directory, on a thread of its own (the hint can
    block while the kernel queues the reads)."""

    def __init__(
        self,
        step_path: str,
        budget_bytes: int = PREFETCH_BUDGET_BYTES,
        *,
        skip_suffixes: tuple[str, ...] = (),
    ) -> None:
        """``skip_suffixes``: files whose names end so are not asked for."""
        self._step_path = step_path
        self._budget = budget_bytes
        self._skip_suffixes = skip_suffixes
        self.requested_bytes = 0
        """Bytes asked for so far (for tests and logs)."""
        self._thread: threading.Thread | None = None
        if hasattr(os, "posix_fadvise") and budget_bytes > 0:
            self._thread = threading.Thread(target=self._run, name="ckptmgr-prefetch", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            entries = sorted(os.scandir(self._step_path), key=lambda entry: entry.name)
        except OSError:
            return
        for entry in entries:
            if self.requested_bytes >= self._budget:
                return
            try:
                if not entry.is_file(follow_symlinks=False) or (
                    self._skip_suffixes and entry.name.endswith(self._skip_suffixes)
                ):
                    continue
                length = min(entry.stat().st_size, self._budget - self.requested_bytes)
                fd = os.open(entry.path, os.O_RDONLY)
                try:
                    for offset in range(0, length, _HINT_BYTES):
                        hinted = min(_HINT_BYTES, length - offset)
                        os.posix_fadvise(fd, offset, hinted, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)
            except OSError:
                continue
            self.requested_bytes += length

    def join(self, timeout_s: float = 10.0) -> None:
        """Wait (at most ``timeout_s``) until every hint is given."""
        if self._thread is not None:
            self._thread.join(timeout_s)
