"""DCP's file-system interface over an fsspec store (GCS, S3, ...), every request retried.

:class:`RetryingFileSystem` is what DCP's fsspec writer and reader of :mod:`ckptmgr.dcp_io`
write and read through on a remote store: files spooled locally and uploaded whole (or, on GCS
and S3, uploaded while written), files read by ranged reads, sizes and checksums checked
against the commit record, and ``.metadata.tmp`` held until its rename makes it one upload.
"""

from __future__ import annotations

import io
import os
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future as ConcurrentFuture
from contextlib import contextmanager
from typing import IO, Any, TypeVar

from torch.distributed.checkpoint.filesystem import FileSystemBase

from ckptmgr import tensor_bytes
from ckptmgr.integrity import (
    ChecksumLog,
    Expected,
    check_content,
    check_relative_path,
    crc32,
    relative_name,
)
from ckptmgr.remote_read import RemoteRangeSource, ranged_reads, read_small_file_ahead
from ckptmgr.remote_write import upload_while_writing, uploads_while_writing
from ckptmgr.retry import Retrier, RetryConfig
from ckptmgr.storage import open_filesystem

T = TypeVar("T")


SPOOL_MEMORY_BYTES = 64 * 2**20
"""A data file up to this size is spooled in memory; a larger one goes to a temporary file."""
_COPY_CHUNK = 8 * 2**20


class _Spool(io.RawIOBase):
    """A write-only stream: memory up to a limit, then a temporary file on local disk.

    ``close()`` (which DCP calls when a file is complete) keeps the data for the upload;
    :meth:`discard` frees it. ``tempfile.gettempdir()`` (``TMPDIR``) holds spilled data.
    """

    def __init__(self, memory_limit: int | None = None) -> None:
        super().__init__()
        self._limit = SPOOL_MEMORY_BYTES if memory_limit is None else memory_limit
        self._memory: io.BytesIO | None = io.BytesIO()
        self._file: IO[bytes] | None = None
        self.file_path: str | None = None
        self._size = 0
        self.crc32 = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:  # bytes-like
        size = memoryview(data).nbytes
        if self._memory is not None and self._size + size > self._limit:
            fd, self.file_path = tempfile.mkstemp(prefix="ckptmgr-spool-")
            self._file = os.fdopen(fd, "wb")
            self._file.write(self._memory.getbuffer())
            self._memory = None
        target = self._memory if self._memory is not None else self._file
        assert target is not None
        target.write(data)
        self.crc32 = crc32(data, self.crc32)
        self._size += size
        return size

    def tell(self) -> int:
        return self._size

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()
        super().close()

    @property
    def in_memory(self) -> bool:
        """True while the data is held in memory (it is then uploaded from there)."""
        return self._memory is not None

    def getvalue(self) -> bytes:
        """The data, when it is held in memory."""
        assert self._memory is not None
        return self._memory.getvalue()

    def discard(self) -> None:
        """Free the memory or remove the temporary file."""
        self.close()
        self._memory = None
        if self.file_path is not None:
            try:
                os.unlink(self.file_path)
            except FileNotFoundError:
                pass
            self.file_path = None


class RetryingFileSystem(FileSystemBase):
    """DCP's file-system interface over an fsspec file system, with every call retried.

    Writes are spooled locally and uploaded in one retried call when DCP closes the file, so a
    transient error re-sends the whole file and never leaves a half-written one. A file whose
    name ends in ``.tmp`` (DCP's ``.metadata.tmp``) is held until DCP renames it, and is then
    uploaded under its final name: one PUT instead of an upload, a copy and a delete. Reads
    download the whole file (memory, or a temporary file beyond ``SPOOL_MEMORY_BYTES``).
    """

    def __init__(
        self,
        fs: Any,
        retrier: Retrier,
        *,
        object_store: bool,
        root: str = "",
        checksums: ChecksumLog | None = None,
        expected: Mapping[str, Expected] | None = None,
    ) -> None:
        self.fs = fs
        self.retrier = retrier
        self.object_store = object_store
        self.root = root
        self.checksums = checksums
        self.expected = expected
        self._held: dict[str, _Spool] = {}
        self._ahead: dict[str, ConcurrentFuture[bytes]] = {}  # path -> its bytes, being read ahead
        self._lock = threading.Lock()

    reopen: tuple[str, dict[str, Any], RetryConfig] | None = None
    """(URL, storage options, retry) that open :attr:`fs` again in another process (its class
    may be one ckptmgr made at run time, which pickle cannot name)."""

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # sent to a checkpoint daemon before any file is held
        del state["_lock"]
        state["_held"] = {}
        state["_ahead"] = {}
        if self.reopen is not None:
            del state["fs"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        if "fs" not in state:
            assert self.reopen is not None
            self.fs, _ = open_filesystem(*self.reopen)

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        path = os.fspath(path)
        if "r" in mode:
            entry = (
                None if self.expected is None else self.expected.get(relative_name(self.root, path))
            )
            with self._lock:
                ahead = self._ahead.get(path)
            if ahead is not None:
                data = ahead.result()
                stream, size, crc = io.BytesIO(data), len(data), crc32(data)
            elif entry is not None and entry.size > 0:
                stream, size, crc = self._download_known(path, entry.size)
            else:
                stream, size, crc = self.retrier.call(f"read {path}", self._download, path)
            try:
                check_content(relative_name(self.root, path), self.expected, size, crc)
            except BaseException:
                stream.close()
                raise
            try:
                yield stream
            finally:
                stream.close()
            return
        spool = _Spool()
        try:
            yield spool
        except BaseException:
            spool.discard()
            raise
        if path.endswith(".tmp"):
            with self._lock:
                self._held[path] = spool
            return
        try:
            self._upload(spool, path)
        finally:
            spool.discard()

    def _upload(self, spool: _Spool, path: str) -> None:
        spool.close()
        if self.checksums is not None:
            self.checksums.add(relative_name(self.root, path), spool.tell(), spool.crc32)
        if spool.in_memory:
            data = spool.getvalue()
            self.retrier.call(f"upload {path}", self.fs.pipe_file, path, data)
        else:
            assert spool.file_path is not None
            self.retrier.call(f"upload {path}", self.fs.put_file, spool.file_path, path)

    def write_small_file(self, path: str | os.PathLike[str], data: bytes) -> None:
        """Upload ``data`` as a new file at ``path`` in one retried request; its checksum is
        logged."""
        path = os.fspath(path)
        self.retrier.call(f"upload {path}", self.fs.pipe_file, path, data)
        if self.checksums is not None:
            self.checksums.add(relative_name(self.root, path), len(data), crc32(data))

    def read_ahead(self, path: str | os.PathLike[str]) -> None:
        """Start reading ``path``, a file the commit record gives the size of (one ranged read:
        :func:`ckptmgr.remote_read.read_small_file_ahead`; else nothing is started), for the
        next ``create_stream`` of it on this file system to use (and check, as ever)."""
        path = os.fspath(path)
        entry = None if self.expected is None else self.expected.get(relative_name(self.root, path))
        if entry is None:
            return
        with self._lock:
            if path not in self._ahead:
                ahead = read_small_file_ahead(self.fs, path, self.retrier.call, entry.size)
                if ahead is not None:
                    self._ahead[path] = ahead

    def _download_known(self, path: str, size: int) -> tuple[IO[bytes], int, int]:
        """(the file's bytes, its size, its CRC-32) of a file whose record gives its ``size``,
        read by ranged reads, each retried, as data files are (:mod:`ckptmgr.remote_read`): no
        request for its size first, which fsspec's ``open`` makes (on GCS, three).
        ``CorruptCheckpointError`` where it is shorter or longer."""
        found: list[tuple[int, int]] = []

        def keep(size: int, crc: int) -> None:
            found.append((size, crc))

        name = relative_name(self.root, path)
        data = bytearray(size)
        fetch = ranged_reads(self.fs, path, self.retrier.call)
        with RemoteRangeSource(fetch, size, name, keep, hash_inline=True) as source:
            source.read_into(0, memoryview(data), None)
            source.finish()
        return io.BytesIO(data), *found[0]

    def _download(self, path: str) -> tuple[IO[bytes], int, int]:
        """(the file's bytes in a local spool, its size, its CRC-32), hashed while copying."""
        spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY_BYTES, prefix="ckptmgr-")
        size, crc = 0, 0
        try:
            with self.fs.open(path, "rb", block_size=_COPY_CHUNK) as remote:
                while True:
                    chunk = remote.read(_COPY_CHUNK)
                    if not chunk:
                        break
                    spool.write(chunk)
                    crc = crc32(chunk, crc)
                    size += len(chunk)
            spool.seek(0)
        except BaseException:
            spool.close()
            raise
        return spool, size, crc  # type: ignore[return-value]

    @contextmanager
    def open_data_file(self, path: str | os.PathLike[str]) -> Iterator[tensor_bytes.TensorSink]:
        """A data file spooled locally (hashed as it is spooled) and uploaded when closed."""
        with self.create_stream(path, "wb") as stream:
            yield tensor_bytes.StreamSink(stream)

    def write_data_file(
        self, path: str | os.PathLike[str], write: Callable[[tensor_bytes.TensorSink], T]
    ) -> T:
        """``write(sink)`` into a new data file; returns its result. On GCS and S3 uploaded
        while it is written (:mod:`ckptmgr.remote_write`; a failed upload is retried by writing
        the file again), elsewhere spooled and uploaded in one retried call
        (:meth:`open_data_file`)."""
        if not uploads_while_writing(self.fs):
            with self.open_data_file(path) as sink:
                return write(sink)
        path = os.fspath(path)
        result, size, crc = self.retrier.call(
            f"upload {path}", upload_while_writing, self.fs, path, write
        )
        if self.checksums is not None:
            self.checksums.add(relative_name(self.root, path), size, crc)
        return result

    @contextmanager
    def open_data_source(
        self, path: str | os.PathLike[str], *, hash_inline: bool = False
    ) -> Iterator[tensor_bytes.TensorSource]:
        """A data file read by ranged reads, several at once, each retried, straight into the
        destinations, and checked whole by ``finish`` (:mod:`ckptmgr.remote_read`)."""
        path = os.fspath(path)
        name = relative_name(self.root, path)
        entry = None if self.expected is None else self.expected.get(name)
        if self.expected is not None and entry is None:
            check_content(name, self.expected, 0, 0)  # (raises: the record does not list it)
        if entry is not None:
            size = entry.size
        else:
            size = self.retrier.call(f"size of {path}", self._fresh_size, path)

        def check(size: int, crc: int) -> None:
            check_content(name, self.expected, size, crc)

        fetch = ranged_reads(self.fs, path, self.retrier.call)
        with RemoteRangeSource(fetch, size, name, check, hash_inline=hash_inline) as source:
            yield source

    def _fresh_size(self, path: str) -> int:
        self.fs.invalidate_cache(path)
        return int(self.fs.size(path))

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        check_relative_path(suffix)
        return f"{os.fspath(path).rstrip('/')}/{suffix}"

    def init_path(self, path: str | os.PathLike[str], **kwargs: Any) -> str | os.PathLike[str]:
        return path

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        source, target = os.fspath(path), os.fspath(new_path)
        with self._lock:
            spool = self._held.pop(source, None)
        if spool is None:
            self.retrier.call(f"rename {source}", self.fs.mv, source, target)
            if self.checksums is not None:
                self.checksums.rename(
                    relative_name(self.root, source), relative_name(self.root, target)
                )
            return
        try:
            self._upload(spool, target)
        finally:
            spool.discard()

    def replace(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        """Rename ``path`` to ``new_path`` over whatever is there: a held file (``.metadata.tmp``)
        is uploaded under ``new_path``, which replaces an object in one request, with no check
        for one first."""
        self.rename(path, new_path)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        if not self.object_store:  # object stores have no directories to create
            self.retrier.call(f"create {path}", self.fs.makedirs, os.fspath(path), exist_ok=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True

    def exists(self, path: str | os.PathLike[str]) -> bool:
        path = os.fspath(path)
        with self._lock:
            if path in self._held:
                return True

        def fresh_exists() -> bool:
            self.fs.invalidate_cache(path)
            return bool(self.fs.exists(path))

        return self.retrier.call(f"check {path}", fresh_exists)

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        path = os.fspath(path)
        with self._lock:
            spool = self._held.pop(path, None)
        if self.checksums is not None:
            self.checksums.discard(relative_name(self.root, path))
        if spool is not None:
            spool.discard()
            return
        try:
            self.retrier.call(f"delete {path}", self.fs.rm_file, path)
        except FileNotFoundError:
            pass

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        return self.retrier.call(f"list {path}", self.fs.ls, os.fspath(path), detail=False)
