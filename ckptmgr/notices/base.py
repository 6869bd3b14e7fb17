"""Notices, the board that holds the pending one, and the polling thread every source runs on."""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass

from ckptmgr.notices._http import TRANSPORT_ERRORS, Requester

#: The exit status of a notice that is no signal: 128 + ``SIGTERM``, what the platform sends next.
DEFAULT_EXIT_CODE = 128 + int(signal.SIGTERM)

log = logging.getLogger("ckptmgr.preemption")

#: Timeout of each request that decides whether an ``"auto"`` source is present.
DETECT_TIMEOUT_S = 0.5


@dataclass(frozen=True)
class PreemptionNotice:
    """One preemption notice: where it came from and when it arrived."""

    #: ``"signal SIGTERM"``, ``"gce preempted=TRUE"``, ``"aws spot instance-action"``,
    #: ``"azure Preempt"``, ``"file /path"``, ...
    source: str
    #: Wall-clock time (``time.time()``) at which the notice was received.
    received_at: float
    #: The signal number for signal notices, else None.
    signum: int | None = None
    #: Extra facts from the source (the AWS action and time, the Azure EventId, ...).
    detail: str = ""

    @property
    def exit_code(self) -> int:
        """The conventional exit status: 128 + the signal (SIGTERM for notices that are not
        signals, since that is what the platform sends next)."""
        return 128 + self.signum if self.signum is not None else DEFAULT_EXIT_CODE

    def __str__(self) -> str:
        return f"{self.source} ({self.detail})" if self.detail else self.source


class NoticeBoard:
    """Holds the pending notice posted by watcher threads (the first one wins until cleared)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._notice: PreemptionNotice | None = None

    @property
    def pending(self) -> PreemptionNotice | None:
        """The pending notice; a plain attribute read, cheap enough for every training step."""
        return self._notice

    def post(self, notice: PreemptionNotice) -> bool:
        """Make ``notice`` pending unless one already is; True if it was taken."""
        with self._lock:
            if self._notice is not None:
                return False
            self._notice = notice
        log.warning("preemption notice: %s", notice)
        return True

    def clear(self) -> None:
        """Forget the pending notice."""
        with self._lock:
            self._notice = None


@dataclass(frozen=True)
class SourceStatus:
    """A snapshot of one watcher: ``state`` is ``"detecting"``, ``"watching"``, ``"absent"``
    (an ``"auto"`` source that was not detected), ``"failed"`` or ``"stopped"``."""

    name: str
    state: str
    polls: int
    errors: int
    last_error: str | None


class Watcher:
    """One notice source, polled on a daemon thread until :meth:`stop`.

    Subclasses implement :meth:`present` (a cheap local check for ``"auto"``), :meth:`probe` (the
    first contact; raises if the source is not there) and :meth:`poll` (one poll, which calls
    :meth:`post` on a new event and raises one of :data:`TRANSPORT_ERRORS` on failure).
    """

    name = "watcher"

    def __init__(
        self,
        board: NoticeBoard,
        *,
        auto: bool,
        poll_interval_s: float,
        request_timeout_s: float = 2.0,
    ) -> None:
        self.auto = auto
        self.poll_interval_s = poll_interval_s
        self.request_timeout_s = request_timeout_s
        self._board = board
        self._stopping = threading.Event()
        self._settled = threading.Event()  # detection is over, either way
        self._http = Requester()
        self._state = "detecting"
        self._polls = 0
        self._errors = 0
        self._last_error: str | None = None
        self._thread = threading.Thread(
            target=self._main, name=f"ckptmgr-preemption-{self.name}", daemon=True
        )

    # -- for subclasses --------------------------------------------------------------------------
    def present(self) -> bool:
        """Cheap local evidence (no network) that this source can exist here."""
        return True

    def probe(self, timeout: float) -> None:
        """First contact; raises if the source does not answer as expected."""

    def poll(self) -> None:
        """One poll: :meth:`post` a notice on a new event; raise on failure."""
        raise NotImplementedError

    def pause_after_poll(self) -> float:
        """Seconds to wait between successful polls (long polls return 0)."""
        return self.poll_interval_s

    def post(self, source: str, detail: str = "") -> None:
        """Post a notice from this source."""
        self._board.post(PreemptionNotice(source=source, received_at=time.time(), detail=detail))

    def sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` unless stopped; True if stopping."""
        return self._stopping.wait(seconds)

    @property
    def http(self) -> Requester:
        """The abortable HTTP client of this watcher."""
        return self._http

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the daemon thread (detection runs there, never in the caller)."""
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to stop and abort its request in flight; does not wait."""
        self._stopping.set()
        self._http.abort()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the thread; True if it has ended."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def wait_settled(self, timeout: float) -> bool:
        """Wait until detection is over; True if it is."""
        return self._settled.wait(timeout)

    def status(self) -> SourceStatus:
        """A snapshot of the state and counters."""
        return SourceStatus(self.name, self._state, self._polls, self._errors, self._last_error)

    # -- the thread ------------------------------------------------------------------------------
    def _backoff(self, failures: int) -> float:
        return min(self.poll_interval_s, 0.25 * 2 ** min(failures - 1, 10))

    def _detect(self) -> bool:
        """Run detection; True if the source should be watched."""
        if self.auto:
            if not self.present():
                log.debug("preemption source %s: not detected on this machine", self.name)
                return False
            try:
                self.probe(DETECT_TIMEOUT_S)
            except TRANSPORT_ERRORS as error:
                log.debug("preemption source %s: not detected (%s)", self.name, error)
                return False
            return True
        failures = 0
        while not self._stopping.is_set():
            try:
                self.probe(self.request_timeout_s)
                return True
            except TRANSPORT_ERRORS as error:
                failures += 1
                self._note_error(error, failures)
                self.sleep(self._backoff(failures))
        return False

    def _note_error(self, error: BaseException, failures: int) -> None:
        if self._stopping.is_set():
            return  # the request was aborted by stop()
        self._errors += 1
        self._last_error = f"{type(error).__name__}: {error}"
        level = logging.WARNING if failures == 1 and not self.auto else logging.DEBUG
        log.log(level, "preemption source %s: %s (retrying)", self.name, self._last_error)

    def _main(self) -> None:
        try:
            if not self._detect():
                self._state = "stopped" if self._stopping.is_set() else "absent"
                return
            self._state = "watching"
            log.info("preemption source %s: watching", self.name)
            self._settled.set()
            failures = 0
            while not self._stopping.is_set():
                try:
                    self.poll()
                except TRANSPORT_ERRORS as error:
                    failures += 1
                    self._note_error(error, failures)
                    self.sleep(self._backoff(failures))
                    continue
                self._polls += 1
                if failures:
                    log.info("preemption source %s: answering again", self.name)
                    failures = 0
                self.sleep(self.pause_after_poll())
            self._state = "stopped"
        except Exception:
            self._state = "failed"
            log.exception("preemption source %s failed; it gives no more notices", self.name)
        finally:
            self._settled.set()
