"""ckptmgr.dcp_state_dicts: DCP's state dicts of modules and optimizers, made directly where
DCP's API only renames, are DCP's: the same keys in the same order, the very tensors (the same
memory, shape, strides, dtype, type), the same plain values. Where DCP would do more (DDP,
``torch.compile``, activation checkpointing, ``_fqn_modifiers``, a key-renaming hook, a patched
``state_dict``), DCP's functions run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_on_one_gloo_rank
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
)

from ckptmgr import dcp_state_dicts
from ckptmgr.dcp_state_dicts import ModuleNames
from ckptmgr.torch_versions import torch_version

OPTIONS = StateDictOptions(strict=False)

# torch.compile's and the checkpoint wrapper's imports warn about torch.jit (torch 2.13): not ours.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")

_LOW, _HIGH = dcp_state_dicts.READ_AGAINST
read_torch = pytest.mark.skipif(
    not _LOW <= torch_version() <= _HIGH,
    reason="DCP's state-dict API of this torch was not read: its own calls are made "
    "(test_another_torch_gets_dcps_own_calls)",
)
"""For the tests of the dicts made without DCP's calls."""


def differences(made: Any, expected: Any, where: str = "") -> list[str]:
    """Where ``made`` is not what DCP made: keys (in order), types, tensors (their memory,
    shape, strides, dtype, values; a DTensor's local tensor and placements), plain values."""
    if type(made) is not type(expected):
        return [f"{where}: {type(made).__name__} against {type(expected).__name__}"]
    if isinstance(made, dict):
        if list(made) != list(expected):
            return [f"{where}: keys {list(made)} against {list(expected)}"]
        return [d for key in made for d in differences(made[key], expected[key], f"{where}/{key}")]
    if isinstance(made, (list, tuple)):
        if len(made) != len(expected):
            return [f"{where}: {len(made)} items against {len(expected)}"]
        pairs = zip(made, expected, strict=True)
        return [d for i, (a, b) in enumerate(pairs) for d in differences(a, b, f"{where}/{i}")]
    if isinstance(made, torch.Tensor):
        if hasattr(made, "placements"):
            if made.placements != expected.placements:
                return [f"{where}: placements {made.placements} against {expected.placements}"]
            made, expected = made._local_tensor, expected._local_tensor
        if _facts(made) != _facts(expected):
            return [f"{where}: {_facts(made)} against {_facts(expected)}"]
        return [] if torch.equal(made, expected) else [f"{where}: values differ"]
    return [] if made == expected else [f"{where}: {made!r} against {expected!r}"]


def _facts(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Where a tensor's memory is and how it is laid out over it."""
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.shape,
        tensor.stride(),
        tensor.storage_offset(),
        tensor.dtype,
        tensor.requires_grad,
    )


class WithExtraState(nn.Module):
    """A module with extra state (saved under ``_extra_state``) and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)
        self.calls = 7

    def get_extra_state(self) -> Any:
        return {"calls": self.calls}

    def set_extra_state(self, state: Any) -> None:
        self.calls = state["calls"]


class Rich(nn.Module):
    """Tied weights (an embedding and the output layer), buffers (batch norm), a frozen layer,
    extra state, an unused parameter (never gets optimizer state), nested containers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.blocks = nn.ModuleDict(
            {"a": nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6)), "b": WithExtraState()}
        )
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.unused = nn.Parameter(torch.randn(4))
        self.out = nn.Linear(6, 10, bias=False)
        self.out.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.blocks["a"](self.embed(tokens))
        hidden = self.frozen(hidden) * self.blocks["b"].scale[:1]
        return self.out(hidden)


def _trained(kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Rich()
    trained = [p for p in model.parameters() if p.requires_grad and p is not model.unused]
    groups = [
        {"params": trained[:2], "lr": 0.1},
        {"params": [*trained[2:], model.unused], "lr": 0.01, "weight_decay": 0.0},
    ]
    if kind == "adamw":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(groups)
    else:
        optimizer = torch.optim.SGD(groups, momentum=0.9)
    for _ in range(2):
        model(torch.randint(0, 10, (5,))).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _no_dcp_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("get_model_state_dict", "get_optimizer_state_dict", "get_state_dict"):

        def refused(*args: Any, _name: str = name, **kwargs: Any) -> Any:
            raise AssertionError(f"DCP's {_name} was called for a plain module")

        monkeypatch.setattr(dcp_state_dicts, name, refused)


def _expected(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": get_model_state_dict(model, options=OPTIONS),
        "optim": get_optimizer_state_dict(model, optimizer, options=OPTIONS),
        "both": get_state_dict(model, optimizer, options=OPTIONS),
    }


def _made(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": dcp_state_dicts.model_state_dict(ModuleNames(model)),
        "optim": dcp_state_dicts.optimizer_state_dict(ModuleNames(model), optimizer),
        "both": dcp_state_dicts.state_dicts(ModuleNames(model), optimizer),
    }


@read_torch
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_plain_modules_dicts_are_made_without_dcp_and_are_dcps(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = _trained(kind)
    assert model.unused not in optimizer.state  # (a parameter without state)
    expected = _expected(model, optimizer)
    assert "out.weight" in expected["model"] and "blocks.b._extra_state" in expected["model"]
    assert "frozen.weight" in expected["model"]
    _no_dcp_calls(monkeypatch)
    made = _made(model, optimizer)
    assert differences(made, expected) == []


def _compiled(model: nn.Module) -> nn.Module:
    return torch.compile(model)  # (an OptimizedModule: "_orig_mod." in its keys; not compiled)


def _block_compiled(model: nn.Module) -> nn.Module:
    model.blocks["a"] = torch.compile(model.blocks["a"])  # (DCP moves its renamed keys last)
    return model


def _compiled_twice(model: nn.Module) -> nn.Module:
    return torch.compile(_block_compiled(model))


def _with_a_child_named_like_compiles(model: nn.Module) -> nn.Module:
    model.blocks["b"]._orig_mod = nn.Linear(2, 2)  # (not torch.compile's: its name stays)
    return model


def _compiled_with_a_child_named_like_compiles(model: nn.Module) -> nn.Module:
    return torch.compile(_with_a_child_named_like_compiles(model))


@read_torch
@pytest.mark.parametrize(
    "change", [_compiled, _block_compiled, _compiled_twice, _with_a_child_named_like_compiles]
)
def test_compiled_modules_dicts_are_made_without_dcp_and_are_dcps(
    change: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``torch.compile``'s wrappers, around the model or a block of it: DCP only removes their
    ``_orig_mod`` from the names (and moves the keys it renamed to the end); a child of a
    module's own named ``_orig_mod``, in a tree without them, keeps its name."""
    model, optimizer = _trained("adamw")
    model = change(model)
    expected = _expected(model, optimizer)
    assert "blocks.a.0.weight" in expected["model"]
    assert "blocks.a.0.weight" in expected["optim"]["state"]
    _no_dcp_calls(monkeypatch)
    assert differences(_made(model, optimizer), expected) == []


def test_importing_ckptmgr_leaves_dynamo_unimported_and_a_later_compile_is_still_seen() -> None:
    """Importing dynamo (``torch.compile``'s wrapper class) took about a second of every
    ``import ckptmgr``: a CLI command, a torchrun worker, a daemon. It is imported only by a
    program that compiles; ckptmgr, imported before that, still names the compiled module's
    parameters as DCP does (without ``_orig_mod``)."""
    program = """
import sys
import ckptmgr
from ckptmgr import dcp_state_dicts
from ckptmgr.dcp_state_dicts import ModuleNames
assert "torch._dynamo" not in sys.modules, "import ckptmgr imported dynamo"
import torch
model = torch.compile(torch.nn.Linear(2, 2))
names = dcp_state_dicts._dcp_names(model)
assert names is not None and names("_orig_mod.weight") == "weight", names
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def _checkpoint_wrapped(model: nn.Module) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model.blocks["a"] = checkpoint_wrapper(model.blocks["a"])
    return model


def _with_fqn_modifiers(model: nn.Module) -> nn.Module:
    model.blocks["b"]._fqn_modifiers = dict  # (DCP calls it: {} renames nothing)
    return model


def _with_renaming_hook(model: nn.Module) -> nn.Module:
    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local: Any) -> None:
        state_dict[f"{prefix}renamed"] = state_dict.pop(f"{prefix}scale")

    model.blocks["b"].register_state_dict_post_hook(hook)
    return model


def _with_state_dict_set_on_the_object(model: nn.Module) -> nn.Module:
    own = model.state_dict
    model.state_dict = lambda *args, **kwargs: own(*args, **kwargs)  # type: ignore[method-assign]
    return model


@pytest.mark.parametrize(
    "change",
    [
        _checkpoint_wrapped,
        _with_fqn_modifiers,
        _with_state_dict_set_on_the_object,
        _compiled_with_a_child_named_like_compiles,
    ],
)
def test_modules_dcp_renames_get_dcps_own_calls(change: Any) -> None:
    model, optimizer = _trained("adamw")
    model = change(model)
    assert dcp_state_dicts._dcp_names(model) is None
    assert differences(_made(model, optimizer), _expected(model, optimizer)) == []


def test_a_module_with_a_hook_that_renames_a_key_gets_dcps_own_call() -> None:
    """DCP checks every key against the module tree: a key a hook renamed fails there, as it
    does when saved through DCP's call; never saved under a name DCP refuses."""
    model = _with_renaming_hook(_trained("adamw")[0])
    assert dcp_state_dicts._dcp_names(model) is None
    with pytest.raises(AttributeError):
        get_model_state_dict(model, options=OPTIONS)
    with pytest.raises(AttributeError):
        dcp_state_dicts.model_state_dict(ModuleNames(model))


def test_an_optimizer_without_state_is_left_to_dcp(monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP creates an optimizer's state by taking a step: never done here."""
    torch.manual_seed(0)
    model = Rich()
    optimizer = torch.optim.AdamW(model.parameters())
    calls: list[str] = []
    monkeypatch.setattr(
        dcp_state_dicts, "get_optimizer_state_dict", lambda *a, **k: calls.append("dcp") or {}
    )
    dcp_state_dicts.optimizer_state_dict(ModuleNames(model), optimizer)
    assert calls == ["dcp"]


def test_another_torch_gets_dcps_own_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = _trained("adamw")
    for version in (_LOW, _HIGH):
        monkeypatch.setattr(dcp_state_dicts, "torch_version", lambda v=version: v)
        assert dcp_state_dicts._dcp_names(model) is not None
    for version in ((_LOW[0], _LOW[1] - 1), (_HIGH[0], _HIGH[1] + 1), (_HIGH[0] + 1, 0)):
        monkeypatch.setattr(dcp_state_dicts, "torch_version", lambda v=version: v)
        assert dcp_state_dicts._dcp_names(model) is None


FSDP2_AND_DDP = r"""
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from ckptmgr import dcp_state_dicts
from ckptmgr.dcp_state_dicts import ModuleNames
from test_dcp_state_dicts import differences

try:
    def trained(model):
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(3, 8)).sum().backward()
        optimizer.step()
        return model, optimizer

    def layers():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))

    class Holder(nn.Module):  # holds a child under DDP's name for its module
        def __init__(self):
            super().__init__()
            self.module = layers()

        def forward(self, x):
            return self.module(x)

    sharded = layers()
    mesh = init_device_mesh("cpu", (1,))
    for layer in (sharded[0], sharded[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    models = {  # name -> (model, made without DCP's calls)
        "fsdp2": (sharded, True),
        "ddp": (DistributedDataParallel(layers()), True),
        "ddp of compiled": (DistributedDataParallel(torch.compile(layers())), True),
        "ddp of a module's 'module'": (DistributedDataParallel(Holder()), False),
    }
    for name, (model, direct) in models.items():
        model, optimizer = trained(model)
        assert (dcp_state_dicts._dcp_names(model) is not None) == direct, name
        expected = get_state_dict(model, optimizer, options=StateDictOptions(strict=False))
        made = dcp_state_dicts.state_dicts(ModuleNames(model), optimizer)
        found = differences(made, expected)
        assert found == [], (name, found)
        if name == "fsdp2":
            assert type(made[0]["0.weight"]).__name__ == "DTensor"
        elif direct:
            assert "0.weight" in made[0] and "0.weight" in made[1]["state"], (name, list(made[0]))
    print("ok")
finally:
    dist.destroy_process_group()
"""


@read_torch
def test_fsdp2_and_ddp_modules_dicts_are_made_without_dcp_and_are_dcps(tmp_path: Path) -> None:
    """On a real process group of one gloo rank (a new interpreter): FSDP2's dicts (DTensor
    shards) and DDP's (``module.`` taken out of the names, around a compiled model too) are
    made without DCP's calls and are DCP's; DDP around a module that holds a child named
    ``module`` of its own gets DCP's calls."""
    run_on_one_gloo_rank(tmp_path, "fsdp2_and_ddp", FSDP2_AND_DDP)
