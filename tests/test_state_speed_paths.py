"""flatten() and plan_restore() on the values their exact-type fast paths handle, and on the
subclasses and unusual keys that must still take the general path.

Everything is real: real tensors, modules and optimizers; no checkpoint files are needed, the
"checkpoint" is what flatten() returned.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from types import MappingProxyType
from typing import Any

import pytest
import torch
from torch import nn

from ckptmgr import CheckpointError, PerRank, StateDict
from ckptmgr.module_state import TrainingObjects
from ckptmgr.objects import TAG
from ckptmgr.state import (
    FlatState,
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
    with pytest.raises(CheckpointError, match=r"holds tensors under 'a' but the state"):
        restore({"a": {"b": 0}}, flat)
    with pytest.raises(CheckpointError, match=r"holds tensors under 'c/d' but the state"):
        restore({"c": {"d": {}, "q": torch.zeros(1)}}, flat)
    with pytest.raises(CheckpointError, match=r"key 'a%2Fb' of the state to restore is missing"):
        restore({"a/b": torch.zeros(1)}, flat)


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
