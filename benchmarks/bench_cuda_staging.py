"""CUDA staging check and benchmark (needs a GPU; never part of the test suite).

Checks, on CUDA tensors, that ``save_async``:

* returns with a snapshot: tensors changed on the GPU right after it returns do not leak into
  the checkpoint, which restores bit-exact into fresh CUDA tensors;
* stages into pinned host buffers that are reused from save to save.

Then reports the blocking time of ``save_async`` against, in the same run, the floor (a
device-to-host copy into already pinned, touched buffers) and ``dcp.async_save``'s blocking time.

Usage::

    python benchmarks/bench_cuda_staging.py --size-mib 2048 --tensors 64 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from ckptmgr import CheckpointManager


def make_state(size_mib: int, tensors: int) -> dict[str, torch.Tensor]:
    """``tensors`` float32 CUDA tensors adding up to ``size_mib`` MiB."""
    numel = size_mib * 2**20 // 4 // tensors
    return {f"layer{i}.weight": torch.randn(numel, device="cuda") for i in range(tensors)}


def check_snapshot_and_pinning(root: Path) -> list[str]:
    """Correctness checks; returns the problems found (empty when all is well)."""
    problems = []
    state = make_state(64, 8)
    expected = {k: v.clone() for k, v in state.items()}
    with CheckpointManager(root, 1, chkpt_on_preemption=False, max_pending_async=1) as manager:
        manager.save_async(1, state)
        for tensor in state.values():
            tensor.add_(1.0)  # queued on the GPU right after save_async returned
        manager.join()
        buffers = manager._staging.acquire(timeout_s=60)  # internal: inspect the staging buffers
        pinned = [b.is_pinned() for b in buffers.buffers.values()]
        pointers = {k: b.data_ptr() for k, b in buffers.buffers.items()}
        manager._staging.release(buffers)
        if not pinned or not all(pinned):
            problems.append(f"staging buffers not pinned: {pinned}")
        manager.save_async(2, state)
        manager.join()
        buffers = manager._staging.acquire(timeout_s=60)
        reused = {k: b.data_ptr() for k, b in buffers.buffers.items()} == pointers
        manager._staging.release(buffers)
        if not reused:
            problems.append("staging buffers were reallocated by the second save")
        target = {k: torch.empty_like(v) for k, v in state.items()}
        manager.restore(1, target)
        for key, value in expected.items():
            if target[key].device.type != "cuda":
                problems.append(f"{key} restored to {target[key].device}")
            if not torch.equal(target[key], value):
                problems.append(f"{key}: restored values differ from the snapshot")
    return problems


def median_blocking(
    save: object, repeats: int, settle: object = lambda: None
) -> tuple[float, float]:
    """(first, median of later) blocking seconds of ``save(i)`` calls.

    ``settle()`` runs untimed before each call (waits for the previous write), so the time is
    the staging alone, not the wait for a free slot.
    """
    times = []
    for i in range(repeats + 1):
        settle()  # type: ignore[operator]
        torch.cuda.synchronize()
        started = time.perf_counter()
        save(i)  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return times[0], statistics.median(times[1:])


def main() -> None:
    """Run the checks, then the timings; print a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckptmgr-cuda-"))
    problems = check_snapshot_and_pinning(root / "check")
    print("correctness:", "OK" if not problems else problems)

    state = make_state(args.size_mib, args.tensors)
    pinned = [torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for v in state.values()]

    def floor_copy(_: int) -> None:
        for buffer, tensor in zip(pinned, state.values(), strict=True):
            buffer.copy_(tensor, non_blocking=True)
        torch.cuda.synchronize()

    results = {"D2H copy into pinned, touched buffers (floor)": median_blocking(floor_copy, 5)}

    pending: list[object] = []

    def dcp_async(i: int) -> None:
        pending.append(dcp.async_save(state, checkpoint_id=root / f"dcp{i}"))

    def dcp_wait() -> None:
        while pending:
            pending.pop().result()  # type: ignore[attr-defined]

    results["dcp.async_save blocking"] = median_blocking(dcp_async, args.repeats, dcp_wait)
    dcp_wait()

    with CheckpointManager(root / "mgr", 1, max_to_keep=1, chkpt_on_preemption=False) as manager:

        def ckptmgr_async(i: int) -> None:
            manager.save_async(i, state)

        results["ckptmgr save_async blocking"] = median_blocking(
            ckptmgr_async, args.repeats, manager.join
        )
        manager.join()

    name = torch.cuda.get_device_name()
    print(
        f"\nstate: {args.size_mib} MiB in {args.tensors} float32 CUDA tensors on {name}; "
        f"torch {torch.__version__}\n"
    )
    print("| operation | first call (s) | median of later calls (s) |")
    print("|---|---|---|")
    for label, (first, later) in results.items():
        print(f"| {label} | {first:.3f} | {later:.3f} |")
    floor = results["D2H copy into pinned, touched buffers (floor)"][1]
    ours = results["ckptmgr save_async blocking"][1]
    theirs = results["dcp.async_save blocking"][1]
    print(
        f"\nsave_async blocking / floor: {ours / floor:.2f}x; "
        f"save_async blocking / dcp.async_save blocking: {ours / theirs:.2f}x"
    )
    if problems:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
