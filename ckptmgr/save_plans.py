"""DCP's save plans, kept from one save of a manager to its next.

Before writing, DCP plans: every rank lists what it writes (an item per tensor, a chunk per
DTensor shard), the coordinator gathers the lists, checks them, builds the global metadata and
sends each rank its final plan. With thousands of DTensors that is most of a save's work on the
writer thread (2 ranks, 5,000 small DTensors: about 0.7 of 1.8 s). A training job saves the
same structure again and again, and DCP can keep the plans (``DefaultSavePlanner(
enable_plan_caching=True)``, torch 2.7 and later): a rank whose local plan is unchanged sends an
empty one, and the coordinator reuses its global plan and metadata.

DCP keeps those plans in dicts on the ``SavePlanner`` class, under the planner's
``_cached_plans_key`` (its class name by default: every planner of a process would share them,
and a plan made for one writer would be handed to another). :class:`SavePlanCache` gives each
manager a key of its own and forgets its plans when a save fails (so that no rank keeps a plan
the others dropped: every rank learns of a failed save) and when the manager closes. DCP takes a
local plan for the kept one when its items' names, shapes and chunks are the same: a rank whose
tensors changed dtype alone sends its plan anyway (:meth:`_SavePlanner.create_local_plan`).
"""

from __future__ import annotations

import inspect
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from ckptmgr.kept_results import KeptResults
from ckptmgr.metadata_file import MetadataFile
from ckptmgr.stand_in_planning import plan_with_stand_ins
from ckptmgr.state_lookup import find_item_tensor
from ckptmgr.write_items import DTensorWriteItems

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = None  # type: ignore[assignment,misc]

_CACHES = (
    "_cached_save_plan",
    "_cached_final_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_metadata",
)
"""The class-level dicts of ``SavePlanner`` that DCP's plan caching fills (torch 2.13)."""

PLAN_CACHING = "enable_plan_caching" in inspect.signature(DefaultSavePlanner).parameters and all(
    isinstance(getattr(SavePlanner, name, None), dict) for name in _CACHES
)
"""True where this torch's DCP can keep save plans in the dicts :class:`SavePlanCache` knows."""


class _SavePlanner(DefaultSavePlanner):
    """DCP's default save planner that finds a DTensor's local tensor directly
    (:mod:`ckptmgr.state_lookup`), plans with the DTensors' items kept in ``write_items``
    (:mod:`ckptmgr.write_items`; None: DCP makes every item), and takes a flat dict of tensors
    as it is (:meth:`set_up_planner`)."""

    def __init__(self, write_items: DTensorWriteItems | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._write_items = write_items

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: Any = None,
        is_coordinator: bool = False,
    ) -> None:
        """DCP's set-up; for a flat dict of plain tensors and DTensors (what ckptmgr hands
        DCP), what DCP's two passes over the state make of it, without them: the same dict
        and a mapping of each key to itself (they walked every value, 2 ranks of 5,000
        DTensors: about 15% of a save)."""
        if not (self.flatten_state_dict and self.flatten_sharded_tensors) or not _flat(state_dict):
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            return
        self.mappings = {key: (key,) for key in state_dict}
        self.state_dict = dict(state_dict)
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        plan = self._create_local_plan()
        if getattr(self, "_enable_plan_caching", False) and not plan.usable:
            kept_plan = SavePlanner._cached_save_plan.get(self._cached_plans_key)
            if kept_plan is not None and not _same_dtypes(self.plan, kept_plan):
                # DCP took the plan for the kept one: it compares names, shapes and chunks, not
                # dtypes, and the coordinator would have written the kept plan's dtypes in the
                # metadata (a tensor that became int32 restored as the float32 of its bits). Sent
                # as a changed plan, it is kept once the save's planning is through, as DCP does.
                self._pending_local_plan = self.plan
                return self.plan
        return plan

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        finished = super().finish_plan(new_plan)
        pending = self.__dict__.pop("_pending_local_plan", None)
        if pending is not None:  # (a DCP that keeps its local plans in create_local_plan)
            SavePlanner._cached_save_plan[self._cached_plans_key] = pending
        return finished

    def _create_local_plan(self) -> SavePlan:
        kept = self._write_items
        if kept is None:
            return super().create_local_plan()
        planned, used = kept.stand_ins(self.state_dict)
        if not used:
            return super().create_local_plan()
        return plan_with_stand_ins(self, planned, used, super().create_local_plan, kept.turn_off)

    def lookup_object(self, index: MetadataIndex) -> Any:
        return find_item_tensor(self.state_dict, index)


def _same_dtypes(plan: SavePlan, other: SavePlan) -> bool:
    """True where the items of two plans of the same length have the same dtypes, one by one
    (what DCP's comparison of a plan with the kept one leaves out)."""
    return all(
        _dtype(item) == _dtype(other_item)
        for item, other_item in zip(plan.items, other.items, strict=True)
    )


def _dtype(item: Any) -> torch.dtype | None:
    data = item.tensor_data
    return None if data is None else data.properties.dtype


def _flat(state_dict: dict[str, Any]) -> bool:
    """True where every key of ``state_dict`` is a string and every value a plain tensor, a
    parameter or a DTensor: what DCP's flattening passes leave as it is."""
    return all(
        type(key) is str and (type(value) in _PLAIN or isinstance(value, _DTENSOR))
        for key, value in state_dict.items()
    )


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_DTENSOR: tuple[type, ...] = (DTensor,) if DTensor is not None else ()


class SavePlanCache:
    """The save plans of one manager: a DCP planner that keeps them under this cache's own key
    (:meth:`planner`), and :meth:`forget` to drop them."""

    def __init__(self) -> None:
        self.key = f"ckptmgr-{uuid.uuid4().hex}"
        """The key of this cache's plans in DCP's dicts: unique to the manager in its process
        (the ranks of a job each have their own; DCP never compares them)."""
        self.write_items = DTensorWriteItems()
        """The write items of the manager's DTensors (:mod:`ckptmgr.write_items`)."""
        self.metadata_file = MetadataFile()
        """The last save's ``.metadata``, pickled field by field (:mod:`ckptmgr.metadata_file`)."""
        self.kept_results = KeptResults()
        """The write results of the last save over a group (:mod:`ckptmgr.kept_results`)."""

    def planner(self) -> SavePlanner:
        """A planner for the next save that reuses this cache's plans (where this torch cannot,
        it plans the save from scratch, as DCP's default planner does)."""
        if not PLAN_CACHING:
            return _SavePlanner(self.write_items)
        planner = _SavePlanner(self.write_items, enable_plan_caching=True)
        planner._cached_plans_key = self.key
        return planner

    def holds_plans(self) -> bool:
        """True while DCP keeps any plan under this cache's key."""
        return any(self.key in getattr(SavePlanner, name, {}) for name in _CACHES)

    def forget(self) -> None:
        """Drop every plan kept under this cache's key, the DTensors' kept items and the pickled
        ``.metadata`` and the write results kept (the next save plans, pickles and sends
        them from scratch)."""
        self.write_items.forget()
        self.metadata_file.forget()
        self.kept_results.forget()
        for name in _CACHES:
            kept = getattr(SavePlanner, name, None)
            if isinstance(kept, dict):
                kept.pop(self.key, None)
