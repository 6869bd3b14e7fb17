"""Reading and writing tensors with torch.distributed.checkpoint, without running pickled code.

DCP stores its global ``.metadata`` with pickle and loads non-tensor items with
``torch.load(weights_only=False)``. ckptmgr stores only tensors through DCP and reads the
metadata with torch's weights-only unpickler, restricted to DCP's own metadata classes.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from ckptmgr.errors import CheckpointError

try:  # FsspecReader/Writer live in a private module; the import path has been stable since 2.2.
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
except ImportError:  # pragma: no cover - very old torch
    from torch.distributed.checkpoint import FsspecReader, FsspecWriter  # type: ignore

# A plain single process is a supported mode, not a mistake: keep DCP from warning on every call.
warnings.filterwarnings(
    "ignore",
    message=r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent "
    r"is to (save|load) in a single process",
    category=UserWarning,
)

_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    (_DCP_METADATA_MODULE, name): getattr(dcp_metadata, name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
    if hasattr(dcp_metadata, name)
}
_ALLOWED_GLOBALS[("torch", "Size")] = torch.Size
_ALLOWED_GLOBALS[("pathlib", "PosixPath")] = pathlib.PurePosixPath
_ALLOWED_GLOBALS[("pathlib", "WindowsPath")] = pathlib.PureWindowsPath
_ALLOWED_GLOBALS[("collections", "OrderedDict")] = collections.OrderedDict
try:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    _ALLOWED_GLOBALS[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
except ImportError:  # pragma: no cover
    pass


def _layout_by_name(name: str) -> torch.layout:
    layout = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(layout, torch.layout):
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r}")
    return layout


_ALLOWED_GLOBALS[("torch.serialization", "_get_layout")] = _layout_by_name


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that can build DCP metadata objects and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED_GLOBALS.get((module, name))
        if allowed is not None:
            return allowed
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


def load_metadata_safely(stream: Any) -> dcp_metadata.Metadata:
    """Unpickle DCP metadata allowing only DCP's metadata classes (no arbitrary code runs)."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(stream.read())).load()
    except Exception as exc:  # UnpicklingError, EOFError, AttributeError, ...
        raise CheckpointError(f"checkpoint metadata is not plain DCP metadata: {exc}") from exc
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"checkpoint metadata has unexpected type {type(metadata).__name__}")
    return metadata


class _SafeMetadataMixin:
    """Replaces DCP's ``pickle.load`` of ``.metadata`` with :func:`load_metadata_safely`."""

    fs: Any
    load_id: Any
    path: Any

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        get_path = getattr(self, "_get_metadata_path", None)
        path = (
            get_path(kwargs.get("rank"))
            if get_path
            else self.fs.concat_path(self.path, ".metadata")
        )
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata_safely(stream)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_SafeMetadataMixin, FileSystemReader):
    """DCP's local reader with a restricted metadata unpickler."""


class SafeFsspecReader(_SafeMetadataMixin, FsspecReader):
    """DCP's fsspec reader with a restricted metadata unpickler."""


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """Loads tensors in place; refuses pickled (BYTE_IO) items instead of unpickling them."""

    def __init__(self) -> None:
        super().__init__(allow_partial_load=False)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"checkpoint item {read_item.dest_index.fqn!r} is a pickled object; ckptmgr never "
            "unpickles checkpoint data"
        )


def make_writer(
    url_or_path: str, *, local: bool, thread_count: int, storage_options: dict[str, Any]
) -> FileSystemWriter | FsspecWriter:
    """A DCP writer for one step directory: fsynced files locally, no ``os.sync()`` remotely."""
    if local:
        return FileSystemWriter(
            url_or_path, single_file_per_rank=True, sync_files=True, thread_count=thread_count
        )
    return FsspecWriter(
        url_or_path,
        single_file_per_rank=True,
        sync_files=False,  # fsspec streams have no fileno(): DCP would fall back to os.sync()
        thread_count=thread_count,
        **storage_options,
    )


def make_reader(
    url_or_path: str, *, local: bool, storage_options: dict[str, Any]
) -> SafeFileSystemReader | SafeFsspecReader:
    """A DCP reader for one committed step directory."""
    if local:
        return SafeFileSystemReader(url_or_path)
    return SafeFsspecReader(url_or_path, **storage_options)


def save_tensors(
    tensors: dict[str, torch.Tensor], writer: Any, group: dist.ProcessGroup | None
) -> dcp_metadata.Metadata:
    """Write ``tensors`` with DCP; collective over ``group`` when distributed."""
    return dcp.save(tensors, storage_writer=writer, process_group=group)


def load_tensors(
    tensors: dict[str, torch.Tensor], reader: Any, group: dist.ProcessGroup | None
) -> None:
    """Fill ``tensors`` in place from a checkpoint with DCP."""
    dcp.load(tensors, storage_reader=reader, planner=TensorOnlyLoadPlanner(), process_group=group)
