"""The restore of a fresh process, as a restarting job's: ckptmgr against a raw cold read.

A job that restarts restores in a fresh process, from files not in the page cache. In
``bench_save.py`` every restore runs in one long process, after other saves and reads; here each
call runs in a fresh process that builds the state's tensors (touched, as a model's parameters
are), drops the files from the page cache and times one of, alternating in shuffled order:

* ``raw read``: one ``readinto`` per tensor from a file of the same bytes (the floor);
* ``ckptmgr restore``: in place, with direct reads (the default);
* ``ckptmgr restore, page cache``: the same with ``CKPTMGR_DIRECT_READS=0``.

The files are written once, at the start: ``--workload a`` is ``--size-mib`` MiB in
``--tensors`` float32 tensors, ``--workload b`` the MLP + AdamW state of ``bench_save.py``.

Usage::

    python benchmarks/bench_first_restore.py --workload b --rounds 8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_save import drop_cache, workload_a, workload_b

from ckptmgr import CheckpointManager

KINDS = ("raw read", "ckptmgr restore", "ckptmgr restore, page cache")


def _workload(args: argparse.Namespace) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """(the state's tensors in file order, the state to save and restore)."""
    work = (
        workload_a(args.size_mib, args.tensors, "cpu")
        if args.workload == "a"
        else workload_b("cpu")
    )
    return work.tensors, work.state


def first_call(kind: str, args: argparse.Namespace) -> float:
    """Seconds of one ``kind`` call in this (fresh) process."""
    tensors, state = _workload(args)
    with torch.no_grad():
        for tensor in tensors.values():
            tensor.zero_()  # touched, and not the saved values
    if kind == "raw read":
        drop_cache(args.scratch / "raw.bin")
        started = time.perf_counter()
        with open(args.scratch / "raw.bin", "rb", buffering=0) as handle:
            for tensor in tensors.values():
                handle.readinto(memoryview(tensor.numpy()).cast("B"))
        return time.perf_counter() - started
    drop_cache(args.scratch / "ckptmgr")
    with CheckpointManager(args.scratch / "ckptmgr", 1, chkpt_on_preemption=False) as manager:
        step = manager.latest_step()
        assert step is not None
        started = time.perf_counter()
        manager.restore(step, state)
        took = time.perf_counter() - started
    expected, _ = _workload(args)  # (the same seed: the saved values)
    for key, tensor in tensors.items():
        if not torch.equal(tensor, expected[key]):
            raise AssertionError(f"{key} restored wrong")
    return took


def write_files(args: argparse.Namespace) -> None:
    """The step and the raw file every call reads."""
    tensors, state = _workload(args)
    with CheckpointManager(args.scratch / "ckptmgr", 1, chkpt_on_preemption=False) as manager:
        manager.save(1, state)
    with open(args.scratch / "raw.bin", "wb") as handle:
        for tensor in tensors.values():
            handle.write(memoryview(tensor.numpy()).cast("B"))
        handle.flush()
        os.fsync(handle.fileno())


def main() -> None:
    """Alternate fresh processes of every kind and print the medians and their ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("a", "b"), default="b")
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(first_call(args.child, args)))
        return
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    shuffler = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as scratch:
        args.scratch = Path(scratch)
        write_files(args)
        for index in range(args.rounds):
            for kind in shuffler.sample(KINDS, len(KINDS)):
                command = [sys.executable, __file__, "--child", kind, "--scratch", scratch]
                command += ["--workload", args.workload, "--size-mib", str(args.size_mib)]
                command += ["--tensors", str(args.tensors)]
                env = dict(os.environ, CKPTMGR_DIRECT_READS="0" if "page cache" in kind else "1")
                output = subprocess.run(
                    command, check=True, capture_output=True, text=True, timeout=600, env=env
                )
                times[kind].append(json.loads(output.stdout.strip().splitlines()[-1]))
                print(f"round {index} {kind}: {times[kind][-1]:.3f} s", flush=True)
    medians = {kind: statistics.median(values) for kind, values in times.items()}
    print(f"\ntorch {torch.__version__}; workload {args.workload}; {args.rounds} rounds")
    print("\n| call in a fresh process | median s | / raw read | all |\n|---|---|---|---|")
    for kind, values in times.items():
        ratio = medians[kind] / medians["raw read"]
        listed = ", ".join(f"{v:.3f}" for v in values)
        print(f"| {kind} | {medians[kind]:.3f} | {ratio:.2f}x | {listed} |")


if __name__ == "__main__":
    main()
