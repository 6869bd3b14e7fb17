"""One background worker that runs async saves in order and keeps their errors for the caller."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

from ckptmgr.errors import CheckpointError

log = logging.getLogger(__name__)


class BackgroundWriter:
    """Runs submitted jobs on one worker thread; failures are raised later, exactly once."""

    def __init__(self) -> None:
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future[Any]] = []
        self._errors: list[CheckpointError] = []
        self._lock = threading.Lock()

    def submit(
        self,
        description: str,
        job: Callable[[], Any],
        *,
        keep_error: bool = True,
        cleanup: Callable[[], None] | None = None,
    ) -> concurrent.futures.Future[Any]:
        """Run ``job`` in the background; ``description`` names it in errors.

        With ``keep_error`` a failure is stored for :meth:`raise_first_error`; without it the
        caller gets it from the returned future (used by synchronous saves). ``cleanup`` runs
        after the job and after its failure is stored, so whoever waits on what ``cleanup``
        frees sees the failure.
        """
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="ckptmgr-writer"
            )
        future = self._executor.submit(self._run, description, job, keep_error, cleanup)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(future)
        return future

    def _run(
        self,
        description: str,
        job: Callable[[], Any],
        keep_error: bool,
        cleanup: Callable[[], None] | None,
    ) -> None:
        try:
            job()
        except BaseException as exc:  # DCP's CheckpointException derives from BaseException
            error = exc if isinstance(exc, CheckpointError) else None
            if error is None:
                error = CheckpointError(f"{description} failed: {_short(exc)}")
                error.__cause__ = exc
            if not keep_error:
                raise error from error.__cause__
            log.error("%s failed", description, exc_info=exc)
            self.record_error(error)
        finally:
            if cleanup is not None:
                cleanup()

    def record_error(self, error: CheckpointError) -> None:
        """Keep ``error`` to be raised by :meth:`raise_first_error`."""
        with self._lock:
            self._errors.append(error)

    def wait(self) -> None:
        """Wait for every submitted job."""
        with self._lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]

    def raise_first_error(self) -> None:
        """Raise the oldest unreported background failure (once), if any."""
        with self._lock:
            if not self._errors:
                return
            error, rest = self._errors[0], self._errors[1:]
            self._errors = []
        for other in rest:
            if hasattr(error, "add_note"):  # Python >= 3.11
                error.add_note(f"another background save also failed: {other}")
        raise error

    def shutdown(self) -> None:
        """Wait for the jobs and stop the worker thread."""
        self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
