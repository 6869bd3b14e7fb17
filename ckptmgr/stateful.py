"""Helpers that make plain values and random number generators checkpointable."""

from __future__ import annotations

import random
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: modules, optimizers, schedulers."""

    def state_dict(self) -> dict[str, Any]:
        """Return the object's state."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any:
        """Restore the object's state."""
        ...


def is_stateful(value: Any) -> bool:
    """True for objects saved via ``state_dict()`` and restored via ``load_state_dict()``."""
    return (
        not isinstance(value, (torch.Tensor, dict, list, tuple))
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


class PerRank:
    """Marks part of a state whose tensors differ from rank to rank.

    Plain tensors are treated as DCP treats them: identical on every rank and written once.
    Wrap rank-local tensors (per-rank statistics, a rank's data-loader buffers) so that every rank
    writes and restores its own copy::

        state = {"model": model, "local": PerRank({"seen": seen_counts})}

    Plain values (ints, strings, ...) are always per rank and need no wrapper; a rank that did not
    exist when the checkpoint was written gets rank 0's. Under ``PerRank`` they, like the tensors,
    restore only on the ranks that saved them: elsewhere ``restore`` raises ``CheckpointError``.
    """

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"


class StateDict:
    """A mutable bag of plain values (and tensors) that restores in place.

    >>> progress = StateDict(epoch=0, step=0)
    >>> progress.epoch += 1

    After ``restore`` the attributes hold the checkpointed values.
    """

    def __init__(self, **values: Any) -> None:
        self.__dict__["_values"] = dict(values)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self.__dict__["_values"][name] = value

    def __getitem__(self, name: str) -> Any:
        return self.__dict__["_values"][name]

    def __setitem__(self, name: str, value: Any) -> None:
        self.__dict__["_values"][name] = value

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.__dict__["_values"].items())
        return f"StateDict({inner})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StateDict) and self.state_dict() == other.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """The values as a dict (a shallow copy)."""
        return dict(self.__dict__["_values"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replace the values with those of ``state_dict``."""
        self.__dict__["_values"].update(state_dict)


class RNGState:
    """Captures and restores the torch, Python ``random`` and (if installed) numpy generators.

    CUDA generators are included when CUDA is available. The states are stored as plain values
    (bytes and ints), so they are per rank under torch.distributed like every plain value, and a
    restore applies whichever generators the checkpoint holds: one saved without numpy or CUDA
    restores onto a machine with them, and CUDA states are applied to the devices that exist.
    """

    def state_dict(self) -> dict[str, Any]:
        """Snapshot every generator's state."""
        state: dict[str, Any] = {
            "torch": _tensor_bytes(torch.get_rng_state()),
            "python": random.getstate(),
        }
        np = _numpy()
        if np is not None:
            kind, keys, pos, has_gauss, cached = np.random.get_state()
            state["numpy"] = {
                "kind": str(kind),
                "keys": [int(k) for k in keys.tolist()],
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
        if torch.cuda.is_available():
            state["cuda"] = [_tensor_bytes(s) for s in torch.cuda.get_rng_state_all()]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set every generator the checkpoint holds to its saved state."""
        torch.set_rng_state(_bytes_tensor(state_dict["torch"]))
        random.setstate(_as_tuple(state_dict["python"]))
        np = _numpy()
        if np is not None and "numpy" in state_dict:
            saved = state_dict["numpy"]
            np.random.set_state(
                (
                    saved["kind"],
                    np.asarray(saved["keys"], dtype=np.uint32),
                    saved["pos"],
                    saved["has_gauss"],
                    saved["cached_gaussian"],
                )
            )
        if torch.cuda.is_available() and "cuda" in state_dict:
            states = state_dict["cuda"][: torch.cuda.device_count()]
            torch.cuda.set_rng_state_all([_bytes_tensor(s) for s in states])


def _tensor_bytes(state: torch.Tensor) -> bytes:
    return bytes(state.cpu().tolist())


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _as_tuple(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuple(v) for v in value)
    return value


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy
