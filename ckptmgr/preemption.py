"""Preemption notices: signals (the handler only sets a flag), cloud metadata servers (GCE, AWS,
Azure), a trigger file and PyTorch/XLA's sync manager, gathered by :class:`PreemptionMonitor`."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ckptmgr.notices import aws, azure, gce
from ckptmgr.notices.base import NoticeBoard, PreemptionNotice, SourceStatus, Watcher
from ckptmgr.notices.file import FileWatcher
from ckptmgr.notices.signal_names import notice_signal_names
from ckptmgr.notices.workers import (
    DEFAULT_WORKER_SIGNALS,
    WorkerSignalGuard,
    ignore_preemption_signals_in_worker,
)
from ckptmgr.notices.xla import XlaPreemptionSync, activate_xla_preemption_sync
from ckptmgr.setting_types import Count, Seconds

__all__ = [
    "DEFAULT_WORKER_SIGNALS",
    "PreemptionConfig",
    "PreemptionMonitor",
    "PreemptionNotice",
    "SignalWatcher",
    "SourceStatus",
    "WorkerSignalGuard",
    "XlaPreemptionSync",
    "ignore_preemption_signals_in_worker",
]

log = logging.getLogger(__name__)

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
#: How long :meth:`PreemptionMonitor.close` waits for its threads, in all.
CLOSE_TIMEOUT_S = 1.0

Mode = bool | Literal["auto"]


class PreemptionConfig(BaseModel):
    """Where preemption notices come from. Every field is validated; unknown fields are errors.

    ``gce``, ``aws``, ``azure`` and ``tpu`` take ``True``, ``False`` or ``"auto"``. ``"auto"``
    watches a cloud only when this machine is one of its VMs (a local DMI check, or the
    endpoint's environment variable is set) and its metadata server answers within 0.5 s; the
    check runs on the watcher's thread, never in the constructor.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    signals: list[str] = Field(
        default_factory=lambda: ["SIGTERM"],
        description='Signals that are a notice, e.g. ["SIGTERM", "SIGUSR1"] ("USR1" works too); '
        "[] for none.",
    )
    gce: Mode = Field(default="auto", description="Watch GCE instance/preempted and maintenance.")
    aws: Mode = Field(default="auto", description="Watch EC2 spot/instance-action (IMDSv2).")
    azure: Mode = Field(default="auto", description="Watch Azure Scheduled Events.")
    tpu: Mode = Field(
        default="auto", description="Use PyTorch/XLA's preemption sync manager on TPU VMs."
    )
    file: str | None = Field(
        default=None, description="A path whose appearance is a notice (e.g. a preStop hook)."
    )
    poll_interval_s: Seconds = Field(
        default=5.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="Seconds between polls (AWS, Azure, file).",
    )
    request_timeout_s: Seconds = Field(
        default=2.0,
        gt=0,
        le=300,
        allow_inf_nan=False,
        description="Timeout of one metadata request.",
    )
    gce_long_poll_s: Count = Field(
        default=60,
        ge=1,
        le=3600,
        description="timeout_sec of each GCE wait_for_change request.",
    )
    exit_after_save: bool = Field(
        default=False,
        strict=True,
        description="Exit with 128+signal once the preemption checkpoint is committed.",
    )
    agree_every_n_steps: int = Field(
        default=1,
        strict=True,
        ge=1,
        description="Under torch.distributed, combine notices across ranks at every Nth decision "
        "only (amortises the all_reduce; the preemption save may come up to N-1 steps later).",
    )

    @field_validator("signals")
    @classmethod
    def _known_signals(cls, names: list[str]) -> list[str]:
        return notice_signal_names(names, "preemption.signals")

    @field_validator("gce", "aws", "azure", "tpu", mode="before")
    @classmethod
    def _mode(cls, value: Any) -> Any:
        if isinstance(value, bool) or value == "auto":
            return value
        raise ValueError(f'must be true, false or "auto", got {value!r}')

    @field_validator("file", mode="before")
    @classmethod
    def _path(cls, value: Any) -> Any:
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if isinstance(value, str) and not value.strip():
            raise ValueError("must be a non-empty path or None")
        return value


class SignalWatcher:
    """Sets a flag when one of the configured signals arrives; chains to earlier handlers.

    The handler takes no lock and does no I/O: it stores the signal and the time, then calls
    the Python handler that was installed before (except ``signal.default_int_handler``, whose
    KeyboardInterrupt would defeat a SIGINT notice). Handlers are installed only from the main
    thread; elsewhere a warning is logged and nothing is installed.
    """

    def __init__(self, signal_names: list[str]) -> None:
        self._previous: dict[signal.Signals, _Handler] = {}
        self._pending = False
        self._closed = False
        self._pid = os.getpid()  # in a forked child, which inherits the handler, it acts closed
        #: The first signal since the last :meth:`clear`, and when it arrived.
        self.received: signal.Signals | None = None
        self.received_at: float | None = None
        if not signal_names:
            return
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
        _OPEN_WATCHERS.add(self)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Closed, or in a forked child (whose manager is unusable: a notice there would only
        # keep the child from dying of a SIGTERM): act as the handler before this one would.
        if self._closed or os.getpid() != self._pid:
            previous = _past_closed_watchers(
                signal.Signals(signum), self._previous.get(signal.Signals(signum))
            )
            # Still installed (closed off the main thread): put the handlers back now. Else a
            # handler installed later calls this one, as its previous: pass the signal on, to
            # the default action too (the later handler would otherwise swallow a SIGTERM).
            self._restore()
            if callable(previous):
                previous(signum, frame)
            elif (previous is None or previous == signal.SIG_DFL) and not _watched_by_an_open(
                signal.Signals(signum)
            ):
                _take_default_action(signal.Signals(signum))
            return
        if not self._pending:
            self.received = signal.Signals(signum)
            self.received_at = time.time()
            self._pending = True  # last: a reader that sees it sees the two fields above
        previous = self._previous.get(signal.Signals(signum))
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    @property
    def installed(self) -> list[str]:
        """Names of the signals whose handler this watcher installed (and has not removed)."""
        return [signum.name for signum in self._previous]

    @property
    def notified(self) -> bool:
        """True once a configured signal has arrived (until :meth:`clear`)."""
        return self._pending

    @property
    def notice(self) -> PreemptionNotice | None:
        """The pending signal notice, or None."""
        received, received_at = self.received, self.received_at
        if not self._pending or received is None or received_at is None:
            return None
        return PreemptionNotice(f"signal {received.name}", received_at, signum=int(received))

    def clear(self) -> None:
        """Forget the notice (after the preemption checkpoint is committed)."""
        self._pending = False

    def close(self) -> None:
        """Put back the handlers that were installed before. Off the main thread, where Python
        cannot set handlers, the first of these signals to arrive puts them back and is handled
        as the handler before would have."""
        self._closed = True
        _OPEN_WATCHERS.discard(self)
        if threading.current_thread() is threading.main_thread():
            self._restore()

    def _restore(self) -> None:
        """Put back the handler before this one wherever this one is still installed. Where a
        handler installed later is on top (and may call this one), the one before is kept, so
        that this one passes signals on to it."""
        for signum, previous in list(self._previous.items()):
            if signal.getsignal(signum) == self._handle:
                previous = _past_closed_watchers(signum, previous)
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
                self._previous.pop(signum, None)


_OPEN_WATCHERS: weakref.WeakSet[SignalWatcher] = weakref.WeakSet()
"""The watchers of this process (a forked child's parent's do not count) not yet closed."""


def _watched_by_an_open(signum: signal.Signals) -> bool:
    """True while an open watcher of this process handles ``signum``: it wants the signal as a
    notice, so a closed one that it (or a handler between them) passes the signal on to must not
    take the default action (a SIGTERM would end the process before its checkpoint)."""
    return any(
        not watcher._closed and watcher._pid == os.getpid() and signum in watcher._previous
        for watcher in list(_OPEN_WATCHERS)
    )


def _take_default_action(signum: signal.Signals) -> None:
    """Act on ``signum`` as its default disposition does (for ``SIGTERM``, end the process),
    from the main thread, whatever handler is installed now (a handler installed after this
    watcher that passed the signal on to it, its handler before): the default disposition is
    set, the signal raised on this thread, where it is delivered before ``raise_signal``
    returns, and the handler put back where the process lives on (a signal whose default is to
    be ignored)."""
    current = signal.getsignal(signum)
    signal.signal(signum, signal.SIG_DFL)
    try:
        signal.raise_signal(signum)
    finally:
        if current is not None and current != signal.SIG_DFL:
            signal.signal(signum, current)


def _past_closed_watchers(signum: signal.Signals, handler: _Handler) -> _Handler:
    """``handler``, or where it is the handler of a watcher closed while this one was on top of
    it (managers closed in the order they were made), the first handler below that is not: the
    closed one only passes signals on, and would otherwise stay installed after both closed.
    (The closed ones keep theirs: a chain that still calls one is passed on as before.)"""
    watcher = getattr(handler, "__self__", None)
    while isinstance(watcher, SignalWatcher) and watcher._closed and handler == watcher._handle:
        handler = watcher._previous.get(signum)
        watcher = getattr(handler, "__self__", None)
    return handler


def build_watchers(config: PreemptionConfig, board: NoticeBoard) -> list[Watcher]:
    """The (not yet started) watchers that ``config`` enables."""
    watchers: list[Watcher] = []
    http = {
        "poll_interval_s": config.poll_interval_s,
        "request_timeout_s": config.request_timeout_s,
    }
    if config.gce is not False:
        for key in gce.KEYS:
            watchers.append(
                gce.GceWatcher(
                    board,
                    key,
                    auto=config.gce == "auto",
                    long_poll_s=config.gce_long_poll_s,
                    **http,
                )
            )
    if config.aws is not False:
        watchers.append(aws.AwsWatcher(board, auto=config.aws == "auto", **http))
    if config.azure is not False:
        watchers.append(azure.AzureWatcher(board, auto=config.azure == "auto", **http))
    if config.file is not None:
        watchers.append(FileWatcher(board, config.file, poll_interval_s=config.poll_interval_s))
    return watchers


class PreemptionMonitor:
    """Gathers preemption notices from every source that ``config`` enables.

    Create it on the main thread: it installs the signal handlers (see :class:`SignalWatcher`)
    and starts one daemon thread per enabled cloud key or file. ``"auto"`` sources detect their
    cloud on their own thread, so the constructor does no network I/O (except on a TPU VM where
    torch_xla is imported: activating its sync manager connects to the XLA coordinator).
    """

    def __init__(self, config: PreemptionConfig | None = None) -> None:
        self.config = config if config is not None else PreemptionConfig()
        self._board = NoticeBoard()
        self._closed = False
        self._pid = os.getpid()  # a forked child has this process's handlers, not its threads
        self._xla = activate_xla_preemption_sync(self.config.tpu)
        names = list(self.config.signals)
        if self._xla is not None and "SIGTERM" in names:
            names.remove("SIGTERM")  # a Python handler would replace torch_xla's C handler
        self._signals = SignalWatcher(names)
        self._watchers = build_watchers(self.config, self._board)
        try:
            for watcher in self._watchers:
                watcher.start()
        except BaseException:
            self.close()
            raise

    @property
    def notified(self) -> bool:
        """True while a notice is pending. No I/O and no lock: read it at every step."""
        return self._signals.notified or self._board.pending is not None

    @property
    def notice(self) -> PreemptionNotice | None:
        """The pending notice (the earliest, if a signal and another source both gave one)."""
        candidates = [n for n in (self._signals.notice, self._board.pending) if n is not None]
        return min(candidates, key=lambda n: n.received_at) if candidates else None

    def clear(self) -> None:
        """Forget the pending notice. Signals count again at once; a cloud source or the file
        gives a notice again only for a new event (a new value, action, EventId or file)."""
        self._signals.clear()
        self._board.clear()

    @property
    def uses_xla(self) -> bool:
        """True when PyTorch/XLA's preemption sync manager is active and owns SIGTERM."""
        return self._xla is not None

    def xla_sync_point(self, step: int) -> bool | None:
        """On XLA: whether ``step`` is the sync point agreed by all hosts after a SIGTERM.
        None when XLA's sync manager is not used. Call it at every step on every host.

        The sync point is one step only: it is also posted as a notice, pending (as any
        other) until the preemption checkpoint commits, so a failed save is tried again at
        the next step."""
        if self._xla is None:
            return None
        reached = self._xla.sync_point_reached(step)
        if reached:
            self._board.post(
                PreemptionNotice(
                    f"XLA preemption sync point at step {step}",
                    time.time(),
                    signum=int(signal.SIGTERM),
                )
            )
        return reached

    @property
    def handled_signals(self) -> list[str]:
        """The signals whose handler this monitor installed."""
        return self._signals.installed

    @property
    def sources(self) -> dict[str, SourceStatus]:
        """The state of each watcher thread, by name (``gce-preempted``, ``aws``, ``file``...)."""
        return {watcher.name: watcher.status() for watcher in self._watchers}

    def wait_for_detection(self, timeout: float) -> dict[str, SourceStatus]:
        """Wait up to ``timeout`` seconds until every source is detected or found absent."""
        deadline = time.monotonic() + timeout
        for watcher in self._watchers:
            watcher.wait_settled(max(0.0, deadline - time.monotonic()))
        return self.sources

    def close(self) -> None:
        """Restore the signal handlers and stop the threads (within about a second, even in a
        long poll: the request in flight is aborted). Idempotent. In a forked child of the
        process that made the monitor, which inherited its signal handlers but none of its
        threads, this restores the child's handlers only."""
        if self._closed:
            return
        self._closed = True
        self._signals.close()
        if os.getpid() != self._pid:
            return
        for watcher in self._watchers:
            watcher.stop()
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for watcher in self._watchers:
            if not watcher.join(max(0.0, deadline - time.monotonic())):
                log.debug("preemption source %s did not stop in time", watcher.name)

    def __enter__(self) -> PreemptionMonitor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
