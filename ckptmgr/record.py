"""The commit record: the JSON document whose presence makes a step committed."""

from __future__ import annotations

import datetime as _dt
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

FORMAT_VERSION = 1
RECORD_NAME = "commit.json"


class FileEntry(BaseModel):
    """One data file of a checkpoint, relative to the step directory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    size: int = Field(ge=0)


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

    def to_json(self) -> bytes:
        """Serialise to UTF-8 JSON bytes."""
        return self.model_dump_json(indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> CommitRecord:
        """Parse and validate a record (raises ``pydantic.ValidationError`` on bad input)."""
        record = cls.model_validate_json(data)
        if record.format_version > FORMAT_VERSION:
            raise ValueError(
                f"commit record format {record.format_version} is newer than this ckptmgr "
                f"understands ({FORMAT_VERSION}); upgrade ckptmgr"
            )
        return record


def utc_now() -> _dt.datetime:
    """The current time, timezone-aware in UTC."""
    return _dt.datetime.now(_dt.timezone.utc)
