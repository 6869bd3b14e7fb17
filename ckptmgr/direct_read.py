"""Reading a data file past the page cache (``O_DIRECT``) during a restore.

A restore reads each data file once, into the destination tensors. Through the page cache the
kernel first reads every byte into cache pages, copies it out, and keeps the pages (a
checkpoint of several GiB evicts what the training process had cached, and the next write
must reclaim them). With ``O_DIRECT`` the disk puts the bytes into memory given by the
caller.

Direct I/O wants the file offset, the length and the memory address aligned
(:data:`~ckptmgr.direct_io.DIRECT_ALIGN`). Where a destination's address lines up with
its file offset (pinned host pieces of a restore to a GPU, page-aligned buffers) its whole
blocks are read straight into it. Other bytes (torch's CPU tensors start 64 bytes past a page)
go through a window: :data:`~ckptmgr.direct_io.BOUNCE_BYTES` of the file read into a
reused aligned buffer and copied out (``memmove``, GIL released), while the next window of a
file read in order is already being read on a helper thread. Where the filesystem refuses
``O_DIRECT`` (at ``open`` or at the first read) everything is read through the page cache.

Measured on the benchmark machine (2 cores, ext4 on a virtual disk whose reads stall at times
for a second or more): restores of 1 GiB in 64 tensors, direct and through the page cache in
random order in one process, took medians of 0.65, 0.83 and 1.12 s against 2.00, 1.11 and
1.77 s in three runs, and used 0.53-0.60 s of CPU against 0.80-1.31 s. But two runs of
``bench_save.py`` (a) were even (0.62, 0.74 s against 0.56, 0.68 s), and restores of (b)
(1.2 GB in 48 tensors of up to 64 MiB) were slower: 1.98 and 0.89 s against 1.10 and 0.57 s
in ``bench_save.py``, 2.03 s against 1.76 s (windows of 64 MiB: 1.62 s) in a throwaway script,
where the reads waited for the disk at about 0.6 GB/s, one window at a time, while the page
cache's own read-ahead kept more in flight. Hence off by default (docs/benchmarks.md, "Direct
reads").
"""

from __future__ import annotations

import ctypes
import errno
import os
from concurrent.futures import Future, ThreadPoolExecutor

from ckptmgr.direct_io import (
    BOUNCE_BYTES,
    DIRECT_ALIGN,
    BounceBuffer,
    address_of,
    give_back_bounce_buffer,
    open_for_direct_io,
    take_bounce_buffer,
)

DIRECT_READS_VARIABLE = "CKPTMGR_DIRECT_READS"
"""Environment variable that turns direct reads on when set to ``1`` (read at import)."""

DIRECT_READS = os.environ.get(DIRECT_READS_VARIABLE, "0").strip() not in ("", "0")
"""Read local data files with ``O_DIRECT`` where the filesystem takes it (Linux). Off by
default (``CKPTMGR_DIRECT_READS=1`` turns it on): on the benchmark machine a restore of the
MLP + AdamW state (b) took longer read directly than through the page cache (below)."""

DIRECT_READ_BYTES = 64 * 2**20
"""Largest single direct read into a caller's buffer (a larger aligned stretch is read in
several)."""


def open_direct_read(path: str | os.PathLike[str]) -> int | None:
    """A descriptor of ``path`` for direct reads; None where the platform or the filesystem has
    no ``O_DIRECT`` (or :data:`DIRECT_READS` is off)."""
    return open_for_direct_io(path, os.O_RDONLY) if DIRECT_READS else None


class _Window:
    """The file's bytes [start, start + length) in a bounce buffer (``length`` falls short of
    the buffer only at the end of the file)."""

    def __init__(self, buffer: BounceBuffer) -> None:
        self.buffer = buffer
        self.start = 0
        self.length = 0
        self.ahead: Future[int] | None = None
        """The read of this window on the helper thread, while it is in flight."""

    @property
    def end(self) -> int:
        return self.start + self.length

    def holds(self, position: int) -> bool:
        return self.start <= position < self.end


class DirectReader:
    """Fills buffers with a file's bytes at any offsets: aligned blocks with ``O_DIRECT``
    (``direct_fd``, None for none), straight into the buffer where its address lines up with
    the file offset and through a window otherwise; everything through the page cache
    (``buffered_fd``) where there are no direct reads or the filesystem refused one.

    The counts of bytes read each way (:attr:`direct_bytes` into the callers' memory,
    :attr:`copied_bytes` out of windows, :attr:`buffered_bytes`) are kept for tests and
    benchmarks. Not thread-safe: one reader per thread.
    """

    def __init__(self, direct_fd: int | None, buffered_fd: int) -> None:
        self._direct_fd = direct_fd
        self._buffered_fd = buffered_fd
        self._current: _Window | None = None  # the window last read
        self._next: _Window | None = None  # a second buffer, the next window read ahead
        self._helper: ThreadPoolExecutor | None = None
        self.direct_bytes = 0
        self.copied_bytes = 0
        self.buffered_bytes = 0

    @property
    def direct(self) -> bool:
        """True while reads go past the page cache."""
        return self._direct_fd is not None

    def read(self, piece: memoryview, offset: int) -> int:
        """Fill ``piece`` (writable) with the file's bytes from ``offset``; returns the count
        read, less than ``piece.nbytes`` only where the file ends first. The GIL is released
        during reads and copies."""
        address = address_of(piece)
        done = 0
        while done < piece.nbytes:
            position = offset + done
            if self._direct_fd is None:
                return done + self._pread_buffered(piece[done:], position)
            window = self._window_holding(position)
            if window is not None:
                count = min(piece.nbytes - done, window.end - position)
                self._copy_out(window, position, piece, done, address, count)
                done += count
                continue
            left = piece.nbytes - done
            lines_up = address is not None and (address + done - position) % DIRECT_ALIGN == 0
            if lines_up and position % DIRECT_ALIGN == 0 and left >= DIRECT_ALIGN:
                count = min(left - left % DIRECT_ALIGN, DIRECT_READ_BYTES)
                got = self._pread_direct(piece[done : done + count], position)
                if got is None:
                    continue  # refused: from now on through the page cache
                self.direct_bytes += got
                done += got
                if got < count:
                    return done  # the end of the file
                continue
            window = self._fill(position - position % DIRECT_ALIGN)
            if window is None:
                continue  # refused
            if not window.holds(position):
                return done  # the end of the file
        return done

    def close(self) -> None:
        """Wait for a read in flight, close the direct descriptor and return the buffers for
        reuse (not the buffered descriptor: the caller's)."""
        for window in (self._current, self._next):
            if window is not None and window.ahead is not None:
                try:
                    window.ahead.result()
                except BaseException:  # (dropped: the read was never used)
                    pass
        if self._helper is not None:
            self._helper.shutdown(wait=True)
            self._helper = None
        for window in (self._current, self._next):
            if window is not None:
                give_back_bounce_buffer(window.buffer)
        self._current = self._next = None
        self._stop_direct()

    # -- windows ------------------------------------------------------------------------------
    def _window_holding(self, position: int) -> _Window | None:
        """The window that holds ``position``: the current one, or the one read ahead (which
        then becomes current, and the window after it is read ahead)."""
        current = self._current
        if current is not None and current.holds(position):
            return current
        ahead = self._next
        if ahead is None or ahead.ahead is None:
            return None
        if not ahead.start <= position < ahead.start + BOUNCE_BYTES:
            return None
        future, ahead.ahead = ahead.ahead, None
        try:
            ahead.length = future.result()
        except OSError:
            ahead.length = 0  # read again on this thread, where its error is raised or handled
            return None
        self._current, self._next = ahead, current
        if ahead.length == BOUNCE_BYTES:
            self._read_ahead(ahead.end)
        return ahead if ahead.holds(position) else None

    def _fill(self, start: int) -> _Window | None:
        """Read the window at ``start`` (a block boundary) on this thread and read the next
        one ahead; None where the filesystem refused (direct reads are off then)."""
        window = self._spare()
        window.start, window.length = start, 0
        got = self._pread_direct(memoryview(window.buffer.memory), start)
        if got is None:
            return None
        window.length = got
        if window is not self._current:
            self._current, self._next = window, self._current
        if got == BOUNCE_BYTES:
            self._read_ahead(window.end)
        return window

    def _spare(self) -> _Window:
        """A window whose buffer no read is filling (the older of the two)."""
        if self._current is None:
            self._current = _Window(take_bounce_buffer())
            return self._current
        if self._next is None:
            self._next = _Window(take_bounce_buffer())
        spare = self._next
        if spare.ahead is not None:  # a read ahead that is not wanted: let it end first
            try:
                spare.ahead.result()
            except OSError:
                pass
            spare.ahead = None
        spare.length = 0
        return spare

    def _read_ahead(self, start: int) -> None:
        """Start reading the window at ``start`` into the spare buffer on the helper thread."""
        fd = self._direct_fd
        if fd is None:
            return
        window = self._spare()
        window.start, window.length = start, 0
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="ckptmgr-read-ahead")
        memory = memoryview(window.buffer.memory)
        window.ahead = self._helper.submit(_pread_all, fd, memory, start)
        self._next = window

    def _copy_out(
        self,
        window: _Window,
        position: int,
        piece: memoryview,
        done: int,
        address: int | None,
        count: int,
    ) -> None:
        source = window.buffer.address + position - window.start
        if address is not None:
            ctypes.memmove(address + done, source, count)  # (ctypes releases the GIL)
        else:
            start = position - window.start
            piece[done : done + count] = window.buffer.memory[start : start + count]
        self.copied_bytes += count

    # -- system calls -------------------------------------------------------------------------
    def _pread_direct(self, data: memoryview, offset: int) -> int | None:
        """Read into ``data`` at ``offset`` directly until it is full or the file ends; None
        (nothing read, direct reads off from now on) where the filesystem refuses them."""
        assert self._direct_fd is not None
        try:
            return _pread_all(self._direct_fd, data, offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._stop_direct()
            return None

    def _pread_buffered(self, data: memoryview, offset: int) -> int:
        done = 0
        while done < data.nbytes:
            count = os.preadv(self._buffered_fd, [data[done:]], offset + done)
            if count == 0:
                break
            done += count
        self.buffered_bytes += done
        return done

    def _stop_direct(self) -> None:
        fd, self._direct_fd = self._direct_fd, None
        if fd is not None:
            if self._next is not None and self._next.ahead is not None:
                try:  # (the helper reads with this descriptor)
                    self._next.ahead.result()
                except OSError:
                    pass
                self._next.ahead = None
            os.close(fd)
        for window in (self._current, self._next):
            if window is not None:
                window.length = 0  # nothing more is served from them


def _pread_all(fd: int, data: memoryview, offset: int) -> int:
    """``preadv`` into ``data`` at ``offset`` until it is full or the file ends; the count."""
    done = 0
    while done < data.nbytes:
        count = os.preadv(fd, [data[done:]], offset + done)
        if count == 0:
            break
        done += count
        if count % DIRECT_ALIGN:
            break  # short of a block: the end of the file
    return done
