"""The background writer: jobs in order and one at a time, and no save stranded and no hang at
interpreter exit when a signal handler's exception interrupts ``save_async``."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
from conftest import REPO, held_dcp_writes, run_bounded, run_python

from ckptmgr import CheckpointManager, dcp_io
from ckptmgr.background import BackgroundWriter
from ckptmgr.errors import CheckpointError
from ckptmgr.niceness import BACKGROUND_NICENESS

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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values: Linux")
def test_jobs_run_below_the_training_threads_priority_and_so_do_their_threads() -> None:
    # When the cores are busy the training loop runs first (BACKGROUND_NICENESS), in thread mode
    # as in process mode; threads a job starts (DCP's writer threads) inherit the lower priority.
    writer = BackgroundWriter()
    seen: dict[str, int] = {}

    def job() -> None:
        seen["job"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        child = threading.Thread(
            target=lambda: seen.update(
                child=os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            )
        )
        child.start()
        child.join(EXIT_TIMEOUT_S)

    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    writer.submit("job", job).result(timeout=EXIT_TIMEOUT_S)
    writer.shutdown()
    expected = min(19, own + BACKGROUND_NICENESS)
    assert seen == {"job": expected, "child": expected}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # the caller's stays


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


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ckptmgr-writer" and t.is_alive()]


def test_shutdown_ends_the_thread_and_a_later_submit_is_refused_and_cleaned_up() -> None:
    # A later submit started another thread (after close(): a save with the lease released).
    writer = BackgroundWriter()
    writer.submit("first", lambda: None).result(timeout=EXIT_TIMEOUT_S)
    writer.shutdown()
    assert not writer_threads()
    ran: list[str] = []
    with pytest.raises(CheckpointError, match="second was refused: the CheckpointManager is"):
        writer.submit("second", lambda: ran.append("job"), cleanup=lambda: ran.append("cleanup"))
    assert ran == ["cleanup"] and not writer_threads()
    writer.shutdown()


def test_an_interrupted_shutdown_takes_jobs_again() -> None:
    writer = BackgroundWriter()
    real_wait = writer.wait

    def interrupted_wait() -> None:
        raise KeyboardInterrupt  # Ctrl-C while close() waits for the saves

    writer.wait = interrupted_wait  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        writer.shutdown()
    writer.wait = real_wait  # type: ignore[method-assign]
    assert writer.submit("after", lambda: 7).result(timeout=EXIT_TIMEOUT_S) is None
    writer.shutdown()
    assert not writer_threads()


def test_a_shutdown_interrupted_while_it_joins_the_thread_takes_jobs_again() -> None:
    # Ctrl-C after the wait, while the worker thread was joined: new jobs stayed refused ("the
    # CheckpointManager is closed") in a manager that was not closed.
    writer = BackgroundWriter()
    writer.submit("first", lambda: None).result(timeout=EXIT_TIMEOUT_S)
    real_join = writer._worker.join  # internal: the last step of shutdown()

    def interrupted_join() -> None:
        raise KeyboardInterrupt

    writer._worker.join = interrupted_join  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        writer.shutdown()
    writer._worker.join = real_join  # type: ignore[method-assign]
    assert writer.submit("after", lambda: 7).result(timeout=EXIT_TIMEOUT_S) is None
    writer.shutdown()
    assert not writer_threads()


def test_jobs_stay_refused_while_another_shutdown_waits_though_one_was_interrupted() -> None:
    # close() from two threads at once, one of them interrupted (Ctrl-C) while it waited: the
    # interrupted one took jobs again while the other went on shutting down, so a save got in
    # (to commit after that close() released the lease, or to keep its join() waiting).
    writer = BackgroundWriter()
    release = threading.Event()
    writer.submit("held", lambda: release.wait(EXIT_TIMEOUT_S))
    real_wait = writer.wait
    other_waits = threading.Event()

    def wait() -> None:
        if threading.current_thread() is threading.main_thread():
            assert other_waits.wait(EXIT_TIMEOUT_S)
            raise KeyboardInterrupt  # Ctrl-C while this close() waits for the saves
        other_waits.set()
        real_wait()

    writer.wait = wait  # type: ignore[method-assign]
    other = threading.Thread(target=writer.shutdown)
    other.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            writer.shutdown()
        ran: list[str] = []
        with pytest.raises(CheckpointError, match="late was refused"):
            writer.submit("late", lambda: ran.append("job"), cleanup=lambda: ran.append("cleanup"))
        assert ran == ["cleanup"]
    finally:
        release.set()
        other.join(EXIT_TIMEOUT_S)
    assert not other.is_alive() and not writer_threads()


def test_close_while_another_thread_saves_returns_and_refuses_the_later_saves(
    tmp_path: Path,
) -> None:
    """close() stopped the writer, a save_async from another thread restarted it (and cancelled
    the stop), and close() then waited for that thread for ever."""
    root = tmp_path / "ckpts"
    manager = CheckpointManager(root, save_interval=1, chkpt_on_preemption=False)
    saved: list[int] = []
    outcome: list[BaseException] = []
    started = threading.Event()

    def save_until_refused() -> None:
        try:
            for step in range(10_000):
                if manager.save_async(step, {"w": torch.full((256,), float(step))}):
                    saved.append(step)
                started.set()
        except BaseException as exc:  # (what ended it: asserted below)
            outcome.append(exc)
        started.set()

    saver = threading.Thread(target=save_until_refused, daemon=True)
    saver.start()
    assert started.wait(EXIT_TIMEOUT_S)
    closer = threading.Thread(target=manager.close, daemon=True)
    closer.start()
    closer.join(EXIT_TIMEOUT_S)
    assert not closer.is_alive(), "close() still waits"
    saver.join(EXIT_TIMEOUT_S)
    assert not saver.is_alive() and len(outcome) == 1, outcome
    assert isinstance(outcome[0], CheckpointError) and "closed" in str(outcome[0])
    assert not writer_threads() and not (root / "owner.json").exists()
    with CheckpointManager(root, save_interval=1, read_only=True) as reader:
        assert reader.all_steps() == saved  # every save that returned True, and no other


class ClosesTheManager:
    """A stateful object whose state_dict() closes the manager (another thread's close() lands
    in the same window: after the save's check that the manager is open)."""

    def __init__(self) -> None:
        self.manager: CheckpointManager | None = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        assert self.manager is not None
        self.manager.close()
        return {"w": torch.ones(8)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass


@pytest.mark.parametrize("call", ["save", "save_async"])
def test_a_save_that_the_manager_is_closed_under_writes_nothing(tmp_path: Path, call: str) -> None:
    """It committed its step after close() had released the lease, and left a writer thread."""
    root = tmp_path / "ckpts"
    manager = CheckpointManager(root, save_interval=1, chkpt_on_preemption=False)
    closing = ClosesTheManager()
    closing.manager = manager
    with pytest.raises(CheckpointError, match="refused: the CheckpointManager is closed"):
        getattr(manager, call)(5, {"obj": closing})
    assert not writer_threads() and not (root / "owner.json").exists()
    assert manager._staging.nbytes == 0  # internal: a refused save_async staged, then freed
    assert sorted(path.name for path in root.iterdir()) == []
    with CheckpointManager(root, save_interval=1, read_only=True) as reader:
        assert reader.all_steps() == []


def test_ctrl_c_while_close_releases_still_releases_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt in one release skipped the others, and the manager counted as
    closed: the lease stayed held (another job was refused) and the signal handlers stayed."""
    before = signal.getsignal(signal.SIGTERM)
    root = tmp_path / "ckpts"
    manager = CheckpointManager(root, save_interval=1)
    assert signal.getsignal(signal.SIGTERM) is not before

    def interrupted() -> None:
        raise KeyboardInterrupt  # as Ctrl-C landing in the first release

    monkeypatch.setattr(manager._save_plans, "forget", interrupted)  # internal: the first
    with pytest.raises(KeyboardInterrupt):
        manager.close()
    assert not (root / "owner.json").exists()
    assert signal.getsignal(signal.SIGTERM) is before
    manager.close()  # a no-op now
    CheckpointManager(root, save_interval=1, chkpt_on_preemption=False).close()


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


def test_an_interrupted_close_releases_nothing_and_a_second_close_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C in close() while a save still writes: close() used to mark the manager closed and
    release the lease (and stop the daemon) anyway, so the save committed without the lease and
    a second close() did nothing. Now nothing is released and the second close() finishes."""
    writing, release, held_write = held_dcp_writes(EXIT_TIMEOUT_S)

    root = tmp_path / "ckpts"
    manager = CheckpointManager(root, save_interval=1, chkpt_on_preemption=False)
    monkeypatch.setattr(dcp_io, "save_tensors", held_write)
    try:
        assert manager.save_async(1, {"w": torch.ones(8)})
        assert writing.wait(EXIT_TIMEOUT_S)
        real_shutdown = manager._writer.shutdown  # internal: the wait close() begins with

        def interrupted_shutdown() -> None:
            raise KeyboardInterrupt  # as Ctrl-C arriving while close() waits

        monkeypatch.setattr(manager._writer, "shutdown", interrupted_shutdown)
        with pytest.raises(KeyboardInterrupt):
            manager.close()
        assert (root / "owner.json").exists()  # still this job's: the save is writing
        monkeypatch.setattr(manager._writer, "shutdown", real_shutdown)
    finally:
        release.set()
    manager.close()
    assert not (root / "owner.json").exists()
    with CheckpointManager(root, save_interval=1, read_only=True) as reader:
        assert reader.all_steps() == [1]


CLOSE_OFF_MAIN_CHILD = """
import signal, sys, threading
import torch
from ckptmgr import CheckpointManager, PreemptionConfig

def previous(signum, frame):
    print("previous handler ran", flush=True)

signal.signal(signal.SIGUSR1, previous)
config = PreemptionConfig(signals=["SIGUSR1", "SIGTERM"], gce=False, aws=False, azure=False)
manager = CheckpointManager(sys.argv[1], save_interval=1, preemption=config)
manager.save(1, {"w": torch.ones(4)})
errors = []
def close_elsewhere():
    try:
        manager.close()
    except BaseException as exc:
        errors.append(repr(exc))
closer = threading.Thread(target=close_elsewhere)
closer.start()
closer.join(60)
print("closed", errors, flush=True)
signal.raise_signal(signal.SIGUSR1)
print("SIGUSR1 handler back:", signal.getsignal(signal.SIGUSR1) is previous, flush=True)
signal.raise_signal(signal.SIGTERM)  # the default action: this process ends here
print("SIGTERM did not end the process", flush=True)
"""


def test_close_from_another_thread_releases_all_and_signals_act_as_before(
    tmp_path: Path,
) -> None:
    """close() off the main thread, where Python cannot set signal handlers, used to raise
    ValueError and leave the lease and the preemption threads behind. It now releases all, and
    the first such signal puts the earlier handlers back and acts as they would."""
    root = tmp_path / "ckpts"
    result = run_python(CLOSE_OFF_MAIN_CHILD, str(root), timeout=EXIT_TIMEOUT_S)
    lines = result.stdout.splitlines()
    assert lines[:3] == ["closed []", "previous handler ran", "SIGUSR1 handler back: True"], (
        result.stdout + result.stderr[-3000:]
    )
    assert result.returncode == -signal.SIGTERM, result.stdout + result.stderr[-3000:]
    assert not (root / "owner.json").exists()


INTERRUPTED_SAVE_CHILD = """
import concurrent.futures, signal, sys, threading, time
import torch
from ckptmgr import CheckpointError, CheckpointManager, dcp_io

writing, release = threading.Event(), threading.Event()

def failing_write(*args, **kwargs):  # fault injection: a write that fails once let go
    writing.set()
    release.wait(60)
    raise OSError(28, "No space left on device (injected)")

dcp_io.save_tensors = failing_write
joined = threading.Event()
invoke_callbacks = concurrent.futures.Future._invoke_callbacks

def late_callbacks(self):  # fault injection: a future's done callbacks run late
    joined.wait(10)
    invoke_callbacks(self)

concurrent.futures.Future._invoke_callbacks = late_callbacks
manager = CheckpointManager(sys.argv[1], save_interval=1, chkpt_on_preemption=False)
main = threading.main_thread()

def interrupt():  # Ctrl-C once the main thread waits for the save's result
    writing.wait(60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(main.ident)
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        if "result" in names:
            break
        time.sleep(0.01)
    signal.pthread_kill(main.ident, signal.SIGINT)

threading.Thread(target=interrupt).start()
try:
    manager.save(1, {"w": torch.ones(4)})
except KeyboardInterrupt:
    print("interrupted", flush=True)
release.set()
try:
    manager.join()
    print("join: no error", flush=True)
except CheckpointError as error:
    text = str(error) + repr(error.__cause__)
    print("join raised:", "No space left" in text, flush=True)
joined.set()
manager.close()
print("steps", manager.all_steps(), flush=True)
"""


def test_the_failure_of_an_interrupted_synchronous_save_is_raised_by_join(
    tmp_path: Path,
) -> None:
    """Ctrl-C while save() waits stops the wait, not the write. If the write then fails, join()
    raises it (it was lost: a synchronous save hands its failure to its waiting caller only).
    The writer keeps it before the save's future completes: kept by a callback of the future,
    it came too late, now and then, for a join() woken by that future (concurrent.futures
    wakes waiters before it runs callbacks; here made certain by delaying the callbacks)."""
    result = run_python(INTERRUPTED_SAVE_CHILD, str(tmp_path / "ckpts"), timeout=EXIT_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["interrupted", "join raised: True", "steps []"], (
        result.stdout + result.stderr[-3000:]
    )


def run_child(root: Path, mode: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    return run_bounded(  # a hang at exit fails here
        [sys.executable, "-X", "faulthandler", str(CHILD), str(root), mode],
        env=env,
        cwd=REPO,
        timeout=EXIT_TIMEOUT_S,
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


def test_join_after_close_leaves_no_thread_running(tmp_path: Path) -> None:
    """close() of a manager that never saved leaves stop()'s wake-up in the queue; a join()
    after it used to take that for a job, cancel the stop and start a thread that polled until
    the process ended."""
    manager = CheckpointManager(tmp_path / "ckpts", 1, chkpt_on_preemption=False)
    manager.close()
    manager.join()
    worker = manager._writer._worker
    deadline = time.monotonic() + 10
    while (thread := worker._thread) is not None and thread.is_alive():
        assert time.monotonic() < deadline, "a writer thread runs on after close() and join()"
        thread.join(timeout=0.1)
