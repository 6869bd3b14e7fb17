"""Where checkpoints live: one small interface over fsspec that the manager calls.

Layout under the root URL::

    step_000000001200/          one committed step (DCP files, plain values, commit.json)
    .tmp-step_000000001200-<id>/  a step being written on a local file system
    .deleting-step_...-<id>/      a step being deleted on a local file system

A step is committed exactly when ``step_<N>/commit.json`` exists. Locally the record is written
inside the temporary directory, which is then renamed into place (an atomic commit); on object
stores, which cannot rename directories, the data is written in place and the record last.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterable
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ckptmgr.errors import CheckpointError
from ckptmgr.record import RECORD_NAME, CommitRecord, FileEntry

log = logging.getLogger(__name__)

STEP_DIR_PATTERN = re.compile(r"^step_(\d{12,})$")
TMP_PREFIX = ".tmp-"
DELETING_PREFIX = ".deleting-"


def step_dir_name(step: int) -> str:
    """Directory name of ``step``: zero-padded so that names sort like numbers."""
    return f"step_{step:012d}"


def parse_step_dir_name(name: str) -> int | None:
    """The step of a step directory name, or None for any other name."""
    match = STEP_DIR_PATTERN.match(name)
    return int(match.group(1)) if match else None


def objects_file_name(rank: int) -> str:
    """Name of the JSON file that holds one rank's plain (non-tensor) values."""
    return f"objects-rank{rank:05d}.json"


class AlreadyCommittedError(CheckpointError):
    """Raised when a commit finds the step already committed (by another writer)."""


class CheckpointStorage:
    """List, write, commit and delete checkpoint steps under one fsspec URL."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = str(url)
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.root = self.root.rstrip("/") or "/"
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.fs.makedirs(self.root, exist_ok=True)

    # -- paths -------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        """A path under the root, in the file system's own form."""
        return "/".join([self.root.rstrip("/"), *parts])

    def step_path(self, step: int) -> str:
        """Path of a committed step's directory."""
        return self.path(step_dir_name(step))

    def url_for(self, path: str) -> str:
        """A URL that DCP's fsspec writer/reader can open (local paths stay plain)."""
        return path if self.is_local else self.fs.unstrip_protocol(path)

    # -- listing -----------------------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        """Steps whose commit record exists, sorted; always read fresh from storage."""
        self.fs.invalidate_cache(self.root)
        if self.is_local:
            steps = []
            for name in _listdir(self.root):
                step = parse_step_dir_name(name)
                if step is not None and os.path.exists(os.path.join(self.root, name, RECORD_NAME)):
                    steps.append(step)
            return sorted(steps)
        found = self.fs.glob(self.path("step_*", RECORD_NAME))
        steps = {parse_step_dir_name(p.rstrip("/").split("/")[-2]) for p in found}
        return sorted(s for s in steps if s is not None)

    def read_record(self, step: int) -> CommitRecord:
        """The commit record of a committed step; ``CheckpointError`` if it is unreadable."""
        path = self.path(step_dir_name(step), RECORD_NAME)
        try:
            return CommitRecord.from_json(self.fs.cat_file(path))
        except FileNotFoundError as exc:
            raise CheckpointError(
                f"commit record {path} is gone (deleted by another process?)"
            ) from exc
        except ValueError as exc:  # pydantic.ValidationError and a newer format are ValueErrors
            raise CheckpointError(f"commit record {path} is damaged or unsupported: {exc}") from exc

    def read_objects(self, step: int, name: str) -> dict[str, Any]:
        """One plain-values file of a committed step, as stored (still encoded)."""
        path = self.path(step_dir_name(step), name)
        try:
            data = json.loads(self.fs.cat_file(path))
        except FileNotFoundError as exc:
            raise CheckpointError(f"{path} is missing: the checkpoint is damaged") from exc
        except ValueError as exc:
            raise CheckpointError(f"{path} is not valid JSON: the checkpoint is damaged") from exc
        if not isinstance(data, dict):
            raise CheckpointError(f"{name} of step {step} is not a JSON object")
        return data

    # -- writing -----------------------------------------------------------------------------
    def write_dir(self, step: int, save_id: str) -> str:
        """The directory a new save of ``step`` writes into (created empty)."""
        if self.is_local:
            path = self.path(f"{TMP_PREFIX}{step_dir_name(step)}-{save_id}")
        else:
            path = self.step_path(step)
        return path

    def prepare_write_dir(self, path: str) -> None:
        """Create ``path``; on object stores, clear leftovers of an interrupted earlier save."""
        if not self.is_local and self.fs.exists(path):
            if self.fs.exists(f"{path}/{RECORD_NAME}"):
                raise AlreadyCommittedError(f"{path} is already committed")
            self.fs.rm(path, recursive=True)
        self.fs.makedirs(path, exist_ok=True)

    def write_json(self, path: str, payload: Any) -> None:
        """Write a JSON document (fsynced on local disks)."""
        data = json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()
        self._write_bytes(path, data)

    def _write_bytes(self, path: str, data: bytes) -> None:
        if self.is_local:
            with open(path, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        else:
            self.fs.pipe_file(path, data)

    def list_files(self, path: str) -> list[FileEntry]:
        """Every file under ``path`` with its size, relative to ``path``."""
        self.fs.invalidate_cache(path)
        entries = []
        for full, info in sorted(self.fs.find(path, detail=True).items()):
            relative = full[len(path.rstrip("/")) + 1 :]
            entries.append(FileEntry(path=relative, size=int(info.get("size") or 0)))
        return entries

    def commit(self, step: int, path: str, record: CommitRecord) -> None:
        """Make the step written into ``path`` committed, atomically where the store allows."""
        if not self.is_local:
            self._write_bytes(f"{path}/{RECORD_NAME}", record.to_json())
            return
        self._write_bytes(os.path.join(path, RECORD_NAME), record.to_json())
        _fsync_dir(path)
        final = self.step_path(step)
        if os.path.exists(final):
            if os.path.exists(os.path.join(final, RECORD_NAME)):
                raise AlreadyCommittedError(f"step {step} was committed by another writer")
            self._remove_local_tree(final)  # remains of an interrupted delete: never listed
        os.rename(path, final)
        _fsync_dir(self.root)

    def discard(self, path: str) -> None:
        """Remove an uncommitted write directory (best effort)."""
        try:
            if self.is_local:
                self._remove_local_tree(path)
            elif self.fs.exists(path) and not self.fs.exists(f"{path}/{RECORD_NAME}"):
                self.fs.rm(path, recursive=True)
        except Exception as exc:  # the next manager's leftover sweep gets it
            log.warning("could not remove uncommitted checkpoint data %s: %s", path, exc)

    # -- deleting ----------------------------------------------------------------------------
    def delete_step(self, step: int) -> None:
        """Delete a committed step: the record first (so it is never half-listed), then the data."""
        path = self.step_path(step)
        record = f"{path}/{RECORD_NAME}"
        if self.is_local:
            if not os.path.exists(path):
                return
            doomed = self.path(f"{DELETING_PREFIX}{step_dir_name(step)}-{time.time_ns()}")
            os.rename(path, doomed)  # one atomic step makes it invisible
            _fsync_dir(self.root)
            self._remove_local_tree(doomed)
            return
        if self.fs.exists(record):
            self.fs.rm_file(record)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def remove_leftovers(self, grace_s: float, keep: Iterable[str] = ()) -> list[str]:
        """Delete uncommitted data older than ``grace_s`` seconds; returns what was removed."""
        keep_set = set(keep)
        self.fs.invalidate_cache(self.root)
        removed = []
        now = time.time()
        for entry in self.fs.ls(self.root, detail=False):
            name = entry.rstrip("/").split("/")[-1]
            full = self.path(name)
            if full in keep_set or not self._is_leftover(name, full):
                continue
            newest = self._newest_mtime(full)
            if newest is None or now - newest < grace_s:
                continue
            try:
                if self.is_local:
                    self._remove_local_tree(full)
                else:
                    self.fs.rm(full, recursive=True)
                removed.append(name)
            except Exception as exc:
                log.warning("could not remove leftover %s: %s", full, exc)
        if removed:
            log.info("removed leftovers of interrupted saves/deletes: %s", removed)
        return removed

    def _is_leftover(self, name: str, full: str) -> bool:
        if name.startswith((TMP_PREFIX, DELETING_PREFIX)):
            return True
        if parse_step_dir_name(name) is None:
            return False
        return not self.fs.exists(f"{full}/{RECORD_NAME}")

    def _newest_mtime(self, path: str) -> float | None:
        if self.is_local:
            newest = os.path.getmtime(path)
            for dirpath, _, files in os.walk(path):
                for name in files:
                    try:
                        newest = max(newest, os.path.getmtime(os.path.join(dirpath, name)))
                    except FileNotFoundError:
                        continue
            return newest
        times = [_info_mtime(info) for info in self.fs.find(path, detail=True).values()]
        known = [t for t in times if t is not None]
        return max(known) if known else None

    @staticmethod
    def _remove_local_tree(path: str) -> None:
        if os.path.exists(path):
            shutil.rmtree(path)


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
