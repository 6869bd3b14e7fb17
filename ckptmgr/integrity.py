"""Integrity of a checkpoint: per-file checksums, computed while writing and checked on reading.

Every file of a step is listed in its commit record with its size and its CRC-32 (``zlib.crc32``,
the checksum of gzip and zip; computed by :func:`crc32`). The checksum is computed while the bytes
stream out of the writer (a hashing wrapper around the streams DCP writes, around the spool of a
remote upload, and around ckptmgr's own JSON files), never in a second pass over the data. On
restore every file's size is checked, and the checksum of every file that is read;
:func:`verify_step` checks one step on demand (sizes, or with ``deep=True`` the checksums of every
file).

Paths from a commit record or from DCP's metadata are checked by :func:`check_relative_path`:
they never leave the step directory.
"""

from __future__ import annotations

import io
import os
import posixpath
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptmgr.errors import CorruptCheckpointError

try:
    from zlib_ng.zlib_ng import crc32 as _zlib_ng_crc32
except ImportError:  # pragma: no cover - a dependency; a platform without its build falls back
    _zlib_ng_crc32 = None

_READ_CHUNK = 8 * 2**20
_CRC32: Callable[[Any, int], int] = zlib.crc32 if _zlib_ng_crc32 is None else _zlib_ng_crc32


def crc32(data: Any, value: int = 0) -> int:
    """The CRC-32 of the bytes-like ``data`` continued from ``value``, as ``zlib.crc32`` computes
    it. zlib-ng computes it where it is installed (a dependency): the same values, 2.3x as fast
    on the benchmark machine (6.9 against 3.0 GB/s), which matters where every byte read is
    checked (a restore of 1.2 GB hashed slower than the disk read). Either releases the GIL
    for large buffers."""
    return _CRC32(data, value)


def check_relative_path(path: str, *, step: int | None = None) -> str:
    """``path`` if it is a plain relative path inside a step directory, else
    ``CorruptCheckpointError``: no absolute paths, no ``..``, no backslashes, no empty parts."""
    if (
        not isinstance(path, str)
        or not path
        or "\\" in path
        or "\x00" in path
        or path.startswith("/")
        or posixpath.isabs(path)
        or os.path.isabs(path)
        or ":" in path.split("/", 1)[0]  # a drive letter or a URL scheme
        or any(part in ("", ".", "..") for part in path.split("/"))
    ):
        raise CorruptCheckpointError(
            f"checkpoint names the path {path!r}, which is not inside its step directory",
            path=str(path),
            step=step,
        )
    return path


class ChecksumLog:
    """Thread-safe record of the files a writer produced: name -> (size, crc32).

    DCP writes one file per writer thread; each one registers its size and checksum here when
    its stream is closed.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def add(self, name: str, size: int, crc: int) -> None:
        """Record (or replace) the size and checksum of ``name``."""
        with self._lock:
            self._entries[name] = (size, crc)

    def rename(self, old: str, new: str) -> None:
        """Move the entry of ``old`` (if any) to ``new``."""
        with self._lock:
            entry = self._entries.pop(old, None)
            if entry is not None:
                self._entries[new] = entry

    def __getstate__(self) -> dict[str, Any]:
        with self._lock:
            return {"_entries": dict(self._entries)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._entries = state["_entries"]
        self._lock = threading.Lock()

    def discard(self, name: str) -> None:
        """Forget ``name``."""
        with self._lock:
            self._entries.pop(name, None)

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """A copy of every entry."""
        with self._lock:
            return dict(self._entries)


CRC_BESIDE_WRITE_BYTES = 1 << 20
"""A write of at least this many bytes has its CRC-32 computed on a thread of its own while the
write runs (both release the GIL): 1 GiB written in 16 MiB pieces and fsynced took 0.78 s so,
against 1.02 s hashing after each write and 1.04 s not hashing at all (medians of 8, a disk
whose speed moved 3x within the run), the CRC alone 0.35 s. Below it, a thread costs more than
the hash."""


def _crc_beside(view: memoryview, crc: int) -> Callable[[], int]:
    """Start ``crc32(view, crc)`` on a new thread; returns a function that waits for it."""
    result: list[int] = []
    thread = threading.Thread(
        target=lambda: result.append(_CRC32(view, crc)), name="ckptmgr-crc", daemon=True
    )
    thread.start()

    def wait() -> int:
        thread.join()
        return result[0]

    return wait


class HashingWriter(io.RawIOBase):
    """A write-only stream that counts and checksums what passes through to ``target``.

    A large write is hashed while it is written (:data:`CRC_BESIDE_WRITE_BYTES`). Every other
    attribute (``fileno`` for DCP's fsync, ``flush``) is the target's.
    """

    def __init__(self, target: Any) -> None:
        super().__init__()
        self._target = target
        self.crc = 0
        self.size = 0

    def writable(self) -> bool:
        """True."""
        return True

    def write(self, data: Any) -> int:  # bytes-like
        """Write ``data`` to the target and add it to the checksum."""
        view = memoryview(data)
        hashed = _crc_beside(view, self.crc) if view.nbytes >= CRC_BESIDE_WRITE_BYTES else None
        try:
            written = self._target.write(view)
        finally:
            crc_of_all = hashed() if hashed is not None else None  # (never left running)
        count = view.nbytes if written is None else int(written)
        if count != view.nbytes:  # a raw target wrote part: checksum exactly what it took
            self.crc = _CRC32(view.cast("B")[:count], self.crc)
        elif crc_of_all is not None:
            self.crc = crc_of_all
        else:
            self.crc = _CRC32(view, self.crc)
        self.size += count
        return count

    def tell(self) -> int:
        """Bytes written so far (DCP's offsets into the file)."""
        return self.size

    def fileno(self) -> int:
        """The target's file descriptor (``io.UnsupportedOperation`` when it has none), with
        the target flushed first: DCP fsyncs ``fileno()`` without a flush, and an fsync of a
        descriptor whose bytes are still in Python's buffer makes none of them durable."""
        fileno = getattr(self._target, "fileno", None)
        if fileno is None:
            raise io.UnsupportedOperation("fileno")
        self.flush()
        return int(fileno())

    def flush(self) -> None:
        """Flush the target."""
        flush = getattr(self._target, "flush", None)
        if flush is not None and not getattr(self._target, "closed", False):
            flush()

    def close(self) -> None:
        """Mark this wrapper closed; the target is closed by whoever opened it."""
        if not self.closed:
            self.flush()
        super().close()


def crc32_of_stream(stream: Any) -> tuple[int, int]:
    """(size, crc32) of everything ``stream`` yields from its current position."""
    crc, size = 0, 0
    while True:
        chunk = stream.read(_READ_CHUNK)
        if not chunk:
            return size, crc
        crc = _CRC32(chunk, crc)
        size += len(chunk)


@dataclass(frozen=True)
class Expected:
    """What the commit record says about one file."""

    size: int
    crc32: int | None


def expected_files(entries: Iterable[Any], *, step: int | None = None) -> dict[str, Expected]:
    """``FileEntry`` list -> name -> :class:`Expected`, every path checked."""
    return {
        check_relative_path(entry.path, step=step): Expected(entry.size, entry.crc32)
        for entry in entries
    }


def check_content(
    name: str,
    expected: Mapping[str, Expected] | None,
    size: int,
    crc: int,
    *,
    step: int | None = None,
) -> None:
    """Raise ``CorruptCheckpointError`` when ``name``'s bytes differ from its record entry.

    ``expected`` None means the record lists no files (a record older than checksums): nothing
    is checked. A file the record does not list is refused.
    """
    if expected is None:
        return
    entry = expected.get(name)
    if entry is None:
        raise CorruptCheckpointError(
            f"{name} is not listed in the commit record", path=name, step=step
        )
    if size != entry.size:
        raise CorruptCheckpointError(
            f"{name} has {size} bytes, the commit record says {entry.size}: the file is damaged",
            path=name,
            step=step,
        )
    if entry.crc32 is not None and crc != entry.crc32:
        raise CorruptCheckpointError(
            f"{name} has CRC-32 {crc:08x}, the commit record says {entry.crc32:08x}: "
            "the file is damaged",
            path=name,
            step=step,
        )


@dataclass(frozen=True)
class FileProblem:
    """One file of a step that failed verification."""

    path: str
    problem: str


def check_sizes(
    expected: Mapping[str, Expected], actual_sizes: Mapping[str, int]
) -> list[FileProblem]:
    """Problems of a step's files from a listing (name -> size): missing or wrong size."""
    problems = []
    for name, entry in sorted(expected.items()):
        size = actual_sizes.get(name)
        if size is None:
            problems.append(FileProblem(name, "missing"))
        elif size != entry.size:
            problems.append(
                FileProblem(name, f"has {size} bytes, the commit record says {entry.size}")
            )
    return problems


def raise_problems(problems: list[FileProblem], step: int) -> None:
    """Raise one ``CorruptCheckpointError`` naming every problem (nothing if there is none)."""
    if not problems:
        return
    text = "; ".join(f"{p.path} {p.problem}" for p in problems)
    raise CorruptCheckpointError(
        f"step {step} is damaged: {text}",
        path=problems[0].path,
        step=step,
    )


def relative_name(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> str:
    """``path`` relative to the step directory ``root`` (DCP's files all lie directly in it)."""
    text, prefix = os.fspath(path), os.fspath(root).rstrip("/") + "/"
    if prefix != "/" and text.startswith(prefix):
        return text[len(prefix) :]
    return text.rsplit("/", 1)[-1]
