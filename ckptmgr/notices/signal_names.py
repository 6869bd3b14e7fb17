"""Signal names that can announce a preemption, checked once for every place that takes them."""

from __future__ import annotations

import signal
from collections.abc import Iterable

UNCATCHABLE = frozenset({"SIGKILL", "SIGSTOP"})
# Sent in normal operation (a child process exits, the terminal is resized, a stopped job goes
# on) or for a fault of the process itself: never a notice that the machine goes away.
NOT_NOTICES = frozenset(
    {
        "SIGCHLD",
        "SIGCLD",
        "SIGWINCH",
        "SIGURG",
        "SIGCONT",
        "SIGSEGV",
        "SIGBUS",
        "SIGFPE",
        "SIGILL",
    }
)


def notice_signal_names(names: Iterable[str], where: str) -> list[str]:
    """``names`` as full signal names (``"usr1"`` is ``"SIGUSR1"``), each once, in order.

    Raises ``TypeError`` for a single string (its letters would be taken for names) and
    ``ValueError`` naming ``where`` for an unknown name, a signal that cannot be caught, or one
    sent in normal operation (SIGCHLD, say)."""
    if isinstance(names, (str, bytes)):
        raise TypeError(f"{where} must be a list of signal names, not one string: {names!r}")
    normalized: list[str] = []
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"{where}: a signal name must be a string, got {name!r}")
        full = name.strip().upper()
        if not full.startswith("SIG"):
            full = "SIG" + full
        if not isinstance(getattr(signal, full, None), signal.Signals):
            raise ValueError(f"unknown signal name {name!r} in {where}")
        if full in UNCATCHABLE:
            raise ValueError(f"{full} cannot be caught; it cannot be a preemption notice")
        if full in NOT_NOTICES:
            raise ValueError(
                f"{full} is sent in normal operation or for a fault of the process, not to "
                "announce a preemption; it cannot be a preemption notice"
            )
        if full not in normalized:
            normalized.append(full)
    return normalized
