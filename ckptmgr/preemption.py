"""Preemption notices from signals: the handler only sets a flag."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

log = logging.getLogger(__name__)

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class PreemptionConfig(BaseModel):
    """Where preemption notices come from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    signals: list[str] = Field(default_factory=lambda: ["SIGTERM"])

    @field_validator("signals")
    @classmethod
    def _known_signals(cls, names: list[str]) -> list[str]:
        for name in names:
            if not isinstance(getattr(signal, name, None), signal.Signals):
                raise ValueError(f"unknown signal name {name!r} in preemption.signals")
        return names


class SignalWatcher:
    """Sets a flag when one of the configured signals arrives; chains to earlier handlers."""

    def __init__(self, signal_names: list[str]) -> None:
        self._event = threading.Event()
        self._previous: dict[signal.Signals, _Handler] = {}
        self.received: signal.Signals | None = None
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "CheckpointManager was created outside the main thread: signal handlers for "
                "preemption (%s) are not installed",
                ", ".join(signal_names),
            )
            return
        for name in signal_names:
            signum = signal.Signals[name]
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)
        self._event.set()
        previous = self._previous.get(signal.Signals(signum))
        if callable(previous):
            previous(signum, frame)

    @property
    def notified(self) -> bool:
        """True once a configured signal has arrived (until :meth:`clear`)."""
        return self._event.is_set()

    def clear(self) -> None:
        """Forget the notice (after the preemption checkpoint is committed)."""
        self._event.clear()

    def close(self) -> None:
        """Put back the handlers that were installed before."""
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
