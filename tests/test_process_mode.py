"""``async_mode="process"``: save_async's DCP write runs in a checkpoint daemon process.

Everything is real: the spawned daemon (DCP's ``_AsyncCheckpointProcess``), the shared-memory
staging arena, the local disk, ``torchrun`` with gloo, and moto's S3 server on 127.0.0.1. A dead
daemon is made with a real ``SIGKILL``. The first process-mode save of a manager spawns a daemon
that imports torch (a few seconds), so each test shares one manager (and daemon) across its saves,
and tests 1 and 2 read one module-scoped run.

Every wait is bounded: ``join()`` on a daemon ``Process`` takes a timeout, the torchrun launcher
kills a job that overruns, and pytest-timeout bounds each test (``join()``/``save_async`` of the
manager have no timeout of their own while the daemon is alive).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import fsspec
import pydantic
import pytest
import torch
from _cloud_servers import Server, require_cloud_modules, start_moto
from _cloud_state import blank_like
from _cloud_state import differences as cloud_differences
from _cloud_state import make_state as make_cloud_state
from _daemon_faults import HeldRead
from _process_mode_worker import KILL_STEPS, STEPS
from conftest import REPO
from fsspec.implementations.memory import MemoryFileSystem
from test_distributed import torchrun
from torch import nn

from ckptmgr import CheckpointConfig, CheckpointError, CheckpointManager, CommitRecord
from ckptmgr.niceness import BACKGROUND_NICENESS
from ckptmgr.save_process import SaveProcess
from ckptmgr.storage import CheckpointStorage

pytestmark = pytest.mark.timeout(240)

WORKER = Path(__file__).resolve().parent / "_process_mode_worker.py"
NPROC = 2
DEATH_TIMEOUT_S = 30.0  # bound of a Process.join() on a killed or stopped daemon
POLL_TIMEOUT_S = 60.0  # bound of polling for an observable condition
N_SMALL = 500
LR = 1e-2
SMALL_DTYPES = (torch.float32, torch.float16, torch.int32, torch.float64, torch.uint8, torch.bool)


# -- states ----------------------------------------------------------------------------------------
def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values of ``dtype`` (every bit pattern class: floats, signed ints, bools)."""
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min // 2, info.max // 2, shape, generator=gen, dtype=dtype)


def tensor_state(seed: int, layout: str) -> dict[str, Any]:
    """A few tensors of more than 1 MiB, ~500 small ones (packed), an empty one, a plain value.

    ``layout="base"`` is the layout of the first saves; ``"changed"`` has other shapes for the
    same keys (the big ones with the same byte counts, transposed) and an added key; ``"dtypes"``
    has base's keys and shapes, the big ones in other dtypes (two of the same item size).
    """
    gen = torch.Generator().manual_seed(seed)
    if layout == "dtypes":  # (DCP's kept plans compare names and shapes, not dtypes)
        big = {
            "big_f32": random_tensor((1024, 512), torch.int32, gen),
            "big_bf16": random_tensor((1024, 1024), torch.float16, gen),
            "big_i64": random_tensor((160_000,), torch.float32, gen),
        }
    elif layout == "base":
        big = {
            "big_f32": random_tensor((1024, 512), torch.float32, gen),  # 2 MiB
            "big_bf16": random_tensor((1024, 1024), torch.bfloat16, gen),  # 2 MiB
            "big_i64": random_tensor((160_000,), torch.int64, gen),  # 1.2 MiB
        }
    else:
        big = {
            "big_f32": random_tensor((512, 1024), torch.float32, gen),
            "big_bf16": random_tensor((2048, 512), torch.bfloat16, gen),
            "big_i64": random_tensor((400, 400), torch.int64, gen),
            "added_big": random_tensor((768, 1024), torch.float16, gen),  # 1.5 MiB, a new key
        }
    shift = 3 if layout == "changed" else 0
    small: dict[str, torch.Tensor] = {}
    for index in range(N_SMALL):
        dtype = SMALL_DTYPES[index % len(SMALL_DTYPES)]
        if index % 11 == 0:
            shape: tuple[int, ...] = ()  # zero-dim
        elif index % 2 == 0:
            shape = (index % 7 + 1 + shift,)
        else:
            shape = (2, index % 5 + 1 + shift)
        small[f"t{index:03d}"] = random_tensor(shape, dtype, gen)
    state: dict[str, Any] = {**big, "small": small, "empty": torch.empty(0, 4), "seed": seed}
    if layout == "changed":
        state["small"]["added_small"] = random_tensor((9,), torch.int16, gen)
    return state


def zeros_like_state(value: Any) -> Any:
    """The structure of ``value`` with tensors of zeros and plain leaves set to -1."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {key: zeros_like_state(item) for key, item in value.items()}
    return -1


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.LayerNorm(512), nn.Linear(512, 64))


def train_one_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: int) -> None:
    gen = torch.Generator().manual_seed(10_000 + batch)
    loss = model(torch.randn(16, 256, generator=gen)).square().mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def fresh_model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model of zeros and an AdamW without state: what a restore must fill."""
    model = make_model()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.zero_()
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def snapshot(
    tensors: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Deep copies of everything a save of this state must hold."""
    return {
        "tensors": copy.deepcopy(tensors),
        "model": {key: value.detach().clone() for key, value in model.state_dict().items()},
        "optim": copy.deepcopy(optimizer.state_dict()),
    }


def mutate(tensors: dict[str, Any]) -> None:
    """Change every tensor in place (what training does while a save_async is in flight)."""
    for value in tensors.values():
        if isinstance(value, dict):
            mutate(value)
        elif isinstance(value, torch.Tensor) and value.numel():
            if value.dtype == torch.bool:
                value.logical_not_()
            else:
                value.add_(1)


def tensor_nbytes(value: Any) -> int:
    """Bytes of every tensor in ``value`` (nested dicts, lists and tuples)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_nbytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_nbytes(item) for item in value)
    return 0


# -- bit-exact comparison --------------------------------------------------------------------------
def differences(actual: Any, expected: Any, where: str = "") -> list[str]:
    """Where ``actual`` differs from ``expected``: tensors bit for bit (dtype and shape too),
    dicts key for key, lists and tuples item for item, other values with ``==``."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return [f"{where}: {type(actual).__name__} is not a tensor"]
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            got = f"{actual.dtype}{list(actual.shape)}"
            return [f"{where}: {got} != {expected.dtype}{list(expected.shape)}"]
        got_bits = actual.detach().reshape(-1).contiguous().view(torch.uint8)
        want_bits = expected.detach().reshape(-1).contiguous().view(torch.uint8)
        return [] if torch.equal(got_bits, want_bits) else [f"{where}: bytes differ"]
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or list(actual) != list(expected):
            return [f"{where}: keys {list(actual)[:5]}... != {list(expected)[:5]}..."]
        return [
            d for key in expected for d in differences(actual[key], expected[key], f"{where}/{key}")
        ]
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            return [f"{where}: {actual!r} != {expected!r}"]
        return [
            d
            for index, (got, want) in enumerate(zip(actual, expected, strict=True))
            for d in differences(got, want, f"{where}[{index}]")
        ]
    return [] if actual == expected else [f"{where}: {actual!r} != {expected!r}"]


def restored_differences(mgr: CheckpointManager, step: int, expected: dict[str, Any]) -> list[str]:
    """Restore ``step`` into zeros and a fresh model/AdamW; where it differs from ``expected``."""
    model, optimizer = fresh_model_and_optimizer()
    tensors = zeros_like_state(expected["tensors"])
    mgr.restore(step, {"tensors": tensors, "model": model, "optim": optimizer})
    restored = {
        "tensors": tensors,
        "model": dict(model.state_dict()),
        "optim": optimizer.state_dict(),
    }
    return differences(restored, expected, f"step {step}")


# -- the daemon ------------------------------------------------------------------------------------
def save_process_of(mgr: CheckpointManager) -> SaveProcess:
    save_process = mgr._save_process
    assert isinstance(save_process, SaveProcess), "the manager is not in process mode"
    return save_process


def daemon_of(mgr: CheckpointManager) -> BaseProcess:
    """The daemon's ``multiprocessing.Process`` (a save must have started it)."""
    daemon = save_process_of(mgr)._daemon
    assert daemon is not None, "no checkpoint daemon is running"
    process: BaseProcess = daemon._save_process
    return process


def kill_and_reap(process: BaseProcess) -> None:
    """SIGKILL ``process`` (stopped or not) and wait, bounded, until it is dead. Its end is
    told by its sentinel, which closes as it exits, rather than by ``is_alive()``: a manager's
    writer thread may be reaping it at the same moment, and of two threads that reap one child
    the loser finds no child and is told it still runs."""
    if process.is_alive():
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
    ended = multiprocessing.connection.wait([process.sentinel], timeout=DEATH_TIMEOUT_S)
    assert ended, f"daemon {process.pid} still alive after SIGKILL"
    process.join(timeout=DEATH_TIMEOUT_S)  # (reaped here unless another thread did)


@contextmanager
def process_manager(path: Path | str, **kwargs: Any) -> Iterator[CheckpointManager]:
    """A process-mode manager, closed afterwards; any daemon it left is killed (a failed test
    must not leave a stopped daemon behind, which would hang the interpreter's exit)."""
    kwargs.setdefault("chkpt_on_preemption", False)
    mgr = CheckpointManager(path, 1, async_mode="process", **kwargs)
    seen: list[BaseProcess] = []
    try:
        yield mgr
    finally:
        daemon = save_process_of(mgr)._daemon
        if daemon is not None:
            seen.append(daemon._save_process)
        try:
            mgr.close()
        finally:
            for process in seen:
                if process.is_alive():
                    kill_and_reap(process)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:012d}"


def read_record(root: Path, step: int) -> CommitRecord:
    return CommitRecord.from_json((step_dir(root, step) / "commit.json").read_bytes())


def checksum_problems(directory: Path, record: CommitRecord) -> list[str]:
    """Where ``record.files`` and the files in ``directory`` (but commit.json) disagree: the
    set of names, a size, or a CRC-32 (which must be present)."""
    on_disk = sorted(p.name for p in directory.iterdir() if p.name != "commit.json")
    listed = sorted(entry.path for entry in record.files)
    problems = [] if listed == on_disk else [f"listed {listed} != on disk {on_disk}"]
    for entry in record.files:
        path = directory / entry.path
        if not path.is_file():
            continue
        data = path.read_bytes()
        if entry.size != len(data):
            problems.append(f"{entry.path}: size {entry.size} != {len(data)}")
        if entry.crc32 is None:
            problems.append(f"{entry.path}: no crc32 in the record")
        elif entry.crc32 != zlib.crc32(data):
            problems.append(f"{entry.path}: crc32 {entry.crc32} != {zlib.crc32(data)}")
    return problems


def _niceness_of_threads(pid: int) -> set[int]:
    """The nice values of every thread of process ``pid`` (field 19 of each task's stat)."""
    values = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as handle:
            values.add(int(handle.read().rsplit(")", 1)[1].split()[16]))
    return values


# -- 1. several save_async steps in one daemon, a layout change, bit-exact restores ----------------
@dataclass
class SingleRun:
    """What one process-mode manager did over :data:`SINGLE_RUN_STEPS` (tests 1 and 2 read it)."""

    root: Path
    expected: dict[int, dict[str, Any]]  # step -> snapshot of what was saved
    pids: dict[int, int | None]  # step -> the daemon's pid after that step's join
    daemon_alive: bool
    daemon_pid: int | None
    daemon_niceness: set[int] | None  # the nice values of the daemon's threads (Linux)
    all_steps: list[int]
    restore_differences: dict[int, list[str]]


# (step, layout, join right after save_async); steps 3 and 4 go back to back (4 waits for 3's
# staging slot); step 5 changes every shape and adds keys, step 6 goes back, step 7 changes the
# big tensors' dtypes alone, step 8 goes back.
SINGLE_RUN_STEPS: list[tuple[int, str, bool]] = [
    (1, "base", True),
    (2, "base", True),
    (3, "base", False),
    (4, "base", True),
    (5, "changed", True),
    (6, "base", True),
    (7, "dtypes", True),
    (8, "base", True),
]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory: pytest.TempPathFactory) -> SingleRun:
    root = tmp_path_factory.mktemp("single") / "ckpts"
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    train_one_step(model, optimizer, 0)
    expected: dict[int, dict[str, Any]] = {}
    pids: dict[int, int | None] = {}
    layout_now = ""
    tensors: dict[str, Any] = {}
    # Three writer threads: several data files per step, each with its own checksum.
    with process_manager(root, num_of_threads=3) as mgr:
        assert save_process_of(mgr).pid is None, "the daemon must start lazily"
        for step, layout, join in SINGLE_RUN_STEPS:
            if layout != layout_now:
                tensors, layout_now = tensor_state(step, layout), layout
            expected[step] = snapshot(tensors, model, optimizer)
            assert mgr.save_async(step, {"tensors": tensors, "model": model, "optim": optimizer})
            # Training goes on while the daemon writes: none of it may reach the checkpoint.
            mutate(tensors)
            train_one_step(model, optimizer, step)
            if join:
                mgr.join()
                pids[step] = save_process_of(mgr).pid
        daemon = daemon_of(mgr)
        return SingleRun(
            root=root,
            expected=expected,
            pids=pids,
            daemon_alive=daemon.is_alive(),
            daemon_pid=daemon.pid,
            daemon_niceness=_niceness_of_threads(daemon.pid) if daemon.pid is not None else None,
            all_steps=mgr.all_steps(),
            restore_differences={
                step: restored_differences(mgr, step, expected[step]) for step in sorted(expected)
            },
        )


def test_save_async_steps_share_one_daemon(single_run: SingleRun) -> None:
    assert single_run.all_steps == [step for step, _, _ in SINGLE_RUN_STEPS]
    pid = single_run.pids[1]
    assert pid is not None and pid != os.getpid()
    assert set(single_run.pids.values()) == {pid}, f"one daemon per manager: {single_run.pids}"
    assert single_run.daemon_alive and single_run.daemon_pid == pid


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values: Linux")
def test_the_daemon_runs_below_the_training_process_priority(single_run: SingleRun) -> None:
    # When the cores are busy the training loop runs first: the daemon (and every thread it
    # starts) is BACKGROUND_NICENESS below the process that started it, at most 19; once, not
    # once more for being started by the background writer thread, which is that low too.
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert single_run.daemon_niceness == {min(19, own + BACKGROUND_NICENESS)}


def test_every_step_restores_bit_exact_across_a_layout_change(single_run: SingleRun) -> None:
    assert single_run.restore_differences == {step: [] for step in single_run.expected}
    record = read_record(single_run.root, 5)  # the changed layout is what step 5 recorded
    assert record.tensors["tensors/added_big"].shape == [768, 1024]
    assert record.tensors["tensors/big_f32"].shape == [512, 1024]
    assert "tensors/small/added_small" in record.tensors
    assert read_record(single_run.root, 6).tensors["tensors/big_f32"].shape == [1024, 512]


# -- 2. the commit record of a process-mode step ---------------------------------------------------
@pytest.mark.parametrize("step", [step for step, _, _ in SINGLE_RUN_STEPS])
def test_commit_record_lists_every_file_with_its_crc32(single_run: SingleRun, step: int) -> None:
    record = read_record(single_run.root, step)
    assert checksum_problems(step_dir(single_run.root, step), record) == []
    names = {entry.path for entry in record.files}
    assert ".metadata" in names and "objects-rank00000.json" in names
    data_files = [entry for entry in record.files if entry.path.endswith(".distcp")]
    assert len(data_files) >= 2, f"3 writer threads wrote {[e.path for e in data_files]}"
    saved = single_run.expected[step]
    expected_bytes = (
        tensor_nbytes(saved["tensors"])
        + tensor_nbytes(saved["model"])
        + tensor_nbytes(saved["optim"]["state"])
    )
    assert sum(entry.size for entry in data_files) == expected_bytes
    recorded_bytes = sum(
        torch.Size(entry.shape).numel() * getattr(torch, entry.dtype).itemsize
        for entry in record.tensors.values()
    )
    assert recorded_bytes == expected_bytes


def test_deep_verify_passes_on_a_process_mode_step(single_run: SingleRun) -> None:
    with CheckpointManager(single_run.root, 1, chkpt_on_preemption=False, read_only=True) as mgr:
        for step in mgr.all_steps():
            mgr.verify(step, deep=True)


# -- 3. a daemon killed between saves is replaced --------------------------------------------------
def test_daemon_killed_between_saves_is_replaced(
    ckpt_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = tensor_state(11, "base")
    second = tensor_state(12, "base")
    with process_manager(ckpt_dir) as mgr:
        assert mgr.save_async(1, {"tensors": first})
        mgr.join()
        old = daemon_of(mgr)
        old_pid = save_process_of(mgr).pid
        assert old_pid is not None and old.pid == old_pid
        os.kill(old_pid, signal.SIGKILL)
        old.join(timeout=DEATH_TIMEOUT_S)
        assert not old.is_alive() and old.exitcode == -signal.SIGKILL

        with caplog.at_level(logging.WARNING, logger="ckptmgr.save_process"):
            assert mgr.save_async(2, {"tensors": second})
            mgr.join()
        new_pid = save_process_of(mgr).pid
        assert new_pid is not None and new_pid != old_pid
        assert daemon_of(mgr).is_alive()
        warnings = [r.getMessage() for r in caplog.records if r.name == "ckptmgr.save_process"]
        assert any(str(old_pid) in message for message in warnings), warnings

        assert mgr.all_steps() == [1, 2]
        for step, saved in ((1, first), (2, second)):
            target = zeros_like_state(saved)
            mgr.restore(step, {"tensors": target})
            assert differences(target, saved, f"step {step}") == []


def test_a_daemon_found_dead_is_not_replaced_where_the_ranks_decide_together(
    tmp_path: Path,
) -> None:
    """Under torch.distributed, starting a daemon is a collective that the ranks agree on
    before the save (replace_unhealthy=False): a daemon that died since fails the save instead
    of being replaced by this rank alone, whose start-up would meet the other ranks' next
    collective. The next save (the ranks having agreed) starts a new one."""
    from ckptmgr import dcp_io

    def writer(step: int) -> Any:
        return dcp_io.make_writer(
            str(tmp_path / f"step{step}"), local=True, thread_count=1, storage_options={}
        )

    process = SaveProcess(None, timeout_s=60)
    try:
        process.save({"w": torch.ones(4)}, writer(1))
        old_pid = process.pid
        assert old_pid is not None
        os.kill(old_pid, signal.SIGKILL)
        daemon = process._daemon._save_process
        daemon.join(timeout=DEATH_TIMEOUT_S)
        assert not daemon.is_alive()
        with pytest.raises(CheckpointError, match="died"):
            process.save({"w": torch.ones(4)}, writer(2), replace_unhealthy=False)
        assert process.pid == old_pid  # not replaced here
        assert not process.healthy
        process.save({"w": torch.ones(4)}, writer(3))  # a single process: replaced at once
        assert process.pid not in (None, old_pid) and process.healthy
    finally:
        process.close()


def test_a_daemon_whose_pipe_broke_is_killed_when_stopped(tmp_path: Path) -> None:
    """DCP's shutdown raises when the pipe to the daemon is broken; the daemon (which ignores
    the SIGTERM that follows) used to live on, and close() raised."""
    from ckptmgr import dcp_io

    process = SaveProcess(None, timeout_s=60)
    writer = dcp_io.make_writer(
        str(tmp_path / "step"), local=True, thread_count=1, storage_options={}
    )
    process.save({"w": torch.ones(4)}, writer)
    daemon = process._daemon._save_process
    process._daemon._process_pipe.close()  # our end of the pipe: sending TERMINATE fails
    process.close()
    daemon.join(timeout=DEATH_TIMEOUT_S)
    assert not daemon.is_alive(), f"daemon {daemon.pid} outlived close()"
    assert process.pid is None


def _thread_waits_in(function: str, thread_prefix: str) -> bool:
    """True when a thread named ``thread_prefix...`` has ``function`` on its stack now."""
    frames = sys._current_frames()
    for thread in threading.enumerate():
        if not thread.name.startswith(thread_prefix) or thread.ident not in frames:
            continue
        frame = frames[thread.ident]
        while frame is not None:
            if frame.f_code.co_name == function:
                return True
            frame = frame.f_back
    return False


def stopped_daemon_after_a_save(mgr: CheckpointManager, tensors: dict[str, Any]) -> Any:
    """Save ``tensors`` (and join), then stop the daemon with SIGSTOP, so that the next save is
    certainly in flight in it; returns the daemon."""
    assert mgr.save_async(1, {"tensors": tensors})
    mgr.join()
    daemon = daemon_of(mgr)
    assert daemon.pid is not None
    os.kill(daemon.pid, signal.SIGSTOP)
    return daemon


def wait_until_the_writer_waits_for_the_daemon() -> None:
    """Bounded: the manager's writer thread has sent a request and waits for the answer."""
    deadline = time.monotonic() + POLL_TIMEOUT_S
    while not _thread_waits_in("_wait_for_response", "ckptmgr-writer"):
        assert time.monotonic() < deadline, "the save never reached the daemon"
        time.sleep(0.01)


def test_a_save_whose_retention_waits_for_a_hung_daemon_deletes_here_after_the_timeout(
    ckpt_dir: Path,
) -> None:
    """An idle daemon that hangs (stopped here): ``save`` (written in this process) hands
    retention's delete of the step before to the daemon, and waited for its answer for ever.
    After ``collective_timeout_s`` the delete runs in this process, and the next save replaces
    the daemon."""
    with process_manager(ckpt_dir, max_to_keep=1, collective_timeout_s=2) as mgr:
        daemon = stopped_daemon_after_a_save(mgr, {"w": torch.ones(4)})
        try:
            outcome: list[Any] = []
            saving = threading.Thread(
                target=lambda: outcome.append(mgr.save(2, {"w": torch.ones(4)}))
            )
            saving.start()
            saving.join(60)
            assert not saving.is_alive(), "save() waited for the hung daemon"
            assert outcome == [True]
            assert mgr.all_steps() == [2]
            assert sorted(p.name for p in ckpt_dir.glob("step_*")) == ["step_000000000002"]
        finally:
            kill_and_reap(daemon)
        assert mgr.save_async(3, {"w": torch.ones(4)})
        mgr.join()
        assert daemon_of(mgr).pid != daemon.pid and mgr.all_steps() == [3]


def test_a_timeout_beyond_what_a_pipe_can_wait_keeps_the_daemon(ckpt_dir: Path) -> None:
    """collective_timeout_s of 3e6 s (valid): the wait for the daemon's answer to a call
    raised OverflowError (a pipe waits 2,147,483 s at most), so every delete ran twice and
    the daemon was replaced at every save (a retention policy of the user's own: the daemon
    deletes what the training process planned)."""

    class KeepTheNewest:
        def keep(self, checkpoints: Any) -> set[int]:
            return {max(checkpoint.step for checkpoint in checkpoints)}

    with process_manager(ckpt_dir, retention=KeepTheNewest(), collective_timeout_s=3e6) as mgr:
        daemons = []
        for step in range(1, 4):
            assert mgr.save_async(step, {"w": torch.full((4,), float(step))})
            mgr.join()
            daemons.append(daemon_of(mgr).pid)
        assert len(set(daemons)) == 1, daemons
        assert mgr.all_steps() == [3]


def test_daemon_killed_during_a_save_fails_that_save_only(ckpt_dir: Path) -> None:
    """The daemon is stopped (SIGSTOP) so that the save is certainly in flight in it, then
    killed: that save fails with CheckpointError from join(); the next save gets a new daemon."""
    first = tensor_state(21, "base")
    doomed = tensor_state(22, "base")
    after = tensor_state(23, "base")
    with process_manager(ckpt_dir) as mgr:
        old = stopped_daemon_after_a_save(mgr, first)
        try:
            assert mgr.save_async(2, {"tensors": doomed})
            wait_until_the_writer_waits_for_the_daemon()
        finally:
            kill_and_reap(old)
        with pytest.raises(CheckpointError) as raised:
            mgr.join()
        chain = f"{raised.value} <- {raised.value.__cause__!r}"
        assert "step 2" in str(raised.value), chain
        # SaveProcess.save promises a CheckpointError saying the daemon died, not a bare
        # socket error from the pipe to it.
        assert "daemon" in chain, f"the error does not say that the daemon died: {chain}"
        assert mgr.all_steps() == [1]
        assert sorted(p.name for p in ckpt_dir.iterdir() if p.name.startswith("step_")) == [
            step_dir(ckpt_dir, 1).name
        ]

        assert mgr.save_async(3, {"tensors": after})
        mgr.join()
        assert save_process_of(mgr).pid not in (None, old.pid)
        assert mgr.all_steps() == [1, 3]
        for step, saved in ((1, first), (3, after)):
            target = zeros_like_state(saved)
            mgr.restore(step, {"tensors": target})
            assert differences(target, saved, f"step {step}") == []


def test_a_daemon_killed_after_its_commit_leaves_the_step_committed_and_reported_so(
    ckpt_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon commits step 2, then its retention (keep one) reads step 1's record, a read
    that blocks (injected in the daemon): the daemon is killed (SIGKILL) there, after the
    rename and before its answer. The save is reported committed (join raises nothing, a
    warning says so), retention runs in the training process instead (step 1 is deleted),
    step 2 restores bit-exact, and the next save gets a new daemon."""
    first = tensor_state(24, "base")
    committed = tensor_state(25, "base")
    after = tensor_state(26, "base")
    with CheckpointManager(ckpt_dir, 1, chkpt_on_preemption=False) as thread_mode:
        assert thread_mode.save(1, {"tensors": first})
    record = step_dir(ckpt_dir, 1) / "commit.json"
    release = ckpt_dir.parent / "release-the-held-read"
    os.mkfifo(release)  # (never opened for writing: the daemon's read waits until it dies)
    real_init_info = SaveProcess._init_info

    def init_info_holding_the_read(self: SaveProcess) -> Any:
        info = real_init_info(self)
        info.ckptmgr_test_fault = HeldRead(str(record), str(release))  # runs in the daemon
        return info

    monkeypatch.setattr(SaveProcess, "_init_info", init_info_holding_the_read)
    with process_manager(ckpt_dir, max_to_keep=1) as mgr:
        with caplog.at_level(logging.WARNING, logger="ckptmgr"):
            assert mgr.save_async(2, {"tensors": committed})
            deadline = time.monotonic() + POLL_TIMEOUT_S
            while not (step_dir(ckpt_dir, 2) / "commit.json").exists():
                assert time.monotonic() < deadline, "step 2 was never committed"
                time.sleep(0.01)
            daemon = daemon_of(mgr)
        monkeypatch.undo()  # (the next daemon reads freely)
        assert daemon.is_alive()  # (blocked in its retention: it cannot have answered)
        kill_and_reap(daemon)
        with caplog.at_level(logging.WARNING, logger="ckptmgr"):
            mgr.join()
        messages = [r.getMessage() for r in caplog.records]
        assert any("committed step 2, then failed" in m for m in messages), messages
        assert mgr.all_steps() == [2]
        assert not step_dir(ckpt_dir, 1).exists()
        target = zeros_like_state(committed)
        mgr.restore(2, {"tensors": target})
        assert differences(target, committed, "step 2") == []

        assert mgr.save_async(3, {"tensors": after})
        mgr.join()
        assert save_process_of(mgr).pid not in (None, daemon.pid)
        assert mgr.all_steps() == [3]


def test_signals_to_the_whole_process_group_leave_the_daemon_and_its_save_alone(
    ckpt_dir: Path,
) -> None:
    """A scheduler's preemption SIGTERM, or Ctrl-C's SIGINT, sent to the process group reaches
    the daemon too; they are the training process's to handle. They once killed the daemon
    with the save in flight (and the preemption save then waited for a new daemon)."""
    first = tensor_state(41, "base")
    in_flight = tensor_state(42, "base")
    with process_manager(ckpt_dir) as mgr:
        daemon = stopped_daemon_after_a_save(mgr, first)
        try:
            assert mgr.save_async(2, {"tensors": in_flight})
            wait_until_the_writer_waits_for_the_daemon()
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
                os.kill(daemon.pid, signum)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        mgr.join()
        assert daemon.is_alive() and save_process_of(mgr).pid == daemon.pid
        assert mgr.all_steps() == [1, 2]
        target = zeros_like_state(in_flight)
        mgr.restore(2, {"tensors": target})
        assert differences(target, in_flight, "step 2") == []
        mgr.close()
        assert not daemon.is_alive(), "close() no longer stops the daemon"


GROUP_SIGNALS_AT_START_SCRIPT = r"""
import signal, sys, torch
from ckptmgr import CheckpointManager

def main(root):
    for signum in (signal.SIGINT, signal.SIGTERM):  # the training process lives on
        signal.signal(signum, lambda signum, frame: print("signal", signum, flush=True))
    with CheckpointManager(root, 1, async_mode="process", chkpt_on_preemption=False) as mgr:
        assert mgr.save_async(1, {"w": torch.ones(10)})  # the daemon starts on the writer
        print("accepted", flush=True)
        sys.stdin.readline()  # the test signals the process group meanwhile
        mgr.join()
        print("listed", mgr.all_steps(), flush=True)

if __name__ == "__main__":
    main(sys.argv[1])
"""


def wait_for_a_child_of(pid: int, timeout_s: float = 90.0) -> None:
    """Return once process ``pid`` has a child process (Linux: read from /proc)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                if (task / "children").read_text().split():
                    return
            except FileNotFoundError:  # (a thread that ended meanwhile)
                continue
        time.sleep(0.005)  # (polling /proc: there is nothing to wait on)
    raise AssertionError(f"process {pid} started no child within {timeout_s} s")


def test_signals_to_the_process_group_while_the_daemon_starts_leave_it_and_the_save_alone(
    tmp_path: Path,
) -> None:
    """The daemon ignores SIGINT and SIGTERM from its entry function on, but took seconds to
    get there (importing the main script and torch): a Ctrl-C or a scheduler's SIGTERM to the
    process group meanwhile killed it, and the first save, accepted, was lost."""
    process = start_script(
        tmp_path, GROUP_SIGNALS_AT_START_SCRIPT, str(tmp_path / "c"), stdin=subprocess.PIPE
    )
    try:
        assert process.stdout is not None and process.stdin is not None
        ready, _, _ = select.select([process.stdout], [], [], 90)
        assert ready, "no line from the script within 90 s"
        assert process.stdout.readline() == "accepted\n"
        wait_for_a_child_of(process.pid)  # the daemon, spawned: seconds from ready
        for signum in (signal.SIGINT, signal.SIGTERM):
            os.killpg(process.pid, signum)
        process.stdin.write("go on\n")
        process.stdin.flush()
        out, err = process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 0, out + err
    assert "listed [1]" in out, out + err
    assert "Traceback" not in err, err


# -- 4. close() stops the daemon -------------------------------------------------------------------
def test_close_stops_the_daemon_after_the_pending_save(ckpt_dir: Path) -> None:
    state = {"tensors": tensor_state(31, "base")}
    with process_manager(ckpt_dir) as mgr:
        assert mgr.save_async(1, state)
        mgr.join()
        daemon = daemon_of(mgr)
        assert daemon.is_alive()
        expected = copy.deepcopy(state)
        assert mgr.save_async(2, state)  # still pending when close() is called
        mgr.close()
        assert not daemon.is_alive(), f"daemon {daemon.pid} outlived close()"
        assert daemon.exitcode == 0, "the daemon did not end by itself when asked to"
        assert daemon not in multiprocessing.active_children()
        assert save_process_of(mgr).pid is None
        assert mgr.all_steps() == [1, 2]  # close() waited for step 2
    with CheckpointManager(ckpt_dir, 1, chkpt_on_preemption=False) as reader:
        target = zeros_like_state(expected)
        reader.restore(2, target)
        assert differences(target, expected) == []


# -- the staging arena goes to a daemon once ------------------------------------------------------
def _count_handed_descriptors(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one for every file descriptor this process hands to another one
    through multiprocessing's resource sharer (how torch sends a shared-memory storage)."""
    import multiprocessing.resource_sharer as resource_sharer

    handed: list[int] = []
    register = resource_sharer._ResourceSharer.register

    def counted(self: Any, send: Any, close: Any) -> Any:
        handed.append(1)
        return register(self, send, close)

    monkeypatch.setattr(resource_sharer._ResourceSharer, "register", counted)
    return handed


def _shared_memory_maps(pid: int) -> set[str]:
    """The shared-memory files (torch's, under /dev/shm) that process ``pid`` has mapped."""
    with open(f"/proc/{pid}/maps") as handle:
        return {line.split(None, 5)[5].strip() for line in handle if "/dev/shm/" in line}


def test_the_staging_arena_goes_to_the_daemon_once(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Handing a descriptor over costs the training process a connection to its resource
    # sharer (Python and system calls that share its GIL): once per arena, not once per save.
    handed = _count_handed_descriptors(monkeypatch)
    base = {"tensors": tensor_state(41, "base")}
    changed = {"tensors": tensor_state(42, "changed")}  # needs a bigger arena
    states = [base, base, base, changed, changed, base]
    expected: dict[int, Any] = {}
    per_save: list[int] = []
    with process_manager(ckpt_dir) as mgr:
        for step, state in enumerate(states, start=1):
            before = len(handed)
            assert mgr.save_async(step, state)
            mgr.join()
            per_save.append(len(handed) - before)
            expected[step] = copy.deepcopy(state)
    assert per_save[:5] == [1, 0, 0, 1, 0], per_save
    with CheckpointManager(ckpt_dir, 1, chkpt_on_preemption=False) as reader:
        for step, state in expected.items():
            target = zeros_like_state(state)
            reader.restore(step, target)
            assert differences(target, state) == [], step


def test_two_staging_slots_keep_two_arenas_in_the_daemon(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With max_pending_async=2 saves take turns between two arenas (when one save is still
    # writing as the next one stages; internal: the pool's slots): the daemon is sent each once
    # and keeps both, and every step holds its own values, not the other slot's.
    handed = _count_handed_descriptors(monkeypatch)
    expected: dict[int, Any] = {}
    with process_manager(ckpt_dir, max_pending_async=2) as mgr:
        for step in range(1, 7):
            state = {"tensors": tensor_state(50 + step, "base")}
            expected[step] = copy.deepcopy(state)
            assert mgr.save_async(step, state)  # (up to two in flight)
        mgr.join()
        arenas = [slot._arena for slot in mgr._staging._all if slot._arena is not None]
    assert 1 <= len(arenas) <= 2
    assert len(handed) == len(arenas), f"{len(handed)} descriptors for {len(arenas)} arenas"
    with CheckpointManager(ckpt_dir, 1, chkpt_on_preemption=False) as reader:
        assert reader.all_steps() == list(expected)
        for step, state in expected.items():
            target = zeros_like_state(state)
            reader.restore(step, target)
            assert differences(target, state) == [], step


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/<pid>/maps: Linux")
def test_the_daemon_lets_go_of_an_arena_the_training_process_dropped(ckpt_dir: Path) -> None:
    with process_manager(ckpt_dir) as mgr:
        assert mgr.save_async(1, {"tensors": tensor_state(43, "base")})
        mgr.join()
        pid = daemon_of(mgr).pid
        assert pid is not None
        first = _shared_memory_maps(pid)
        assert len(first) == 1 and first <= _shared_memory_maps(os.getpid()), first
        assert mgr.save_async(2, {"tensors": tensor_state(44, "changed")})  # a new arena
        mgr.join()
        second = _shared_memory_maps(pid)
        assert len(second) == 1 and second != first, (first, second)
        assert second <= _shared_memory_maps(os.getpid())  # the arena the training process has
        assert not first & _shared_memory_maps(os.getpid())  # which let go of the first one


def test_the_daemon_writes_the_objects_file_beside_the_data(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Neither the training process's storage nor its DCP file system may write it: the write
    # (and its fsync) runs in the daemon, with the data files.
    from ckptmgr.dcp_io import ChecksummingFileSystem

    def refused(self: Any, path: Any, *args: Any) -> None:
        raise AssertionError(f"the training process wrote {path}")

    monkeypatch.setattr(ChecksummingFileSystem, "write_small_file", refused)
    state = {"tensors": tensor_state(45, "base"), "epoch": 7, "run": {"name": "b", "lr": 0.5}}
    expected = copy.deepcopy(state)
    with process_manager(ckpt_dir) as mgr:
        assert mgr.save_async(1, state)
        mgr.join()
    record = read_record(ckpt_dir, 1)
    entry = next(f for f in record.files if f.path == "objects-rank00000.json")
    data = (ckpt_dir / "step_000000000001" / entry.path).read_bytes()
    assert entry.size == len(data) and entry.crc32 == zlib.crc32(data)
    monkeypatch.undo()
    with CheckpointManager(ckpt_dir, 1, chkpt_on_preemption=False) as reader:
        target = zeros_like_state(expected)
        reader.restore(1, target)
        assert differences(target, expected) == []


def test_an_arena_view_pickles_as_its_place_in_the_arena() -> None:
    from multiprocessing.reduction import ForkingPickler

    from ckptmgr import save_process

    arena = torch.UntypedStorage._new_shared(4096)
    whole = torch.empty(0, dtype=torch.uint8).set_(arena, 0, (4096,))
    whole.copy_(torch.arange(4096, dtype=torch.int64).remainder(251).to(torch.uint8))
    floats = whole[64:1088].view(torch.float32).view(16, 16)
    views = {"rows": floats, "columns": floats.t()[2:7, ::3], "bytes": whole[5:9]}
    token = 10**9  # (no arena of this process has it)
    alive = frozenset({token})
    sent = [
        save_process._ArenaView(views["rows"], token, arena, alive),
        save_process._ArenaView(views["columns"], token, None, alive),
        save_process._ArenaView(views["bytes"], token, None, alive),
    ]
    try:
        received = ForkingPickler.loads(ForkingPickler.dumps(sent))
        for view, got in zip(views.values(), received, strict=True):
            assert got.dtype == view.dtype and got.shape == view.shape
            assert got.stride() == view.stride() and torch.equal(got, view)
        # later requests send the token only; an arena no longer alive is dropped first
        later = save_process._ArenaView(views["bytes"], token, None, alive)
        assert torch.equal(ForkingPickler.loads(ForkingPickler.dumps(later)), views["bytes"])
        dropped = save_process._ArenaView(views["bytes"], token, None, frozenset())
        with pytest.raises(CheckpointError, match="never sent staging arena"):
            ForkingPickler.loads(ForkingPickler.dumps(dropped))
        assert token not in save_process._DAEMON_ARENAS
    finally:
        save_process._DAEMON_ARENAS.pop(token, None)


def start_script(directory: Path, text: str, *args: str, **popen: Any) -> subprocess.Popen[str]:
    """Start ``text`` as a script (its own file in ``directory``) in a fresh interpreter and a
    session of its own, its output piped (``popen``: more of ``subprocess.Popen``'s options)."""
    script = directory / f"script_{uuid.uuid4().hex[:8]}.py"
    script.write_text(text)
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
        start_new_session=True,
        **popen,
    )


def run_script(directory: Path, text: str, *args: str) -> tuple[int, str, str]:
    """Run ``text`` as a script (:func:`start_script`): its exit status, standard output and
    standard error (killed after 90 s, with every process it started: a forked child that
    hangs holds the output pipes open)."""
    process = start_script(directory, text, *args)
    try:
        out, err = process.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
    return process.returncode, out, err


EXIT_WITHOUT_CLOSE_CHILD = r"""
import os, sys, torch
from ckptmgr import CheckpointManager

def main(root, mode):
    mgr = CheckpointManager(root, 1, async_mode="process", chkpt_on_preemption=False)
    mgr.save_async(1, {"w": torch.ones(10)})
    if mode == "pending":
        mgr.save_async(2, {"w": torch.full((10,), 2.0)})  # still queued when main() ends
    else:
        mgr.join()
    print("daemon", mgr._save_process.pid, flush=True)
    if mode == "raise":
        raise RuntimeError("training failed")  # the traceback keeps mgr alive at exit
    return mgr

if __name__ == "__main__":
    kept = main(sys.argv[1], sys.argv[2])  # a module global at exit
"""


@pytest.mark.parametrize("mode", ["global", "raise", "pending"])
def test_a_program_that_ends_without_close_exits_and_stops_its_daemon(
    tmp_path: Path, mode: str
) -> None:
    """Without close(), exit waits for the queued saves, then stops the daemon. It waited
    forever: multiprocessing's exit sends SIGTERM to daemonic children, which the daemon
    ignores, and waits for them, while the daemon waits on a pipe the manager still held."""
    root = tmp_path / "ckpts"
    returncode, out, err = run_script(tmp_path, EXIT_WITHOUT_CLOSE_CHILD, str(root), mode)
    daemons = [int(line.split()[1]) for line in out.splitlines() if line.startswith("daemon ")]
    alive = []
    for pid in daemons:  # never leave one behind, whatever happened
        try:
            os.kill(pid, signal.SIGKILL)
            alive.append(pid)
        except ProcessLookupError:
            pass
    assert returncode == (1 if mode == "raise" else 0), out + err
    assert daemons and not alive, f"daemons {daemons}, still alive at exit: {alive}"
    with CheckpointManager(root, 1, chkpt_on_preemption=False, read_only=True) as reader:
        assert reader.all_steps() == ([1, 2] if mode == "pending" else [1])


FAULTY_START_SCRIPT = r"""
import multiprocessing, os, signal, sys, torch
from torch.distributed.checkpoint import _async_process_executor
from ckptmgr import CheckpointManager

waited_for_ready = _async_process_executor._AsyncCheckpointProcess._wait_for_response
first_start = [True]

def faulty_first_start(self, timeout=None):  # DCP waits 1800 s for a daemon to be ready
    if timeout == 1800 and first_start[0]:
        first_start[0] = False
        if sys.argv[2] == "slow":
            timeout = 0.01
        else:  # killed (as by the OOM killer)
            os.kill(self._save_process.pid, signal.SIGKILL)
            self._save_process.join(60)
    return waited_for_ready(self, timeout=timeout)

_async_process_executor._AsyncCheckpointProcess._wait_for_response = faulty_first_start

if __name__ == "__main__":
    mgr = CheckpointManager(sys.argv[1], 1, async_mode="process", chkpt_on_preemption=False)
    mgr.save_async(1, {"w": torch.ones(4)})
    try:
        mgr.join()
    except Exception as exc:
        print("join raised", type(exc).__name__, exc, flush=True)
    print("children after the failed start", multiprocessing.active_children(), flush=True)
    mgr.save_async(2, {"w": torch.full((4,), 2.0)})
    mgr.join()
    mgr.close()
    print("listed", mgr.all_steps(), flush=True)
"""


def test_a_daemon_that_is_not_ready_in_time_is_killed_and_the_program_exits(
    tmp_path: Path,
) -> None:
    """A daemon that did not answer within DCP's start-up wait (1800 s; here shortened) was left
    running, held by nothing: close() left it, and the program never exited (multiprocessing's
    exit waits for its daemonic children, and the daemon ignores SIGTERM). It is killed, the save
    fails saying so (it raised DCP's bare RuntimeError), and the next save starts another."""
    returncode, out, err = run_script(tmp_path, FAULTY_START_SCRIPT, str(tmp_path / "c"), "slow")
    assert returncode == 0, out + err
    assert "join raised CheckpointError" in out and "did not become ready" in out, out + err
    assert "children after the failed start []" in out, out
    assert "listed [2]" in out, out


def test_a_daemon_killed_while_starting_is_named_so_without_advice_on_the_script(
    tmp_path: Path,
) -> None:
    """A daemon killed by a signal before it was ready (the OOM killer) was reported with the
    advice to guard the main script, which is for a daemon that raised there."""
    returncode, out, err = run_script(tmp_path, FAULTY_START_SCRIPT, str(tmp_path / "c"), "killed")
    assert returncode == 0, out + err
    assert "join raised CheckpointError" in out, out + err
    assert "was killed by SIGKILL before it was ready (exit code -9)" in out, out
    assert "__main__" not in out, out
    assert "listed [2]" in out, out


DAEMONIC_CHILD_SCRIPT = r"""
import multiprocessing, sys

def make_manager(root, answers):
    from ckptmgr import CheckpointManager
    try:
        CheckpointManager(root, 1, async_mode="process", chkpt_on_preemption=False)
        answers.put("made")
    except Exception as exc:
        answers.put(f"{type(exc).__name__}: {exc}")

if __name__ == "__main__":
    context = multiprocessing.get_context("fork")
    answers = context.Queue()
    child = context.Process(target=make_manager, args=(sys.argv[1], answers), daemon=True)
    child.start()
    print("child:", answers.get(timeout=60), flush=True)
    child.join(60)
"""


def test_a_daemonic_process_is_refused_when_the_manager_is_made(tmp_path: Path) -> None:
    """A daemonic multiprocessing child (a Pool's worker) may not start processes: the manager
    is refused at once (every save failed with multiprocessing's bare AssertionError)."""
    returncode, out, err = run_script(tmp_path, DAEMONIC_CHILD_SCRIPT, str(tmp_path / "ckpts"))
    assert returncode == 0, out + err
    refusal = "CheckpointError: async_mode='process' cannot start its checkpoint daemon in a "
    assert f"child: {refusal}daemonic process" in out, out + err


KILLED_WHILE_IDLE_SCRIPT = r"""
import sys, torch
from ckptmgr import CheckpointManager

if __name__ == "__main__":
    mgr = CheckpointManager(sys.argv[1], 1, async_mode="process", chkpt_on_preemption=False)
    mgr.save_async(1, {"w": torch.ones(4)})
    mgr.join()
    print("daemon", mgr._save_process.pid, flush=True)
    sys.stdin.readline()  # until killed (or the test's end closes stdin)
"""


def _running(pid: int) -> bool:
    """True while process ``pid`` exists and is no zombie (reparented, it may wait for a reaper
    that a container's init is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_the_daemon_of_a_killed_training_process_ends_quietly(tmp_path: Path) -> None:
    """``kill -9`` of an idle training process: its daemon ends (its pipe closed), without the
    traceback of an EOFError on the standard error it shares with the training process."""
    stderr_path = tmp_path / "stderr"
    script = tmp_path / "killed_while_idle.py"
    script.write_text(KILLED_WHILE_IDLE_SCRIPT)
    with stderr_path.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "ckpts")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            start_new_session=True,
        )
    daemon_pid = None
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # bounded: the script exits when its stdin closes
        assert line.startswith("daemon "), line + stderr_path.read_text()
        daemon_pid = int(line.split()[1])
        process.kill()
        process.wait(60)
        deadline = time.monotonic() + DEATH_TIMEOUT_S
        while _running(daemon_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(daemon_pid), "the daemon outlived its process"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate(timeout=60)
    assert "Traceback" not in stderr_path.read_text(), stderr_path.read_text()


FORKED_CHILD_EXITS_SCRIPT = r"""
import os, sys, torch
from ckptmgr import CheckpointManager

if __name__ == "__main__":
    mgr = CheckpointManager(sys.argv[1], 1, async_mode="process", chkpt_on_preemption=False)
    mgr.save_async(1, {"w": torch.ones(4)})
    mgr.join()
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a forked child that ends normally (the interpreter's exit runs)
    print("child exit status", os.waitpid(pid, 0)[1], flush=True)
    mgr.save_async(2, {"w": torch.full((4,), 2.0)})
    mgr.close()
    print("listed", mgr.all_steps(), flush=True)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_forked_child_that_exits_leaves_the_parents_daemon_alone_and_quiet(
    tmp_path: Path,
) -> None:
    """A child forked from a process-mode training process inherits DCP's daemon object; at
    the child's exit its finalizer tested the parent's daemon and printed "Exception ignored
    ... AssertionError: can only test a child process". The parent's daemon serves on."""
    returncode, out, err = run_script(tmp_path, FORKED_CHILD_EXITS_SCRIPT, str(tmp_path / "c"))
    assert returncode == 0, out + err
    assert "child exit status 0" in out and "listed [1, 2]" in out, out + err
    assert "Exception ignored" not in err and "AssertionError" not in err, err


UNGUARDED_SCRIPT = r"""
import sys, torch
from ckptmgr import CheckpointManager

mgr = CheckpointManager(sys.argv[1], 1, async_mode="process", chkpt_on_preemption=False)
try:
    mgr.save_async(1, {"w": torch.ones(10)})
    mgr.join()
except Exception as exc:
    print("save raised", type(exc).__name__, exc, flush=True)
mgr.close()
print("listed", mgr.all_steps(), flush=True)
"""


def test_a_script_without_a_main_guard_fails_its_save_saying_so(tmp_path: Path) -> None:
    """The daemon is spawned: it imports the main script again, and an unguarded one makes a
    second manager there. That manager is refused before it touches the root (it competed for
    the owner lease: LeaseHeldError), and the save says why the daemon ended (it said "Checkpoint
    background process is dead. Exit code: None")."""
    root = tmp_path / "ckpts"
    returncode, out, err = run_script(tmp_path, UNGUARDED_SCRIPT, str(root))
    assert returncode == 0, out + err
    guard = 'guard the script\'s entry point with `if __name__ == "__main__":`'
    assert "save raised CheckpointError" in out and "ended before it was ready" in out, out + err
    assert guard in out, out
    assert "a CheckpointManager is being made while this process is started" in err, err
    assert "LeaseHeld" not in err, err
    assert "listed []" in out, out


def test_a_script_read_from_standard_input_is_refused_when_the_manager_is_made(
    tmp_path: Path,
) -> None:
    """``python - < train.py``: spawn runs the main script again in the daemon, from
    ``<stdin>``, which is no file. The manager is refused at once saying so; the first save
    failed instead, advising a ``__main__`` guard, which could not help."""
    script = "if __name__ == '__main__':\n" + "\n".join(
        "    " + line for line in UNGUARDED_SCRIPT.strip().splitlines()
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    child = subprocess.run(
        [sys.executable, "-", str(tmp_path / "ckpts")],
        input=script,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert child.returncode == 1, child.stdout + child.stderr
    assert "CheckpointError: async_mode='process' cannot start its checkpoint daemon" in (
        child.stderr
    )
    assert f"from '{tmp_path / '<stdin>'}', which is no file" in child.stderr, child.stderr
    assert not (tmp_path / "ckpts").exists()


FORK_WHILE_THE_TRACKER_IS_HELD = r"""
import multiprocessing.resource_tracker, os, sys, threading, torch
from ckptmgr import CheckpointManager

if __name__ == "__main__":
    held, release = threading.Event(), threading.Event()
    tracker = multiprocessing.resource_tracker._resource_tracker

    def hold():  # as the parent's writer thread does while it starts a daemon
        with tracker._lock:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(60)
    pid = os.fork()
    if pid == 0:
        mgr = CheckpointManager(sys.argv[1], 1, async_mode="process", chkpt_on_preemption=False)
        mgr.save_async(7, {"w": torch.ones(4)})
        mgr.close()
        print("child listed", mgr.all_steps(), flush=True)
        os._exit(0)
    release.set()
    holder.join()
    print("child exit status", os.waitpid(pid, 0)[1], flush=True)
"""


def test_a_forked_child_starts_its_daemon_though_a_lock_was_held_at_the_fork(
    tmp_path: Path,
) -> None:
    """The parent's writer thread held multiprocessing's resource tracker lock while it started
    a daemon; a fork then left it held in the child, whose own manager's first daemon start
    waited for it for ever (its close() too)."""
    returncode, out, err = run_script(tmp_path, FORK_WHILE_THE_TRACKER_IS_HELD, str(tmp_path / "c"))
    assert returncode == 0, out + err
    assert "child listed [7]" in out and "child exit status 0" in out, out + err


def test_the_daemons_store_port_is_chosen_when_it_binds(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port probed free and handed to the daemon could be taken before the daemon bound it
    (another process's daemon started at the same time, a forked child's): the save failed
    with EADDRINUSE. Taken here, as such a process would, it fails nothing now."""
    real_init_info = SaveProcess._init_info
    taken: list[socket.socket] = []

    def init_info_whose_port_is_taken(self: SaveProcess) -> Any:
        info = real_init_info(self)
        if info.tcp_store_master_port:  # a port chosen here: another process binds it first
            squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            squatter.bind((info.tcp_store_master_addr, info.tcp_store_master_port))
            squatter.listen()
            taken.append(squatter)
        return info

    monkeypatch.setattr(SaveProcess, "_init_info", init_info_whose_port_is_taken)
    try:
        with process_manager(ckpt_dir) as mgr:
            assert mgr.save_async(1, {"w": torch.ones(4)})
            mgr.join()
            assert mgr.all_steps() == [1]
    finally:
        for squatter in taken:
            squatter.close()


def test_no_manager_is_made_while_multiprocessing_starts_this_process(tmp_path: Path) -> None:
    """What a spawned child sees while it imports the main module: refused, nothing made."""
    process = multiprocessing.process.current_process()
    process._inheriting = True  # type: ignore[attr-defined]  # as spawn's _main sets it
    try:
        with pytest.raises(CheckpointError, match="guard the script's entry point"):
            CheckpointManager(tmp_path / "ckpts", 1, chkpt_on_preemption=False)
    finally:
        del process._inheriting  # type: ignore[attr-defined]
    assert not (tmp_path / "ckpts").exists()


# -- file work between saves runs in the daemon ---------------------------------------------------
class KeepTheNewestStep:
    """A retention policy of the user's own (not ckptmgr's): planned in the training process."""

    def keep(self, checkpoints: Any) -> set[int]:
        return {max(checkpoint.step for checkpoint in checkpoints)}


def test_the_file_work_of_deleting_old_steps_goes_to_the_daemon(ckpt_dir: Path) -> None:
    """With a policy of the user's own, retention plans in the training process, and its
    deletions run through the storage's ``run_local_file_work``, which a process-mode manager
    points at its daemon; each old step still goes, and leaves nothing. (ckptmgr's own
    policies run in the daemon, after its commit: see the tests of ckptmgr.daemon_commit.)"""
    ran: list[str] = []
    with process_manager(ckpt_dir, retention=[KeepTheNewestStep()]) as mgr:
        save_process = save_process_of(mgr)
        storage = mgr._storage
        assert storage.run_local_file_work == save_process.run_when_idle
        storage.run_local_file_work = lambda function, *args: (
            ran.append(function.__name__) or save_process.run_when_idle(function, *args)
        )
        states = {step: {"tensors": tensor_state(40 + step, "base")} for step in (1, 2, 3)}
        for step, state in states.items():
            assert mgr.save_async(step, state)
            mgr.join()
        assert save_process.run_when_idle(os.getpid) == daemon_of(mgr).pid != os.getpid()
        assert ran == ["delete_local_step", "delete_local_step"]
        assert mgr.all_steps() == [3]
        assert sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir()) == [
            step_dir(ckpt_dir, 3).name
        ]
        target = zeros_like_state(states[3])
        mgr.restore(3, target)
        assert differences(target, states[3]) == []


def test_a_call_runs_here_while_a_save_holds_the_daemon_or_before_there_is_one(
    ckpt_dir: Path,
) -> None:
    with process_manager(ckpt_dir) as mgr:
        save_process = save_process_of(mgr)
        assert save_process.run_when_idle(os.getpid) == os.getpid()  # no daemon yet
        assert save_process._daemon is None, "a call must not start a daemon"
        assert mgr.save_async(1, {"tensors": tensor_state(45, "base")})
        mgr.join()
        with save_process._lock:  # as while a save runs: never waited for
            assert save_process.run_when_idle(os.getpid) == os.getpid()
        assert save_process.run_when_idle(os.getpid) == daemon_of(mgr).pid


def test_what_a_call_raises_in_the_daemon_is_raised_here_and_the_daemon_serves_on(
    ckpt_dir: Path,
) -> None:
    missing = ckpt_dir / "no-such-file"
    with process_manager(ckpt_dir) as mgr:
        assert mgr.save_async(1, {"tensors": tensor_state(46, "base")})
        mgr.join()
        save_process = save_process_of(mgr)
        pid = daemon_of(mgr).pid
        with pytest.raises(FileNotFoundError) as raised:
            save_process.run_when_idle(os.stat, str(missing))
        assert raised.value.filename == str(missing)
        assert save_process.healthy and save_process.run_when_idle(os.getpid) == pid
        state = {"tensors": tensor_state(47, "base")}
        assert mgr.save_async(2, state)
        mgr.join()
        assert save_process.pid == pid and mgr.all_steps() == [1, 2]
        target = zeros_like_state(state)
        mgr.restore(2, target)
        assert differences(target, state) == []


def test_a_daemon_that_dies_during_a_call_has_it_run_here_and_is_replaced(ckpt_dir: Path) -> None:
    with process_manager(ckpt_dir) as mgr:
        assert mgr.save_async(1, {"tensors": tensor_state(48, "base")})
        mgr.join()
        save_process = save_process_of(mgr)
        old = daemon_of(mgr)
        assert old.pid is not None
        # The daemon kills itself in the call; the call then runs here (and signals a process
        # that is dead but not yet reaped: nothing happens).
        assert save_process.run_when_idle(os.kill, old.pid, signal.SIGKILL) is None
        old.join(timeout=DEATH_TIMEOUT_S)
        assert old.exitcode == -signal.SIGKILL
        assert not save_process.healthy
        assert save_process.run_when_idle(os.getpid) == os.getpid()
        state = {"tensors": tensor_state(49, "base")}
        assert mgr.save_async(2, state)
        mgr.join()
        assert save_process.pid not in (None, old.pid)
        assert mgr.all_steps() == [1, 2]
        target = zeros_like_state(state)
        mgr.restore(2, target)
        assert differences(target, state) == []


def test_a_save_over_a_quarantined_step_moves_it_aside_in_process_mode(
    ckpt_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = {"tensors": tensor_state(50, "base")}
    again = {"tensors": tensor_state(51, "base")}
    with process_manager(ckpt_dir) as mgr:
        assert mgr.save_async(1, first)
        mgr.join()
        metadata = step_dir(ckpt_dir, 1) / ".metadata"
        damaged = bytearray(metadata.read_bytes())
        damaged[len(damaged) // 2] ^= 0x01
        metadata.write_bytes(bytes(damaged))
        assert mgr.restore_latest({"tensors": zeros_like_state(first)["tensors"]}) is None
        assert mgr.all_steps() == []  # quarantined
        with caplog.at_level(logging.WARNING, logger="ckptmgr.storage"):
            assert mgr.save_async(1, again, force=True)
            mgr.join()
        warnings = [r.getMessage() for r in caplog.records if r.name == "ckptmgr.storage"]
        assert any("moved quarantined step 1 aside" in message for message in warnings), warnings
        target = zeros_like_state(again)
        mgr.restore(1, target)
        assert differences(target, again) == []
    quarantined = CheckpointStorage(str(ckpt_dir)).quarantined()
    assert [q.step for q in quarantined] == [1] and ".metadata" in quarantined[0].reason
    assert quarantined[0].name.startswith("step_000000000001.quarantined-")


def test_a_commit_the_daemon_refuses_raises_its_error_here(ckpt_dir: Path) -> None:
    """A ckptmgr error raised by a call in the daemon arrives as itself; the daemon stays."""
    from ckptmgr.storage import AlreadyCommittedError, commit_local_step

    with process_manager(ckpt_dir) as mgr:
        assert mgr.save_async(1, {"tensors": tensor_state(52, "base")})
        mgr.join()
        write_dir = ckpt_dir / ".tmp-step_000000000001-other"
        write_dir.mkdir()
        final = step_dir(ckpt_dir, 1)
        record = (final / "commit.json").read_bytes()
        with pytest.raises(AlreadyCommittedError, match="another writer"):
            save_process_of(mgr).run_when_idle(
                commit_local_step, str(ckpt_dir), str(write_dir), str(final), "-", b"{}"
            )
        assert save_process_of(mgr).healthy
        assert (final / "commit.json").read_bytes() == record
        assert mgr.all_steps() == [1]


def test_the_record_lists_the_files_as_the_daemon_listed_them(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local save's write directory is listed by the DCP writer once every file is written:
    in process mode by the daemon, so the training process lists nothing (made to fail here)."""

    def no_listing_here(self: CheckpointStorage, path: str) -> Any:
        raise AssertionError(f"listed {path} in the training process")

    state = {"tensors": tensor_state(53, "base")}
    with process_manager(ckpt_dir) as mgr:
        monkeypatch.setattr(CheckpointStorage, "list_files", no_listing_here)
        assert mgr.save_async(1, state)
        mgr.join()
        monkeypatch.undo()
        record = read_record(ckpt_dir, 1)
        assert checksum_problems(step_dir(ckpt_dir, 1), record) == []
        target = zeros_like_state(state)
        mgr.restore(1, target)
        assert differences(target, state) == []


# -- the commit, made by the daemon's writer (ckptmgr.daemon_commit) ----------------------------
def test_the_daemon_commits_the_step_and_lists_the_root_for_retention(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A single-process local save is committed by the daemon's writer, which also lists the
    committed steps for retention: with the commit and the listing made to fail in the training
    process, every save commits (its record with the save's metrics, ``committed_at`` taken at
    the commit), retention keeps the last two, and each kept step restores bit-exact."""

    def not_here(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("committed or listed in the training process")

    import ckptmgr.storage

    states = {step: {"tensors": tensor_state(60 + step, "base")} for step in (1, 2, 3, 4)}
    with process_manager(ckpt_dir, max_to_keep=2) as mgr:
        monkeypatch.setattr(CheckpointStorage, "commit", not_here)
        monkeypatch.setattr(CheckpointStorage, "committed_steps", not_here)
        monkeypatch.setattr(ckptmgr.storage, "commit_local_step", not_here)
        started: dict[int, float] = {}
        for step, state in states.items():
            started[step] = time.time()
            assert mgr.save_async(step, state, metrics={"loss": 1.0 / step})
            mgr.join()
        monkeypatch.undo()
        assert mgr.all_steps() == [3, 4]
        assert sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir()) == [
            step_dir(ckpt_dir, 3).name,
            step_dir(ckpt_dir, 4).name,
        ]
        for step in (3, 4):
            record = read_record(ckpt_dir, step)
            assert record.step == step and record.metrics == {"loss": 1.0 / step}
            assert started[step] <= record.committed_at.timestamp() <= time.time()
            assert checksum_problems(step_dir(ckpt_dir, step), record) == []
            target = zeros_like_state(states[step])
            mgr.restore(step, target)
            assert differences(target, states[step]) == []


def test_the_daemon_applies_ckptmgrs_own_retention_after_its_commit(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """ckptmgr's own policies (here the best two by loss, and the latest two) are planned and
    applied by the daemon right after its commit: with planning, the lease read and deletion
    made to fail in the training process, the steps they do not keep are deleted, logged here,
    and the kept ones restore bit-exact."""
    from ckptmgr import KeepBest, lease, pruning

    def not_here(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("retention ran in the training process")

    losses = {1: 0.5, 2: 0.1, 3: 0.9, 4: 0.2, 5: 0.8, 6: 0.7}
    states = {step: {"tensors": tensor_state(90 + step, "base")} for step in losses}
    with process_manager(
        ckpt_dir, max_to_keep=2, retention=[KeepBest(n=2, metric="loss", mode="min")]
    ) as mgr:
        for name in ("list_and_plan_deletions", "delete_steps"):
            monkeypatch.setattr(pruning, name, not_here)
        monkeypatch.setattr(CheckpointStorage, "delete_step", not_here)
        monkeypatch.setattr(lease.OwnerLease, "confirm", not_here)
        with caplog.at_level(logging.INFO, logger="ckptmgr"):
            for step, state in states.items():
                assert mgr.save_async(step, state, metrics={"loss": losses[step]})
                mgr.join()
        monkeypatch.undo()
        kept = [2, 4, 5, 6]  # the best two (0.1, 0.2) and the latest two
        assert mgr.all_steps() == kept
        assert sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir()) == [
            step_dir(ckpt_dir, step).name for step in kept
        ]
        messages = [r.getMessage() for r in caplog.records]
        for gone in (1, 3):
            assert f"deleted step {gone} (retention)" in messages, messages
            assert any(m.startswith(f"retention deleting step {gone}:") for m in messages)
        for step in kept:
            target = zeros_like_state(states[step])
            mgr.restore(step, target)
            assert differences(target, states[step]) == []


def test_a_take_over_after_a_commit_leaves_the_steps_as_they_are(ckpt_dir: Path) -> None:
    """A take-over after the last commit: the next save reads the owner record in the daemon
    before it commits, commits nothing, and its retention deletes nothing (the daemon reads the
    record again before deleting: tests/test_daemon_commit.py)."""
    state = {"tensors": tensor_state(99, "base")}
    with process_manager(ckpt_dir, max_to_keep=1, lease_timeout_s=600.0) as mgr:
        for step in (1, 2):
            assert mgr.save_async(step, state)
            mgr.join()
        assert mgr.all_steps() == [2]
        owner = ckpt_dir / "owner.json"
        record = json.loads(owner.read_bytes())
        record.update(job_id="another-job", lease_id=uuid.uuid4().hex)
        owner.write_text(json.dumps(record))
        assert mgr.save_async(3, state)
        with pytest.raises(CheckpointError, match="taken over by job 'another-job'"):
            mgr.join()
        assert mgr.all_steps() == [2]
        assert sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir()) == [
            step_dir(ckpt_dir, 2).name
        ]


def _record_what_goes_whole(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[bool]]:
    """By slot of ``SaveProcess.kept_in_daemon``, whether each request carried the value whole
    (True) or by token (False), as the requests are pickled."""
    sent: dict[str, list[bool]] = {}
    kept_arguments = SaveProcess._kept_arguments

    def spy(self: SaveProcess, slot: str, value: Any) -> Any:
        arguments = kept_arguments(self, slot, value)
        sent.setdefault(slot, []).append(arguments[2])
        return arguments

    monkeypatch.setattr(SaveProcess, "_kept_arguments", spy)
    return sent


def test_the_pack_layout_and_staged_tensors_go_to_the_daemon_once_per_layout_and_daemon(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layout of the packed small tensors (what the record's tensor table is made from)
    and the staged tensors (their places in the shared arena) travel whole in the first save
    of each layout to each daemon, by token otherwise (the daemon writes the new bytes through
    the views it keeps): across a layout change and a daemon replaced after a SIGKILL, every
    step restores bit-exact. What the training process keeps of the staged tensors sent holds
    no arena's storage once the daemon has it."""
    from ckptmgr import save_process

    sent = _record_what_goes_whole(monkeypatch)
    states = {
        1: {"tensors": tensor_state(70, "base")},
        2: {"tensors": tensor_state(71, "base")},
        3: {"tensors": tensor_state(72, "changed")},
        4: {"tensors": tensor_state(73, "changed")},
        5: {"tensors": tensor_state(74, "changed")},
    }
    with process_manager(ckpt_dir) as mgr:
        for step, state in states.items():
            if step == 5:
                kill_and_reap(daemon_of(mgr))
            assert mgr.save_async(step, state)
            mgr.join()
            kept = save_process_of(mgr)._sent_states[-1]
            views = [v for v in kept.state.values() if isinstance(v, save_process._ArenaView)]
            assert views and all(view._args[1] is None for view in views), step
        assert sent == {
            "pack layout": [True, False, True, False, True],
            "staged tensors": [True, False, True, False, True],
        }
        for step, state in states.items():
            target = zeros_like_state(state)
            mgr.restore(step, target)
            assert differences(target, state) == [], step
            record = read_record(ckpt_dir, step)
            assert len(record.tensor_table.entries) == N_SMALL + (4 if step < 3 else 6)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/<pid>/maps: Linux")
def test_two_staging_slots_send_their_layout_and_staged_tensors_whole_once_each(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``max_pending_async=2`` saves take turns between two staging slots (made certain
    here by stopping the daemon so that a save stays in flight while the next one stages). The
    daemon keeps what each slot sent: the pack layout and the staged tensors go whole in the
    first save of each slot, by token in the later ones, whichever slot went last. When one
    slot's layout changes (into a new arena), the daemon drops what it kept of the old arena
    and maps only the arenas the training process has. Every step restores bit-exact."""
    sent = _record_what_goes_whole(monkeypatch)
    states = {step: {"tensors": tensor_state(110 + step, "base")} for step in range(1, 6)}
    states[6] = {"tensors": tensor_state(116, "changed")}
    expected = copy.deepcopy(states)
    with process_manager(ckpt_dir, max_pending_async=2) as mgr:

        def two_in_flight(first: int, second: int) -> None:
            daemon = daemon_of(mgr)
            assert daemon.pid is not None
            os.kill(daemon.pid, signal.SIGSTOP)
            try:
                assert mgr.save_async(first, states[first])
                wait_until_the_writer_waits_for_the_daemon()
                assert mgr.save_async(second, states[second])  # the other slot
            finally:
                os.kill(daemon.pid, signal.SIGCONT)
            mgr.join()

        assert mgr.save_async(1, states[1])
        mgr.join()
        two_in_flight(2, 3)  # slot of step 1, then the other one
        two_in_flight(4, 5)  # the other one first this time
        assert sent == {
            "pack layout": [True, False, True, False, False],
            "staged tensors": [True, False, True, False, False],
        }
        assert mgr.save_async(6, states[6])
        mgr.join()
        pid = daemon_of(mgr).pid
        assert pid is not None
        in_daemon, here = _shared_memory_maps(pid), _shared_memory_maps(os.getpid())
        assert len(in_daemon) == 2 and in_daemon <= here, (in_daemon, here)
        for step, state in expected.items():
            target = zeros_like_state(state)
            mgr.restore(step, target)
            assert differences(target, state) == [], step


def test_an_answer_left_to_commit_here_carries_the_tensor_entries_once_per_metadata() -> None:
    """A save that the training process commits (distributed, or on a remote store) is answered
    with what the commit reads of DCP's metadata: its checksums, listing and the stored
    tensors' entries, not the metadata's chunks and storage places (0.7 s a save for 5,000
    DTensors over 2 ranks); while DCP's kept plans keep the very same metadata, the entries
    travel as a word and are put back here. Over a real pipe, as the daemon answers."""
    from multiprocessing import Pipe

    from torch.distributed.checkpoint import metadata as dcp_metadata

    from ckptmgr import save_process
    from ckptmgr.record import tensor_entries

    def made(names: list[str]) -> dcp_metadata.Metadata:
        stored = {
            name: dcp_metadata.TensorStorageMetadata(
                dcp_metadata.TensorProperties(dtype=torch.float32),
                torch.Size([4, 2]),
                [dcp_metadata.ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 2]))],
            )
            for name in names
        }
        metadata = dcp_metadata.Metadata(state_dict_metadata=stored, storage_data={"x": 1})
        setattr(metadata, save_process.CHECKSUMS_ATTRIBUTE, {"__0_0.distcp": (32, 7)})
        setattr(metadata, save_process.LISTING_ATTRIBUTE, {"__0_0.distcp": 32})
        return metadata

    daemon_end, here = Pipe()
    serving = save_process._CallServingConnection(daemon_end)
    process = SaveProcess(None, 5.0)
    first, other = made(["a", "b"]), made(["a", "b", "c"])
    got: list[Any] = []
    for metadata in (first, first, other, other):
        serving.send(metadata)
        answer = here.recv()
        assert answer.state_dict_metadata == {} and answer.storage_data is None
        assert getattr(answer, save_process.CHECKSUMS_ATTRIBUTE) == {"__0_0.distcp": (32, 7)}
        assert getattr(answer, save_process.LISTING_ATTRIBUTE) == {"__0_0.distcp": 32}
        got.append(getattr(answer, save_process.TENSOR_ENTRIES_ATTRIBUTE))
        entries = getattr(process._with_entries(answer), save_process.TENSOR_ENTRIES_ATTRIBUTE)
        assert entries == tensor_entries(metadata)
    sent_whole = [not isinstance(entries, str) for entries in got]
    assert sent_whole == [True, False, True, False]
    daemon_end.close()
    here.close()


def test_the_answer_to_a_save_the_daemon_committed_carries_the_commit_alone(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon answers a save its writer committed with the commit's result and nothing
    else the training process would unpickle for no use: DCP's metadata empty, no file sizes
    and checksums. The step's own ``.metadata`` file holds the whole of DCP's metadata, and the
    step restores bit-exact."""
    from torch.distributed.checkpoint import FileSystemReader

    from ckptmgr.daemon_commit import DaemonCommitResult
    from ckptmgr.save_process import CHECKSUMS_ATTRIBUTE, COMMITTED_ATTRIBUTE, LISTING_ATTRIBUTE

    answers: list[Any] = []
    save = SaveProcess.save

    def spy(self: SaveProcess, *args: Any, **kwargs: Any) -> Any:
        answers.append(save(self, *args, **kwargs))
        return answers[-1]

    monkeypatch.setattr(SaveProcess, "save", spy)
    states = {step: {"tensors": tensor_state(80 + step, "base")} for step in (1, 2)}
    with process_manager(ckpt_dir) as mgr:
        for step, state in states.items():
            assert mgr.save_async(step, state)
            mgr.join()
        assert len(answers) == 2
        for step, answer in zip(states, answers, strict=True):
            assert answer.state_dict_metadata == {}
            assert not hasattr(answer, CHECKSUMS_ATTRIBUTE)
            assert not hasattr(answer, LISTING_ATTRIBUTE)
            committed = getattr(answer, COMMITTED_ATTRIBUTE)
            assert isinstance(committed, DaemonCommitResult)
            assert step in (committed.listed or [])
        for step, state in states.items():
            on_disk = FileSystemReader(str(step_dir(ckpt_dir, step))).read_metadata()
            assert len(on_disk.state_dict_metadata) > 0
            target = zeros_like_state(state)
            mgr.restore(step, target)
            assert differences(target, state) == [], step


def test_a_lease_taken_over_during_the_write_commits_nothing(ckpt_dir: Path) -> None:
    """The daemon reads the owner record just before it commits: a take-over that the
    heartbeat has not seen yet (it beats every 150 s here) fails the save, commits nothing,
    and stops this job's saves from then on."""
    state = {"tensors": tensor_state(80, "base")}
    with process_manager(ckpt_dir, lease_timeout_s=600.0) as mgr:
        assert mgr.save_async(1, state)
        mgr.join()
        owner = ckpt_dir / "owner.json"
        record = json.loads(owner.read_bytes())
        record.update(job_id="another-job", lease_id=uuid.uuid4().hex)
        owner.write_text(json.dumps(record))  # another job took the root over
        assert mgr.save_async(2, state)
        with pytest.raises(CheckpointError, match="taken over by job 'another-job'"):
            mgr.join()
        assert not step_dir(ckpt_dir, 2).exists()
        assert not [p.name for p in ckpt_dir.iterdir() if p.name.startswith(".tmp-")]
        assert mgr.all_steps() == [1]
        with pytest.raises(CheckpointError, match="taken over"):
            mgr.save(3, state)
        assert not step_dir(ckpt_dir, 3).exists()
        assert json.loads(owner.read_bytes())["job_id"] == "another-job"


def test_a_step_another_writer_committed_fails_the_save_and_is_left_alone(ckpt_dir: Path) -> None:
    """A step that another writer committed meanwhile is refused by the daemon's commit: the
    save fails with that error, the other writer's step stays as it was, and the next save
    commits, in the same daemon (which answered the failure and serves on: no new process)."""
    state = {"tensors": tensor_state(81, "base")}
    with process_manager(ckpt_dir) as mgr:
        assert mgr.save_async(1, state)
        mgr.join()
        daemon = daemon_of(mgr)
        foreign = step_dir(ckpt_dir, 2)
        foreign.mkdir()
        (foreign / "commit.json").write_bytes(b"another writer's record")
        assert mgr.save_async(2, state)
        with pytest.raises(CheckpointError, match="committed by another writer"):
            mgr.join()
        assert [p.name for p in foreign.iterdir()] == ["commit.json"]
        assert (foreign / "commit.json").read_bytes() == b"another writer's record"
        assert save_process_of(mgr).healthy
        assert mgr.save_async(3, state)
        mgr.join()
        assert daemon_of(mgr).pid == daemon.pid and daemon.is_alive()
        assert mgr.all_steps() == [1, 2, 3]  # storage's view: the other writer's step too
        target = zeros_like_state(state)
        mgr.restore(3, target)
        assert differences(target, state) == []


def test_a_write_the_daemon_failed_leaves_it_serving_the_next_save(ckpt_dir: Path) -> None:
    """A write that fails in the daemon (its file size limit lowered with ``prlimit``: the
    kernel refuses the data file with EFBIG) fails the save, commits nothing, and the daemon,
    which answered the failure, serves the next save once the limit is back: the same process,
    the step bit-exact. The daemon keeps DCP's plans from save to save, and drops them when a
    save fails (as thread mode's writer does)."""
    import resource

    from ckptmgr.daemon_save import holds_plans

    states = {step: {"tensors": tensor_state(90 + step, "base")} for step in (1, 2, 3)}
    with process_manager(ckpt_dir) as mgr:
        assert mgr.save_async(1, states[1])
        mgr.join()
        assert save_process_of(mgr).run_when_idle(holds_plans) is True
        daemon = daemon_of(mgr)
        soft, hard = resource.prlimit(daemon.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(daemon.pid, resource.RLIMIT_FSIZE, (4096, hard))
        try:
            assert mgr.save_async(2, states[2])
            with pytest.raises(CheckpointError, match="File too large"):
                mgr.join()
        finally:
            resource.prlimit(daemon.pid, resource.RLIMIT_FSIZE, (soft, hard))
        assert mgr.all_steps() == [1]
        assert not step_dir(ckpt_dir, 2).exists()
        assert daemon.is_alive() and save_process_of(mgr).healthy
        assert save_process_of(mgr).run_when_idle(holds_plans) is False
        assert mgr.save_async(3, states[3])
        mgr.join()
        assert daemon_of(mgr).pid == daemon.pid
        assert save_process_of(mgr).run_when_idle(holds_plans) is True
        assert mgr.all_steps() == [1, 3]
        target = zeros_like_state(states[3])
        mgr.restore(3, target)
        assert differences(target, states[3]) == []


class _Unpicklable(Exception):
    def __reduce__(self) -> Any:
        raise TypeError("not picklable")


def _raise_unpicklable() -> None:
    raise _Unpicklable("from the daemon")


def test_the_daemon_side_of_the_pipe_answers_calls_between_requests() -> None:
    """The daemon's end of the pipe, as DCP's serving loop reads it, in this process: a call
    is answered with its result (or its error, as a CheckpointError when that cannot be
    pickled), and the next other request is what recv() returns."""
    from ckptmgr.save_process import _CallResult, _CallServingConnection, _DaemonCall

    training_end, daemon_end = multiprocessing.Pipe()
    serving = _CallServingConnection(daemon_end)
    training_end.send(_DaemonCall(len, ("four",)))
    training_end.send(_DaemonCall(_raise_unpicklable, ()))
    training_end.send("a save request")
    assert serving.recv() == "a save request"
    first, second = training_end.recv(), training_end.recv()
    assert isinstance(first, _CallResult) and first.unwrap() == 4
    with pytest.raises(CheckpointError, match="_Unpicklable"):
        second.unwrap()
    serving.send("an answer")  # everything but recv is the pipe's own
    assert training_end.poll(POLL_TIMEOUT_S) and training_end.recv() == "an answer"
    training_end.close()
    serving.close()


# -- 5. configuration ------------------------------------------------------------------------------
class _RenamedMemoryFileSystem(MemoryFileSystem):
    """fsspec's in-memory file system under a protocol of its own."""

    protocol = ("renamed-memory",)


@pytest.mark.parametrize("scheme", ["memory", "renamed-memory"])
def test_memory_root_is_refused_in_process_mode(scheme: str) -> None:
    """An in-memory file system is refused at once, also under a protocol of its own (where
    every save failed: "commit failed: CorruptCheckpointError('.metadata was written but
    storage does not hold it')", the daemon having written into its own memory)."""
    fsspec.register_implementation("renamed-memory", _RenamedMemoryFileSystem, clobber=True)
    with pytest.raises(CheckpointError, match="async_mode"):
        CheckpointManager(
            f"{scheme}://process-mode-{uuid.uuid4().hex}",
            1,
            async_mode="process",
            chkpt_on_preemption=False,
        )


def test_unknown_async_mode_is_a_validation_error(tmp_path: Path) -> None:
    with pytest.raises(pydantic.ValidationError, match="async_mode"):
        CheckpointConfig(path=str(tmp_path), save_interval=1, async_mode="bogus")
    with pytest.raises(ValueError, match="async_mode"):
        CheckpointManager(tmp_path, 1, async_mode="bogus", chkpt_on_preemption=False)
    assert CheckpointConfig(path=str(tmp_path), save_interval=1).async_mode == "thread"


def test_yaml_config_with_process_mode_round_trips(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    config_file = tmp_path / "checkpointing.yaml"
    config_file.write_text(
        f"path: {json.dumps(str(root))}\n"
        "save_interval: 1\n"
        "async_mode: process\n"
        "chkpt_on_preemption: false\n"
    )
    assert CheckpointConfig.from_file(config_file).async_mode == "process"
    saved = {"tensors": tensor_state(41, "base")}
    expected = copy.deepcopy(saved)
    mgr = CheckpointManager.from_config(config_file)
    try:
        assert mgr.config.async_mode == "process"
        assert mgr.save_async(1, saved)
        mutate(saved["tensors"])
        mgr.join()
        assert save_process_of(mgr).pid is not None, "save_async did not use a daemon"
        target = zeros_like_state(expected)
        mgr.restore(1, target)
        assert differences(target, expected) == []
    finally:
        mgr.close()


# -- 6. plain save() in process mode ---------------------------------------------------------------
def test_sync_save_in_process_mode_runs_in_thread_and_starts_no_daemon(ckpt_dir: Path) -> None:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    train_one_step(model, optimizer, 0)
    tensors = tensor_state(51, "base")
    expected = snapshot(tensors, model, optimizer)
    children_before = set(multiprocessing.active_children())
    with process_manager(ckpt_dir) as mgr:
        assert mgr.save(1, {"tensors": tensors, "model": model, "optim": optimizer})
        assert save_process_of(mgr).pid is None
        assert save_process_of(mgr)._daemon is None
        assert set(multiprocessing.active_children()) == children_before
        assert restored_differences(mgr, 1, expected) == []
        assert checksum_problems(step_dir(ckpt_dir, 1), read_record(ckpt_dir, 1)) == []


# -- 7. two ranks under torchrun -------------------------------------------------------------------
def test_two_ranks_save_async_in_daemons_and_restore_bit_exact(tmp_path: Path) -> None:
    out_dir, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out_dir.mkdir()
    launch = torchrun("process", NPROC, WORKER, out_dir, "process", out_dir, ckpt)
    records = launch.checked_records(NPROC)
    for rank, record in records.items():
        where = f"rank {rank}"
        assert [entry["step"] for entry in record["saves"]] == STEPS, where
        for entry in record["saves"]:
            assert entry["error"] is None and entry["returned"] is True, f"{where}: {entry}"
            assert entry["training_all_reduce"] == [3.0] * 4, where
        assert record["join_errors"] == [None, None], where
        assert record["all_steps"] == STEPS, where
        pids = record["daemon_pids"]
        assert len(set(pids)) == 1 and pids[0] is not None, f"{where}: {pids}"
        assert pids[0] != record["pid"], where
        assert record["daemon_alive_before_close"] is True, where
        assert record["close_error"] is None, where
        assert record["daemon_alive_after_close"] is False, where
        assert [r["step"] for r in record["restores"]] == STEPS, where
        for restored in record["restores"]:
            assert restored["error"] is None, f"{where}: {restored}"
            assert restored["differences"] == dict.fromkeys(restored["differences"]), (
                f"{where}, step {restored['step']}: {restored['differences']}"
            )
            assert set(restored["differences"]) == {
                "model",
                "local",
                "local_big",
                "sharded",
                "step",
            }
    assert records[0]["daemon_pids"][0] != records[1]["daemon_pids"][0]

    for step in STEPS:
        record = read_record(ckpt, step)
        assert record.world_size == NPROC
        directory = step_dir(ckpt, step)
        assert checksum_problems(directory, record) == [], f"step {step}"
        data = [entry.path for entry in record.files if entry.path.endswith(".distcp")]
        for rank in range(NPROC):
            assert any(name.startswith(f"__{rank}_") for name in data), (
                f"step {step}: no data file of rank {rank} in {data}"
            )
            assert f"objects-rank{rank:05d}.json" in {entry.path for entry in record.files}


def test_two_ranks_recover_after_one_daemon_is_killed(tmp_path: Path) -> None:
    """Rank 1's daemon dies between saves: the save after it may fail (with CheckpointError,
    on both ranks), but the one after that must commit on both ranks."""
    out_dir, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out_dir.mkdir()
    launch = torchrun("kill", NPROC, WORKER, out_dir, "kill", out_dir, ckpt)
    records = launch.checked_records(NPROC)
    assert records[1]["killed"] is True
    for rank, record in records.items():
        saves = {entry["step"]: entry for entry in record["saves"]}
        assert sorted(saves) == KILL_STEPS
        first = saves[KILL_STEPS[0]]
        assert first["error"] is None or first["is_checkpoint_error"], f"rank {rank}: {first}"
        last = saves[KILL_STEPS[-1]]
        assert last["error"] is None, f"rank {rank}: the manager did not recover: {record}"
        assert KILL_STEPS[-1] in record["all_steps"], f"rank {rank}: {record['all_steps']}"
        assert record["restore_error"] is None, f"rank {rank}"
        assert set(record["restore_differences"].values()) == {None}, record["restore_differences"]
        assert record["close_error"] is None, f"rank {rank}"
    assert records[1]["saves"][-1]["pid"] not in (None, records[1]["first_pid"])
    assert (
        checksum_problems(step_dir(ckpt, KILL_STEPS[-1]), read_record(ckpt, KILL_STEPS[-1])) == []
    )


# -- 8. S3 (moto's server on 127.0.0.1) ------------------------------------------------------------
@pytest.fixture(name="s3_server", scope="module")
def s3_server_fixture() -> Iterator[Server]:
    """moto's S3 server, as tests/test_cloud_storage.py runs it (S3 only here)."""
    require_cloud_modules()
    running = start_moto()
    try:
        yield running
    finally:
        running.stop()


@pytest.mark.cloud
def test_process_mode_saves_to_s3_and_restores_bit_exact(s3_server: Server) -> None:
    root = s3_server.root(f"process-{uuid.uuid4().hex[:12]}")
    options = s3_server.storage_options()
    with process_manager(root, storage_options=options) as mgr:
        for step in (1, 2):
            state = make_cloud_state(step, size=65536)
            assert mgr.save_async(step, state)
            mutate(state["model"])  # after staging: must not reach the checkpoint
        mgr.join()
        assert save_process_of(mgr).pid is not None, "save_async did not use a daemon"
        assert mgr.all_steps() == [1, 2]
        for step in (1, 2):
            target = blank_like(make_cloud_state(step, size=65536))
            mgr.restore(step, target)
            assert cloud_differences(target, make_cloud_state(step, size=65536)) == []
            mgr.verify(step, deep=True)
    storage = CheckpointStorage(root, options)
    for step in (1, 2):
        record = storage.read_record(step)
        assert any(entry.path.endswith(".distcp") for entry in record.files), record.files
        for entry in record.files:
            data = storage.fs.cat_file(f"{storage.step_path(step)}/{entry.path}")
            assert (entry.size, entry.crc32) == (len(data), zlib.crc32(data)), entry


def test_a_file_system_registered_at_run_time_is_known_to_the_daemon(tmp_path: Path) -> None:
    """A protocol registered with ``fsspec.register_implementation`` in the training process
    was unknown in the daemon (a fresh, spawned process): every save failed with "Checkpoint
    background process is dead", the cause (``Protocol not known``) only in the daemon's
    output. The daemon registers the same class before it writes."""
    import fsspec
    from _dist_worker import FLAKY_PROTOCOL, FlakyLocalFileSystem

    fsspec.register_implementation(FLAKY_PROTOCOL, FlakyLocalFileSystem, clobber=True)
    state = {"w": torch.arange(8.0), "n": 3}
    with process_manager(f"{FLAKY_PROTOCOL}://{tmp_path / 'root'}") as mgr:
        assert mgr.save_async(1, state)
        mgr.join()
        assert save_process_of(mgr).pid is not None, "save_async did not use a daemon"
        assert mgr.all_steps() == [1]
        target = {"w": torch.zeros(8), "n": 0}
        mgr.restore(1, target)
    assert torch.equal(target["w"], state["w"]) and target["n"] == 3


ANSWERED_FAILURE_SCRIPT = r"""
import errno, os, socket, sys

import fsspec
import torch
import torch.distributed as dist
from _dist_worker import FlakyLocalFileSystem

from ckptmgr import CheckpointError, CheckpointManager


class DataWritesFail(FlakyLocalFileSystem):
    protocol = "ckptmgr-data-writes-fail"

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode and str(path).endswith(".metadata") and os.environ.get("FAIL_WRITES"):
            raise OSError(errno.EIO, "injected failure of a write in the daemon")
        return super()._open(path, mode, **kwargs)


def main():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    fsspec.register_implementation(DataWritesFail.protocol, DataWritesFail, clobber=True)
    os.environ["FAIL_WRITES"] = "1"  # the daemon, spawned at the first save, inherits it
    url = f"{DataWritesFail.protocol}://{sys.argv[1]}"
    state = {"w": torch.arange(8.0)}
    with CheckpointManager(url, 1, async_mode="process", chkpt_on_preemption=False) as mgr:
        mgr.save_async(1, state)
        try:
            mgr.join()
        except CheckpointError as error:
            print("error:", error)
        del os.environ["FAIL_WRITES"]  # the next daemon writes
        mgr.save_async(2, state)
        mgr.join()
        print("steps:", mgr.all_steps())
    dist.destroy_process_group()
    print("ok")


if __name__ == "__main__":
    main()
"""


def test_a_write_failing_in_the_daemon_is_not_taken_for_its_death_when_distributed(
    tmp_path: Path,
) -> None:
    """Under torch.distributed (here one gloo rank), a save that failed in the daemon with an
    ``OSError`` (writing ``.metadata``), answered by the daemon, was taken for a broken pipe: the
    training process waited up to 5 s for the live daemon to exit, then reported "the
    checkpoint daemon process died during the save". The save now fails with the daemon's
    error, and the next save (with a new daemon: the ranks replace theirs together) commits."""
    from conftest import REPO, run_bounded

    script = tmp_path / "answered_failure.py"
    script.write_text(ANSWERED_FAILURE_SCRIPT)
    path = os.pathsep.join([str(REPO), str(REPO / "tests")])
    command = [sys.executable, "-X", "faulthandler", str(script), str(tmp_path / "root")]
    result = run_bounded(command, timeout=120, env={**os.environ, "PYTHONPATH": path})
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "ok" in result.stdout, output
    error = next(line for line in result.stdout.splitlines() if line.startswith("error:"))
    assert "injected failure of a write in the daemon" in error, output
    assert "died" not in error, output
    assert "steps: [2]" in result.stdout, output


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_forked_child_of_a_process_mode_parent_saves_with_its_own_daemon(tmp_path: Path) -> None:
    """A child made by os.fork inherited multiprocessing's resource sharer from a parent that
    had sent staged tensors to its daemon: the child's own daemon then asked the parent's
    listener for the child's file descriptors, and every save of the child failed."""
    from conftest import in_forked_child

    state = {"w": torch.arange(8.0), **{f"s/{i}": torch.full((4,), float(i)) for i in range(40)}}
    with CheckpointManager(
        tmp_path / "parent", 1, chkpt_on_preemption=False, async_mode="process"
    ) as parent:
        assert parent.save_async(1, state)
        parent.join()

        def save_in_child() -> bytes:
            with CheckpointManager(
                tmp_path / "child", 1, chkpt_on_preemption=False, async_mode="process"
            ) as child:
                for step in (1, 2):
                    state["w"].add_(1)
                    child.save_async(step, state)
                    child.join()
                restored = {key: torch.zeros_like(value) for key, value in state.items()}
                child.restore(2, restored)
                exact = all(torch.equal(restored[key], state[key]) for key in state)
                return b"saved, bit-exact" if exact else b"saved, but differs"

        assert in_forked_child(save_in_child, timeout_s=180.0) == b"saved, bit-exact"
        assert parent.save_async(2, state)
        parent.join()
        assert parent.all_steps() == [1, 2]
