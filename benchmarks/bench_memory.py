"""Host memory held by async saves in a fresh process: ckptmgr ``save_async`` (thread and process
modes) against ``dcp.async_save``, on many small tensors and on a few large ones of the same bytes.

``bench_save.py`` measures the peak of one save after many (``VmHWM`` reset before it): memory a
manager keeps from its first save on (staging buffers, the cached layout of the state) is not in
it. Here each kind runs in a fresh process that builds the state, then makes ``--saves`` saves of
it, each joined, and reports, against the resident memory before the first save:

- **held**: the training process's memory after the last save (its proportional set size,
  ``Pss`` of ``/proc/self/smaps_rollup``, which splits memory shared with the daemon between the
  two), as a ratio to the state's bytes;
- **daemon**: in process mode, the daemon's ``Pss`` after the last save, all of it (its
  interpreter and torch, about 200 MiB, with its share of the staging buffers);
- **peak**: the training process's peak resident memory (``VmHWM``);
- **growth**: held memory added per save from the third save on.

Usage::

    python benchmarks/bench_memory.py [--saves 10] [--tensors 20000] [--size-mib 20]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

KINDS = ("dcp.async_save", "ckptmgr save_async (thread)", "ckptmgr save_async (process)")
MIB = 2**20


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def _children_pss_mib() -> float:
    """The proportional set size of this process's children (the checkpoint daemon)."""
    total = 0.0
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                with open(f"/proc/{child}/smaps_rollup") as rollup:
                    for line in rollup:
                        if line.startswith("Pss:"):
                            total += int(line.split()[1]) / 1024
            except FileNotFoundError:  # (ended meanwhile)
                continue
    return total


def _own_pss_mib() -> float:
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    raise KeyError("Pss")


def measure(kind: str, tensors: int, size_mib: int, saves: int, root: str) -> dict[str, float]:
    """Run ``saves`` saves of ``kind`` in this process; memory figures in MiB."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ckptmgr import CheckpointManager

    numel = size_mib * MIB // 4 // tensors
    state = {f"layer{i}.weight": torch.randn(numel) for i in range(tensors)}
    state_mib = tensors * numel * 4 / MIB
    manager = None
    if kind.startswith("ckptmgr"):
        mode = "process" if "process" in kind else "thread"
        manager = CheckpointManager(
            root, 1, max_to_keep=2, async_mode=mode, chkpt_on_preemption=False
        )
    gc.collect()
    before = _own_pss_mib()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # (VmHWM from here)
    rss_before = _status_mib("VmRSS")
    held: list[float] = []
    for step in range(1, saves + 1):
        if manager is None:
            dcp.async_save(state, checkpoint_id=f"{root}/step_{step}").result()
        else:
            manager.save_async(step, state)
            manager.join()
        gc.collect()
        held.append(_own_pss_mib() - before)
    peak = _status_mib("VmHWM") - rss_before
    daemon = _children_pss_mib()
    if manager is not None:
        manager.close()
    growth = (held[-1] - held[2]) / (saves - 3) if saves > 3 else 0.0
    return {
        "state_mib": state_mib,
        "held_mib": held[-1],
        "daemon_mib": daemon,
        "peak_mib": peak,
        "growth_mib": growth,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--tensors", type=int, nargs="+", default=[20000, 8])
    parser.add_argument("--size-mib", type=int, default=20)
    parser.add_argument("--child", nargs=2, metavar=("KIND", "TENSORS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory() as root:
            result = measure(args.child[0], int(args.child[1]), args.size_mib, args.saves, root)
        print(json.dumps(result))
        return
    header = f"{'tensors':>8} {'kind':<30} {'state MiB':>9} {'held':>14} {'daemon':>8}"
    print(f"{header} {'peak':>14} {'growth/save':>12}")
    for tensors in args.tensors:
        for kind in KINDS:
            command = [sys.executable, __file__, "--child", kind, str(tensors)]
            command += ["--saves", str(args.saves), "--size-mib", str(args.size_mib)]
            done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            state = result["state_mib"]
            print(
                f"{tensors:>8} {kind:<30} {state:>9.1f} "
                f"{result['held_mib']:>7.1f} {result['held_mib'] / state:>5.2f}x "
                f"{f'{daemon:.1f}' if (daemon := result['daemon_mib']) else '-':>8} "
                f"{result['peak_mib']:>7.1f} {result['peak_mib'] / state:>5.2f}x "
                f"{result['growth_mib'] * 1024:>8.1f} KiB",
                flush=True,
            )


if __name__ == "__main__":
    main()
