"""DCP's state dicts of a module and its optimizer, made directly where DCP's API only renames.

``get_model_state_dict`` / ``get_optimizer_state_dict`` / ``get_state_dict`` (ckptmgr's options:
``strict=False``, all others DCP's defaults) map every parameter's name to its canonical name
anew on every call: each name is walked attribute by attribute through the module tree, twice,
and the whole tree is searched for FSDP (version 1) states. For a module with none of the
wrappers whose names DCP rewrites but ``torch.compile``'s and DDP's, that is work for nothing:
the module's own ``state_dict()`` has the canonical names once the wrappers' ``_orig_mod`` and
``module`` are taken out of them, and the optimizer's ``state_dict()`` needs only each
parameter's position replaced by that name from ``named_parameters()``. With 1,000
``nn.Linear`` layers and AdamW (2,000 parameters, 8,000 tensors) ``get_state_dict`` took 77 ms
a save on the training thread (98 ms compiled), against about 10 ms for the module's and the
optimizer's own ``state_dict()`` and the renaming.

A module tree is *plain* when none of its modules is FSDP (version 1, wrapper or composable)
or an activation-checkpoint wrapper, declares DCP's ``_fqn_modifiers`` or has a state-dict hook
that runs after ``state_dict()`` (which may rename keys; DCP would check them against the
module tree); when, if it holds ``torch.compile``'s or DDP's wrappers, nothing else in it holds
something under the name they hold their module by (``_orig_mod``, ``module``); and when
neither the module's nor the optimizer's ``state_dict`` is patched by DCP or replaced on the
object. FSDP2 (``fully_shard``), tensor-parallel, compiled and DDP modules are plain: DCP takes
their ``state_dict()`` as it is and removes the wrappers' ``_orig_mod`` and ``module`` from the
names. For a plain tree the dicts made here are DCP's (the same keys in the same order, the
very tensors, the same plain values: ``tests/test_dcp_state_dicts.py`` compares them);
anywhere else, and on a torch whose DCP code this was not read against
(:data:`READ_AGAINST`), DCP's functions are called.

Loads (a restore) likewise: ``set_model_state_dict`` of a plain tree renames and calls the
module's ``load_state_dict``, which copies each value into the tensor of its key after
filtering the whole dict by every child's prefix (1,000 layers: 1,000 passes over 2,000 keys).
A restore fills the module's own tensors in place, so where loading would do nothing but copy
each onto itself it is skipped (:func:`load_model_state_dict`). ``set_optimizer_state_dict``
maps names again and hands the optimizer's ``load_state_dict`` the saved dict split by the
optimizer's groups; the same split is made here from the names of the optimizer's parameters
(:func:`load_optimizer_state_dict`; ``tests/test_dcp_state_dict_loads.py`` compares it with
DCP's), keyed by position in ranges (:func:`_by_position`). The restore of that module and its
optimizer: 0.79-1.08 s -> 0.20-0.25 s.

Each function takes the module as a :class:`ModuleNames`, which keeps what they work out
about its names (whether DCP would only rename, the names of an optimizer's parameters) for
one save or restore: a restore asked five and three times (1,000 layers: about 10 ms of it).
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Callable
from itertools import chain
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

from ckptmgr.errors import CheckpointError
from ckptmgr.torch_versions import torch_version

try:  # FSDP version 1: DCP renames its parameters (flat parameters, its wrapper's prefix)
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._common_utils import _get_module_fsdp_state
except ImportError:  # pragma: no cover - a torch without it or that moved it: never plain
    FullyShardedDataParallel = None  # type: ignore[assignment,misc]
    _get_module_fsdp_state = None

try:  # whose state_dict() DCP's _patch_model_state_dict / _patch_optimizer_state_dict patched
    from torch.distributed.checkpoint.state_dict import _patched_state_dict
except ImportError:  # pragma: no cover - a torch that moved it: never plain
    _patched_state_dict = None

try:  # maps a parameter name to the name DCP uses (DDP/compile prefixes removed)
    from torch.distributed.checkpoint.state_dict import _get_fqns
except ImportError:  # pragma: no cover - a torch that moved it: use the names as they are
    _get_fqns = None

try:  # torch's norm layers' loads, which only add or drop keys a module's own dict has or lacks
    from torch.nn.modules.batchnorm import _NormBase
    from torch.nn.modules.instancenorm import _InstanceNorm

    _NORM_LOADS = (_NormBase._load_from_state_dict, _InstanceNorm._load_from_state_dict)
except (ImportError, AttributeError):  # pragma: no cover - a torch that moved them
    _NORM_LOADS = ()

READ_AGAINST = ((2, 10), (2, 14))
"""The lowest and highest (major, minor) torch versions whose DCP state-dict API
(``torch/distributed/checkpoint/state_dict.py``) this module was read against; on any other,
DCP's functions are called. (From 2.10 to 2.14 that file changed in its type hints, a comment
and the process group of FSDP version 1's optimizer state, which is never plain.)"""

GET_OPTIONS = StateDictOptions(strict=False)
"""The options ckptmgr gets DCP's state dicts with (``strict`` only makes
``get_model_state_dict`` reject a module without state, ``nn.ReLU()``)."""

LOAD_OPTIMIZER_OPTIONS = StateDictOptions(strict=False)
"""The options ckptmgr loads an optimizer's state dict with: a parameter without saved state is
left without state (as it was when saved)."""

_CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"
"""The attribute of an activation-checkpoint wrapper that holds the wrapped module; DCP removes
its prefix from names."""
_COMPILE_WRAPPER_MODULE = "torch._dynamo.eval_frame"
"""Where ``torch.compile``'s wrapper, ``OptimizedModule``, is defined. Importing it costs about
a second (all of dynamo), so it is looked up only once something imported it: no module can be
one before (:func:`_wrapped_as`)."""
_FQN_MODIFIERS = "_fqn_modifiers"
"""A module method whose renaming DCP applies (``StateDictOptions.dsd_fqn_modifiers``)."""

_FSDP1_WRAPPERS: tuple[type, ...] = tuple(
    kind for kind in (FullyShardedDataParallel,) if kind is not None
)

Rename = Callable[[str], str]
"""DCP's name of a parameter or state-dict key, from the module's own."""


class ModuleNames:
    """A module, and DCP's names of what it holds, worked out once for one save or restore.

    Telling whether DCP would do no more than rename walks the module tree (:func:`_dcp_names`;
    1,000 layers: about 2 ms) and naming an optimizer's parameters takes a pass over
    ``named_parameters()`` (about 3 ms): a restore of a module and its optimizer asked five and
    three times. Both are kept here, so make one for each save or restore
    (:class:`ckptmgr.module_state.TrainingObjects` does): they hold while the module tree and
    the optimizers' parameter groups are unchanged."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._by_position: dict[int, tuple[torch.optim.Optimizer, list[str | None]]] = {}

    @functools.cached_property
    def rename(self) -> Rename | None:
        """:func:`_dcp_names` of the module."""
        return _dcp_names(self.module)

    def by_position(self, optimizer: torch.optim.Optimizer, rename: Rename) -> list[str | None]:
        """:func:`_names_by_position` of ``optimizer``'s parameters (``rename`` is
        :attr:`rename`)."""
        kept = self._by_position.get(id(optimizer))
        if kept is None or kept[0] is not optimizer:
            kept = (optimizer, _names_by_position(self.module, optimizer, rename))
            self._by_position[id(optimizer)] = kept
        return kept[1]


def model_state_dict(names: ModuleNames) -> dict[str, Any]:
    """``get_model_state_dict(model, options=GET_OPTIONS)`` of ``names.module``."""
    rename = names.rename
    if rename is not None:
        return _own_state_dict(names.module, rename)
    return get_model_state_dict(names.module, options=GET_OPTIONS)


def optimizer_state_dict(names: ModuleNames, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``get_optimizer_state_dict(model, optimizer, options=GET_OPTIONS)`` (``model`` is
    ``names.module``) of an optimizer with state (DCP takes a step to create the state of one
    without)."""
    rename = names.rename if _own_method(optimizer, "state_dict") else None
    if optimizer.state and rename is not None:
        return _named_optimizer_state_dict(names, optimizer, rename)
    return get_optimizer_state_dict(names.module, optimizer, options=GET_OPTIONS)


def state_dicts(
    names: ModuleNames, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``get_state_dict(model, optimizer, options=GET_OPTIONS)`` (``model`` is
    ``names.module``) of an optimizer with state."""
    rename = names.rename if _own_method(optimizer, "state_dict") else None
    if optimizer.state and rename is not None:
        return (
            _own_state_dict(names.module, rename),
            _named_optimizer_state_dict(names, optimizer, rename),
        )
    model_dict, optimizer_dict = get_state_dict(names.module, optimizer, options=GET_OPTIONS)
    return model_dict, optimizer_dict


def load_model_state_dict(names: ModuleNames, state_dict: dict[str, Any], strict: bool) -> None:
    """``set_model_state_dict(model, state_dict, options=StateDictOptions(strict=strict))``
    (``model`` is ``names.module``), which is skipped where it would do nothing: where every
    value of ``state_dict`` already is the module's own tensor under DCP's name of it (the same
    memory, shape, strides and dtype: what a restore in place leaves) and loading a plain tree
    would only copy each onto itself.

    ``nn.Module.load_state_dict`` filters the whole dict by each child's prefix: a flat
    ``nn.Sequential`` of 1,000 layers made 1,000 passes over 2,000 keys (about 0.5 s)."""
    if not _holds_own_tensors(names, state_dict):
        set_model_state_dict(names.module, state_dict, options=StateDictOptions(strict=strict))


def load_optimizer_state_dict(
    names: ModuleNames, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> None:
    """``set_optimizer_state_dict(model, optimizer, state_dict, options=LOAD_OPTIMIZER_OPTIONS)``
    (``model`` is ``names.module``) of a state dict keyed by DCP's parameter names.

    Where DCP would only map names (a plain tree, an optimizer with state whose parameter groups
    hold, in order, the parameters the saved groups name), the optimizer's own
    ``load_state_dict`` gets the dict DCP would give it, without DCP's walk over every
    parameter's name: for each group, the saved hyperparameters and the names, and the saved
    state of each of its parameters that requires a gradient."""
    split = _split_by_group(names, optimizer, state_dict)
    if split is None:
        set_optimizer_state_dict(
            names.module, optimizer, state_dict, options=LOAD_OPTIMIZER_OPTIONS
        )
    elif getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", True):
        optimizer.load_state_dict(split)  # (a hook sees the dict DCP would give it)
    else:
        optimizer.load_state_dict(_by_position(split))


def loads_with_torchs_load(optimizer: torch.optim.Optimizer) -> bool:
    """True where ``optimizer.load_state_dict`` is torch's own ``Optimizer.load_state_dict``
    (neither its class's nor one set on the object), whose state becomes the given state."""
    own_load = "load_state_dict" in vars(optimizer)
    return not own_load and type(optimizer).load_state_dict is torch.optim.Optimizer.load_state_dict


def parameter_names(names: ModuleNames, optimizer: torch.optim.Optimizer) -> list[str]:
    """DCP's name of each of ``optimizer``'s parameters (in the optimizer's order) in
    ``names.module.named_parameters()`` (a shared parameter's first name).

    Raises ``CheckpointError`` when the module does not hold them all."""
    model = names.module
    rename = names.rename
    if rename is not None:  # (a copy: the names kept are not handed out)
        return _all_named(list(names.by_position(optimizer, rename)), model)
    by_id: dict[int, str] = {}
    for name, param in model.named_parameters():
        if id(param) not in by_id:
            by_id[id(param)] = name if _get_fqns is None else next(iter(_get_fqns(model, name)))
    params = chain.from_iterable(group["params"] for group in optimizer.param_groups)
    return _all_named([by_id.get(id(param)) for param in params], model)


def _all_named(names: list[str | None], model: nn.Module) -> list[str]:
    """``names``, each a parameter's name; raises ``CheckpointError`` for a parameter without
    one (not a parameter of ``model``)."""
    missing = [index for index, name in enumerate(names) if name is None]
    if missing:
        raise CheckpointError(
            f"parameters {missing[:5]} of the optimizer are not parameters of the module "
            f"{type(model).__qualname__} it was paired with"
        )
    return cast(list[str], names)


def _holds_own_tensors(names: ModuleNames, state_dict: dict[str, Any]) -> bool:
    """True where ``state_dict`` holds exactly the module's own state dict (DCP's names, the
    very memory of each tensor) and its ``load_state_dict`` of it would only copy each value
    onto itself (:func:`_loads_by_copy`)."""
    rename = names.rename
    if rename is None or not _loads_by_copy(names.module):
        return False
    own = _own_state_dict(names.module, rename)
    if len(own) != len(state_dict):
        return False
    for key, tensor in own.items():
        loaded = state_dict.get(key)
        if not (
            type(tensor) is torch.Tensor
            and type(loaded) is torch.Tensor
            and loaded.dtype == tensor.dtype
            and loaded.is_set_to(tensor)
            and loaded.is_conj() == tensor.is_conj()
            and loaded.is_neg() == tensor.is_neg()
        ):
            return False
    return True


def _loads_by_copy(model: nn.Module) -> bool:
    """True where ``model.load_state_dict`` of a dict with exactly its own keys does nothing
    but copy each value into the tensor under its key: torch's own ``load_state_dict``, no load
    hook (lazy modules, FSDP2 and spectral norm have them), no ``_load_from_state_dict`` but
    ``nn.Module``'s or torch's norm layers' (which only add a key the dict lacks or drop one
    the module lacks), no extra state to set, parameters not swapped on load
    (``torch.__future__.set_swap_module_params_on_conversion``)."""
    if torch.__future__.get_swap_module_params_on_conversion():
        return False
    if type(model).load_state_dict is not nn.Module.load_state_dict:
        return False
    if "load_state_dict" in vars(model):
        return False
    loads = (nn.Module._load_from_state_dict, *_NORM_LOADS)
    for module in model.modules():
        if module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks:
            return False
        if type(module)._load_from_state_dict not in loads:
            return False
        if "_load_from_state_dict" in vars(module) or "set_extra_state" in vars(module):
            return False
        if type(module).set_extra_state is not nn.Module.set_extra_state:
            return False
    return True


def _split_by_group(
    names: ModuleNames, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> dict[str, Any] | None:
    """What DCP's ``set_optimizer_state_dict`` hands ``optimizer.load_state_dict``, where it
    would only map names (:func:`load_optimizer_state_dict`); None elsewhere. Unlike DCP, the
    saved state of a parameter that does not require grad now (frozen after the save, or
    before it and after its state was made) is kept: DCP left it out, and the state of a
    layer frozen for a while was lost (its moments started afresh once it was unfrozen). A
    group without parameters is matched by its position, as the others are: DCP's matching
    gave its hyperparameters none back (the next step raised ``KeyError: 'betas'``)."""
    if not optimizer.state and not loads_with_torchs_load(optimizer):
        # DCP would create the state by taking a step, which torch's own load then replaces
        # with the loaded state whole: only that load may be called without the step
        return None
    if not (_own_method(optimizer, "state_dict") and _own_method(optimizer, "load_state_dict")):
        return None
    rename = names.rename
    saved_state, saved_groups = state_dict.get("state"), state_dict.get("param_groups")
    if rename is None or not isinstance(saved_state, dict) or not isinstance(saved_groups, list):
        return None
    groups = optimizer.param_groups
    if len(saved_groups) != len(groups):
        return None
    by_position = iter(names.by_position(optimizer, rename))
    state: dict[str, Any] = {}
    split_groups: list[dict[str, Any]] = []
    for group, saved in zip(groups, saved_groups, strict=True):
        own = [next(by_position) for _ in group["params"]]
        if None in own or not isinstance(saved, dict) or saved.get("params") != own:
            return None  # (DCP matches groups by the names they hold; an empty one specially)
        for name in own:  # (a frozen parameter's state too: DCP drops it, see the docstring)
            if name in saved_state:
                state[name] = saved_state[name]
        split_groups.append({"params": own, **{k: v for k, v in saved.items() if k != "params"}})
    return {"state": state, "param_groups": split_groups}


def _by_position(split: dict[str, Any]) -> dict[str, Any]:
    """``split`` (from :func:`_split_by_group`) keyed by each parameter's position in the
    optimizer, each group's positions a ``range``: ``Optimizer.load_state_dict`` looks up the
    parameter of every state tensor in its group's ``params``, which takes a scan of a list
    (10,000 parameters with AdamW: 2.9 s to load keyed by name, 0.08 s by ranges)."""
    position: dict[str, int] = {}
    groups = []
    for group in split["param_groups"]:
        start = len(position)
        position.update(zip(group["params"], itertools.count(start)))
        groups.append({**group, "params": range(start, len(position))})
    state = {position[name]: value for name, value in split["state"].items()}
    return {"state": state, "param_groups": groups}


def _names_by_position(
    model: nn.Module, optimizer: torch.optim.Optimizer, rename: Rename
) -> list[str | None]:
    """:func:`parameter_names` of a plain tree, renamed by ``rename``."""
    params = list(chain.from_iterable(group["params"] for group in optimizer.param_groups))
    position = {param: index for index, param in enumerate(params)}
    names: list[str | None] = [None] * len(params)
    for name, param in model.named_parameters():
        index = position.get(param)
        if index is not None:
            names[index] = rename(name)
    return names


def _dcp_names(model: nn.Module) -> Rename | None:
    """How DCP's state-dict API names what ``model`` names, where it would do no more than
    rename (as the module docstring says); None where DCP's functions must run."""
    low, high = READ_AGAINST
    if not low <= torch_version() <= high:
        return None
    if _get_module_fsdp_state is None or _patched_state_dict is None:
        return None
    if not _own_method(model, "state_dict"):
        return None
    wrappers = _wrapped_as()
    wrapper_kinds = tuple(wrappers)
    wrapped_as: set[str] = set()  # the names of the wrappers' children in this tree
    for module in model.modules():
        if isinstance(module, wrapper_kinds):
            wrapped_as.update(name for kind, name in wrappers.items() if isinstance(module, kind))
        if (
            isinstance(module, _FSDP1_WRAPPERS)
            or _get_module_fsdp_state(module) is not None
            or _CHECKPOINT_WRAPPED in module._modules
            or hasattr(type(module), _FQN_MODIFIERS)
            or _FQN_MODIFIERS in vars(module)
            or module._state_dict_hooks  # (may rename keys, which DCP would check)
        ):
            return None
    if not wrapped_as:
        return _as_it_is
    for module in model.modules():  # only the wrappers hold something under their names
        if not isinstance(module, wrapper_kinds) and not wrapped_as.isdisjoint(
            chain(module._modules, module._parameters, module._buffers)
        ):
            return None
    return functools.partial(_without_parts, frozenset(wrapped_as))


def _wrapped_as() -> dict[type, str]:
    """``torch.compile``'s and DDP's wrappers, and the name under which each holds the module it
    wraps: DCP removes that name from the names below it (``_orig_mod.0.weight``,
    ``module.0.weight`` -> ``0.weight``). ``torch.compile``'s only once dynamo was imported."""
    wrappers: dict[type, str] = {DistributedDataParallel: "module"}
    compile_wrappers = sys.modules.get(_COMPILE_WRAPPER_MODULE)
    compiled = getattr(compile_wrappers, "OptimizedModule", None)
    if isinstance(compiled, type):
        wrappers[compiled] = "_orig_mod"
    return wrappers


def _as_it_is(name: str) -> str:
    return name


def _without_parts(parts: frozenset[str], name: str) -> str:
    """``name`` without the parts named in ``parts`` (the wrappers' children, in a tree where
    only the wrappers hold something under those names: :func:`_dcp_names`)."""
    kept = [part for part in name.split(".") if part not in parts]
    return ".".join(kept)


def _own_method(obj: object, name: str) -> bool:
    """True where ``obj.name`` is its class's method, neither patched by DCP nor set on the
    object itself."""
    return name not in vars(obj) and getattr(type(obj), name) not in _patched_state_dict  # type: ignore[operator]


@torch.no_grad()
def _own_state_dict(model: nn.Module, rename: Rename) -> dict[str, Any]:
    """The module's ``state_dict()``, each key renamed as DCP does (a renamed key moves to the
    end, as DCP pops and sets it)."""
    state = model.state_dict()
    if rename is not _as_it_is:
        for key in list(state):
            name = rename(key)
            if name != key:
                state[name] = state.pop(key)
    return state


def _named_optimizer_state_dict(
    names: ModuleNames, optimizer: torch.optim.Optimizer, rename: Rename
) -> dict[str, Any]:
    """The optimizer's ``state_dict()`` with each parameter's position replaced by DCP's name of
    it in the module's ``named_parameters()`` (the first name of a shared parameter), as DCP
    does."""
    own = optimizer.state_dict()
    named = _all_named(names.by_position(optimizer, rename), names.module)
    state = own["state"]
    for index in list(state):  # (re-inserted in their order, as DCP does)
        state[named[index]] = state.pop(index)
    for group in own["param_groups"]:
        group["params"] = [named[index] for index in group["params"]]
    return {"state": state, "param_groups": own["param_groups"]}
