"""Where a training loop loses its time during background saves: every step timed.

``bench_save.py`` reports the steps a loop loses while a save's background job runs, as one sum.
This script times each step of the loop instead, so the loss can be placed: in the first step
after ``save_async`` returns, in the write, around the commit. For each of ``--saves`` saves in a
row it makes a ``save_async`` of the workload, then runs the loop on the calling thread until the
background job has ended (retention's deletion included). A step's excess is its time minus the
loop's median step time measured just before, with nothing running.

Reported: the baseline step; blocking per save; steps per save; lost milliseconds per save (the
summed excess of the steps, the blocking copy not counted); the share of the loop's time lost
while the job ran (lost / (lost + steps x baseline)); the excess of the first steps after each
``save_async``; and the excess by the time since ``save_async`` returned, in 5 ms slices.

The baseline is measured once, and this machine's speed drifts by more than the loss within a
run. So after each save's job has ended, and as many steps again to let the kernel settle, the
loop runs as many steps once more with nothing running (the control), and the "paired" loss is
the save's steps' excess less the control's: the same step count, measured a moment apart.

``--kept N`` first commits N steps of a tiny state to the root and keeps every step (the default
retention, ``max_to_keep=0``): the root of a long run. The listing after each commit then covers
N + 1 steps, and any per-step work in it shows as a loss that grows with N. ``--max-to-keep K``
sets retention instead (say 5000: a policy that plans over every step and keeps them all).

``--pin`` (Linux, two CPUs or more) runs the loop alone on CPU 0 and everything else (ckptmgr's
threads, the checkpoint daemon in process mode) on CPU 1: what remains of the loss then is not
competition for a core.

Usage::

    python benchmarks/bench_loop_steps.py --workload c --mode thread --saves 60
    python benchmarks/bench_loop_steps.py --workload c --mode process --saves 60 --pin
    python benchmarks/bench_loop_steps.py --workload c --mode process --saves 60 --kept 1000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from bench_save import Loop, workload_a, workload_c, writer_idle  # this script's folder

from ckptmgr import CheckpointManager

_LIMIT_S = 600.0  # bound on one background job
_SLICE_S = 0.005


def pin_loop_alone(loop_thread: int) -> list[int]:
    """Pin thread ``loop_thread`` to CPU 0, and every other thread of this process and of its
    child processes to CPU 1; returns the child pids."""
    children: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        tid = int(task)
        os.sched_setaffinity(tid, {0} if tid == loop_thread else {1})
        try:
            with open(f"/proc/self/task/{task}/children") as handle:
                children.update(int(pid) for pid in handle.read().split())
        except OSError:
            pass
    for pid in children:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(task), {1})
            except OSError:  # the thread ended meanwhile
                pass
    return sorted(children)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["a", "c"], default="c")
    parser.add_argument("--small", type=int, default=20_000, help="tensors of workload c")
    parser.add_argument("--size-mib", type=int, default=1024, help="size of workload a")
    parser.add_argument("--mode", choices=["thread", "process"], default="thread")
    parser.add_argument("--loop", choices=["python", "compute"], default="python")
    parser.add_argument("--saves", type=int, default=60)
    parser.add_argument("--pin", action="store_true", help="the loop alone on CPU 0")
    parser.add_argument(
        "--kept", type=int, default=0, help="steps committed before, all kept (max_to_keep=0)"
    )
    parser.add_argument(
        "--max-to-keep", type=int, default=None, help="default: 1, or 0 (keep all) with --kept"
    )
    parser.add_argument("--dir", default=None, help="where to write (default: a temp directory)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()

    work = (
        workload_c(args.small, "cpu")
        if args.workload == "c"
        else workload_a(args.size_mib, 64, "cpu")
    )
    root = Path(tempfile.mkdtemp(prefix="bench-loop-", dir=args.dir))
    loop = Loop(args.loop)
    threads = torch.get_num_threads()  # for the copy; the loop runs on one, as in bench_save
    if args.kept:  # the root of a long run: steps 0 .. kept - 1, every one kept
        with CheckpointManager(root, 1, chkpt_on_preemption=False) as earlier:
            for step in range(args.kept):
                earlier.save(step, {"w": torch.zeros(4)})
    first_step = args.kept
    manager = CheckpointManager(
        root,
        1,
        max_to_keep=args.max_to_keep if args.max_to_keep is not None else 0 if args.kept else 1,
        chkpt_on_preemption=False,
        async_mode=args.mode,
    )
    try:
        manager.save_async(first_step, work.state)  # allocates the staging, starts the daemon
        manager.join()
        children = pin_loop_alone(threading.get_native_id()) if args.pin else []
        torch.set_num_threads(1)
        baseline = loop.baseline(300)
        blocking: list[float] = []
        steps = 0
        first: list[list[float]] = [[] for _ in range(4)]
        slices: dict[int, float] = {}
        lost = 0.0
        control_excess = 0.0
        paired: list[float] = []  # per save: its steps' excess less the control's
        lost_before = 0.0
        for step in range(1, args.saves + 1):
            torch.set_num_threads(threads)
            started = time.perf_counter()
            manager.save_async(first_step + step, work.state)
            returned = time.perf_counter()
            blocking.append(returned - started)
            torch.set_num_threads(1)
            index = 0
            while not writer_idle(manager):
                before = time.perf_counter()
                loop.step()
                after = time.perf_counter()
                excess = after - before - baseline
                lost += excess
                if index < len(first):
                    first[index].append(excess)
                position = int((before - returned) / _SLICE_S)
                slices[position] = slices.get(position, 0.0) + excess
                index += 1
                if after - returned > _LIMIT_S:
                    raise TimeoutError(f"a background save took over {_LIMIT_S} s")
            steps += index
            manager.join()
            # The same number of steps with nothing running, a moment later: what those steps
            # cost when the machine is as fast or slow as it was during this save. As many
            # steps run first and are not counted, so that what the save left running in the
            # kernel (writeback, the journal) stays the save's cost.
            for _ in range(index):
                loop.step()
            control = 0.0
            for _ in range(index):
                before = time.perf_counter()
                loop.step()
                control += time.perf_counter() - before - baseline
            control_excess += control
            paired.append(lost - lost_before - control)
            lost_before = lost
        baseline_after = loop.baseline(300)
    finally:
        manager.close()
        shutil.rmtree(root, ignore_errors=True)

    saves = args.saves
    busy = steps * baseline
    result = {
        "workload": work.name,
        "mode": args.mode,
        "loop": args.loop,
        "pinned": args.pin,
        "kept_before": args.kept,
        "max_to_keep": manager.config.max_to_keep,
        "children_pinned": len(children),
        "saves": saves,
        "baseline_step_ms": baseline * 1e3,
        "baseline_step_after_ms": baseline_after * 1e3,
        "blocking_ms": statistics.median(blocking) * 1e3,
        "steps_per_save": steps / saves,
        "lost_ms_per_save": lost / saves * 1e3,
        "lost_share": lost / (lost + busy) if lost + busy > 0 else 0.0,
        "control_excess_ms_per_save": control_excess / saves * 1e3,
        "paired_lost_ms_per_save": (lost - control_excess) / saves * 1e3,
        "paired_lost_share": (lost - control_excess) / (lost + busy) if lost + busy > 0 else 0.0,
        "paired_lost_ms_median": statistics.median(paired) * 1e3,
        "paired_lost_share_median": statistics.median(paired)
        / (statistics.median(paired) + busy / saves)
        if busy > 0
        else 0.0,
        "first_steps_excess_ms": [sum(e) / saves * 1e3 for e in first],
        "excess_ms_by_slice": {
            f"{k * 5}-{k * 5 + 5} ms": v / saves * 1e3 for k, v in sorted(slices.items())
        },
    }
    print(
        f"{work.name}, {args.mode} mode, {args.loop} loop{', pinned' if args.pin else ''}"
        f"{f', {args.kept} steps kept before' if args.kept else ''}: "
        f"baseline step {result['baseline_step_ms']:.3f} ms "
        f"({result['baseline_step_after_ms']:.3f} ms after); blocking {result['blocking_ms']:.1f} "
        f"ms; {result['steps_per_save']:.1f} steps per save; lost "
        f"{result['lost_ms_per_save']:.2f} ms per save = {result['lost_share'] * 100:.0f}% of the "
        f"loop's time while the job ran"
    )
    print(
        f"paired with as many steps right after each save, nothing running: those lost "
        f"{result['control_excess_ms_per_save']:.2f} ms per save; the save cost "
        f"{result['paired_lost_ms_per_save']:.2f} ms per save = "
        f"{result['paired_lost_share'] * 100:.0f}% of the loop's time while the job ran; median "
        f"over the saves {result['paired_lost_ms_median']:.2f} ms = "
        f"{result['paired_lost_share_median'] * 100:.0f}%"
    )
    firsts = ", ".join(f"{value:.2f}" for value in result["first_steps_excess_ms"])
    print(f"excess of the first steps after save_async returned, ms per save: {firsts}")
    for label, value in result["excess_ms_by_slice"].items():
        if abs(value) >= 0.05:
            print(f"  {label} after save_async returned: {value:.2f} ms per save")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
