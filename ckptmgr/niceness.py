"""Running ckptmgr's background work below the training loop's scheduling priority.

When the cores are busy, the training loop should run first and a checkpoint's writing and
hashing wait. On Linux every thread has its own nice value, which threads it starts inherit, so
each background thread (the thread-mode writer, the hashing thread, every thread of process
mode's daemon) puts itself at one level: :data:`BACKGROUND_NICENESS` above the training
process's main thread. It is one level, not a step per thread, because the threads start one
another (the writer starts the hashing thread and the daemon; the daemon's writer threads start
hashing threads), and steps would add up to the kernel's lowest priority, 19.
"""

from __future__ import annotations

import os
import threading

BACKGROUND_NICENESS = 10
"""How much higher than the training process's main thread's nice value ckptmgr's background
threads' is: with the cores busy, the training loop runs first; with a core to spare, as on most
GPU machines, the background work runs as fast as before."""

_MAX_NICENESS = 19  # the kernel's lowest priority

_background_niceness: int | None = None
"""The level set by :func:`set_background_niceness` (in the daemon: its training process's)."""


def background_niceness() -> int | None:
    """The nice value ckptmgr's background threads run at: the one set in this process by
    :func:`set_background_niceness`, or else :data:`BACKGROUND_NICENESS` above this process's
    main thread (at most 19). None where nice values cannot be read."""
    if _background_niceness is not None:
        return _background_niceness
    try:
        main = os.getpriority(os.PRIO_PROCESS, os.getpid())  # Linux: the main thread's (tid)
    except (AttributeError, OSError):
        return None
    return min(_MAX_NICENESS, main + BACKGROUND_NICENESS)


def set_background_niceness(niceness: int) -> None:
    """Make ``niceness`` this process's background level (for a helper process whose training
    process is another one) and put every thread of the process at least that low (on Linux,
    where each thread has its own, from ``/proc/self/task``; elsewhere the calling thread).
    Threads started afterwards by one of them inherit it."""
    global _background_niceness
    _background_niceness = niceness
    try:
        tids = [int(task) for task in os.listdir("/proc/self/task")]
    except OSError:  # not Linux
        tids = [threading.get_native_id()]
    for tid in tids:
        _lower_to(tid, niceness)


def run_calling_thread_in_background() -> None:
    """Put the calling thread at :func:`background_niceness` (never raising a thread's
    priority: one already lower stays). Nothing where that is not supported or allowed."""
    niceness = background_niceness()
    if niceness is not None:
        _lower_to(threading.get_native_id(), niceness)


def _lower_to(tid: int, niceness: int) -> None:
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < niceness:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
    except (AttributeError, OSError):  # not supported, not allowed, or the thread has ended
        pass
