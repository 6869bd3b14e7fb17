"""SIGTERM to a whole process group whose training loop reads a DataLoader with 2 workers.

Without help the workers die of the signal and the main process fails with PyTorch's "DataLoader
worker ... killed by signal" error; with ``ignore_preemption_signals_in_worker`` as the
``worker_init_fn`` the workers live on, the main process commits its preemption checkpoint,
and it still exits promptly with the loader's iterator left open.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest
from conftest import REPO

from ckptmgr import CheckpointManager

CHILD = Path(__file__).resolve().parent / "_dataloader_child.py"
LINE_TIMEOUT_S = 120.0  # the first step includes importing torch and starting the workers
EXIT_TIMEOUT_S = 60.0
SIGNAL_AFTER_STEP = 3


class Lines:
    """Collects a stream's lines on a thread; every wait is bounded."""

    def __init__(self, stream: IO[str]) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, wanted: str, timeout: float = LINE_TIMEOUT_S) -> None:
        while True:
            try:
                line = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no {wanted!r} line within {timeout} s") from None
            if line is None:
                raise AssertionError(f"the child ended before printing {wanted!r}: {self.seen}")
            self.seen.append(line)
            if line == wanted:
                return

    def rest(self, timeout: float = EXIT_TIMEOUT_S) -> list[str]:
        while True:
            try:
                line = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"the child's output did not end within {timeout} s") from None
            if line is None:
                return self.seen
            self.seen.append(line)


Started = tuple[subprocess.Popen[str], Lines, Path]


@pytest.fixture
def run_child(ckpt_dir: Path, tmp_path: Path) -> Iterator[Callable[[str], Started]]:
    """Starts the child in its own session; at teardown the whole group is killed if needed."""
    started: list[subprocess.Popen[str]] = []

    def start(mode: str) -> Started:
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
        stderr_path = tmp_path / f"stderr-{mode}.txt"
        with stderr_path.open("w") as stderr:
            proc = subprocess.Popen(
                [sys.executable, str(CHILD), str(ckpt_dir), mode],
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=env,
                cwd=REPO,
                start_new_session=True,  # its own process group, shared with its workers
            )
        started.append(proc)
        assert proc.stdout is not None
        return proc, Lines(proc.stdout), stderr_path

    yield start
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and any worker left behind
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


def wait_for_exit(proc: subprocess.Popen[str], stderr_path: Path) -> int:
    """The child's exit status; if it does not exit within EXIT_TIMEOUT_S, fail with the stacks
    of all its threads (the child dumps them to stderr on SIGUSR1)."""
    try:
        return proc.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGUSR1)
        try:
            proc.wait(timeout=5)  # no exit is expected: this only gives the dump time
        except subprocess.TimeoutExpired:
            pass
        stderr = stderr_path.read_text()
        raise AssertionError(
            f"the child did not exit within {EXIT_TIMEOUT_S} s; its stderr:\n{stderr[-8000:]}"
        ) from None


def committed_steps(ckpt_dir: Path) -> list[int]:
    with CheckpointManager(ckpt_dir, save_interval=1000, chkpt_on_preemption=False) as mgr:
        return mgr.all_steps()


def test_without_the_guard_the_workers_die_and_take_the_main_process_down(
    run_child: Callable[[str], Started],
) -> None:
    proc, lines, stderr_path = run_child("plain")
    lines.wait_for(f"step={SIGNAL_AFTER_STEP}")
    os.killpg(proc.pid, signal.SIGTERM)
    returncode = wait_for_exit(proc, stderr_path)
    output = lines.rest()
    stderr = stderr_path.read_text()
    assert returncode != 0, output
    assert "DataLoader worker" in stderr, stderr[-3000:]
    assert "killed by signal" in stderr or "exited unexpectedly" in stderr, stderr[-3000:]
    assert not any(line.startswith("workers_alive") for line in output)


def test_with_the_guard_the_main_process_checkpoints_and_exits_cleanly(
    run_child: Callable[[str], Started], ckpt_dir: Path
) -> None:
    proc, lines, stderr_path = run_child("guard")
    lines.wait_for(f"step={SIGNAL_AFTER_STEP}")
    os.killpg(proc.pid, signal.SIGTERM)
    returncode = wait_for_exit(proc, stderr_path)  # exit also stops the workers (no hang)
    output = lines.rest()
    stderr = stderr_path.read_text()
    assert returncode == 0, f"{output[-5:]}\n{stderr[-3000:]}"
    preempted = [line for line in output if line.startswith("preempted step=")]
    assert len(preempted) == 1, output
    step = int(preempted[0].partition("=")[2])
    assert step > SIGNAL_AFTER_STEP
    assert any(line.startswith("workers_alive batch=") for line in output), output
    assert committed_steps(ckpt_dir) == [step]
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # no process of the group (no worker) outlived the child
