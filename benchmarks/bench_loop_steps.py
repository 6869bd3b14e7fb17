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
``save_async``; the excess by the time since ``save_async`` returned, in 5 ms slices; and the
loop thread's time off its core during a save (wall time less the thread's CPU time: waiting for
the GIL, or for a core), paired with the control's like the loss below. That part does not move
with the machine's speed, which the rest of the loss does.

The baseline is measured once, and this machine's speed drifts by more than the loss within a
run. So after each save's job has ended, and as many steps again to let the kernel settle, the
loop runs as many steps once more with nothing running (the control), and the "paired" loss is
the save's steps' excess less the control's: the same step count, measured a moment apart.

``--kept N`` first commits N steps of a tiny state to the root and keeps every step (the default
retention, ``max_to_keep=0``): the root of a long run. The listing after each commit then covers
N + 1 steps, and any per-step work in it shows as a loss that grows with N. ``--max-to-keep K``
sets retention instead (say 5000: a policy that plans over every step and keeps them all).

``--mode floor-thread`` and ``--mode floor-process`` measure the floors the same way: each save
copies the state into one preallocated buffer (as the staging does), then a background thread of
this process, or a child process at the daemon's nice value (which shares no GIL with the loop),
writes those bytes to a new file, fsyncs it and deletes the previous save's file. What the loop
loses beside the process floor is the cost of the I/O alone (CPU, memory bandwidth, the kernel's
writeback and journal), which no checkpointer that writes the state can avoid.

``--pin`` (Linux, two CPUs or more) runs the loop alone on CPU 0 and everything else (ckptmgr's
threads, the checkpoint daemon in process mode) on CPU 1: what remains of the loss then is not
competition for a core. ``--loop-cpu N`` pins the loop's thread alone to CPU N and leaves the rest
to the kernel. Where the loop runs matters on machines whose disk interrupts all go to one CPU
(``/proc/irq/<n>/effective_affinity_list``; CPU 1 on the 2-core machine of docs/benchmarks.md):
a loop on that CPU is preempted by the completion of the save's writes (the block layer's
high-priority kworker), one elsewhere is not, and unpinned runs land on either.

Usage::

    python benchmarks/bench_loop_steps.py --workload c --mode thread --saves 60
    python benchmarks/bench_loop_steps.py --workload c --mode process --saves 60 --pin
    python benchmarks/bench_loop_steps.py --workload c --mode process --saves 60 --kept 1000
    python benchmarks/bench_loop_steps.py --workload c --mode floor-process --saves 60
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.connection
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
from ckptmgr.niceness import background_niceness

_LIMIT_S = 600.0  # bound on one background job
_SLICE_S = 0.005


class ManagerSaver:
    """ckptmgr's ``save_async`` of ``state``, in the shape of the floors below."""

    def __init__(self, manager: CheckpointManager, state: dict[str, torch.Tensor]) -> None:
        self.manager = manager
        self._state = state

    def save_async(self, step: int) -> None:
        self.manager.save_async(step, self._state)

    def idle(self) -> bool:
        return writer_idle(self.manager)

    def join(self) -> None:
        self.manager.join()

    def close(self) -> None:
        self.manager.close()


def _write_and_fsync(blob: torch.Tensor, path: Path, previous: Path | None) -> None:
    """The floor's write: ``blob``'s bytes to a new file at ``path``, fsynced (the GIL released
    in each call), then ``previous`` deleted."""
    view = memoryview(blob.numpy()).cast("B")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    if previous is not None:
        previous.unlink()


def _floor_process(connection: multiprocessing.connection.Connection, blob: torch.Tensor) -> None:
    """The process floor's child: writes ``blob`` to each path it is sent, answers when done."""
    niceness = background_niceness()
    if niceness is not None:
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
    previous: Path | None = None
    while (path := connection.recv()) is not None:
        _write_and_fsync(blob, path, previous)
        previous = path
        connection.send(True)
    if previous is not None:
        previous.unlink()


class RawWriteFloor:
    """The floors: the state copied into one preallocated buffer, whose bytes a background
    thread (``in_process=False``) or a child process writes to a new file and fsyncs."""

    def __init__(self, work_tensors: list[torch.Tensor], root: Path, in_process: bool) -> None:
        self._sources = [t.reshape(-1) for t in work_tensors]
        nbytes = sum(t.numel() * t.element_size() for t in work_tensors)
        self._blob = torch.empty(nbytes, dtype=torch.uint8)
        if in_process:
            self._blob.share_memory_()
        self._blob.fill_(1)  # touched: the copies into it pay no page faults
        self._flat = self._blob.view(work_tensors[0].dtype)
        self._root = root
        self._previous: Path | None = None
        self._thread: threading.Thread | None = None
        self._child: multiprocessing.process.BaseProcess | None = None
        self._connection: multiprocessing.connection.Connection | None = None
        self._pending = False
        if in_process:
            context = multiprocessing.get_context("spawn")
            self._connection, theirs = context.Pipe()
            self._child = context.Process(target=_floor_process, args=(theirs, self._blob))
            self._child.start()
            theirs.close()

    def save_async(self, step: int) -> None:
        torch.cat(self._sources, out=self._flat)
        path = self._root / f"floor-{step}.bin"
        if self._connection is not None:
            self._connection.send(path)
            self._pending = True
        else:
            self._thread = threading.Thread(
                target=_write_and_fsync, args=(self._blob, path, self._previous)
            )
            self._thread.start()
        self._previous = path

    def idle(self) -> bool:
        if self._connection is not None:
            if self._pending and self._connection.poll():
                self._connection.recv()
                self._pending = False
            return not self._pending
        return self._thread is None or not self._thread.is_alive()

    def join(self) -> None:
        if self._connection is not None:
            if self._pending and not self._connection.poll(_LIMIT_S):
                raise TimeoutError(f"the floor's write took over {_LIMIT_S} s")
            self.idle()
        elif self._thread is not None:
            self._thread.join(_LIMIT_S)
            if self._thread.is_alive():
                raise TimeoutError(f"the floor's write took over {_LIMIT_S} s")

    def close(self) -> None:
        if self._connection is not None and self._child is not None:
            self._connection.send(None)
            self._child.join(_LIMIT_S)
            self._connection.close()
        elif self._previous is not None:
            self.join()
            self._previous.unlink(missing_ok=True)


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
    parser.add_argument(
        "--mode", choices=["thread", "process", "floor-thread", "floor-process"], default="thread"
    )
    parser.add_argument("--loop", choices=["python", "compute"], default="python")
    parser.add_argument("--saves", type=int, default=60)
    parser.add_argument("--pin", action="store_true", help="the loop alone on CPU 0")
    parser.add_argument(
        "--loop-cpu",
        type=int,
        default=None,
        help="pin the loop's thread (only) to this CPU; the rest runs where the kernel puts it",
    )
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
    saver: ManagerSaver | RawWriteFloor
    if args.mode.startswith("floor-"):
        saver = RawWriteFloor(list(work.tensors.values()), root, args.mode == "floor-process")
    else:
        manager = CheckpointManager(
            root,
            1,
            max_to_keep=args.max_to_keep if args.max_to_keep is not None else 0 if args.kept else 1,
            chkpt_on_preemption=False,
            async_mode=args.mode,
        )
        saver = ManagerSaver(manager, work.state)
    try:
        saver.save_async(first_step)  # allocates the staging, starts the daemon
        saver.join()
        children = pin_loop_alone(threading.get_native_id()) if args.pin else []
        if args.loop_cpu is not None:
            os.sched_setaffinity(threading.get_native_id(), {args.loop_cpu})
        torch.set_num_threads(1)
        baseline = loop.baseline(300)
        blocking: list[float] = []
        steps = 0
        first: list[list[float]] = [[] for _ in range(4)]
        slices: dict[int, float] = {}
        lost = 0.0
        control_excess = 0.0
        paired: list[float] = []  # per save: its steps' excess less the control's
        # per save: the loop thread's time off its core (waiting for the GIL, or for a core)
        # during the save's steps, less the same during the control's
        off_core: list[float] = []
        lost_before = 0.0
        for step in range(1, args.saves + 1):
            torch.set_num_threads(threads)
            started = time.perf_counter()
            saver.save_async(first_step + step)
            returned = time.perf_counter()
            blocking.append(returned - started)
            torch.set_num_threads(1)
            index = 0
            window_cpu = time.thread_time()
            while not saver.idle():
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
            window_off = time.perf_counter() - returned - (time.thread_time() - window_cpu)
            steps += index
            saver.join()
            # The same number of steps with nothing running, a moment later: what those steps
            # cost when the machine is as fast or slow as it was during this save. As many
            # steps run first and are not counted, so that what the save left running in the
            # kernel (writeback, the journal) stays the save's cost.
            for _ in range(index):
                loop.step()
            control = 0.0
            control_started, control_cpu = time.perf_counter(), time.thread_time()
            for _ in range(index):
                before = time.perf_counter()
                loop.step()
                control += time.perf_counter() - before - baseline
            control_off = time.perf_counter() - control_started
            off_core.append(window_off - (control_off - (time.thread_time() - control_cpu)))
            control_excess += control
            paired.append(lost - lost_before - control)
            lost_before = lost
        baseline_after = loop.baseline(300)
    finally:
        saver.close()
        shutil.rmtree(root, ignore_errors=True)

    saves = args.saves
    busy = steps * baseline
    result = {
        "workload": work.name,
        "mode": args.mode,
        "loop": args.loop,
        "pinned": args.pin,
        "loop_cpu": args.loop_cpu,
        "kept_before": args.kept,
        "max_to_keep": saver.manager.config.max_to_keep
        if isinstance(saver, ManagerSaver)
        else None,
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
        "paired_off_core_ms_median": statistics.median(off_core) * 1e3,
        "first_steps_excess_ms": [sum(e) / saves * 1e3 for e in first],
        "excess_ms_by_slice": {
            f"{k * 5}-{k * 5 + 5} ms": v / saves * 1e3 for k, v in sorted(slices.items())
        },
    }
    print(
        f"{work.name}, {args.mode} mode, {args.loop} loop{', pinned' if args.pin else ''}"
        f"{f', loop on CPU {args.loop_cpu}' if args.loop_cpu is not None else ''}"
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
    print(
        f"the loop thread's time off its core (waiting for the GIL or a core) during a save's "
        f"steps, less during the control's: median {result['paired_off_core_ms_median']:.2f} ms"
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
