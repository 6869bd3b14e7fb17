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
reused aligned buffer and copied out (``memmove``, GIL released), while the next
:data:`READ_AHEAD_WINDOWS` windows of a file read in order are already being read on helper
threads. Where the filesystem refuses
``O_DIRECT`` (at ``open`` or at the first read) everything is read through the page cache.

Measured on the benchmark machine (2 cores, ext4 on a virtual disk; docs/benchmarks.md, "Direct
reads"): with one window read ahead the disk served about 0.6 GB/s and restores of the MLP +
AdamW state (b) were slower than through the page cache, so direct reads were off by default.
With three windows ahead, ``bench_save.py`` restores of 1 GiB in 64 tensors (a) took 0.48-0.69 s
(12 rounds) against 0.54-2.82 s through the page cache, and of (b) 0.51-0.82 s against
0.47-2.83 s (medians 0.74 and 0.62 s); the first restore of the process, what a restarting job
does, 0.52-0.75 s against 1.70-2.83 s: on by default since.
"""

from __future__ import annotations

import ctypes
import errno
import os
from concurrent.futures import Future, ThreadPoolExecutor, wait

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
"""Environment variable that turns direct reads off when set to ``0`` (read at import)."""

DIRECT_READS = os.environ.get(DIRECT_READS_VARIABLE, "1").strip() not in ("", "0")
"""Read local data files with ``O_DIRECT`` where the filesystem takes it (Linux). On by
default; ``CKPTMGR_DIRECT_READS=0`` reads them through the page cache (as a file system that
refuses ``O_DIRECT`` is read anyway)."""

READ_AHEAD_WINDOWS = 3
"""Windows of a file read in order that are read ahead, each on its own helper thread, while
the reader copies out of the current one."""

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
        """The read of this window on a helper thread, while it is in flight."""

    @property
    def end(self) -> int:
        return self.start + self.length

    def holds(self, position: int) -> bool:
        return self.start <= position < self.end

    def may_hold(self, position: int) -> bool:
        """True where ``position`` is in the window once its read ends (at most the buffer)."""
        return self.start <= position < self.start + BOUNCE_BYTES

    def settle(self) -> bool:
        """Wait for the read in flight; False (nothing held) where it failed: the read that
        needs these bytes reads them again and raises or handles the error itself."""
        future, self.ahead = self.ahead, None
        if future is None:
            return True
        try:
            self.length = future.result()
        except OSError:
            self.length = 0
            return False
        return True


class DirectReader:
    """Fills buffers with a file's bytes at any offsets: aligned blocks with ``O_DIRECT``
    (``direct_fd``, None for none), straight into the buffer where its address lines up with
    the file offset and through windows otherwise; everything through the page cache
    (``buffered_fd``) where there are no direct reads or the filesystem refused one.

    A file read in increasing offsets is read :data:`READ_AHEAD_WINDOWS` windows ahead of the
    one being copied out of, each on its own helper thread, so that the disk has several reads
    to serve at once (one at a time it served about 0.6 GB/s where the page cache's read-ahead
    got more).

    The counts of bytes read each way (:attr:`direct_bytes` into the callers' memory,
    :attr:`copied_bytes` out of windows, :attr:`buffered_bytes`) are kept for tests and
    benchmarks. Not thread-safe: one reader per thread.
    """

    def __init__(self, direct_fd: int | None, buffered_fd: int) -> None:
        self._direct_fd = direct_fd
        self._buffered_fd = buffered_fd
        self._size = os.fstat(buffered_fd).st_size if direct_fd is not None else 0
        self._windows: list[_Window] = []
        """Windows in file order, each starting where the one before it ends (or will end, for
        a read in flight); the first is the one last copied from."""
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
                got = self._pread_direct_at_once(piece[done : done + count], position)
                self.direct_bytes += got
                done += got
                if got < count and self._direct_fd is not None:
                    return done  # the end of the file (else refused: the page cache reads)
                continue
            window = self._fill(position - position % DIRECT_ALIGN)
            if window is None:
                continue  # refused
            if not window.holds(position):
                return done  # the end of the file
        return done

    def close(self) -> None:
        """Wait for the reads in flight, close the direct descriptor and return the buffers for
        reuse (not the buffered descriptor: the caller's)."""
        self._settle_all()
        if self._helper is not None:
            self._helper.shutdown(wait=True)
            self._helper = None
        for window in self._windows:
            give_back_bounce_buffer(window.buffer)
        self._windows = []
        self._stop_direct()

    # -- windows ------------------------------------------------------------------------------
    def _window_holding(self, position: int) -> _Window | None:
        """The window that holds ``position`` (waiting for its read if it is in flight); the
        windows before it are done with and read further ahead."""
        for index, window in enumerate(self._windows):
            if window.ahead is not None:
                if not window.may_hold(position):
                    continue
                if not window.settle():
                    return None
            if window.holds(position):
                if index:
                    self._read_ahead(self._windows[:index])
                return window
        return None

    def _fill(self, start: int) -> _Window | None:
        """Read the window at ``start`` (a block boundary) on this thread and the windows after
        it ahead; None where the filesystem refused (direct reads are off then)."""
        self._settle_all()  # (their buffers are reused)
        spare = self._windows
        window = spare.pop() if spare else _Window(take_bounce_buffer())
        self._windows = [window]
        window.start, window.length = start, 0
        got = self._pread_direct(memoryview(window.buffer.memory), start)
        if got is None:
            for unused in spare:
                give_back_bounce_buffer(unused.buffer)
            return None
        window.length = got
        self._read_ahead(spare)
        return window

    def _read_ahead(self, done_with: list[_Window]) -> None:
        """Drop the windows ``done_with`` (at the front of the list, or already out of it) and
        start reading windows after the last one until :data:`READ_AHEAD_WINDOWS` are read ahead
        or the file ends, in their buffers first."""
        spare = list(done_with)
        if spare and spare[0] is self._windows[0]:
            del self._windows[: len(spare)]
        for window in spare:
            window.settle()  # (a read skipped over: its bytes are not wanted)
        fd = self._direct_fd
        while fd is not None and len(self._windows) <= READ_AHEAD_WINDOWS:
            last = self._windows[-1]
            if last.ahead is None and last.length < BOUNCE_BYTES:
                break  # the end of the file
            start = last.start + BOUNCE_BYTES
            if start >= self._size:
                break
            window = spare.pop() if spare else _Window(take_bounce_buffer())
            window.start, window.length = start, 0
            memory = memoryview(window.buffer.memory)
            window.ahead = self._helper_pool().submit(_pread_all, fd, memory, start)
            self._windows.append(window)
        for window in spare:
            give_back_bounce_buffer(window.buffer)

    def _helper_pool(self) -> ThreadPoolExecutor:
        if self._helper is None:
            self._helper = ThreadPoolExecutor(
                READ_AHEAD_WINDOWS, thread_name_prefix="ckptmgr-read-ahead"
            )
        return self._helper

    def _settle_all(self) -> None:
        for window in self._windows:
            window.settle()

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

    def _pread_direct_at_once(self, data: memoryview, offset: int) -> int:
        """Read aligned ``data`` at ``offset`` directly, split into up to ``1 +
        READ_AHEAD_WINDOWS`` parts of at least a window each read at once (the first on this
        thread, the others on the helpers): the disk serves several reads faster than one.
        Returns the count read: short of ``data`` where the file ends, or where the
        filesystem refused (direct reads are off then; the caller reads the rest). A part that
        failed is read again on this thread, where its error is raised or handled."""
        parts = max(1, min(1 + READ_AHEAD_WINDOWS, data.nbytes // BOUNCE_BYTES))
        fd = self._direct_fd
        assert fd is not None
        step = _round_up(_round_up(data.nbytes, parts) // parts, DIRECT_ALIGN)
        starts = list(range(0, data.nbytes, step))
        helper = self._helper_pool() if len(starts) > 1 else None
        futures = [
            helper.submit(_pread_all, fd, data[start : start + step], offset + start)
            for start in starts[1:]
            if helper is not None
        ]
        counts: list[int | None] = []
        try:
            try:
                counts.append(_pread_all(fd, data[:step], offset))
            except OSError:
                counts.append(None)  # read again below
        finally:
            wait(futures)  # (all of them end before the descriptor may be closed)
        for future in futures:
            try:
                counts.append(future.result())
            except OSError:
                counts.append(None)
        total = 0
        for start, count in zip(starts, counts, strict=True):
            wanted = min(step, data.nbytes - start)
            if count is None:
                count = self._pread_direct(data[start : start + wanted], offset + start)
                if count is None:
                    return total  # refused
            total += count
            if count < wanted:
                break  # the end of the file
        return total

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
            self._settle_all()  # (the helpers read with this descriptor)
            os.close(fd)
        for window in self._windows:
            window.length = 0  # nothing more is served from them


def _round_up(count: int, multiple: int) -> int:
    """``count`` rounded up to a multiple of ``multiple``."""
    return -(-count // multiple) * multiple


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
