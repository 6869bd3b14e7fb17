"""``ckptmgr export``: one committed step rebuilt as nested dicts and written as a single
``torch.save`` file, without running code from the checkpoint (see :mod:`ckptmgr.cli`)."""

from __future__ import annotations

import os
import re
import sys
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.planner import ReadItem

from ckptmgr import objects
from ckptmgr.cli_output import Report, format_bytes, one_line, plural, progress
from ckptmgr.dcp_io import TensorOnlyLoadPlanner, make_reader
from ckptmgr.errors import CheckpointError, CorruptCheckpointError
from ckptmgr.integrity import expected_files
from ckptmgr.packing import PACK_KEY, placed_in_record, unpacked
from ckptmgr.record import CommitRecord, is_raw
from ckptmgr.state import split_rank_private
from ckptmgr.step_restore import load_step
from ckptmgr.storage import CheckpointStorage, objects_file_name

ESCAPED_KEY_CHAR = re.compile(r"%2F|%25")
"""What ``ckptmgr.state.join_path`` escapes in a key: ``/`` as ``%2F``, ``%`` as ``%25``."""


@dataclass
class ExportedState:
    """A step rebuilt as nested dicts, and what went into it."""

    state: dict[str, Any] = field(default_factory=dict)
    tensor_count: int = 0
    tensor_bytes: int = 0
    plain_value_count: int = 0


def export_state(storage: CheckpointStorage, record: CommitRecord, rank: int) -> ExportedState:
    """Load one step's tensors and plain values (as ``rank`` restores them) into nested dicts.

    This is what ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` does (empty
    tensors rebuilt from the metadata, loaded in one process), but safely: the metadata goes
    through ckptmgr's restricted unpickler, and pickled (BYTE_IO) items are refused up front and
    again in the planner, never unpickled.
    """
    storage.check_sizes(record.step, record)  # as a restore does: missing files named at once
    metadata = new_reader(storage, record).read_metadata()
    refuse_pickled_items(metadata)
    placed = placed_in_record(record)
    stored_tensors = [
        name
        for name, item in metadata.state_dict_metadata.items()
        if isinstance(item, dcp_metadata.TensorStorageMetadata) and name != PACK_KEY
    ]
    stored_names = tensors_for_rank([*stored_tensors, *placed], rank)
    buffers = {
        name: empty_tensor_like(metadata.state_dict_metadata[name])
        for name in stored_names
        if name not in placed
    }
    if placed:
        pack_item = metadata.state_dict_metadata.get(PACK_KEY)
        if not isinstance(pack_item, dcp_metadata.TensorStorageMetadata):
            raise CorruptCheckpointError(
                "the record names packed tensors; the metadata has no pack"
            )
        buffers[PACK_KEY] = empty_tensor_like(pack_item)
    exported = ExportedState(tensor_count=len(stored_names))
    exported.tensor_bytes = sum(t.numel() * t.element_size() for t in buffers.values())
    with progress("reading", exported.tensor_bytes, format_bytes) as bar:
        planner = ProgressLoadPlanner(on_loaded=bar.advance)
        load_step(record.step, buffers, new_reader(storage, record), None, planner, what="export")
    if placed:
        buffers.update(unpacked(buffers.pop(PACK_KEY), placed))
    tree = NestedState()
    for name, path in stored_names.items():
        tree.insert(path, buffers[name])
    plain_values = read_plain_values(storage, record, rank)
    for path, value in plain_values.items():
        tree.insert(path, value)
    exported.state = tree.root
    exported.plain_value_count = len(plain_values)
    return exported


def new_reader(storage: CheckpointStorage, record: CommitRecord) -> Any:
    """ckptmgr's safe DCP reader for one committed step: files checked against ``record``."""
    return make_reader(
        storage.url_for(storage.step_path(record.step)),
        local=storage.is_local,
        storage_options=storage.storage_options,
        retry=storage.retry,
        expected=expected_files(record.files, step=record.step) if record.files else None,
        raw=is_raw(record),
    )


def refuse_pickled_items(metadata: dcp_metadata.Metadata) -> None:
    """Raise ``CheckpointError`` if the checkpoint holds pickled (BYTE_IO) items."""
    pickled = sorted(
        name
        for name, item in metadata.state_dict_metadata.items()
        if isinstance(item, dcp_metadata.BytesStorageMetadata)
    )
    if pickled:
        raise CheckpointError(
            f"the checkpoint holds pickled objects {pickled}; ckptmgr never unpickles "
            "checkpoint data, so it cannot export this step"
        )


def tensors_for_rank(names: Iterable[str], rank: int) -> dict[str, str]:
    """Stored tensor name -> path, for what ``rank`` would restore, among the stored ``names``.

    Shared tensors are stored under their path. Per-rank tensors (``%rank00003%/<path>``) are
    taken from ``rank``, or from rank 0 when ``rank`` has no copy; other ranks' copies are left out.
    """
    chosen: dict[str, str] = {}
    private: dict[str, dict[int, str]] = {}
    for name in names:
        private_name = split_rank_private(name)
        if private_name is None:
            chosen[name] = name
        else:
            rank_of_copy, path = private_name
            private.setdefault(path, {})[rank_of_copy] = name
    for path, by_rank in private.items():
        name = by_rank.get(rank, by_rank.get(0))
        if name is not None:
            chosen[name] = path
    return chosen


def empty_tensor_like(item: dcp_metadata.TensorStorageMetadata) -> torch.Tensor:
    """An uninitialised CPU tensor of the stored global shape and dtype."""
    return torch.empty(item.size, dtype=item.properties.dtype)


class ProgressLoadPlanner(TensorOnlyLoadPlanner):
    """ckptmgr's tensor-only planner that reports the bytes of every chunk it has loaded."""

    def __init__(self, on_loaded: Callable[[int], None]) -> None:
        super().__init__()
        self.on_loaded = on_loaded

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Called by DCP once a chunk is in place."""
        super().commit_tensor(read_item, tensor)
        self.on_loaded(tensor.numel() * tensor.element_size())


def read_plain_values(
    storage: CheckpointStorage, record: CommitRecord, rank: int
) -> dict[str, Any]:
    """Decoded plain values by path, from ``rank``'s file or else rank 0's (as restore does),
    checked against the record's size and CRC-32 first (``CorruptCheckpointError``)."""
    expected = expected_files(record.files, step=record.step) if record.files else None
    for name in (objects_file_name(rank), objects_file_name(0)):
        if name in record.object_files:
            stored = storage.read_objects(record.step, name, expected)
            return {path: objects.decode(value) for path, value in stored.items()}
    return {}


def unescape_key(part: str) -> str:
    """Undo ``ckptmgr.state.join_path``'s escaping: ``%2F`` -> ``/`` and ``%25`` -> ``%``."""
    return ESCAPED_KEY_CHAR.sub(lambda match: "/" if match[0] == "%2F" else "%", part)


class NestedState:
    """Nested dicts built from stored paths such as ``model/fc1.weight``."""

    def __init__(self) -> None:
        self.root: dict[str, Any] = {}
        self._branches: set[tuple[str, ...]] = set()
        self._leaves: set[tuple[str, ...]] = set()

    def insert(self, path: str, value: Any) -> None:
        """Put ``value`` at ``path``; ``CheckpointError`` if the path clashes with another."""
        keys = tuple(unescape_key(part) for part in path.split("/"))
        node = self.root
        for depth in range(1, len(keys)):
            if keys[:depth] in self._leaves:
                raise self._clash(path)
            self._branches.add(keys[:depth])
            node = node.setdefault(keys[depth - 1], {})
        if keys in self._leaves or keys in self._branches:
            raise self._clash(path)
        self._leaves.add(keys)
        node[keys[-1]] = value

    @staticmethod
    def _clash(path: str) -> CheckpointError:
        return CheckpointError(
            f"cannot export: the checkpoint has a value at {path!r} and also under or above it"
        )


def check_output_path(given: str, storage: CheckpointStorage) -> Path:
    """The path of the file to write, ``given`` on the command line; fails before any loading
    if it cannot be written as a file, or lies under ``storage``'s root (export writes nothing
    there: ``OUT.pt`` in a step directory replaced a committed file)."""
    if given.endswith(("/", os.sep)):  # (pathlib drops it: a file was written by that name)
        raise CheckpointError(f"{given} names a directory; give the file to write")
    output = Path(given)
    if storage.is_local:
        root = os.path.realpath(storage.root)
        where = os.path.realpath(output)
        if where == root or where.startswith(root.rstrip(os.sep) + os.sep):
            raise CheckpointError(
                f"{output} is under the checkpoint root {storage.root}: export writes nothing "
                "there (it could replace a step's own files); give a path outside it"
            )
    if output.is_dir():
        raise CheckpointError(f"{output} is a directory; give the file to write")
    if output.exists() and not output.is_file():  # (a FIFO, a device such as /dev/null)
        raise CheckpointError(
            f"{output} is not a regular file: export writes a new file and renames it over "
            "the path, which would replace it; give the path of a regular file or a new one"
        )
    if not output.parent.is_dir():
        raise CheckpointError(f"cannot write {output}: {output.parent} is not a directory")
    return output


def write_torch_file(state: Mapping[str, Any], output: Path, expected_bytes: int) -> None:
    """``torch.save`` to a temporary file beside ``output``, fsync it, then rename it into place.

    ``expected_bytes`` (the tensor data) sizes the progress bar; the file is slightly larger.
    """
    # (a short name: OUT.pt's own within it went past the 255 bytes a name may have)
    temporary = output.with_name(f".ckptmgr-export-{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        with (
            progress("writing", expected_bytes, format_bytes) as bar,
            open(temporary, "wb") as handle,
        ):
            torch.save(dict(state), CountingWriter(handle, bar.advance))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, output)
    except (RuntimeError, OSError) as error:  # (torch.save's failed writes: RuntimeError)
        raise CheckpointError(f"cannot write {output}: {one_line(error)}") from error
    finally:
        try:
            temporary.unlink(missing_ok=True)
        except OSError as error:  # (not in place of the failure being raised)
            print(
                f"ckptmgr: warning: could not remove {temporary}: {one_line(error)}",
                file=sys.stderr,
            )


class CountingWriter:
    """A binary file for ``torch.save`` that reports the bytes written through it."""

    def __init__(self, handle: BinaryIO, on_written: Callable[[int], None]) -> None:
        self.handle = handle
        self.on_written = on_written

    def write(self, data: bytes) -> int:
        """Write ``data`` to the file and report its size."""
        written = self.handle.write(data)
        self.on_written(memoryview(data).nbytes)
        return written

    def flush(self) -> None:
        """Flush the file."""
        self.handle.flush()


def render_export(report: Report, out: TextIO) -> None:
    """One summary line."""
    print(
        f"wrote step {report['step']} (rank {report['rank']}) to {report['output']}: "
        f"{plural(report['tensors'], 'tensor')} ({format_bytes(report['tensor_bytes'])}), "
        f"{plural(report['plain_values'], 'plain value')}, {format_bytes(report['file_size'])}",
        file=out,
    )
