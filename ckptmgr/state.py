"""Splitting a user's state into tensors (written by DCP) and plain values (written as JSON).

A state is a dict whose values may be tensors, objects with ``state_dict()``/``load_state_dict()``,
and nested dicts/lists/tuples of those and of plain values. Every leaf gets a path such as
``"model/fc1.weight"`` or ``"optim/state/0/exp_avg"``. A container that holds no tensor is stored
whole as one plain value.

Plain tensors follow DCP's rule: the same path on every rank holds the same (replicated) values
and is written once. Tensors under :class:`~ckptmgr.PerRank` differ between ranks: they are
stored under a rank-private name, ``%rank00003%/<path>``, which no user path can collide with
because ``%`` in keys is escaped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptmgr import objects
from ckptmgr.errors import CheckpointError
from ckptmgr.stateful import PerRank, is_stateful


def join_path(parent: str, key: object) -> str:
    """Append one key to a path, escaping ``%`` and ``/`` inside the key."""
    part = str(key).replace("%", "%25").replace("/", "%2F")
    return f"{parent}/{part}" if parent else part


@dataclass
class FlatState:
    """A state split into tensors by path and JSON-encoded plain values by path."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)


def rank_private_name(path: str, rank: int) -> str:
    """The stored name of a per-rank tensor at ``path`` on ``rank``."""
    return f"%rank{rank:05d}%/{path}"


def flatten(state: Mapping[str, Any], rank: int = 0) -> FlatState:
    """Split ``state`` into tensors (by stored name) and encoded plain values (by path).

    The plain values are encoded copies; the tensors are the caller's own objects.
    """
    if not isinstance(state, Mapping):
        raise CheckpointError(f"state_dict must be a dict, got {type(state).__qualname__}")
    flat = FlatState()
    for key, value in state.items():
        _flatten_value(value, join_path("", key), flat, rank, private=False)
    return flat


def _flatten_value(value: Any, path: str, flat: FlatState, rank: int, private: bool) -> None:
    if isinstance(value, torch.Tensor):
        name = rank_private_name(path, rank) if private else path
        _claim(name, flat)
        flat.tensors[name] = value
        return
    if isinstance(value, PerRank):
        _flatten_value(value.value, path, flat, rank, private=True)
        return
    if is_stateful(value):
        value = value.state_dict()
    if isinstance(value, (dict, list, tuple)) and _contains_tensor(value):
        for key, item in _items(value):
            _flatten_value(item, join_path(path, key), flat, rank, private)
        return
    _claim(path, flat)
    flat.objects[path] = objects.encode(value, path)


def _claim(path: str, flat: FlatState) -> None:
    if path in flat.tensors or path in flat.objects:
        raise CheckpointError(
            f"two entries of the state map to the same path {path!r} "
            "(keys like 3 and '3' in one dict)"
        )


def _items(container: dict | list | tuple) -> Iterable[tuple[object, Any]]:
    return container.items() if isinstance(container, dict) else enumerate(container)


def _contains_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, PerRank):
        return _contains_tensor(value.value)
    if is_stateful(value):
        return _contains_tensor(value.state_dict())
    if isinstance(value, (dict, list, tuple)):
        return any(_contains_tensor(item) for _, item in _items(value))
    return False


@dataclass
class RestorePlan:
    """Where each checkpointed value goes when a state is restored in place."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # Applied after the tensors are loaded: set plain values, then call load_state_dict().
    finishers: list[Callable[[], None]] = field(default_factory=list)

    def finish(self) -> None:
        """Write plain values into their containers and hand state dicts back to their owners."""
        for finisher in self.finishers:
            finisher()


def plan_restore(
    state: Mapping[str, Any],
    saved_tensors: Iterable[str],
    saved_objects: Mapping[str, Any],
    rank: int = 0,
) -> RestorePlan:
    """Match ``state`` against a checkpoint's stored tensor names and plain values.

    Per-rank tensors load this rank's copy, or rank 0's when the checkpoint has none for this
    rank (a job restarted with more ranks, or one process reading a multi-rank checkpoint).
    Raises ``CheckpointError`` naming the first key of ``state`` the checkpoint lacks, and a
    specific error when the checkpoint holds tensors under a path where ``state`` has none (the
    signature of an optimizer whose lazily created state does not exist yet).
    """
    if not isinstance(state, MutableMapping):
        raise CheckpointError(f"state_dict must be a dict, got {type(state).__qualname__}")
    planner = _RestorePlanner(set(saved_tensors), saved_objects, rank)
    for key in list(state):
        planner.visit_child(state, key, join_path("", key), private=False)
    # Finishers were appended in post-order: inner containers first, owners' load_state_dict last.
    return planner.plan


class _RestorePlanner:
    def __init__(
        self, saved_tensors: set[str], saved_objects: Mapping[str, Any], rank: int
    ) -> None:
        self.saved_tensors = saved_tensors
        self.saved_objects = saved_objects
        self.rank = rank
        self.plan = RestorePlan()

    def stored_names(self, path: str, private: bool) -> list[str]:
        """Names ``path`` may be stored under, preferred first."""
        if not private:
            return [path]
        return [rank_private_name(path, self.rank), rank_private_name(path, 0)]

    def visit_child(self, container: Any, key: Any, path: str, private: bool) -> None:
        value = container[key]
        if isinstance(value, torch.Tensor):
            name = next(
                (n for n in self.stored_names(path, private) if n in self.saved_tensors), None
            )
            if name is None:
                raise self._missing(path)
            self.plan.tensors[name] = value
            return
        if isinstance(value, PerRank):
            self.visit_child(value.__dict__, "value", path, private=True)
            return
        if is_stateful(value):
            owner = value
            holder = {"state": owner.state_dict()}
            self._visit_container_or_leaf(holder, "state", path, private)
            self.plan.finishers.append(lambda: owner.load_state_dict(holder["state"]))
            return
        self._visit_container_or_leaf(container, key, path, private)

    def _visit_container_or_leaf(self, container: Any, key: Any, path: str, private: bool) -> None:
        value = container[key]
        if isinstance(value, (dict, list, tuple)) and _contains_tensor(value):
            if isinstance(value, tuple):
                items = list(value)
                for index in range(len(items)):
                    self.visit_child(items, index, join_path(path, index), private)
                self.plan.finishers.append(lambda: _set(container, key, tuple(items)))
            else:
                for child_key in list(_keys(value)):
                    self.visit_child(value, child_key, join_path(path, child_key), private)
            return
        if path in self.saved_objects:
            decoded = objects.decode(self.saved_objects[path])
            self.plan.finishers.append(lambda: _set(container, key, decoded))
            return
        names = self.stored_names(path, private)
        if any(name in self.saved_tensors for name in names):
            raise CheckpointError(
                f"the checkpoint holds a tensor at {path!r} but the state to restore has a "
                f"{type(value).__qualname__} there"
            )
        prefixes = tuple(name + "/" for name in names)
        if any(name.startswith(prefixes) for name in self.saved_tensors):
            raise CheckpointError(
                f"the checkpoint holds tensors under {path!r} but the state to restore has none "
                "there. If this is an optimizer's state_dict(), its state is created lazily: call "
                "ckptmgr.prime_optimizer(optimizer) before restore, or pass the Optimizer object "
                "itself so that ckptmgr primes it"
            )
        raise self._missing(path)

    @staticmethod
    def _missing(path: str) -> CheckpointError:
        return CheckpointError(
            f"key {path!r} of the state to restore is missing from the checkpoint"
        )


def _keys(container: dict | list) -> Iterable[Any]:
    return container.keys() if isinstance(container, dict) else range(len(container))


def _set(container: Any, key: Any, value: Any) -> None:
    container[key] = value


def optimizer_paths_needing_prime(
    state: Mapping[str, Any], saved_tensors: Iterable[str]
) -> list[torch.optim.Optimizer]:
    """Optimizers in ``state`` whose state is empty while the checkpoint has state for them."""
    saved = list(saved_tensors)
    found: list[torch.optim.Optimizer] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.optim.Optimizer):
            prefix = join_path(path, "state") + "/"
            if not value.state and any(name.startswith(prefix) for name in saved):
                found.append(value)
            return
        if isinstance(value, (dict, list, tuple)):
            for key, item in _items(value):
                walk(item, join_path(path, key))

    for key, value in state.items():
        walk(value, join_path("", key))
    return found
