"""Keep DataLoader workers alive when a preemption signal goes to the whole process group.

SLURM, ``kill -TERM -PGID`` and Ctrl-C signal every process of the group. PyTorch's DataLoader
workers die of SIGTERM (their handler exits only when the parent sends it), the main process
then raises ``DataLoader worker (pid ...) is killed by signal: Terminated`` before it can save.
Use :func:`ignore_preemption_signals_in_worker` (or :class:`WorkerSignalGuard`) as the
``worker_init_fn``: the workers ignore these signals, except a SIGTERM from their parent (how
the DataLoader and multiprocessing shut workers down), which still ends the worker at once.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType

from ckptmgr.notices.signal_names import notice_signal_names

#: Signals that preemption sends to whole process groups (SLURM ``--signal``, SIGTERM).
DEFAULT_WORKER_SIGNALS: tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGUSR2")


def _ignore(signum: int, frame: FrameType | None) -> None:
    """Python-level no-op handler, used where ``sigwaitinfo`` is unavailable (macOS)."""


def _parents() -> set[int]:
    pids = {os.getppid()}
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        pids.add(parent.pid)  # with spawn/forkserver the OS parent is not the creator
    return pids


def _drain(signums: set[signal.Signals], parents: set[int]) -> None:
    """Take the blocked signals one by one; a SIGTERM from the parent ends the worker."""
    while True:
        info = signal.sigwaitinfo(signums)
        if info.si_signo == signal.SIGTERM and info.si_pid in parents:
            os._exit(0)  # what PyTorch's own worker SIGTERM handler does for its parent


class WorkerSignalGuard:
    """A picklable ``worker_init_fn``: makes the worker ignore ``signals`` (names such as
    ``"SIGTERM"``, or ``"TERM"``), then calls ``then(worker_id)`` if given.

    The names are checked here, rather than in a worker, as :class:`ckptmgr.PreemptionConfig`
    checks its own: ``ValueError`` for an unknown name, SIGKILL or SIGSTOP (which cannot be
    caught), or a signal sent in normal operation (SIGCHLD, whose loss would break a worker's
    own child processes); ``TypeError`` for one string in place of a list."""

    def __init__(
        self,
        signals: Sequence[str] = DEFAULT_WORKER_SIGNALS,
        then: Callable[[int], None] | None = None,
    ) -> None:
        self.signals = tuple(notice_signal_names(signals, "WorkerSignalGuard's signals"))
        self.then = then

    def __call__(self, worker_id: int) -> None:
        signums = {signal.Signals[name] for name in self.signals}
        for signum in signums:  # also covers threads that existed before the mask below
            signal.signal(signum, _ignore)
        if hasattr(signal, "sigwaitinfo") and hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, signums)  # inherited by later threads
            threading.Thread(
                target=_drain,
                args=(signums, _parents()),
                name="ckptmgr-worker-signals",
                daemon=True,
            ).start()
        if self.then is not None:
            self.then(worker_id)


def ignore_preemption_signals_in_worker(worker_id: int) -> None:
    """``worker_init_fn`` for ``torch.utils.data.DataLoader``: the worker survives SIGTERM,
    SIGUSR1 and SIGUSR2 sent to the process group, so the main process can checkpoint."""
    WorkerSignalGuard()(worker_id)
