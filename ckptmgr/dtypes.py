"""torch's dtypes by the names commit records store them under (``float32``: without
``torch.``), looked up in torch's own namespace.

A name read from a checkpoint never reaches ``getattr(torch, name)``, which for some names
imports a module of torch (``_dynamo``, ``_inductor``, ``_export``, ``onnx``: seconds each, with
whatever their import sets up) or calls a function (the deprecated ``has_cuda`` and its kind):
a checkpoint cannot make a restore or a ``ckptmgr`` command do either.
"""

from __future__ import annotations

import torch

_DTYPES: dict[str, torch.dtype] = {
    name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)
}


def dtype_named(name: str) -> torch.dtype | None:
    """The torch dtype stored under ``name``, or None where torch has no dtype of that name."""
    return _DTYPES.get(name)
