"""The CRC-32 of a file's bytes, computed on a helper thread in the order they are written or
read (:class:`OrderedHasher`), beside the I/O. Imports no torch: :mod:`ckptmgr.remote_read`
uses it too, which :mod:`ckptmgr.storage` imports, and the ``ckptmgr`` commands that only read
records and list files (``ls``, ``verify``, ``prune``, ``rm``) run without torch."""

from __future__ import annotations

import queue
import threading
from typing import Any

from ckptmgr.integrity import crc32
from ckptmgr.niceness import run_calling_thread_in_background

PARALLEL_HASHING = True
"""Hash on a helper thread (at a lower priority) beside the I/O, or else on the writing thread."""
HANDOFF_BYTES = 1 << 20
"""Small pieces are batched until this many bytes before the hashing thread gets them."""


class OrderedHasher:
    """CRC-32 of a sequence of byte pieces, computed on a helper thread in the order given.

    ``add`` returns at once (``crc32`` releases the GIL for large buffers, so hashing runs
    beside the caller's I/O); ``result`` waits for every piece. Each piece's owner (the tensor
    whose memory it views) is held until the piece is hashed. With ``max_backlog_bytes``,
    ``add`` waits while more than that many bytes handed to the thread are not hashed yet (for
    pieces whose memory exists only to be hashed, so that a slow hash cannot pile them up).
    ``inline``: hash each piece in ``add`` instead, on the caller's thread (as everywhere where
    ``PARALLEL_HASHING`` is off).
    """

    def __init__(self, max_backlog_bytes: int | None = None, *, inline: bool = False) -> None:
        self._queue: queue.SimpleQueue[list[tuple[memoryview, Any]] | None] = queue.SimpleQueue()
        self._batch: list[tuple[memoryview, Any]] = []
        self._batch_bytes = 0
        self._crc = 0
        self._error: BaseException | None = None
        self._max_backlog = max_backlog_bytes
        self._backlog = 0  # bytes queued for the thread and not hashed yet
        self._hashed = threading.Condition()
        self._inline = inline or not PARALLEL_HASHING
        self._thread = threading.Thread(target=self._run, name="ckptmgr-crc32", daemon=True)
        if not self._inline:
            self._thread.start()

    def add(self, piece: memoryview, owner: Any = None) -> None:
        """Queue ``piece`` (hashed after every piece added before it)."""
        if self._inline:
            self._crc = crc32(piece, self._crc)
            return
        self._batch.append((piece, owner))
        self._batch_bytes += piece.nbytes
        if self._batch_bytes >= HANDOFF_BYTES:
            self._flush()

    def result(self) -> int:
        """The CRC-32 of all pieces added (waits for the hashing thread; ends it)."""
        if self._inline:
            return self._crc
        self._flush()
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._crc

    def _flush(self) -> None:
        if not self._batch:
            return
        if self._max_backlog is not None:
            with self._hashed:
                while self._backlog > self._max_backlog and self._thread.is_alive():
                    self._hashed.wait(_BACKLOG_POLL_S)
                self._backlog += self._batch_bytes
        self._queue.put(self._batch)
        self._batch = []
        self._batch_bytes = 0

    def _run(self) -> None:
        run_calling_thread_in_background()
        crc = 0
        try:
            while True:
                batch = self._queue.get()
                if batch is None:
                    break
                hashed = 0
                for piece, _owner in batch:
                    crc = crc32(piece, crc)
                    hashed += piece.nbytes
                del batch
                with self._hashed:
                    self._backlog -= hashed
                    self._hashed.notify_all()
        except BaseException as exc:  # pragma: no cover - crc32 does not fail on bytes
            self._error = exc
        finally:
            self._crc = crc
            with self._hashed:
                self._hashed.notify_all()  # a waiting add() sees the thread gone


_BACKLOG_POLL_S = 1.0  # how often a waiting add() checks that the hashing thread still runs
