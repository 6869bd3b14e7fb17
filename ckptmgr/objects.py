"""JSON encoding of the non-tensor values in a state (no pickle, so loading runs no code).

Supported: ``None``, ``bool``, ``int``, ``float`` (including nan/inf), ``str``, ``bytes``, and
``list``/``tuple``/``dict`` of those. Tuples and dicts with non-string keys are tagged so that
they come back as the same types; so are ints too long for JSON's decimal form.
"""

from __future__ import annotations

import base64
import math
from typing import Any

from ckptmgr.errors import CheckpointError

TAG = "__ckptmgr__"

_LONGEST_JSON_INT_BITS = 10_000
"""Ints longer than this (about 3,000 decimal digits) are stored in hex: Python refuses to
convert ints of more than 4,300 digits to and from decimal text by default."""


def encode(value: Any, path: str) -> Any:
    """Turn ``value`` into JSON-compatible data; raise ``CheckpointError`` naming ``path``."""
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
        return [encode(item, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, tuple):
        return {
            TAG: "tuple",
            "items": [encode(item, f"{path}[{i}]") for i, item in enumerate(value)],
        }
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value) and TAG not in value:
            return {key: encode(item, f"{path}/{key}") for key, item in value.items()}
        return {
            TAG: "dict",
            "items": [
                [encode(key, path), encode(item, f"{path}/{key}")] for key, item in value.items()
            ],
        }
    raise CheckpointError(
        f"cannot checkpoint the value at {path!r} of type {type(value).__qualname__}: "
        "only tensors, objects with state_dict()/load_state_dict(), and "
        "None/bool/int/float/str/bytes and lists, tuples and dicts of them can be saved"
    )


def decode(data: Any) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(data, list):
        return [decode(item) for item in data]
    if not isinstance(data, dict):
        return data
    tag = data.get(TAG)
    if tag is None:
        return {key: decode(item) for key, item in data.items()}
    if tag == "float":
        return float(data["value"])
    if tag == "int":
        return int(data["hex"], 16)  # no digit limit for base 16
    if tag == "bytes":
        return base64.b64decode(data["base64"])
    if tag == "tuple":
        return tuple(decode(item) for item in data["items"])
    if tag == "dict":
        return {_hashable(decode(key)): decode(item) for key, item in data["items"]}
    raise CheckpointError(f"unknown value tag {tag!r} in checkpoint objects")


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        return tuple(_hashable(k) for k in key)
    return key
