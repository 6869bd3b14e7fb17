"""ckptmgr.dcp_state_dicts, the load side: a plain module whose state dict already holds its own
tensors (what a restore in place leaves) is not loaded again, and an optimizer's state dict
is split for its own ``load_state_dict`` as DCP's ``set_optimizer_state_dict`` splits it.
Wherever loading would do more (another tensor, a hook, extra state, ...) or DCP would match
differently (parameter groups in another order, an empty group, ...), DCP's functions run."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_on_one_gloo_rank
from test_dcp_state_dicts import WithExtraState, _trained, differences, read_torch
from torch import nn
from torch.distributed.checkpoint import state_dict as dcp_state_dict_api
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from ckptmgr import CheckpointError, CheckpointManager, dcp_state_dicts
from ckptmgr.dcp_state_dicts import ModuleNames
from ckptmgr.module_state import OptimizerState

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
    read_torch,
]


class Calls:
    """Records the calls of a function of ckptmgr.dcp_state_dicts, DCP's among them (and makes
    them, or refuses them)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str, refuse: bool = False) -> None:
        self.count = 0
        real = getattr(dcp_state_dicts, name)

        def called(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            if refuse:
                raise AssertionError(f"DCP's {name} was called")
            return real(*args, **kwargs)

        monkeypatch.setattr(dcp_state_dicts, name, called)


def _norms() -> nn.Module:
    """Linear layers and torch's norm layers (whose ``_load_from_state_dict`` is their own)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 6),
        nn.BatchNorm1d(6),
        nn.Linear(6, 6),
        nn.InstanceNorm1d(6, affine=True, track_running_stats=True),
        nn.InstanceNorm1d(6),  # (no running stats)
        nn.Linear(6, 3),
    )
    with torch.no_grad():  # (running statistics that moved)
        model[1].running_mean.add_(0.5)
        model[1].num_batches_tracked.add_(3)
        model[3].running_var.mul_(2.0)
    return model


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in model.state_dict().items()}


def _same_values(model: nn.Module, values: dict[str, torch.Tensor]) -> bool:
    own = model.state_dict()
    return list(own) == list(values) and all(torch.equal(own[k], values[k]) for k in values)


@pytest.mark.parametrize("wrap", ["plain", "compiled"])
def test_a_plain_modules_own_tensors_are_not_loaded_again(
    wrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _norms()
    if wrap == "compiled":
        model = torch.compile(model)  # (names without "_orig_mod.")
    before = _values(model)
    state = dcp_state_dicts.model_state_dict(
        ModuleNames(model)
    )  # the module's tensors, DCP's names
    assert "0.weight" in state and "1.num_batches_tracked" in state
    calls = Calls(monkeypatch, "set_model_state_dict", refuse=True)
    dcp_state_dicts.load_model_state_dict(ModuleNames(model), state, strict=True)
    assert calls.count == 0
    assert _same_values(model, before)


def _another_tensor(model: nn.Module, state: dict[str, Any]) -> None:
    state["0.weight"] = torch.full_like(state["0.weight"], 2.5)


def _a_view_as_another_dtype(model: nn.Module, state: dict[str, Any]) -> None:
    # the same memory, shape and strides: only the dtype tells it is not the module's tensor
    state["0.weight"] = state["0.weight"].view(torch.int32)


def _a_missing_key(model: nn.Module, state: dict[str, Any]) -> None:
    del state["2.bias"]


def _an_extra_key(model: nn.Module, state: dict[str, Any]) -> None:
    state["9.weight"] = torch.zeros(1)


def _a_load_pre_hook(model: nn.Module, state: dict[str, Any]) -> None:
    model[2].register_load_state_dict_pre_hook(lambda *args: None)


def _a_load_post_hook(model: nn.Module, state: dict[str, Any]) -> None:
    model[0].register_load_state_dict_post_hook(lambda *args: None)


class OwnLoad(nn.Linear):
    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)


def _an_own_load_from_state_dict(model: nn.Module, state: dict[str, Any]) -> None:
    layer = OwnLoad(6, 6)
    layer.load_state_dict(model[2].state_dict())
    model[2] = layer
    state.clear()
    state.update(dcp_state_dicts.model_state_dict(ModuleNames(model)))


def _extra_state(model: nn.Module, state: dict[str, Any]) -> None:
    model.append(WithExtraState())
    state.clear()
    state.update(dcp_state_dicts.model_state_dict(ModuleNames(model)))
    assert "6._extra_state" in state


def _load_state_dict_set_on_the_object(model: nn.Module, state: dict[str, Any]) -> None:
    model.load_state_dict = model.load_state_dict  # type: ignore[method-assign]


def _parameters_swapped_on_load(model: nn.Module, state: dict[str, Any]) -> None:
    torch.__future__.set_swap_module_params_on_conversion(True)


@pytest.mark.parametrize(
    "change",
    [
        _another_tensor,
        _a_view_as_another_dtype,
        _a_missing_key,
        _an_extra_key,
        _a_load_pre_hook,
        _a_load_post_hook,
        _an_own_load_from_state_dict,
        _extra_state,
        _load_state_dict_set_on_the_object,
        _parameters_swapped_on_load,
    ],
)
def test_a_load_that_would_do_more_gets_dcps_call(
    change: Callable[[nn.Module, dict[str, Any]], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _norms()
    state = dcp_state_dicts.model_state_dict(ModuleNames(model))
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    try:
        change(model, state)
        calls = Calls(monkeypatch, "set_model_state_dict")
        try:
            dcp_state_dicts.load_model_state_dict(ModuleNames(model), state, strict=True)
        except RuntimeError:  # (DCP's strict load of a dict that lacks a key or has another)
            assert change in (_a_missing_key, _an_extra_key)
        assert calls.count == 1
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    if change is _another_tensor:
        assert torch.equal(model[0].weight, torch.full_like(model[0].weight, 2.5))


def _freeze_after_training(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A parameter with saved state that no longer requires a gradient: DCP drops its state,
    ckptmgr keeps it."""
    model.blocks["a"][0].bias.requires_grad_(False)
    assert model.blocks["a"][0].bias in optimizer.state


def _unchanged(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    pass


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("change", [_unchanged, _freeze_after_training])
def test_an_optimizers_dict_is_split_as_dcp_splits_it(kind: str, change: Any) -> None:
    """Against DCP's own split of the same dict (tied weights, a parameter without state,
    two groups with their own hyperparameters), but for the state of a parameter frozen since
    the save, which DCP drops and ckptmgr keeps (a layer frozen for a while, unfrozen later,
    goes on with its moments as in an uninterrupted run)."""
    model, optimizer = _trained(kind)
    saved = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(strict=False))
    change(model, optimizer)
    options = dcp_state_dicts.LOAD_OPTIMIZER_OPTIONS
    info = dcp_state_dict_api._verify_options(model, (optimizer,), optim_only=True, options=options)
    expected = dcp_state_dict_api._split_optim_state_dict(model, optimizer, saved, info)
    made = dcp_state_dicts._split_by_group(ModuleNames(model), optimizer, saved)
    assert made is not None
    if change is _freeze_after_training:
        assert "blocks.a.0.bias" in saved["state"] and "blocks.a.0.bias" not in expected["state"]
        expected["state"] = {  # (in the saved order)
            name: expected["state"].get(name, value)
            for name, value in saved["state"].items()
            if name in expected["state"] or name == "blocks.a.0.bias"
        }
    assert differences(made, expected) == []


def _loaded_both_ways(
    kind: str,
    monkeypatch: pytest.MonkeyPatch,
    change: Callable[[dict[str, Any]], None],
    without_state: bool = False,
) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """(DCP's calls made by ckptmgr's load, the optimizer's state dict after ckptmgr's load,
    after DCP's) of a trained optimizer's dict (changed by ``change``) into two copies of
    one trained elsewhere (``without_state``: their optimizers' state dropped, as a new
    optimizer's, which DCP creates with a step first)."""
    source_model, source = _trained(kind)
    with torch.no_grad():  # (other values than the destinations')
        for param in source_model.parameters():
            param.mul_(0.5)
    source_model(torch.randint(0, 10, (5,))).sum().backward()
    source.step()
    saved = copy.deepcopy(get_optimizer_state_dict(source_model, source))
    change(saved)
    ours, dcps = _trained(kind), _trained(kind)
    if without_state:
        ours[1].state.clear()
        dcps[1].state.clear()
    calls = Calls(monkeypatch, "set_optimizer_state_dict")
    dcp_state_dicts.load_optimizer_state_dict(ModuleNames(ours[0]), ours[1], copy.deepcopy(saved))
    monkeypatch.undo()
    set_optimizer_state_dict(
        dcps[0], dcps[1], copy.deepcopy(saved), options=dcp_state_dicts.LOAD_OPTIMIZER_OPTIONS
    )
    return calls.count, ours[1].state_dict(), dcps[1].state_dict()


def _equal(made: Any, expected: Any) -> bool:
    if isinstance(made, torch.Tensor):
        return (
            type(made) is type(expected)
            and made.dtype == expected.dtype
            and torch.equal(made, expected)
        )
    if isinstance(made, dict):
        return list(made) == list(expected) and all(_equal(made[k], expected[k]) for k in made)
    if isinstance(made, (list, tuple)):
        return len(made) == len(expected) and all(map(_equal, made, expected))
    return bool(made == expected)


def _groups_swapped(saved: dict[str, Any]) -> None:
    saved["param_groups"].reverse()


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("change", [lambda saved: None, _groups_swapped])
@pytest.mark.parametrize("without_state", [False, True], ids=["with-state", "without-state"])
def test_an_optimizer_loads_as_dcp_loads_it(
    kind: str, change: Any, without_state: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The optimizer ends up as DCP's load leaves it, one without state too (which DCP gives a
    step first); saved groups in another order than the optimizer's (DCP matches them by the
    names they hold) get DCP's call."""
    calls, ours, dcps = _loaded_both_ways(kind, monkeypatch, change, without_state)
    assert _equal(ours, dcps)
    assert calls == (1 if change is _groups_swapped else 0)
    if change is _groups_swapped:  # each group got its own hyperparameters back
        assert [group["lr"] for group in ours["param_groups"]] == [0.1, 0.01]


def test_the_optimizers_load_is_keyed_by_position_in_ranges() -> None:
    """The split handed to the optimizer's own load (with no pre-hook): each group's positions
    a range (no scan of a list per state tensor), each state the saved one, under its
    parameter's position in the optimizer."""
    model, optimizer = _trained("adamw")
    saved = get_optimizer_state_dict(model, optimizer)
    split = dcp_state_dicts._split_by_group(ModuleNames(model), optimizer, saved)
    assert split is not None
    made = dcp_state_dicts._by_position(split)
    assert [group["params"] for group in made["param_groups"]] == [range(0, 2), range(2, 7)]
    assert [group["lr"] for group in made["param_groups"]] == [0.1, 0.01]
    names = dcp_state_dicts.parameter_names(ModuleNames(model), optimizer)
    assert list(made["state"]) == [names.index(name) for name in split["state"]]
    assert all(made["state"][names.index(name)] is value for name, value in split["state"].items())


def test_an_optimizers_load_pre_hook_sees_dcps_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer = _trained("adamw")
    saved = copy.deepcopy(get_optimizer_state_dict(model, optimizer))
    seen: list[Any] = []
    optimizer.register_load_state_dict_pre_hook(
        lambda optimizer, state_dict: seen.append([g["params"] for g in state_dict["param_groups"]])
    )
    calls = Calls(monkeypatch, "set_optimizer_state_dict")
    dcp_state_dicts.load_optimizer_state_dict(ModuleNames(model), optimizer, saved)
    assert calls.count == 0
    assert seen == [[group["params"] for group in saved["param_groups"]]]
    assert seen[0][0] == ["embed.weight", "blocks.a.0.weight"]


def _an_empty_group(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    saved = get_optimizer_state_dict(model, optimizer)
    optimizer.add_param_group({"params": [], "lr": 0.5})
    saved["param_groups"].append({**saved["param_groups"][0], "params": [], "lr": 0.5})
    return saved


class OwnLoadAdamW(torch.optim.AdamW):
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)


def _no_state_and_an_own_load(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """(Without state DCP takes a step first; only torch's own load replaces that state whole.)"""
    saved = get_optimizer_state_dict(model, optimizer)
    optimizer.__class__ = OwnLoadAdamW
    optimizer.state.clear()
    return saved


def _patched_load(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    saved = get_optimizer_state_dict(model, optimizer)
    optimizer.load_state_dict = optimizer.load_state_dict  # type: ignore[method-assign]
    return saved


def test_an_empty_group_is_split_by_position_with_its_hyperparameters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A group without parameters went to DCP's load, which matches groups by the names they
    hold: the group got none of its saved hyperparameters back (the next step raised
    ``KeyError: 'betas'``). It is matched by its position now, as the other groups are."""
    model, optimizer = _trained("adamw")
    saved = _an_empty_group(model, optimizer)
    optimizer.param_groups[-1]["lr"] = 0.25  # (changed since the save: the load puts it back)
    assert dcp_state_dicts._split_by_group(ModuleNames(model), optimizer, saved) is not None
    calls = Calls(monkeypatch, "set_optimizer_state_dict")
    dcp_state_dicts.load_optimizer_state_dict(ModuleNames(model), optimizer, saved)
    assert calls.count == 0
    expected = {key: value for key, value in saved["param_groups"][-1].items() if key != "params"}
    empty = optimizer.param_groups[-1]
    assert {key: value for key, value in empty.items() if key != "params"} == expected
    assert list(empty["params"]) == []


@pytest.mark.parametrize("case", [_no_state_and_an_own_load, _patched_load])
def test_optimizer_loads_dcp_would_do_more_for_get_its_call(
    case: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = _trained("adamw")
    saved = case(model, optimizer)
    assert dcp_state_dicts._split_by_group(ModuleNames(model), optimizer, saved) is None
    calls = Calls(monkeypatch, "set_optimizer_state_dict")
    dcp_state_dicts.load_optimizer_state_dict(ModuleNames(model), optimizer, saved)
    assert calls.count == 1


@pytest.mark.parametrize("wrap", ["plain", "compiled"])
def test_parameter_names_are_dcps(wrap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer = _trained("adamw")
    if wrap == "compiled":
        model = torch.compile(model)
    made = dcp_state_dicts.parameter_names(ModuleNames(model), optimizer)
    assert made[0] == "embed.weight"  # (tied: its first name, without "_orig_mod.")
    groups = get_optimizer_state_dict(model, optimizer)["param_groups"]
    assert made == [name for group in groups for name in group["params"]]
    monkeypatch.setattr(dcp_state_dicts, "_dcp_names", lambda model: None)  # DCP's names
    assert dcp_state_dicts.parameter_names(ModuleNames(model), optimizer) == made


def test_an_optimizer_paired_with_a_module_without_its_parameters_is_refused() -> None:
    model, optimizer = _trained("adamw")
    with pytest.raises(CheckpointError, match=r"parameters \[0, 6\] of the optimizer are not"):
        dcp_state_dicts.parameter_names(ModuleNames(nn.Sequential(model.blocks)), optimizer)


def test_a_restore_in_place_skips_dcps_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the manager: a plain module and its optimizer restore bit for bit without DCP's
    load calls; a module with extra state gets DCP's model load (and its extra state back)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    train = functools.partial(_train, model, optimizer)
    train()
    state = {"model": model, "optim": optimizer}
    with CheckpointManager(tmp_path, save_interval=1) as manager:
        manager.save(1, state)
        saved_model, saved_optim = _values(model), copy.deepcopy(optimizer.state_dict())
        train()
        assert not _same_values(model, saved_model)
        model_calls = Calls(monkeypatch, "set_model_state_dict", refuse=True)
        optim_calls = Calls(monkeypatch, "set_optimizer_state_dict", refuse=True)
        manager.restore(1, state)
        assert (model_calls.count, optim_calls.count) == (0, 0)
        assert _same_values(model, saved_model)
        assert _equal(optimizer.state_dict(), saved_optim)
        monkeypatch.undo()

        extra = WithExtraState()
        manager.save(2, {"extra": extra})
        extra.calls = 8
        model_calls = Calls(monkeypatch, "set_model_state_dict")
        manager.restore(2, {"extra": extra})
        assert model_calls.count == 1 and extra.calls == 7


def _train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One step of ``optimizer`` on a batch of 5 random inputs of 4 features."""
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("wrapped", [False, True], ids=["found", "optimizer-state"])
def test_dcps_names_are_worked_out_once_a_save_or_restore_and_anew_for_the_next(
    wrapped: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save or restore of a module and its optimizer tells once whether DCP would only rename
    (a walk over the module tree) and names the optimizer's parameters once (a restore asked
    five and three times); the next save sees a module that changed since (a layer and its
    parameter group added), also through an ``OptimizerState`` the user made once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    train = functools.partial(_train, model, optimizer)
    train()
    optim = OptimizerState(model, optimizer) if wrapped else optimizer
    state = {"model": model, "optim": optim}
    walks = Calls(monkeypatch, "_dcp_names")
    namings = Calls(monkeypatch, "_names_by_position")
    with CheckpointManager(tmp_path, save_interval=1) as manager:
        manager.save(1, state)
        assert (walks.count, namings.count) == (1, 1)
        saved_model, saved_optim = _values(model), copy.deepcopy(optimizer.state_dict())
        train()
        manager.restore(1, state)
        assert (walks.count, namings.count) == (2, 2)
        assert _same_values(model, saved_model)
        assert _equal(optimizer.state_dict(), saved_optim)

        model.append(nn.Linear(3, 2))
        optimizer.add_param_group({"params": list(model[2].parameters()), "lr": 0.02})
        train()
        manager.save(2, state)
        saved_model, saved_optim = _values(model), copy.deepcopy(optimizer.state_dict())
        train()
        manager.restore(2, state)
        assert (walks.count, namings.count) == (4, 4)
        assert _same_values(model, saved_model) and "2.weight" in saved_model
        assert _equal(optimizer.state_dict(), saved_optim)
        assert len(optimizer.state) == 6  # (the new layer's state, restored too)


FSDP2_AND_DDP_LOADS = r"""
import copy
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from ckptmgr import dcp_state_dicts
from ckptmgr.dcp_state_dicts import ModuleNames

try:
    calls = {"set_model_state_dict": 0, "set_optimizer_state_dict": 0}
    for name in calls:
        def counted(*args, _name=name, _real=getattr(dcp_state_dicts, name), **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        setattr(dcp_state_dicts, name, counted)

    def trained(model):
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(3, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        return model, optimizer

    def layers():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))

    sharded = layers()
    mesh = init_device_mesh("cpu", (1,))
    for layer in (sharded[0], sharded[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    # name -> (model, whether DCP's model load is skipped, whether its optimizer load is)
    models = {
        "ddp": (DistributedDataParallel(layers()), True, True),
        "fsdp2": (sharded, False, True),  # (load hooks; DTensor shards)
    }
    for name, (model, skip_model, skip_optim) in models.items():
        model, optimizer = trained(model)
        saved = copy.deepcopy(get_optimizer_state_dict(model, optimizer))
        own = dcp_state_dicts.model_state_dict(ModuleNames(model))
        values = {  # (copies: a one-rank full_tensor() may be the shard itself)
            key: (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()
            for key, value in own.items()
        }
        model(torch.randn(3, 8)).sum().backward()
        optimizer.step()  # (moves the parameters and the optimizer's state on)
        before = dict(calls)
        dcp_state_dicts.load_model_state_dict(ModuleNames(model), own, strict=True)
        dcp_state_dicts.load_optimizer_state_dict(ModuleNames(model), optimizer, saved)
        made = {key: calls[key] - before[key] for key in calls}
        assert made == {"set_model_state_dict": int(not skip_model),
                        "set_optimizer_state_dict": int(not skip_optim)}, (name, made)
        # the module's own tensors were loaded onto themselves: its values moved on
        now = dcp_state_dicts.model_state_dict(ModuleNames(model))
        assert not all(torch.equal(values[k], v.full_tensor() if hasattr(v, "full_tensor") else v)
                       for k, v in now.items()), name
        state = optimizer.state_dict()["state"]
        for index, (key, value) in enumerate(saved["state"].items()):
            for part in ("exp_avg", "exp_avg_sq", "step"):
                got = state[index][part]
                got = got.full_tensor() if hasattr(got, "full_tensor") else got
                want = value[part]
                want = want.full_tensor() if hasattr(want, "full_tensor") else want
                assert torch.equal(got, want), (name, key, part)
    print("ok")
finally:
    dist.destroy_process_group()
"""


def test_ddp_and_fsdp2_loads(tmp_path: Path) -> None:
    """On a real process group of one gloo rank: DDP's module and optimizer load without DCP's
    calls where they may; FSDP2's module (load hooks, DTensor shards) gets DCP's model load,
    its optimizer the split load; each optimizer ends up with the saved state."""
    run_on_one_gloo_rank(tmp_path, "ddp_and_fsdp2_loads", FSDP2_AND_DDP_LOADS)
