"""Splitting a user's state into tensors (written by DCP) and plain values (written as JSON).

A state is a dict whose values may be tensors, objects with ``state_dict()``/``load_state_dict()``,
and nested dicts/lists/tuples of those and of plain values. Every leaf gets a path such as
``"model/fc1.weight"`` or ``"optim/state/fc1.weight/exp_avg"``. A container that holds no tensor
(and no object with a state dict) is stored whole as one plain value.

Modules and optimizers are saved through DCP's state-dict API (see :mod:`ckptmgr.module_state`):
their keys are parameter names, and an FSDP2 or tensor-parallel model contributes DTensors.

Plain tensors follow DCP's rule: the same path on every rank holds the same (replicated) values
and is written once. Tensors under :class:`~ckptmgr.PerRank` differ between ranks: they are
stored under a rank-private name, ``%rank00003%/<path>``, which no user path can collide with
because ``%`` in keys is escaped.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Collection, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch

from ckptmgr import objects
from ckptmgr.errors import CheckpointError
from ckptmgr.module_state import TrainingObjects
from ckptmgr.stateful import PerRank, is_stateful
from ckptmgr.tensor_table import TensorEntry

try:
    from torch.distributed.tensor import DTensor

    _DTENSOR_TYPES: frozenset[type] = frozenset({DTensor})
except ImportError:  # pragma: no cover - torch without DTensor
    _DTENSOR_TYPES = frozenset()

_PRIVATE = re.compile(r"%rank(\d{5,})%/(.*)", re.DOTALL)


# Exact types (not subclasses) that the walks below handle without the general checks: a
# tensor, parameter or DTensor is a tensor leaf; a plain scalar is neither a module, an
# optimizer, a ``PerRank`` nor stateful, so it is a plain leaf. Subclasses go through the
# general path.
_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter} | _DTENSOR_TYPES)
_SCALAR_TYPES = frozenset({type(None), bool, int, float, str, bytes})
_CONTAINER_TYPES = frozenset({dict, list, tuple})
_LONG_CONTAINER = 16
"""An exact container of at least this many items has its items' types collected in C first
(by :func:`_needs_walk`)."""

# plan_restore plans an exact dict or list of at least this many items in batches where it can:
# all its items if all are tensors, or all dicts of tensors only, else each run of at least this
# many tensors. For fewer, the setup costs more than it saves (measured: about 40 tensors).
_BATCH_MIN = 64
# A run of at least _BATCH_MIN ones in a container's flags (1 for each exact tensor item).
_TENSOR_RUN = re.compile(b"\x01{%d,}" % _BATCH_MIN)
# Keys whose str() runs no code and cannot fail (but for a huge int): their paths can be joined
# all at once.
_BATCH_KEY_TYPES = frozenset({str, int})
# Joins the keys to escape them all at once; keys that hold it are joined one by one instead.
_KEY_SEP = "\x00"


def join_path(parent: str, key: object) -> str:
    """Append one key to a path, escaping ``%`` and ``/`` inside the key."""
    if type(key) is str and "%" not in key and "/" not in key:
        part = key  # nothing to escape (the common case)
    else:
        part = str(key).replace("%", "%25").replace("/", "%2F")
    return f"{parent}/{part}" if parent else part


def _join_paths(parent: str, keys: Sequence[object]) -> list[str] | None:
    """``[join_path(parent, key) for key in keys]``, computed for all the keys at once: with one
    ``str.replace`` of each escape on all of them joined by ``_KEY_SEP``, where any needs one.
    None (join them one by one) if a key is not an exact ``str`` or ``int``, or holds
    ``_KEY_SEP``."""
    prefix = f"{parent}/" if parent else ""
    kinds = set(map(type, keys))
    try:
        if kinds == {int}:
            return [f"{prefix}{key}" for key in keys]  # no "%" or "/" in a number
        if not kinds <= _BATCH_KEY_TYPES:
            return None
        text = _KEY_SEP.join(keys if kinds == {str} else map(str, keys))
    except ValueError:  # an int too long to print: join_path raises it when its turn comes
        return None
    if kinds == {str} and "%" not in text and "/" not in text:  # the common case
        return [prefix + key for key in keys] if prefix else list(keys)
    parts = text.replace("%", "%25").replace("/", "%2F").split(_KEY_SEP)
    if len(parts) != len(keys):  # a key holds the separator (or there are no keys)
        return None
    return [prefix + part for part in parts] if prefix else parts


def _unescaped_strs(keys: list[Any]) -> bool:
    """True if every key is an exact ``str`` that :func:`join_path` appends as it is."""
    if set(map(type, keys)) != {str}:
        return False
    text = "".join(keys)
    return "%" not in text and "/" not in text


def _exact_tensors(values: Iterable[Any]) -> bool:
    """True if the type of every value is exactly one of ``_TENSOR_TYPES``."""
    return set(map(type, values)) <= _TENSOR_TYPES


@dataclass
class FlatState:
    """A state split into tensors by path and JSON-encoded plain values by path."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)


def rank_private_name(path: str, rank: int) -> str:
    """The stored name of a per-rank tensor at ``path`` on ``rank``."""
    return f"%rank{rank:05d}%/{path}"


def is_rank_private(name: str) -> bool:
    """True for a stored name made by :func:`rank_private_name` (no user path looks like one,
    since ``%`` in keys is escaped)."""
    return _PRIVATE.fullmatch(name) is not None


def split_rank_private(name: str) -> tuple[int, str] | None:
    """(rank, path) of a stored name made by :func:`rank_private_name`; None for any other."""
    match = _PRIVATE.fullmatch(name)
    return None if match is None else (int(match.group(1)), match.group(2))


def flatten(state: Mapping[str, Any], rank: int = 0) -> FlatState:
    """Split ``state`` into tensors (by stored name) and encoded plain values (by path).

    The plain values are encoded copies; the tensors are the caller's own objects (for modules
    and optimizers, the tensors DCP's state-dict API returns: their parameters and state).
    """
    if not isinstance(state, Mapping):
        raise CheckpointError(f"state_dict must be a dict, got {type(state).__qualname__}")
    flattener = _Flattener(TrainingObjects(state, saving=True), rank)
    try:
        if type(state) is dict and flattener.add_tensors(state, "", private=False):
            return flattener.flat
        for key, value in state.items():
            if type(value) in _TENSOR_TYPES:  # the most common item, without a call of visit()
                flattener._add_tensor(value, join_path("", key), private=False)
            else:
                flattener.visit(value, join_path("", key), private=False)
    except RecursionError:  # (no look for cycles on every save: the walk's own depth limit)
        raise CheckpointError(
            "the state cannot be saved: a list or dict in it holds itself, or it is nested "
            f"deeper than Python's recursion limit ({sys.getrecursionlimit()})"
        ) from None
    return flattener.flat


class _Flattener:
    def __init__(self, training: TrainingObjects, rank: int) -> None:
        self.training = training
        self.rank = rank
        self.flat = FlatState()

    def visit(self, value: Any, path: str, private: bool) -> None:
        """Add ``value`` at ``path``: as tensors, walked item by item, or as one plain value."""
        kind = type(value)
        if kind in _SCALAR_TYPES:  # not a module, an optimizer, a PerRank nor stateful
            self._add_plain(value, path)
            return
        if kind not in _CONTAINER_TYPES:  # exact dicts, lists and tuples fail all these checks
            if isinstance(value, torch.Tensor):
                self._add_tensor(value, path, private)
                return
            if isinstance(value, PerRank):
                self.visit(value.value, path, private=True)
                return
            value = self.training.adapt(value)
            if is_stateful(value):
                owner, value = value, value.state_dict()
                if isinstance(value, torch.Tensor):
                    raise CheckpointError(
                        f"cannot checkpoint {path!r}: its state_dict() "
                        f"({type(owner).__qualname__}) returned a tensor, not a dict; return "
                        "one that holds the tensor ({'value': tensor})"
                    )
            if not isinstance(value, (dict, list, tuple)):
                self._add_plain(value, path)
                return
        if (kind is dict or kind is list) and self.add_tensors(value, path, private):
            return
        if not _needs_walk(value):
            self._add_plain(value, path)
            return
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            item_path = join_path(path, key)
            if type(item) in _TENSOR_TYPES:  # the most common item, without a call of visit()
                self._add_tensor(item, item_path, private)
            else:
                self.visit(item, item_path, private)

    def add_tensors(self, items: dict | list, path: str, private: bool) -> bool:
        """Store the tensors of ``items``, an exact dict or list at ``path``, at once when there
        are many items and all are exact tensors (a model's or a flat state dict), or all are
        non-empty exact dicts of exact tensors under keys with nothing to escape (an optimizer's
        state of each parameter): as :meth:`visit` would one by one. False, with nothing stored,
        when they do not qualify, or when a name collides (the items one by one then raise for
        the first)."""
        if len(items) < _BATCH_MIN:
            return False
        values = list(items.values()) if type(items) is dict else items
        kinds = set(map(type, values))
        nested = kinds == {dict}
        if nested:
            if not all(values):  # an empty dict is a plain value
                return False
            tensors = list(chain.from_iterable(map(dict.values, values)))
            inner_keys = list(chain.from_iterable(values))
            if not (_exact_tensors(tensors) and _unescaped_strs(inner_keys)):
                return False
        elif kinds <= _TENSOR_TYPES:
            tensors = values
        else:
            return False
        names = _join_paths(path, list(items) if type(items) is dict else range(len(items)))
        if names is None or (nested and "" in names):  # ("" + "/key" is not the key's path)
            return False
        if nested:
            parents = zip(names, values, strict=True)
            names = [f"{name}/{key}" for name, child in parents for key in child]
        if private:
            prefix = rank_private_name("", self.rank)
            names = [prefix + name for name in names]
        return self._add_all(names, tensors)

    def _add_all(self, names: list[str], tensors: list[torch.Tensor]) -> bool:
        """Store ``tensors`` under ``names`` (in order), unless a name is taken already or
        given twice: then False, with nothing stored."""
        stored = self.flat.tensors
        if not (stored.keys().isdisjoint(names) and self.flat.objects.keys().isdisjoint(names)):
            return False
        count = len(stored)
        stored.update(zip(names, tensors, strict=True))
        if len(stored) != count + len(names):  # two keys of one path (3 and "3")
            for name in names:
                stored.pop(name, None)
            return False
        return True

    def _add_tensor(self, tensor: torch.Tensor, path: str, private: bool) -> None:
        """Store ``tensor`` under ``path`` (its rank-private name under ``PerRank``)."""
        name = rank_private_name(path, self.rank) if private else path
        if name in self.flat.tensors or name in self.flat.objects:
            raise _collision(name)
        self.flat.tensors[name] = tensor

    def _add_plain(self, value: Any, path: str) -> None:
        """Store ``value`` whole, JSON-encoded, at ``path``."""
        if path in self.flat.tensors or path in self.flat.objects:
            raise _collision(path)
        self.flat.objects[path] = objects.encode(value, path)


def _collision(path: str) -> CheckpointError:
    """The error for a second entry of the state at ``path``."""
    return CheckpointError(
        f"two entries of the state map to the same path {path!r} (keys like 3 and '3' in one "
        "dict, or at the top of the state a key '' whose items' paths are those of top keys)"
    )


def _items(container: dict | list | tuple) -> Iterable[tuple[object, Any]]:
    return container.items() if isinstance(container, dict) else enumerate(container)


def _needs_walk(value: Any) -> bool:
    """True if ``value`` holds a tensor, a ``PerRank`` or an object with a state dict, so that
    its items need paths of their own (otherwise it is stored whole as one plain value)."""
    kind = type(value)
    items: Collection[Any]
    if kind is dict:
        items = value.values()
    elif kind is list or kind is tuple:
        items = value
    elif isinstance(value, (torch.Tensor, PerRank)) or is_stateful(value):
        return True
    elif isinstance(value, (dict, list, tuple)):
        return any(_needs_walk(item) for _, item in _items(value))
    else:
        return False
    if len(items) >= _LONG_CONTAINER:  # (a list of a million indices: its item types in C)
        kinds = set(map(type, items))
        if kinds <= _SCALAR_TYPES:
            return False
        if not kinds.isdisjoint(_TENSOR_TYPES):
            return True
    for item in items:  # any(_needs_walk(item) for item in items), the common leaves inlined
        kind = type(item)
        if kind in _SCALAR_TYPES:
            continue
        if kind in _TENSOR_TYPES or _needs_walk(item):
            return True
    return False


@dataclass
class RestorePlan:
    """Where each checkpointed value goes when a state is restored in place."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # Applied after the tensors are loaded: set plain values, then call load_state_dict().
    finishers: list[Callable[[], None]] = field(default_factory=list)
    # Undo what planning changed (optimizer state created to load into), newest first.
    undo: list[Callable[[], None]] = field(default_factory=list)

    def finish(self) -> None:
        """Write plain values into their containers and hand state dicts back to their owners."""
        for finisher in self.finishers:
            finisher()

    def abandon(self) -> None:
        """Undo what planning changed, for a restore that does not go on."""
        while self.undo:
            self.undo.pop()()


def plan_restore(
    state: Mapping[str, Any],
    saved_tensors: Iterable[str],
    saved_objects: Mapping[str, Any],
    rank: int = 0,
    objects_rank: int | None = None,
    saved_entries: Mapping[str, TensorEntry] | None = None,
    object_ranks: Sequence[int] = (),
) -> RestorePlan:
    """Match ``state`` against a checkpoint's stored tensor names and plain values.

    ``saved_entries``: the stored tensors' shapes and dtypes by name (the record's tensor
    table), with which an optimizer's missing state is made from what the checkpoint holds
    rather than by a step (:meth:`ckptmgr.module_state.OptimizerState.restore_template`).
    ``object_ranks``: the ranks whose plain values the checkpoint holds (named in the error
    for a per-rank value this rank has no copy of).

    ``saved_objects`` are the plain values of ``objects_rank`` (default: ``rank``); a rank whose
    own file is missing (a job restarted with more ranks) reads rank 0's. Plain values are
    restored from it, but per-rank state (under :class:`~ckptmgr.PerRank`) only from this rank's
    own copy: a missing copy raises ``CheckpointError``. Raises ``CheckpointError`` naming the
    first key of ``state`` the checkpoint lacks, and a specific error when the checkpoint holds
    tensors under a path where ``state`` has none (the signature of an optimizer state dict whose
    lazily created state does not exist yet).

    Modules and optimizers are restored through DCP's state-dict API. An optimizer's missing state
    is created first; a plain ``optimizer.state_dict()`` (keyed by position) restores from a
    checkpoint of an ``Optimizer`` object (keyed by parameter name) too.
    """
    if not isinstance(state, MutableMapping):
        raise CheckpointError(f"state_dict must be a dict, got {type(state).__qualname__}")
    objects_rank = rank if objects_rank is None else objects_rank
    saved_names = saved_tensors if type(saved_tensors) is list else list(saved_tensors)
    planner = _RestorePlanner(
        TrainingObjects(state), saved_names, saved_objects, rank, objects_rank, saved_entries
    )
    planner.object_ranks = list(object_ranks)
    try:
        if type(state) is dict:
            planner.plan_items(state, "", private=False)
        else:
            for key in list(state):
                planner.visit_child(state, key, join_path("", key), private=False)
    except BaseException:
        planner.plan.abandon()
        raise
    # Finishers were appended in post-order: inner containers first, owners' load_state_dict last.
    return planner.plan


def _ancestors(names: Iterable[str]) -> set[str]:
    """Every stored name and every path above one (``a/b/c`` -> ``a/b/c``, ``a/b``, ``a``)."""
    found: set[str] = set()
    for name in names:
        while name and name not in found:
            found.add(name)
            name = name.rpartition("/")[0]
    return found


class _Saved:
    """What the checkpoint holds under one object's path (see ``module_state.SavedEntries``)."""

    def __init__(self, planner: _RestorePlanner, path: str, private: bool) -> None:
        self.planner = planner
        self.path = path
        self.private = private

    def _path(self, keys: tuple[object, ...]) -> str:
        path = self.path
        for key in keys:
            path = join_path(path, key)
        return path

    def _plain(self, keys: tuple[object, ...]) -> tuple[bool, Any]:
        """(found, value) of the plain value at ``keys``, also inside a container that was
        stored whole as one plain value higher up."""
        saved_objects = self.planner.saved_objects
        for depth in range(len(keys), -1, -1):
            path = self._path(keys[:depth])
            if path in saved_objects:
                value = objects.decode(saved_objects[path])
                for key in keys[depth:]:
                    if isinstance(value, dict) and key in value:
                        value = value[key]
                    elif isinstance(value, (list, tuple)) and isinstance(key, int):
                        if not -len(value) <= key < len(value):
                            return False, None
                        value = value[key]
                    else:
                        return False, None
                return True, value
        return False, None

    def children(self, *keys: object) -> list[str] | None:
        """The keys stored directly below ``keys``, each a stored tensor or plain value; None
        where one holds more below it, a key was escaped, the value is per-rank or was stored
        whole as one plain value, or the stored tensors' shapes are not known."""
        path = self._path(keys)
        if self.private or self.planner.saved_entries is None or path in self.planner.saved_objects:
            return None
        below = self.planner.children_index.get(path, [])
        index = self.planner.children_index
        if any("%" in key or join_path(path, key) in index for key in below):
            return None
        return below

    def tensor(self, *keys: object) -> TensorEntry | None:
        """The shape and dtype of the tensor stored at ``keys`` (None: none, or not known)."""
        entries = self.planner.saved_entries
        if entries is None or self.private:
            return None
        return entries.get(self._path(keys))

    def has(self, *keys: object) -> bool:
        path = self._path(keys)
        stored = self.planner.stored_names(path, self.private)
        if any(name in self.planner.tensor_paths for name in stored):
            return True
        return path in self.planner.object_paths or self._plain(keys)[0]

    def plain(self, *keys: object) -> Any:
        return self._plain(keys)[1]


class _RestorePlanner:
    def __init__(
        self,
        training: TrainingObjects,
        saved_names: list[str],
        saved_objects: Mapping[str, Any],
        rank: int,
        objects_rank: int,
        saved_entries: Mapping[str, TensorEntry] | None = None,
    ) -> None:
        self.training = training
        self.saved_entries = saved_entries
        self.saved_names = saved_names
        self._saved_after = 0  # the position in saved_names after the last run found in order
        self.saved_objects = saved_objects
        self.rank = rank
        self.objects_rank = objects_rank
        self.object_ranks: list[int] = []  # the ranks whose plain values the checkpoint holds
        self.plan = RestorePlan()

    @functools.cached_property
    def saved_tensors(self) -> set[str]:
        """The stored tensor names (a set made when first needed)."""
        return set(self.saved_names)

    @functools.cached_property
    def children_index(self) -> dict[str, list[str]]:
        """Path -> the last parts of the stored tensors' and plain values' paths directly below
        it, in stored order (made when first needed)."""
        index: dict[str, list[str]] = {}
        for name in chain(self.saved_names, self.saved_objects):
            parent, _, last = name.rpartition("/")
            while True:
                seen = parent in index
                index.setdefault(parent, []).append(last)
                if seen or not parent:  # (the paths above were listed with it)
                    break
                parent, _, last = parent.rpartition("/")
        return index

    @functools.cached_property
    def tensor_paths(self) -> set[str]:
        """The stored tensor names and every path above one (computed when first needed)."""
        return _ancestors(self.saved_tensors)

    @functools.cached_property
    def object_paths(self) -> set[str]:
        """The stored plain values' paths and every path above one (computed when first needed)."""
        return _ancestors(self.saved_objects)

    def stored_names(self, path: str, private: bool) -> list[str]:
        """The name ``path`` is stored under (a rank-private name under ``PerRank``)."""
        return [rank_private_name(path, self.rank) if private else path]

    def visit_child(self, container: Any, key: Any, path: str, private: bool) -> None:
        """Plan the restore of ``container[key]``, whose path is ``path``."""
        value = container[key]
        kind = type(value)
        if kind in _TENSOR_TYPES:
            self.plan_tensor(value, path, private)
            return
        if kind in _CONTAINER_TYPES or kind in _SCALAR_TYPES:  # fail all the checks below
            self._visit_container_or_leaf(container, key, path, private)
            return
        if isinstance(value, torch.Tensor):
            self.plan_tensor(value, path, private)
            return
        if isinstance(value, PerRank):
            self.visit_child(value.__dict__, "value", path, private=True)
            return
        value = self.training.adapt(value)
        if is_stateful(value):
            owner = value
            template = getattr(owner, "restore_template", None)
            if template is not None:
                forget = getattr(owner, "forget_created_state", None)
                if forget is not None:
                    self.plan.undo.append(forget)
                holder = {"state": template(_Saved(self, path, private))}
            else:
                holder = {"state": owner.state_dict()}
            self._visit_container_or_leaf(holder, "state", path, private)
            self.plan.finishers.append(functools.partial(_load_state, owner, holder))
            return
        self._visit_container_or_leaf(container, key, path, private)

    def plan_tensor(self, tensor: torch.Tensor, path: str, private: bool) -> None:
        """Load ``tensor`` from its stored name; raise if the checkpoint lacks it."""
        name = rank_private_name(path, self.rank) if private else path
        if name not in self.saved_tensors:
            if path in self.saved_objects and not private:
                raise CheckpointError(
                    f"the checkpoint holds a plain value at {path!r} but the state to restore "
                    "has a tensor there"
                )
            raise self._missing(path, private)
        self.plan.tensors[name] = tensor

    def plan_items(self, items: dict | list, path: str, private: bool) -> None:
        """Plan every item of ``items``, an exact dict or list at ``path``, in order.

        Many items are planned by :meth:`_plan_many`, in batches where it can; others one by one
        here, which gives the same plan and the same first error.
        """
        keys = list(items) if type(items) is dict else list(range(len(items)))
        paths = _join_paths(path, keys) if len(keys) >= _BATCH_MIN else None
        if paths is not None:
            self._plan_many(items, keys, path, paths, private)
            return
        # Reading an item of an exact dict or list runs no code, so a tensor item is planned here
        # without a call of visit_child (which reads it again); others are read once more, there.
        for child_key in keys:
            child_path = join_path(path, child_key)
            if type(child := items[child_key]) in _TENSOR_TYPES:
                self.plan_tensor(child, child_path, private)
            else:
                self.visit_child(items, child_key, child_path, private)

    def _plan_many(
        self, items: dict | list, keys: list[Any], path: str, paths: list[str], private: bool
    ) -> None:
        """Plan the items at ``keys`` of ``items`` (at ``path``), whose paths are ``paths``: at
        once if all are tensors, or dicts that hold only tensors; else each long run of tensors
        at once and the other items one by one."""
        types = list(map(type, items.values() if type(items) is dict else items))
        runs = _tensor_runs(types)
        all_dicts = not runs and types[0] is dict and types.count(dict) == len(types)
        if not (runs or all_dicts):
            self._plan_each(items, keys, paths, private)
            return
        # Reading an item of an exact dict or list runs no code: all are read ahead.
        values = list(items.values()) if type(items) is dict else items.copy()
        if all_dicts and self._plan_tensor_dicts(values, path, paths, private):
            return
        self._plan_runs(items, keys, paths, values, runs, private)

    def _plan_runs(
        self,
        items: dict | list,
        keys: list[Any],
        paths: list[str],
        values: list[Any],
        runs: dict[int, int],
        private: bool,
    ) -> None:
        """Plan the items at ``keys`` (read ahead as ``values``) one by one, except each run of
        tensors ``keys[start:stop]`` for ``start: stop`` in ``runs``, planned at once."""
        done = 0
        for start, stop in runs.items():
            if done < start:
                self._plan_each(items, keys[done:start], paths[done:start], private)
            # Past the first item, read the run again: the planning of an item before it may
            # have run code (a state_dict()) that changed this container.
            run = values[start:stop] if start == 0 else _read_tensors(items, keys[start:stop])
            if run is None or not self._plan_tensor_run(run, paths[start:stop], private):
                # A missing tensor or a changed item: go on one by one, to raise the same error.
                self._plan_each(items, keys[start:], paths[start:], private)
                return
            done = stop
        if done < len(keys):
            self._plan_each(items, keys[done:], paths[done:], private)

    def _plan_tensor_dicts(
        self, dicts: list[dict], parent: str, paths: list[str], private: bool
    ) -> bool:
        """Plan ``dicts``, the exact dicts at ``paths`` below ``parent``, at once if each holds
        only exact tensors under keys with nothing to escape (an optimizer's state of each
        parameter), as visit_child would: their tensors in order, each at its path. False, with
        nothing planned, if they do not all qualify or the checkpoint lacks one of the tensors."""
        # visit_child takes the general path for an empty dict (a plain value), and for one at
        # "" or with plain values at or below its path (a positional optimizer state dict). Below
        # the top level, a child's path can hold plain values only if its parent's path does.
        if not (all(dicts) and _exact_tensors(dicts[0].values())):  # the first rules most out
            return False
        if (not parent or parent in self.object_paths) and (
            "" in paths or not self.object_paths.isdisjoint(paths)
        ):
            return False
        tensors = list(chain.from_iterable(map(dict.values, dicts)))
        if not (_exact_tensors(tensors) and _unescaped_strs(list(chain.from_iterable(dicts)))):
            return False
        names = [f"{path}/{key}" for path, child in zip(paths, dicts, strict=True) for key in child]
        return self._plan_tensor_run(tensors, names, private)

    def _plan_tensor_run(
        self, tensors: list[torch.Tensor], paths: list[str], private: bool
    ) -> bool:
        """Plan ``tensors`` (exact tensors) at ``paths`` as :meth:`plan_tensor` does one by one;
        False, with nothing planned, if the checkpoint lacks one of them."""
        names = paths
        if private:
            prefix = rank_private_name("", self.rank)
            names = [prefix + path for path in paths]
        if not (self._saved_in_order(names) or self.saved_tensors.issuperset(names)):
            return False
        self.plan.tensors.update(zip(names, tensors, strict=True))
        return True

    def _saved_in_order(self, names: list[str]) -> bool:
        """True when ``names`` are the stored names right after the last run found so (or the
        first ones): a state restored in the order it was saved is found by comparing lists,
        without hashing each new path for a set lookup (and without the set, made only where
        needed)."""
        start = self._saved_after
        stop = start + len(names)
        if self.saved_names[start:stop] != names:
            return False
        self._saved_after = stop
        return True

    def _plan_each(
        self, items: dict | list, keys: list[Any], paths: list[str], private: bool
    ) -> None:
        """Plan ``items[key]``, an exact dict's or list's item, at its path, for each key in turn
        (each item is read only then)."""
        # Reading an item of an exact dict or list runs no code, so a tensor item is planned here
        # without a call of visit_child (which reads it again); others are read once more, there.
        for child_key, child_path in zip(keys, paths, strict=True):
            if type(child := items[child_key]) in _TENSOR_TYPES:
                self.plan_tensor(child, child_path, private)
            else:
                self.visit_child(items, child_key, child_path, private)

    def _visit_container_or_leaf(self, container: Any, key: Any, path: str, private: bool) -> None:
        """Plan ``container[key]``, a value that is not a tensor, ``PerRank`` or stateful."""
        value = container[key]
        if isinstance(value, dict) and self._visit_positional_optimizer(value, path, private):
            return
        if not (isinstance(value, (dict, list, tuple)) and _needs_walk(value)):
            self._visit_leaf(container, key, value, path, private)
            return
        items = list(value) if isinstance(value, tuple) else value
        if type(items) is dict or type(items) is list:
            self.plan_items(items, path, private)
        else:  # a subclass's own methods read each item once, in visit_child
            for child_key in list(_keys(items)):
                self.visit_child(items, child_key, join_path(path, child_key), private)
        if isinstance(value, tuple):
            self.plan.finishers.append(
                functools.partial(_set_tuple, container, key, type(value), items)
            )

    def _visit_leaf(self, container: Any, key: Any, value: Any, path: str, private: bool) -> None:
        """Plan a plain value stored whole at ``path``, or raise why it cannot be restored."""
        if path in self.saved_objects:
            if private and self.objects_rank != self.rank:
                raise self._missing(path, private)
            decoded = objects.decode(self.saved_objects[path])
            self.plan.finishers.append(functools.partial(_set, container, key, decoded))
            return
        (name,) = self.stored_names(path, private)
        if name in self.saved_tensors:
            raise CheckpointError(
                f"the checkpoint holds a tensor at {path!r} but the state to restore has a "
                f"{type(value).__qualname__} there"
            )
        if name in self.tensor_paths:
            raise CheckpointError(
                f"the checkpoint holds tensors under {path!r} but the state to restore has none "
                "there. If this is an optimizer's state_dict(), its state is created lazily: call "
                "ckptmgr.prime_optimizer(optimizer) before restore, or pass the Optimizer object "
                "itself so that ckptmgr creates it"
            )
        raise self._missing(path, private)

    def _visit_positional_optimizer(self, target: dict, path: str, private: bool) -> bool:
        """Restore a plain ``optimizer.state_dict()`` (state keyed by parameter position) from a
        checkpoint of an ``Optimizer`` object (keyed by parameter name). False if not that case.

        Position ``i`` of the target's parameter groups is the parameter named at position ``i``
        of the saved groups: both list the optimizer's parameters in its own order.
        """
        if type(target) is dict and path and path not in self.object_paths:
            return False  # no plain value at or below path: no saved param_groups (the usual case)
        saved = _Saved(self, path, private)
        saved_groups = saved.plain("param_groups")
        groups = target.get("param_groups")
        if not (
            isinstance(groups, list)
            and isinstance(target.get("state"), dict)
            and isinstance(saved_groups, list)
            and _group_params(groups, int)
            and _group_params(saved_groups, str)
        ):
            return False
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in saved_groups]:
            raise CheckpointError(
                f"the optimizer at {path!r} has parameter groups of sizes "
                f"{[len(g['params']) for g in groups]}, the checkpoint "
                f"{[len(g['params']) for g in saved_groups]}"
            )
        name_of = {
            index: name
            for group, saved_group in zip(groups, saved_groups, strict=True)
            for index, name in zip(group["params"], saved_group["params"], strict=True)
        }
        state_path = join_path(path, "state")
        target_state = target["state"]
        if not target_state and saved.has("state") and saved.plain("state") != {}:
            self._visit_container_or_leaf(target, "state", state_path, private)  # raises
        for index in list(target_state):
            if index not in name_of:
                raise self._missing(join_path(state_path, index), private)
            self.visit_child(target_state, index, join_path(state_path, name_of[index]), private)
        restored = [
            {**saved_group, "params": list(group["params"])}
            for group, saved_group in zip(groups, saved_groups, strict=True)
        ]
        self.plan.finishers.append(functools.partial(_set, target, "param_groups", restored))
        return True

    def _missing(self, path: str, private: bool) -> CheckpointError:
        if private:
            copies = filter(None, map(split_rank_private, self.saved_tensors))
            ranks = sorted(
                rank
                for rank, stored_path in copies
                if stored_path == path or stored_path.startswith(path + "/")
            )
            if not ranks and self.objects_rank == self.rank:
                # No rank holds a tensor of it, and this rank's own plain values lack it: a key
                # the checkpoint does not have, or one other ranks saved as plain values alone
                # (theirs are not read here), not a checkpoint of fewer ranks
                return CheckpointError(
                    f"key {path!r} of the state to restore (per-rank state) is missing from "
                    f"the checkpoint for rank {self.rank}: this rank saved no value of it, and "
                    "no rank a tensor"
                )
            held = f"copies for ranks {sorted(set(ranks))}" if ranks else "no tensor copies"
            if not ranks:
                held = (
                    f"plain values of ranks {self.object_ranks}"
                    if self.object_ranks
                    else f"plain values of rank {self.objects_rank} only"
                )
            return CheckpointError(
                f"per-rank state {path!r} has no copy for rank {self.rank} in the checkpoint "
                f"({held}; it was probably written by fewer ranks). Per-rank state is restored "
                "only on the ranks that saved it: leave it out of the state to restore on the "
                "other ranks"
            )
        return CheckpointError(
            f"key {path!r} of the state to restore is missing from the checkpoint"
        )


def _group_params(groups: list, kind: type) -> bool:
    """True if every group is a dict whose params are all of type ``kind`` (and some exist)."""
    params = [g.get("params") if isinstance(g, dict) else None for g in groups]
    if not all(isinstance(p, list) for p in params):
        return False
    flat = [p for group in params for p in group]  # type: ignore[union-attr]
    return bool(flat) and all(isinstance(p, kind) and not isinstance(p, bool) for p in flat)


def _keys(container: dict | list) -> Iterable[Any]:
    return container.keys() if isinstance(container, dict) else range(len(container))


def _tensor_runs(types: list[type]) -> dict[int, int]:
    """``start: stop`` of each run ``types[start:stop]`` of types in ``_TENSOR_TYPES`` to plan at
    once, ``types`` being the types of a container's items: all of them if all are tensors, else
    each run of at least ``_BATCH_MIN``."""
    tensors = sum(map(types.count, _TENSOR_TYPES))
    if tensors == len(types):
        return {0: len(types)}
    # The other items split the tensors into at most len(types) - tensors + 1 runs: where these
    # average fewer than _BATCH_MIN tensors, the long runs (if any) do not pay for the search.
    if tensors < _BATCH_MIN * (len(types) - tensors + 1):
        return {}
    flags = bytes(map(_TENSOR_TYPES.__contains__, types))
    return {run.start(): run.end() for run in _TENSOR_RUN.finditer(flags)}


def _read_tensors(items: dict | list, keys: list[Any]) -> list[torch.Tensor] | None:
    """``items[key]`` for each key if each is still an exact tensor; None if one is not (or is
    gone): the items were changed since they were first read."""
    try:
        values = [items[key] for key in keys]
    except (KeyError, IndexError):
        return None
    return values if _exact_tensors(values) else None


# The finishers are partials of these rather than lambdas: a lambda makes its function put the
# variables it uses in cells, a cost paid on every call of that function, not only by finishers.
def _set(container: Any, key: Any, value: Any) -> None:
    container[key] = value


def _set_tuple(container: Any, key: Any, kind: type, items: list[Any]) -> None:
    """A new tuple of ``items`` in place of the destination's: a namedtuple of the
    destination's own type (not one the checkpoint names), else a plain tuple."""
    make = getattr(kind, "_make", None)
    container[key] = make(items) if callable(make) else tuple(items)


def _load_state(owner: Any, holder: dict[str, Any]) -> None:
    owner.load_state_dict(holder["state"])


def optimizer_paths_needing_prime(
    state: Mapping[str, Any], saved_tensors: Iterable[str]
) -> list[torch.optim.Optimizer]:
    """Always empty: ``restore`` creates the state of ``Optimizer`` objects itself (see
    :meth:`ckptmgr.module_state.OptimizerState.restore_template`), without the destructive
    step of :func:`~ckptmgr.prime_optimizer`. Kept for callers of the earlier API."""
    del state, saved_tensors
    return []
