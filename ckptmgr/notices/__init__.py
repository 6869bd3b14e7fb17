"""Sources of preemption notices other than signals: cloud metadata servers, a trigger file,
PyTorch/XLA's sync manager, and the DataLoader worker guard. See ``ckptmgr.preemption``."""

from ckptmgr.notices.base import NoticeBoard, PreemptionNotice, SourceStatus, Watcher
from ckptmgr.notices.workers import (
    DEFAULT_WORKER_SIGNALS,
    WorkerSignalGuard,
    ignore_preemption_signals_in_worker,
)
from ckptmgr.notices.xla import XlaPreemptionSync, activate_xla_preemption_sync

__all__ = [
    "DEFAULT_WORKER_SIGNALS",
    "NoticeBoard",
    "PreemptionNotice",
    "SourceStatus",
    "Watcher",
    "WorkerSignalGuard",
    "XlaPreemptionSync",
    "activate_xla_preemption_sync",
    "ignore_preemption_signals_in_worker",
]
