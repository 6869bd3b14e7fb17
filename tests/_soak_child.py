"""Zygote of tests/test_soak.py: imports torch once, then forks one worker per kill trial.

Run as a script (``python tests/_soak_child.py``) with the repository root on ``PYTHONPATH``.
Starting an interpreter that imports torch takes seconds; forking one that already has takes
milliseconds. So this process imports everything, prints ``ready``, and then, for every JSON
line (one trial's configuration) on its stdin:

1. forks a **worker** and prints ``forked <pid>``;
2. waits for the worker to die and prints ``reaped <pid> <signal number or -exit status>``.

The worker inherits stdout and writes its own lines with single ``os.write`` calls (atomic on a
pipe), so nothing it printed before a SIGKILL is lost or torn. Its lines are those of
``tests/_crash_child.py`` (``attempt``/``saved``/``queued``/``joined``), plus ``armed`` once the
kill window opens, ``restoring <step>`` before and ``restored <step>`` after each restore it
checked itself, and ``CORRUPT <step> <what>`` if one was not bit-exact.

Workloads (``phase``): ``save`` saves in a loop (sync and async, random ``max_to_keep``);
``delete`` saves with ``max_to_keep=1`` so that every commit deletes a step; ``restore``
commits a few steps and then mostly restores (and checks) random committed steps, saving one
now and then. Kills (``kill``): ``external`` means the test sends SIGKILL at a random time after
``armed``; ``self`` means the worker SIGKILLs itself right before its ``after_ops``-th file
system operation (``fsync``, ``rename``, ``replace``, ``unlink``, ``rmdir``, ``mkdir``; during
the ``delete`` phase only those inside a retention delete count), an exact and reproducible
moment. A watchdog (``SIGALRM``) ends a worker that is never killed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

CONFIG_WAIT_S = 600.0
COUNTED_OPS = ("fsync", "rename", "replace", "unlink", "rmdir", "mkdir")


def emit(line: str) -> None:
    """One line to stdout in one write(2): atomic on a pipe, never buffered across a fork."""
    os.write(1, (line + "\n").encode())


class SelfKiller:
    """Counts file system operations and SIGKILLs the process before the ``after_ops``-th."""

    def __init__(self, after_ops: int, only_in_delete: bool) -> None:
        self.after_ops = after_ops
        self.only_in_delete = only_in_delete
        self.armed = False
        self.count = 0
        self.in_delete = threading.local()
        self._lock = threading.Lock()

    def before_op(self) -> None:
        if not self.armed:
            return
        if self.only_in_delete and not getattr(self.in_delete, "active", False):
            return
        with self._lock:
            self.count += 1
            if self.count > self.after_ops:
                os.kill(os.getpid(), signal.SIGKILL)

    def install(self) -> None:
        """Wrap the counted ``os`` functions and the storage's step deletion."""
        from ckptmgr.storage import CheckpointStorage

        for name in COUNTED_OPS:
            original = getattr(os, name)
            setattr(os, name, self._counting(original))
        delete_step = CheckpointStorage.delete_step
        killer = self

        def counted_delete_step(storage: CheckpointStorage, step: int) -> None:
            killer.in_delete.active = True
            try:
                delete_step(storage, step)
            finally:
                killer.in_delete.active = False

        CheckpointStorage.delete_step = counted_delete_step  # type: ignore[method-assign]

    def _counting(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.before_op()
            return original(*args, **kwargs)

        return wrapper


def run_worker(config: dict[str, Any]) -> None:
    """The workload of one trial; never returns normally (killed, or the watchdog fires)."""
    import _crash_child as states

    from ckptmgr import CheckpointManager

    signal.alarm(int(config["watchdog_s"]))
    killer: SelfKiller | None = None
    kill = config["kill"]
    if kill["mode"] == "self":
        killer = SelfKiller(int(kill["after_ops"]), only_in_delete=config["phase"] == "delete")
        killer.install()
    rng = random.Random(config["seed"])
    spec = config["spec"]
    manager = CheckpointManager(
        config["root"],
        save_interval=1,
        max_to_keep=config["max_to_keep"],
        max_pending_async=config["max_pending_async"],
        chkpt_on_preemption=False,
    )
    state = states.blank_state(spec)
    phase = config["phase"]
    setup_steps = 3 if phase == "restore" else 1
    for step in range(config["max_steps"]):
        states.fill_state(state, step)
        if step == setup_steps:
            if killer is not None:
                killer.armed = True
            emit("armed")
        if phase == "restore" and step >= setup_steps:
            for _ in range(rng.randrange(2, 6)):
                restore_and_check(manager, spec, rng)
        sync = step < setup_steps or rng.random() < 0.5
        if sync:
            emit(f"attempt {step} sync")
            committed = manager.save(step, state)
            emit(f"saved {step} {committed}")
        else:
            emit(f"attempt {step} async")
            queued = manager.save_async(step, state)
            emit(f"queued {step} {queued}")
            if rng.random() < config["join_probability"]:
                manager.join()
                emit(f"joined {step}")
    emit("done")
    signal.pause()


def restore_and_check(manager: Any, spec: dict[str, int], rng: random.Random) -> None:
    """Restore a random committed step and compare it bit for bit with what was saved."""
    import _crash_child as states

    from ckptmgr import StepNotFoundError

    steps = manager.all_steps()
    if not steps:
        return
    step = rng.choice(steps)
    restored = states.blank_state(spec)
    emit(f"restoring {step}")
    try:
        manager.restore(step, restored)
    except StepNotFoundError:
        # restore() first waits for pending async saves, whose retention may delete the step.
        if step in manager.all_steps():
            raise
        emit(f"pruned {step}")
        return
    try:
        states.assert_bit_exact(restored, states.expected_state(step, spec), f"step {step}")
    except AssertionError as error:
        emit(f"CORRUPT {step} {str(error).splitlines()[0]}")
        os._exit(3)
    emit(f"restored {step}")


def main() -> int:
    import select

    import _crash_child  # noqa: F401  (imports torch: the slow part, done once)

    import ckptmgr  # noqa: F401

    emit("ready")
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], CONFIG_WAIT_S)
        if not readable:
            return 0
        line = sys.stdin.readline()
        if not line.strip():
            return 0
        config = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                run_worker(config)
            except BaseException as error:
                emit(f"ERROR {type(error).__name__}: {error}")
                os._exit(2)
            os._exit(0)
        emit(f"forked {pid}")
        _, status = os.waitpid(pid, 0)
        code = os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)
        emit(f"reaped {pid} {code}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
