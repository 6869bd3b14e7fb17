"""flatten() and plan_restore() on the values their exact-type fast paths handle, and on the
subclasses and unusual keys that must still take the general path.

Everything is real: real tensors, modules and optimizers; no checkpoint files are needed, the
"checkpoint" is what flatten() returned.
"""

from __future__ import annotations

import copy
import functools
import random
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

import pytest
import torch
from torch import nn

from ckptmgr import CheckpointError, PerRank, StateDict
from ckptmgr import state as state_module
from ckptmgr.module_state import TrainingObjects
from ckptmgr.objects import TAG
from ckptmgr.state import (
    FlatState,
    _RestorePlanner,
    flatten,
    join_path,
    plan_restore,
    rank_private_name,
    split_rank_private,
)


class Shout(str):
    """A str subclass whose str() differs from itself: keys of it go through str()."""

    def __str__(self) -> str:
        return self.upper()


class ReversedItems(dict):
    """A dict subclass whose items() runs backwards: flatten must walk it through items()."""

    def items(self) -> Any:
        return list(super().items())[::-1]


class MyList(list):
    pass


class MyTensor(torch.Tensor):
    pass


def restore(state: dict[str, Any], flat: FlatState, rank: int = 0, objects_rank: int = 0) -> None:
    """Restore ``state`` in place from ``flat`` as CheckpointManager.restore does."""
    plan = plan_restore(state, dict.fromkeys(flat.tensors), flat.objects, rank, objects_rank)
    assert set(plan.tensors) <= set(flat.tensors)
    with torch.no_grad():
        for name, tensor in plan.tensors.items():
            tensor.copy_(flat.tensors[name])
    plan.finish()


def zeroed(state: Any) -> Any:
    """A deep copy of ``state`` with every tensor zeroed and every int replaced by -1."""
    state = copy.deepcopy(state)

    def clear(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            with torch.no_grad():
                value.zero_()
            return value
        if isinstance(value, bool) or not isinstance(value, (int, dict, list, tuple, PerRank)):
            return value
        if isinstance(value, int):
            return -1
        if isinstance(value, PerRank):
            value.value = clear(value.value)
            return value
        if isinstance(value, tuple):
            return type(value)(clear(item) for item in value)
        keys = value.keys() if isinstance(value, dict) else range(len(value))
        for key in list(keys):
            value[key] = clear(value[key])
        return value

    return clear(state)


def test_join_path_escapes_percent_and_slash_and_uses_str_of_other_keys() -> None:
    assert join_path("", "a") == "a"
    assert join_path("x", "exp_avg") == "x/exp_avg"
    assert join_path("x", "a/b") == "x/a%2Fb"
    assert join_path("x", "50%") == "x/50%25"
    assert join_path("x", "%rank00001%/y") == "x/%25rank00001%25%2Fy"
    assert join_path("", "") == ""
    assert join_path("", "/") == "%2F"
    assert join_path("x", 3) == "x/3"
    assert join_path("x", -1) == "x/-1"
    assert join_path("x", True) == "x/True"
    assert join_path("x", 2.5) == "x/2.5"
    assert join_path("x", (1, "a/b")) == "x/(1, 'a%2Fb')"
    assert join_path("x", Shout("a/b")) == "x/A%2FB"
    assert join_path("x", Shout("ab")) == "x/AB"


def test_flatten_paths_and_values_of_plain_nested_containers() -> None:
    t = [torch.randn(2) for _ in range(6)]
    state = {
        "opt": {"p0": {"exp_avg": t[0], "step": 3}, "p/1": {"%": t[1]}},
        "tup": (t[2], 1, [t[3]]),
        "mixed": [1, "s", {"deep": (None, [t[4]])}],
        "lst": [],
        "empty": {},
        "empty_tuple": (),
        "cfg": {"lr": 0.1, "betas": (0.9, 0.99), "name": "adam", "raw": b"\x00"},
        3: t[5],
        "step": 5,
    }
    flat = flatten(state)
    assert list(flat.tensors) == [
        "opt/p0/exp_avg",
        "opt/p%2F1/%25",
        "tup/0",
        "tup/2/0",
        "mixed/2/deep/1/0",
        "3",
    ]
    for name, tensor in zip(flat.tensors, t, strict=True):
        assert flat.tensors[name] is tensor
    assert flat.objects == {
        "opt/p0/step": 3,
        "tup/1": 1,
        "mixed/0": 1,
        "mixed/1": "s",
        "mixed/2/deep/0": None,
        "lst": [],
        "empty": {},
        "empty_tuple": {TAG: "tuple", "items": []},
        "cfg": {
            "lr": 0.1,
            "betas": {TAG: "tuple", "items": [0.9, 0.99]},
            "name": "adam",
            "raw": {TAG: "bytes", "base64": "AA=="},
        },
        "step": 5,
    }


def test_long_containers_are_walked_where_they_hold_tensors_or_per_rank_values() -> None:
    """A long list or dict (its item types told in C first) is stored whole when it holds
    only plain values, and walked where an item is a tensor, or a container or ``PerRank``
    holding one: the odd item first, last, or deep."""
    ints = list(range(40))
    t = torch.randn(2)
    state = {
        "plain": ints,
        "plain_dict": {f"k{i}": i for i in range(40)},
        "tensor_last": [*ints, t],
        "deep_first": [{"x": [t]}, *ints],
        "per_rank": {**{f"k{i}": i for i in range(40)}, "mine": PerRank(7)},
        "tuple": (*ints, t),
    }
    flat = flatten(state, rank=1)
    assert list(flat.tensors) == ["tensor_last/40", "deep_first/0/x/0", "tuple/40"]
    assert flat.objects["plain"] == ints
    assert flat.objects["plain_dict"] == {f"k{i}": i for i in range(40)}
    assert flat.objects["tensor_last/39"] == 39 and flat.objects["per_rank/k39"] == 39
    assert any(name.startswith("per_rank/mine") for name in flat.objects), list(flat.objects)


def test_flatten_of_a_large_plain_state_names_every_leaf() -> None:
    n = 2000
    state = {"opt": {f"p{i}": {"exp_avg": torch.zeros(1), "step": i} for i in range(n)}}
    flat = flatten(state)
    assert list(flat.tensors) == [f"opt/p{i}/exp_avg" for i in range(n)]
    assert flat.objects == {f"opt/p{i}/step": i for i in range(n)}


def test_parameters_and_tensor_subclasses_are_tensor_leaves() -> None:
    param = nn.Parameter(torch.randn(3))
    sub = torch.randn(2).as_subclass(MyTensor)
    state = {"p": param, "nested": {"p": param, "sub": sub}, "list": [sub]}
    flat = flatten(state)
    assert list(flat.tensors) == ["p", "nested/p", "nested/sub", "list/0"]
    assert flat.tensors["p"] is param and flat.tensors["nested/sub"] is sub
    assert type(flat.tensors["nested/p"]) is nn.Parameter
    assert type(flat.tensors["list/0"]) is MyTensor
    target = {
        "p": nn.Parameter(torch.zeros(3)),
        "nested": {"p": nn.Parameter(torch.zeros(3)), "sub": torch.zeros(2).as_subclass(MyTensor)},
        "list": [torch.zeros(2).as_subclass(MyTensor)],
    }
    restore(target, flat)
    assert torch.equal(target["p"], param) and torch.equal(target["nested"]["sub"], sub)
    assert torch.equal(target["list"][0], sub)


def test_subclassed_containers_are_walked_through_their_own_methods() -> None:
    a, b = torch.randn(1), torch.randn(1)
    state = {
        "rev": ReversedItems(x=a, y=b, n=1),
        "od": OrderedDict([("y", b), ("x", a)]),
        "ml": MyList([a, 2]),
        "plain_rev": ReversedItems(u=1, v=2),
    }
    flat = flatten(state)
    assert list(flat.tensors) == ["rev/y", "rev/x", "od/y", "od/x", "ml/0"]
    assert flat.objects == {"rev/n": 1, "ml/1": 2, "plain_rev": {"u": 1, "v": 2}}
    target = zeroed(state)
    restore(target, flat)
    assert type(target["rev"]) is ReversedItems and type(target["ml"]) is MyList
    assert torch.equal(target["rev"]["x"], a) and torch.equal(target["od"]["y"], b)
    assert target["rev"]["n"] == 1 and target["ml"][1] == 2
    assert target["plain_rev"] == {"u": 1, "v": 2}


def test_str_subclass_keys_are_named_by_their_str() -> None:
    t = torch.randn(1)
    flat = flatten({"d": {Shout("a/b"): t, Shout("c"): 1}})
    assert list(flat.tensors) == ["d/A%2FB"]
    assert flat.objects == {"d/C": 1}


@pytest.mark.parametrize(
    ("make", "path"),
    [
        pytest.param(lambda t: {3: t, "3": t}, "3", id="int-then-str-same-tensor"),
        pytest.param(lambda t: {"3": t, 3: torch.ones(1)}, "3", id="str-then-int"),
        pytest.param(lambda t: {"a": {3: t, "3": 1}}, "a/3", id="tensor-then-plain"),
        pytest.param(lambda t: {"a": {0: 1, "0": t}}, "a/0", id="plain-then-tensor"),
        pytest.param(lambda t: {"a": {"0": 1, 0: t, "x": t}}, "a/0", id="nested"),
        pytest.param(lambda t: {"l": [t], "l2": {0: [t], "0": [t]}}, "l2/0/0", id="in-lists"),
        pytest.param(lambda t: {"a": PerRank({1: t, "1": t})}, "%rank00000%/a/1", id="per-rank"),
        pytest.param(lambda t: {"a": {1.0: t, "1.0": t}}, "a/1.0", id="float-key"),
        pytest.param(lambda t: {"": [t], "0": t}, "0", id="top-empty-key"),
        pytest.param(lambda t: {"": {"w": t}, "w": 1}, "w", id="top-empty-key-plain"),
    ],
)
def test_keys_mapping_to_one_path_raise(make: Any, path: str) -> None:
    state = make(torch.randn(1))
    with pytest.raises(CheckpointError, match=f"same path '{path}'"):
        flatten(state)


def test_escaped_keys_never_clash_with_keys_holding_the_escape() -> None:
    t = torch.randn(1)
    flat = flatten({"x": {"a%2Fb": t, "a/b": 1, "%rank00000%": t}, "%": PerRank({"/": t})})
    assert list(flat.tensors) == ["x/a%252Fb", "x/%25rank00000%25", "%rank00000%/%25/%2F"]
    assert flat.objects == {"x/a%2Fb": 1}


def test_per_rank_inside_a_plain_dict_is_stored_under_rank_private_names() -> None:
    seen, w = torch.randn(3), torch.randn(2)
    state = {"a": {"local": PerRank({"seen": seen, "n": 4, "t": (seen, 1)}), "w": w}}
    flat = flatten(state, rank=3)
    assert list(flat.tensors) == [
        "%rank00003%/a/local/seen",
        "%rank00003%/a/local/t/0",
        "a/w",
    ]
    assert flat.objects == {"a/local/n": 4, "a/local/t/1": 1}

    target = zeroed(state)
    restore(target, flat, rank=3, objects_rank=3)
    assert torch.equal(target["a"]["local"].value["seen"], seen)
    assert target["a"]["local"].value["n"] == 4
    assert target["a"]["local"].value["t"][1] == 1
    assert torch.equal(target["a"]["w"], w)

    with pytest.raises(
        CheckpointError,
        match=r"per-rank state 'a/local/seen' has no copy for rank 1 in the "
        r"checkpoint \(copies for ranks \[3\]",
    ):
        restore(zeroed(state), flat, rank=1, objects_rank=1)
    plain_only = {"a": {"local": PerRank({"n": 0})}}
    with pytest.raises(CheckpointError, match=r"plain values of rank 0 only"):
        restore(plain_only, flatten({"a": {"local": PerRank({"n": 4})}}), rank=1, objects_rank=0)
    # A key no rank saved is missing, not a copy of fewer ranks (it was blamed on those)
    with pytest.raises(
        CheckpointError,
        match=r"key 'nope' of the state to restore \(per-rank state\) is missing from the "
        r"checkpoint for rank 3: this rank saved no value of it, and no rank a tensor",
    ):
        restore({"nope": PerRank(torch.zeros(2))}, flat, rank=3, objects_rank=3)


def test_rank_private_names_split_back_into_rank_and_path() -> None:
    for path in ("a/b", "x\ny", "%25/%2F", "a/%rank00001%/b"):
        assert split_rank_private(rank_private_name(path, 12)) == (12, path)
    assert split_rank_private(rank_private_name("w", 123456)) == (123456, "w")
    for name in ("a/%rank00001%/b", "%rank0001%/a", "%rank00001%", "w", "%25rank00001%25/a"):
        assert split_rank_private(name) is None, name


def test_round_trip_of_every_container_kind_restores_in_place() -> None:
    model = nn.Linear(2, 2)
    state = {
        "opt": {f"p{i}": {"exp_avg": torch.randn(2), "step": i} for i in range(5)},
        "tup": (torch.randn(1), 7, (torch.randn(1), "x")),
        "lists": [[torch.randn(1)], [], [1, 2]],
        "empty": {},
        "od": OrderedDict(b=torch.randn(1), a=2),
        "pr": PerRank([torch.randn(1), 3]),
        "sd": StateDict(step=4, t=torch.randn(1)),
        "model": model,
        "cfg": {"lr": 0.5, 2: "two", "k": [1, (2, 3)]},
        "param": nn.Parameter(torch.randn(2)),
    }
    flat = flatten(state)
    target = zeroed(state)
    tuple_before = target["tup"]
    restore(target, flat)
    assert target["tup"] is not tuple_before and type(target["tup"]) is tuple
    assert target["tup"][1] == 7 and target["tup"][2][1] == "x"
    assert torch.equal(target["tup"][2][0], state["tup"][2][0])
    for i in range(5):
        assert torch.equal(target["opt"][f"p{i}"]["exp_avg"], state["opt"][f"p{i}"]["exp_avg"])
        assert target["opt"][f"p{i}"]["step"] == i
    assert target["lists"][2] == [1, 2] and target["lists"][1] == []
    assert torch.equal(target["lists"][0][0], state["lists"][0][0])
    assert target["empty"] == {} and target["od"]["a"] == 2
    assert target["pr"].value[1] == 3 and torch.equal(target["pr"].value[0], state["pr"].value[0])
    assert target["sd"].step == 4 and torch.equal(target["sd"].t, state["sd"].t)
    assert torch.equal(target["model"].weight, model.weight)
    assert target["cfg"] == {"lr": 0.5, 2: "two", "k": [1, (2, 3)]}
    assert torch.equal(target["param"], state["param"])


def test_restore_errors_name_the_path() -> None:
    flat = flatten({"a": {"b": torch.randn(1), "n": 1}, "c": {"d": {"e": torch.randn(1)}}})
    with pytest.raises(CheckpointError, match=r"key 'a/x' of the state to restore is missing"):
        restore({"a": {"b": torch.zeros(1), "n": 0, "x": torch.zeros(1)}}, flat)
    with pytest.raises(CheckpointError, match=r"key 'a/m' of the state to restore is missing"):
        restore({"a": {"b": torch.zeros(1), "m": 0}}, flat)
    with pytest.raises(CheckpointError, match=r"holds a tensor at 'a/b' but .* has a int there"):
        restore({"a": {"b": 0, "n": 0, "z": torch.zeros(1)}}, flat)
    with pytest.raises(CheckpointError, match=r"holds a plain value at 'a/n' but .* a tensor"):
        restore({"a": {"b": torch.zeros(1), "n": torch.zeros(1)}}, flat)
    with pytest.raises(CheckpointError, match=r"holds tensors under 'a' but the state"):
        restore({"a": {"b": 0}}, flat)
    with pytest.raises(CheckpointError, match=r"holds tensors under 'a' but the state"):
        restore({"a": {}}, flat)  # (an optimizer's state_dict() before its first step)
    with pytest.raises(CheckpointError, match=r"holds tensors under 'c/d' but the state"):
        restore({"c": {"d": {}, "q": torch.zeros(1)}}, flat)
    with pytest.raises(CheckpointError, match=r"key 'a%2Fb' of the state to restore is missing"):
        restore({"a/b": torch.zeros(1)}, flat)


class LazyAverage:
    """An average of the weights whose tensor is made at its first update (as an EMA's often
    is): before that, its state dict holds its plain values only."""

    def __init__(self) -> None:
        self.decay = 0.5
        self.shadow: torch.Tensor | None = None

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"decay": self.decay}
        if self.shadow is not None:
            state["shadow"] = self.shadow
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decay = state["decay"]
        self.shadow = state.get("shadow")


def test_state_created_lazily_is_refused_not_left_out() -> None:
    """A state whose tensors the checkpoint holds, but which has only plain values there (made
    before its first update), is refused: restored as a subset, its tensors would be left out
    silently (tried, and found by a review: the average's tensor stayed None)."""
    saved = LazyAverage()
    saved.shadow = torch.randn(4)
    flat = flatten({"ema": saved})
    with pytest.raises(CheckpointError, match=r"holds tensors under 'ema' but the state"):
        restore({"ema": LazyAverage()}, flat)


def test_modules_are_found_inside_any_container() -> None:
    for make in (
        lambda m: {"models": [m]},
        lambda m: {"models": (1, m)},
        lambda m: {"models": {0: {"inner": m}}},
        lambda m: {"wrapped": PerRank(m)},
        lambda m: {"proxy": MappingProxyType({"m": m})},
        lambda m: {"od": OrderedDict(m=m)},
        lambda m: {"ml": MyList([m])},
    ):
        model = nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        assert TrainingObjects(make(model)).module_for(optimizer) is model


def test_optimizer_of_a_module_in_a_list_is_keyed_by_parameter_name() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(1, 2)).sum().backward()
    optimizer.step()
    flat = flatten({"models": (model,), "opt": optimizer})
    assert "opt/state/0.weight/exp_avg" in flat.tensors
    assert "models/0/0.weight" in flat.tensors


def _flattened_one_by_one(state: dict[str, Any]) -> Any:
    """The state as flatten() makes it, each module's and optimizer's state dict made by its
    own DCP call (as a restore's walk does)."""
    flattener = state_module._Flattener(TrainingObjects(state), 0)
    for key, value in state.items():
        flattener.visit(value, key, private=False)
    return flattener.flat


def _stepped(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()


@pytest.mark.parametrize("optimizer_first", [False, True], ids=["model-first", "optim-first"])
def test_a_module_and_its_one_optimizer_get_their_state_dicts_from_one_dcp_call(
    monkeypatch: pytest.MonkeyPatch, optimizer_first: bool
) -> None:
    """Saving a module and its one optimizer (with state) makes both state dicts with one call
    (``dcp_state_dicts.state_dicts``: where DCP's ``get_state_dict`` runs, it maps every
    parameter's names once, not twice); what is flattened is what the two calls one by one
    make: the same names, the very same tensors, the same
    plain values. In the other cases each is made on its own: an optimizer without state, two
    optimizers of one module, an optimizer the user wrapped as ``OptimizerState``, one below the
    state's top level."""
    from ckptmgr import OptimizerState, dcp_state_dicts

    calls: list[str] = []
    for name in ("state_dicts", "model_state_dict", "optimizer_state_dict"):
        real = getattr(dcp_state_dicts, name)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(dcp_state_dicts, name, spy)

    def check(state: dict[str, Any], expected_calls: list[str]) -> None:
        if optimizer_first:
            state = dict(reversed(list(state.items())))
        calls.clear()
        flat = flatten(state)
        assert sorted(calls) == sorted(expected_calls), calls
        reference = _flattened_one_by_one(state)
        assert list(flat.tensors) == list(reference.tensors)
        for name, tensor in flat.tensors.items():
            other = reference.tensors[name]
            assert tensor.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()
            assert torch.equal(tensor, other), name
        assert flat.objects == reference.objects

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    check({"model": model, "optim": optimizer}, ["model_state_dict"])  # no state yet
    _stepped(model, optimizer)
    check({"model": model, "optim": optimizer}, ["state_dicts"])
    check(
        {"model": model, "optim": OptimizerState(model, optimizer)},
        ["model_state_dict", "optimizer_state_dict"],
    )
    check(  # (only an optimizer at the state's top level is looked for)
        {"model": model, "training": {"optim": optimizer}},
        ["model_state_dict", "optimizer_state_dict"],
    )
    first = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    rest = torch.optim.Adam([*model[1].parameters(), *model[2].parameters()], lr=0.1)
    _stepped(model, first)
    _stepped(model, rest)
    check(
        {"model": model, "first": first, "rest": rest},
        ["model_state_dict", "optimizer_state_dict", "optimizer_state_dict"],
    )


def test_ambiguous_optimizer_names_the_module_paths() -> None:
    shared = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(shared.parameters(), lr=0.1)
    state = {
        "a": [nn.Sequential(shared)],
        "b": {3: nn.Sequential(shared), "n": 1},
        "opt": optimizer,
    }
    with pytest.raises(CheckpointError, match=r"several modules in the state \('a/0', 'b/3'\)"):
        flatten(state)


@pytest.mark.parametrize("key", ["optim", "", "o/p", "50%"])
def test_positional_optimizer_state_dict_restores_from_an_optimizer_checkpoint(key: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    flat = flatten({"model": model, key: optimizer})

    model2 = copy.deepcopy(model)
    optimizer2 = torch.optim.Adam(model2.parameters(), lr=0.5)
    model2(torch.randn(4, 3)).sum().backward()
    optimizer2.step()
    target = {"model": model2, key: optimizer2.state_dict()}
    restore(target, flat)
    restored = target[key]
    expected = optimizer.state_dict()
    assert restored["param_groups"][0]["lr"] == 0.01
    assert restored["param_groups"][0]["params"] == expected["param_groups"][0]["params"]
    for index, entry in expected["state"].items():
        assert torch.equal(restored["state"][index]["exp_avg"], entry["exp_avg"])


# --- Batched planning: an exact dict or list of many items is planned in batches -----------------
#
# Every test below compares plan_restore's plan (the stored names, their order, and the very tensor
# objects) or its error with those of planning item by item: with walk_tensors, an oracle written
# here, or with plan_restore itself with batching turned off. Sizes straddle the batch threshold.

BATCH = state_module._BATCH_MIN
SIZES = [BATCH - 1, BATCH, 5 * BATCH]

Plan = list[tuple[str, torch.Tensor]]


def walk_tensors(value: Any, path: str, rank: int = 0, private: bool = False) -> Plan:
    """(stored name, tensor) of each tensor of ``value`` at ``path``, item by item in the order
    plan_restore walks a state of dicts, lists, tuples, ``PerRank``, tensors and plain values."""
    if isinstance(value, torch.Tensor):
        return [(rank_private_name(path, rank) if private else path, value)]
    if isinstance(value, PerRank):
        return walk_tensors(value.value, path, rank, private=True)
    if isinstance(value, StateDict):
        return walk_tensors(value.state_dict(), path, rank, private)
    if isinstance(value, dict):  # items read as plan_restore reads them: by key, or by index
        items: Any = ((key, value[key]) for key in value.keys())
    elif isinstance(value, list):
        items = ((index, value[index]) for index in range(len(value)))
    elif isinstance(value, tuple):
        items = enumerate(value)
    else:
        return []
    found: Plan = []
    for key, item in items:
        found += walk_tensors(item, join_path(path, key), rank, private)
    return found


def expected_plan(state: dict[Any, Any], rank: int = 0) -> Plan:
    """The plan of ``state`` by :func:`walk_tensors`; a name found twice keeps its first place
    and its last tensor, as assigning into a dict does."""
    return list(dict(walk_tensors(state, "", rank)).items())


def planned(
    state: dict[Any, Any],
    saved: Iterable[str],
    objects: dict[str, Any],
    rank: int = 0,
    objects_rank: int | None = None,
) -> Plan:
    """(stored name, tensor) of each tensor plan_restore plans, in its order."""
    return list(plan_restore(state, saved, objects, rank, objects_rank).tensors.items())


def with_decoys(names: Iterable[str]) -> list[str]:
    """``names`` and, for each, the name it would have if its keys were not escaped: a wrong
    name then finds a tensor in the checkpoint, instead of falling back to the right one."""
    names = list(names)
    return names + [name.replace("%2F", "/").replace("%25", "%") for name in names]


def assert_same_plan(got: Plan, expected: Plan) -> None:
    """Same names in the same order, each with the very same tensor object."""
    assert [name for name, _ in got] == [name for name, _ in expected]
    for (name, tensor), (_, want) in zip(got, expected, strict=True):
        assert tensor is want, name


@contextmanager
def batching_off() -> Iterator[None]:
    """plan_restore plans every container item by item while this is active."""
    batch_min = state_module._BATCH_MIN
    state_module._BATCH_MIN = sys.maxsize
    try:
        yield
    finally:
        state_module._BATCH_MIN = batch_min


def outcome(plan: Callable[[], Plan]) -> Plan | str:
    """What ``plan()`` returns, or the type and message of the exception it raises."""
    try:
        return plan()
    except Exception as exc:  # compared with the item-by-item outcome
        return f"{type(exc).__name__}: {exc}"


def assert_same_outcome_as_one_by_one(plan: Callable[[], Plan]) -> Plan | str:
    """``plan()`` gives the same plan, or raises the same error, with batching on and off."""
    batched = outcome(plan)
    with batching_off():
        one_by_one = outcome(plan)
    if isinstance(one_by_one, str):
        assert batched == one_by_one
    else:
        assert not isinstance(batched, str), batched
        assert_same_plan(batched, one_by_one)
    return batched


KEY_STYLES: dict[str, Callable[[int], object]] = {
    "plain": lambda i: f"p{i}",
    "escaped": lambda i: f"optim/state/p{i}/exp_avg" if i % 3 else f"{i}%",
    "int": lambda i: i,
    "negative-int": lambda i: -i,
    "str-and-int": lambda i: i if i % 2 else f"k{i}",
    "str-and-int-escaped": lambda i: i if i % 2 else f"a/{i}%",
    "empty-and-escapes-only": lambda i: "" if i == 0 else "/%" * (i % 3) + "/" * (i // 3),
    "nul-escaped": lambda i: f"a\x00/{i}" if i % 5 == 0 else f"b/{i}",
    "nul-plain": lambda i: f"a\x00{i}",
    "shout": lambda i: Shout(f"s/{i}") if i % 7 == 0 else f"k/{i}",
    "float": lambda i: i + 0.5,
    "bool-then-int": lambda i: bool(i) if i < 2 else i,
}


@pytest.mark.parametrize("parent", [(), ("a/b", 7)], ids=["top", "nested"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("style", KEY_STYLES)
def test_a_dict_of_tensors_plans_each_key_at_its_path_in_order(
    style: str, n: int, parent: tuple[object, ...]
) -> None:
    keys = [KEY_STYLES[style](i) for i in range(n)]
    tensors = [torch.zeros(1) for _ in keys]
    inner: dict[Any, Any] = dict(zip(keys, tensors, strict=True))
    state: dict[Any, Any] = inner
    for key in reversed(parent):
        state = {key: state}
    prefix = ""
    for key in parent:
        prefix = join_path(prefix, key)
    flat = flatten(state)
    got = planned(state, with_decoys(flat.tensors), flat.objects)
    assert [name for name, _ in got] == [join_path(prefix, key) for key in keys]
    assert all(tensor is want for (_, tensor), want in zip(got, tensors, strict=True))


@pytest.mark.parametrize("order", ["as walked", "reversed", "shuffled", "others between"])
def test_the_plan_does_not_depend_on_the_order_of_the_stored_names(order: str) -> None:
    """Runs of tensors are found among the stored names by comparing lists where the names are
    stored in the order the state is walked, else by set lookups: the plan is the same."""
    n = 5 * BATCH
    state = {
        "a": {f"k{i}": torch.zeros(1) for i in range(n)},
        "b": [torch.zeros(1) for _ in range(n)],
        "c": {f"p{i}": {"x": torch.zeros(1), "y": torch.zeros(1)} for i in range(n)},
    }
    flat = flatten(state)
    names = list(flat.tensors)
    if order == "reversed":
        names.reverse()
    elif order == "shuffled":
        random.Random(0).shuffle(names)
    elif order == "others between":
        names = [stored for i, name in enumerate(names) for stored in (name, f"other/{i}")]
    assert_same_plan(planned(state, names, flat.objects), expected_plan(state))


@pytest.mark.parametrize("n", SIZES)
def test_lists_and_tuples_of_tensors_plan_each_index_in_order(n: int) -> None:
    state = {
        "list": [torch.zeros(1) for _ in range(n)],
        "tuple": tuple(torch.zeros(1) for _ in range(n)),
        "nested": [[torch.zeros(1) for _ in range(3)] for _ in range(n)],
        "a/b": [nn.Parameter(torch.zeros(1)) for _ in range(n)],
    }
    flat = flatten(state)
    got = planned(state, flat.tensors, flat.objects)
    assert_same_plan(got, expected_plan(state))
    assert [name for name, _ in got][: 2 * n : n] == ["list/0", "tuple/0"]
    assert got[-1][0] == f"a%2Fb/{n - 1}"


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("inner", [1, 2, 3, BATCH])
def test_dicts_of_tensors_plan_each_tensor_at_its_path_in_order(n: int, inner: int) -> None:
    # Keyed like an optimizer's state: by parameter name, or by position; and below the top.
    names = ["step", "exp_avg", "exp_avg_sq"] + [f"x{i}" for i in range(inner)]
    for outer in (lambda i: f"layers.{i}.weight", lambda i: i):
        state = {
            "optim": {
                "state": {outer(i): {k: torch.zeros(1) for k in names[:inner]} for i in range(n)}
            },
            **{outer(i): {k: torch.zeros(1) for k in names[:inner]} for i in range(n)},
        }
        flat = flatten(state)
        got = planned(state, flat.tensors, flat.objects)
        assert_same_plan(got, expected_plan(state))
        assert got[0][0] == join_path(join_path("optim/state", outer(0)), "step")


@pytest.mark.parametrize("n", SIZES)
def test_dicts_that_do_not_hold_only_tensors_are_planned_item_by_item(n: int) -> None:
    t = torch.zeros(1)
    shapes: list[Callable[[int], Any]] = [
        lambda i: {"a": torch.zeros(1), "step": i},  # a plain value
        lambda i: {} if i == n // 2 else {"a": torch.zeros(1)},  # an empty dict: a plain value
        lambda i: {"a/b" if i == n - 1 else "a": torch.zeros(1)},  # a key to escape
        lambda i: {i: torch.zeros(1)},  # an int key
        lambda i: {"a": torch.zeros(1).as_subclass(MyTensor) if i == 3 else torch.zeros(1)},
        lambda i: OrderedDict(a=torch.zeros(1)) if i == 1 else {"a": torch.zeros(1)},
        lambda i: {"a": [t, torch.zeros(1)]},
    ]
    for shape in shapes:
        state = {"o": {f"p{i}": shape(i) for i in range(n)}}
        flat = flatten(state)
        got = planned(state, with_decoys(flat.tensors), flat.objects)
        assert_same_plan(got, expected_plan(state))


def mixed_items(n: int, seed: int) -> list[Any]:
    """Runs of random tensors of every length around the batch threshold (and ``n``), between
    items of every other kind."""
    torch.manual_seed(seed)
    others: list[Callable[[], Any]] = [
        lambda: 5,
        lambda: None,
        lambda: "s",
        lambda: {"x": torch.randn(1), "n": 2},
        lambda: [torch.randn(1), (torch.randn(1), 3)],
        lambda: PerRank({"seen": torch.randn(1)}),
        lambda: StateDict(step=1, t=torch.randn(1)),
        lambda: torch.randn(1).as_subclass(MyTensor),
        lambda: {f"k{i}": torch.randn(1) for i in range(BATCH)},
    ]
    items: list[Any] = []
    for index, run in enumerate([0, 1, BATCH - 1, BATCH, BATCH + 1, 2 * BATCH, n]):
        items += [torch.randn(1) for _ in range(run)]
        items.append(others[index % len(others)]())
    return items


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("container", ["dict", "list"])
def test_a_mix_of_tensors_and_other_items_plans_in_walk_order(n: int, container: str) -> None:
    def make(seed: int) -> dict[str, Any]:
        items = mixed_items(n, seed)
        if container == "list":
            return {"list": items}
        return {f"i/{i}": item for i, item in enumerate(items)}

    saved, target = make(0), make(1)
    flat = flatten(saved, rank=2)
    got = assert_same_outcome_as_one_by_one(
        functools.partial(planned, target, flat.tensors, flat.objects, rank=2)
    )
    assert isinstance(got, list)
    assert_same_plan(got, expected_plan(target, rank=2))
    restore(target, flat, rank=2, objects_rank=2)
    for (name, tensor), (_, want) in zip(
        expected_plan(target, 2), expected_plan(saved, 2), strict=True
    ):
        assert torch.equal(tensor, want), name


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("rank", [0, 3])
def test_per_rank_containers_plan_rank_private_names(n: int, rank: int) -> None:
    state = {
        "pr": PerRank({f"k/{i}": torch.zeros(1) for i in range(n)}),
        "prl": PerRank([torch.zeros(1) for _ in range(n)]),
        "prd": PerRank({i: {"exp_avg": torch.zeros(1)} for i in range(n)}),
        "shared": {f"k{i}": torch.zeros(1) for i in range(n)},
    }
    flat = flatten(state, rank=rank)
    got = planned(state, flat.tensors, flat.objects, rank=rank)
    assert_same_plan(got, expected_plan(state, rank=rank))
    assert got[0][0] == rank_private_name("pr/k%2F0", rank)
    assert got[-1][0] == f"shared/k{n - 1}"
    with pytest.raises(CheckpointError, match=r"per-rank state 'pr/k%2F0' has no copy for rank 1"):
        planned(state, flat.tensors, flat.objects, rank=1)


def test_a_tensor_subclass_among_tensors_takes_the_general_path_in_its_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = 3 * BATCH
    tensors: list[torch.Tensor] = [torch.zeros(1) for _ in range(n)]
    tensors[BATCH + 5] = torch.zeros(1).as_subclass(MyTensor)
    tensors[2 * BATCH] = nn.Parameter(torch.zeros(1))
    state = {
        "d": {f"k{i}": t for i, t in enumerate(tensors)},
        "l": list(tensors),
        "dicts": {f"p{i}": {"a": t} for i, t in enumerate(tensors)},
    }
    flat = flatten(state)
    visited: list[str] = []
    visit_child = _RestorePlanner.visit_child

    def recorded(self: _RestorePlanner, container: Any, key: Any, path: str, private: bool) -> None:
        visited.append(path)
        visit_child(self, container, key, path, private)

    monkeypatch.setattr(_RestorePlanner, "visit_child", recorded)
    got = planned(state, flat.tensors, flat.objects)
    assert_same_plan(got, expected_plan(state))
    subclassed = [f"d/k{BATCH + 5}", f"l/{BATCH + 5}", f"dicts/p{BATCH + 5}/a"]
    assert set(subclassed) <= set(visited)
    assert type(dict(got)[subclassed[0]]) is MyTensor
    assert type(dict(got)[f"l/{2 * BATCH}"]) is nn.Parameter


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_the_first_missing_tensor_in_walk_order_is_named(n: int, where: str) -> None:
    missing = {"first": 0, "middle": n // 2, "last": n - 1}[where]
    shapes: list[Callable[[], Any]] = [
        lambda: {f"w/{i}": torch.zeros(1) for i in range(n)},
        lambda: {"l": [torch.zeros(1) for _ in range(n)]},
        lambda: {"o": {f"p{i}": {"a": torch.zeros(1)} for i in range(n)}},
        lambda: {"pr": PerRank({f"k{i}": torch.zeros(1) for i in range(n)})},
    ]
    for make in shapes:
        state = make()
        names = [name for name, _ in expected_plan(state)]
        flat = flatten(state)
        # The checkpoint lacks the tensor at `missing` and every one after it.
        saved = names[:missing]
        error = assert_same_outcome_as_one_by_one(
            functools.partial(planned, state, saved, flat.objects)
        )
        assert isinstance(error, str)
        name = names[missing]
        path = split_rank_private(name)[1] if split_rank_private(name) else name
        assert repr(path) in error, error


@pytest.mark.parametrize("n", [BATCH, 5 * BATCH])
def test_a_missing_item_before_a_missing_tensor_raises_its_own_error_first(n: int) -> None:
    keys = [f"k{i}" for i in range(n)]
    for plain_first in (True, False):
        plain, tensor = (n // 4, n // 2) if plain_first else (n // 2, n // 4)
        state: dict[str, Any] = {key: torch.zeros(1) for key in keys}
        state[keys[plain]] = 7
        flat = flatten(state)
        saved = [name for name in flat.tensors if name != keys[tensor]]
        objects = {k: v for k, v in flat.objects.items() if k != keys[plain]}
        error = assert_same_outcome_as_one_by_one(functools.partial(planned, state, saved, objects))
        first = keys[min(plain, tensor)]
        assert isinstance(error, str) and f"key {first!r} of the state" in error, error


@pytest.mark.parametrize("missing", [None, 3, 100])
def test_a_key_whose_path_cannot_be_made_raises_in_its_turn(missing: int | None) -> None:
    # str() of an int of more than 4,300 digits raises ValueError; a missing tensor before it
    # is named first.
    n = 2 * BATCH
    huge = 10**5000
    flat = flatten({i: torch.zeros(1) for i in range(n)})
    state: dict[int, torch.Tensor] = {i: torch.zeros(1) for i in range(n)}
    state[huge] = state.pop(50)
    state.update({i: state.pop(i) for i in range(51, n)})  # the huge key at place 50
    saved = [name for name in flat.tensors if name != str(missing)]
    error = assert_same_outcome_as_one_by_one(functools.partial(planned, state, saved, {}))
    assert isinstance(error, str)
    if missing is not None and missing < 50:
        assert error.startswith(f"CheckpointError: key '{missing}' of the state")
    else:
        assert error.startswith("ValueError: Exceeds the limit")


def test_an_empty_dict_among_dicts_of_tensors_is_a_plain_value() -> None:
    n = 2 * BATCH
    flat = flatten({"o": {f"p{i}": {"a": torch.zeros(1)} for i in range(n)}})
    state = {"o": {f"p{i}": {} if i == 5 else {"a": torch.zeros(1)} for i in range(n)}}
    error = assert_same_outcome_as_one_by_one(
        functools.partial(planned, state, flat.tensors, flat.objects)
    )
    assert isinstance(error, str) and "holds tensors under 'o/p5' but the state" in error, error


def test_a_missing_tensor_in_dicts_of_tensors_is_named_in_walk_order() -> None:
    n = 5 * BATCH
    state = {"opt": {f"p{i}": {"a": torch.zeros(1), "b": torch.zeros(1)} for i in range(n)}}
    flat = flatten(state)
    saved = [name for name in flat.tensors if name not in ("opt/p9/a", "opt/p7/b")]
    with pytest.raises(CheckpointError, match=r"key 'opt/p7/b' of the state to restore is missing"):
        planned(state, saved, flat.objects)


def test_plain_values_under_dicts_of_tensors_are_read_as_item_by_item() -> None:
    # A dict at a path with plain values at or below it may be an optimizer.state_dict(): item
    # by item, those values are read (here: one that cannot be decoded, which raises).
    n = 2 * BATCH
    for parent in ("o", ""):
        inner = {f"p{i}": {"a": torch.zeros(1)} for i in range(n)}
        inner[""] = {"a": torch.zeros(1)}
        state = {parent: inner} if parent else inner
        flat = flatten(state)
        bad = join_path(join_path(parent, "p3"), "param_groups")
        objects = {**flat.objects, bad: {TAG: "bogus"}}
        error = assert_same_outcome_as_one_by_one(
            functools.partial(planned, state, flat.tensors, objects)
        )
        assert error == "CorruptCheckpointError: unknown value tag 'bogus' in checkpoint objects"


def test_keys_mapping_to_one_path_keep_the_first_place_and_the_last_tensor() -> None:
    n = 2 * BATCH
    keys: list[Any] = [f"{i}" for i in range(n)]
    flat = flatten({key: torch.zeros(1) for key in keys})
    state: dict[Any, Any] = {key: torch.zeros(1) for key in keys}
    state[5] = torch.zeros(1)  # stored, like "5", as "5"
    got = planned(state, flat.tensors, flat.objects)
    assert_same_plan(got, expected_plan(state))
    assert [name for name, _ in got] == keys and dict(got)["5"] is state[5]


class Shadowed(dict):
    """A dict whose ``[]`` gives another tensor for each key than its ``values()``."""

    def __init__(self, items: dict[str, torch.Tensor]) -> None:
        super().__init__(items)
        self.shadow = {key: torch.ones(1) for key in items}

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.shadow[key]


class ShadowedList(list):
    """A list whose ``[]`` gives another tensor for each index than iterating it."""

    def __init__(self, items: list[torch.Tensor]) -> None:
        super().__init__(items)
        self.shadow = [torch.ones(1) for _ in items]

    def __getitem__(self, index: Any) -> Any:
        return self.shadow[index]


def test_subclassed_containers_of_many_tensors_are_walked_through_their_own_methods() -> None:
    n = 2 * BATCH
    state = {
        "od": OrderedDict((f"k{i}", torch.zeros(1)) for i in range(n)),
        "rev": ReversedItems((f"k{i}", torch.zeros(1)) for i in range(n)),
        "ml": MyList(torch.zeros(1) for _ in range(n)),
        "shadowed": Shadowed({f"k{i}": torch.zeros(1) for i in range(n)}),
        "shadowed-list": ShadowedList([torch.zeros(1) for _ in range(n)]),
        "in-list": [Shadowed({f"k{i}": torch.zeros(1) for i in range(3)}) for _ in range(n)],
    }
    flat = flatten(state)
    got = planned(state, flat.tensors, flat.objects)
    assert_same_plan(got, expected_plan(state))
    assert dict(got)["shadowed/k0"] is state["shadowed"].shadow["k0"]


class Rebinds:
    """Stateful: its ``state_dict()`` runs ``change`` on the container it is in, as planning
    calls it, before the items after it are planned."""

    def __init__(self, container: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> None:
        self.container = container
        self.change = change

    def state_dict(self) -> dict[str, Any]:
        self.change(self.container)
        return {"n": 1}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        del state_dict


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda d: d.__setitem__("k10", torch.ones(1)), id="new-tensor"),
        pytest.param(lambda d: d.__setitem__("k10", 3), id="tensor-to-int"),
        pytest.param(lambda d: d.__setitem__("k10", [torch.ones(1)]), id="tensor-to-list"),
        pytest.param(lambda d: d.pop("k10"), id="deleted"),
        pytest.param(lambda d: d.__setitem__("k0", torch.ones(1)), id="earlier-item"),
    ],
)
def test_items_changed_by_an_earlier_items_planning_are_planned_as_they_are_then(
    change: Callable[[dict[str, Any]], None],
) -> None:
    n = 3 * BATCH
    checkpoint: dict[str, Any] = {f"k{i}": torch.zeros(1) for i in range(n)}
    checkpoint["k1"] = StateDict(n=1)
    flat = flatten(checkpoint)

    def plan() -> list[tuple[str, float]] | str:
        """(name, value) of each tensor planned for a new state (zeros; changed ones hold
        ones), or the error."""
        state: dict[str, Any] = {f"k{i}": torch.zeros(1) for i in range(n)}
        state["k1"] = Rebinds(state, change)
        got = outcome(functools.partial(planned, state, flat.tensors, flat.objects))
        return got if isinstance(got, str) else [(name, float(t.sum())) for name, t in got]

    batched = plan()
    with batching_off():
        assert batched == plan()
    if not isinstance(batched, str):
        assert [name for name, _ in batched] == [f"k{i}" for i in range(n) if i != 1]


def test_large_containers_of_tensors_are_planned_without_a_call_per_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Guards that the tests above exercise the batches: plan_tensor plans one tensor at a time.
    n = 2 * BATCH
    state = {
        "d": {f"k/{i}": torch.zeros(1) for i in range(n)},
        "l": [torch.zeros(1) for _ in range(n)],
        "dicts": {i: {"a": torch.zeros(1), "b": torch.zeros(1)} for i in range(n)},
        "pr": PerRank({f"k{i}": torch.zeros(1) for i in range(n)}),
        "mixed": {f"k{i}": 1 if i == n // 2 else torch.zeros(1) for i in range(3 * n)},
    }
    flat = flatten(state)
    calls: list[str] = []
    plan_tensor = _RestorePlanner.plan_tensor

    def counted(self: _RestorePlanner, tensor: torch.Tensor, path: str, private: bool) -> None:
        calls.append(path)
        plan_tensor(self, tensor, path, private)

    monkeypatch.setattr(_RestorePlanner, "plan_tensor", counted)
    got = planned(state, flat.tensors, flat.objects)
    assert_same_plan(got, expected_plan(state))
    assert calls == []


@pytest.mark.parametrize("positional", [False, True], ids=["optimizer", "optimizer-state-dict"])
def test_an_optimizer_with_many_parameters_restores_its_state(positional: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(BATCH)))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 2)).sum().backward()
    optimizer.step()
    flat = flatten({"model": model, "optim": optimizer})
    assert sum(name.startswith("optim/state/") for name in flat.tensors) == 6 * BATCH

    model2 = copy.deepcopy(model)
    optimizer2 = torch.optim.Adam(model2.parameters(), lr=0.5)
    if positional:
        model2(torch.randn(3, 2)).sum().backward()
        optimizer2.step()
    target = {"model": model2, "optim": optimizer2.state_dict() if positional else optimizer2}
    restore(target, flat)
    restored = target["optim"] if positional else optimizer2.state_dict()
    expected = optimizer.state_dict()
    assert restored["param_groups"][0]["lr"] == 0.01
    assert len(restored["state"]) == 2 * BATCH
    for index, entry in expected["state"].items():
        for key, value in entry.items():
            assert torch.equal(restored["state"][index][key], value), (index, key)


# --- Batched flatten: an exact dict or list of many tensors is stored at once -------------------
def flattened(state: Any, rank: int = 0) -> Plan:
    """(stored name, tensor) of each tensor flatten() stores, in its order; its plain values
    must be the same with batching on and off too (checked by the caller's comparison)."""
    flat = flatten(state, rank)
    return [
        *flat.tensors.items(),
        *(("plain:" + path, value) for path, value in flat.objects.items()),
    ]


def assert_same_flat_as_one_by_one(state: Any, rank: int = 0) -> Plan | str:
    """flatten() stores the same (or raises the same) with batching on and off."""
    batched = outcome(lambda: flattened(state, rank))
    with batching_off():
        one_by_one = outcome(lambda: flattened(state, rank))
    if isinstance(one_by_one, str):
        assert batched == one_by_one
    else:
        assert not isinstance(batched, str), batched
        assert [name for name, _ in batched] == [name for name, _ in one_by_one]
        for (name, value), (_, want) in zip(batched, one_by_one, strict=True):
            assert value is want or (name.startswith("plain:") and value == want), name
    return batched


@pytest.mark.parametrize("parent", [(), ("a/b", 7)], ids=["top", "nested"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("style", KEY_STYLES)
def test_flatten_stores_a_dict_of_tensors_at_each_keys_path_in_order(
    style: str, n: int, parent: tuple[object, ...]
) -> None:
    make_key = KEY_STYLES[style]
    container = {make_key(i): torch.full((1,), float(i)) for i in range(n)}
    state: dict[Any, Any] = {"before": torch.ones(1), "plain": 3}
    inner: dict[Any, Any] = state
    for key in parent:
        inner[key] = inner = {}
    inner["x"] = container
    state["after"] = torch.zeros(1)
    got = assert_same_flat_as_one_by_one(state)
    assert not isinstance(got, str), got
    assert_same_plan(got[:-1], expected_plan(state))
    assert got[-1] == ("plain:plain", 3)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("rank", [0, 3])
def test_flatten_stores_lists_and_per_rank_containers_of_tensors(n: int, rank: int) -> None:
    tensors = [torch.full((1,), float(i)) for i in range(n)]
    state = {
        "list": list(tensors),
        "private": PerRank({f"k/{i}": t for i, t in enumerate(tensors)}),
        "private_list": PerRank(list(tensors)),
    }
    got = assert_same_flat_as_one_by_one(state, rank)
    assert not isinstance(got, str)
    assert_same_plan(got, expected_plan(state, rank))


@pytest.mark.parametrize("where", [0, 40, BATCH * 2 - 1])
def test_flatten_of_many_tensors_under_keys_of_one_path_raises_as_one_by_one(where: int) -> None:
    """3 and "3" in one dict of many tensors: the same error as item by item, nothing kept."""
    container: dict[Any, torch.Tensor] = {i: torch.ones(1) for i in range(BATCH * 2)}
    container[str(where)] = torch.zeros(1)
    got = assert_same_flat_as_one_by_one({"big": container})
    assert got == f"CheckpointError: {_collision_message(f'big/{where}')}"


def _collision_message(path: str) -> str:
    return (
        f"two entries of the state map to the same path {path!r} (keys like 3 and '3' in one "
        "dict, or at the top of the state a key '' whose items' paths are those of top keys)"
    )


@pytest.mark.parametrize("n", SIZES)
def test_flatten_of_tensors_with_other_items_or_subclasses_stores_them_one_by_one(n: int) -> None:
    tensors = {f"t{i}": torch.full((1,), float(i)) for i in range(n)}
    for odd in ({"plain": 1}, {"sub": torch.ones(2).as_subclass(MyTensor)}, {"none": None}):
        state = {"x": {**tensors, **odd}, "y": [*tensors.values(), *odd.values()]}
        assert_same_flat_as_one_by_one(state)


def tensors_added_one_by_one(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths flatten() stores a tensor at one by one from now on (a batch adds none)."""
    calls: list[str] = []
    real = state_module._Flattener._add_tensor

    def counting(self: Any, tensor: torch.Tensor, path: str, private: bool) -> None:
        calls.append(path)
        real(self, tensor, path, private)

    monkeypatch.setattr(state_module._Flattener, "_add_tensor", counting)
    return calls


def test_a_large_flat_state_is_flattened_without_a_call_per_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = tensors_added_one_by_one(monkeypatch)
    flat_state = {f"optim/state/p{i}/exp_avg": torch.ones(1) for i in range(5 * BATCH)}
    assert len(flatten(flat_state).tensors) == 5 * BATCH
    state = {  # (a container that mixes tensors with other items stores them one by one)
        "model": {f"layer{i}.weight": torch.ones(1) for i in range(5 * BATCH)},
        "buffers": [torch.ones(1) for _ in range(5 * BATCH)],
    }
    flat = flatten(state)
    assert len(flat.tensors) == 10 * BATCH
    assert calls == []


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("inner", [1, 3])
@pytest.mark.parametrize("style", ["plain", "escaped", "int", "str-and-int-escaped", "float"])
def test_flatten_stores_dicts_of_tensor_dicts_at_each_path_in_order(
    style: str, inner: int, n: int
) -> None:
    """An optimizer's state: per parameter, a dict of a few tensors."""
    make_key = KEY_STYLES[style]
    names = ["step", "exp_avg", "exp_avg_sq"][:inner]
    container = {
        make_key(i): {name: torch.full((1,), float(i)) for name in names} for i in range(n)
    }
    for state in ({"optim": {"state": container}}, {"l": list(container.values())}, container):
        got = assert_same_flat_as_one_by_one(state)
        assert not isinstance(got, str), got
        assert_same_plan(got, expected_plan(state))


@pytest.mark.parametrize(
    "odd",
    [
        "an empty dict",
        "a plain value inside",
        "a key to escape inside",
        "an int key inside",
        "a subclass inside",
        "top-level key ''",
        "keys 3 and '3'",
        "per-rank",
    ],
)
def test_flatten_of_dicts_of_tensor_dicts_with_one_odd_one_is_as_one_by_one(odd: str) -> None:
    container: dict[Any, Any] = {
        i: {"exp_avg": torch.full((1,), float(i)), "exp_avg_sq": torch.ones(1)}
        for i in range(2 * BATCH)
    }
    middle = container[BATCH]
    state: dict[Any, Any] = {"state": container}
    if odd == "an empty dict":
        container[BATCH] = {}
    elif odd == "a plain value inside":
        middle["step"] = 3
    elif odd == "a key to escape inside":
        middle["a/b"] = torch.ones(1)
    elif odd == "an int key inside":
        middle[0] = torch.ones(1)
    elif odd == "a subclass inside":
        middle["sub"] = torch.ones(1).as_subclass(MyTensor)
    elif odd == "top-level key ''":
        state = {str(key): value for key, value in container.items()}
        state[""] = state.pop(str(BATCH))
    elif odd == "keys 3 and '3'":
        container["3"] = {"exp_avg": torch.zeros(1)}
    else:
        state = {"state": PerRank(container)}
    got = assert_same_flat_as_one_by_one(state, rank=2)
    if odd == "keys 3 and '3'":
        assert got == f"CheckpointError: {_collision_message('state/3/exp_avg')}"
    else:
        assert not isinstance(got, str), got


def test_an_optimizer_like_state_is_flattened_without_a_call_per_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = tensors_added_one_by_one(monkeypatch)
    state = {
        "optim": {
            "state": {
                i: {"exp_avg": torch.ones(1), "exp_avg_sq": torch.ones(1)} for i in range(200)
            }
        }
    }
    flat = flatten(state)
    assert list(flat.tensors)[:2] == ["optim/state/0/exp_avg", "optim/state/0/exp_avg_sq"]
    assert len(flat.tensors) == 400 and calls == []
