"""The commit record: the JSON document whose presence makes a step committed."""

from __future__ import annotations

import datetime as _dt
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
)

from ckptmgr.errors import CorruptCheckpointError
from ckptmgr.integrity import check_relative_path

FORMAT_VERSION = 1
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


class TensorEntry(BaseModel):
    """Global shape and dtype of one tensor stored in a checkpoint."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: str
    shape: list[int]


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
    object_files: list[str] = Field(default_factory=list)
    ckptmgr_version: str = ""
    torch_version: str = ""

    @field_validator("object_files")
    @classmethod
    def _object_files_inside_step(cls, value: list[str]) -> list[str]:
        return [_safe_path(name) for name in value]

    def to_json(self) -> bytes:
        """Serialise to UTF-8 JSON bytes."""
        return self.model_dump_json(indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> CommitRecord:
        """Parse and validate a record.

        Raises ``pydantic.ValidationError`` (a ``ValueError``) on bad input, including a file
        path that leaves the step directory, and :class:`NewerFormatError` (also a
        ``ValueError``) for a record of a newer format.
        """
        record = cls.model_validate_json(data)
        if record.format_version > FORMAT_VERSION:
            raise NewerFormatError(
                f"commit record format {record.format_version} is newer than this ckptmgr "
                f"understands ({FORMAT_VERSION}); upgrade ckptmgr"
            )
        return record


def utc_now() -> _dt.datetime:
    """The current time, timezone-aware in UTC."""
    return _dt.datetime.now(_dt.timezone.utc)
