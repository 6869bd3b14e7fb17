"""TPU VMs: PyTorch/XLA's preemption sync manager (TSL), which owns SIGTERM when active.

torch_xla's manager installs a C-level SIGTERM handler and agrees on a sync point across hosts
(``max(step) + 1``); ``_sync_point_reached(step)`` is then True on every host at the same step.
A Python SIGTERM handler would replace that C handler, so when this is active ckptmgr leaves
SIGTERM alone and asks the sync manager instead.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any, Literal

log = logging.getLogger("ckptmgr.preemption")

_BINDINGS = (
    "_ensure_xla_coordinator_initialized",
    "_activate_preemption_sync_manager",
    "_sync_point_reached",
)
#: ``torch_xla.runtime.device_type()`` values on which the sync manager is used in "auto" mode.
XLA_DEVICE_TYPES = frozenset({"TPU", "NEURON"})


class XlaPreemptionSync:
    """Asks PyTorch/XLA's active preemption sync manager whether ``step`` is the sync point."""

    def __init__(self, bindings: Any) -> None:
        self._bindings = bindings

    def sync_point_reached(self, step: int) -> bool:
        """True on every host at the agreed step after a SIGTERM reached any host.

        Call it at every step, on every host, with the same step numbers.
        """
        return bool(self._bindings._sync_point_reached(step))


def activate_xla_preemption_sync(mode: bool | Literal["auto"]) -> XlaPreemptionSync | None:
    """Activate PyTorch/XLA's preemption sync manager if ``mode`` asks for it and it applies.

    ``False``: never. ``"auto"``: only if ``torch_xla`` is already imported and its device is a
    TPU (or Neuron), so nothing heavy is imported elsewhere. ``True``: import ``torch_xla`` and
    activate it, raising ``RuntimeError`` if that is impossible. Returns None when not used.
    Activation is idempotent (a manager that torch_xla already activated is reused) and it is
    never deactivated, as in torch_xla's own CheckpointManager.
    """
    if mode is False or (mode == "auto" and "torch_xla" not in sys.modules):
        return None
    try:
        torch_xla = importlib.import_module("torch_xla")
        runtime = importlib.import_module("torch_xla.runtime")
    except ImportError as error:
        if mode is True:
            raise RuntimeError(
                "preemption.tpu=True needs torch_xla, which cannot be imported"
            ) from error
        return None
    bindings = getattr(torch_xla, "_XLAC", None)
    missing = [name for name in _BINDINGS if not hasattr(bindings, name)]
    if missing:
        if mode is True:
            raise RuntimeError(f"preemption.tpu=True: torch_xla lacks {', '.join(missing)}")
        log.info("torch_xla lacks %s: its preemption sync manager is not used", missing)
        return None
    if mode == "auto" and runtime.device_type() not in XLA_DEVICE_TYPES:
        return None
    bindings._ensure_xla_coordinator_initialized(
        runtime.process_index(), runtime.process_count(), runtime.get_master_ip()
    )
    bindings._activate_preemption_sync_manager()
    log.info("preemption: using PyTorch/XLA's preemption sync manager (it handles SIGTERM)")
    return XlaPreemptionSync(bindings)
