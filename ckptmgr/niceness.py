"""Running ckptmgr's background work below the training loop's scheduling priority.

When the cores are busy, the training loop should run first and a checkpoint's hashing or
writing wait: on Linux every thread has its own nice value, which threads it starts inherit.
"""

from __future__ import annotations

import os
import threading


def lower_calling_thread_priority(by: int) -> None:
    """Raise the calling thread's nice value by ``by`` (capped at 19 by the kernel); threads it
    starts afterwards inherit it. Nothing where that is not supported or not allowed."""
    _lower(threading.get_native_id(), by)


def lower_process_priority(by: int) -> None:
    """Raise the nice value of every thread of this process by ``by`` (on Linux, where each
    thread has its own, from ``/proc/self/task``; elsewhere the calling thread's). Threads
    started afterwards by one of them inherit it."""
    try:
        tids = [int(task) for task in os.listdir("/proc/self/task")]
    except OSError:  # not Linux
        tids = [threading.get_native_id()]
    for tid in tids:
        _lower(tid, by)


def _lower(tid: int, by: int) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + by)
    except (AttributeError, OSError):  # not supported, not allowed, or the thread has ended
        pass
