"""Where checkpoints live: one small interface over fsspec that the manager calls.

Layout under the root URL::

    step_000000001200/          one committed step (DCP files, plain values, commit.json)
    .tmp-step_000000001200-<id>/  a step being written on a local file system
    .deleting-step_...-<id>/      a step being deleted on a local file system
    owner.json                    the writing job's lease (ckptmgr.lease; and owner.json.lock
                                  beside it on NFS)

A step is committed exactly when ``step_<N>/commit.json`` exists. A committed step that was
found damaged is *quarantined*: ``step_<N>/quarantined.json`` says why, and the step is no longer
listed (nor deleted by retention); a new save of the same step moves it aside to
``step_<N>.quarantined-<ns>/`` first. Locally the record is written
inside the temporary directory, which is then renamed into place (an atomic commit); on object
stores, which cannot rename directories, the data is written in place and the record last, with a
create-only write where the store supports it.

Every call to a non-local store goes through :class:`~ckptmgr.retry.Retrier` (transient errors
are retried, see :mod:`ckptmgr.retry`). Listings never trust fsspec's listing cache: each one is a
fresh recursive listing of the root (one request per 1000 objects on GCS and S3), so a record
written by another process is seen at once.
"""

from __future__ import annotations

import datetime as _dt
import errno
import inspect
import json
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec
import fsspec.asyn
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from ckptmgr import local_glob
from ckptmgr.errors import CheckpointError, CorruptCheckpointError, describe_error
from ckptmgr.integrity import (
    Expected,
    FileProblem,
    check_content,
    check_sizes,
    crc32,
    crc32_of_stream,
    expected_files,
    raise_problems,
)
from ckptmgr.local_files import (
    NotRegularFileError,
    open_step_file,
    read_regular_file,
    remove_tree_iteratively,
    walk_files,
)
from ckptmgr.record import (
    QUARANTINE_NAME,
    RECORD_NAME,
    CommitRecord,
    FileEntry,
    NewerFormatError,
    utc_now,
)
from ckptmgr.remote_read import crc32_of_remote, ranged_reads, read_small_file_ahead
from ckptmgr.retry import (
    Retrier,
    RetryConfig,
    client_class,
    client_options,
    http_status,
    is_gcs_class,
    is_s3_class,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

_STEP_DIR = r"step_([0-9]{12,})"
"""A step directory's name, matched whole (ASCII digits: ``\\d`` matches any script's); the
group is its step. :func:`step_of_match` also checks that it is the name its step's directory
has (``step_0000000000005``, with a zero too many, is no step directory)."""
STEP_DIR_PATTERN = re.compile(_STEP_DIR)
_RECORD_IN_STEP_DIR = re.compile(f"{_STEP_DIR}/{re.escape(RECORD_NAME)}")
_MARKER_IN_STEP_DIR = re.compile(f"{_STEP_DIR}/{re.escape(QUARANTINE_NAME)}")
"""A step directory's record and quarantine marker, as a path relative to the root."""
QUARANTINED_ASIDE_PATTERN = re.compile(rf"{_STEP_DIR}\.quarantined-([0-9]+)")
TMP_PREFIX = ".tmp-"
DELETING_PREFIX = ".deleting-"
_LEFTOVER_NAME = re.compile(
    rf"(?:{re.escape(TMP_PREFIX)}|{re.escape(DELETING_PREFIX)}){_STEP_DIR}-.+", re.DOTALL
)
"""The names ckptmgr gives a save being written (``.tmp-step_<N>-<save_id>``) and a step being
deleted (``.deleting-step_<N>-<ns>``); see :func:`is_leftover_name`."""
OBJECT_STORE_PROTOCOLS = frozenset({"gs", "gcs", "s3", "s3a", "az", "abfs", "abfss", "oss"})
"""Protocols without real directories: a "directory" is a key prefix that exists while it holds
objects, and a rename copies every object."""


def step_dir_name(step: int) -> str:
    """Directory name of ``step``: zero-padded so that names sort like numbers."""
    return f"step_{step:012d}"


def is_leftover_name(name: str) -> bool:
    """Whether ``name`` is one ckptmgr gives a save being written or a step being deleted: a
    user's ``.tmp-notes.txt`` or ``.deleting-list.csv`` under the root is no leftover (the
    sweep deleted them, matching the prefix alone)."""
    return _LEFTOVER_NAME.fullmatch(name) is not None


def parse_step_dir_name(name: str) -> int | None:
    """The step of a step directory name, or None for any other name."""
    return step_of_match(STEP_DIR_PATTERN.fullmatch(name))


def step_of_match(match: re.Match[str] | None) -> int | None:
    """The step of a full match of a pattern that starts with a step directory's name (its
    first group), or None where there is none or the name is not the step's own."""
    if match is None:
        return None
    digits = match.group(1)
    if len(digits) > 12 and digits.startswith("0"):
        return None  # another spelling of a step whose directory has another name
    return int(digits)


def objects_file_name(rank: int) -> str:
    """Name of the JSON file that holds one rank's plain (non-tensor) values."""
    return f"objects-rank{rank:05d}.json"


def open_filesystem(
    url: str, storage_options: Mapping[str, Any] | None = None, retry: RetryConfig | None = None
) -> tuple[AbstractFileSystem, str]:
    """The fsspec file system and path of ``url``, like ``fsspec.core.url_to_fs``.

    For ``gs://`` and ``s3://`` the file system is a subclass of gcsfs'/s3fs' whose HTTP requests
    are retried by ckptmgr's policy (:func:`ckptmgr.retry.client_class`). The same URL, options and
    retry configuration give the same (cached) instance, so the manager and DCP share one.
    """
    options = dict(storage_options or {})
    protocol, _ = fsspec.core.split_protocol(url)
    if protocol is None or "::" in url:
        return fsspec.core.url_to_fs(url, **options)
    base = fsspec.get_filesystem_class(protocol)
    cls = client_class(base, retry or RetryConfig())
    if cls is base:
        return fsspec.core.url_to_fs(url, **options)
    kwargs = {**cls._get_kwargs_from_urls(url), **client_options(cls, options)}
    return cls(**kwargs), cls._strip_protocol(url)


def find_files(
    fs: AbstractFileSystem, path: str, *, likely_empty: bool = False
) -> dict[str, dict[str, Any]]:
    """``fs.find(path, detail=True)``. ``likely_empty`` (a new step's directory): one request,
    where a ``find`` of a path with nothing under it makes more: on S3 one listing of the
    parent's keys that start with ``<name>/`` (s3fs' ``find`` asks twice more whether the path
    is a file or a directory), on GCS one listing of the objects under ``path`` (gcsfs' lists
    again as a file's name). (Not for every listing: s3fs keeps what a plain ``find`` lists,
    and later reads of those files then skip a request for their size.)"""
    parent, _, name = path.rstrip("/").rpartition("/")
    if likely_empty and is_s3_class(type(fs)) and parent:
        return fs.find(parent, prefix=f"{name}/", detail=True)  # type: ignore[no-any-return]
    if likely_empty and is_gcs_class(type(fs)):
        list_objects = _gcs_object_listing(fs)
        if list_objects is not None:
            items, _ = fsspec.asyn.sync(fs.loop, list_objects, path, delimiter="")
            return {item["name"]: item for item in items}
    if _walks_with_ls(fs):
        return _find_by_ls(fs, path)
    return fs.find(path, detail=True)  # type: ignore[no-any-return]


def _walks_with_ls(fs: AbstractFileSystem) -> bool:
    """True where ``fs.find`` is fsspec's own: a walk of the tree, one ``ls`` per directory,
    which leaves out every directory below the first whose ``ls`` fails, whatever its
    ``on_error`` (fsspec 2026.9 does not pass it down the walk): files silently missing from
    the listing, steps not listed, a committed step's directory looking empty."""
    if isinstance(fs, fsspec.asyn.AsyncFileSystem):
        return type(fs)._find is fsspec.asyn.AsyncFileSystem._find
    return type(fs).find is AbstractFileSystem.find


def _find_by_ls(fs: AbstractFileSystem, path: str) -> dict[str, dict[str, Any]]:
    """What fsspec's own ``fs.find(path, detail=True)`` lists, by ``ls`` of each directory,
    raising the error of one that cannot be listed (but for one gone meanwhile: deleted while
    listed, it is left out)."""
    top = fs._strip_protocol(path).rstrip("/")
    found: dict[str, dict[str, Any]] = {}
    pending = [top]
    while pending:
        directory = pending.pop()
        try:
            listing = fs.ls(directory, detail=True)
        except FileNotFoundError:
            continue
        for info in listing:
            name = info["name"].rstrip("/")
            if info.get("type") != "directory":
                found[name] = info
            elif name.startswith(f"{directory}/"):  # (not the directory itself, nor above it)
                pending.append(name)
    return dict(sorted(found.items()))


def _gcs_object_listing(fs: AbstractFileSystem) -> Callable[..., Any] | None:
    """gcsfs' one listing of every object under a path (``_do_list_objects``), or None where
    this gcsfs has none of that form. gcsfs' ``find`` of a path with nothing under it lists it a
    second time, as a file's name (``path`` without the slash), whatever it is asked."""
    method = getattr(fs, "_do_list_objects", None)
    if method is None:
        return None
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return None
    return method if "delimiter" in parameters else None


def is_object_store(fs: AbstractFileSystem) -> bool:
    """True for file systems whose directories are key prefixes (GCS, S3, Azure, ...)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in OBJECT_STORE_PROTOCOLS for p in protocols)


@dataclass(frozen=True)
class Quarantined:
    """A committed step that was found damaged and is no longer listed."""

    step: int
    name: str
    """Its directory name: ``step_<N>``, or ``step_<N>.quarantined-<ns>`` once moved aside."""
    reason: str
    quarantined_at: str | None


@dataclass(frozen=True)
class Leftover:
    """Uncommitted data under the root (an interrupted save or delete)."""

    name: str
    path: str
    age_s: float | None
    """Seconds since its newest file was modified (None when the store does not say)."""


class AlreadyCommittedError(CheckpointError):
    """Raised when a commit finds the step already committed (by another writer)."""


_WILDCARDS = ("*", "?", "[")
"""What fsspec's ``rm`` and ``copy`` expand as a glob in a path (``fsspec.utils.has_magic``)."""


class CheckpointStorage:
    """List, write, commit and delete checkpoint steps under one fsspec URL.

    ``retry`` sets how transient errors of a remote store are retried (the default
    :class:`~ckptmgr.retry.RetryConfig` when None); local disks are never retried.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        retry: RetryConfig | None = None,
        *,
        create: bool = True,
    ) -> None:
        self.url = str(url)
        self.storage_options = dict(storage_options or {})
        self.retry = retry or RetryConfig()
        self._retrier = Retrier(self.retry)
        self.fs, self.root = open_filesystem(self.url, self.storage_options, self.retry)
        self.root = self.root.rstrip("/") or "/"
        self.is_local = isinstance(self.fs, LocalFileSystem)
        if not self.is_local and any(char in self.root for char in _WILDCARDS):
            raise CheckpointError(
                f"checkpoint root {self.url!r} contains one of {' '.join(_WILDCARDS)}: fsspec "
                "reads these as wildcards when it deletes or copies, so deleting a step could "
                "delete files of another path that they match; choose a root without them"
            )
        self.is_object_store = is_object_store(self.fs)
        if self.is_object_store and "//" in self.root:
            raise CheckpointError(
                f"checkpoint root {self.url!r} has an empty path segment ('//'): object stores "
                "and their fsspec file systems disagree on what such a key names (s3fs finds "
                "none of the objects it wrote under 'bucket//run', so every commit failed after "
                "the data was uploaded); remove the extra '/'"
            )
        self.run_local_file_work: Callable[..., Any] = run_here
        """What runs the file work of deleting a local step and of removing an uncommitted
        write (:func:`delete_local_step`, :func:`remove_local_tree`), called as
        ``run_local_file_work(function, *args)``: :func:`run_here`, in this process, unless the
        owner sets another (a manager in process mode has its checkpoint daemon run it, where
        its system calls share no GIL with the training loop)."""
        protocols = (
            self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        )
        self.reachable_from_other_processes = not (
            "memory" in protocols or isinstance(self.fs, MemoryFileSystem)
        )
        """False for an in-memory file system: another process sees nothing of it."""
        if create:  # (else read-only use: a root that does not exist lists no steps)
            if self.is_local:
                try:
                    self.fs.makedirs(self.root, exist_ok=True)
                except FileExistsError as exc:  # (the OS's "File exists" for a file there)
                    raise NotADirectoryError(
                        errno.ENOTDIR, "the checkpoint root is not a directory", self.root
                    ) from exc
            elif not self.is_object_store:  # (no directories there: s3fs' makedirs would
                # create a missing bucket, a mistyped name's included)
                self.call(f"create {self.root}", self.fs.makedirs, self.root, exist_ok=True)

    def call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` as one storage operation, retried on transient errors
        (remote stores only; ``what`` names it in the log). For the manager's other calls to
        this root's file system too (the owner lease's), which must be safe to repeat."""
        if self.is_local:
            return fn(*args, **kwargs)
        return self._retrier.call(what, fn, *args, **kwargs)

    # -- paths -------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        """A path under the root, in the file system's own form."""
        return "/".join([self.root.rstrip("/"), *parts])

    def step_path(self, step: int) -> str:
        """Path of a committed step's directory."""
        return self.path(step_dir_name(step))

    def aside_path(self, step: int) -> str:
        """A new path to move a quarantined step's directory aside to (unlisted, kept), so that
        a new save of the step can take its name."""
        return self.path(f"{step_dir_name(step)}.quarantined-{time.time_ns()}")

    def url_for(self, path: str) -> str:
        """A URL that DCP's fsspec writer/reader can open (local paths stay plain)."""
        return path if self.is_local else self.fs.unstrip_protocol(path)

    # -- listing -----------------------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        """Steps whose commit record exists, sorted; always read fresh from storage.

        Locally two calls of the C library's ``glob`` (or, where that is missing, one directory
        listing plus a ``stat`` per step); on other stores one recursive
        listing of the root (one request per 1000 objects on GCS and S3), whatever the number
        of steps.
        """
        committed, quarantined = self._committed_and_quarantined()
        return sorted(committed - quarantined)

    def quarantined_steps(self) -> list[int]:
        """Committed steps that are quarantined in place (``step_<N>/quarantined.json``)."""
        committed, quarantined = self._committed_and_quarantined()
        return sorted(committed & quarantined)

    def listed_steps(self) -> tuple[list[int], list[int]]:
        """(:meth:`committed_steps`, :meth:`quarantined_steps`) from one listing."""
        committed, quarantined = self._committed_and_quarantined()
        return sorted(committed - quarantined), sorted(committed & quarantined)

    def _committed_and_quarantined(
        self, listing: Mapping[str, Any] | None = None
    ) -> tuple[set[int], set[int]]:
        """(steps with a commit record, steps with a quarantine marker), fresh from storage
        (remote: from ``listing``, the root's, when given)."""
        if self.is_local:
            return local_committed_and_quarantined(self.root)
        committed: set[int] = set()
        quarantined: set[int] = set()
        for relative in self._find(self.root) if listing is None else listing:
            parts = relative.split("/")
            if len(parts) == 2 and parts[1] in (RECORD_NAME, QUARANTINE_NAME):
                step = parse_step_dir_name(parts[0])
                if step is not None:
                    (committed if parts[1] == RECORD_NAME else quarantined).add(step)
        return committed, quarantined

    def _find(self, path: str, *, likely_empty: bool = False) -> dict[str, dict[str, Any]]:
        """Every file under ``path`` (relative path -> info), listed fresh, with retries
        (``likely_empty``: see :func:`find_files`)."""
        prefix = path.rstrip("/") + "/"

        def listing() -> dict[str, dict[str, Any]]:
            self._forget_listings_under(path)
            try:
                found = find_files(self.fs, path, likely_empty=likely_empty)
            except FileNotFoundError:
                return {}
            return {
                name[len(prefix) :]: info
                for name, info in found.items()
                if name.startswith(prefix)
                and len(name) > len(prefix)  # (not a "directory" placeholder object)
                and info.get("type", "file") != "directory"
            }

        return self.call(f"list {path}", listing)

    def _forget_listings_under(self, path: str) -> None:
        """Drop the file system's cached listings of ``path``, its parents and every directory
        under it. s3fs fills its cache with one listing per directory while it lists a tree,
        never replaces one already there, and answers a read of a file from it without a
        request: a step listed while another process was writing it (its data there, its
        record not yet) kept that listing, and its ``commit.json`` was "missing" for every
        later read in this process, its data files too (a restore would have taken the step
        for damaged)."""
        self.fs.invalidate_cache(path)
        cache = getattr(self.fs, "dircache", None)
        if cache is None:
            return
        prefix = path.rstrip("/") + "/"
        for key in [key for key in list(cache) if str(key).startswith(prefix)]:
            cache.pop(key, None)

    def read_record(self, step: int) -> CommitRecord:
        """The commit record of a committed step; ``CheckpointError`` if it is unreadable."""
        return self.read_record_at(self.path(step_dir_name(step)), step)

    def read_record_at(self, step_path: str, step: int | None = None) -> CommitRecord:
        """The commit record in the step directory ``step_path``.

        ``CorruptCheckpointError`` when it is damaged (not JSON, invalid, a path that leaves the
        step directory, or a record of another step), ``CheckpointError`` when it is gone or of
        a newer format.
        """
        path = f"{step_path}/{RECORD_NAME}"
        try:
            record = CommitRecord.from_json(self._read_bytes(path))
        except OSError as exc:
            if self.is_local and _is_no_record(exc, path):
                raise CorruptCheckpointError(
                    f"commit record {path} is damaged: {exc}", path=RECORD_NAME, step=step
                ) from exc
            if not isinstance(exc, FileNotFoundError):
                raise
            raise CheckpointError(
                f"commit record {path} is gone (deleted by another process?)"
            ) from exc
        except NewerFormatError as exc:
            raise CheckpointError(f"commit record {path} is unsupported: {exc}") from exc
        except ValueError as exc:  # pydantic.ValidationError, bad UTF-8 and JSON are ValueErrors
            raise CorruptCheckpointError(
                f"commit record {path} is damaged: {exc}", path=RECORD_NAME, step=step
            ) from exc
        if step is not None and record.step != step:
            raise CorruptCheckpointError(
                f"commit record {path} is of step {record.step}, not {step}",
                path=RECORD_NAME,
                step=step,
            )
        return record

    def read_ahead(
        self, step: int, name: str, expected: Mapping[str, Expected] | None
    ) -> Future[bytes] | None:
        """Start reading the file ``name`` of a committed step on a remote store, where it is a
        round trip that need not wait for others (one ranged read of the size its record gives,
        for :meth:`read_objects`' ``ahead``); None on a local disk, or where the record gives no
        size or more than one read's worth
        (:func:`ckptmgr.remote_read.read_small_file_ahead`)."""
        entry = None if expected is None else expected.get(name)
        if self.is_local or entry is None:
            return None
        path = self.path(step_dir_name(step), name)
        return read_small_file_ahead(self.fs, path, self._retrier.call, entry.size)

    def read_objects(
        self,
        step: int,
        name: str,
        expected: Mapping[str, Expected] | None = None,
        ahead: Future[bytes] | None = None,
    ) -> dict[str, Any]:
        """One plain-values file of a committed step, as stored (still encoded).

        With ``expected`` (the commit record's files), its size and CRC-32 are checked first.
        ``ahead``: its bytes being read (:meth:`read_ahead`).
        """
        path = self.path(step_dir_name(step), name)
        try:
            raw = self._read_bytes(path) if ahead is None else ahead.result()
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(
                f"{path} is missing: the checkpoint is damaged", path=name, step=step
            ) from exc
        check_content(name, expected, len(raw), crc32(raw), step=step)
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise CorruptCheckpointError(
                f"{path} is not valid JSON: the checkpoint is damaged", path=name, step=step
            ) from exc
        except RecursionError as exc:  # no damage: how deep the caller's stack already is counts
            raise CheckpointError(
                f"{path} is nested deeper than Python's recursion limit allows here"
            ) from exc
        if not isinstance(data, dict):
            raise CorruptCheckpointError(
                f"{name} of step {step} is not a JSON object", path=name, step=step
            )
        return data

    # -- integrity ---------------------------------------------------------------------------
    def file_sizes(self, step_path: str) -> dict[str, int]:
        """Every file under the step directory ``step_path`` -> its size, listed fresh."""
        if self.is_local:
            sizes = {}
            for full in walk_files(step_path):
                try:
                    size = os.path.getsize(full)
                except OSError as exc:  # gone, a dangling link, a link loop: no file here
                    if not _leads_nowhere(exc):
                        raise
                    continue
                sizes[os.path.relpath(full, step_path).replace(os.sep, "/")] = size
            return sizes
        return {name: int(info.get("size") or 0) for name, info in self._find(step_path).items()}

    def check_sizes(self, step: int, record: CommitRecord) -> None:
        """Raise ``CorruptCheckpointError`` naming every file of the record that is missing or
        has another size (one listing of the step directory)."""
        expected = expected_files(record.files, step=step)
        problems = check_sizes(expected, self.file_sizes(self.step_path(step)))
        raise_problems(problems, step)

    def verify_files(
        self,
        step_path: str,
        record: CommitRecord,
        *,
        deep: bool,
        unreadable: list[FileProblem] | None = None,
    ) -> list[FileProblem]:
        """Every problem of the files of ``record`` in ``step_path``: missing files and sizes,
        and with ``deep`` the CRC-32 of every file (each file is read once). A file that cannot
        be read for a reason that says nothing of the checkpoint (an ``OSError``: no permission,
        say) raises, or where ``unreadable`` is given is added to it and the others are still
        checked."""
        try:
            expected = expected_files(record.files, step=record.step)
        except CorruptCheckpointError as exc:
            return [FileProblem(exc.path or "?", "is a path outside the step directory")]
        problems = check_sizes(expected, self.file_sizes(step_path))
        if not deep:
            return problems
        broken = {problem.path for problem in problems}
        for name, entry in sorted(expected.items()):
            if name in broken:
                continue
            if entry.crc32 is None:
                continue  # a record from before checksums: sizes only
            try:
                size, crc = self._crc32_of(f"{step_path}/{name}", name, entry.size)
            except FileNotFoundError:
                problems.append(FileProblem(name, "missing"))
                continue
            except CorruptCheckpointError as exc:  # (a remote file ends before its size)
                problems.append(FileProblem(name, f"does not match its record: {exc}"))
                continue
            except OSError as exc:
                if unreadable is None:
                    raise
                unreadable.append(FileProblem(name, describe_error(exc) or ""))
                continue
            try:
                check_content(name, expected, size, crc)
            except CorruptCheckpointError as exc:
                problems.append(FileProblem(name, str(exc).removeprefix(f"{name} ")))
        return problems

    def _crc32_of(self, path: str, name: str, size: int) -> tuple[int, int]:
        """(size, CRC-32) of the file at ``path`` (``name`` in its step), listed with ``size``
        bytes: read whole on a local disk, by ranged reads several at once elsewhere (as a
        restore reads data files, :mod:`ckptmgr.remote_read`), each retried."""
        if self.is_local:
            with open_step_file(path, name) as handle:
                return crc32_of_stream(handle)
        return crc32_of_remote(ranged_reads(self.fs, path, self.call), size, name)

    # -- quarantine --------------------------------------------------------------------------
    def quarantine(self, step: int, reason: str) -> bool:
        """Mark a committed step as damaged: it stays in storage, is no longer listed, and is
        never deleted by retention. Writes ``step_<N>/quarantined.json``; False, writing
        nothing, where the step's local directory is a symbolic link (the marker would be
        written where it leads: outside the root, perhaps into another job's step)."""
        marker = {
            "step": step,
            "reason": reason[:4000],
            "quarantined_at": utc_now().isoformat().replace("+00:00", "Z"),
        }
        if self.is_local and os.path.islink(self.step_path(step)):
            return False
        path = self.path(step_dir_name(step), QUARANTINE_NAME)
        data = json.dumps(marker, indent=1).encode()
        self._write_bytes(path, data)
        if self.is_local:
            _fsync_dir(self.step_path(step))
        return True

    def quarantined(self) -> list[Quarantined]:
        """Every quarantined step: marked in place, and moved aside by a later save."""
        found: list[Quarantined] = []
        for step in self.quarantined_steps():
            found.append(self._quarantine_info(step, step_dir_name(step)))
        if self.is_local:
            names = _listdir(self.root)
        else:
            names = sorted({rel.split("/", 1)[0] for rel in self._find(self.root) if "/" in rel})
        for name in names:
            step = step_of_match(QUARANTINED_ASIDE_PATTERN.fullmatch(name))
            if step is not None:
                found.append(self._quarantine_info(step, name))
        return sorted(found, key=lambda q: (q.step, q.name))

    def _quarantine_info(self, step: int, name: str) -> Quarantined:
        try:
            marker = json.loads(self._read_bytes(self.path(name, QUARANTINE_NAME)))
            reason = str(marker.get("reason", ""))
            when = marker.get("quarantined_at")
        except (OSError, ValueError, AttributeError) as exc:
            reason, when = f"(quarantine marker unreadable: {exc})", None
        return Quarantined(step=step, name=name, reason=reason, quarantined_at=when)

    def _move_quarantined_aside(self, step: int) -> None:
        """Move a quarantined ``step_<N>/`` to ``step_<N>.quarantined-<ns>/`` (kept, unlisted),
        so that a new save can take its name: on remote stores (a local commit renames it aside
        itself: :func:`commit_local_step`)."""
        source = self.step_path(step)
        target = self.aside_path(step)
        log.warning("moving quarantined step %d aside to %s before saving it again", step, target)
        files = sorted(self._find(source))
        if not self.is_object_store:  # (a file system of directories: copies need one there)
            self.call(f"create {target}", self.fs.makedirs, target, exist_ok=True)
        for name in files:  # copy everything, the record and the marker last, then delete
            if name not in (RECORD_NAME, QUARANTINE_NAME):
                self.call(f"copy {name}", self.fs.copy, f"{source}/{name}", f"{target}/{name}")
        for name in (QUARANTINE_NAME, RECORD_NAME):
            if name in files:
                self.call(f"copy {name}", self.fs.copy, f"{source}/{name}", f"{target}/{name}")
        for name in (RECORD_NAME, QUARANTINE_NAME):
            if name in files:
                self.call(f"delete {name}", self.fs.rm_file, f"{source}/{name}")
        rest = [f"{source}/{n}" for n in files if n not in (RECORD_NAME, QUARANTINE_NAME)]
        self._remove_tree(source, rest)

    def _read_bytes(self, path: str) -> bytes:
        if self.is_local:  # a FIFO, a device: refused, not waited on or read for ever
            return read_regular_file(path)
        return self.call(f"read {path}", self.fs.cat_file, path)

    # -- writing -----------------------------------------------------------------------------
    def write_dir(self, step: int, save_id: str) -> str:
        """The directory a new save of ``step`` writes into (created empty)."""
        if self.is_local:
            path = self.path(f"{TMP_PREFIX}{step_dir_name(step)}-{save_id}")
        else:
            path = self.step_path(step)
        return path

    def prepare_write_dir(self, path: str) -> None:
        """Create ``path``; on other stores, clear leftovers of an interrupted earlier save.

        Raises :class:`AlreadyCommittedError` when ``path`` holds a commit record: a committed
        step is never written into.
        """
        if self.is_local:
            os.makedirs(path, exist_ok=True)  # (fsspec's makedirs: 4x the time, GIL held)
            return
        existing = self._find(path, likely_empty=True)
        if RECORD_NAME in existing and QUARANTINE_NAME in existing:
            step = parse_step_dir_name(path.rstrip("/").rsplit("/", 1)[-1])
            if step is not None:
                self._move_quarantined_aside(step)
                existing = self._find(path)
        if RECORD_NAME in existing:
            raise AlreadyCommittedError(f"{path} is already committed")
        if existing:
            log.info("removing %d objects of an interrupted save in %s", len(existing), path)
            self._remove_tree(path, [f"{path}/{name}" for name in existing])
        if not self.is_object_store:
            self.call(f"create {path}", self.fs.makedirs, path, exist_ok=True)

    def ensure_dir(self, path: str) -> None:
        """Create directory ``path`` if the store has directories (not on object stores)."""
        if self.is_local:
            os.makedirs(path, exist_ok=True)
        elif not self.is_object_store:
            self.call(f"create {path}", self.fs.makedirs, path, exist_ok=True)

    def _write_bytes(self, path: str, data: bytes) -> None:
        if self.is_local:
            write_synced(path, data)
        else:
            self.call(f"write {path}", self.fs.pipe_file, path, data)

    def list_files(self, path: str) -> list[FileEntry]:
        """Every file under ``path`` with its size, relative to ``path``."""
        if self.is_local:
            sizes = local_file_sizes(path)
        else:
            sizes = {
                name: int(info.get("size") or 0)
                for name, info in self._find(path).items()
                if not name.endswith("/")  # a "folder" marker of another tool: no file of ours
            }
        return [FileEntry(path=relative, size=size) for relative, size in sorted(sizes.items())]

    def commit(self, step: int, path: str, record: CommitRecord) -> None:
        """Make the step written into ``path`` committed, atomically where the store allows.

        On remote stores the record is written last, in one request, create-only where the store
        supports it (S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``): a record that already
        exists is read back, and unless it is this save's own (an earlier try that did land),
        :class:`AlreadyCommittedError` is raised.
        """
        if not self.is_local:
            self._commit_remote(step, f"{path}/{RECORD_NAME}", record)
            return
        aside = self.aside_path(step)
        moved_aside = commit_local_step(  # (in this process: see commit_local_step)
            self.root, path, self.step_path(step), aside, record.to_json()
        )
        if moved_aside:
            log_moved_aside(step, aside)

    def _commit_remote(self, step: int, target: str, record: CommitRecord) -> None:
        data = record.to_json()
        try:
            self.call(f"write commit record {target}", self._create_only, target, data)
            return
        except FileExistsError:
            if self._holds_own_record(target, record):
                return
            raise AlreadyCommittedError(f"step {step} was committed by another writer") from None
        except Exception:
            # A try whose reply was lost may have written it before the tries that failed.
            if self._holds_own_record(target, record):
                return
            raise

    def _holds_own_record(self, target: str, record: CommitRecord) -> bool:
        """True when ``target`` is ``record`` (by its save id), written by an earlier try."""
        try:
            existing = CommitRecord.from_json(self._read_bytes(target))
        except Exception:  # absent, unreadable, or the store still failing: not known to be ours
            return False
        if existing.save_id != record.save_id:
            return False
        log.info("commit record of step %d was written by an earlier try", record.step)
        return True

    def _create_only(self, path: str, data: bytes) -> None:
        """Write ``path`` unless it exists (``FileExistsError``), in one request if possible.

        Stores without conditional writes (a ``mode`` that fsspec does not know, or HTTP 501 from
        an S3-compatible server) get a check and a plain write: a best effort, like GCS emulators
        that accept ``ifGenerationMatch=0`` and ignore it.

        On a file system whose writes are not atomic (not an object store), a write that fails
        midway may leave part of the record: that is removed (see :meth:`_remove_partial`),
        so the step is not listed damaged, and a retried try does not find the file taken.
        """
        try:
            try:
                self.fs.pipe_file(path, data, mode="create")
                return
            except TypeError:
                pass
            except Exception as exc:
                if http_status(exc) != 501:
                    raise
            self.fs.invalidate_cache(path)
            if self.fs.exists(path):
                raise FileExistsError(path)
            self.fs.pipe_file(path, data)
        except FileExistsError:  # there before this write: not its part
            raise
        except Exception:
            if not self.is_object_store:  # (an object store never shows part of an object)
                self._remove_partial(path, data)
            raise

    def _remove_partial(self, path: str, data: bytes) -> None:
        """Remove what a failed create-only write of ``data`` left at ``path`` (nothing was
        there before it): a file holding the start of ``data``, or one that cannot be read
        (best effort: one that cannot be removed is found damaged later; a file holding anything
        else is not this write's, and stays)."""
        try:
            self.fs.invalidate_cache(path)
            left: bytes | None = self.fs.cat_file(path)  # (one try: within a try of the write)
        except FileNotFoundError:  # nothing there
            return
        except Exception:  # there, but unreadable: made by this write all the same
            left = None
        if left is not None and (left == data or not data.startswith(left)):
            return  # whole after all, or not this write's
        try:
            self.fs.rm_file(path)
            log.warning("removed %s, left partly written by a failed write", path)
        except Exception as exc:
            log.warning("could not remove %s, left partly written by a failed write: %s", path, exc)

    def discard(self, path: str) -> None:
        """Remove an uncommitted write directory (best effort). One that holds a whole commit
        record stays (the commit landed after all, or another writer's did); one whose record is
        partial (a failed write on a file system that is not an object store, which could not
        be removed then) goes, the record first: the directory was cleared for this save."""
        try:
            if self.is_local:
                self.run_local_file_work(remove_local_tree, path)
                return
            existing = self._find(path)
            record = f"{path}/{RECORD_NAME}"
            if RECORD_NAME in existing and not self._holds_partial_record(record):
                return
            files = [f"{path}/{name}" for name in existing if name != RECORD_NAME]
            self._remove_tree(path, [record, *files] if RECORD_NAME in existing else files)
        except Exception as exc:  # the next manager's leftover sweep gets it
            log.warning("could not remove uncommitted checkpoint data %s: %s", path, exc)

    def _holds_partial_record(self, record: str) -> bool:
        """True when ``record`` reads back as no commit record at all (not damage to check:
        only a write of this save's can have left it, on a file system that is not an object
        store); False for a whole record, on an object store, or when it cannot be read."""
        if self.is_object_store:
            return False
        try:
            data = self._read_bytes(record)
        except Exception:
            return False
        try:
            CommitRecord.from_json(data)
        except NewerFormatError:
            return False
        except ValueError:
            return True
        return False

    # -- deleting ----------------------------------------------------------------------------
    def delete_step(self, step: int) -> None:
        """Delete a committed step: the record first (so it is never half-listed), then the data.
        Raises when the step could not be deleted (it stays listed and whole); a failure after
        that, to remove its files, is logged, and the next manager's sweep removes them.

        On remote stores the data objects are listed once and deleted in batches (S3 deletes up
        to 1000 keys per request).
        """
        path = self.step_path(step)
        if self.is_local:
            doomed = self.path(f"{DELETING_PREFIX}{step_dir_name(step)}-{time.time_ns()}")
            self.run_local_file_work(delete_local_step, self.root, path, doomed)
            return
        record = f"{path}/{RECORD_NAME}"
        try:
            self.call(f"delete commit record {record}", self.fs.rm_file, record)
        except FileNotFoundError:
            pass
        try:
            self._remove_tree(path, [f"{path}/{name}" for name in self._find(path)])
        except Exception as exc:  # the step is deleted (not listed): its files are a leftover
            log.warning(
                "step %d is deleted (its commit record is gone), but removing its files under "
                "%s failed: %s: %s; the next manager's sweep of leftovers removes them",
                step,
                path,
                type(exc).__name__,
                exc,
            )

    def _remove_tree(self, path: str, files: list[str]) -> None:
        """Delete ``files`` (all under ``path``) in batches, then ``path`` itself if it is a
        directory of its own (not on object stores, where it vanishes with its last object)."""
        if files:
            self.call(f"delete {len(files)} objects under {path}", self._remove_files, files)
        if not self.is_object_store:

            def remove_dir() -> None:
                try:
                    self.fs.rm(path, recursive=True)
                except FileNotFoundError:
                    pass

            self.call(f"delete {path}", remove_dir)

    def _remove_files(self, files: list[str]) -> None:
        """Delete the objects ``files``, each by its literal name. ``fs.rm`` of a list (one
        batch request per 1000 on S3, per 100 on GCS) takes a name with ``*``, ``?`` or ``[``
        for a pattern, and s3fs drops a name's trailing ``/`` (a "folder" marker a console
        makes): such names, which another tool wrote, are deleted one by one (a pattern had
        deleted another object of the step, and left the marker and the literal name)."""
        batched = [name for name in files if not _is_odd_object_name(name)]
        one_by_one = [name for name in files if _is_odd_object_name(name)]
        try:
            if batched:
                self.fs.rm(batched)
        except FileNotFoundError:  # a retry after a partly done batch: delete what is left
            one_by_one = batched + one_by_one
        for name in one_by_one:
            try:
                self.fs.rm_file(name)
            except FileNotFoundError:
                continue

    def leftovers(self) -> list[Leftover]:
        """Uncommitted data under the root: interrupted saves and deletes, sorted by name."""
        if not self.is_local:
            return self._remote_leftovers()
        self.fs.invalidate_cache(self.root)
        found = []
        now = time.time()
        for entry in self.fs.ls(self.root, detail=False):
            name = entry.rstrip("/").split("/")[-1]
            full = self.path(name)
            if not self._is_leftover(name, full):
                continue
            newest = self._newest_mtime(full)
            if newest is None:  # gone meanwhile: nothing left over
                continue
            found.append(Leftover(name=name, path=full, age_s=max(now - newest, 0.0)))
        return sorted(found, key=lambda leftover: leftover.name)

    def _remote_leftovers(self, listing: Mapping[str, Any] | None = None) -> list[Leftover]:
        """Leftovers from one recursive listing of the root (``listing``, when given)."""
        groups: dict[str, list[dict[str, Any]]] = {}
        for relative, info in (self._find(self.root) if listing is None else listing).items():
            top, _, rest = relative.partition("/")
            if rest:
                groups.setdefault(top, []).append({**info, "_relative": rest})
        now = time.time()
        found = []
        for name, infos in groups.items():
            if is_leftover_name(name):
                pass
            elif parse_step_dir_name(name) is None:
                continue
            elif any(info["_relative"] == RECORD_NAME for info in infos):
                continue
            times = [t for t in (_info_mtime(info) for info in infos) if t is not None]
            age = max(now - max(times), 0.0) if times else None
            found.append(Leftover(name=name, path=self.path(name), age_s=age))
        return sorted(found, key=lambda leftover: leftover.name)

    def sweep_and_list(self, grace_s: float) -> list[int]:
        """:meth:`remove_leftovers` then :meth:`committed_steps` (opening a manager); on a
        remote store a root without leftovers is listed once for both."""
        if self.is_local:
            self.remove_leftovers(grace_s)
            return self.committed_steps()
        listing = self._find(self.root)
        leftovers = self._remote_leftovers(listing)
        if not leftovers:
            committed, quarantined = self._committed_and_quarantined(listing)
            return sorted(committed - quarantined)
        self.remove_leftovers(grace_s, found=leftovers)
        return self.committed_steps()  # (anew: one may have been committed meanwhile)

    def remove_leftovers(
        self, grace_s: float, keep: Iterable[str] = (), found: list[Leftover] | None = None
    ) -> list[str]:
        """Delete uncommitted data older than ``grace_s`` seconds; returns what was removed
        (``found``: the :meth:`leftovers`, listed just now)."""
        keep_set = set(keep)
        removed = []
        for leftover in self.leftovers() if found is None else found:
            if leftover.path in keep_set or leftover.age_s is None or leftover.age_s < grace_s:
                continue
            try:
                if self.is_local:
                    if not self._remove_local_leftover(leftover):
                        continue
                else:
                    files = self._find(leftover.path)  # anew: a writer may be at it again
                    if RECORD_NAME in files:  # committed meanwhile (a slow writer): keep it
                        continue
                    now = time.time()
                    ages = [_info_mtime(info) for info in files.values()]
                    if any(t is None or now - t < grace_s for t in ages):
                        continue  # written to since it was listed: not left over after all
                    self._remove_tree(leftover.path, [f"{leftover.path}/{n}" for n in files])
                removed.append(leftover.name)
            except Exception as exc:
                log.warning("could not remove leftover %s: %s", leftover.path, exc)
        if removed:
            log.info("removed leftovers of interrupted saves/deletes: %s", removed)
        return removed

    def _is_leftover(self, name: str, full: str) -> bool:
        """Whether the entry ``name`` of the local root (at ``full``) is what an interrupted
        save or delete left: a directory (or a link: never followed) of a leftover's name, or a
        step directory without a commit record. A plain file is none: ckptmgr makes none of
        those names a file (a user's file named ``step_<N>`` was deleted)."""
        if is_leftover_name(name):
            pass
        elif parse_step_dir_name(name) is None:
            return False
        elif exists_locally(f"{full}/{RECORD_NAME}"):
            return False
        try:
            return not stat.S_ISREG(os.lstat(full).st_mode)
        except FileNotFoundError:
            return False  # (gone meanwhile: nothing left over)

    def _newest_mtime(self, path: str) -> float | None:
        """The newest modification time under ``path``; None when it is gone meanwhile (a save
        committed or discarded it, a delete renamed it)."""
        if os.path.islink(path):  # what it leads to is no save's (not walked: /usr took 4 s)
            if not os.path.exists(path):  # (a link that loops or leads nowhere, unreadable)
                return None
            try:
                return os.lstat(path).st_mtime  # its own time
            except FileNotFoundError:
                return None
        try:
            newest = os.path.getmtime(path)
        except OSError as exc:
            if _leads_nowhere(exc):
                return None
            raise
        for full in walk_files(path):
            try:  # a link's own time: what it leads to is no save's, and may be unreadable
                newest = max(newest, os.lstat(full).st_mtime)
            except OSError as exc:
                if not _leads_nowhere(exc):
                    raise
        return newest

    def _remove_local_leftover(self, leftover: Leftover) -> bool:
        """Remove a local leftover; False when it is gone or turned out committed. An
        uncommitted ``step_<N>/`` is first renamed aside and checked again there, so that a
        save of step N that commits meanwhile (its commit replaces that directory) is never
        removed with it."""
        path = leftover.path
        if parse_step_dir_name(leftover.name) is not None:
            aside = self.path(f"{DELETING_PREFIX}{leftover.name}-{time.time_ns()}")
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                return False
            if exists_locally(os.path.join(aside, RECORD_NAME)):  # committed meanwhile
                os.rename(aside, path)
                return False
            path = aside
        remove_local_tree(path)
        return True


def local_committed_steps(root: str) -> list[int]:
    """The committed steps under the local root ``root`` (what
    :meth:`CheckpointStorage.committed_steps` lists), sorted."""
    committed, quarantined = local_committed_and_quarantined(root)
    return sorted(committed - quarantined)


def local_committed_and_quarantined(root: str) -> tuple[set[int], set[int]]:
    """(steps with a commit record, steps with a quarantine marker) under the local root
    ``root``: three calls of the C library's ``glob`` (:func:`_glob_committed_and_quarantined`),
    or, where that cannot answer, one directory listing plus a ``stat`` per step. A step
    directory that cannot be looked in (no permission, an I/O error) raises the ``OSError``:
    it may hold a committed step."""
    matched = _glob_committed_and_quarantined(root)
    if matched is not None:
        return matched
    committed: set[int] = set()
    quarantined: set[int] = set()
    for name in _listdir(root):
        step = parse_step_dir_name(name)
        if step is not None:
            _look_in_step_dir(root, name, step, committed, quarantined)
    return committed, quarantined


def _look_in_step_dir(
    root: str, name: str, step: int, committed: set[int], quarantined: set[int]
) -> None:
    """Add ``step`` to ``committed`` (and ``quarantined``) by what its directory ``name``
    holds; raises for a directory that cannot be looked in (see :func:`exists_locally`)."""
    if exists_locally(os.path.join(root, name, RECORD_NAME)):
        committed.add(step)
        if exists_locally(os.path.join(root, name, QUARANTINE_NAME)):
            quarantined.add(step)


def _glob_committed_and_quarantined(root: str) -> tuple[set[int], set[int]] | None:
    """The listing of :func:`local_committed_and_quarantined` in three calls of the C library
    (:mod:`ckptmgr.local_glob`) instead of a ``stat`` per step from Python, each of which costs
    a Python-bound training loop a GIL hand-over. None where that cannot answer, and where
    nothing matched (a root that is missing, empty or not a directory, which the listing in
    Python handles as it always did, and at no cost).

    glob(3) takes a record it cannot look at (a step directory without permission) for a
    missing one: every step directory it found no record in (a leftover, or such a directory)
    is looked in from Python, which raises for it (usually none or a few)."""
    records = local_glob.match(root, f"step_*/{RECORD_NAME}")
    if not records:
        return None
    markers = local_glob.match(root, f"step_*/{QUARANTINE_NAME}")
    step_dirs = local_glob.match(root, "step_*/")
    if markers is None or step_dirs is None:
        return None

    def steps(paths: list[str], in_step_dir: re.Pattern[str]) -> set[int]:
        found = (step_of_match(in_step_dir.fullmatch(path)) for path in paths)
        return {step for step in found if step is not None}

    committed = steps(records, _RECORD_IN_STEP_DIR)
    quarantined = steps(markers, _MARKER_IN_STEP_DIR) & committed
    for path in step_dirs:
        name = path.rstrip("/")
        step = parse_step_dir_name(name)
        if step is not None and step not in committed:
            _look_in_step_dir(root, name, step, committed, quarantined)
    return committed, quarantined


def log_moved_aside(step: int, aside: str) -> None:
    """The warning that a local commit moved quarantined step ``step`` aside to ``aside``."""
    log.warning("moved quarantined step %d aside to %s before saving it again", step, aside)


def run_here(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)``, in the calling thread (the default ``run_local_file_work``)."""
    return function(*args)


def commit_local_step(root: str, path: str, final: str, aside: str, record: bytes) -> bool:
    """Commit the local write directory ``path`` as the step directory ``final``: the commit
    record's bytes ``record`` written into it and synced, ``path`` synced, renamed to ``final``,
    and ``root`` (their parent) synced. A quarantined step in ``final`` is moved to ``aside``
    first (returns True then); ``AlreadyCommittedError`` if ``final`` holds another record.

    Safe to run again after an interruption: when ``path`` is gone and ``final`` holds this
    very record, the commit was done (only the sync of ``root`` is repeated).

    It runs in the calling process, not through ``run_local_file_work``: handed to the
    checkpoint daemon that way (tried at b0ed874), the record's bytes (0.7 MB for 20,000
    tensors) crossed the pipe in several writes, and a Python-bound training loop lost more of
    its time to the GIL than with the file work done here (docs/benchmarks.md). In process mode
    the daemon's writer makes the record and calls it (:mod:`ckptmgr.daemon_commit`)."""
    final_record = os.path.join(final, RECORD_NAME)
    if not os.path.exists(path) and _holds_bytes(final_record, record):
        _fsync_dir(root)
        return False
    write_synced(os.path.join(path, RECORD_NAME), record)
    _fsync_dir(path)
    moved_aside = False
    if exists_locally(os.path.join(final, QUARANTINE_NAME)) and exists_locally(final_record):
        os.rename(final, aside)  # kept, unlisted: a new save takes the step's name
        _fsync_dir(root)
        moved_aside = True
    if exists_locally(final):
        if exists_locally(final_record):
            raise AlreadyCommittedError(f"{final} was committed by another writer")
        remove_local_tree(final)  # remains of an interrupted delete: never listed
    os.rename(path, final)
    _fsync_dir(root)
    return moved_aside


def write_synced(path: str, data: bytes) -> None:
    """Write ``data`` as the file ``path`` (created or truncated) and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _holds_bytes(path: str, data: bytes) -> bool:
    """True when the file ``path`` exists and holds exactly ``data``."""
    try:
        with open(path, "rb") as handle:
            return handle.read(len(data) + 1) == data
    except OSError:
        return False


def delete_local_step(root: str, path: str, doomed: str) -> None:
    """Delete the local step directory ``path`` (nothing if it is gone): renamed to ``doomed``
    first, which makes it invisible in one atomic step (``root``, their parent, is synced
    then), and removed after. Safe to run again after an interruption: a ``doomed`` directory
    left behind is a leftover that the next manager's sweep removes. Raises only while the step
    is there: once it is renamed, a failure to remove its files is logged (a warning), not
    raised, for the step is deleted."""
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        if exists_locally(path):
            raise
        return  # (gone: deleted meanwhile by another process, a second `ckptmgr prune`)
    _fsync_dir(root)
    try:
        remove_local_tree(doomed)
    except OSError as exc:  # the step is deleted (no longer listed): its files are a leftover
        log.warning(
            "step directory %s is deleted (renamed to %s), but removing its files failed: "
            "%s: %s; the next manager's sweep of leftovers removes them",
            path,
            doomed,
            type(exc).__name__,
            exc,
        )


def remove_local_tree(path: str) -> None:
    """Remove the local directory ``path`` and everything under it; nothing if it is gone,
    or if another process removes it (or part of it) at the same time. A link (to a directory
    elsewhere, say) or a file there is removed itself: nothing it leads to is touched."""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        if os.path.islink(path):
            log.warning(
                "%s is a symbolic link (to %s): the link is removed, what it leads to is left "
                "as it is",
                path,
                os.readlink(path),
            )
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    try:
        shutil.rmtree(path, ignore_errors=True)
    except RecursionError:  # a tree deeper than the recursion limit (not ckptmgr's)
        remove_tree_iteratively(path)
    if os.path.lexists(path):  # what could not be removed: once more, for its error
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            if os.path.lexists(path):
                raise


def exists_locally(path: str) -> bool:
    """Whether the local ``path`` exists (a link there counts, even one that leads nowhere, as
    for ``glob(3)``, which lists the committed steps). Unlike ``os.path.exists``, which answers
    False for any error, only its absence is False (or a loop of links on the way, which no
    file can be behind): a path that cannot be looked at (a directory on the way without
    permission, an I/O error) raises, so that a committed step is never taken for a missing
    one (left out of a listing, or swept as a leftover)."""
    try:
        os.lstat(path)
    except OSError as exc:
        if _leads_nowhere(exc):
            return False
        raise
    return True


_GLOB_MAGIC = re.compile(r"[*?\[]")


def _is_odd_object_name(name: str) -> bool:
    """True for an object name that ``fs.rm`` would not delete as it is: one with a character
    fsspec expands as a pattern, or a "folder" marker's trailing ``/``."""
    return name.endswith("/") or _GLOB_MAGIC.search(name) is not None


def _is_no_record(error: OSError, path: str) -> bool:
    """True where reading the local record ``path`` failed with ``error`` because what is there
    can never be one: a directory, a FIFO, a socket or a device, a link that loops or leads
    nowhere (a record deleted meanwhile is no damage, and a permission is no damage either)."""
    if isinstance(error, NotRegularFileError):
        return True
    if error.errno in (errno.ELOOP, errno.ENXIO):
        return True
    return isinstance(error, FileNotFoundError) and os.path.lexists(path)


def _leads_nowhere(error: OSError) -> bool:
    """True for an error that says no file is at the path: it is missing, a directory on the
    way is a file or missing, or the links on the way loop."""
    return isinstance(error, (FileNotFoundError, NotADirectoryError)) or (
        error.errno == errno.ELOOP
    )


def _info_mtime(info: dict[str, Any]) -> float | None:
    for key in ("mtime", "LastModified", "updated", "created", "last_modified"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, (int, float)):
            return float(value)
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        try:
            return _dt.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
    return None


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def json_bytes(payload: Any) -> bytes:
    """``payload`` as the compact UTF-8 JSON ckptmgr writes (``ValueError`` for NaN and
    infinities, ``TypeError`` for what JSON cannot hold)."""
    return json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()


def local_file_sizes(path: str) -> dict[str, int]:
    """Every entry under the local directory ``path`` other than a directory, by its
    ``/``-separated path relative to ``path``, with its size, as fsspec's ``find`` lists them
    (a symbolic link is listed, not descended, with its target's size, 0 when it has none):
    one ``scandir`` per directory, about a third of the time ``find`` takes."""
    sizes: dict[str, int] = {}
    pending = [("", path)]
    while pending:
        relative, directory = pending.pop()
        try:
            listing = os.scandir(directory)
        except FileNotFoundError:  # (gone meanwhile: nothing, as find lists nothing)
            continue
        with listing as entries:
            for entry in entries:
                name = f"{relative}{entry.name}"
                if entry.is_dir(follow_symlinks=False):
                    pending.append((f"{name}/", entry.path))
                else:
                    try:
                        sizes[name] = entry.stat().st_size
                    except FileNotFoundError:  # a link to nothing
                        sizes[name] = 0
    return sizes


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
