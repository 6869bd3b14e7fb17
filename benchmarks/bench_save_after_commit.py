"""Blocking of a ``save_async`` made as soon as the previous save has committed.

After its commit a background save goes on: retention deletes the steps it no longer keeps
(with ``max_to_keep=1``, the previous step). This measures what the next ``save_async`` costs the
training thread at that moment, against the memcpy floor (a copy of the state into preallocated,
touched buffers) measured in the same process, interleaved. A ``save_async`` that had to wait
for the deletion would show it here.

Usage::

    python benchmarks/bench_save_after_commit.py --size-mib 1024 --tensors 64 --saves 8

Each round: with nothing running, the memcpy floor; a ``save_async``; as soon as it has
committed, a second ``save_async``, whose blocking time is reported.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch
from bench_save import CommitClock  # this script's folder is on sys.path

from ckptmgr import CheckpointManager

_WAIT_S = 600.0  # bound on waiting for one commit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--saves", type=int, default=8, help="rounds (two saves each)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp directory)")
    args = parser.parse_args()

    numel = args.size_mib * 2**20 // 4 // args.tensors
    state = {f"t{i}": torch.rand(numel) for i in range(args.tensors)}
    targets = [torch.zeros(numel) for _ in range(args.tensors)]  # touched
    commits = CommitClock()
    root = tempfile.mkdtemp(dir=args.dir)
    manager = CheckpointManager(root, 1, max_to_keep=1, chkpt_on_preemption=False)
    memcpy: list[float] = []
    blocking: list[float] = []
    try:
        manager.save_async(0, state)  # allocates the arena
        for round_ in range(1, args.saves + 1):
            manager.join()  # nothing running: the floor, then a save after an idle spell
            started = time.perf_counter()
            torch._foreach_copy_(targets, list(state.values()))
            memcpy.append(time.perf_counter() - started)
            first, second = 2 * round_ - 1, 2 * round_
            manager.save_async(first, state)
            commits.wait(first, _WAIT_S)
            started = time.perf_counter()
            manager.save_async(second, state)  # the step before `first` is being deleted now
            blocking.append(time.perf_counter() - started)
        manager.join()
    finally:
        manager.close()
        shutil.rmtree(root, ignore_errors=True)
    floor, block = statistics.median(memcpy), statistics.median(blocking)
    print(f"state: {args.size_mib} MiB in {args.tensors} tensors, {args.saves} rounds")
    print(f"memcpy floor, median s:                          {floor:.3f}")
    print(f"save_async right after the previous commit, median s: {block:.3f}")
    print(f"all: {[round(b, 3) for b in blocking]}")
    print(f"ratio to the memcpy floor: {block / floor:.2f}x")


if __name__ == "__main__":
    main()
