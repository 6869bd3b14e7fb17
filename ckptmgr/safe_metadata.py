"""Unpickling DCP's ``.metadata`` without running code from it, at the C unpickler's speed.

DCP pickles its global metadata: one object per stored tensor, and per chunk of it an offset,
a size and where its bytes lie. A sharded state has a chunk per tensor and rank (5,000 small
DTensors on two ranks: 10,000 chunks, 1.6 MB), and every rank unpickles the whole file on
every restore.

Pickle runs code through the globals it names: :meth:`_MetadataUnpickler.find_class` names
only DCP's metadata classes and the few types inside them. Pickle's BUILD then sets attributes
on the object below it, and a crafted file can put there what ``find_class`` handed out: the
classes of this process, changed for everything in it. The pure-Python unpickler can be told to
refuse such a BUILD, but costs about 80 µs per chunk; the C one cannot. So ``find_class``
hands out nothing shared that BUILD could change:

* each of DCP's classes as a stand-in made for this load (:class:`_StandIn`), whose
  construction gives an object of the real class and which refuses to have attributes set;
* DCP's memory-format enum as a stand-in whose members are fresh :class:`_EncodedFormat`
  objects (which refuse attributes too) equal to the real member they name;
* ``torch.Size`` and torch's dtypes, layouts and memory formats as they are, and ``dict`` for
  ``OrderedDict`` (whose instances would take attributes): built-in types and objects that
  take no attributes.
"""

from __future__ import annotations

import io
import operator
import pathlib
import pickle
from typing import Any, NoReturn

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata

from ckptmgr.errors import CorruptCheckpointError
from ckptmgr.integrity import check_relative_path

try:  # _StorageInfo (an item's file, offset and length) is private; stable since torch 2.0
    from torch.distributed.checkpoint.filesystem import _StorageInfo
except ImportError:  # pragma: no cover
    _StorageInfo = None  # type: ignore[assignment,misc]

_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"

_CLASSES: dict[tuple[str, str], type] = {
    (_DCP_METADATA_MODULE, name): getattr(dcp_metadata, name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
    )
    if hasattr(dcp_metadata, name)
}
"""DCP's Python classes a ``.metadata`` may name, handed out as stand-ins."""
_CLASSES[("pathlib", "PosixPath")] = pathlib.PurePosixPath
_CLASSES[("pathlib", "WindowsPath")] = pathlib.PureWindowsPath
_CLASSES[("pathlib", "PurePosixPath")] = pathlib.PurePosixPath
_CLASSES[("pathlib", "PureWindowsPath")] = pathlib.PureWindowsPath
if _StorageInfo is not None:
    _CLASSES[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo

_BUILT_IN_TYPES: dict[tuple[str, str], type] = {
    ("torch", "Size"): torch.Size,
    # A plain dict (ordered as well): an OrderedDict takes attributes, which a BUILD could set
    # to shadow its methods (``values``) from the checks below
    ("collections", "OrderedDict"): dict,
}
"""Types handed out: built-in types whose instances take no attributes (BUILD on one fails)."""

_MEMORY_FORMAT_ENCODING = getattr(dcp_metadata, "_MEM_FORMAT_ENCODING", None)

# torch's dtypes, layouts and memory formats by name, read from the module's own namespace:
# a name from the file never reaches getattr(torch, ...), whose lazy submodules would import.
_TORCH_ENUMS: dict[str, Any] = {
    name: value
    for name, value in vars(torch).items()
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format))
}


def _refuse_attributes(target: object) -> NoReturn:
    raise pickle.UnpicklingError(
        f"refusing to set attributes of {target!r} from checkpoint metadata"
    )


class _StandIn(type):
    """The type of a stand-in: a class made for one load, constructed like the real one (its
    ``__new__`` returns an object of the real class), whose attributes cannot be set."""

    def __setattr__(cls, name: str, value: Any) -> None:
        _refuse_attributes(cls)

    def __delattr__(cls, name: str) -> None:
        _refuse_attributes(cls)


def _stand_in(name: str, make: Any) -> type:
    """A stand-in named ``name`` whose construction with ``args`` returns ``make(*args)``."""

    def __new__(cls: type, *args: Any) -> Any:
        return make(*args)

    return _StandIn(name, (), {"__new__": staticmethod(__new__), "__slots__": ()})


def _new_of(real: type) -> Any:
    """What NEWOBJ does with ``real``: ``real.__new__(real, *args)``, no ``__init__``."""
    return lambda *args: real.__new__(real, *args)


class _EncodedFormat:
    """A member of DCP's memory-format enum as a ``.metadata`` names it: equal to the real
    member (which is what ``TensorProperties.__setstate__`` compares it with), one object per
    mention, and no attribute of it can be set."""

    __slots__ = ("member",)
    member: Any

    def __init__(self, member: Any) -> None:
        object.__setattr__(self, "member", member)

    def __eq__(self, other: object) -> bool:
        return other is self.member

    def __hash__(self) -> int:
        return hash(self.member)

    def __setattr__(self, name: str, value: Any) -> None:
        _refuse_attributes(self)

    def __delattr__(self, name: str) -> None:
        _refuse_attributes(self)

    def __repr__(self) -> str:
        return f"_EncodedFormat({self.member!r})"


def _encoded_format(value: Any) -> _EncodedFormat:
    assert _MEMORY_FORMAT_ENCODING is not None
    try:
        return _EncodedFormat(_MEMORY_FORMAT_ENCODING(value))
    except (ValueError, TypeError) as exc:
        raise pickle.UnpicklingError(f"unknown memory format encoding {value!r}") from exc


def _layout_by_name(name: str) -> torch.layout:
    layout = _TORCH_ENUMS.get(str(name).removeprefix("torch."))
    if not isinstance(layout, torch.layout):
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r}")
    return layout


class _MetadataUnpickler(pickle.Unpickler):
    """The C unpickler, building DCP metadata objects and nothing else (see the module)."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._stand_ins: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        found = self._stand_ins.get(key)
        if found is not None:
            return found
        built_in = _BUILT_IN_TYPES.get(key)
        if built_in is not None:
            return built_in
        if module == "torch" and name in _TORCH_ENUMS:
            return _TORCH_ENUMS[name]
        real = _CLASSES.get(key)
        if real is not None:
            found = _stand_in(name, _new_of(real))
        elif key == (_DCP_METADATA_MODULE, "_MEM_FORMAT_ENCODING") and _MEMORY_FORMAT_ENCODING:
            found = _stand_in(name, _encoded_format)
        elif key == ("torch.serialization", "_get_layout"):
            found = _stand_in(name, _layout_by_name)
        else:
            raise pickle.UnpicklingError(
                f"refusing to load {module}.{name} from checkpoint metadata"
            )
        self._stand_ins[key] = found
        return found


def load_metadata_safely(stream: Any) -> dcp_metadata.Metadata:
    """Unpickle DCP metadata allowing only DCP's metadata classes (no code from the file runs,
    and nothing of this process changes)."""
    data = stream.read()
    try:
        metadata = _MetadataUnpickler(data).load()
    except Exception as exc:  # UnpicklingError, EOFError, AttributeError, TypeError, ...
        raise CorruptCheckpointError(
            f"checkpoint metadata is not plain DCP metadata: {exc}", path=".metadata"
        ) from exc
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CorruptCheckpointError(
            f"checkpoint metadata has unexpected type {type(metadata).__name__}", path=".metadata"
        )
    _check_chunk_count(metadata, len(data))
    _check_storage_paths(metadata)
    return metadata


def _check_chunk_count(metadata: dcp_metadata.Metadata, file_bytes: int) -> None:
    """Refuse metadata that names more chunks than its file has bytes: pickle's memo lets a
    small file share one list of chunks among all its tensors (250 KB: 20,000 tensors of the
    same 20,000 chunks), which DCP's load goes through for each, for minutes. DCP writes each
    chunk's offsets and sizes anew, tens of bytes each."""
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        raise CorruptCheckpointError("checkpoint metadata is malformed", path=".metadata")
    try:
        chunks = sum(
            len(item.chunks)
            for item in dict.values(entries)
            if not isinstance(item, dcp_metadata.BytesStorageMetadata)
        )
    except (AttributeError, TypeError):  # (no chunks, or chunks that are no list)
        raise CorruptCheckpointError("checkpoint metadata is malformed", path=".metadata") from None
    if chunks > file_bytes:
        raise CorruptCheckpointError(
            f"checkpoint metadata names {chunks} chunks in {file_bytes} bytes: it is no file "
            "DCP wrote",
            path=".metadata",
        )


def _check_storage_paths(metadata: dcp_metadata.Metadata) -> None:
    """Refuse metadata whose chunks live outside the step directory (or is malformed)."""
    storage_data = getattr(metadata, "storage_data", None)
    if storage_data is None:
        return
    if not isinstance(storage_data, dict):
        raise CorruptCheckpointError("checkpoint metadata is malformed", path=".metadata")
    try:  # each file once: a chunk per tensor and rank names one of a file per rank
        relatives = set(map(_RELATIVE_PATH, dict.values(storage_data)))
    except (AttributeError, TypeError):  # (no path, or an unhashable one)
        raise CorruptCheckpointError("checkpoint metadata is malformed", path=".metadata") from None
    for relative in relatives:
        if not isinstance(relative, str):
            raise CorruptCheckpointError("checkpoint metadata is malformed", path=".metadata")
        check_relative_path(relative)


_RELATIVE_PATH = operator.attrgetter("relative_path")
