"""JSON encoding of the non-tensor values in a state (no pickle, so loading runs no code).

Supported: ``None``, ``bool``, ``int``, ``float`` (including nan/inf), ``str``, ``bytes``, and
``list``/``tuple``/``dict`` of those. Tuples and dicts with non-string keys are tagged so that
they come back as the same types; so are ints too long for JSON's decimal form.
"""

from __future__ import annotations

import base64
import math
from typing import Any

from ckptmgr.errors import CheckpointError, CorruptCheckpointError, describe_error

TAG = "__ckptmgr__"

_LONGEST_JSON_INT_BITS = 10_000
"""Ints longer than this (about 3,000 decimal digits) are stored in hex: Python refuses to
convert ints of more than 4,300 digits to and from decimal text by default."""


def encode(value: Any, path: str) -> Any:
    """Turn ``value`` into JSON-compatible data; raise ``CheckpointError`` naming ``path``.

    The data shares nothing mutable with ``value`` (a snapshot: a ``save_async`` may return
    before it is written). Exact ``dict``/``list``/``str``/``int``/``float``/``bool``/``None``
    values, the usual ones, take a fast path: no type tests beyond their exact type, and no
    path formatted unless a value cannot be saved (a dict of 50,000 small dicts: 0.35 s on the
    training thread when every item's path was formatted, as many isinstance tests made)."""
    try:
        return _encode(value)
    except _Unsupported:
        where, kind = _first_unsupported(value, path) or (path, type(value))
        raise CheckpointError(
            f"cannot checkpoint the value at {where!r} of type {kind.__qualname__}: "
            "only tensors, objects with state_dict()/load_state_dict(), and "
            "None/bool/int/float/str/bytes and lists, tuples and dicts of them can be saved"
        ) from None


class _Unsupported(Exception):
    """A value :func:`encode` cannot save (its path is found afterwards)."""


_AS_IS = frozenset({str, bool, type(None)})
"""Exact types whose values are their own JSON data (an int or float may need a tag)."""
_DECODED_AS_IS = frozenset({str, bool, type(None), int, float})
"""Exact types of JSON data that :func:`decode` returns as they are."""


def _encode(value: Any) -> Any:
    kind = type(value)
    if kind in _AS_IS:
        return value
    if kind is dict and _keyed_by_strings(value):
        return {key: item if type(item) in _AS_IS else _encode(item) for key, item in value.items()}
    if kind is list:
        if len(value) >= _LONG_LIST and _stored_as_they_are(value):
            return list(value)
        return [item if type(item) in _AS_IS else _encode(item) for item in value]
    if kind is int and value.bit_length() <= _LONGEST_JSON_INT_BITS:
        return value
    if kind is float and math.isfinite(value):
        return value
    return _encode_any(value)


_LONG_LIST = 16
"""An exact list of at least this many items is first checked whole, in C, for items that are
their own JSON data (a list of a million step indices: 0.15 s item by item, about 0.04 s)."""


def _stored_as_they_are(items: list) -> bool:
    """True where every item is stored as it is: all of exact types in ``_AS_IS``, or all
    exact ints no longer than JSON's decimal form takes, or all finite exact floats."""
    kinds = set(map(type, items))
    if kinds <= _AS_IS:
        return True
    if kinds == {int}:
        return max(map(int.bit_length, items)) <= _LONGEST_JSON_INT_BITS
    if kinds == {float}:
        return all(map(math.isfinite, items))
    return False


def _encode_any(value: Any) -> Any:
    """:func:`_encode` of any value: subclasses of the supported types are stored as their
    base type's values (tuples and dicts with keys other than strings tagged)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if value.bit_length() > _LONGEST_JSON_INT_BITS:  # JSON's decimal form is refused
            return {TAG: "int", "hex": hex(value)}
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {TAG: "float", "value": repr(float(value))}
    if isinstance(value, str):
        return str(value)
    if isinstance(value, bytes):
        return {TAG: "bytes", "base64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, list):
        return [_encode(item) for item in value]
    if isinstance(value, tuple):
        return {TAG: "tuple", "items": [_encode(item) for item in value]}
    if isinstance(value, dict):
        if _keyed_by_strings(value):
            return {key: _encode(item) for key, item in value.items()}
        return {
            TAG: "dict",
            "items": [[_encode(key), _encode(item)] for key, item in value.items()],
        }
    raise _Unsupported


_is_str = str.__instancecheck__


def _keyed_by_strings(value: dict) -> bool:
    """True where a dict is stored as a JSON object (else as tagged ``[key, item]`` pairs)."""
    return TAG not in value and all(map(_is_str, value))


def _first_unsupported(value: Any, path: str) -> tuple[str, type] | None:
    """The path and type of the first value in ``value`` that :func:`_encode` cannot save, in
    the order it encodes (a tagged dict's key before its item); None if there is none."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return None
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found = _first_unsupported(item, f"{path}[{index}]")
            if found is not None:
                return found
        return None
    if isinstance(value, dict):
        tagged = not _keyed_by_strings(value)
        for key, item in value.items():
            found = (_first_unsupported(key, path) if tagged else None) or _first_unsupported(
                item, f"{path}/{key}"
            )
            if found is not None:
                return found
        return None
    return path, type(value)


def decode(data: Any) -> Any:
    """Inverse of :func:`encode`. ``CorruptCheckpointError`` for what it never writes (a tag
    whose fields are missing or of another type, an unhashable key, an unknown tag)."""
    try:
        return _decode(data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptCheckpointError(
            f"a plain value in the checkpoint is not one ckptmgr writes: {describe_error(exc)}"
        ) from exc
    except RecursionError as exc:  # no damage: how deep the caller's stack already is counts
        raise CheckpointError(
            "a plain value in the checkpoint is nested deeper than Python's recursion limit "
            "allows here"
        ) from exc


def _decode(data: Any) -> Any:
    kind = type(data)
    if kind is list:
        if len(data) >= _LONG_LIST and set(map(type, data)) <= _DECODED_AS_IS:
            return list(data)
        return [item if type(item) in _DECODED_AS_IS else _decode(item) for item in data]
    if kind is not dict:
        return data
    tag = data.get(TAG)
    if tag is None:
        return {
            key: item if type(item) in _DECODED_AS_IS else _decode(item)
            for key, item in data.items()
        }
    if tag == "float":
        return float(data["value"])
    if tag == "int":
        return int(data["hex"], 16)  # no digit limit for base 16
    if tag == "bytes":
        return base64.b64decode(data["base64"])
    if tag == "tuple":
        return tuple(_decode(item) for item in data["items"])
    if tag == "dict":
        return {_hashable(_decode(key)): _decode(item) for key, item in data["items"]}
    raise CorruptCheckpointError(f"unknown value tag {tag!r} in checkpoint objects")


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        return tuple(_hashable(k) for k in key)
    return key
