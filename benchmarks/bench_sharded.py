"""Saves and restores of a state of many small DTensors on a real gloo job: ckptmgr against DCP.

Usage: ``python benchmarks/bench_sharded.py [--tensors 5000] [--nproc 2] [--rounds 5]``

A sharded model (FSDP2 makes every parameter and optimizer moment a DTensor) holds a DTensor
per parameter and moment, so DCP's per-item work (planning, its metadata, the exchange of
plans) grows with their count, on every rank. Each rank builds ``--tensors`` DTensors of 256
float32 items sharded ``Shard(0)`` over a 1-d mesh of all ranks, then times, in one run and
interleaved in ``--rounds`` rounds after a first one (reported apart):

* ``dcp.save`` into a new directory, and ckptmgr ``save`` (sync: its write, on the writer
  thread, is what a background save costs the training process's other threads);
* ckptmgr ``save_async`` in thread mode and in process mode (``async_mode="process"``): the
  time it blocks the caller, against a floor of ``torch._foreach_copy_`` of every local shard
  into buffers allocated before (the copy staging cannot avoid), and the time to ``join()``;
* ``dcp.load`` and ckptmgr ``restore``, in place, each read checked bit for bit afterwards.

Rank 0 prints the median seconds of each and the ratios of ckptmgr to DCP and to the floor.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _timed(action: Callable[[], object]) -> float:
    dist.barrier()
    started = time.perf_counter()
    action()
    dist.barrier()
    return time.perf_counter() - started


def _worker(rank: int, world_size: int, port: int, tensors: int, rounds: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=300)
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptmgr import CheckpointManager

    mesh = init_device_mesh("cpu", (world_size,))
    generator = torch.Generator().manual_seed(0)
    state = {
        f"model.layers.{i // 9}.p{i % 9}": distribute_tensor(
            torch.randn(256, generator=generator), mesh, [Shard(0)]
        )
        for i in range(tensors)
    }
    targets = {key: distribute_tensor(torch.zeros(256), mesh, [Shard(0)]) for key in state}
    manager = CheckpointManager(f"{root}/ckptmgr", 1, max_to_keep=2, chkpt_on_preemption=False)
    async_managers = {
        mode: CheckpointManager(
            f"{root}/ckptmgr-{mode}",
            1,
            max_to_keep=2,
            chkpt_on_preemption=False,
            async_mode=mode,
        )
        for mode in ("thread", "process")
    }
    local_shards = [value.to_local() for value in state.values()]
    floor_buffers = [torch.empty_like(shard) for shard in local_shards]
    times: dict[str, list[float]] = {
        "dcp.save": [],
        "ckptmgr save": [],
        "floor: foreach_copy of the local shards": [],
        "ckptmgr save_async blocking (thread)": [],
        "ckptmgr save_async to join (thread)": [],
        "ckptmgr save_async blocking (process)": [],
        "ckptmgr save_async to join (process)": [],
        "dcp.load": [],
        "ckptmgr restore": [],
    }

    def save_async(mode: str, step: int) -> None:
        async_manager = async_managers[mode]
        dist.barrier()
        started = time.perf_counter()
        if not async_manager.save_async(step, state):
            raise AssertionError(f"save_async in {mode} mode took no checkpoint")
        times[f"ckptmgr save_async blocking ({mode})"].append(time.perf_counter() - started)
        async_manager.join()
        dist.barrier()
        times[f"ckptmgr save_async to join ({mode})"].append(time.perf_counter() - started)

    def check() -> None:
        for key, value in state.items():
            if not torch.equal(targets[key].to_local(), value.to_local()):
                raise AssertionError(f"{key} restored wrong")
            targets[key].to_local().zero_()

    for step in range(rounds + 1):
        dcp_dir = f"{root}/dcp-{step}"
        times["dcp.save"].append(_timed(partial(dcp.save, state, checkpoint_id=dcp_dir)))
        times["ckptmgr save"].append(_timed(partial(manager.save, step, state)))
        times["floor: foreach_copy of the local shards"].append(
            _timed(partial(torch._foreach_copy_, floor_buffers, local_shards))
        )
        for mode in async_managers:
            save_async(mode, step)
        times["dcp.load"].append(_timed(partial(dcp.load, targets, checkpoint_id=dcp_dir)))
        check()
        times["ckptmgr restore"].append(_timed(partial(manager.restore, step, targets)))
        check()
    manager.close()
    for async_manager in async_managers.values():
        async_manager.close()
    if rank == 0:
        print(
            f"torch {torch.__version__}; {world_size} ranks (gloo, 127.0.0.1); {tensors} DTensors "
            f"of 256 float32 items, Shard(0); first round apart, medians of {rounds} more"
        )
        print("\n| operation | first s | median s |")
        print("|---|---|---|")
        medians = {}
        for name, values in times.items():
            medians[name] = statistics.median(values[1:])
            print(f"| {name} | {values[0]:.3f} | {medians[name]:.3f} |")
        floor = medians["floor: foreach_copy of the local shards"]
        print(
            f"\nckptmgr save / dcp.save: {medians['ckptmgr save'] / medians['dcp.save']:.2f}x; "
            f"ckptmgr restore / dcp.load: "
            f"{medians['ckptmgr restore'] / medians['dcp.load']:.2f}x"
        )
        for mode in async_managers:
            blocking = medians[f"ckptmgr save_async blocking ({mode})"]
            joined = medians[f"ckptmgr save_async to join ({mode})"]
            print(
                f"save_async ({mode} mode): blocking / floor {blocking / floor:.2f}x; "
                f"to join / dcp.save {joined / medians['dcp.save']:.2f}x"
            )
    dist.destroy_process_group()


def main() -> None:
    """Spawn the ranks of a local gloo job and run the rounds."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=5000)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        mp.spawn(
            _worker,
            args=(args.nproc, _free_port(), args.tensors, args.rounds, root),
            nprocs=args.nproc,
        )


if __name__ == "__main__":
    main()
