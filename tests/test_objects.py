"""ckptmgr.objects: the JSON form of a state's plain values. Its fast paths (exact types, long
homogeneous lists checked whole) give exactly the data the straightforward encoding below
gives, for values of every supported kind and their subclasses; the data is a snapshot; an
unsupported value is named by its path."""

from __future__ import annotations

import base64
import collections
import enum
import json
import math
import random
from typing import Any

import pytest

from ckptmgr.errors import CheckpointError
from ckptmgr.objects import TAG, decode, encode


def reference_encode(value: Any) -> Any:
    """The encoding as the format describes it, one isinstance test after another."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if value.bit_length() > 10_000:
            return {TAG: "int", "hex": hex(value)}
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {TAG: "float", "value": repr(value)}
    if isinstance(value, str):
        return str(value)
    if isinstance(value, bytes):
        return {TAG: "bytes", "base64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, list):
        return [reference_encode(item) for item in value]
    if isinstance(value, tuple):
        return {TAG: "tuple", "items": [reference_encode(item) for item in value]}
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value) and TAG not in value:
            return {key: reference_encode(item) for key, item in value.items()}
        pairs = [[reference_encode(k), reference_encode(v)] for k, v in value.items()]
        return {TAG: "dict", "items": pairs}
    raise TypeError(type(value))


def typed(data: Any) -> Any:
    """``data`` with every value's exact type beside it (``==`` alone takes 1 for 1.0, True)."""
    if isinstance(data, dict):
        return ("dict", [(typed(k), typed(v)) for k, v in data.items()])
    if isinstance(data, (list, tuple)):
        return (type(data).__name__, [typed(item) for item in data])
    return (type(data).__name__, hex(data) if type(data) is int else repr(data))


def as_base_types(value: Any) -> Any:
    """``value`` as it comes back from a checkpoint: subclasses as their base types."""
    if value is None or type(value) is bool:
        return value
    for base in (int, float, str, bytes):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, list):
        return [as_base_types(item) for item in value]
    if isinstance(value, tuple):
        return tuple(as_base_types(item) for item in value)
    return {as_base_types(key): as_base_types(item) for key, item in value.items()}


class Color(enum.IntEnum):
    RED = 1


class Name(str):
    pass


class Ratio(float):
    pass


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """A value of any supported kind: scalars (subclasses, nan/inf, long ints, bytes), lists
    (long homogeneous ones, some with one odd item), tuples, dicts (string keys, other keys,
    the tag key), nested."""
    scalars: list[Any] = [
        None,
        True,
        False,
        0,
        -7,
        2**62,
        2**20_000 + 1,
        Color.RED,
        1.5,
        -0.0,
        math.nan,
        math.inf,
        -math.inf,
        Ratio(2.5),
        "s",
        "",
        Name("sub"),
        "__ckptmgr__",
        b"\x00\xff",
    ]
    roll = rng.random()
    if depth >= 3 or roll < 0.45:
        return rng.choice(scalars)
    if roll < 0.6:  # a long list, homogeneous or with one odd item
        kind = rng.choice(["int", "float", "str", "mixed"])
        size = rng.choice([15, 16, 17, 200])
        items: list[Any] = {
            "int": lambda: [rng.randrange(-(2**40), 2**40) for _ in range(size)],
            "float": lambda: [rng.uniform(-1, 1) for _ in range(size)],
            "str": lambda: [rng.choice(["a", "b", None, True]) for _ in range(size)],
            "mixed": lambda: [rng.choice([1, 2.0, "x", None]) for _ in range(size)],
        }[kind]()
        if rng.random() < 0.5:
            items[rng.randrange(size)] = random_value(rng, depth + 1)
        return items
    if roll < 0.75:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if roll < 0.82:
        return tuple(random_value(rng, depth + 1) for _ in range(rng.randrange(4)))
    keys: list[Any] = ["a", "b", Name("c"), "d", 1, (1, 2), None, 2.5, TAG]
    weights = [8, 8, 1, 8, 1, 1, 1, 1, 1]
    chosen = rng.choices(keys, weights, k=rng.randrange(4))
    value = {key: random_value(rng, depth + 1) for key in chosen}
    return collections.OrderedDict(value) if rng.random() < 0.1 else value


def test_the_fast_paths_give_the_straightforward_encoding_and_decode_back() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        value = random_value(rng)
        data = encode(value, "x")
        assert typed(data) == typed(reference_encode(value)), value
        text = json.dumps(data, allow_nan=False)  # (as written into the objects file)
        assert typed(decode(json.loads(text))) == typed(as_base_types(value)), value


def test_long_lists_are_stored_item_by_item_where_an_item_needs_a_tag() -> None:
    ints = list(range(100))
    floats = [float(i) for i in range(100)]
    for items, odd in (
        (ints, 2**20_000),  # too long for JSON's decimal form: hex
        (floats, math.nan),
        (floats, math.inf),
        (ints, (1, 2)),  # a tuple
        (ints, True),  # a bool among ints stays a bool
        (floats, Ratio(0.5)),
        (ints, b"x"),
    ):
        value = [*items[:50], odd, *items[50:]]
        assert typed(encode(value, "x")) == typed(reference_encode(value)), odd


def test_the_encoding_is_a_snapshot() -> None:
    inner = list(range(100))
    value = {"steps": inner, "names": ["a"] * 20, "nested": {"l": [1.0] * 30}}
    data = encode(value, "x")
    inner.append(100)
    value["names"][0] = "changed"
    value["nested"]["l"].clear()
    assert data == {"steps": list(range(100)), "names": ["a"] * 20, "nested": {"l": [1.0] * 30}}


@pytest.mark.parametrize(
    ("value", "where"),
    [
        (object(), "x"),
        ({"a": [1, {"b": (2, object())}]}, "x/a[1]/b[1]"),
        ([1] * 40 + [object()], "x[40]"),
        ({1: "fine", object(): 2}, "x"),  # a key of a dict stored as pairs
        ({1: [object()]}, "x/1[0]"),
    ],
)
def test_an_unsupported_value_is_named_by_its_path(value: Any, where: str) -> None:
    with pytest.raises(CheckpointError, match=r"cannot checkpoint the value at '([^']*)'") as err:
        encode(value, "x")
    assert f"at {where!r} of type object" in str(err.value)
