"""The owner lease through CheckpointManager: two jobs on one root, real processes.

A child interpreter runs a manager on the root, commits a step and reports over stdout; the
test then constructs managers in this process (another job: the job identity of a process
without TORCHELASTIC_RUN_ID/SLURM_JOB_ID/CKPTMGR_JOB_ID is the process itself).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import REPO, held_dcp_writes, in_forked_child, run_python

from ckptmgr import CheckpointError, CheckpointManager, dcp_io
from ckptmgr.lease import LEASE_NAME, LeaseHeldError

BOUND_S = 90.0
pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

CHILD_CODE = r"""
import sys, torch
from ckptmgr import CheckpointError, CheckpointManager
root, timeout, take_over = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "take_over"
manager = CheckpointManager(
    root, 1, chkpt_on_preemption=False, lease_timeout_s=timeout, take_over=take_over
)
manager.save(1, {"w": torch.full((4,), 1.0)})
print("saved 1", flush=True)
for line in sys.stdin:  # "save <step>" or "close"
    words = line.split()
    if words[0] == "close":
        manager.close()
        print("closed", flush=True)
        break
    step = int(words[1])
    try:
        manager.save(step, {"w": torch.full((4,), float(step))})
        print(f"saved {step}", flush=True)
    except CheckpointError as error:
        print("failed " + str(error).replace("\n", " "), flush=True)
"""


class ManagerChild:
    """A child process that owns the root through its CheckpointManager."""

    def __init__(self, root: Path, lease_timeout_s: float = 60.0, take_over: bool = False) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
        for name in ("CKPTMGR_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
            env.pop(name, None)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                CHILD_CODE,
                str(root),
                str(lease_timeout_s),
                "take_over" if take_over else "respect",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.readline() == "saved 1"

    def readline(self) -> str:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            if not selector.select(BOUND_S):
                self.proc.kill()
                pytest.fail(f"the child said nothing within {BOUND_S:.0f}s")
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(BOUND_S)
            assert self.proc.stderr is not None
            pytest.fail(f"the child exited (rc={self.proc.returncode}): {self.proc.stderr.read()}")
        return line.strip()

    def send(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.readline()

    def sigkill(self) -> None:
        assert self.proc.poll() is None
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(BOUND_S) == -signal.SIGKILL

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(BOUND_S)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def children() -> Iterator[list[ManagerChild]]:
    started: list[ManagerChild] = []
    yield started
    for child in started:
        child.close()


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("CKPTMGR_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "ckpts"


def manager(root: Path, **kwargs: object) -> CheckpointManager:
    return CheckpointManager(root, 1, chkpt_on_preemption=False, **kwargs)  # type: ignore[arg-type]


def owner_pid(root: Path) -> int:
    return int(json.loads((root / LEASE_NAME).read_text())["pid"])


def test_second_writer_refuses_at_construction_naming_the_owner(
    root: Path, children: list[ManagerChild]
) -> None:
    child = ManagerChild(root)
    children.append(child)
    assert owner_pid(root) == child.proc.pid
    with pytest.raises(CheckpointError) as refused:
        manager(root)
    message = str(refused.value)
    assert "owned by another job" in message and f"pid {child.proc.pid}" in message
    assert "take_over=True" in message
    # The refused manager touched nothing: the owner goes on saving.
    assert child.send("save 2") == "saved 2"
    assert owner_pid(root) == child.proc.pid


def test_owner_killed_with_sigkill_never_blocks_a_restart(
    root: Path, children: list[ManagerChild]
) -> None:
    child = ManagerChild(root)
    children.append(child)
    assert child.send("save 2") == "saved 2"
    child.sigkill()
    assert owner_pid(root) == child.proc.pid  # the dead owner's record is still there
    with manager(root) as restarted:
        assert owner_pid(root) == os.getpid()
        assert restarted.all_steps() == [1, 2]
        restored = {"w": torch.zeros(4)}
        restarted.restore(2, restored)
        assert torch.equal(restored["w"], torch.full((4,), 2.0))
        assert restarted.save(3, {"w": torch.full((4,), 3.0)})
    assert not (root / LEASE_NAME).exists(), "close() did not release the lease"


def test_take_over_displaces_a_live_owner_whose_next_save_fails(
    root: Path, children: list[ManagerChild]
) -> None:
    child = ManagerChild(root, lease_timeout_s=0.4)  # heartbeat every 0.1 s
    children.append(child)
    with manager(root, take_over=True) as thief:
        assert owner_pid(root) == os.getpid()
        assert thief.save(5, {"w": torch.full((4,), 5.0)})
        # The displaced owner learns it at its next heartbeat; its saves then write nothing.
        # Its first attempt may race the heartbeat, so ask a bounded number of times.
        answers = [child.send(f"save {step}") for step in range(10, 10 + 50)]
        failed = [a for a in answers if a.startswith("failed")]
        assert failed, f"the displaced owner kept saving: {answers[-3:]}"
        assert "taken over by" in failed[0]
        assert all(a.startswith("failed") for a in answers[answers.index(failed[0]) :])
        assert owner_pid(root) == os.getpid()
    assert child.send("close") == "closed"
    assert not (root / LEASE_NAME).exists()


def test_a_save_writing_when_its_lease_is_lost_commits_and_deletes_nothing(
    root: Path, children: list[ManagerChild], monkeypatch: pytest.MonkeyPatch
) -> None:
    """This job's save is still writing when another job takes the root over; once the
    heartbeat has found the loss, the save commits nothing and retention (max_to_keep=1 here)
    deletes none of the new owner's steps. It once committed and then deleted them."""
    writing, release, held_write = held_dcp_writes(BOUND_S)

    with manager(root, lease_timeout_s=0.4, max_to_keep=1) as victim:  # heartbeat every 0.1 s
        assert victim.save(1, {"w": torch.full((4,), 1.0)})
        monkeypatch.setattr(dcp_io, "save_tensors", held_write)
        try:
            assert victim.save_async(2, {"w": torch.full((4,), 2.0)})
            assert writing.wait(BOUND_S)
            thief = ManagerChild(root, take_over=True)  # commits its step 1 over ours
            children.append(thief)
            assert thief.send("save 5") == "saved 5"
            deadline = time.monotonic() + BOUND_S
            while victim._lease is not None and victim._lease._holding.lost is None:  # internal
                assert time.monotonic() < deadline, "the heartbeat never found the loss"
                time.sleep(0.05)  # polling the heartbeat thread's finding, bounded above
        finally:
            release.set()
        with pytest.raises(CheckpointError, match="taken over"):
            victim.join()
    with CheckpointManager(root, 1, read_only=True, chkpt_on_preemption=False) as reader:
        assert reader.all_steps() == [1, 5]  # the new owner's steps, and no step 2
        restored = {"w": torch.zeros(4)}
        reader.restore(5, restored)
        assert torch.equal(restored["w"], torch.full((4,), 5.0))


def test_a_save_committed_after_a_take_over_deletes_none_of_the_new_owners_steps(
    root: Path, children: list[ManagerChild]
) -> None:
    """The heartbeat finds a take-over only at its next beat (every lease_timeout_s / 4): a save
    committed in between (the window the docs admit) then ran retention and deleted the new
    owner's steps. The record is read again before anything is deleted."""
    with manager(root, lease_timeout_s=600.0, max_to_keep=1) as victim:  # beats every 150 s
        assert victim.save(1, {"w": torch.full((4,), 1.0)})
        thief = ManagerChild(root, take_over=True)  # commits its step 1 over ours
        children.append(thief)
        assert thief.send("save 5") == "saved 5"
        victim.save(7, {"w": torch.full((4,), 7.0)})  # committed: the heartbeat has not beaten
        with pytest.raises(CheckpointError, match="taken over"):
            victim.join()
    with CheckpointManager(root, 1, read_only=True, chkpt_on_preemption=False) as reader:
        assert reader.all_steps() == [1, 5, 7]  # retention deleted nothing
        restored = {"w": torch.zeros(4)}
        reader.restore(5, restored)
        assert torch.equal(restored["w"], torch.full((4,), 5.0))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
@pytest.mark.parametrize("job_id", [None, "job-7"])
def test_a_manager_made_in_a_forked_child_is_refused_while_the_parent_owns_the_root(
    root: Path, monkeypatch: pytest.MonkeyPatch, job_id: str | None
) -> None:
    """A forked child inherited the process's lease holdings, so a manager it made on its
    parent's root shared the parent's lease without a heartbeat of its own, and its retention
    deleted the parent's steps. The child now acquires anew, as any other process would; and
    with a job identity it shares with the parent, it is not taken for the job's restart (which
    takes the lease over) while the parent, its ancestor, lives."""
    if job_id is not None:
        monkeypatch.setenv("CKPTMGR_JOB_ID", job_id)
    with manager(root) as parent:
        assert parent.save(1, {"w": torch.full((4,), 1.0)})

        def open_in_child() -> bytes:
            try:
                with manager(root, max_to_keep=1) as child:
                    child.save(2, {"w": torch.full((4,), 2.0)})
            except LeaseHeldError:
                return b"refused"
            return b"accepted"

        assert in_forked_child(open_in_child) == b"refused"
        assert owner_pid(root) == os.getpid()
        assert parent.save(3, {"w": torch.full((4,), 3.0)})
        assert parent.all_steps() == [1, 3]


def test_a_read_only_manager_creates_no_root(tmp_path: Path) -> None:
    """read_only writes nothing to storage: on a path that does not exist (a typo, or a job
    that has not started writing yet) it once created the directories."""
    missing = tmp_path / "runs" / "exp-1-typo" / "ckpt"
    with CheckpointManager(missing, 1, read_only=True, chkpt_on_preemption=False) as reader:
        assert reader.all_steps() == []
        assert reader.restore_latest({"w": torch.zeros(4)}) is None
    assert not (tmp_path / "runs").exists()


def test_read_only_use_needs_no_lease(root: Path, children: list[ManagerChild]) -> None:
    child = ManagerChild(root)
    children.append(child)
    result = run_python("from ckptmgr.cli import main; main()", "ls", str(root), timeout=BOUND_S)
    assert result.returncode == 0, result.stderr
    assert "1" in result.stdout
    assert owner_pid(root) == child.proc.pid


def test_a_read_only_manager_restores_while_another_job_writes(
    root: Path, children: list[ManagerChild]
) -> None:
    child = ManagerChild(root)
    children.append(child)
    with CheckpointManager(root, 1, read_only=True) as reader:
        assert reader.all_steps() == [1]
        restored = {"w": torch.zeros(4)}
        reader.restore(1, restored)
        assert torch.equal(restored["w"], torch.full((4,), 1.0))
        with pytest.raises(CheckpointError, match="read_only=True"):
            reader.save(5, {"w": torch.ones(4)}, force=True)
    assert owner_pid(root) == child.proc.pid
    assert child.send("save 2") == "saved 2"


def test_close_releases_and_managers_of_one_process_share(root: Path) -> None:
    with manager(root) as first, manager(root) as second:
        assert first.save(1, {"w": torch.ones(2)})
        assert second.save(2, {"w": torch.ones(2)})
        assert owner_pid(root) == os.getpid()
    assert not (root / LEASE_NAME).exists()
    with manager(root, leftover_grace_s=0) as again:
        assert again.all_steps() == [1, 2]
        assert sorted(os.listdir(root)) == [LEASE_NAME, "step_000000000001", "step_000000000002"]


def _lease_threads() -> list[str]:
    return [
        thread.name for thread in threading.enumerate() if thread.name.startswith("ckptmgr-lease")
    ]


@pytest.mark.parametrize("async_mode", ["thread", "process"])
def test_managers_dropped_without_close_give_the_root_back(
    root: Path, children: list[ManagerChild], async_mode: str
) -> None:
    """A manager garbage-collected without close() held the root for the rest of the process
    (its lease's record kept beating): another job was refused ("owned by another job ...
    heartbeat 0.2 s ago"). The last manager of the process that is dropped gives it back, at
    the lease's next heartbeat (every lease_timeout_s / 4: 0.5 s here)."""
    first = manager(root, async_mode=async_mode, lease_timeout_s=2.0)
    second = manager(root, async_mode=async_mode, lease_timeout_s=2.0)
    assert first.save_async(2, {"w": torch.ones(2)})
    first.join()
    dropped = weakref.ref(first)
    del first
    gc.collect()
    assert dropped() is None
    assert owner_pid(root) == os.getpid()  # the other manager of the process still holds it
    assert _lease_threads()
    del second
    gc.collect()
    deadline = time.monotonic() + BOUND_S  # (a bounded wait for the heartbeat's give-back)
    while (_lease_threads() or (root / LEASE_NAME).exists()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (root / LEASE_NAME).exists()
    assert _lease_threads() == []
    children.append(ManagerChild(root))  # another job takes the root: saves step 1
    assert children[0].send("save 3") == "saved 3"
    assert owner_pid(root) == children[0].proc.pid


COMMAND_HOLDING_CODE = r"""
import sys
from fsspec.implementations.local import LocalFileSystem
from ckptmgr.lease import CLI_JOB_PREFIX, OwnerLease
lease = OwnerLease(LocalFileSystem(), sys.argv[1], job_id=CLI_JOB_PREFIX + "prune-test")
lease.acquire()
print("held", flush=True)
sys.stdin.readline()  # until told
lease.release()
print("released", flush=True)
"""


def test_a_manager_waits_for_a_command_that_holds_the_root(root: Path) -> None:
    """A job (re)started while `ckptmgr prune` deleted steps failed at once, "owned by another
    job ... pass take_over=True if that job is gone" (which would take the lease from a prune
    still deleting). It waits for the command, saying so, then opens the root."""
    root.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    command = subprocess.Popen(
        [sys.executable, "-c", COMMAND_HOLDING_CODE, str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert command.stdout is not None and command.stdin is not None
        assert command.stdout.readline().strip() == "held"
        opened: list[object] = []
        waiting = threading.Event()

        class _Waiting(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if "waiting for it to finish" in record.getMessage():
                    waiting.set()

        handler = _Waiting()
        logging.getLogger("ckptmgr").addHandler(handler)
        try:
            finished = threading.Event()

            def make() -> None:
                try:
                    opened.append(manager(root))
                except BaseException as exc:  # (what the test reports)
                    opened.append(exc)
                finally:
                    finished.set()

            maker = threading.Thread(target=make)
            maker.start()
            deadline = time.monotonic() + BOUND_S
            while not (waiting.is_set() or finished.is_set()) and time.monotonic() < deadline:
                waiting.wait(0.05)
            assert waiting.is_set() and not opened, opened  # the manager waits for the command
            command.stdin.write("release\n")
            command.stdin.flush()
            maker.join(BOUND_S)
        finally:
            logging.getLogger("ckptmgr").removeHandler(handler)
        assert not maker.is_alive() and len(opened) == 1
        made = opened[0]
        assert isinstance(made, CheckpointManager)
        assert owner_pid(root) == os.getpid()
        made.close()
    finally:
        command.kill()
        command.wait(BOUND_S)


def test_lease_settings_are_validated(root: Path) -> None:
    with pytest.raises(ValueError, match="lease_timeout_s"):
        manager(root, lease_timeout_s=0)
    with pytest.raises(ValueError, match="take_over"):
        manager(root, take_over="yes")
