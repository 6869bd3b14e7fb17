"""Child process for test_preemption_signal.py: a training loop that is preempted by SIGTERM.

Usage: ``python _preempt_child.py CHECKPOINT_DIR``. Protocol on stdin/stdout, one line each:

- the child prints ``ready handler_installed=<bool>`` once the manager is created;
- for every step it waits for a ``go`` line on stdin, then runs the step and prints
  ``step=<n> saved=<bool> reached=<bool> previous_calls=<n>``;
- after the step at which ``reached_preemption`` is True it closes the manager and prints
  ``closed handler_restored=<bool> previous_calls=<n>``, then exits 0.

A Python SIGTERM handler is installed before the manager, to check that the manager's handler
chains to it and that ``close()`` puts it back.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

import torch

from ckptmgr import CheckpointManager

MAX_STEPS = 50

previous_calls: list[int] = []


def previous_handler(signum: int, frame: FrameType | None) -> None:
    """The application's own SIGTERM handler, installed before the manager."""
    previous_calls.append(signum)


def main(root: str) -> int:
    signal.signal(signal.SIGTERM, previous_handler)
    mgr = CheckpointManager(root, save_interval=1000, chkpt_on_preemption=True)
    installed = signal.getsignal(signal.SIGTERM) is not previous_handler
    print(f"ready handler_installed={installed}", flush=True)
    state = {"weights": torch.zeros(16), "step": 0}
    for step in range(1, MAX_STEPS + 1):
        if sys.stdin.readline().strip() != "go":
            print("stdin closed", flush=True)
            return 3
        state["weights"].fill_(float(step))
        state["step"] = step
        saved = mgr.save_async(step, state)
        reached = mgr.reached_preemption(step)
        print(
            f"step={step} saved={saved} reached={reached} previous_calls={len(previous_calls)}",
            flush=True,
        )
        if reached:
            break
    else:
        print("no preemption checkpoint was taken", flush=True)
        return 4
    mgr.close()
    restored = signal.getsignal(signal.SIGTERM) is previous_handler
    print(f"closed handler_restored={restored} previous_calls={len(previous_calls)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
