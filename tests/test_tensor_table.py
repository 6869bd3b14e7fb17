"""The column-wise tensor table of a commit record (formats 3 and 4, ckptmgr.tensor_table): what
it accepts, what it refuses and names, its columns stored in runs (format 4), and its format-2
views (``tensors`` and ``packed``)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from ckptmgr.record import CommitRecord, TensorEntry, TensorTable, record_bytes, utc_now


def sample_columns() -> dict[str, list[Any]]:
    return {
        "names": ["big", "a/b", "c", "%rank00001%/d"],
        "dtypes": ["float32", "bfloat16", "int8", "bool"],
        "shapes": [[1024, 1024], [2, 3], [], [0, 5]],
        "pack_offsets": [None, 8, 0, None],
    }


def test_stored_columns_round_trip_through_json() -> None:
    table = TensorTable.from_columns(sample_columns())
    text = table.to_json()
    assert json.loads(text) == sample_columns()
    assert TensorTable.from_columns(json.loads(text)) == table
    assert text is table.to_json()  # made once
    assert text.count(b"\n") == 3  # one line per column


def test_views_read_like_the_dicts_of_format_2() -> None:
    table = TensorTable.from_columns(sample_columns())
    entries, packed = table.entries, table.packed
    assert list(entries) == ["big", "a/b", "c", "%rank00001%/d"]
    assert len(entries) == 4 and "c" in entries and "nope" not in entries
    assert entries["a/b"] == TensorEntry(dtype="bfloat16", shape=[2, 3])
    assert entries == {
        "big": TensorEntry(dtype="float32", shape=[1024, 1024]),
        "a/b": TensorEntry(dtype="bfloat16", shape=[2, 3]),
        "c": TensorEntry(dtype="int8", shape=[]),
        "%rank00001%/d": TensorEntry(dtype="bool", shape=[0, 5]),
    }
    with pytest.raises(KeyError):
        entries["nope"]
    assert list(packed) == ["a/b", "c"] and len(packed) == 2
    assert packed == {"a/b": 8, "c": 0}
    assert "a/b" in packed and "big" not in packed and "nope" not in packed
    assert packed.get("big") is None and packed.get("c") == 0
    with pytest.raises(KeyError):
        packed["big"]  # described, but stored on its own
    assert table.index == {"big": 0, "a/b": 1, "c": 2, "%rank00001%/d": 3}
    assert table.index is table.index  # made once


def test_format_2_dicts_make_the_same_table() -> None:
    columns = sample_columns()
    entries = {
        name: TensorEntry(dtype=dtype, shape=shape)
        for name, dtype, shape in zip(
            columns["names"], columns["dtypes"], columns["shapes"], strict=True
        )
    }
    table = TensorTable.from_entries(entries, {"c": 0, "a/b": 8})
    assert table == TensorTable.from_columns(columns)
    with pytest.raises(ValueError, match="'ghost' has no entry"):
        TensorTable.from_entries(entries, {"c": 0, "ghost": 8})
    with pytest.raises(ValueError, match="'c' has a negative offset"):
        TensorTable.from_entries(entries, {"c": -1})


def _damaged(edit: str) -> Any:
    columns: Any = sample_columns()
    if edit == "not an object":
        return [columns]
    if edit == "missing column":
        del columns["shapes"]
    elif edit == "unknown column":
        columns["strides"] = [[1]] * 4
    elif edit == "column not a list":
        columns["dtypes"] = "float32"
    elif edit == "columns of unequal length":
        columns["pack_offsets"].append(None)
    elif edit == "name not a string":
        columns["names"][2] = 3
    elif edit == "name twice":
        columns["names"][2] = "a/b"
    elif edit == "dtype not a string":
        columns["dtypes"][1] = None
    elif edit == "shape not a list":
        columns["shapes"][1] = "2,3"
    elif edit == "negative dimension":
        columns["shapes"][1] = [2, -3]
    elif edit == "dimension a float":
        columns["shapes"][1] = [2, 3.0]
    elif edit == "dimension a bool":
        columns["shapes"][1] = [2, True]
    elif edit == "offset negative":
        columns["pack_offsets"][1] = -8
    elif edit == "offset a float":
        columns["pack_offsets"][1] = 8.0
    elif edit == "offset a bool":
        columns["pack_offsets"][2] = False
    elif edit == "offset a string":
        columns["pack_offsets"][2] = "0"
    else:
        raise AssertionError(edit)
    return columns


DAMAGE = {
    "not an object": "must be an object",
    "missing column": "must be an object of exactly",
    "unknown column": "strides",
    "column not a list": r"tensor_table\.dtypes is not a list",
    "columns of unequal length": "differ in length",
    "name not a string": r"names\[2\] is not a string",
    "name twice": "'a/b' more than once",
    "dtype not a string": r"dtypes\[1\] is not a string",
    "shape not a list": r"shapes\[1\] is not a list",
    "negative dimension": r"shapes\[1\] is not a list of non-negative integers",
    "dimension a float": r"shapes\[1\] is not a list of non-negative integers",
    "dimension a bool": r"shapes\[1\] is not a list of non-negative integers",
    "offset negative": "'a/b' has a negative offset",
    "offset a float": r"pack_offsets\[1\] is not an integer or null",
    "offset a bool": r"pack_offsets\[2\] is not an integer or null",
    "offset a string": r"pack_offsets\[2\] is not an integer or null",
}


@pytest.mark.parametrize("edit", list(DAMAGE))
def test_a_damaged_table_is_refused_naming_what_is_wrong(edit: str) -> None:
    """Directly, and inside a record (a ``ValueError``: a damaged record)."""
    damaged = _damaged(edit)
    with pytest.raises(ValueError, match=DAMAGE[edit]):
        TensorTable.from_columns(copy.deepcopy(damaged))
    record = CommitRecord(step=1, save_id="s", committed_at=utc_now(), world_size=1)
    data = json.loads(record.to_json())
    data["tensor_table"] = damaged
    with pytest.raises(ValueError, match=DAMAGE[edit]):
        CommitRecord.from_json(record_bytes(data))


def test_an_empty_table_and_a_record_without_one() -> None:
    empty = TensorTable.empty()
    assert len(empty) == 0 and dict(empty.entries) == {} and dict(empty.packed) == {}
    assert TensorTable.from_columns(json.loads(empty.to_json())) == empty
    record = CommitRecord(step=1, save_id="s", committed_at=utc_now(), world_size=1)
    data = json.loads(record.to_json())
    assert data["tensor_table"] == {"names": [], "dtypes": [], "shapes": [], "pack_offsets": []}
    del data["tensor_table"]
    assert CommitRecord.from_json(record_bytes(data)).tensor_table == empty


def test_model_dump_holds_the_columns() -> None:
    table = TensorTable.from_columns(sample_columns())
    record = CommitRecord(
        step=1, save_id="s", committed_at=utc_now(), world_size=1, tensor_table=table
    )
    assert record.model_dump()["tensor_table"] == sample_columns()
    assert CommitRecord.model_validate(record.model_dump()) == record


# -- format 4: columns stored in runs -------------------------------------------------------------
def uniform_columns(count: int = 40) -> dict[str, list[Any]]:
    """An optimizer's state of small tensors: one dtype, one shape, packed back to back."""
    return {
        "names": [f"state/{i}/exp_avg" for i in range(count)],
        "dtypes": ["float32"] * count,
        "shapes": [[256]] * count,
        "pack_offsets": [1024 * i for i in range(count)],
    }


def test_columns_of_long_runs_are_stored_in_runs_and_read_back_alike() -> None:
    columns = uniform_columns()
    table = TensorTable.from_columns(copy.deepcopy(columns))
    stored = json.loads(table.to_json())
    assert stored == {
        "names": columns["names"],
        "dtypes": {"runs": [["float32", 40]]},
        "shapes": {"runs": [[[256], 40]]},
        "pack_offsets": {"runs": [[0, 1024, 40]]},
    }
    read = TensorTable.from_columns(stored)
    assert read == table
    assert read.to_columns() == stored  # (written again the same way)
    assert len(table.to_json()) < len(json.dumps(columns)) * 0.7


def test_a_column_is_stored_in_runs_only_where_they_make_it_four_times_shorter() -> None:
    columns = uniform_columns(8)
    columns["shapes"] = [[i + 1] for i in range(8)]  # no two alike
    columns["pack_offsets"] = [0, 4, 8, 12, None, None, 100, 200]  # 4 runs of 8 rows
    stored = TensorTable.from_columns(copy.deepcopy(columns)).to_columns()
    assert stored["dtypes"] == {"runs": [["float32", 8]]}
    assert stored["shapes"] == columns["shapes"]
    assert stored["pack_offsets"] == columns["pack_offsets"]
    assert TensorTable.from_columns(sample_columns()).to_columns() == sample_columns()  # unlike


@pytest.mark.parametrize("seed", range(30))
def test_any_columns_read_back_the_same_rows_from_their_runs(seed: int) -> None:
    """Random columns with runs of every kind (None, one value, evenly spaced offsets up and
    down, lone values) come back row for row from their runs, whichever form is written."""
    import random

    rng = random.Random(seed)
    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[list[int]] = []
    offsets: list[int | None] = []
    while len(names) < 200:
        length = rng.choice([1, 1, 2, 3, 17, 60])
        dtype = rng.choice(["float32", "bfloat16", "int64"])
        shape = rng.choice([[], [3], [2, 5], [0]])
        kind = rng.choice(["none", "up", "down", "same", "lone"])
        start = rng.randrange(10_000, 20_000)
        for i in range(length):
            names.append(f"t{len(names)}")
            dtypes.append(dtype)
            shapes.append(list(shape))
            offsets.append(
                {
                    "none": None,
                    "up": start + 8 * i,
                    "down": start - 16 * i,
                    "same": start,
                    "lone": rng.randrange(0, 10_000),
                }[kind]
            )
    columns = {"names": names, "dtypes": dtypes, "shapes": shapes, "pack_offsets": offsets}
    table = TensorTable.from_columns(copy.deepcopy(columns))
    from ckptmgr.tensor_table import _offset_runs, _value_runs

    for key, runs in (
        ("dtypes", _value_runs(dtypes)),
        ("shapes", _value_runs(shapes)),
        ("pack_offsets", _offset_runs(offsets)),
    ):
        forced = dict(copy.deepcopy(columns), **{key: {"runs": runs}})
        assert TensorTable.from_columns(forced) == table, key
    read = TensorTable.from_columns(json.loads(table.to_json()))
    assert read.to_columns() == table.to_columns()
    assert (read.names, read.dtypes, read.shapes, read.pack_offsets) == tuple(
        columns[key] for key in ("names", "dtypes", "shapes", "pack_offsets")
    )


RUN_DAMAGE = {
    "runs not a list": ("dtypes", {"runs": "float32"}, r"tensor_table\.dtypes is not a list"),
    "another key": ("dtypes", {"runs": [["float32", 40]], "x": 1}, r"dtypes is not a list"),
    "run not a pair": ("dtypes", {"runs": [["float32"]]}, r"dtypes\.runs\[0\] is not \["),
    "count zero": ("dtypes", {"runs": [["float32", 0], ["float32", 40]]}, r"runs\[0\]"),
    "count a bool": ("dtypes", {"runs": [["float32", 39], ["int8", True]]}, r"runs\[1\]"),
    "dtype not a string": ("dtypes", {"runs": [[7, 40]]}, r"dtypes\.runs\[0\] is not \[a str"),
    "too few rows": ("dtypes", {"runs": [["float32", 39]]}, "differ in length"),
    "a huge count": ("shapes", {"runs": [[[256], 10**15]]}, "differ in length"),
    "negative dimension": ("shapes", {"runs": [[[-1], 40]]}, r"shapes\.runs\[0\] is not"),
    "shape not a list": ("shapes", {"runs": [[256, 40]]}, r"shapes\.runs\[0\] is not"),
    "offset a string": ("pack_offsets", {"runs": [["0", 4, 40]]}, r"pack_offsets\.runs\[0\]"),
    "null with a step": ("pack_offsets", {"runs": [[None, 4, 40]]}, r"pack_offsets\.runs\[0\]"),
    "step a float": ("pack_offsets", {"runs": [[0, 4.0, 40]]}, r"pack_offsets\.runs\[0\]"),
    "offsets too many": ("pack_offsets", {"runs": [[0, 4, 41]]}, "differ in length"),
    "offsets going negative": (
        "pack_offsets",
        {"runs": [[64, -4, 40]]},
        "'state/17/exp_avg' has a negative offset",
    ),
}


@pytest.mark.parametrize("edit", list(RUN_DAMAGE))
def test_damaged_runs_are_refused_naming_the_run(edit: str) -> None:
    """Directly, and inside a record of format 4 (a ``ValueError``: a damaged record), without
    making the rows a huge count claims."""
    key, damaged, message = RUN_DAMAGE[edit]
    columns: dict[str, Any] = uniform_columns()
    columns[key] = damaged
    with pytest.raises(ValueError, match=message):
        TensorTable.from_columns(copy.deepcopy(columns))
    record = CommitRecord(step=1, save_id="s", committed_at=utc_now(), world_size=1)
    data = json.loads(record.to_json())
    data["tensor_table"] = columns
    with pytest.raises(ValueError, match=message):
        CommitRecord.from_json(record_bytes(data))


def test_runs_are_read_from_records_of_format_4_only() -> None:
    table = TensorTable.from_columns(uniform_columns())
    record = CommitRecord(
        step=1, save_id="s", committed_at=utc_now(), world_size=1, tensor_table=table
    )
    data = json.loads(record.to_json())
    assert data["format_version"] == 4 and "runs" in data["tensor_table"]["dtypes"]
    assert CommitRecord.from_json(record_bytes(data)).tensor_table == table
    data["format_version"] = 3
    with pytest.raises(ValueError, match="format 3 stores tensor_table as lists only"):
        CommitRecord.from_json(record_bytes(data))
    data["tensor_table"] = uniform_columns()  # the same rows as lists: format 3 as it was
    assert CommitRecord.from_json(record_bytes(data)).tensor_table == table
