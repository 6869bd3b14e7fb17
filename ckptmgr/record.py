"""The commit record: the JSON document whose presence makes a step committed."""

from __future__ import annotations

import datetime as _dt
import json
import sys
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.dataclasses import dataclass as pydantic_dataclass

from ckptmgr.errors import CheckpointError, CorruptCheckpointError
from ckptmgr.integrity import check_relative_path

FORMAT_VERSION = 2
"""Format of the records (and data files) this ckptmgr writes. 1: DCP's ``torch.save`` items in
the data files; 2: raw tensor bytes (:mod:`ckptmgr.tensor_bytes`) in the byte order of
``byteorder``. Both are read."""
RECORD_NAME = "commit.json"
QUARANTINE_NAME = "quarantined.json"


class NewerFormatError(ValueError):
    """A commit record written by a newer ckptmgr, in a format this one does not understand."""


def _safe_path(value: str) -> str:
    try:
        return check_relative_path(value)
    except CorruptCheckpointError as exc:
        raise ValueError(str(exc)) from None


class FileEntry(BaseModel):
    """One file of a checkpoint, relative to the step directory: its size and CRC-32.

    ``crc32`` (``zlib.crc32`` of the whole file) is None in records written before ckptmgr
    stored checksums; such files are checked by size only. ``path`` never leaves the step
    directory (no absolute paths, no ``..``).
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    path: str
    size: int = Field(ge=0)
    crc32: int | None = Field(default=None, ge=0, lt=2**32)

    @field_validator("path")
    @classmethod
    def _path_inside_step(cls, value: str) -> str:
        return _safe_path(value)

    @model_serializer(mode="wrap")
    def _drop_missing_checksum(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("crc32", 0) is None:
            del data["crc32"]
        return data


@pydantic_dataclass(frozen=True, slots=True, config=ConfigDict(extra="forbid"))
class TensorEntry:
    """Global shape and dtype of one tensor stored in a checkpoint.

    A slotted pydantic dataclass rather than a model: a record holds one per tensor, and this
    form validates about 1.5x faster (20,000 entries: 17 ms instead of 26 ms here).
    """

    dtype: str
    shape: list[NonNegativeInt]

    @classmethod
    def trusted(cls, dtype: str, shape: list[int]) -> TensorEntry:
        """An entry made from values ckptmgr itself produced, without validation (which costs
        about 7 µs per entry: 140 ms for the 20,000 entries of a state of small tensors)."""
        entry = object.__new__(cls)
        object.__setattr__(entry, "dtype", dtype)
        object.__setattr__(entry, "shape", shape)
        return entry


_TENSORS_JSON = TypeAdapter(dict[str, TensorEntry])
_PACKED_JSON = TypeAdapter(dict[str, int])


class TensorSection:
    """A record's ``tensors`` and ``packed``, with their JSON text made once.

    With thousands of tensors these two fields are nearly all of a record, and they stay the same
    from save to save while the state's layout does: a saver keeps one section and hands it to
    every record (:meth:`CommitRecord.use_section`), which then serialises only its small rest.
    The dicts must not be changed after the section is made.
    """

    __slots__ = ("json", "packed", "tensors")

    def __init__(self, tensors: dict[str, TensorEntry], packed: dict[str, int]) -> None:
        self.tensors = tensors
        self.packed = packed
        self.json = b"".join(  # UTF-8 bytes, as a record is written
            (
                b'"tensors": ',
                _TENSORS_JSON.dump_json(tensors),
                b',\n "packed": ',
                _PACKED_JSON.dump_json(packed),
            )
        )


class CommitRecord(BaseModel):
    """Everything ckptmgr knows about one committed step, stored as ``commit.json``.

    The record is written last; a step directory without it is not a checkpoint.
    """

    model_config = ConfigDict(extra="allow", ser_json_inf_nan="constants")

    format_version: int = FORMAT_VERSION
    step: int = Field(ge=0)
    save_id: str
    committed_at: _dt.datetime
    world_size: int = Field(ge=1)
    metrics: dict[str, float] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    files: list[FileEntry] = Field(default_factory=list)
    tensors: dict[str, TensorEntry] = Field(default_factory=dict)
    packed: dict[str, int] = Field(default_factory=dict)
    """Tensors stored in the pack of small tensors (:mod:`ckptmgr.packing`): name -> byte
    offset in the pack (format 2). Their dtype and shape are in ``tensors``. A top-level field,
    so that a ckptmgr that does not know it still reads the record's format version."""
    object_files: list[str] = Field(default_factory=list)
    ckptmgr_version: str = ""
    torch_version: str = ""
    byteorder: Literal["little", "big"] | None = None
    """Byte order of the raw tensor bytes (format 2); None in format 1."""

    _section: TensorSection | None = PrivateAttr(default=None)

    @field_validator("object_files")
    @classmethod
    def _object_files_inside_step(cls, value: list[str]) -> list[str]:
        return [_safe_path(name) for name in value]

    @model_validator(mode="after")
    def _packed_tensors_are_described(self) -> CommitRecord:
        if not self.packed.keys() <= self.tensors.keys():
            missing = next(iter(self.packed.keys() - self.tensors.keys()))
            raise ValueError(f"packed tensor {missing!r} has no entry in tensors")
        if self.packed and min(self.packed.values()) < 0:
            name = min(self.packed, key=self.packed.__getitem__)
            raise ValueError(f"packed tensor {name!r} has a negative offset in the pack")
        return self

    def use_section(self, section: TensorSection) -> None:
        """Take ``tensors`` and ``packed`` from ``section`` (already validated: entries made by
        ckptmgr), so that :meth:`to_json` reuses its JSON text."""
        self.tensors = section.tensors
        self.packed = section.packed
        self._section = section

    def to_json(self) -> bytes:
        """Serialise to UTF-8 JSON bytes (``tensors`` and ``packed`` last, on one line each)."""
        head = self.model_dump_json(indent=1, exclude={"tensors", "packed"})
        section = self._section
        if (
            section is None
            or section.tensors is not self.tensors
            or section.packed is not self.packed
        ):
            section = TensorSection(self.tensors, self.packed)  # fields set since: made anew
        assert head.endswith("\n}")
        return b"".join((head[:-2].encode(), b",\n ", section.json, b"\n}"))

    @classmethod
    def from_json(cls, data: bytes | str) -> CommitRecord:
        """Parse and validate a record.

        Raises ``pydantic.ValidationError`` (a ``ValueError``) on bad input, including a file
        path that leaves the step directory, and :class:`NewerFormatError` (also a
        ``ValueError``) for a record of a newer format.
        """
        try:
            record = cls.model_validate_json(data)
        except ValueError:
            version = _format_version_of(data)  # a newer format may not validate here
            if version is not None and version > FORMAT_VERSION:
                raise NewerFormatError(
                    f"commit record format {version} is newer than this ckptmgr understands "
                    f"({FORMAT_VERSION}); upgrade ckptmgr"
                ) from None
            raise
        if record.format_version > FORMAT_VERSION:
            raise NewerFormatError(
                f"commit record format {record.format_version} is newer than this ckptmgr "
                f"understands ({FORMAT_VERSION}); upgrade ckptmgr"
            )
        return record


def _format_version_of(data: bytes | str) -> int | None:
    """The ``format_version`` of a JSON record that does not validate, if it has one."""
    try:
        version = json.loads(data).get("format_version")
    except (ValueError, AttributeError, RecursionError):  # (nested deeper than json parses)
        return None
    return version if isinstance(version, int) else None


def is_raw(record: CommitRecord) -> bool:
    """True when ``record``'s data files hold raw tensor bytes (format 2), False for DCP's
    ``torch.save`` items (format 1). Raises ``CheckpointError`` for raw bytes of the other byte
    order than this machine's."""
    if record.format_version < 2:
        return False
    if record.byteorder is not None and record.byteorder != sys.byteorder:
        raise CheckpointError(
            f"step {record.step} holds {record.byteorder}-endian tensor bytes; this machine is "
            f"{sys.byteorder}-endian (restore it on a {record.byteorder}-endian machine)"
        )
    return True


def utc_now() -> _dt.datetime:
    """The current time, timezone-aware in UTC."""
    return _dt.datetime.now(_dt.timezone.utc)
