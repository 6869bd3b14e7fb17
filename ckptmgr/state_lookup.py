"""Finding the tensor of a DCP item in the flat state ckptmgr hands DCP, without DCP's detours.

DCP's planners find each item's tensor with ``find_state_dict_object``: for a DTensor that is
``__get_tensor_shard__``, which returns ``to_local()``, an autograd function call (with its
runtime type checks) per item: about 20-40 µs, once per DTensor on every save and restore. The
local shard is the DTensor's ``_local_tensor``, the same memory; :func:`find_item_tensor`
returns that directly for a DTensor whose local part is a plain tensor and whose placements hold
no ``Partial`` (DCP refuses those: they still take DCP's path, and its error). Anything else
takes DCP's own lookup.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.utils import find_state_dict_object

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = None  # type: ignore[assignment,misc]


def find_item_tensor(state_dict: Mapping[str, Any], index: MetadataIndex) -> Any:
    """What DCP's ``find_state_dict_object(state_dict, index)`` finds: for a DTensor, its local
    tensor itself (not a view of it through autograd)."""
    found = state_dict.get(index.fqn)
    if DTensor is not None and type(found) is DTensor:
        local = found._local_tensor
        if type(local) is torch.Tensor and not any(
            placement.is_partial() for placement in found.placements
        ):
            return local
    return find_state_dict_object(state_dict, index)  # type: ignore[arg-type]
