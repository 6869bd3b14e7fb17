"""Write+fsync of a checkpoint-sized file, with and without write-behind (ckptmgr.writeback).

Writes ``--size-mib`` MiB (``--tensors`` float32 tensors) to a new file in ``--piece-mib`` MiB
``write`` calls and fsyncs it, plainly (the raw write floor of ``bench_save.py``) and with the
writeback of every ``--stretches`` MiB started as soon as it is written, interleaved in one
process (the order reversed every other round). Every file is written beside the previous one
of its kind, which is deleted after, as a checkpoint's retention does (see ``Bench.fresh`` in
``bench_save.py``). Prints each method's times, the median of the rounds after the first, and
the median of its per-round ratios to the plain write.

Usage::

    python benchmarks/bench_write_behind.py --size-mib 1152 --rounds 7 --stretches 16,64,256
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ckptmgr.writeback import WriteBehind


def write_file(path: Path, tensors: list[torch.Tensor], piece: int, stretch: int | None) -> float:
    """Seconds to write ``tensors`` to ``path`` in ``piece``-byte calls and fsync it, starting
    the writeback of every ``stretch`` bytes (None: never)."""
    started = time.perf_counter()
    with open(path, "wb", buffering=0) as handle:
        behind = None if stretch is None else WriteBehind(handle.fileno(), stretch)
        for tensor in tensors:
            view = memoryview(tensor.numpy()).cast("B")
            written = 0
            while written < view.nbytes:
                size = min(piece, view.nbytes - written)
                if behind is not None:
                    size = min(size, behind.room())
                count = handle.write(view[written : written + size])
                assert count is not None
                written += count
                if behind is not None:
                    behind.wrote(count)
        os.fsync(handle.fileno())
    return time.perf_counter() - started


def main() -> None:
    """Run the rounds and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1152)
    parser.add_argument("--tensors", type=int, default=24)
    parser.add_argument("--piece-mib", type=int, default=16, help="bytes per write call")
    parser.add_argument("--stretches", default="16,64,256", help="MiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp directory)")
    args = parser.parse_args()
    numel = args.size_mib * 2**20 // 4 // args.tensors
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.rand(numel, generator=gen) for _ in range(args.tensors)]
    methods: dict[str, int | None] = {"plain write+fsync": None}
    for mib in args.stretches.split(","):
        methods[f"write-behind every {int(mib)} MiB"] = int(mib) * 2**20
    times: dict[str, list[float]] = {name: [] for name in methods}
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        previous: dict[str, Path] = {}
        for round_number in range(args.rounds):
            order = list(methods) if round_number % 2 == 0 else list(methods)[::-1]
            for number, name in enumerate(order):
                path = Path(scratch) / f"{round_number:03d}-{number}.bin"
                took = write_file(path, tensors, args.piece_mib * 2**20, methods[name])
                if name in previous:
                    previous[name].unlink()
                previous[name] = path
                times[name].append(took)
                print(f"round {round_number} {name}: {took:.3f} s", flush=True)
    plain = times["plain write+fsync"][1:]
    print(f"\n{args.size_mib} MiB in {args.piece_mib} MiB writes, then fsync (after round 0)")
    print("| method | median s | per-round ratio to plain (median) |")
    print("|---|---|---|")
    for name, values in times.items():
        ratios = [value / base for value, base in zip(values[1:], plain, strict=True)]
        median = statistics.median(values[1:])
        print(f"| {name} | {median:.3f} | {statistics.median(ratios):.2f}x |")


if __name__ == "__main__":
    main()
