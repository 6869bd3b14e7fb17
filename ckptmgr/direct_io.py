"""What direct reads and writes (``O_DIRECT``) share: opening a file for them, the alignment
they need, and a pool of reused buffers through which the bytes go that cannot be moved from or
to where they lie.

Direct I/O wants the file offset, the length and the memory address of each call aligned
(:data:`DIRECT_ALIGN`). Writes (:mod:`ckptmgr.direct_write`) gather unaligned bytes in a bounce
buffer and write it when full; reads (:mod:`ckptmgr.direct_read`) read aligned blocks into one
and copy the wanted bytes out. The buffers are anonymous memory maps (page-aligned), kept for
reuse so that a save or a restore does not pay their page faults again.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading

DIRECT_ALIGN = 4096
"""Alignment of the offset, the length and the address of every direct read or write: the page
size, a multiple of the logical block size of common disks (512 or 4096 bytes)."""

BOUNCE_BYTES = 8 * 2**20
"""Size of a bounce buffer (a multiple of :data:`DIRECT_ALIGN`)."""

_POOL_SIZE = 16  # buffers kept for reuse (a writer holds one, a reader up to four)
_pool: list[BounceBuffer] = []
_pool_lock = threading.Lock()


def open_for_direct_io(path: str | os.PathLike[str], flags: int) -> int | None:
    """``os.open(path, flags | O_DIRECT)``; None where the platform has no ``O_DIRECT`` or the
    filesystem refuses it at ``open`` (tmpfs before Linux 6.6, and others)."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return None
    try:
        return os.open(path, flags | direct)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            return None
        raise


class BounceBuffer:
    """:data:`BOUNCE_BYTES` of page-aligned memory: :attr:`memory` to pass to ``os.pwrite`` or
    ``os.preadv``, :attr:`address` for copies with ``ctypes.memmove`` (which releases the
    GIL)."""

    def __init__(self) -> None:
        self.memory = mmap.mmap(-1, BOUNCE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._array = (ctypes.c_char * BOUNCE_BYTES).from_buffer(self.memory)
        self.address = ctypes.addressof(self._array)
        """Address of the first byte."""


def take_bounce_buffer() -> BounceBuffer:
    """A buffer from the pool, or a new one (return it with :func:`give_back_bounce_buffer`)."""
    with _pool_lock:
        if _pool:
            return _pool.pop()
    return BounceBuffer()


def give_back_bounce_buffer(buffer: BounceBuffer) -> None:
    """Return ``buffer`` to the pool (dropped when the pool is full); the caller no longer uses
    it."""
    with _pool_lock:
        if len(_pool) < _POOL_SIZE:
            _pool.append(buffer)


def address_of(piece: memoryview) -> int | None:
    """The address of ``piece``'s first byte, or None for a read-only or empty buffer (whose
    address ctypes cannot give)."""
    if piece.readonly or not piece.nbytes:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(piece))
