"""Save-path benchmark: ckptmgr against its baselines, measured in one process run.

Reports the median of ``--repeats`` runs (after one warm-up) for each operation and the ratios
that matter, each against a baseline measured in the same run:

* blocking time of ``save_async`` / a memcpy of the state into already-touched buffers (floor);
* ``save_async`` blocking time / ``dcp.async_save`` blocking time;
* end-to-end ``save`` / ``dcp.save`` and / a raw write+fsync of the same bytes.

Usage::

    python benchmarks/bench_save.py --size-mib 1024 --tensors 64 --repeats 3

Disk speed varies between runs on shared machines: compare ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from ckptmgr import CheckpointManager


def make_state(size_mib: int, tensors: int) -> dict[str, torch.Tensor]:
    """``tensors`` float32 tensors that add up to ``size_mib`` MiB, filled (pages touched)."""
    numel = size_mib * 2**20 // 4 // tensors
    generator = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.rand(numel, generator=generator) for i in range(tensors)}


def timed(operation: Callable[[], object]) -> float:
    """Seconds one call of ``operation`` takes."""
    started = time.perf_counter()
    operation()
    return time.perf_counter() - started


def median_of(operation: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(first call, median of ``repeats`` later calls) in seconds."""
    first = timed(operation)
    return first, statistics.median(timed(operation) for _ in range(repeats))


def raw_write(state: dict[str, torch.Tensor], directory: Path) -> None:
    """Write every tensor's bytes to one file and fsync it: the disk's floor."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "raw.bin", "wb") as handle:
        for tensor in state.values():
            handle.write(memoryview(tensor.numpy()).cast("B"))
        handle.flush()
        os.fsync(handle.fileno())


def fresh(directory: Path) -> Path:
    """An empty directory (removed first if present)."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return directory


def main() -> None:
    """Run every measurement and print a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: tmp)")
    args = parser.parse_args()
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="ckptmgr-bench-"))
    state = make_state(args.size_mib, args.tensors)
    results: dict[str, tuple[float, float]] = {}

    targets = [torch.empty_like(v) for v in state.values()]
    sources = list(state.values())
    results["memcpy into touched buffers"] = median_of(
        lambda: torch._foreach_copy_(targets, sources), 3
    )

    results["raw write + fsync"] = median_of(lambda: raw_write(state, fresh(scratch / "raw")), 2)
    results["torch.save"] = median_of(
        lambda: torch.save(state, fresh(scratch / "ts") / "state.pt"), args.repeats
    )
    results["dcp.save"] = median_of(
        lambda: dcp.save(state, checkpoint_id=fresh(scratch / "dcp")), args.repeats
    )

    futures: list[object] = []

    def dcp_async_blocking() -> None:
        futures.append(dcp.async_save(state, checkpoint_id=fresh(scratch / "dcpa")))

    def dcp_async_wait() -> None:
        futures.pop().result()  # type: ignore[attr-defined]

    async_block, async_wait = [], []
    for _ in range(args.repeats + 1):
        async_block.append(timed(dcp_async_blocking))
        async_wait.append(timed(dcp_async_wait))
    results["dcp.async_save blocking"] = (async_block[0], statistics.median(async_block[1:]))

    manager_dir = fresh(scratch / "ckptmgr")
    with CheckpointManager(manager_dir, 1, max_to_keep=1, chkpt_on_preemption=False) as manager:
        step = iter(range(10**6))
        results["ckptmgr save"] = median_of(lambda: manager.save(next(step), state), args.repeats)
        blocking, total = [], []
        for _ in range(args.repeats + 1):
            started = time.perf_counter()
            manager.save_async(next(step), state)
            blocking.append(time.perf_counter() - started)
            manager.join()
            total.append(time.perf_counter() - started)
        results["ckptmgr save_async blocking"] = (blocking[0], statistics.median(blocking[1:]))
        results["ckptmgr save_async to commit"] = (total[0], statistics.median(total[1:]))
    shutil.rmtree(scratch, ignore_errors=True)

    print(
        f"\nstate: {args.size_mib} MiB in {args.tensors} float32 tensors; "
        f"torch {torch.__version__}; {os.cpu_count()} CPUs; {platform.platform()}\n"
    )
    print("| operation | first call (s) | median of later calls (s) |")
    print("|---|---|---|")
    for name, (first, later) in results.items():
        print(f"| {name} | {first:.3f} | {later:.3f} |")

    def ratio(a: str, b: str) -> str:
        return f"{results[a][1] / results[b][1]:.2f}x"

    print("\n| ratio (medians of later calls) | value |")
    print("|---|---|")
    print(
        f"| save_async blocking / memcpy floor | "
        f"{ratio('ckptmgr save_async blocking', 'memcpy into touched buffers')} |"
    )
    print(
        f"| save_async blocking / dcp.async_save blocking | "
        f"{ratio('ckptmgr save_async blocking', 'dcp.async_save blocking')} |"
    )
    print(f"| save / dcp.save | {ratio('ckptmgr save', 'dcp.save')} |")
    print(f"| save / raw write + fsync | {ratio('ckptmgr save', 'raw write + fsync')} |")
    print(
        f"| save_async to commit / dcp.save | {ratio('ckptmgr save_async to commit', 'dcp.save')} |"
    )


if __name__ == "__main__":
    main()
