"""Child process for test_background.py: an exception raised into ``save_async`` while it starts
the writer thread, as a signal handler raises one (``KeyboardInterrupt`` on Ctrl-C, PyTorch's
DataLoader error when a worker is killed).

Usage: ``python _interrupted_save_child.py CHECKPOINT_DIR after|before``. ``after``: the exception
comes once the thread is running, and the program ends without ``close()``, as one whose
exception escaped would. ``before``: it comes before the thread exists; the program then calls
``close()``. Prints ``interrupted`` when ``save_async`` raised, ``closed`` after ``close()``.
"""

from __future__ import annotations

import sys
import threading

import torch

from ckptmgr import CheckpointManager


def main(root: str, mode: str) -> int:
    manager = CheckpointManager(root, save_interval=1, chkpt_on_preemption=False)
    original_start = threading.Thread.start

    def interrupted_start(thread: threading.Thread) -> None:
        if not thread.name.startswith("ckptmgr-writer"):
            original_start(thread)
            return
        threading.Thread.start = original_start  # type: ignore[method-assign]
        if mode == "after":
            original_start(thread)
        raise KeyboardInterrupt

    threading.Thread.start = interrupted_start  # type: ignore[method-assign]
    try:
        manager.save_async(1, {"weights": torch.arange(1000, dtype=torch.float32)})
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    if mode == "before":
        manager.close()
        print("closed", flush=True)
    else:  # alive until exit, as a script's global manager, or one held by a traceback
        globals()["kept_manager"] = manager
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
