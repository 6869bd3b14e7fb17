"""The column-wise tensor table of a commit record (format 3, ckptmgr.tensor_table): what it
accepts, what it refuses and names, and its format-2 views (``tensors`` and ``packed``)."""

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
