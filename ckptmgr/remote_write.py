"""Uploading a data file to GCS or S3 while it is written, instead of through a local spool.

A data file bound for another store is spooled (memory up to 64 MiB, then a temporary file in
``TMPDIR``) and uploaded in one retried call once DCP has written it: a transient error re-sends
the whole file, and no half of one is ever stored. On GCS and S3 the spool only adds a write and
a read of the whole file on local disk, and needs the room for it (a rank's data file can be
many GiB, and ``TMPDIR`` is often small, or memory). :func:`upload_while_writing` uploads the
bytes as they are written instead:

* GCS: a resumable upload in chunks of :data:`UPLOAD_CHUNK_BYTES`, one after the other (as
  gcsfs uploads any file); GCS makes the object only when the last chunk arrives.
* S3: a multipart upload in parts of :data:`UPLOAD_CHUNK_BYTES`, :data:`PARTS_IN_FLIGHT` sent
  at once (as s3fs sends a large file's parts); S3 makes the object only when the upload is
  completed.

A file of at most one chunk is sent in one request when it is complete. Each request is retried
by the file system's own policy (:mod:`ckptmgr.retry`); an upload that still fails is cancelled,
so it never leaves an object behind, and the caller retries by writing the file again (the
tensors are still there).
"""

from __future__ import annotations

import io
import sys
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Protocol, TypeVar

from ckptmgr.integrity import crc32

UPLOAD_CHUNK_BYTES = 32 * 2**20
"""Bytes sent by one request of an upload (a multiple of GCS's 256 KiB, and over S3's smallest
part of 5 MiB); a file of at most this many bytes is sent in one request."""
PARTS_IN_FLIGHT = 4
"""S3 parts of one file sent at once: a file being uploaded holds at most this many parts in
memory, plus the one being filled."""

T = TypeVar("T")


class _Upload(Protocol):
    def write(self, data: memoryview) -> None: ...
    def finish(self) -> None: ...
    def cancel(self) -> None: ...


def uploads_while_writing(fs: Any) -> bool:
    """True for file systems whose files :func:`upload_while_writing` uploads (gcsfs, s3fs)."""
    return _upload_class(fs) is not None


def _upload_class(fs: Any) -> Callable[[Any, str, int], _Upload] | None:
    gcsfs, s3fs = sys.modules.get("gcsfs"), sys.modules.get("s3fs")
    if gcsfs is not None and isinstance(fs, gcsfs.GCSFileSystem):
        return _ResumableUpload
    if s3fs is not None and isinstance(fs, s3fs.S3FileSystem):
        return _MultipartUpload
    return None


class UploadSink:
    """A :class:`ckptmgr.tensor_bytes.TensorSink` that uploads to ``path`` on ``fs`` what it is
    given, hashing it as it goes. Up to ``chunk_bytes`` are held in memory: a file no larger is
    sent in one request by :meth:`finish`; a larger one goes as an upload in chunks, started
    when the first chunk is full."""

    def __init__(self, fs: Any, path: str, chunk_bytes: int) -> None:
        self._fs = fs
        self._path = path
        self._chunk = chunk_bytes
        self._head: io.BytesIO | None = io.BytesIO()
        self._upload: _Upload | None = None
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
            opener = _upload_class(self._fs)
            if opener is None:
                raise TypeError(f"no upload while writing to {type(self._fs).__name__}")
            self._upload = opener(self._fs, self._path, self._chunk)
            self._upload.write(self._head.getbuffer())
            self._head = None
        assert self._upload is not None
        for start in range(0, piece.nbytes, self._chunk):  # (bounded copies)
            self._upload.write(piece[start : start + self._chunk])

    def finish(self) -> None:
        """Send what is held: the object exists once this returns."""
        if self._head is not None:
            self._fs.pipe_file(self._path, self._head.getvalue())
            self._head = None
        elif self._upload is not None:
            self._upload.finish()

    def cancel(self) -> None:
        """Drop what is held and cancel an unfinished upload."""
        self._head = None
        upload, self._upload = self._upload, None
        if upload is not None:
            upload.cancel()


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


class _ResumableUpload:
    """GCS: gcsfs's file for writing, a resumable upload sent ``chunk_bytes`` at a time."""

    def __init__(self, fs: Any, path: str, chunk_bytes: int) -> None:
        self._remote = fs.open(path, "wb", block_size=chunk_bytes)

    def write(self, data: memoryview) -> None:
        self._remote.write(data)

    def finish(self) -> None:
        self._remote.close()  # the last chunk: the object exists from here on

    def cancel(self) -> None:
        """Cancel the upload, and make sure that closing the file later (fsspec closes an
        open file when it is collected) cannot finish it."""
        try:
            self._remote.discard()  # (a request of its own: the upload expires anyway)
        except Exception:  # (the upload's own error is the one to raise)
            pass
        finally:
            self._remote.closed = True


class _MultipartUpload:
    """S3: a multipart upload, parts of ``chunk_bytes`` sent ``PARTS_IN_FLIGHT`` at a time
    through s3fs's (retried) API calls."""

    def __init__(self, fs: Any, path: str, chunk_bytes: int) -> None:
        self._fs = fs
        self._bucket, self._key, _ = fs.split_path(path)
        self._chunk = chunk_bytes
        self._part = io.BytesIO()
        self._sent: deque[Future[dict[str, Any]]] = deque()
        self._done: list[dict[str, Any]] = []
        self._pool = ThreadPoolExecutor(PARTS_IN_FLIGHT, thread_name_prefix="ckptmgr-part")
        started = fs.call_s3("create_multipart_upload", Bucket=self._bucket, Key=self._key)
        self._upload_id = started["UploadId"]

    def write(self, data: memoryview) -> None:
        while data.nbytes:
            room = self._chunk - self._part.tell()
            self._part.write(data[:room])
            data = data[room:]
            if self._part.tell() == self._chunk:
                self._send_part()

    def finish(self) -> None:
        if self._part.tell() or not (self._sent or self._done):
            self._send_part()
        while self._sent:
            self._done.append(self._sent.popleft().result())
        self._pool.shutdown()
        parts = sorted(self._done, key=lambda part: part["PartNumber"])
        self._fs.call_s3(
            "complete_multipart_upload",
            Bucket=self._bucket,
            Key=self._key,
            UploadId=self._upload_id,
            MultipartUpload={"Parts": parts},
        )
        self._fs.invalidate_cache(f"{self._bucket}/{self._key}")

    def cancel(self) -> None:
        wait(self._sent)  # (a part still being sent could outlive the abort)
        self._pool.shutdown()
        try:
            self._fs.call_s3(
                "abort_multipart_upload",
                Bucket=self._bucket,
                Key=self._key,
                UploadId=self._upload_id,
            )
        except Exception:  # (the upload's own error is the one to raise; S3 can expire it)
            pass

    def _send_part(self) -> None:
        if len(self._sent) >= PARTS_IN_FLIGHT:
            self._done.append(self._sent.popleft().result())  # (raises a part's failure)
        number = len(self._done) + len(self._sent) + 1
        body, self._part = self._part.getvalue(), io.BytesIO()
        self._sent.append(self._pool.submit(self._upload_part, number, body))

    def _upload_part(self, number: int, body: bytes) -> dict[str, Any]:
        answer = self._fs.call_s3(
            "upload_part",
            Bucket=self._bucket,
            Key=self._key,
            UploadId=self._upload_id,
            PartNumber=number,
            Body=body,
        )
        return {"PartNumber": number, "ETag": answer["ETag"]}
