"""No manager in a process that multiprocessing is still starting.

A process started with ``spawn`` (the checkpoint daemon of ``async_mode="process"``, a
``DataLoader`` worker where ``spawn`` is the default, ``torch.multiprocessing.spawn``) imports
the main module again before it runs its target. A script that makes its manager at the top
level, without an ``if __name__ == "__main__":`` guard, would make a second manager there: a
second job on the root, which opens it, sweeps it and competes for its owner lease, while the
process that started the child waits for an answer that never comes. Python itself refuses to
start a process at that point; ckptmgr refuses to make a manager, with a message that says what
to change.
"""

from __future__ import annotations

import multiprocessing.process

from ckptmgr.errors import CheckpointError

ENTRY_POINT_HINT = (
    'guard the script\'s entry point with `if __name__ == "__main__":` (a process started with '
    "multiprocessing's spawn, such as the checkpoint daemon of async_mode='process' or a "
    "DataLoader worker, imports the main module again)"
)
"""What to change when a manager is made while a spawned process starts."""


def refuse_while_bootstrapping() -> None:
    """Raise ``CheckpointError`` when this process is a child multiprocessing is still starting
    (importing the main module, or unpickling its target)."""
    if getattr(multiprocessing.process.current_process(), "_inheriting", False):
        raise CheckpointError(
            "a CheckpointManager is being made while this process is started by "
            f"multiprocessing, before it runs its target: {ENTRY_POINT_HINT}"
        )
