"""The background writer: jobs in order and one at a time, and no save stranded and no hang at
interpreter exit when a signal handler's exception interrupts ``save_async``."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch
from conftest import REPO

from ckptmgr import CheckpointManager
from ckptmgr.background import BackgroundWriter
from ckptmgr.errors import CheckpointError

CHILD = Path(__file__).resolve().parent / "_interrupted_save_child.py"
EXIT_TIMEOUT_S = 60.0


def test_jobs_run_one_at_a_time_in_submission_order() -> None:
    writer = BackgroundWriter()
    events: list[str] = []
    running = threading.Lock()

    def job(number: int) -> None:
        assert running.acquire(blocking=False), "two jobs ran at once"
        try:
            events.append(f"start {number}")
            events.append(f"end {number}")
        finally:
            running.release()

    futures = [writer.submit(f"job {n}", lambda n=n: job(n)) for n in range(50)]
    writer.wait()
    assert all(future.done() and future.exception() is None for future in futures)
    assert events == [f"{kind} {n}" for n in range(50) for kind in ("start", "end")]
    writer.shutdown()


def test_a_failure_is_kept_and_raised_once_or_given_to_the_waiting_caller() -> None:
    writer = BackgroundWriter()

    def fail() -> None:
        raise OSError("disk gone")

    writer.submit("kept save", fail)
    given = writer.submit("waited-for save", fail, keep_error=False)
    writer.wait()
    with pytest.raises(CheckpointError, match="waited-for save failed: OSError: disk gone"):
        given.result(timeout=0)
    with pytest.raises(CheckpointError, match="kept save failed: OSError: disk gone"):
        writer.raise_first_error()
    writer.raise_first_error()  # reported once
    writer.shutdown()


def test_shutdown_ends_the_thread_and_a_later_submit_starts_another() -> None:
    writer = BackgroundWriter()
    writer.submit("first", lambda: None).result(timeout=EXIT_TIMEOUT_S)
    writer.shutdown()
    assert not [t for t in threading.enumerate() if t.name == "ckptmgr-writer" and t.is_alive()]
    assert writer.submit("second", lambda: 7).result(timeout=EXIT_TIMEOUT_S) is None
    writer.shutdown()


def test_a_manager_dropped_without_close_is_collected_and_its_thread_ends(
    tmp_path: Path,
) -> None:
    """The worker thread kept its last job (whose closure holds the manager) in its frame, so
    a manager that had saved and was then dropped without close() was never collected, nor
    did its thread (and, in process mode, its daemon) ever end."""
    manager = CheckpointManager(tmp_path / "ckpts", save_interval=1, chkpt_on_preemption=False)
    assert manager.save_async(1, {"w": torch.ones(8)})
    manager.join()
    thread = manager._writer._worker._thread  # internal: the manager's worker thread
    assert thread is not None and thread.is_alive()
    dropped = weakref.ref(manager)
    del manager
    gc.collect()
    assert dropped() is None, gc.get_referrers(dropped())
    thread.join(EXIT_TIMEOUT_S)
    assert not thread.is_alive()


def run_child(root: Path, mode: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, str(CHILD), str(root), mode],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=EXIT_TIMEOUT_S,  # a hang at exit fails here
    )


def committed_steps(root: Path) -> list[int]:
    with CheckpointManager(root, save_interval=1, chkpt_on_preemption=False) as manager:
        return manager.all_steps()


@pytest.mark.parametrize("mode", ["after", "before"])
def test_an_exception_raised_into_save_async_strands_no_save_and_no_thread(
    tmp_path: Path, mode: str
) -> None:
    """``after``: the thread started, the program ends without close(); ``before``: no thread
    was started, close() must still run the queued save. Either way the process exits and the
    save is committed (ThreadPoolExecutor hung at exit, or in close(), here)."""
    result = run_child(tmp_path / "ckpts", mode)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "interrupted", result.stdout
    assert lines[1:] == (["closed"] if mode == "before" else []), result.stdout
    assert committed_steps(tmp_path / "ckpts") == [1]
