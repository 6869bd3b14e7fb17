"""Saves and restores of a state of many small DTensors on a real gloo job: ckptmgr against DCP.

Usage: ``python benchmarks/bench_sharded.py [--tensors 5000] [--nproc 2] [--rounds 5]``

A sharded model (FSDP2 makes every parameter and optimizer moment a DTensor) holds a DTensor
per parameter and moment, so DCP's per-item work (planning, its metadata, the exchange of
plans) grows with their count, on every rank. Each rank builds ``--tensors`` DTensors of 256
float32 items sharded ``Shard(0)`` over a 1-d mesh of all ranks, then times, in one run and
interleaved in ``--rounds`` rounds after a first one (reported apart):

* ``dcp.save`` into a new directory, and ckptmgr ``save`` (sync: its write, on the writer
  thread, is what a background save costs the training process's other threads);
* ``dcp.load`` and ckptmgr ``restore``, in place, each read checked bit for bit afterwards.

Rank 0 prints the median seconds of each and the ratios of ckptmgr to DCP.
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
    times: dict[str, list[float]] = {
        "dcp.save": [],
        "ckptmgr save": [],
        "dcp.load": [],
        "ckptmgr restore": [],
    }

    def check() -> None:
        for key, value in state.items():
            if not torch.equal(targets[key].to_local(), value.to_local()):
                raise AssertionError(f"{key} restored wrong")
            targets[key].to_local().zero_()

    for step in range(rounds + 1):
        dcp_dir = f"{root}/dcp-{step}"
        times["dcp.save"].append(_timed(partial(dcp.save, state, checkpoint_id=dcp_dir)))
        times["ckptmgr save"].append(_timed(partial(manager.save, step, state)))
        times["dcp.load"].append(_timed(partial(dcp.load, targets, checkpoint_id=dcp_dir)))
        check()
        times["ckptmgr restore"].append(_timed(partial(manager.restore, step, targets)))
        check()
    manager.close()
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
        print(
            f"\nckptmgr save / dcp.save: {medians['ckptmgr save'] / medians['dcp.save']:.2f}x; "
            f"ckptmgr restore / dcp.load: "
            f"{medians['ckptmgr restore'] / medians['dcp.load']:.2f}x"
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
