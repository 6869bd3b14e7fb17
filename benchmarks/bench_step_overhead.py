"""Per-step cost of the manager's decision (``should_save``) on a real 2-rank gloo job.

Usage: ``python benchmarks/bench_step_overhead.py [--steps 5000] [--nproc 2]``

Each rank times, in one run and interleaved in rounds:

* ``baseline``: a bare 1-element ``all_reduce`` on a fresh gloo group (what any cross-rank
  agreement costs at least);
* ``preemption on``: ``should_save(step)`` with ``chkpt_on_preemption=True`` (the default):
  one 2-element all_reduce that agrees on the preemption flag and rank 0's save decision;
* ``agree every 10``: the same with ``PreemptionConfig(agree_every_n_steps=10)`` (amortised);
* ``preemption off``: ``should_save(step)`` with only ``save_interval``: no collective at all.

Rank 0 prints the median microseconds per call and the ratio to the baseline.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROUNDS = 5


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _per_call_us(action: object, steps: int) -> float:
    started = time.perf_counter()
    for step in range(1, steps + 1):
        action(step)  # type: ignore[operator]
    return (time.perf_counter() - started) / steps * 1e6


def _worker(rank: int, world_size: int, port: int, steps: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from ckptmgr import CheckpointManager

    group = dist.new_group(backend="gloo")
    flag = torch.zeros(1, dtype=torch.int32)
    on = CheckpointManager(f"{root}/on", save_interval=10**9, chkpt_on_preemption=True)
    from ckptmgr import PreemptionConfig

    amortised = CheckpointManager(
        f"{root}/every10",
        save_interval=10**9,
        preemption=PreemptionConfig(agree_every_n_steps=10),
    )
    off = CheckpointManager(f"{root}/off", save_interval=10**9, chkpt_on_preemption=False)
    results: dict[str, list[float]] = {
        "baseline": [],
        "preemption on": [],
        "agree every 10": [],
        "preemption off": [],
    }
    for _ in range(ROUNDS):
        results["baseline"].append(
            _per_call_us(lambda _s: dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group), steps)
        )
        results["preemption on"].append(_per_call_us(on.should_save, steps))
        results["agree every 10"].append(_per_call_us(amortised.should_save, steps))
        results["preemption off"].append(_per_call_us(off.should_save, steps))
    on.close()
    amortised.close()
    off.close()
    if rank == 0:
        baseline = statistics.median(results["baseline"])
        print(f"{world_size} ranks, gloo on 127.0.0.1, {steps} calls x {ROUNDS} rounds")
        print(f"{'operation':<18} {'median us/call':>15} {'x baseline':>11}")
        for name, values in results.items():
            median = statistics.median(values)
            print(f"{name:<18} {median:>15.1f} {median / baseline:>11.2f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        mp.spawn(_worker, args=(args.nproc, _free_port(), args.steps, root), nprocs=args.nproc)


if __name__ == "__main__":
    main()
