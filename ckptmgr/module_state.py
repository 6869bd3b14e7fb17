"""Modules and optimizers, saved through ``torch.distributed.checkpoint.state_dict``.

When a state holds an ``nn.Module`` or a ``torch.optim.Optimizer`` object, ckptmgr does not call
its own ``state_dict()``. It uses DCP's state-dict API instead:

- a module is saved with ``get_model_state_dict``: keys are fully qualified parameter names
  (``DistributedDataParallel``'s ``module.`` and ``torch.compile``'s ``_orig_mod.`` prefixes
  removed), and the tensors of an FSDP2 or tensor-parallel model are its DTensor shards;
- an optimizer is saved with ``get_optimizer_state_dict``: its per-parameter state is keyed by
  the same parameter names (``optim/state/0.weight/exp_avg``) instead of by the parameter's
  position in the optimizer, so it can be resharded, and restored into a differently wrapped
  model. This needs the optimizer's module, which is looked up in the same state.

Where DCP's functions would do no more than rename (no FSDP version 1 or activation-checkpoint
wrapper in the module tree: a plain, compiled, DDP or FSDP2 module), the same dicts
are made directly from the module's and the optimizer's own ``state_dict()``, without DCP's
walk over every parameter's name on every save (:mod:`ckptmgr.dcp_state_dicts`). When a state
being saved holds a module and its one optimizer (with state, at the state's top level), both
state dicts are made by one call, the same dicts as the two calls make: each of DCP's maps
every parameter's names anew (:meth:`TrainingObjects.joint_state_dicts`).

Both are restored as ``set_model_state_dict`` / ``set_optimizer_state_dict`` restore them. In a
plain tree (as above) a module whose state dict was filled in place is not loaded again, and an
optimizer's dict is matched to its parameters by name without DCP's walk (see
:mod:`ckptmgr.dcp_state_dicts`); elsewhere DCP's functions run. Checkpoints with an optimizer
keyed by position (from ``optimizer.state_dict()``) are still restored into
``Optimizer`` objects, and an optimizer saved before its first step is saved without state and
left unchanged. An ``Optimizer`` restored without state (a restarted job's) gets the state to
load into made from the checkpoint's shapes and dtypes where it is one of torch's own, else
by a step (:meth:`OptimizerState.restore_template`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from ckptmgr import dcp_state_dicts
from ckptmgr.dtypes import dtype_named
from ckptmgr.errors import CheckpointError
from ckptmgr.optimizer import create_state
from ckptmgr.stateful import PerRank
from ckptmgr.tensor_table import TensorEntry

log = logging.getLogger(__name__)

_NOT_SETTINGS = frozenset({"params", "param_names"})  # what a parameter group holds but settings


class SavedEntries(Protocol):
    """What a checkpoint holds under one object's path (given to :meth:`restore_template`)."""

    def has(self, *keys: object) -> bool:
        """True if the checkpoint holds a tensor or plain value at or below these keys."""
        ...

    def plain(self, *keys: object) -> Any:
        """The plain value stored whole at these keys, or None."""
        ...

    def children(self, *keys: object) -> list[str] | None:
        """The keys stored directly below these keys, each a tensor or plain value; None where
        that is not known (one holds more below it, or the value is stored otherwise)."""
        ...

    def tensor(self, *keys: object) -> TensorEntry | None:
        """The shape and dtype of the tensor stored at these keys, or None."""
        ...


class ModelState:
    """An ``nn.Module`` saved with ``get_model_state_dict`` and restored with
    ``set_model_state_dict``. Its keys are the parameters' fully qualified names."""

    def __init__(self, module: nn.Module, training: TrainingObjects | None = None) -> None:
        """``training``: the objects of the state being saved or restored, which work out
        DCP's names of a module once (:meth:`TrainingObjects.names_of`) and, in a save, make
        the state dicts of a module and of its one optimizer together
        (:meth:`TrainingObjects.joint_state_dicts`)."""
        self.module = module
        self._training = training

    def state_dict(self) -> dict[str, Any]:
        """The module's state dict; DTensor shards for FSDP2 and tensor-parallel modules."""
        if self._training is not None:
            made = self._training.joint_state_dicts(self.module)
            if made is not None:
                return made[1]
        return dcp_state_dicts.model_state_dict(_names_of(self.module, self._training))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict`` (strictly: every key of the module must be present)."""
        names = _names_of(self.module, self._training)
        dcp_state_dicts.load_model_state_dict(names, state_dict, strict=bool(state_dict))


class OptimizerState:
    """An optimizer saved with ``get_optimizer_state_dict`` (per-parameter state keyed by the
    parameters' names in ``model``) and restored with ``set_optimizer_state_dict``.

    Put one in the state yourself, ``{"optim": OptimizerState(model, optimizer)}``, when
    ckptmgr cannot tell which module of the state an optimizer belongs to.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        training: TrainingObjects | None = None,
    ) -> None:
        """``training`` as for :class:`ModelState`."""
        self.model = model
        self.optimizer = optimizer
        self._training = training
        self._created: list[torch.Tensor] = []  # whose state restore_template created

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {name: {...}}, "param_groups": [{..., "params": [name, ...]}]}``.

        An optimizer without state (before its first step) is not changed: DCP would create the
        state by taking a step; ckptmgr saves the parameter groups and an empty state instead.
        """
        if self.optimizer.state:
            if self._training is not None:
                made = self._training.joint_state_dicts(self.model)
                if made is not None and made[0] is self.optimizer:
                    return made[2]
            names = _names_of(self.model, self._training)
            return dcp_state_dicts.optimizer_state_dict(names, self.optimizer)
        groups = self.optimizer.state_dict()["param_groups"]
        names = self._parameter_names()
        for group in groups:
            group["params"] = [names[index] for index in group["params"]]
        return {"state": {}, "param_groups": groups}

    def restore_template(self, saved: SavedEntries) -> dict[str, Any]:
        """The state dict to load ``saved`` into: the optimizer's own tensors, for exactly the
        parameters the checkpoint holds state for (creating the state first if needed).

        Raises ``CheckpointError``, before anything is changed, when the checkpoint's parameter
        groups cannot be matched with this optimizer's (another number of groups; for a
        checkpoint keyed by position, other group sizes)."""
        self._check_groups(saved)
        self._warn_of_another_kind(saved)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if _keyed_by_position(saved):  # written from optimizer.state_dict() (older ckptmgr)
            keys: list[Any] = list(range(len(params)))
        else:
            keys = self._parameter_names()
        stored: set[Any] = {key for key in keys if saved.has("state", key)}
        # Every parameter the checkpoint holds state for gets state to load it into (those
        # that have some already keep it until the load replaces it): made from what the
        # checkpoint holds where it can be, else by a step (create_state).
        lacking = [
            (key, p)
            for key, p in zip(keys, params, strict=True)
            if key in stored and p not in self.optimizer.state
        ]
        made: dict[Any, dict[str, Any]] = {}
        if lacking and not _keyed_by_position(saved) and _loads_saved_state(self.optimizer):
            for key, param in lacking:
                entries = _state_from_checkpoint(saved, key, param)
                if entries is not None:
                    made[key] = entries
        self._created = create_state(self.optimizer, [p for k, p in lacking if k not in made])
        template = self.optimizer.state_dict() if _keyed_by_position(saved) else self.state_dict()
        template["state"] = {k: v for k, v in template["state"].items() if k in stored}
        template["state"].update(made)
        return template

    def forget_created_state(self) -> None:
        """Drop the state :meth:`restore_template` created, for a restore that does not go on:
        the optimizer is left as it was (its parameters were not changed)."""
        for param in self._created:
            self.optimizer.state.pop(param, None)
        self._created = []

    def _check_groups(self, saved: SavedEntries) -> None:
        saved_sizes = _saved_group_sizes(saved)
        if saved_sizes is None:
            return
        own_sizes = [len(group["params"]) for group in self.optimizer.param_groups]
        if len(saved_sizes) == len(own_sizes) and (
            saved_sizes == own_sizes or not _keyed_by_position(saved)
        ):
            return
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(saved_sizes)} parameter group(s) of "
            f"{saved_sizes} parameters, this optimizer {len(own_sizes)} of {own_sizes}: their "
            "groups cannot be matched (the state and hyperparameters of each group would go "
            "to another); restore into an optimizer with the same parameter groups"
        )

    def _warn_of_another_kind(self, saved: SavedEntries) -> None:
        """Log a warning where a saved parameter group looks saved by another kind of optimizer:
        it lacks settings this optimizer is made with (its ``defaults``: SGD's ``momentum``) and
        has some this one's group lacks (AdamW's ``betas``). Torch's load takes the saved groups
        and state as they are, and the first ``step()`` fails far from the cause (SGD:
        ``KeyError: 'momentum'``). Settings a scheduler adds to a group (OneCycleLR's
        ``max_lr``, SWALR's ``swa_lr``) are no optimizer's own, so only the saved group's lack of
        the optimizer's own ones counts. A warning, not an error: a setting one torch version
        added, with a scheduler's saved, looks the same."""
        saved_settings = _saved_group_settings(saved)
        if saved_settings is None:
            return
        made_with = set(self.optimizer.defaults) - _NOT_SETTINGS
        for index, (theirs, group) in enumerate(
            zip(saved_settings, self.optimizer.param_groups, strict=False)
        ):
            lacking = made_with - theirs
            foreign = theirs - (set(group) - _NOT_SETTINGS)
            if lacking and foreign:
                log.warning(
                    "the checkpoint's optimizer looks like another kind than this %s: its "
                    "parameter group %d has settings %s that this one lacks, and lacks its %s; "
                    "the saved settings and state are loaded as they are, and a step may fail",
                    type(self.optimizer).__name__,
                    index,
                    sorted(foreign),
                    sorted(lacking),
                )
                return

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict keyed by parameter name (or, from older checkpoints, by position).

        Parameters without saved state end up without state, as they were when saved.
        """
        groups = state_dict.get("param_groups", [])
        if any(isinstance(p, int) for group in groups for p in group.get("params", [])):
            self.optimizer.load_state_dict(state_dict)
        elif state_dict.get("state"):
            names = _names_of(self.model, self._training)
            dcp_state_dicts.load_optimizer_state_dict(names, self.optimizer, state_dict)
        else:  # nothing per parameter: set the groups and drop any state; no step is taken
            position = {name: index for index, name in enumerate(self._parameter_names())}
            unknown = [p for group in groups for p in group["params"] if p not in position]
            if unknown:
                raise CheckpointError(
                    f"the checkpoint's optimizer holds parameters {unknown[:5]} that this "
                    "optimizer does not have"
                )
            by_position = [
                {**group, "params": [position[p] for p in group["params"]]} for group in groups
            ]
            self.optimizer.load_state_dict({"state": {}, "param_groups": by_position})

    def _parameter_names(self) -> list[str]:
        """The name of every parameter of the optimizer, in the optimizer's order."""
        names = _names_of(self.model, self._training)
        return dcp_state_dicts.parameter_names(names, self.optimizer)


def _names_of(module: nn.Module, training: TrainingObjects | None) -> dcp_state_dicts.ModuleNames:
    """DCP's names of ``module``: those ``training`` keeps for this save or restore, else
    worked out anew (an object made by the user lives longer than one save)."""
    if training is not None:
        return training.names_of(module)
    return dcp_state_dicts.ModuleNames(module)


def _loads_saved_state(optimizer: torch.optim.Optimizer) -> bool:
    """True for torch's own optimizers (``torch.optim``), whose load takes the state it is
    given as the state (keys as saved, each tensor cast to its parameter's dtype and moved to
    its device, ``step`` left where it is unless ``capturable`` or ``fused``), and none of
    whose state holds more than tensors and plain values under string keys."""
    return (
        type(optimizer).__module__.startswith("torch.optim.")
        and dcp_state_dicts.loads_with_torchs_load(optimizer)
        and not getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", True)
    )


def _state_from_checkpoint(
    saved: SavedEntries, key: str, param: torch.Tensor
) -> dict[str, Any] | None:
    """The state of ``param`` to restore the checkpoint's into, made from what the checkpoint
    holds for it instead of by a step (a step over a large model costs seconds: AdamW over
    100M parameters, 1.4-1.6 s): an empty tensor for each stored tensor, laid out as the
    optimizer's load leaves it (the parameter's dtype and device, its strides where the shapes
    match; ``step`` as stored, on the CPU), and a placeholder for each plain value, which the
    restore replaces. None where the checkpoint's state of it is not only tensors and plain
    values, or ``param`` is not a plain tensor (a DTensor's state is sharded like it)."""
    if type(param) is not nn.Parameter:
        return None
    names = saved.children("state", key)
    if not names:
        return None
    entries = {name: saved.tensor("state", key, name) for name in names}
    # The order torch's optimizers make their state in (a step: ``step``, then the moments;
    # NAdam's and ASGD's scalars before their tensors): the scalar tensors first, the rest
    # after, each in the order stored (where the pack of small tensors and the plain values
    # come after the others)
    names = sorted(names, key=lambda name: not _scalar(entries[name]))
    made: dict[str, Any] = {}
    for name in names:
        entry = entries[name]
        if entry is None:
            made[name] = None  # a plain value (the restore puts the stored one here)
            continue
        dtype = dtype_named(entry.dtype)
        if dtype is None:
            return None
        if name == "step":  # (kept as given unless capturable/fused, which move it)
            made[name] = torch.empty(entry.shape, dtype=dtype)
            continue
        dtype = param.dtype if param.is_floating_point() else dtype
        if list(param.shape) == entry.shape:
            made[name] = torch.empty_like(param, dtype=dtype, requires_grad=False)
        else:
            made[name] = torch.empty(entry.shape, dtype=dtype, device=param.device)
    return made


def _scalar(entry: TensorEntry | None) -> bool:
    return entry is not None and not entry.shape


def _saved_group_sizes(saved: SavedEntries) -> list[int] | None:
    """How many parameters each saved parameter group holds; None when not known."""
    groups = saved.plain("param_groups")
    if isinstance(groups, list):
        params = [group.get("params") if isinstance(group, dict) else None for group in groups]
    else:  # param_groups holding a tensor (a tensor learning rate) are stored item by item
        params = []
        while saved.has("param_groups", len(params)):
            params.append(saved.plain("param_groups", len(params), "params"))
    if not params or not all(isinstance(p, list) for p in params):
        return None
    return [len(p) for p in params]


def _saved_group_settings(saved: SavedEntries) -> list[set[str]] | None:
    """The names of each saved parameter group's settings; None when not known."""
    groups = saved.plain("param_groups")
    if isinstance(groups, list):
        if not all(isinstance(group, dict) for group in groups):
            return None
        return [{str(key) for key in group} - _NOT_SETTINGS for group in groups]
    settings: list[set[str]] = []  # stored item by item (a tensor learning rate)
    while saved.has("param_groups", len(settings)):
        names = saved.children("param_groups", len(settings))
        if names is None:
            return None
        settings.append(set(names) - _NOT_SETTINGS)
    return settings or None


def _keyed_by_position(saved: SavedEntries) -> bool:
    groups = saved.plain("param_groups")
    if isinstance(groups, list) and groups and isinstance(groups[0], dict):
        first = groups[0].get("params")
    else:  # param_groups holding a tensor (a tensor learning rate) are stored item by item
        first = saved.plain("param_groups", 0, "params")
    return isinstance(first, list) and any(isinstance(p, int) for p in first)


class TrainingObjects:
    """Finds the module of each optimizer in a state, and wraps modules and optimizers.

    An optimizer belongs to the module of the state that holds all of its parameters. When
    several do, the outermost wins (a model and one of its submodules); two unrelated modules
    holding all of them are ambiguous.
    """

    def __init__(self, state: Mapping[str, Any], *, saving: bool = False) -> None:
        """``saving``: the state is being saved, and a module and its one optimizer have their
        state dicts made together (:meth:`joint_state_dicts`)."""
        self._state = state
        self._saving = saving
        self._param_ids: dict[int, set[int]] = {}
        self._joint: dict[int, tuple[torch.optim.Optimizer, dict, dict] | None] = {}
        self._names: dict[int, dcp_state_dicts.ModuleNames] = {}

    @functools.cached_property
    def _modules(self) -> dict[int, tuple[str, nn.Module]]:
        """id -> (path, module) of every module in the state, found when an optimizer first
        needs its module (a state without optimizers is never scanned)."""
        modules: dict[int, tuple[str, nn.Module]] = {}
        found: list[tuple[str, nn.Module]] = []
        _collect_modules(self._state, "", found)
        for path, module in found:
            modules.setdefault(id(module), (path, module))
        return modules

    @functools.cached_property
    def _optimizers_by_module(self) -> dict[int, list[torch.optim.Optimizer]]:
        """id of a module -> the optimizers at the top level of the state that belong to it
        (each once; where they usually are: one look per key, no walk through the state's
        containers on every save); an optimizer whose module cannot be told is left out (it
        raises where it is visited)."""
        by_module: dict[int, list[torch.optim.Optimizer]] = {}
        seen: set[int] = set()
        for optimizer in self._state.values():
            if not isinstance(optimizer, torch.optim.Optimizer) or id(optimizer) in seen:
                continue
            seen.add(id(optimizer))
            try:
                module = self.module_for(optimizer)
            except CheckpointError:
                continue
            by_module.setdefault(id(module), []).append(optimizer)
        return by_module

    def adapt(self, value: Any) -> Any:
        """A ``ModelState``/``OptimizerState`` for a module/optimizer, and for an
        ``OptimizerState`` the user made one of this save or restore (which works out DCP's
        names with the rest of the state's: :meth:`names_of`); other values unchanged."""
        if isinstance(value, nn.Module):
            return ModelState(value, self)
        if isinstance(value, torch.optim.Optimizer):
            return OptimizerState(self.module_for(value), value, self)
        if type(value) is OptimizerState and value._training is None:
            return OptimizerState(value.model, value.optimizer, self)
        return value

    def names_of(self, module: nn.Module) -> dcp_state_dicts.ModuleNames:
        """DCP's names of ``module``, worked out once for the save or restore of this state
        (:class:`ckptmgr.dcp_state_dicts.ModuleNames`): a restore of a module and its optimizer
        asked five times whether DCP would only rename, and three times for the names of the
        optimizer's parameters."""
        names = self._names.get(id(module))
        if names is None or names.module is not module:
            names = dcp_state_dicts.ModuleNames(module)
            self._names[id(module)] = names
        return names

    def joint_state_dicts(
        self, module: nn.Module
    ) -> tuple[torch.optim.Optimizer, dict[str, Any], dict[str, Any]] | None:
        """(the optimizer, DCP's state dict of ``module``, that of the optimizer), made by one
        call (:func:`ckptmgr.dcp_state_dicts.state_dicts`) once per state saved, where
        ``module`` has exactly one optimizer at the top level of the state and that optimizer
        has state; None otherwise (each is made on its own), and always in a restore.

        ``get_model_state_dict`` and ``get_optimizer_state_dict`` each map every parameter's
        names anew (DCP's ``_verify_options``): one call for both does it once (FSDP2 over 1,000
        parameters with AdamW, 2 ranks: 61 ms against 49 + 31 ms a save, on the training
        thread). The dicts are the same as the two calls make."""
        if not self._saving:
            return None
        key = id(module)
        if key not in self._joint:
            optimizers = self._optimizers_by_module.get(key, [])
            made = None
            if len(optimizers) == 1 and optimizers[0].state:
                optimizer = optimizers[0]
                names = self.names_of(module)
                model_dict, optimizer_dict = dcp_state_dicts.state_dicts(names, optimizer)
                made = (optimizer, model_dict, optimizer_dict)
            self._joint[key] = made
        return self._joint[key]

    def module_for(self, optimizer: torch.optim.Optimizer) -> nn.Module:
        """The module of the state whose parameters include all of ``optimizer``'s."""
        wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
        holders = [
            (path, module)
            for path, module in self._modules.values()
            if wanted <= self._params_of(module)
        ]
        outermost = [
            (path, module)
            for path, module in holders
            if not any(other is not module and _is_submodule(module, other) for _, other in holders)
        ]
        if len(outermost) == 1:
            return outermost[0][1]
        advice = (
            "ckptmgr saves an optimizer's state keyed by parameter names, which it takes from "
            "the module it optimizes. Put that module in the state (e.g. {'model': model, "
            "'optim': optimizer}), wrap the optimizer as "
            "ckptmgr.OptimizerState(model, optimizer), or save "
            "optimizer.state_dict() to key it by parameter position"
        )
        if not outermost:
            raise CheckpointError(
                f"no module in the state holds all parameters of the optimizer "
                f"{type(optimizer).__qualname__}. {advice}"
            )
        paths = ", ".join(repr(path) for path, _ in outermost)
        raise CheckpointError(
            f"several modules in the state ({paths}) hold all parameters of the optimizer "
            f"{type(optimizer).__qualname__}; it is ambiguous which one it belongs to. {advice}"
        )

    def _params_of(self, module: nn.Module) -> set[int]:
        ids = self._param_ids.get(id(module))
        if ids is None:
            ids = {id(p) for p in module.parameters()}
            self._param_ids[id(module)] = ids
        return ids


def _is_submodule(inner: nn.Module, outer: nn.Module) -> bool:
    return any(module is inner for module in outer.modules())


# Exact types that neither are nor hold a module: the scan skips them (under a key of a type in
# _SIMPLE_KEYS, whose path part is formatted without running user code).
_NO_MODULES = frozenset({torch.Tensor, nn.Parameter, type(None), bool, int, float, str, bytes})
_SIMPLE_KEYS = frozenset({str, int})


def _collect_modules(value: Any, path: str, found: list[tuple[str, nn.Module]]) -> None:
    """Append ``(path, module)`` for every module in ``value``, depth first in item order.

    Looks through dicts (any ``Mapping``), lists, tuples and ``PerRank``; a module's path joins
    the keys with ``/`` (unescaped: it only names the module in error messages).
    """
    kind = type(value)
    items: Iterable[tuple[object, Any]]
    if kind is dict:
        items = value.items()
    elif kind is list or kind is tuple:
        items = enumerate(value)
    elif isinstance(value, nn.Module):
        found.append((path, value))
        return
    elif isinstance(value, PerRank):
        _collect_modules(value.value, path, found)
        return
    elif isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return
    for key, item in items:
        if type(item) in _NO_MODULES and type(key) in _SIMPLE_KEYS:
            continue
        _collect_modules(item, f"{path}/{key}" if path else str(key), found)
