"""The tensor table of a commit record: name, dtype, shape and place in the pack of every stored
tensor, kept column by column.

A record of a state of many small tensors is nearly all this table. Format 2 stored it as two JSON
objects (``tensors``: name -> ``{"dtype", "shape"}``, and ``packed``: name -> offset), which cost
an object per tensor to parse and to validate: 27 ms for 20,000 tensors here, a fifth of their
restore, and 2.3 MB of record. Format 3 stores four parallel lists instead (``tensor_table``:
``names``, ``dtypes``, ``shapes``, ``pack_offsets``), which parse in about 6 ms and take 1.3 MB,
and whose columns the restore matches against its destinations in a few C-level passes.

Format 4 may store ``dtypes``, ``shapes`` and ``pack_offsets`` in runs instead, where that makes
a column at least four times shorter: ``{"runs": [[value, count], ...]}`` (``count`` equal
values in a row) for dtypes and shapes, ``{"runs": [[first, step, count], ...]}`` (``first``,
``first + step``, ...; ``[null, 0, count]``: tensors stored on their own) for offsets. An
optimizer's state of many small tensors of one dtype, packed back to back, is then three short
runs: 20,000 tensors of one shape parse and are checked in a third of the time of their lists.
The rows are the same either way; only the stored text differs.
"""

from __future__ import annotations

import itertools
import json
import operator
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from pydantic import ConfigDict, NonNegativeInt
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic_core import core_schema

COLUMNS = ("names", "dtypes", "shapes", "pack_offsets")
"""The keys of a stored table, in the order they are written."""
RUNS = "runs"
"""The one key of a column stored in runs (format 4)."""
RUNS_SHORTEN_AT_LEAST = 4
"""A column is written in runs when they are at most this many times fewer than its rows."""


@pydantic_dataclass(frozen=True, slots=True, config=ConfigDict(extra="forbid"))
class TensorEntry:
    """Global shape and dtype of one tensor stored in a checkpoint.

    A slotted pydantic dataclass rather than a model: records of format 2 hold one per tensor, and
    this form validates about 1.5x faster (20,000 entries: 17 ms instead of 26 ms here).
    """

    dtype: str
    shape: list[NonNegativeInt]

    @classmethod
    def trusted(cls, dtype: str, shape: list[int]) -> TensorEntry:
        """An entry made from values ckptmgr itself produced or checked, without validation
        (which costs about 7 µs per entry)."""
        entry = object.__new__(cls)
        object.__setattr__(entry, "dtype", dtype)
        object.__setattr__(entry, "shape", shape)
        return entry


class TensorTable:
    """Every tensor of a step, as parallel columns: ``names[i]`` is stored with dtype
    ``dtypes[i]`` (a torch dtype name without ``torch.``) and global shape ``shapes[i]``, at byte
    ``pack_offsets[i]`` of the pack of small tensors, or on its own where that is None.

    Immutable by convention: the columns must not be changed after the table is made (the
    index and the JSON text are made from them once).
    """

    __slots__ = ("_index", "_json", "_stored", "dtypes", "names", "pack_offsets", "shapes")

    def __init__(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        pack_offsets: list[int | None],
    ) -> None:
        """A table of columns ckptmgr made or checked (see :meth:`from_columns`): not checked."""
        self.names = names
        self.dtypes = dtypes
        self.shapes = shapes
        self.pack_offsets = pack_offsets
        self._index: dict[str, int] | None = None
        self._json: bytes | None = None
        self._stored: dict[str, Any] | None = None

    @classmethod
    def empty(cls) -> TensorTable:
        """A table of no tensors."""
        return cls([], [], [], [])

    @classmethod
    def from_entries(
        cls, tensors: Mapping[str, TensorEntry], packed: Mapping[str, int]
    ) -> TensorTable:
        """The table of format 2's ``tensors`` and ``packed`` (or of a saver's entries).

        Raises ``ValueError`` when a packed tensor has no entry or a negative offset.
        """
        names = list(tensors)
        table = cls(
            names,
            [entry.dtype for entry in tensors.values()],
            [entry.shape for entry in tensors.values()],
            list(map(packed.get, names)),
        )
        if len(packed) != len(table.pack_offsets) - table.pack_offsets.count(None):
            missing = next(name for name in packed if name not in tensors)
            raise ValueError(f"packed tensor {missing!r} has no entry in tensors")
        table._check_offsets()
        return table

    @classmethod
    def from_columns(cls, value: object) -> TensorTable:
        """The table stored as ``value`` (the parsed JSON of a record's ``tensor_table``).

        ``dtypes``, ``shapes`` and ``pack_offsets`` may each be a list or an object of runs
        (format 4; see the module's docstring). Raises ``ValueError`` naming what is wrong: a
        missing or unknown column, columns of unequal length, a name twice, a malformed run,
        or a value of the wrong type (names and dtypes are strings, shapes lists of
        non-negative integers, offsets non-negative integers or null). The checks are C-level
        passes over whole columns, or a step per run, not a Python step per tensor.
        """
        if isinstance(value, TensorTable):
            return value
        if not isinstance(value, dict) or set(value) != set(COLUMNS):
            found = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise ValueError(f"tensor_table must be an object of exactly {list(COLUMNS)}: {found}")
        names = value["names"]
        if type(names) is not list:
            raise ValueError("tensor_table.names is not a list")
        rows = len(names)
        dtypes, dtypes_listed = _column(value, "dtypes", rows, _dtype_runs)
        shapes, shapes_listed = _column(value, "shapes", rows, _shape_runs)
        offsets, offsets_listed = _column(value, "pack_offsets", rows, _offset_runs_expanded)
        columns = [names, dtypes, shapes, offsets]
        if len(set(map(len, columns))) != 1:
            lengths = dict(zip(COLUMNS, map(len, columns), strict=True))
            raise ValueError(f"the columns of tensor_table differ in length: {lengths}")
        _check_types("names", names, {str}, "a string")
        if dtypes_listed:  # (runs were checked run by run)
            _check_types("dtypes", dtypes, {str}, "a string")
        if shapes_listed:
            _check_types("shapes", shapes, {list}, "a list")
            dims = list(itertools.chain.from_iterable(shapes))
            if not set(map(type, dims)) <= {int} or (dims and min(dims) < 0):
                index = next(i for i, shape in enumerate(shapes) if not _is_shape(shape))
                raise ValueError(
                    f"tensor_table.shapes[{index}] is not a list of non-negative integers: "
                    f"{shapes[index]!r}"
                )
        if offsets_listed:
            _check_types("pack_offsets", offsets, {int, type(None)}, "an integer or null")
        table = cls(names, dtypes, shapes, offsets)
        if len(table.index) != len(names):
            twice = next(name for name, count in Counter(names).items() if count > 1)
            raise ValueError(f"tensor_table names {twice!r} more than once")
        table._check_offsets()
        return table

    def _check_offsets(self) -> None:
        offsets = self.pack_offsets
        if None in offsets:
            offsets = [offset for offset in offsets if offset is not None]
        if offsets and min(offsets) < 0:  # type: ignore[type-var]
            index = next(
                i for i, offset in enumerate(self.pack_offsets) if offset is not None and offset < 0
            )
            name = self.names[index]
            raise ValueError(f"packed tensor {name!r} has a negative offset in the pack")

    @property
    def index(self) -> dict[str, int]:
        """Name -> position in the columns (made on first use: about 1 ms per 20,000)."""
        index = self._index
        if index is None:
            index = self._index = dict(zip(self.names, range(len(self.names)), strict=True))
        return index

    @property
    def entries(self) -> TableEntries:
        """The table as name -> :class:`TensorEntry` (format 2's ``tensors``)."""
        return TableEntries(self)

    @property
    def packed(self) -> PackOffsets:
        """The packed tensors as name -> byte offset in the pack (format 2's ``packed``)."""
        return PackOffsets(self)

    def to_columns(self) -> dict[str, Any]:
        """The table as stored: a JSON object of the four columns, each of ``dtypes``,
        ``shapes`` and ``pack_offsets`` in runs where they make it at least
        ``RUNS_SHORTEN_AT_LEAST`` times shorter (worked out once per table)."""
        stored = self._stored
        if stored is None:
            stored = self._stored = {
                "names": self.names,
                "dtypes": _in_runs_if_shorter(self.dtypes, _value_runs(self.dtypes)),
                "shapes": _in_runs_if_shorter(self.shapes, _value_runs(self.shapes)),
                "pack_offsets": _in_runs_if_shorter(
                    self.pack_offsets, _offset_runs(self.pack_offsets)
                ),
            }
        return dict(stored)

    def to_json(self) -> bytes:
        """The stored JSON text of the table (UTF-8, one line per column), made once."""
        text = self._json
        if text is None:
            lines = (
                f'"{key}": {json.dumps(column, separators=(",", ":"))}'
                for key, column in self.to_columns().items()
            )
            text = self._json = ("{" + ",\n  ".join(lines) + "}").encode()
        return text

    def __len__(self) -> int:
        return len(self.names)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorTable):
            return NotImplemented
        return (
            self.names == other.names
            and self.dtypes == other.dtypes
            and self.shapes == other.shapes
            and self.pack_offsets == other.pack_offsets
        )

    __hash__ = None  # type: ignore[assignment]  # (mutable columns)

    def __repr__(self) -> str:
        return f"TensorTable({len(self.names)} tensors, {len(self.packed)} packed)"

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        """Validated by :meth:`from_columns`, serialised as its columns."""
        return core_schema.no_info_plain_validator_function(
            cls.from_columns,
            serialization=core_schema.plain_serializer_function_ser_schema(cls.to_columns),
        )


class TableEntries(Mapping[str, TensorEntry]):
    """A read-only view of a :class:`TensorTable` as name -> :class:`TensorEntry`."""

    __slots__ = ("_table",)

    def __init__(self, table: TensorTable) -> None:
        self._table = table

    def __getitem__(self, name: str) -> TensorEntry:
        table = self._table
        position = table.index[name]
        return TensorEntry.trusted(table.dtypes[position], table.shapes[position])

    def __contains__(self, name: object) -> bool:
        return name in self._table.index

    def __iter__(self) -> Iterator[str]:
        return iter(self._table.names)

    def __len__(self) -> int:
        return len(self._table.names)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self)!r})"


class PackOffsets(Mapping[str, int]):
    """A read-only view of the packed tensors of a :class:`TensorTable` as name -> offset."""

    __slots__ = ("_table",)

    def __init__(self, table: TensorTable) -> None:
        self._table = table

    def __getitem__(self, name: str) -> int:
        table = self._table
        offset = table.pack_offsets[table.index[name]]
        if offset is None:
            raise KeyError(name)
        return offset

    def __contains__(self, name: object) -> bool:
        position = self._table.index.get(name)  # type: ignore[call-overload]
        return position is not None and self._table.pack_offsets[position] is not None

    def __iter__(self) -> Iterator[str]:
        table = self._table
        return itertools.compress(table.names, map(operator.is_not, table.pack_offsets, _NONES))

    def __len__(self) -> int:
        offsets = self._table.pack_offsets
        return len(offsets) - offsets.count(None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self)!r})"


_NONES = itertools.repeat(None)  # (endless and stateless: shared by every call)


def _column(
    table: dict[str, Any],
    key: str,
    rows: int,
    expand: Callable[[str, list[Any], int], list[Any]],
) -> tuple[list[Any], bool]:
    """(the column ``key`` of a stored table, True when it was stored as a list): a list as it
    is, or its runs expanded by ``expand`` (which checks them, and that they hold ``rows``
    rows, before it makes them)."""
    column = table[key]
    if type(column) is list:
        return column, True
    if type(column) is dict and set(column) == {RUNS} and type(column[RUNS]) is list:
        return expand(key, column[RUNS], rows), False
    raise ValueError(f'tensor_table.{key} is not a list or an object {{"{RUNS}": [...]}}')


def _check_run_count(key: str, runs: list[list[Any]], rows: int) -> None:
    """Raise unless the (checked) runs hold ``rows`` rows, before any is made."""
    total = sum(run[-1] for run in runs)
    if total != rows:
        raise ValueError(
            f"the columns of tensor_table differ in length: names has {rows}, the runs of "
            f"{key} {total}"
        )


def _expanded_value_runs(
    key: str, runs: list[Any], rows: int, is_value: Callable[[Any], bool], what: str
) -> list[Any]:
    for index, run in enumerate(runs):
        if not (
            type(run) is list
            and len(run) == 2
            and type(run[1]) is int
            and run[1] > 0
            and is_value(run[0])
        ):
            raise ValueError(
                f"tensor_table.{key}.runs[{index}] is not [{what}, a positive count]: {run!r}"
            )
    _check_run_count(key, runs, rows)
    return list(itertools.chain.from_iterable(itertools.starmap(itertools.repeat, runs)))


def _dtype_runs(key: str, runs: list[Any], rows: int) -> list[Any]:
    return _expanded_value_runs(key, runs, rows, lambda value: type(value) is str, "a string")


def _shape_runs(key: str, runs: list[Any], rows: int) -> list[Any]:
    return _expanded_value_runs(
        key,
        runs,
        rows,
        lambda value: type(value) is list and _is_shape(value),
        "a list of non-negative integers",
    )


def _offset_runs_expanded(key: str, runs: list[Any], rows: int) -> list[Any]:
    parts: list[Iterator[int | None] | range] = []
    for index, run in enumerate(runs):
        if (
            type(run) is list
            and len(run) == 3
            and type(run[1]) is int
            and type(run[2]) is int
            and run[2] > 0
            and (type(run[0]) is int or (run[0] is None and run[1] == 0))
        ):
            first, step, count = run
            if step:
                parts.append(range(first, first + step * count, step))
            else:
                parts.append(itertools.repeat(first, count))
        else:
            raise ValueError(
                f"tensor_table.{key}.runs[{index}] is not [an integer, a step, a positive "
                f"count] or [null, 0, a positive count]: {run!r}"
            )
    _check_run_count(key, runs, rows)
    return list(itertools.chain.from_iterable(parts))


def _value_runs(column: list[Any]) -> list[list[Any]]:
    """``column`` as ``[value, count]`` runs of equal neighbours."""
    if not column:
        return []
    changes = itertools.compress(range(1, len(column)), map(operator.ne, column[1:], column[:-1]))
    starts = [0, *changes]
    ends = [*starts[1:], len(column)]
    return [[column[start], end - start] for start, end in zip(starts, ends, strict=True)]


def _offset_runs(offsets: list[int | None]) -> list[list[Any]]:
    """``offsets`` as ``[first, step, count]`` runs of evenly spaced neighbours (``[None, 0,
    count]`` for a run of None), each taken as long as it goes on."""
    runs: list[list[Any]] = []
    count = len(offsets)
    start = 0
    while start < count:
        first = offsets[start]
        end = start + 1
        step = 0
        if first is None:
            while end < count and offsets[end] is None:
                end += 1
        elif end < count and (second := offsets[end]) is not None:
            step = second - first
            following = second + step
            end += 1
            while end < count and offsets[end] == following:
                end += 1
                following += step
        runs.append([first, step, end - start])
        start = end
    return runs


def _in_runs_if_shorter(column: list[Any], runs: list[list[Any]]) -> list[Any] | dict[str, Any]:
    """``{"runs": runs}`` where they are at most a ``RUNS_SHORTEN_AT_LEAST``-th of the rows
    (and there are rows), else ``column``."""
    if runs and len(runs) * RUNS_SHORTEN_AT_LEAST <= len(column):
        return {RUNS: runs}
    return column


def _check_types(key: str, column: list[Any], types: set[type], what: str) -> None:
    if not set(map(type, column)) <= types:
        index = next(i for i, value in enumerate(column) if type(value) not in types)
        raise ValueError(f"tensor_table.{key}[{index}] is not {what}: {column[index]!r}")


def _is_shape(shape: list[Any]) -> bool:
    return all(type(size) is int and size >= 0 for size in shape)
