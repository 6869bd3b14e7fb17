"""Reading a data file from an object store during a restore: ranged reads, several at once.

A rank's tensors are stored in one data file per writer thread (one by default), so on GCS or S3
a rank's share of a checkpoint is often a single object of many GiB. Downloading it as one
stream runs at the speed of one connection; object stores serve ranged reads of one object in
parallel much faster (GCS "sliced" downloads, S3 byte-range fetches). :class:`RemoteRangeSource`
fetches a file in windows of :data:`WINDOW_BYTES`, up to :data:`WINDOWS_AHEAD` at once, each
window one retried ranged read, and hands the bytes to the restore in increasing offsets, copied
straight into the destination tensors: nothing goes through a local temporary file. Every byte
of the file is hashed in order (windows the restore does not need are fetched only for that),
and :meth:`RemoteRangeSource.finish` checks the size and CRC-32 against the commit record, as
:class:`ckptmgr.tensor_bytes.VerifyingLocalFile` does for a local file: the destinations hold
unchecked bytes until then, and a restore that finds damage raises.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from ckptmgr.errors import CorruptCheckpointError
from ckptmgr.ordered_hash import OrderedHasher

WINDOW_BYTES = 32 * 2**20
"""Bytes fetched by one ranged read (AWS advises byte-range fetches of 8 to 16 MB; larger ones
make fewer requests, each a round trip; 32 MiB is between the GCS emulator's best, 16 MiB, and
moto's, 64 MiB: docs/benchmarks.md)."""
WINDOWS_AHEAD = 4
"""Windows of one file asked for beyond the one being copied out of: the memory a file being read
holds is at most this many windows, plus the current one and those waiting to be hashed."""
FETCH_THREADS = 4
"""Ranged reads in flight at once in one process, over every file it reads (a restore reads
several data files at a time): one process holds at most this many connections for them."""
HASH_BACKLOG_BYTES = 2 * WINDOW_BYTES
"""Fetched windows waiting for the hashing thread, at most (a slow hash holds the reads back)."""

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def _fetch_pool() -> ThreadPoolExecutor:
    """This process's threads for ranged reads (``FETCH_THREADS``; made anew in a forked child,
    which has none of its parent's threads)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="ckptmgr-fetch")
            _pool_pid = os.getpid()
        return _pool


Fetch = Callable[[int, int], bytes]
"""``fetch(start, end)``: the file's bytes ``start`` to ``end`` (exclusive), or fewer where the
file ends first; retried by the caller's policy."""


def read_small_file_ahead(
    fs: Any, path: str, retried: Callable[..., Any], size: int
) -> Future[bytes] | None:
    """Start reading ``path``, a file of ``size`` bytes (as its record gives), by one ranged
    read on the fetch threads (see :func:`ranged_reads`); None where it is empty or more than
    one window (``WINDOW_BYTES``). The future's bytes hold one more where the file goes on past
    ``size`` (servers end a range at the end of the object): checked by the caller."""
    if not 0 < size <= WINDOW_BYTES:
        return None
    return _fetch_pool().submit(ranged_reads(fs, path, retried), 0, size + 1)


def ranged_reads(fs: Any, path: str, retried: Callable[..., Any]) -> Fetch:
    """The :data:`Fetch` of ``path`` on the fsspec file system ``fs``: ``fs.cat_file`` of each
    range, called through ``retried(what, function, *args, **kwargs)`` (a retry policy)."""

    def fetch(start: int, end: int) -> bytes:
        # (keywords: s3fs's cat_file takes a version id second)
        return retried(f"read {path} [{start}:{end}]", fs.cat_file, path, start=start, end=end)

    return fetch


class RemoteRangeSource:
    """A :class:`ckptmgr.tensor_bytes.TensorSource` over a remote file of ``size`` bytes, read
    through ``fetch``; ``check(size, crc)`` raises ``CorruptCheckpointError`` when the whole
    file's size and CRC-32 are not its record's (None: nothing to check against).

    Reads are served in increasing offsets from windows fetched ahead; a read of bytes already
    passed is a ranged read of its own. ``hash_inline``: hash on the reading thread (for a
    reader that is a background thread itself). ``window_bytes`` and ``windows_ahead`` default
    to :data:`WINDOW_BYTES` and :data:`WINDOWS_AHEAD`. :meth:`close` ends the fetches.
    """

    def __init__(
        self,
        fetch: Fetch,
        size: int,
        name: str,
        check: Callable[[int, int], None] | None,
        *,
        hash_inline: bool = False,
        window_bytes: int | None = None,
        windows_ahead: int | None = None,
    ) -> None:
        window_bytes = WINDOW_BYTES if window_bytes is None else window_bytes
        windows_ahead = WINDOWS_AHEAD if windows_ahead is None else windows_ahead
        if window_bytes <= 0 or windows_ahead <= 0:
            raise ValueError("window_bytes and windows_ahead must be positive")
        self._fetch = fetch
        self._size = size
        self._name = name
        self._check = check
        self._window_bytes = window_bytes
        self._ahead = windows_ahead
        self._pool = _fetch_pool()
        self._pending: deque[tuple[int, Future[bytes]]] = deque()
        self._requested = 0  # the first byte not asked for yet
        self._start = 0  # the current window: its first byte, and its bytes
        self._window = memoryview(b"")
        self._hasher: OrderedHasher | None = None
        if check is not None:
            self._hasher = OrderedHasher(max_backlog_bytes=HASH_BACKLOG_BYTES, inline=hash_inline)
        self._fill()

    def read_into(self, offset: int, piece: memoryview, owner: Any) -> None:
        """Fill ``piece`` with the file's bytes at ``offset``."""
        del owner
        end = offset + piece.nbytes
        if end > self._size:
            raise CorruptCheckpointError(
                f"the file ends at byte {self._size}, before the tensor bytes it should hold at "
                f"{offset}..{end}",
                path=self._name,
            )
        if offset < self._start:  # passed (and hashed) already: fetched again on its own
            data = self._fetch_exactly(offset, end)
            piece[:] = data
            return
        done = 0
        while done < piece.nbytes:
            position = offset + done
            while position >= self._start + len(self._window):
                self._advance()
            start = position - self._start
            count = min(piece.nbytes - done, len(self._window) - start)
            piece[done : done + count] = self._window[start : start + count]
            done += count

    def finish(self) -> None:
        """Fetch and hash the rest of the file, then check it whole."""
        while self._start + len(self._window) < self._size:
            self._advance()
        self._window = memoryview(b"")
        if self._hasher is not None and self._check is not None:
            crc = self._hasher.result()
            self._hasher = None
            self._check(self._size, crc)

    def close(self) -> None:
        """Cancel the fetches not started, wait for those running, end the hashing."""
        futures = [future for _, future in self._pending]
        self._pending.clear()
        for future in futures:
            future.cancel()
        wait(futures)
        self._window = memoryview(b"")
        if self._hasher is not None:
            try:
                self._hasher.result()
            except BaseException:  # pragma: no cover - crc32 does not fail on bytes
                pass
            self._hasher = None

    def __enter__(self) -> RemoteRangeSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fill(self) -> None:
        """Ask for windows until ``windows_ahead`` are in flight or the file is covered."""
        while len(self._pending) < self._ahead and self._requested < self._size:
            start = self._requested
            end = min(self._size, start + self._window_bytes)
            last = end == self._size
            future = self._pool.submit(self._fetch_exactly, start, end, last=last)
            self._pending.append((start, future))
            self._requested = end

    def _advance(self) -> None:
        """Make the next window current (hashed in order) and ask for another."""
        if not self._pending:  # (read_into and finish stop at the file's size)
            raise AssertionError("no window left to advance to")
        start, future = self._pending.popleft()
        data = future.result()
        self._start, self._window = start, memoryview(data)
        if self._hasher is not None:
            self._hasher.add(self._window, data)
        self._fill()

    def _fetch_exactly(self, start: int, end: int, *, last: bool = False) -> bytes:
        """Bytes ``start`` to ``end``; ``last``: the file's last window, asked for with one byte
        more, which must not come (servers end a range at the end of the object)."""
        data = self._fetch(start, end + 1 if last else end)
        if len(data) < end - start:
            raise CorruptCheckpointError(
                f"the file ends at byte {start + len(data)}, before byte {end}: it is not the "
                f"{self._size} bytes its record gives",
                path=self._name,
            )
        if len(data) > end - start:
            raise CorruptCheckpointError(
                f"the file goes on past byte {end}: it is not the {self._size} bytes its "
                "record gives",
                path=self._name,
            )
        return data


def crc32_of_remote(fetch: Fetch, size: int, name: str) -> tuple[int, int]:
    """(size, CRC-32) of the remote file ``name`` of ``size`` bytes, read by ranged reads as a
    restore reads it (``CorruptCheckpointError`` where it ends before ``size`` or goes on past
    it)."""
    found: list[tuple[int, int]] = []

    def keep(size: int, crc: int) -> None:
        found.append((size, crc))

    with RemoteRangeSource(fetch, size, name, keep) as source:
        source.finish()
    return found[0]
