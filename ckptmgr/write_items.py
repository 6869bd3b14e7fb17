"""A DTensor's write items, kept from one save of a manager to its next.

Before every save, each rank lists what it writes: DCP's local plan, a ``WriteItem`` per
tensor. For a DTensor, DCP works the item out from the placements each time (the shape and
offset of this rank's shard, through DTensor's ``to_local()``, an autograd call): about 50 µs
per DTensor, on the writer thread, holding the GIL (2 ranks, 5,000 small DTensors: about 0.25 s
of a 0.8 s save). The item is a function of a few things the DTensor says about itself (its
name, global shape, mesh, placements, and the dtype, layout, ``requires_grad`` and pinning of
its local tensor), unchanged from save to save in a training job.

:class:`DTensorWriteItems` keeps each DTensor's items under those things, and for a save hands
DCP's planner a state in which every DTensor it knows is replaced by a :class:`KeptWriteItems`:
an object of DCP's checkpointable protocol (``__create_write_items__``, which DCP asks of any
object it plans before treating it as a plain tensor or bytes) that gives back the kept items.
DCP's planning runs as it always does (its own plan caching, checks and metadata) on items that
are the same as those it would have made. A DTensor whose key changed (resharded, another
dtype, reshaped) is planned by DCP's own code again, and its new items kept.

Where this torch's planner does not ask every stand-in for its items exactly once (a version
that plans differently; :mod:`ckptmgr.stand_in_planning`), the manager plans from scratch, now
and from then on (:meth:`DTensorWriteItems.turn_off`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItem

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = None  # type: ignore[assignment,misc]


class KeptWriteItems:
    """Stands in for a DTensor in DCP's local planning: gives back the items kept for it."""

    __slots__ = ("calls", "items")

    def __init__(self, items: list[WriteItem]) -> None:
        self.items = items
        self.calls = 0
        """How many times DCP asked for the items (once, in a planning that used them)."""

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        del fqn, object
        self.calls += 1
        return list(self.items)


def _key_of(tensor: Any, grad_enabled: bool) -> tuple[Any, ...] | None:
    """What DCP's items for DTensor ``tensor`` are made from; None for a tensor whose items are
    not kept (not exactly a DTensor over a plain local tensor: its items are DCP's to make)."""
    if DTensor is None or type(tensor) is not DTensor:
        return None
    local = tensor._local_tensor
    if type(local) is not torch.Tensor:
        return None
    spec = tensor._spec
    return (
        spec.mesh,
        spec.placements,
        spec.shape,
        local.dtype,
        local.layout,
        # (what to_local() returns: the local tensor itself unless grad mode is on)
        tensor.requires_grad if grad_enabled else local.requires_grad,
        local.requires_grad,
        grad_enabled,
        local.is_pinned(),
    )


def _items_of(fqn: str, tensor: Any) -> list[WriteItem]:
    """DCP's items for DTensor ``tensor`` (none on a rank outside its mesh, as DCP plans)."""
    if tensor.device_mesh.get_coordinate() is None:
        return []
    return list(tensor.__create_write_items__(fqn, tensor))


class DTensorWriteItems:
    """The write items of a manager's DTensors, kept between its saves (one thread at a time)."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[tuple[Any, ...], KeptWriteItems]] = {}
        self.enabled = True
        """False once a planning did not use the stand-ins as expected: plan from scratch."""

    def stand_ins(self, state_dict: dict[str, Any]) -> tuple[dict[str, Any], list[KeptWriteItems]]:
        """``state_dict`` (flat, as DCP's planner holds it) with every DTensor replaced by its
        kept items (made now for one not kept, or changed since), and the stand-ins used; the
        state itself and no stand-ins when nothing is kept (:attr:`enabled` false)."""
        if not self.enabled:
            return state_dict, []
        grad_enabled = torch.is_grad_enabled()
        kept = self._kept
        planned: dict[str, Any] = {}
        used: list[KeptWriteItems] = []
        for fqn, value in state_dict.items():
            key = _key_of(value, grad_enabled)
            if key is None:
                planned[fqn] = value
                continue
            held = kept.get(fqn)
            if held is None or held[0] != key:
                held = kept[fqn] = (key, KeptWriteItems(_items_of(fqn, value)))
            stand_in = held[1]
            stand_in.calls = 0
            planned[fqn] = stand_in
            used.append(stand_in)
        if not used:
            return state_dict, []
        for fqn in [fqn for fqn in kept if fqn not in state_dict]:
            del kept[fqn]  # (no longer saved: nothing kept for a name the state dropped)
        return planned, used

    def turn_off(self) -> None:
        """Keep nothing from now on: every later save's items are made by DCP."""
        self.enabled = False
        self.forget()

    def holds_items(self) -> bool:
        """True while any DTensor's items are kept."""
        return bool(self._kept)

    def forget(self) -> None:
        """Drop every kept item (the next save makes them anew)."""
        self._kept.clear()
