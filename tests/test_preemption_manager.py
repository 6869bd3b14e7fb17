"""Preemption notices through a real CheckpointManager: cloud metadata, a trigger file,
``exit_after_save`` in a real child process, and retention protection of the preemption step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _metadata_server import FakeMetadataServer
from conftest import REPO, run_python

from ckptmgr import CheckpointManager, PreemptionConfig

NOTICE_WAIT_S = 15.0
POLL_S = 0.2
QUIET = {"signals": [], "gce": False, "aws": False, "azure": False, "tpu": False}


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((8,), float(step)), "step": step}


def _train_until_preempted(manager: CheckpointManager, first_step: int) -> int:
    """Run steps (saving when told) until the manager reports the preemption step; bounded."""
    deadline = time.monotonic() + NOTICE_WAIT_S
    step = first_step
    while time.monotonic() < deadline:
        manager.save_async(step, _state(step))
        if manager.reached_preemption(step):
            return step
        step += 1
    raise AssertionError(f"no preemption checkpoint within {NOTICE_WAIT_S} s (last step {step})")


@pytest.fixture
def metadata(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeMetadataServer]:
    with FakeMetadataServer() as fake:
        monkeypatch.setenv("GCE_METADATA_HOST", fake.address)
        monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", fake.url)
        yield fake


@pytest.mark.parametrize("cloud", ["gce", "aws"])
def test_a_cloud_notice_saves_the_next_step(
    ckpt_dir: Path, metadata: FakeMetadataServer, cloud: str
) -> None:
    config = PreemptionConfig(**{**QUIET, cloud: True, "poll_interval_s": POLL_S})
    with CheckpointManager(ckpt_dir, save_interval=10**6, preemption=config) as manager:
        for step in range(1, 4):
            assert not manager.save_async(step, _state(step))
        if cloud == "gce":
            metadata.set_gce("preempted", "TRUE")
        else:
            metadata.set_aws_action("terminate")
        preempted = _train_until_preempted(manager, 4)
        assert manager.all_steps() == [preempted]
    with CheckpointManager(ckpt_dir, save_interval=1, chkpt_on_preemption=False) as reader:
        restored = {"w": torch.zeros(8), "step": -1}
        reader.restore(preempted, restored)
    assert restored["step"] == preempted and torch.equal(restored["w"], _state(preempted)["w"])


def keep_one_with_a_trigger_file(ckpt_dir: Path, trigger: Path, **kwargs: Any) -> CheckpointManager:
    """A manager that keeps one step (``KeepLatest(1)``), saves only when forced or preempted,
    and takes ``trigger`` appearing for a preemption notice."""
    config = PreemptionConfig(**{**QUIET, "file": str(trigger), "poll_interval_s": POLL_S})
    return CheckpointManager(
        ckpt_dir, save_interval=10**6, max_to_keep=1, preemption=config, **kwargs
    )


def wait_until_noticed(manager: CheckpointManager, step: int) -> None:
    deadline = time.monotonic() + NOTICE_WAIT_S
    while not manager.should_save(step):
        assert time.monotonic() < deadline, "the trigger file was never noticed"


def test_a_trigger_file_saves_the_next_step_and_is_protected_from_retention(
    ckpt_dir: Path, tmp_path: Path
) -> None:
    trigger = tmp_path / "preempt-now"
    with keep_one_with_a_trigger_file(ckpt_dir, trigger) as manager:
        manager.save(200, _state(200), force=True)
        manager.save(300, _state(300), force=True)
        trigger.touch()
        # A rewind: the run goes on at step 150, where the notice arrives.
        wait_until_noticed(manager, 150)
        assert manager.save_async(150, _state(150))
        assert manager.reached_preemption(150)
        # KeepLatest(1) keeps 300; the preemption step is the most recently committed: kept.
        assert manager.all_steps() == [150, 300]
        reasons = {d.step: d.reasons for d in manager.explain_retention()}
        assert reasons[150] == ["protected: the most recently committed step"]


@pytest.mark.parametrize("async_mode", ["thread", "process"])
def test_retention_runs_after_the_preemption_checkpoint(
    ckpt_dir: Path, tmp_path: Path, async_mode: str
) -> None:
    """Deferred to the next save (tried, to spare the notice's grace period the deletions), a
    job preempted before each of its interval saves, whose only save is then the preemption
    checkpoint, never deleted a step: the root grew by one step per job."""
    trigger = tmp_path / "preempt-now"
    with keep_one_with_a_trigger_file(ckpt_dir, trigger, async_mode=async_mode) as mgr:
        assert mgr.save(1, _state(1), force=True)
        trigger.touch()
        wait_until_noticed(mgr, 2)
        assert mgr.save_async(2, _state(2))
        assert mgr.reached_preemption(2)
        assert mgr.all_steps() == [2]  # retention ran before reached_preemption returned


EXIT_CHILD = """
import signal, sys
import torch
from ckptmgr import CheckpointError, CheckpointManager, PreemptionConfig, pruning

def refuse_to_delete(storage, steps):  # fault injection: retention's delete fails
    raise CheckpointError(f"injected: could not delete steps {steps}")

settings = {"save_interval": 1000}
if sys.argv[2:] == ["--deletes-fail"]:
    pruning.delete_steps = refuse_to_delete
    settings = {"save_interval": 5, "max_to_keep": 1}
config = PreemptionConfig(signals=["SIGUSR1"], gce=False, aws=False, azure=False,
                          exit_after_save=True)
manager = CheckpointManager(sys.argv[1], preemption=config, **settings)
for step in range(1, 100):
    if step == 7:
        signal.raise_signal(signal.SIGUSR1)  # a real signal to this process
    manager.save_async(step, {"w": torch.full((4,), float(step))})
    print(f"trained step {step}", flush=True)
print("the manager did not exit", flush=True)
sys.exit(3)
"""


def test_exit_after_save_exits_even_when_retention_cannot_delete(ckpt_dir: Path) -> None:
    """The preemption checkpoint is committed, so the process exits as asked though
    retention's delete of the step before it failed (that error is logged); the failure used to
    be raised instead, and the process trained on until the machine went away."""
    result = run_python(EXIT_CHILD, str(ckpt_dir), "--deletes-fail", timeout=120)
    assert result.returncode == 128 + signal.SIGUSR1, result.stdout + result.stderr
    assert "trained step 6" in result.stdout and "trained step 7" not in result.stdout
    assert "exiting after the preemption checkpoint despite" in result.stderr
    assert "injected: could not delete steps [5]" in result.stderr
    with CheckpointManager(ckpt_dir, save_interval=1, chkpt_on_preemption=False) as reader:
        assert reader.all_steps() == [5, 7]


def test_exit_after_save_exits_with_128_plus_the_signal_once_committed(ckpt_dir: Path) -> None:
    result = run_python(EXIT_CHILD, str(ckpt_dir), timeout=120)
    assert result.returncode == 128 + signal.SIGUSR1, result.stdout + result.stderr
    assert "trained step 6" in result.stdout and "trained step 7" not in result.stdout
    assert "preemption checkpoint of step 7 committed" in result.stderr
    assert "after the notice (signal SIGUSR1)" in result.stderr
    with CheckpointManager(ckpt_dir, save_interval=1, chkpt_on_preemption=False) as reader:
        assert reader.all_steps() == [7]
        restored = {"w": torch.zeros(4)}
        reader.restore(7, restored)
    assert torch.equal(restored["w"], torch.full((4,), 7.0))


OFF_MAIN_THREAD_CHILD = """
import signal, sys, threading
import torch
from ckptmgr import CheckpointManager, PreemptionConfig

config = PreemptionConfig(signals=["SIGUSR1"], gce=False, aws=False, azure=False,
                          exit_after_save=True)
manager = CheckpointManager(sys.argv[1], save_interval=1000, preemption=config)

def train():
    try:
        for step in range(1, 100):
            manager.save_async(step, {"w": torch.full((4,), float(step))})
            print(f"trained step {step}", flush=True)
    finally:
        print("the training thread ended", flush=True)

signal.raise_signal(signal.SIGUSR1)  # a real signal to this process, noticed at step 1
thread = threading.Thread(target=train)
thread.start()
thread.join()
print("the main thread ended", flush=True)
"""


def test_exit_after_save_off_the_main_thread_exits_the_process_with_the_signals_status(
    ckpt_dir: Path,
) -> None:
    """A training loop on a thread other than the main thread: the process exits with 128 + the
    signal once the checkpoint is committed (SystemExit ended only the training thread, and the
    process exited 0 when its main thread did: the preemption hidden from the scheduler)."""
    result = run_python(OFF_MAIN_THREAD_CHILD, str(ckpt_dir), timeout=120)
    assert result.returncode == 128 + signal.SIGUSR1, result.stdout + result.stderr
    assert "trained step" not in result.stdout and "the main thread ended" not in result.stdout
    assert "exiting with status 138 after the preemption checkpoint" in result.stderr
    with CheckpointManager(ckpt_dir, save_interval=1, chkpt_on_preemption=False) as reader:
        assert reader.all_steps() == [1]


TWO_RANKS_CHILD = """
import os, signal, sys
import torch, torch.distributed as dist
from ckptmgr import CheckpointManager, PreemptionConfig

root, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=2)
config = PreemptionConfig(signals=["SIGTERM", "SIGUSR1"], gce=False, aws=False, azure=False,
                          exit_after_save=True)
with CheckpointManager(root + "/ckpt", save_interval=1000, preemption=config) as manager:
    for step in range(1, 100):
        if step == 5 and rank == 1:
            signal.raise_signal(signal.SIGUSR1)  # only rank 1 is told
        manager.save_async(step, {"w": torch.full((4,), float(step + rank))})
        print(f"trained step {step}", flush=True)
print("the manager did not exit", flush=True)
sys.exit(3)
"""


def test_exit_after_save_exits_every_rank_with_the_status_of_the_rank_that_got_the_signal(
    tmp_path: Path,
) -> None:
    """Only rank 1 gets SIGUSR1: both ranks exit 138 (rank 0 exited 143, so that a scheduler
    reading the highest status, as srun does, missed SLURM's requeue signal)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", TWO_RANKS_CHILD, str(tmp_path), str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    outputs = []
    try:
        for process in ranks:
            outputs.append(process.communicate(timeout=120))
    finally:
        for process in ranks:
            process.kill()
    for rank, (process, (stdout, stderr)) in enumerate(zip(ranks, outputs, strict=True)):
        assert process.returncode == 128 + signal.SIGUSR1, f"rank {rank}: {stdout}{stderr}"
        assert "trained step 4" in stdout and "trained step 5" not in stdout, f"rank {rank}"
    with CheckpointManager(tmp_path / "ckpt", save_interval=1, chkpt_on_preemption=False) as reader:
        assert reader.all_steps() == [5]


AGREE_EVERY_CHILD = """
import json, signal, sys, tempfile
import torch, torch.distributed as dist
from ckptmgr import CheckpointManager, PreemptionConfig

class EveryStep:  # a policy of the user's own: ckptmgr cannot know it answers alike on all ranks
    def should_save(self, context):
        return True

dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
config = PreemptionConfig(signals=["SIGUSR1"], gce=False, aws=False, azure=False,
                          agree_every_n_steps=2)
with CheckpointManager(sys.argv[1] + "/a", save_interval=1000, preemption=config) as mgr:
    signal.raise_signal(signal.SIGUSR1)  # a real signal to this process
    for step in range(1, 21):
        if mgr.should_save(step):
            print("should_save", step, "save returned", mgr.save(step, {"w": torch.zeros(2)}))
        if mgr.reached_preemption(step):
            break
    print("preemption steps", mgr.all_steps(), flush=True)
with CheckpointManager(sys.argv[1] + "/b", save_policy=EveryStep(),
                       chkpt_on_preemption=False, preemption=config) as mgr:
    for step in range(1, 11):
        if mgr.should_save(step):
            mgr.save(step, {"w": torch.zeros(2)})
    print("policy steps", json.dumps(mgr.all_steps()), flush=True)
dist.destroy_process_group()
"""


def test_agree_every_n_steps_agrees_once_per_step_so_save_follows_should_save(
    tmp_path: Path,
) -> None:
    """With agree_every_n_steps=2 under torch.distributed (gloo, one rank here), the documented
    `if should_save(step): save(step)` saves: the agreement is per step, and save(step) reuses
    should_save(step)'s. The count went up per call, so save() fell on the decisions without
    agreement and returned False at every step: no preemption checkpoint, and a save policy
    that needs the agreement (a policy of the user's own) never saved."""
    result = run_python(AGREE_EVERY_CHILD, str(tmp_path), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    # (only the child's own lines: gloo of some torch versions prints to stdout as well)
    lines = [line for line in result.stdout.splitlines() if not line.startswith("[Gloo]")]
    assert lines[0] == "should_save 2 save returned True", result.stdout
    assert "preemption steps [2]" in lines
    assert json.loads(lines[-1].removeprefix("policy steps ")) == [2, 4, 6, 8, 10]


NOTICE_AFTER_THE_LAST_STEP_CHILD = """
import signal, sys
import torch
from ckptmgr import CheckpointManager, PreemptionConfig

config = PreemptionConfig(signals=["SIGTERM"], gce=False, aws=False, azure=False)
manager = CheckpointManager(sys.argv[1], save_interval=1, preemption=config)
answered = sys.argv[2] == "answered"
for step in range(1, 4):
    if answered and step == 2:
        signal.raise_signal(signal.SIGTERM)  # a real signal, answered by step 2's save
    manager.save_async(step, {"w": torch.full((4,), float(step))})
if not answered:
    signal.raise_signal(signal.SIGTERM)  # a real signal, after the loop's last decision
manager.close()
print("handler after close:", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
"""


def test_a_notice_that_no_checkpoint_answered_is_named_when_the_manager_closes(
    ckpt_dir: Path,
) -> None:
    """A SIGTERM after the last step (or during close) was taken by the handler and acted on by
    nothing, silently: the process went on, exit status 0, until the platform's SIGKILL."""
    result = run_python(NOTICE_AFTER_THE_LAST_STEP_CHILD, str(ckpt_dir), "unanswered")
    assert result.returncode == 0, result.stderr
    assert "handler after close: True" in result.stdout
    assert "a preemption notice (signal SIGTERM) arrived and no checkpoint answered it" in (
        result.stderr
    )
    with CheckpointManager(ckpt_dir, save_interval=1, chkpt_on_preemption=False) as reader:
        assert reader.all_steps() == [1, 2, 3]


def test_an_answered_notice_is_not_named_when_the_manager_closes(ckpt_dir: Path) -> None:
    result = run_python(NOTICE_AFTER_THE_LAST_STEP_CHILD, str(ckpt_dir), "answered")
    assert result.returncode == 0, result.stderr
    assert "preemption checkpoint of step 2 committed" in result.stderr
    assert "no checkpoint answered it" not in result.stderr
