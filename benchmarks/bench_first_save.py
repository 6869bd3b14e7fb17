"""The first async save of a process: ckptmgr ``save_async`` against ``dcp.async_save``.

The first call of each pays for fresh host memory (page faults) on the training thread. In
``bench_save.py`` both first calls run in one process after other work, so the kernel's state
(page cache to reclaim) differs between them; here every first call runs in a fresh process, the
two kinds alternating, on the same state (``--size-mib`` MiB in ``--tensors`` float32 tensors).

Usage::

    python benchmarks/bench_first_save.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KINDS = ("dcp.async_save", "ckptmgr save_async")


def first_call(kind: str, size_mib: int, tensors: int) -> float:
    """Blocking seconds of the first ``kind`` call of this process."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ckptmgr import CheckpointManager

    numel = size_mib * 2**20 // 4 // tensors
    state = {f"t{i}": torch.randn(numel) for i in range(tensors)}
    with tempfile.TemporaryDirectory() as scratch:
        if kind == "dcp.async_save":
            started = time.perf_counter()
            future = dcp.async_save(state, checkpoint_id=Path(scratch) / "dcp")
            blocking = time.perf_counter() - started
            future.result()
        else:
            with CheckpointManager(scratch, 1, chkpt_on_preemption=False) as manager:
                started = time.perf_counter()
                manager.save_async(1, state)
                blocking = time.perf_counter() - started
                manager.join()
    return blocking


def main() -> None:
    """Alternate fresh processes of both kinds and print the medians and their ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(first_call(args.child, args.size_mib, args.tensors)))
        return
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for index in range(args.rounds):
        for kind in KINDS if index % 2 == 0 else KINDS[::-1]:
            command = [sys.executable, __file__, "--child", kind]
            command += ["--size-mib", str(args.size_mib), "--tensors", str(args.tensors)]
            output = subprocess.run(
                command, check=True, capture_output=True, text=True, timeout=600
            )
            times[kind].append(json.loads(output.stdout.strip().splitlines()[-1]))
            print(f"round {index} {kind}: first blocking {times[kind][-1]:.3f} s", flush=True)
    medians = {kind: statistics.median(values) for kind, values in times.items()}
    print("\n| first call in a fresh process | median blocking s | all |\n|---|---|---|")
    for kind, values in times.items():
        print(f"| {kind} | {medians[kind]:.3f} | {', '.join(f'{v:.3f}' for v in values)} |")
    ratio = medians["ckptmgr save_async"] / medians["dcp.async_save"]
    print(f"\nsave_async first / dcp.async_save first: {ratio:.2f}x")


if __name__ == "__main__":
    main()
