"""ckptmgr: crash-safe, asynchronous checkpoint management for PyTorch training loops.

Everything public is importable from here::

    from ckptmgr import CheckpointManager, prime_optimizer
"""

from ckptmgr._version import __version__
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
