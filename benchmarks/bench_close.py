"""How long ``close()`` of a process-mode manager waits for its checkpoint daemon to end.

Against DCP's own daemon (``_AsyncCheckpointProcess``, what ``dcp.async_save`` with
``AsyncCheckpointerType.PROCESS`` runs), stopped the way DCP stops it (``__del__``: the request
to stop, then a wait for the process to end), after the same saves, in the same process; the
two kinds alternate. Both daemons are asked to stop with nothing in flight (every save
answered), so the time is the daemon's own way out: DCP's tears down its gloo group and then
the interpreter (torch loaded), ckptmgr's skips the interpreter's finalization.

Usage::

    python benchmarks/bench_close.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._async_process_executor import _AsyncCheckpointProcess

from ckptmgr import CheckpointManager
from ckptmgr.save_process import SaveProcess

KINDS = ("DCP daemon stop", "ckptmgr close()")


def state_of(tensors: int) -> dict[str, torch.Tensor]:
    """``tensors`` float32 tensors of 64 Ki elements each."""
    generator = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(65536, generator=generator) for i in range(tensors)}


def dcp_daemon_stop(root: Path, state: dict[str, torch.Tensor], saves: int) -> float:
    """Seconds DCP's daemon takes to stop (``__del__``) after ``saves`` saves."""
    info = SaveProcess(None, 60.0)._init_info()  # the same 1-rank init info as ckptmgr's daemon
    daemon = _AsyncCheckpointProcess(pg_init_info=info)
    try:
        for index in range(saves):
            writer = dcp.FileSystemWriter(str(root / f"dcp-{index}"))
            daemon.save(state, storage_writer=writer, no_dist=True)
        started = time.perf_counter()
        daemon.__del__()
        elapsed = time.perf_counter() - started
    finally:
        if daemon._save_process.is_alive():
            daemon._save_process.kill()
    return elapsed


def ckptmgr_close(root: Path, state: dict[str, torch.Tensor], saves: int) -> float:
    """Seconds ``close()`` of a process-mode manager takes after ``saves`` committed saves."""
    manager = CheckpointManager(root, 1, async_mode="process", chkpt_on_preemption=False)
    for step in range(saves):
        manager.save_async(step, state)
    manager.join()
    started = time.perf_counter()
    manager.close()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--tensors", type=int, default=64)
    args = parser.parse_args()
    state = state_of(args.tensors)
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for index in range(args.rounds):
        for kind in KINDS if index % 2 == 0 else KINDS[::-1]:
            with tempfile.TemporaryDirectory(prefix="bench-close-") as directory:
                if kind == KINDS[0]:
                    elapsed = dcp_daemon_stop(Path(directory), state, args.saves)
                else:
                    elapsed = ckptmgr_close(Path(directory), state, args.saves)
            times[kind].append(elapsed)
            print(f"round {index} {kind}: {elapsed:.3f} s", flush=True)
    medians = {kind: statistics.median(values) for kind, values in times.items()}
    print("\n| stop of the daemon | median s | all |\n|---|---|---|")
    for kind, values in times.items():
        print(f"| {kind} | {medians[kind]:.3f} | {', '.join(f'{v:.3f}' for v in values)} |")
    print(f"\nckptmgr close() / DCP daemon stop: {medians[KINDS[1]] / medians[KINDS[0]]:.2f}x")


if __name__ == "__main__":
    main()
