"""Plain values in a state (dicts, lists, numbers, strings): the training thread's share.

A state may hold more than tensors: a data loader's position, metric histories, a sample order.
ckptmgr stores them as JSON (restoring runs no code from a checkpoint), encoded on the training
thread at ``save_async``, since the values may change as soon as it returns. This measures, in
one process and interleaved, ``save_async``'s blocking time for a state of one small tensor and
the plain values against ``pickle.dumps`` of the values (a copy made in C: the floor) and
``copy.deepcopy``, ``dcp.async_save``'s blocking time (which pickles them), and ``restore``
against ``pickle.loads``.

Usage::

    python benchmarks/bench_plain_values.py --entries 50000 --indices 1000000 --rounds 7

Values: ``--entries`` small dicts (``{"step": i, "name": "n<i>", "vals": [i, i + 1.5]}``) keyed
by string, and a list of ``--indices`` ints.
"""

from __future__ import annotations

import argparse
import copy
import pickle
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ckptmgr import CheckpointManager


def _timed(call: Callable[[], Any]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=50_000, help="small dicts")
    parser.add_argument("--indices", type=int, default=1_000_000, help="ints in one list")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp directory)")
    args = parser.parse_args()

    values = {
        "entries": {
            f"k{i}": {"step": i, "name": f"n{i}", "vals": [i, i + 1.5]} for i in range(args.entries)
        },
        "indices": list(range(args.indices)),
    }
    state = {"weight": torch.zeros(16), "plain": values}
    root = Path(tempfile.mkdtemp(dir=args.dir))
    manager = CheckpointManager(root / "ckptmgr", 1, max_to_keep=1, chkpt_on_preemption=False)
    step = 0
    pickled = pickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL)

    def save_async() -> float:
        nonlocal step
        step += 1
        took = _timed(lambda: manager.save_async(step, state))
        manager.join()
        return took

    def dcp_async_save() -> float:
        future: Any = None

        def call() -> None:
            nonlocal future
            future = dcp.async_save(state, checkpoint_id=str(root / f"dcp-{step}"))

        took = _timed(call)
        future.result()
        shutil.rmtree(root / f"dcp-{step}", ignore_errors=True)
        return took

    def restore() -> float:
        target = {"weight": torch.empty(16), "plain": None}
        took = _timed(lambda: manager.restore(step, target))
        assert target["plain"] == values
        return took

    methods: list[tuple[str, Callable[[], float]]] = [
        ("floor: pickle.dumps", lambda: _timed(lambda: pickle.dumps(values, protocol=5))),
        ("copy.deepcopy", lambda: _timed(lambda: copy.deepcopy(values))),
        ("dcp.async_save blocking", dcp_async_save),
        ("ckptmgr save_async blocking", save_async),
        ("pickle.loads", lambda: _timed(lambda: pickle.loads(pickled))),
        ("ckptmgr restore", restore),
    ]
    results: dict[str, list[float]] = {name: [] for name, _ in methods}
    try:
        save_async()  # the first save of the process, and a step for restore()
        for round_ in range(args.rounds):
            shift = round_ % len(methods)
            for name, method in methods[shift:] + methods[:shift]:
                results[name].append(method())
    finally:
        manager.close()
        shutil.rmtree(root, ignore_errors=True)

    median = {name: statistics.median(times) for name, times in results.items()}
    print(
        f"{args.entries} small dicts and a list of {args.indices} ints "
        f"({len(pickled) / 2**20:.1f} MiB pickled); medians of {args.rounds} rounds"
    )
    print("| method | s | / pickle.dumps |")
    print("|---|---|---|")
    for name, took in median.items():
        print(f"| {name} | {took:.3f} | {took / median['floor: pickle.dumps']:.2f}x |")
    print(f"restore / pickle.loads: {median['ckptmgr restore'] / median['pickle.loads']:.2f}x")


if __name__ == "__main__":
    main()
