"""Write+fsync of a checkpoint-sized file: plain, with write-behind (ckptmgr.writeback), and
written directly (ckptmgr.direct_write).

Writes ``--size-mib`` MiB (``--tensors`` float32 tensors) to a new file in ``--piece-mib`` MiB
``write`` calls and fsyncs it, plainly (the raw write floor of ``bench_save.py``) and with the
writeback of every ``--stretches`` MiB started as soon as it is written, interleaved in one
process (the order reversed every other round). Every file is written beside the previous one
of its kind, which is deleted after, as a checkpoint's retention does (see ``Bench.fresh`` in
``bench_save.py``). The direct writes (``O_DIRECT``, as ckptmgr writes its data files where the
file system takes it) write the same bytes twice over: from page-aligned tensors, as staged
tensors are (taken by the disk from where they lie), and from tensors 64 bytes past a page
boundary (copied through the bounce buffer). Prints each method's times, the median of the
rounds after the first, and the median of its per-round ratios to the plain write.

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

from ckptmgr.direct_write import DIRECT_ALIGN, DirectWriter, open_direct
from ckptmgr.tensor_bytes import byte_view
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


def write_direct(path: Path, tensors: list[torch.Tensor], piece: int) -> float:
    """Seconds to write ``tensors`` to ``path`` in ``piece``-byte calls through a
    :class:`DirectWriter` and fsync it."""
    started = time.perf_counter()
    with open(path, "wb", buffering=0) as handle:
        fd = open_direct(path)
        if fd is None:
            raise SystemExit(f"{path.parent} takes no O_DIRECT: leave out --direct")
        writer = DirectWriter(fd, handle.fileno())
        for tensor in tensors:
            view = byte_view(tensor)
            for start in range(0, view.nbytes, piece):
                writer.write(view[start : start + piece])
        writer.finish()
        writer.close()
        os.fsync(handle.fileno())
    return time.perf_counter() - started


def offset_copies(tensors: list[torch.Tensor], skew: int) -> list[torch.Tensor]:
    """Copies of ``tensors`` that start ``skew`` bytes past a ``DIRECT_ALIGN`` boundary."""
    copies = []
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        raw = torch.empty(nbytes + 2 * DIRECT_ALIGN, dtype=torch.uint8)
        start = -raw.data_ptr() % DIRECT_ALIGN + skew
        copy = raw[start : start + nbytes].view(tensor.dtype)
        copy.copy_(tensor.reshape(-1))
        copies.append(copy)
    return copies


def main() -> None:
    """Run the rounds and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1152)
    parser.add_argument("--tensors", type=int, default=24)
    parser.add_argument("--piece-mib", type=int, default=16, help="bytes per write call")
    parser.add_argument("--stretches", default="16,64,256", help="MiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp directory)")
    parser.add_argument("--no-direct", action="store_true", help="leave out the direct writes")
    args = parser.parse_args()
    numel = args.size_mib * 2**20 // 4 // args.tensors
    gen = torch.Generator().manual_seed(0)
    tensors = offset_copies([torch.rand(numel, generator=gen) for _ in range(args.tensors)], 0)
    skewed = [] if args.no_direct else offset_copies(tensors, 64)
    methods: dict[str, int | str | None] = {"plain write+fsync": None}
    for mib in args.stretches.split(","):
        methods[f"write-behind every {int(mib)} MiB"] = int(mib) * 2**20
    if not args.no_direct:
        methods["direct, page-aligned source"] = "aligned"
        methods["direct, source 64 bytes off (copied)"] = "skewed"
    times: dict[str, list[float]] = {name: [] for name in methods}
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        previous: dict[str, Path] = {}
        for round_number in range(args.rounds):
            order = list(methods) if round_number % 2 == 0 else list(methods)[::-1]
            for number, name in enumerate(order):
                path = Path(scratch) / f"{round_number:03d}-{number}.bin"
                method, piece = methods[name], args.piece_mib * 2**20
                if isinstance(method, str):
                    source = tensors if method == "aligned" else skewed
                    took = write_direct(path, source, piece)
                else:
                    took = write_file(path, tensors, piece, method)
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
