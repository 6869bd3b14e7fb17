"""Saves in a row, each made before the previous one is written: the time per save.

A job that saves more often than a save takes to write (or that keeps ``max_pending_async=2``
so that a slow write does not block the next save) makes each ``save_async`` while the last
one is still writing. With two staging slots the saves take turns between them, each with its
own staged tensors. This measures, per save in a row of ``--saves``, the time the caller is
blocked (waiting for a free slot included) and the time per save from the first call to the
last commit, for ckptmgr in thread and process mode with one and two slots, against
``dcp.async_save`` made the same way (each call after waiting for the previous one's future,
DCP's own bound of one save in flight), in the same process and interleaved.

Usage::

    python benchmarks/bench_back_to_back.py --small 20000 --saves 10 --rounds 3

The state is ``--small`` tensors of 256 float32 (workload c of ``bench_save.py``) and, with
``--size-mib``, as many MiB more in ``--tensors`` tensors. Each round runs every method once,
in an order rotated from round to round; a warm-up round (each manager's first save, a daemon's
start, DCP's first plan) is not counted. Prints medians over the rounds.
"""

from __future__ import annotations

import argparse
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

_MODES = (("thread", 1), ("thread", 2), ("process", 1), ("process", 2))


def _state(small: int, size_mib: int, tensors: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    state = {
        f"optim/state/p{i // 2}/{'exp_avg' if i % 2 == 0 else 'exp_avg_sq'}": torch.rand(
            256, generator=generator
        )
        for i in range(small)
    }
    if size_mib:
        numel = size_mib * 2**20 // 4 // tensors
        for i in range(tensors):
            state[f"layer{i}.weight"] = torch.rand(numel, generator=generator)
    return state


def _mutate(state: dict[str, torch.Tensor]) -> None:
    """A training step's change: every tensor's values, in one op."""
    torch._foreach_add_(list(state.values()), 1.0)


def _row(saves: int, save: Callable[[int], None], finish: Callable[[], None], state: Any) -> dict:
    """Time ``saves`` calls of ``save`` in a row (the state changed before each) and ``finish``."""
    blocking: list[float] = []
    started = time.perf_counter()
    for index in range(saves):
        _mutate(state)
        called = time.perf_counter()
        save(index)
        blocking.append(time.perf_counter() - called)
    finish()
    return {
        "blocking": statistics.median(blocking),
        "per_save": (time.perf_counter() - started) / saves,
    }


class _Managers:
    """One manager per (async mode, slots), kept across rounds: its daemon and arenas live on."""

    def __init__(self, root: Path, state: dict[str, torch.Tensor]) -> None:
        self.state = state
        self.step = 0
        self.managers = {
            (mode, slots): CheckpointManager(
                root / f"{mode}-{slots}",
                1,
                max_to_keep=2,
                async_mode=mode,
                max_pending_async=slots,
                chkpt_on_preemption=False,
            )
            for mode, slots in _MODES
        }

    def row(self, mode: str, slots: int, saves: int) -> dict:
        manager = self.managers[(mode, slots)]

        def save(_: int) -> None:
            self.step += 1
            assert manager.save_async(self.step, self.state)

        return _row(saves, save, manager.join, self.state)

    def close(self) -> None:
        for manager in self.managers.values():
            manager.close()


def _dcp_row(root: Path, state: dict[str, torch.Tensor], saves: int) -> dict:
    """``dcp.async_save`` in a row, each call after the previous future's result; every
    checkpoint in its own directory (removed afterwards, as a manager's retention would)."""
    pending: list[Any] = []
    written: list[Path] = []

    def save(index: int) -> None:
        if pending:
            pending.pop().result()
        directory = root / f"dcp-{time.monotonic_ns()}-{index}"
        written.append(directory)
        pending.append(dcp.async_save(state, checkpoint_id=str(directory)))

    def finish() -> None:
        if pending:
            pending.pop().result()

    row = _row(saves, save, finish, state)
    for directory in written:
        shutil.rmtree(directory, ignore_errors=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=20_000, help="tensors of 1 KiB")
    parser.add_argument("--size-mib", type=int, default=0, help="MiB in large tensors as well")
    parser.add_argument("--tensors", type=int, default=16, help="large tensors of --size-mib")
    parser.add_argument("--saves", type=int, default=10, help="saves in a row, per method")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp directory)")
    args = parser.parse_args()

    state = _state(args.small, args.size_mib, args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    root = Path(tempfile.mkdtemp(dir=args.dir))
    managers = _Managers(root, state)
    methods: list[tuple[str, Callable[[int], dict]]] = [
        ("dcp.async_save", lambda saves: _dcp_row(root, state, saves))
    ]
    for mode, slots in _MODES:
        methods.append(
            (
                f"save_async {mode}, max_pending_async={slots}",
                lambda saves, mode=mode, slots=slots: managers.row(mode, slots, saves),
            )
        )
    results: dict[str, list[dict]] = {name: [] for name, _ in methods}
    try:
        for _, method in methods:  # warm-up: first saves, daemons, first plans
            method(2)
        for round_ in range(args.rounds):
            shift = round_ % len(methods)
            for name, method in methods[shift:] + methods[:shift]:
                results[name].append(method(args.saves))
    finally:
        managers.close()
        shutil.rmtree(root, ignore_errors=True)

    print(
        f"state: {len(state)} tensors, {nbytes / 2**20:.1f} MiB; {args.saves} saves in a row, "
        f"medians of {args.rounds} rounds"
    )
    baseline = statistics.median(r["per_save"] for r in results["dcp.async_save"])
    print("| method | blocking per call, s | time per save, s | per save / dcp.async_save |")
    print("|---|---|---|---|")
    for name, rows in results.items():
        blocking = statistics.median(r["blocking"] for r in rows)
        per_save = statistics.median(r["per_save"] for r in rows)
        print(f"| {name} | {blocking:.3f} | {per_save:.3f} | {per_save / baseline:.2f}x |")


if __name__ == "__main__":
    main()
