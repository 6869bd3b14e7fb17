"""A rank's write results, pickled as flat rows rather than an object per item.

After writing, every rank sends its write results to the coordinator (DCP's ``WriteResult``:
the item's index, its size and where it went: file, offset, length), which puts them in
``.metadata``. A sharded state has an item per DTensor, and pickle writes each result as
three dataclass objects (the result, its ``MetadataIndex`` and its ``_StorageInfo``) with their
attribute dicts and a ``torch.Size``: 5,000 results took about 45 ms to pickle on the sending
rank and 110 ms to unpickle on the coordinator, every save, for each rank.

:class:`WriteResults` is a list of the same results that pickles as a list of file names and a
tuple of plain values per result (about 5 and 14 ms for those 5,000); unpickling builds the
same results again, in the same order. A result of another shape (ckptmgr's checksum report,
an index without offsets, a storage record with transforms) is pickled as it is.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

try:  # _StorageInfo (an item's file, offset and length) is private; stable since torch 2.0
    from torch.distributed.checkpoint.filesystem import _StorageInfo
except ImportError:  # pragma: no cover
    _StorageInfo = None  # type: ignore[assignment,misc]

_Row = tuple[str, tuple[int, ...], int | None, int, int, int, int]
"""(fqn, offset, index hint, size in bytes, file number, offset in the file, length)."""


_Flat = tuple[list[str], list[_Row], list[tuple[int, WriteResult]]]
"""(file names, a row per result of the usual shape, (position, result) of each other one)."""


class WriteResults(list[WriteResult]):
    """Write results (a list, not changed once made) that pickle compactly: see the module's
    description."""

    _flat: _Flat | None = None

    def flattened(self) -> _Flat:
        """(file names, a :data:`_Row` per result of the usual shape, (position, result) of
        each other one): what pickling writes, and plain values that are equal exactly where
        the results are (made once)."""
        flat = self._flat
        if flat is None:
            flat = self._flat = _flatten(self)
        return flat

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuilt, self.flattened())


def _flatten(results: list[WriteResult]) -> _Flat:
    files: dict[str, int] = {}
    rows: list[_Row] = []
    others: list[tuple[int, WriteResult]] = []
    for position, result in enumerate(results):
        index, info = result.index, result.storage_data
        if (
            type(index) is MetadataIndex
            and index.offset is not None
            and _StorageInfo is not None
            and type(info) is _StorageInfo
            and info.transform_descriptors is None
        ):
            file = files.setdefault(info.relative_path, len(files))
            rows.append(
                (
                    index.fqn,
                    tuple(index.offset),
                    index.index,
                    result.size_in_bytes,
                    file,
                    info.offset,
                    info.length,
                )
            )
        else:
            others.append((position, result))
    return list(files), rows, others


def _rebuilt(
    files: list[str], rows: list[_Row], others: list[tuple[int, WriteResult]]
) -> WriteResults:
    """The :class:`WriteResults` that :meth:`WriteResults.__reduce__` flattened."""
    assert _StorageInfo is not None
    results = WriteResults(
        WriteResult(
            index=MetadataIndex(fqn, offset, hint),
            size_in_bytes=size,
            storage_data=_StorageInfo(files[file], start, length),
        )
        for fqn, offset, hint, size, file, start, length in rows
    )
    for position, result in others:  # (in increasing positions: each lands where it was)
        results.insert(position, result)
    results._flat = (files, rows, others)
    return results
