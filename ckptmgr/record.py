"""The commit record: the JSON document whose presence makes a step committed."""

from __future__ import annotations

import datetime as _dt
import json
import sys
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    field_validator,
    model_serializer,
    model_validator,
)

from ckptmgr.errors import CheckpointError, CorruptCheckpointError
from ckptmgr.integrity import check_relative_path, crc32
from ckptmgr.tensor_table import TensorEntry, TensorTable

__all__ = [
    "FORMAT_VERSION",
    "QUARANTINE_NAME",
    "RECORD_NAME",
    "CommitRecord",
    "FileEntry",
    "NewerFormatError",
    "TensorEntry",
    "TensorTable",
    "files_with_checksums",
    "is_raw",
    "record_bytes",
    "tensor_entries",
    "utc_now",
]

FORMAT_VERSION = 4
"""Format of the records (and data files) this ckptmgr writes. 1: DCP's ``torch.save`` items in
the data files; 2: raw tensor bytes (:mod:`ckptmgr.tensor_bytes`) in the byte order of
``byteorder``; 3: as 2, with the tensors described by one column-wise ``tensor_table``
(:mod:`ckptmgr.tensor_table`) instead of the ``tensors`` and ``packed`` objects; 4: as 3, with
the table's ``dtypes``, ``shapes`` and ``pack_offsets`` stored in runs where that makes them
shorter. All are read."""
RUNS_SINCE = 4
"""Records of this format and later may store columns of ``tensor_table`` in runs."""
RECORD_NAME = "commit.json"
QUARANTINE_NAME = "quarantined.json"
CHECKSUMMED_SINCE = 3
"""Records of this format and later end with ``record_crc32``, the CRC-32 of the bytes before it."""
_CHECKSUM_MARK = b',\n "record_crc32": '
"""What precedes the record's checksum, which ends the record: ``<mark><crc>\n}``."""


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


_TENSORS_JSON = TypeAdapter(dict[str, TensorEntry])
_PACKED_JSON = TypeAdapter(dict[str, int])


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
    tensor_table: TensorTable = Field(default_factory=TensorTable.empty)
    """Every tensor of the step: stored name, dtype, global shape, and byte offset in the pack of
    small tensors (:mod:`ckptmgr.packing`) or None. Records of format 1 and 2 stored it as
    ``tensors`` and ``packed``, which are read into this table (and can be passed so)."""
    object_files: list[str] = Field(default_factory=list)
    ckptmgr_version: str = ""
    torch_version: str = ""
    byteorder: Literal["little", "big"] | None = None
    """Byte order of the raw tensor bytes (format 2 and later); None in format 1."""

    @field_validator("committed_at")
    @classmethod
    def _committed_at_in_utc(cls, value: _dt.datetime) -> _dt.datetime:
        """A time without a zone (a record edited by hand) is taken as UTC, as ckptmgr writes
        it: compared with the others' aware times, it stopped retention for the whole root
        ("can't compare offset-naive and offset-aware datetimes")."""
        return value.replace(tzinfo=_dt.timezone.utc) if value.tzinfo is None else value

    @field_validator("object_files")
    @classmethod
    def _object_files_inside_step(cls, value: list[str]) -> list[str]:
        return [_safe_path(name) for name in value]

    @model_validator(mode="before")
    @classmethod
    def _tensor_objects_to_table(cls, data: Any) -> Any:
        """Format 1 and 2's ``tensors`` and ``packed`` objects, read into ``tensor_table``; the
        checksum that ends a stored record (checked by :meth:`from_json`) dropped."""
        if not isinstance(data, dict):
            return data
        if "record_crc32" in data:
            data = {key: value for key, value in data.items() if key != "record_crc32"}
        version = data.get("format_version", FORMAT_VERSION)
        if "tensor_table" in data and isinstance(version, int) and version < 3:
            raise ValueError(f"a record of format {version} holds no tensor_table")
        table = data.get("tensor_table")
        if (
            isinstance(table, dict)
            and isinstance(version, int)
            and version < RUNS_SINCE
            and any(isinstance(column, dict) for column in table.values())
        ):
            raise ValueError(f"a record of format {version} stores tensor_table as lists only")
        if "tensors" not in data and "packed" not in data:
            return data
        if "tensor_table" in data:
            raise ValueError("a record holds tensor_table or tensors and packed, not both")
        data = dict(data)
        tensors = _TENSORS_JSON.validate_python(data.pop("tensors", {}))
        packed = _PACKED_JSON.validate_python(data.pop("packed", {}))
        data["tensor_table"] = TensorTable.from_entries(tensors, packed)
        return data

    @property
    def tensors(self) -> Mapping[str, TensorEntry]:
        """Every tensor of the step as stored name -> :class:`TensorEntry` (a view of
        ``tensor_table``)."""
        return self.tensor_table.entries

    @property
    def packed(self) -> Mapping[str, int]:
        """The tensors in the pack of small tensors as stored name -> byte offset in the pack
        (a view of ``tensor_table``)."""
        return self.tensor_table.packed

    def to_json(self) -> bytes:
        """Serialise to UTF-8 JSON bytes (``tensor_table`` last, one line per column: its text
        is made once per table, and a saver reuses one table while the state's layout holds)."""
        head = self.model_dump_json(indent=1, exclude={"tensor_table"})
        assert head.endswith("\n}")
        table = self.tensor_table.to_json()
        return _with_checksum(b"".join((head[:-2].encode(), b',\n "tensor_table": ', table)))

    @classmethod
    def from_json(cls, data: bytes | str) -> CommitRecord:
        """Parse and validate a record.

        Raises ``pydantic.ValidationError`` (a ``ValueError``) on bad input, including a file
        path that leaves the step directory, ``ValueError`` when a record of format 3 or later
        does not match its checksum (``record_crc32``), and :class:`NewerFormatError` (also a
        ``ValueError``) for a record of a newer format. A record that claims a newer format but
        ends with a checksum its bytes do not match is damaged (``ValueError``): a flipped bit
        can raise the version too, and every format keeps ``record_crc32`` as it is.
        """
        try:
            record = cls.model_validate_json(data)
        except ValueError:
            version = _format_version_of(data)  # a newer format may not validate here
            if version is not None and version > FORMAT_VERSION:
                raise _newer_format(version, data) from None
            raise
        raw = data if isinstance(data, bytes) else data.encode()
        if record.format_version > FORMAT_VERSION:
            raise _newer_format(record.format_version, raw)
        if record.format_version >= CHECKSUMMED_SINCE or _CHECKSUM_MARK in raw[-40:]:
            _check_checksum(raw)  # (also where a flipped bit made the version an older one)
        return record


def _newer_format(version: int, data: bytes | str) -> NewerFormatError:
    """The error for a record of format ``version``, newer than this ckptmgr's; raises
    ``ValueError`` instead where the record ends with a checksum its bytes do not match (a
    damaged record of a format known here, whose version a flipped bit raised)."""
    raw = data if isinstance(data, bytes) else data.encode()
    if _CHECKSUM_MARK in raw[-40:]:
        _check_checksum(raw)
    return NewerFormatError(
        f"commit record format {version} is newer than this ckptmgr understands "
        f"({FORMAT_VERSION}); upgrade ckptmgr"
    )


def record_bytes(document: dict[str, Any]) -> bytes:
    """The bytes of a ``commit.json`` that holds ``document`` (a parsed record, edited, say),
    ending with its checksum, as :meth:`CommitRecord.to_json` writes one. For tools and tests
    that rewrite records: anything else that changes a record's bytes makes it damaged."""
    body = {key: value for key, value in document.items() if key != "record_crc32"}
    text = json.dumps(body, indent=1).encode()
    assert text.endswith(b"\n}")
    return _with_checksum(text[:-2])


def _with_checksum(body: bytes) -> bytes:
    """``body`` (a JSON object without its closing brace) closed by its checksum."""
    return b"".join((body, _CHECKSUM_MARK, str(crc32(body)).encode(), b"\n}"))


def _check_checksum(data: bytes) -> None:
    """Raise ``ValueError`` unless ``data`` ends with ``record_crc32``, the checksum of what
    precedes it (a CRC-32 of the whole record: 0.5 ms for the 1.3 MB of 20,000 tensors)."""
    at = data.rfind(_CHECKSUM_MARK)
    digits = data[at + len(_CHECKSUM_MARK) : -2] if at >= 0 else b""
    if not (digits.isdigit() and data.endswith(b"\n}") and len(digits) <= 10):
        raise ValueError("the record does not end with its checksum, record_crc32")
    stored = int(digits)
    actual = crc32(data[:at])
    if actual != stored:
        raise ValueError(f"the record's bytes have CRC-32 {actual}, its record_crc32 says {stored}")


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


def tensor_entries(dcp_metadata: Any) -> dict[str, TensorEntry]:
    """The tensors DCP stored (name -> dtype and global shape), from its metadata."""
    entries = {}
    for key, item in dcp_metadata.state_dict_metadata.items():
        properties = getattr(item, "properties", None)
        if properties is None:
            continue
        entries[key] = TensorEntry.trusted(
            str(properties.dtype).removeprefix("torch."), list(item.size)
        )
    return entries


def files_with_checksums(
    listed: list[FileEntry], written: Mapping[str, tuple[int, int]]
) -> list[FileEntry]:
    """The listed files with the CRC-32 their writer computed; a file written but not listed,
    or listed with another size than written, means the store lost or changed bytes (or
    something deleted them), and the step is not committed."""
    missing = sorted(set(written) - {entry.path for entry in listed})
    if missing:
        raise CorruptCheckpointError(
            f"{missing[0]} was written but storage does not hold it"
            + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""),
            path=missing[0],
        )
    entries = []
    for entry in listed:
        known = written.get(entry.path)
        if known is None:
            entries.append(entry)
            continue
        size, crc = known
        if size != entry.size:
            raise CorruptCheckpointError(
                f"{entry.path} was written with {size} bytes but storage holds {entry.size}",
                path=entry.path,
            )
        entries.append(FileEntry(path=entry.path, size=entry.size, crc32=crc))
    return entries
