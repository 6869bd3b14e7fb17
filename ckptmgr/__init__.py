"""ckptmgr: crash-safe, asynchronous checkpoint management for PyTorch training loops.

Everything public is importable from here::

    from ckptmgr import CheckpointManager, prime_optimizer

Each name is imported from its module when it is first used (PEP 562), so that a program that
needs only part of ckptmgr, such as the ``ckptmgr`` command line's ``ls``, ``prune``, ``rm``
and ``verify``, does not import torch and DCP (about 3 s of a 2-core machine's time).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from ckptmgr._version import __version__

if TYPE_CHECKING:
    from ckptmgr.config import CheckpointConfig
    from ckptmgr.errors import CheckpointError, CorruptCheckpointError, StepNotFoundError
    from ckptmgr.manager import CheckpointManager
    from ckptmgr.module_state import OptimizerState
    from ckptmgr.optimizer import prime_optimizer
    from ckptmgr.preemption import (
        PreemptionConfig,
        PreemptionMonitor,
        PreemptionNotice,
        WorkerSignalGuard,
        ignore_preemption_signals_in_worker,
    )
    from ckptmgr.record import CommitRecord
    from ckptmgr.retention import (
        AnyOf,
        CheckpointInfo,
        KeepAll,
        KeepBest,
        KeepEveryNSeconds,
        KeepEveryNSteps,
        KeepLatest,
        KeepSteps,
        RetentionDecision,
        RetentionPolicy,
    )
    from ckptmgr.retry import RetryConfig
    from ckptmgr.save_policy import (
        SaveAtSteps,
        SaveContext,
        SaveEveryNSeconds,
        SaveEveryNSteps,
        SaveFirstStep,
        SavePolicy,
    )
    from ckptmgr.stateful import PerRank, RNGState, StateDict, Stateful

_HOMES: dict[str, str] = {
    "AnyOf": "ckptmgr.retention",
    "CheckpointConfig": "ckptmgr.config",
    "CheckpointError": "ckptmgr.errors",
    "CheckpointInfo": "ckptmgr.retention",
    "CheckpointManager": "ckptmgr.manager",
    "CommitRecord": "ckptmgr.record",
    "CorruptCheckpointError": "ckptmgr.errors",
    "ignore_preemption_signals_in_worker": "ckptmgr.preemption",
    "KeepAll": "ckptmgr.retention",
    "KeepBest": "ckptmgr.retention",
    "KeepEveryNSeconds": "ckptmgr.retention",
    "KeepEveryNSteps": "ckptmgr.retention",
    "KeepLatest": "ckptmgr.retention",
    "KeepSteps": "ckptmgr.retention",
    "OptimizerState": "ckptmgr.module_state",
    "PerRank": "ckptmgr.stateful",
    "PreemptionConfig": "ckptmgr.preemption",
    "PreemptionMonitor": "ckptmgr.preemption",
    "PreemptionNotice": "ckptmgr.preemption",
    "prime_optimizer": "ckptmgr.optimizer",
    "RetentionDecision": "ckptmgr.retention",
    "RetentionPolicy": "ckptmgr.retention",
    "RetryConfig": "ckptmgr.retry",
    "RNGState": "ckptmgr.stateful",
    "SaveAtSteps": "ckptmgr.save_policy",
    "SaveContext": "ckptmgr.save_policy",
    "SaveEveryNSeconds": "ckptmgr.save_policy",
    "SaveEveryNSteps": "ckptmgr.save_policy",
    "SaveFirstStep": "ckptmgr.save_policy",
    "SavePolicy": "ckptmgr.save_policy",
    "StateDict": "ckptmgr.stateful",
    "Stateful": "ckptmgr.stateful",
    "StepNotFoundError": "ckptmgr.errors",
    "WorkerSignalGuard": "ckptmgr.preemption",
}
"""The module that defines each public name."""

__all__ = [
    "AnyOf",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CommitRecord",
    "CorruptCheckpointError",
    "KeepAll",
    "KeepBest",
    "KeepEveryNSeconds",
    "KeepEveryNSteps",
    "KeepLatest",
    "KeepSteps",
    "OptimizerState",
    "PerRank",
    "PreemptionConfig",
    "PreemptionMonitor",
    "PreemptionNotice",
    "RNGState",
    "RetentionDecision",
    "RetentionPolicy",
    "RetryConfig",
    "SaveAtSteps",
    "SaveContext",
    "SaveEveryNSeconds",
    "SaveEveryNSteps",
    "SaveFirstStep",
    "SavePolicy",
    "StateDict",
    "Stateful",
    "StepNotFoundError",
    "WorkerSignalGuard",
    "__version__",
    "ignore_preemption_signals_in_worker",
    "prime_optimizer",
]


def __getattr__(name: str) -> Any:
    """The public ``name``, imported from its module on first use (then kept here); or a
    submodule, imported on first use (``ckptmgr.record.record_bytes`` after ``import
    ckptmgr``, as when the package imported every module)."""
    home = _HOMES.get(name)
    if home is not None:
        value = getattr(importlib.import_module(home), name)
        globals()[name] = value
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")  # (which sets it here)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
