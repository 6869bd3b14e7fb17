"""Uploading a data file to GCS while it is written, instead of through a local spool.

A data file bound for an object store is spooled (memory up to 64 MiB, then a temporary file in
``TMPDIR``) and uploaded in one retried call once DCP has written it: a transient error re-sends
the whole file, and no half of one is ever stored. gcsfs uploads a file one chunk after the
other whichever way it is given the bytes, so for ``gs://`` the spool only adds a write and a
read of the whole file on local disk (and needs the room for it). :func:`upload_while_writing`
uploads the bytes as they are written instead: a resumable upload in chunks of
:data:`UPLOAD_CHUNK_BYTES`, which GCS makes an object only when the last chunk arrives. The
caller retries a failed upload by writing the file again (the tensors are still there); an upload
that fails is cancelled, so it never leaves an object behind.

s3fs uploads the parts of one large file ten at a time, which a write-as-you-go upload (one part
at a time) would lose: S3 keeps the spool.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from ckptmgr.integrity import crc32

UPLOAD_CHUNK_BYTES = 32 * 2**20
"""Bytes sent by one request of a resumable upload (a multiple of GCS's 256 KiB); a file being
uploaded holds about twice this in memory."""

T = TypeVar("T")


def uploads_while_writing(fs: Any) -> bool:
    """True for file systems whose files :func:`upload_while_writing` uploads (gcsfs)."""
    gcsfs = sys.modules.get("gcsfs")
    return gcsfs is not None and isinstance(fs, gcsfs.GCSFileSystem)


class UploadSink:
    """A :class:`ckptmgr.tensor_bytes.TensorSink` that uploads to ``path`` on ``fs`` what it is
    given, hashing it as it goes. Up to ``chunk_bytes`` are held in memory: a file no larger is
    sent in one request by :meth:`finish`; a larger one goes as a resumable upload, opened when
    the first chunk is full, and given the pieces in slices of at most ``chunk_bytes`` (so the
    upload's buffer stays near one chunk)."""

    def __init__(self, fs: Any, path: str, chunk_bytes: int) -> None:
        self._fs = fs
        self._path = path
        self._chunk = chunk_bytes
        self._head: io.BytesIO | None = io.BytesIO()
        self._remote: Any = None
        self.size = 0
        self.crc32 = 0

    def tell(self) -> int:
        """Bytes written so far."""
        return self.size

    def write_piece(self, piece: memoryview, owner: Any) -> None:
        """Hash ``piece`` and hand it over (copied before this returns)."""
        del owner
        self.crc32 = crc32(piece, self.crc32)
        self.size += piece.nbytes
        if self._head is not None:
            if self._head.tell() + piece.nbytes <= self._chunk:
                self._head.write(piece)
                return
            self._remote = self._fs.open(self._path, "wb", block_size=self._chunk)
            self._remote.write(self._head.getbuffer())
            self._head = None
        for start in range(0, piece.nbytes, self._chunk):
            self._remote.write(piece[start : start + self._chunk])

    def finish(self) -> None:
        """Send what is held: the object exists once this returns."""
        if self._head is not None:
            self._fs.pipe_file(self._path, self._head.getvalue())
            self._head = None
        else:
            self._remote.close()

    def cancel(self) -> None:
        """Drop what is held and cancel an unfinished upload, so that closing its file later
        (fsspec closes an open file when it is collected) cannot finish it."""
        self._head = None
        remote, self._remote = self._remote, None
        if remote is None:
            return
        try:
            remote.discard()  # (a request of its own: the upload expires anyway if it fails)
        except Exception:  # (the upload's own error is the one to raise)
            pass
        finally:
            remote.closed = True


def upload_while_writing(
    fs: Any, path: str, write: Callable[[UploadSink], T], *, chunk_bytes: int | None = None
) -> tuple[T, int, int]:
    """``write(sink)`` into a new object at ``path``, uploaded while it is written; returns
    (what ``write`` returned, the object's size, its CRC-32). On any error the upload is
    cancelled (no object is made) and the error raised."""
    sink = UploadSink(fs, path, UPLOAD_CHUNK_BYTES if chunk_bytes is None else chunk_bytes)
    try:
        result = write(sink)
        sink.finish()
    except BaseException:
        sink.cancel()
        raise
    return result, sink.size, sink.crc32
