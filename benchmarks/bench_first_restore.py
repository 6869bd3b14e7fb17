"""The restore of a fresh process, as a restarting job's: ckptmgr against a raw cold read.

A job that restarts restores in a fresh process, from files not in the page cache. In
``bench_save.py`` every restore runs in one long process, after other saves and reads; here each
call runs in a fresh process that builds the state's tensors (touched, as a model's parameters
are), drops the files from the page cache and times one of, alternating in shuffled order:

* ``raw read``: one ``readinto`` per tensor from a file of the same bytes (the floor);
* ``ckptmgr restore``: in place, with direct reads (the default);
* ``ckptmgr restore, page cache``: the same with ``CKPTMGR_DIRECT_READS=0``.

The files are written once, at the start: ``--workload a`` is ``--size-mib`` MiB in
``--tensors`` float32 tensors, ``--workload b`` the MLP + AdamW state of ``bench_save.py``,
``--workload d`` its 1,000 layers of 64x64 + AdamW (``--layers``). With ``--fresh-optimizer``
the restore goes into a new AdamW without per-parameter state, as a restarted job's is (the
restore creates the state first); the floor reads the same bytes.

Usage::

    python benchmarks/bench_first_restore.py --workload b --rounds 8
    python benchmarks/bench_first_restore.py --workload b --rounds 4 --fresh-optimizer
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
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_save import drop_cache, workload_a, workload_b, workload_d

from ckptmgr import CheckpointManager

KINDS = ("raw read", "ckptmgr restore", "ckptmgr restore, page cache")


def _workload(args: argparse.Namespace) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """(the state's tensors in file order, the state to save and restore)."""
    if args.workload == "a":
        work = workload_a(args.size_mib, args.tensors, "cpu")
    elif args.workload == "b":
        work = workload_b("cpu")
    else:
        work = workload_d(args.layers, "cpu")
    return work.tensors, work.state


def _with_a_fresh_optimizer(
    tensors: dict[str, torch.Tensor], state: dict[str, object]
) -> Callable[[], dict[str, torch.Tensor]]:
    """Put a new AdamW (no per-parameter state yet) in place of the state's optimizer; returns
    what gives the tensors to check after the restore: the module's, and the new optimizer's
    under the names of ``tensors`` (``restore`` creates them)."""
    model = state["model"]
    assert isinstance(model, torch.nn.Module)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state["optim"] = optimizer
    names = {id(param): name for name, param in model.named_parameters()}

    def restored() -> dict[str, torch.Tensor]:
        found = {key: value for key, value in tensors.items() if key.startswith("model/")}
        for param, values in optimizer.state.items():
            for key, value in values.items():
                found[f"optim/{names[id(param)]}/{key}"] = value
        return found

    return restored


def first_call(kind: str, args: argparse.Namespace) -> float:
    """Seconds of one ``kind`` call in this (fresh) process."""
    tensors, state = _workload(args)
    with torch.no_grad():
        for tensor in tensors.values():
            tensor.zero_()  # touched, and not the saved values
    restored: Callable[[], dict[str, torch.Tensor]] = lambda: tensors  # noqa: E731
    if kind != "raw read" and args.fresh_optimizer:
        restored = _with_a_fresh_optimizer(tensors, state)
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
    found = restored()
    if set(found) != set(expected):
        raise AssertionError(f"restored {len(found)} tensors, saved {len(expected)}")
    for key, tensor in found.items():
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
    parser.add_argument("--workload", choices=("a", "b", "d"), default="b")
    parser.add_argument("--layers", type=int, default=1000, help="layers of workload d")
    parser.add_argument(
        "--fresh-optimizer",
        action="store_true",
        help="restore (b) or (d) into a new optimizer without state, as a restarted job does",
    )
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fresh_optimizer and args.workload == "a":
        parser.error("--fresh-optimizer needs a workload with an optimizer: b or d")
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
                command += ["--tensors", str(args.tensors), "--layers", str(args.layers)]
                command += ["--fresh-optimizer"] if args.fresh_optimizer else []
                env = dict(os.environ, CKPTMGR_DIRECT_READS="0" if "page cache" in kind else "1")
                output = subprocess.run(
                    command, check=True, capture_output=True, text=True, timeout=600, env=env
                )
                times[kind].append(json.loads(output.stdout.strip().splitlines()[-1]))
                print(f"round {index} {kind}: {times[kind][-1]:.3f} s", flush=True)
    medians = {kind: statistics.median(values) for kind, values in times.items()}
    fresh = ", a fresh optimizer" if args.fresh_optimizer else ""
    print(f"\ntorch {torch.__version__}; workload {args.workload}{fresh}; {args.rounds} rounds")
    print("\n| call in a fresh process | median s | / raw read | all |\n|---|---|---|---|")
    for kind, values in times.items():
        ratio = medians[kind] / medians["raw read"]
        listed = ", ".join(f"{v:.3f}" for v in values)
        print(f"| {kind} | {medians[kind]:.3f} | {ratio:.2f}x | {listed} |")


if __name__ == "__main__":
    main()
