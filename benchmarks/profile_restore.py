"""Where a restore of many small tensors spends its time: cProfile of ckptmgr ``restore``.

Saves ``--small`` float32 tensors of 256 items (workload (c) of ``bench_save.py``) on
``--device``, then restores them in place ``--rounds`` times, each after the step's files are
dropped from the page cache (as ``bench_save.py`` does), and prints the median restore, a cold
raw read of the same bytes (one ``readinto`` per tensor, ``bench_save.py``'s floor) and the
functions that took the most time of their own across the rounds. Not a benchmark of record:
profiling slows Python calls, so the profiled rounds come after the timed ones.

Usage::

    python benchmarks/profile_restore.py --device cpu --rounds 7 --top 25
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_save import drop_cache

from ckptmgr import CheckpointManager


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    """Time and profile restores of ``--small`` small tensors."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--small", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    state = {
        f"state/{i}/exp_avg": torch.randn(256, generator=gen).to(args.device)
        for i in range(args.small)
    }
    target = {key: torch.zeros_like(value) for key, value in state.items()}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        raw = root / "raw.bin"
        with open(raw, "wb") as handle:
            for value in state.values():
                handle.write(value.cpu().numpy().tobytes())
        host = [torch.empty(256) for _ in state]
        with CheckpointManager(root / "ckpt", 1, chkpt_on_preemption=False) as manager:
            assert manager.save(1, state)
            manager.restore(1, target)  # (imports and first-use costs)
            _sync(args.device)
            restores, reads = [], []
            for _ in range(args.rounds):
                drop_cache(root / "ckpt")
                started = time.perf_counter()
                manager.restore(1, target)
                _sync(args.device)
                restores.append(time.perf_counter() - started)
                drop_cache(raw)
                started = time.perf_counter()
                with open(raw, "rb", buffering=0) as handle:
                    for tensor in host:
                        handle.readinto(memoryview(tensor.numpy()).cast("B"))
                reads.append(time.perf_counter() - started)
            assert all(torch.equal(target[key], value) for key, value in state.items())
            restore, read = statistics.median(restores), statistics.median(reads)
            print(
                f"{args.small} tensors on {args.device}: restore {restore * 1e3:.1f} ms, "
                f"cold raw read {read * 1e3:.1f} ms ({restore / read:.2f}x), medians of "
                f"{args.rounds}"
            )
            profile = cProfile.Profile()
            for _ in range(args.rounds):
                drop_cache(root / "ckpt")
                profile.enable()
                manager.restore(1, target)
                _sync(args.device)
                profile.disable()
    print(f"cProfile, {args.rounds} restores, by own time:")
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
