"""Worker of tests/test_process_mode.py: one rank of a ``torchrun`` job (gloo, CPU) whose manager
runs with ``async_mode="process"``.

Run as ``torchrun --nproc-per-node 2 tests/_process_mode_worker.py <name> <out_dir> <ckpt_dir>``
with the repository root on ``PYTHONPATH``. With ``<name>`` ``process``, each rank saves
:data:`STEPS` with ``save_async`` (a replicated ``nn.Linear``, :class:`~ckptmgr.PerRank`
tensors and DTensors sharded over the ranks), mutating the state and running a training
all_reduce while each write is in flight, joins, and restores every step into fresh objects.
With ``kill``, rank 1's daemon is killed between two saves (see :func:`run_kill`). Each rank
writes what it observed to ``<out_dir>/<name>-rank<R>.json``; the test makes every assertion.

The daemon is started with ``spawn``, which imports this file again in the daemon: everything
that runs is under the ``if __name__ == "__main__":`` guard. Every wait is bounded: the process
group and the manager use short collective timeouts, and ``faulthandler`` ends (and dumps the
stacks of) a rank still running after ``WATCHDOG_S`` seconds.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ckptmgr import PerRank

COLLECTIVE_TIMEOUT_S = 30.0
WATCHDOG_S = 100.0
DAEMON_EXIT_TIMEOUT_S = 30.0
STEPS: list[int] = [1, 2, 3]
KILL_STEPS: list[int] = [2, 3]
KILL_COLLECTIVE_TIMEOUT_S = 15.0


def make_linear(step: int) -> nn.Linear:
    """The replicated layer at ``step``: the same on every rank."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 32)
    with torch.no_grad():
        layer.weight.add_(step * 0.25)
        layer.bias.sub_(step)
    return layer


SHARDED_COUNT = 6
"""DTensors in the saved state: each sharded ``Shard(0)`` over all ranks. Staged in process
mode, every local shard but the first lies past the start of the one shared arena (a DTensor
torch pickles wrongly: see ckptmgr.save_process._SentDTensor)."""


def make_sharded(step: int) -> dict[str, Any]:
    """The DTensors of ``step``: the same global values on every rank, each rank its shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    gen = torch.Generator().manual_seed(7 * step)
    return {
        f"w{i}": distribute_tensor(torch.randn(16 * (i + 1), 3, generator=gen), mesh, [Shard(0)])
        for i in range(SHARDED_COUNT)
    }


def make_state(step: int, rank: int) -> dict[str, Any]:
    """What rank ``rank`` saves at ``step``."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return {
        "model": make_linear(step),
        # Same keys on every rank, values that depend on the rank: marked PerRank.
        "local": PerRank(torch.arange(96, dtype=torch.float64).reshape(8, 12) * (rank + 1) + step),
        "local_big": PerRank(torch.randn(512, 640, generator=gen)),  # 1.25 MiB
        "sharded": make_sharded(step),
        "step": step,
    }


def blank_state() -> dict[str, Any]:
    """Fresh objects with the structure of :func:`make_state` and values no step has."""
    layer = nn.Linear(64, 32)
    with torch.no_grad():
        layer.weight.fill_(-7)
        layer.bias.fill_(-7)
    sharded = make_sharded(0)
    for value in sharded.values():
        value.to_local().fill_(-7)
    return {
        "model": layer,
        "local": PerRank(torch.full((8, 12), -1.0, dtype=torch.float64)),
        "local_big": PerRank(torch.zeros(512, 640)),
        "sharded": sharded,
        "step": -1,
    }


def first_difference(actual: Any, expected: Any, where: str) -> str | None:
    """None if ``actual`` equals ``expected`` bit for bit (dtype and shape too), else where not."""
    if isinstance(expected, PerRank):
        return first_difference(actual.value, expected.value, where)
    if isinstance(expected, nn.Module):
        return first_difference(actual.state_dict(), expected.state_dict(), where)
    if isinstance(expected, dict):
        if list(actual) != list(expected):
            return f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            found = first_difference(actual[key], expected[key], f"{where}/{key}")
            if found is not None:
                return found
        return None
    if isinstance(expected, DTensor):
        if not isinstance(actual, DTensor) or actual.placements != expected.placements:
            return f"{where}: {actual!r} is not laid out as {expected.placements}"
        return first_difference(actual.to_local(), expected.to_local(), f"{where} (local)")
    if isinstance(expected, torch.Tensor):
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            got = f"{actual.dtype}{list(actual.shape)}"
            return f"{where}: {got} != {expected.dtype}{list(expected.shape)}"
        got_bits = actual.detach().reshape(-1).contiguous().view(torch.uint8)
        want_bits = expected.detach().reshape(-1).contiguous().view(torch.uint8)
        return None if torch.equal(got_bits, want_bits) else f"{where}: tensor bytes differ"
    return None if actual == expected else f"{where}: {actual!r} != {expected!r}"


def _error(action: Callable[[], Any]) -> tuple[Any, str | None]:
    """(result, None), or (None, a description of the exception ``action`` raised)."""
    try:
        return action(), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc} (cause: {exc.__cause__!r})"[:3000]


def open_process_manager(ckpt_dir: str, timeout_s: float) -> tuple[Any, Any]:
    """A process-mode manager saving every step, and its SaveProcess."""
    from ckptmgr import CheckpointManager

    manager = CheckpointManager(
        ckpt_dir,
        save_interval=1,
        chkpt_on_preemption=False,
        collective_timeout_s=timeout_s,
        async_mode="process",
    )
    save_process = manager._save_process
    assert save_process is not None, "the manager is not in process mode"
    return manager, save_process


def run(rank: int, ckpt_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    manager, save_process = open_process_manager(ckpt_dir, COLLECTIVE_TIMEOUT_S)
    record: dict[str, Any] = {"pid": os.getpid(), "saves": [], "join_errors": [], "daemon_pids": []}
    state = make_state(STEPS[0], rank)
    for step in STEPS:
        fresh = make_state(step, rank)
        state["model"].load_state_dict(fresh["model"].state_dict())
        state["local"].value.copy_(fresh["local"].value)
        state["local_big"].value.copy_(fresh["local_big"].value)
        for key, value in fresh["sharded"].items():
            state["sharded"][key].to_local().copy_(value.to_local())
        state["step"] = step
        entry: dict[str, Any] = {"step": step}
        entry["returned"], entry["error"] = _error(
            lambda step=step: manager.save_async(step, state)
        )
        # Training goes on while the daemon writes: mutate the state, use the training group.
        with torch.no_grad():
            state["model"].weight.add_(100.0)
        state["local"].value.add_(0.5)
        state["local_big"].value.mul_(-2.0)
        for value in state["sharded"].values():
            value.to_local().add_(3.0)
        grad = torch.full((4,), float(rank + 1))
        dist.all_reduce(grad)
        entry["training_all_reduce"] = grad.tolist()
        record["saves"].append(entry)
        if step == STEPS[0]:  # the first save alone, then the others back to back
            record["join_errors"].append(_error(manager.join)[1])
            record["daemon_pids"].append(save_process.pid)
    record["join_errors"].append(_error(manager.join)[1])
    record["daemon_pids"].append(save_process.pid)
    record["all_steps"] = manager.all_steps()
    daemon = save_process._daemon
    record["daemon_alive_before_close"] = daemon is not None and daemon._save_process.is_alive()

    record["restores"] = []
    for step in STEPS:
        fresh = blank_state()
        _, error = _error(lambda fresh=fresh, step=step: manager.restore(step, fresh))
        expected = make_state(step, rank)
        record["restores"].append(
            {
                "step": step,
                "error": error,
                "differences": {
                    key: first_difference(fresh[key], value, key) for key, value in expected.items()
                },
            }
        )
    record["close_error"] = _error(manager.close)[1]
    record["daemon_alive_after_close"] = None
    if daemon is not None:
        daemon._save_process.join(timeout=DAEMON_EXIT_TIMEOUT_S)
        record["daemon_alive_after_close"] = daemon._save_process.is_alive()
    return record


def run_kill(rank: int, ckpt_dir: str) -> dict[str, Any]:
    """Rank 1's daemon is SIGKILLed between two saves; then :data:`KILL_STEPS` are saved on
    both ranks. The manager must recover: at the latest the save after the first one that
    failed commits (both ranks then need daemons that form a group again)."""
    import signal

    import torch.distributed as dist

    from ckptmgr import CheckpointError

    manager, save_process = open_process_manager(ckpt_dir, KILL_COLLECTIVE_TIMEOUT_S)
    record: dict[str, Any] = {"saves": []}
    manager.save_async(1, make_state(1, rank))
    manager.join()
    record["first_pid"] = save_process.pid
    dist.barrier()
    if rank == 1:
        daemon = save_process._daemon
        assert daemon is not None
        os.kill(daemon._save_process.pid, signal.SIGKILL)
        daemon._save_process.join(timeout=DAEMON_EXIT_TIMEOUT_S)
        record["killed"] = not daemon._save_process.is_alive()
    dist.barrier()
    for step in KILL_STEPS:
        entry: dict[str, Any] = {"step": step}
        try:
            manager.save_async(step, make_state(step, rank))
            manager.join()
            entry["error"] = None
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            entry["is_checkpoint_error"] = isinstance(exc, CheckpointError)
        entry["pid"] = save_process.pid
        record["saves"].append(entry)
    record["all_steps"] = manager.all_steps()
    last = KILL_STEPS[-1]
    if last in record["all_steps"]:
        fresh = blank_state()
        _, record["restore_error"] = _error(lambda: manager.restore(last, fresh))
        expected = make_state(last, rank)
        record["restore_differences"] = {
            key: first_difference(fresh[key], value, key) for key, value in expected.items()
        }
    record["close_error"] = _error(manager.close)[1]
    return record


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    name, out_dir, ckpt_dir = argv
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    rank = dist.get_rank()
    record: dict[str, Any] = {"rank": rank, "world_size": dist.get_world_size()}
    try:
        record.update(run(rank, ckpt_dir) if name == "process" else run_kill(rank, ckpt_dir))
    except Exception:
        record["crash"] = traceback.format_exc()
    target = Path(out_dir) / f"{name}-rank{rank}.json"
    temporary = target.with_suffix(".tmp")
    temporary.write_text(json.dumps(record, indent=1, default=repr))
    temporary.rename(target)
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    finally:
        gc.freeze()  # (the interpreter's last collection skipped: about 0.7 s with torch loaded)
