"""One background worker that runs async saves in order and keeps their errors for the caller."""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from ckptmgr.errors import CheckpointError
from ckptmgr.niceness import run_calling_thread_in_background

log = logging.getLogger(__name__)

_IDLE_POLL_S = 0.2
"""How often an idle worker checks whether the interpreter is shutting down."""

WAIT_SLICE_S = 0.5
"""A wait for background jobs wakes at least this often. Python runs a signal's handler (Ctrl-C's
KeyboardInterrupt) between bytecodes, and a thread blocked on a lock is woken by the signal
only once it is in the system call: a signal that lands after the last check and before the
thread blocks (more likely on a loaded machine) would be acted on only when the lock is
released, at the end of the save. Waking from time to time bounds that delay."""


def result_of(future: concurrent.futures.Future[Any]) -> Any:
    """``future.result()``, waiting in slices of :data:`WAIT_SLICE_S` (see there)."""
    while True:
        try:
            return future.result(timeout=WAIT_SLICE_S)
        except concurrent.futures.TimeoutError:
            if future.done():  # (the job's own TimeoutError)
                raise


_Job = tuple[concurrent.futures.Future[Any], Callable[[], None]]


class FailureHandover:
    """Where a synchronous job's failure goes: to the caller waiting for it, or, once that
    caller has stopped waiting (Ctrl-C), to the writer's kept failures, for ``join()``. Decided
    under one lock, so a failure is never lost between the two nor kept twice."""

    def __init__(self, writer: BackgroundWriter) -> None:
        self._writer = writer
        self._lock = threading.Lock()
        self._caller_gone = False
        self._failure: CheckpointError | None = None

    def keeps(self, error: CheckpointError) -> bool:
        """The job failed with ``error``: True when it is kept (nobody waits for it)."""
        with self._lock:
            if not self._caller_gone:
                self._failure = error  # the caller gets it from the future
                return False
        self._writer.record_error(error)
        return True

    def caller_gone(self) -> None:
        """The caller stopped waiting: keep the job's failure, now or when it comes."""
        with self._lock:
            self._caller_gone = True
            failure, self._failure = self._failure, None
        if failure is not None:  # it failed while the caller was being interrupted
            log.error("a save whose caller stopped waiting failed: %s", failure)
            self._writer.record_error(failure)


class _Worker:
    """The thread that runs jobs one at a time, in the order they were queued.

    Written for the exceptions that a signal handler raises at any point of the training thread
    (``KeyboardInterrupt``, or PyTorch's DataLoader error when a worker process is killed): an
    exception between queueing a job and starting the thread must neither strand the job nor
    leave a thread that keeps the interpreter from exiting. ``ThreadPoolExecutor`` fails the
    second way when it is interrupted inside ``Thread.start()``: the thread is never registered
    for its wake-up at exit, and the interpreter waits for it forever. So this thread is started
    by every call that finds none alive, serves under a lock (at most one serves at a time, even
    if an interrupted start left two), finishes every queued job, and ends when asked or when it
    is idle after the main thread has finished (interpreter exit waits for queued saves, as for
    any non-daemon thread, and no longer).
    """

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._serving = threading.Lock()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def put(self, job: _Job) -> None:
        """Queue ``job`` and make sure a thread will run it."""
        self.jobs.put(job)
        self.ensure_running()

    def ensure_running(self, *, cancel_stop: bool = True) -> None:
        """Start a thread unless one is alive (and with ``cancel_stop`` cancel a :meth:`stop`:
        a thread started without it runs the queued jobs, then ends)."""
        with self._lock:
            if cancel_stop:
                self._stopping = False  # a job queued after stop() is run too
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self._serve, name="ckptmgr-writer")
            self._thread.start()

    def stop(self) -> None:
        """Let the thread end once the queued jobs are done (returns at once)."""
        self._stopping = True
        self.jobs.put(None)  # wakes an idle thread

    def join(self) -> None:
        """Wait until the thread has ended (after :meth:`stop`)."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _serve(self) -> None:
        run_calling_thread_in_background()  # below the training loop; threads it starts too
        with self._serving:
            while True:
                try:
                    job = self.jobs.get(timeout=_IDLE_POLL_S)
                except queue.Empty:
                    job = None
                if job is None:  # idle, or woken by stop()
                    with self._lock:  # ensure_running() sees either this thread or none
                        ending = self._stopping or not threading.main_thread().is_alive()
                        if ending and self.jobs.empty():
                            if self._thread is threading.current_thread():
                                self._thread = None
                            return
                    continue
                future, run = job
                if future.set_running_or_notify_cancel():
                    run()
                # The last job's closure holds its manager: kept in this frame while idle, it
                # would keep a manager dropped without close() (and this thread) alive.
                del job, future, run


class BackgroundWriter:
    """Runs submitted jobs on one worker thread; failures are raised later, exactly once."""

    def __init__(self) -> None:
        self._worker = _Worker()
        self._pending: list[concurrent.futures.Future[Any]] = []
        self._errors: list[CheckpointError] = []
        self._lock = threading.Lock()
        # shutdown() calls under way or done: while there is one, no job is taken (see submit)
        self._shutdowns = 0
        # A writer dropped without shutdown() (a manager never closed) lets its thread end.
        weakref.finalize(self, self._worker.stop).atexit = False

    def submit(
        self,
        description: str,
        job: Callable[[], Any],
        *,
        keep_error: bool | FailureHandover = True,
        cleanup: Callable[[], None] | None = None,
    ) -> concurrent.futures.Future[Any]:
        """Run ``job`` in the background; ``description`` names it in errors.

        With ``keep_error`` a failure is stored for :meth:`raise_first_error`; without it the
        caller gets it from the returned future (used by synchronous saves); a
        :class:`FailureHandover` decides when the job fails.
        ``cleanup`` runs after the job and after its failure is stored, so whoever waits on
        what ``cleanup`` frees sees the failure.

        Once :meth:`shutdown` has begun (``close()``, from another thread, or from inside the
        call that submits), the job is refused: ``cleanup`` runs here and ``CheckpointError``
        is raised. (Taken, it restarted the worker that shutdown() was stopping, whose join
        then waited for ever; or, after the shutdown, it ran with the manager's lease
        released.)
        """
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                self._run(description, job, keep_error, cleanup)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(None)

        with self._lock:  # (so that shutdown() waits for this job, or this call refuses it)
            refused = self._shutdowns > 0
            if not refused:
                # Queued first: if an exception interrupts this call in between, the save still
                # runs (a future listed but never queued would make wait() hang).
                self._worker.put((future, run))
                self._pending = [f for f in self._pending if not f.done()]
                self._pending.append(future)
        if refused:
            if cleanup is not None:
                cleanup()
            raise CheckpointError(f"{description} was refused: the CheckpointManager is closed")
        return future

    def _run(
        self,
        description: str,
        job: Callable[[], Any],
        keep_error: bool | FailureHandover,
        cleanup: Callable[[], None] | None,
    ) -> None:
        try:
            job()
        except BaseException as exc:  # DCP's CheckpointException derives from BaseException
            error = exc if isinstance(exc, CheckpointError) else None
            if error is None:
                error = CheckpointError(f"{description} failed: {_short(exc)}")
                error.__cause__ = exc
            if isinstance(keep_error, FailureHandover):
                if not keep_error.keeps(error):
                    raise error from error.__cause__
                log.error("%s failed (its caller stopped waiting)", description, exc_info=exc)
            elif not keep_error:
                raise error from error.__cause__
            else:
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
        if not self._worker.jobs.empty():  # an interrupted submit() may have queued a job only
            self._worker.ensure_running(cancel_stop=False)  # (or stop() its wake-up)
        with self._lock:
            pending = list(self._pending)
        while concurrent.futures.wait(pending, timeout=WAIT_SLICE_S).not_done:
            pass  # (woken now and then: see WAIT_SLICE_S)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]

    def take_errors(self) -> list[CheckpointError]:
        """The unreported background failures, oldest first; they count as reported."""
        with self._lock:
            errors, self._errors = self._errors, []
        return errors

    def raise_first_error(
        self, already_reported: Callable[[CheckpointError], bool] | None = None
    ) -> None:
        """Raise the oldest unreported background failure (once), if any; failures for which
        ``already_reported`` is true are dropped (reported another way)."""
        with self._lock:
            errors, self._errors = self._errors, []
        if already_reported is not None:
            errors = [error for error in errors if not already_reported(error)]
        if not errors:
            return
        error, rest = errors[0], errors[1:]
        for other in rest:
            if hasattr(error, "add_note"):  # Python >= 3.11
                error.add_note(f"another background save also failed: {other}")
        raise error

    def shutdown(self) -> None:
        """Refuse new jobs, wait for the queued ones and stop the worker thread. Interrupted
        while it waits (Ctrl-C), it takes jobs again (unless another call is under way), and
        may be called again."""
        with self._lock:
            self._shutdowns += 1
        try:
            self.wait()
            self._worker.stop()
            self._worker.join()
        except BaseException:  # (a job queued now cancels the stop: the worker serves on)
            with self._lock:
                self._shutdowns -= 1
            raise


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
