"""Preemption by a real SIGTERM: the next step is checkpointed and the loop can stop cleanly."""

from __future__ import annotations

import multiprocessing
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import IO

import pytest
import torch

from ckptmgr import CheckpointManager

REPO = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "_preempt_child.py"
LINE_TIMEOUT_S = 120.0  # the first line includes importing torch in a fresh interpreter
MAX_STEPS_BEFORE_SIGNAL = 20  # the child runs at most 50 steps


class LineReader:
    """Reads a stream's lines on a thread so that every wait for a line is bounded."""

    def __init__(self, stream: IO[str]) -> None:
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def next_line(self, timeout: float = LINE_TIMEOUT_S) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line from the child within {timeout} s") from None
        if line is None:
            raise AssertionError("the child closed its output early")
        return line


def parse(line: str) -> dict[str, str]:
    """``"step=3 saved=False"`` -> ``{"step": "3", "saved": "False"}`` (bare words map to "")."""
    fields = {}
    for word in line.split():
        key, _, value = word.partition("=")
        fields[key] = value
    return fields


@pytest.fixture
def child(ckpt_dir: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """The preemptible training loop in a child process; killed at teardown if still alive."""
    stderr_path = tmp_path / "child-stderr.txt"
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    with stderr_path.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), str(ckpt_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            cwd=REPO,
        )
    try:
        yield proc, stderr_path
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


def send(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def test_sigterm_checkpoints_the_next_step_and_chains_to_the_previous_handler(
    child: tuple[subprocess.Popen[str], Path], ckpt_dir: Path
) -> None:
    proc, stderr_path = child
    assert proc.stdout is not None
    lines = LineReader(proc.stdout)

    ready = parse(lines.next_line())
    assert "ready" in ready, ready
    assert ready["handler_installed"] == "True", "the manager did not install a SIGTERM handler"

    steps_before_signal = random.randint(1, MAX_STEPS_BEFORE_SIGNAL)
    for step in range(1, steps_before_signal + 1):
        send(proc, "go")
        report = parse(lines.next_line())
        assert report == {
            "step": str(step),
            "saved": "False",
            "reached": "False",
            "previous_calls": "0",
        }, report

    # The child now waits on stdin for the next step; the signal arrives before that step.
    proc.send_signal(signal.SIGTERM)
    send(proc, "go")
    preempted_step = steps_before_signal + 1
    report = parse(lines.next_line())
    assert report == {
        "step": str(preempted_step),
        "saved": "True",
        "reached": "True",
        "previous_calls": "1",
    }, f"{report}; child stderr:\n{stderr_path.read_text()}"

    closed = parse(lines.next_line())
    assert closed == {"closed": "", "handler_restored": "True", "previous_calls": "1"}, closed
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(timeout=LINE_TIMEOUT_S) == 0, stderr_path.read_text()

    with CheckpointManager(ckpt_dir, save_interval=1000, chkpt_on_preemption=False) as mgr:
        assert mgr.all_steps() == [preempted_step]
        state = {"weights": torch.full((16,), -1.0), "step": -1}
        mgr.restore(preempted_step, state)
    assert torch.equal(state["weights"], torch.full((16,), float(preempted_step)))
    assert state["step"] == preempted_step


def test_close_restores_the_previous_sigterm_handler(ckpt_dir: Path) -> None:
    calls: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        calls.append(signum)

    original = signal.signal(signal.SIGTERM, handler)
    try:
        mgr = CheckpointManager(ckpt_dir, save_interval=10, chkpt_on_preemption=True)
        assert signal.getsignal(signal.SIGTERM) is not handler
        mgr.close()
        assert signal.getsignal(signal.SIGTERM) is handler
        mgr.close()  # idempotent: the handler stays put
        assert signal.getsignal(signal.SIGTERM) is handler

        with CheckpointManager(ckpt_dir, save_interval=10, chkpt_on_preemption=True):
            assert signal.getsignal(signal.SIGTERM) is not handler
        assert signal.getsignal(signal.SIGTERM) is handler

        with CheckpointManager(ckpt_dir, save_interval=10, chkpt_on_preemption=False):
            assert signal.getsignal(signal.SIGTERM) is handler
        assert calls == []
    finally:
        signal.signal(signal.SIGTERM, original)


def test_close_restores_the_default_sigterm_disposition(ckpt_dir: Path) -> None:
    original = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with CheckpointManager(ckpt_dir, save_interval=10, chkpt_on_preemption=True):
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, original)


CLOSE_ORDER_CHILD = r"""
import signal, sys, tempfile, threading
from ckptmgr import CheckpointManager, PreemptionConfig

seen = []
before = lambda signum, frame: seen.append("before")
signal.signal(signal.SIGTERM, before)
config = PreemptionConfig(gce=False, aws=False, azure=False, tpu=False)
first = CheckpointManager(tempfile.mkdtemp(), 10, preemption=config)
second = CheckpointManager(tempfile.mkdtemp(), 10, preemption=config)  # on top of the first
first.close()  # the second still calls the first's handler, as the one before it
signal.raise_signal(signal.SIGTERM)
print("after a SIGTERM: second notified", second._preemption.notified, "before ran", seen)
second.close()
print("both closed: the handler before is back", signal.getsignal(signal.SIGTERM) is before)

first = CheckpointManager(tempfile.mkdtemp(), 10, preemption=config)
second = CheckpointManager(tempfile.mkdtemp(), 10, preemption=config)
first.close()
closing = threading.Thread(target=second.close)  # off the main thread: left installed
closing.start()
closing.join()
seen.clear()
signal.raise_signal(signal.SIGTERM)  # the first signal puts the handler before back, and reaches it
print("closed off the main thread: before ran", seen, signal.getsignal(signal.SIGTERM) is before)

signal.signal(signal.SIGTERM, signal.SIG_DFL)
first = CheckpointManager(tempfile.mkdtemp(), 10, preemption=config)
second = CheckpointManager(tempfile.mkdtemp(), 10, preemption=config)
first.close()  # the second, open, passes the signal on to the first: no default action
signal.raise_signal(signal.SIGTERM)
print("default below, the first closed: second notified", second._preemption.notified, flush=True)
second.close()

def chaining(signum, frame):  # a library's handler, installed after ours, that calls ours
    print("library handler ran", flush=True)
    if callable(previous):
        previous(signum, frame)

signal.signal(signal.SIGTERM, signal.SIG_DFL)
third = CheckpointManager(tempfile.mkdtemp(), 10, preemption=config)
previous = signal.signal(signal.SIGTERM, chaining)
third.close()
signal.raise_signal(signal.SIGTERM)  # passed on to the default action: the process ends
print("survived a SIGTERM", flush=True)
"""


def test_a_closed_managers_handler_under_a_later_one_passes_signals_on(tmp_path: Path) -> None:
    """A manager closed while a later handler sits on top of its own (a second manager made
    while it was open, or a library that calls the handler before it) cannot take its handler
    out: it passes signals on to the handler before it. It forgot that one and re-sent the
    signal to the process, which called it again: RecursionError for one SIGTERM. Once the
    later one closes too, the handler before both is back (the closed one was left installed).
    Where the one before it is the default, the signal's default action is taken: a SIGTERM
    that the library passed on was dropped, and the process lived on; but not while an open
    manager handles the signal (it passed it on to the closed one: the process died)."""
    from conftest import run_python

    result = run_python(CLOSE_ORDER_CHILD, timeout=120)
    assert result.returncode == -signal.SIGTERM, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "after a SIGTERM: second notified True before ran ['before']", lines
    assert lines[1] == "both closed: the handler before is back True", lines
    assert lines[2] == "closed off the main thread: before ran ['before'] True", lines
    assert lines[3] == "default below, the first closed: second notified True", lines
    assert lines[4:] == ["library handler ran"], lines


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_forked_child_dies_of_sigterm_although_it_inherited_the_handler(tmp_path: Path) -> None:
    """A forked child (a multiprocessing worker, say) inherits the manager's SIGTERM handler,
    which only notes a notice for the next save; but the parent's manager cannot save in the
    child, so the child ignored SIGTERM and terminate() left it running. In a forked child the
    handler now acts as the one before it: here the default, so the child dies."""
    bound_s = 60.0
    context = multiprocessing.get_context("fork")
    running = context.Event()

    def run() -> None:  # a SIGTERM before the child runs Python is dropped by CPython's fork
        running.set()
        time.sleep(4 * bound_s)

    manager = CheckpointManager(tmp_path, 1)  # chkpt_on_preemption=True: handles SIGTERM
    child = context.Process(target=run)
    try:
        child.start()
        assert running.wait(bound_s)
        child.terminate()
        child.join(bound_s)
        assert child.exitcode == -signal.SIGTERM, "the child ignored SIGTERM"
    finally:
        if child.exitcode is None:
            child.kill()
            child.join(bound_s)
        manager.close()
