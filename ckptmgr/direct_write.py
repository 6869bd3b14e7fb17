"""Writing a data file past the page cache (``O_DIRECT``), from the tensors' own memory.

A checkpoint's data file is written once and read, if ever, after a restart: holding its bytes
in the page cache only costs. A ``write`` into the page cache copies every byte (on a core the
training loop may need), the kernel's writeback then runs beside it, and a file larger than the
free memory makes the kernel reclaim pages first. With ``O_DIRECT`` the disk reads the bytes
straight from the staged tensors: the writing thread waits for the disk and uses almost no CPU.

Direct I/O wants the file offset, the length and the memory address of each write aligned
(:data:`DIRECT_ALIGN`). A stretch of a tensor whose address lines up with its file offset is
written from the tensor itself; other bytes are gathered in a reused aligned buffer
(:data:`BOUNCE_BYTES`) that is written when full. The end of the file that does not fill an
aligned block is written through the page cache, as is everything where the filesystem refuses
``O_DIRECT`` (tmpfs, some FUSE filesystems: at ``open``, or at the first write). The caller still
fsyncs the file: direct I/O does not flush the disk's cache nor record the file's size.

Measured on the benchmark machine (2 cores, ext4 on a virtual disk) by
``benchmarks/bench_write_behind.py`` (1152 MiB in 16 MiB calls, then fsync; medians of
per-round ratios to a plain write): 0.78x from page-aligned tensors, 0.84x through the bounce
buffer, against 1.12x for write-behind in the same run. In a throwaway script with a matmul
loop beside the write, the writing thread used 0.06 s of CPU against 1.80 s for the plain write,
and the loop lost nothing (docs/benchmarks.md, "Direct writes").
"""

from __future__ import annotations

import ctypes
import errno
import os

from ckptmgr.direct_io import (
    BOUNCE_BYTES,
    DIRECT_ALIGN,
    BounceBuffer,
    address_of,
    give_back_bounce_buffer,
    open_for_direct_io,
    take_bounce_buffer,
)

__all__ = [
    "BOUNCE_BYTES",
    "DIRECT_ALIGN",
    "DIRECT_WRITES",
    "DIRECT_WRITES_VARIABLE",
    "DIRECT_WRITE_BYTES",
    "DirectWriter",
    "open_direct",
]

DIRECT_WRITES_VARIABLE = "CKPTMGR_DIRECT_WRITES"
"""Environment variable that turns direct writes off when set to ``0`` (read at import: a
checkpoint daemon started later inherits it)."""

DIRECT_WRITES = os.environ.get(DIRECT_WRITES_VARIABLE, "1").strip() != "0"
"""Write data files with ``O_DIRECT`` where the filesystem takes it (Linux); False (or
``CKPTMGR_DIRECT_WRITES=0``): always through the page cache, with write-behind
(:mod:`ckptmgr.writeback`)."""

DIRECT_WRITE_BYTES = 64 * 2**20
"""Largest single direct write (a larger aligned stretch is written in several)."""


def open_direct(path: str | os.PathLike[str]) -> int | None:
    """A second descriptor of the existing file ``path``, for direct writes; None where the
    platform or the filesystem has no ``O_DIRECT`` (or :data:`DIRECT_WRITES` is off)."""
    return open_for_direct_io(path, os.O_WRONLY) if DIRECT_WRITES else None


class DirectWriter:
    """Appends bytes to a file from offset 0: aligned blocks with ``O_DIRECT`` (``direct_fd``),
    the unaligned end of the file through the page cache (``buffered_fd``).

    The counts of bytes written each way (:attr:`direct_bytes`, :attr:`copied_bytes` of them
    through the bounce buffer, :attr:`buffered_bytes`) are kept for tests and benchmarks.
    """

    def __init__(self, direct_fd: int, buffered_fd: int) -> None:
        self._direct_fd: int | None = direct_fd
        self._refused = False  # the filesystem refused a direct write
        self._buffered_fd = buffered_fd
        self._position = 0  # file offset of the next byte appended
        self._fill = 0  # bytes in the bounce buffer; they belong at _position - _fill
        self._bounce: BounceBuffer | None = take_bounce_buffer()
        self.direct_bytes = 0
        self.copied_bytes = 0
        self.buffered_bytes = 0

    @property
    def direct(self) -> bool:
        """False once the filesystem refused a direct write (the rest goes through the cache)."""
        return not self._refused

    def write(self, piece: memoryview) -> None:
        """Append ``piece`` (the GIL is released during the copies and writes)."""
        address = address_of(piece)
        done = 0
        while done < piece.nbytes:
            left = piece.nbytes - done
            if self._direct_fd is None:  # (the bounce buffer is empty then)
                self._pwrite_buffered(piece[done:], self._position)
                self._position += left
                return
            # Bytes can go from where they lie when their address and their file offset are
            # the same distance past a block boundary (and then from the next boundary on).
            lines_up = address is not None and (address + done - self._position) % DIRECT_ALIGN == 0
            behind = -self._position % DIRECT_ALIGN  # bytes to the next block boundary
            if lines_up and not behind and left >= DIRECT_ALIGN:
                self._flush_bounce()  # whole blocks only: the offset is on a boundary
                if self._direct_fd is None:
                    continue  # refused while flushing
                count = min(left - left % DIRECT_ALIGN, DIRECT_WRITE_BYTES)
                if self._pwrite_direct(piece[done : done + count], self._position):
                    self._position += count
                    done += count
                continue  # (a refused write turned direct writes off: see the top)
            count = min(left, BOUNCE_BYTES - self._fill)
            if lines_up and behind:
                count = min(count, behind)  # up to the boundary; the rest from where it lies
            self._copy_in(piece, done, address, count)
            self._position += count
            done += count
            if self._fill == BOUNCE_BYTES:
                self._flush_bounce()

    def finish(self) -> None:
        """Write what the bounce buffer holds: its whole blocks directly, the rest (the end of
        the file) through the page cache."""
        self._flush_bounce(everything=True)

    def close(self) -> None:
        """Close the direct descriptor and return the bounce buffer for reuse (not the
        buffered descriptor: the caller's)."""
        fd, self._direct_fd = self._direct_fd, None
        if fd is not None:
            os.close(fd)
        bounce, self._bounce = self._bounce, None
        if bounce is not None:
            give_back_bounce_buffer(bounce)

    def _copy_in(self, piece: memoryview, done: int, address: int | None, count: int) -> None:
        assert self._bounce is not None
        target = self._bounce.address + self._fill
        if address is not None:
            ctypes.memmove(target, address + done, count)  # (ctypes releases the GIL)
        else:
            self._bounce.memory[self._fill : self._fill + count] = piece[done : done + count]
        self._fill += count
        self.copied_bytes += count

    def _flush_bounce(self, *, everything: bool = False) -> None:
        """Write the bounce buffer's whole blocks directly (all of it with ``everything``, the
        partial last block through the page cache); keep a partial last block otherwise."""
        if not self._fill or self._bounce is None:
            return
        start = self._position - self._fill  # a block boundary
        blocks = self._fill - self._fill % DIRECT_ALIGN
        view = memoryview(self._bounce.memory)
        written = 0
        if blocks and self._direct_fd is not None:
            if self._pwrite_direct(view[:blocks], start):
                written = blocks
        if written < self._fill and (everything or self._direct_fd is None):
            self._pwrite_buffered(view[written : self._fill], start + written)
            written = self._fill
        rest = self._fill - written
        if rest and written:
            view[:rest] = view[written : self._fill]  # the partial block moves to the front
        self._fill = rest
        view.release()

    def _pwrite_direct(self, data: memoryview, offset: int) -> bool:
        """Write all of ``data`` at ``offset`` directly; False (and nothing written, direct
        writes off from now on) where the filesystem refuses them."""
        assert self._direct_fd is not None
        done = 0
        while done < data.nbytes:
            try:
                count = os.pwrite(self._direct_fd, data[done:], offset + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL or done:
                    raise
                self._stop_direct()
                return False
            done += count
            if (count == 0 or count % DIRECT_ALIGN) and done < data.nbytes:  # short, unaligned
                self._pwrite_buffered(data[done:], offset + done)
                self.direct_bytes += done
                return True
        self.direct_bytes += done
        return True

    def _pwrite_buffered(self, data: memoryview, offset: int) -> None:
        done = 0
        while done < data.nbytes:
            done += os.pwrite(self._buffered_fd, data[done:], offset + done)
        self.buffered_bytes += done

    def _stop_direct(self) -> None:
        self._refused = True
        fd, self._direct_fd = self._direct_fd, None
        if fd is not None:
            os.close(fd)
