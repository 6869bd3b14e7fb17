"""Save-path benchmark: ckptmgr against its floors and baselines, interleaved in one process run.

For each workload it runs, in rounds (round 0 is the first call of the process, in a fixed order,
reported apart; later rounds give the medians) whose method order is shuffled anew each round
(seeded by ``--seed``), so that no method always runs right after the same one: with an order
that only rotated, ``save_async`` always followed ckptmgr ``save`` (which writes, then deletes a
step) and the raw write floor the memcpy floor, and what ran just before moved the commit of
workload c by up to 2x:

* floors: a copy of the state into preallocated, touched buffers (pinned device-to-host copy with
  ``--device cuda``), a raw sequential write + fsync of the same bytes into a new file, a raw
  cold read of them;
* baselines: ``torch.save`` (+ fsync), ``dcp.save``, ``dcp.async_save`` (thread mode),
  ``dcp.load``;
* ckptmgr: ``save``, ``save_async``, ``restore``.

Metrics per save: blocking time, time to commit (for ckptmgr the moment it logs ``committed step
N``; ``done`` is the end of its background job, which also deletes what retention no longer keeps),
peak extra host memory (``VmHWM`` reset through ``/proc/self/clear_refs`` before each operation;
for ckptmgr the staging memory it keeps between saves is added), and for async saves the cost to
a training loop running on the calling thread while the background job runs (to its end):
``slowdown`` (the background window / the time as many steps take right after, with nothing
running) and ``lost`` seconds (from the call to the end of the job, less that control), summed
over ``--loop-saves`` saves in a row (ten times as many for workload c, whose write lasts only a
few steps). The control is measured after each save, after a few more steps that let the
kernel's writeback settle: the machine's speed drifts within a run by more than a small state's
loss, so a step time measured once before the saves (kept as ``slowdown_vs_baseline``) does not
do. Two loops: a compute-bound
one (matmuls on one intra-op thread) and a Python-bound one (many tiny ops).

Workloads: ``a`` = ``--size-mib`` MiB in ``--tensors`` float32 tensors; ``b`` = a ~100M-parameter
MLP with AdamW state; ``c`` = ``--small`` tensors of 1 KiB in an optimizer-like nested dict;
with ``--views`` c's tensors are slices of one flat buffer (a contiguous parameter buffer);
``d`` = a model of ``--layers`` ``nn.Linear(64, 64)`` layers with AdamW state, given to ckptmgr
as the module and optimizer objects (DCP's state-dict API, or ckptmgr's own path to the same
dicts, runs at every save; the baselines get the tensors).

Usage::

    python benchmarks/bench_save.py --workloads a,c --repeats 3 --json bench.json

Disk speed varies between runs on shared machines: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from ckptmgr import CheckpointManager

Record = dict[str, float]


# -- when a ckptmgr save commits ---------------------------------------------------------------
class CommitClock(logging.Handler):
    """The moment each step commits, from ckptmgr's ``committed step N`` log line.

    A background save goes on after its commit: retention then deletes the steps it no longer
    keeps (deleting the previous 1 GiB step takes about 0.3 s on the benchmark machine). Time to
    commit is measured to that log line, not to the end of the background job.
    """

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.committed_at: dict[int, float] = {}  # step -> time.perf_counter() of its commit
        self._changed = threading.Condition()
        logger = logging.getLogger("ckptmgr")
        logger.setLevel(logging.INFO)  # no handler prints INFO: the root has none
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == "committed step %d" and isinstance(record.args, tuple):
            with self._changed:
                self.committed_at[int(record.args[0])] = time.perf_counter()
                self._changed.notify_all()

    def wait(self, step: int, timeout_s: float) -> float:
        """The commit time of ``step``, waiting up to ``timeout_s`` for it (``TimeoutError``)."""
        with self._changed:
            if not self._changed.wait_for(lambda: step in self.committed_at, timeout_s):
                raise TimeoutError(f"step {step} did not commit within {timeout_s} s")
            return self.committed_at[step]


def writer_idle(manager: CheckpointManager) -> bool:
    """True when ``manager`` has no background job left (its write, commit and retention's
    deletions all done). Internal state: the public ``join()`` can only wait for that."""
    return all(future.done() for future in manager._writer._pending)


# -- process memory -------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak() -> int:
    """Reset the process's peak RSS (VmHWM) to its current RSS; returns the RSS in bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:  # pragma: no cover - not Linux, or not allowed
        pass
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    """Peak RSS (bytes) since the last :func:`reset_peak`."""
    return _status_kib("VmHWM") * 1024


def drop_cache(path: Path) -> None:
    """Ask the kernel to drop ``path``'s files (recursively) from the page cache."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def du(path: Path, keep: Callable[[Path], bool] = lambda p: True) -> int:
    """Bytes of the files under ``path`` for which ``keep`` is true."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and keep(p))


# -- workloads --------------------------------------------------------------------------------
class Workload:
    """A state to save: the flat tensors (for the floors and baselines) and ckptmgr's state."""

    def __init__(self, name: str, tensors: dict[str, torch.Tensor], state: dict[str, Any]):
        self.name = name
        self.tensors = tensors
        self.state = state
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors.values())


def workload_a(size_mib: int, count: int, device: str) -> Workload:
    numel = size_mib * 2**20 // 4 // count
    generator = torch.Generator().manual_seed(0)
    tensors = {
        f"layer{i}.weight": torch.rand(numel, generator=generator).to(device) for i in range(count)
    }
    return Workload(f"a: {size_mib} MiB in {count} tensors", tensors, dict(tensors))


def _trained_mlp(
    width: int, depth: int, device: str
) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    """``depth`` ``nn.Linear(width, width)`` layers after one AdamW step, the optimizer, and
    their tensors by name (``model/<param>``, ``optim/<param>/<state key>``)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width, device=device)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tensors: dict[str, torch.Tensor] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for name, param in model.named_parameters():
        tensors[f"model/{name}"] = param.data
    for param, values in optimizer.state.items():
        for key, value in values.items():
            tensors[f"optim/{names[id(param)]}/{key}"] = value
    return model, optimizer, tensors


def workload_b(device: str) -> Workload:
    model, optimizer, tensors = _trained_mlp(4096, 6, device)  # 6 x 16.8M weights + biases
    params = sum(p.numel() for p in model.parameters())  # ~100.7M parameters
    return Workload(
        f"b: MLP {params / 1e6:.0f}M params + AdamW",
        tensors,
        {"model": model, "optim": optimizer},
    )


def workload_d(layers: int, device: str) -> Workload:
    model, optimizer, tensors = _trained_mlp(64, layers, device)
    return Workload(
        f"d: {layers} layers of 64x64 + AdamW, as objects",
        tensors,
        {"model": model, "optim": optimizer},
    )


def workload_c(count: int, device: str, views: bool = False) -> Workload:
    generator = torch.Generator().manual_seed(0)
    names = [
        f"optim/state/p{i // 2}/{'exp_avg' if i % 2 == 0 else 'exp_avg_sq'}" for i in range(count)
    ]
    if views:  # slices of one flat buffer, as in a contiguous parameter buffer
        flat = torch.rand(count * 256, generator=generator).to(device)
        tensors = {name: flat[i * 256 : (i + 1) * 256] for i, name in enumerate(names)}
        return Workload(f"c: {count} slices of 1 KiB of one buffer", tensors, dict(tensors))
    tensors = {name: torch.rand(256, generator=generator).to(device) for name in names}
    return Workload(f"c: {count} tensors of 1 KiB", tensors, dict(tensors))


# -- training loops that run while a background save runs -----------------------------------------
class Loop:
    """One kind of training step, and its cost measured around a background save."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._a = torch.randn(384, 384)
        self._b = torch.randn(384, 384)
        self._small = [torch.zeros(4) for _ in range(16)]

    def step(self) -> None:
        if self.kind == "compute":
            for _ in range(4):
                torch.mm(self._a, self._b)
        else:  # Python-bound: many tiny tensor ops, the CPU side of a GPU training loop
            for _ in range(40):
                for tensor in self._small:
                    tensor.add_(1.0)

    def baseline(self, steps: int = 30) -> float:
        """Median step time (s) right now."""
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    def run_until(self, done: Callable[[], bool], limit_s: float) -> tuple[int, float]:
        """Steps until ``done()``; returns (steps, seconds)."""
        started = time.perf_counter()
        steps = 0
        while not done():
            self.step()
            steps += 1
            if time.perf_counter() - started > limit_s:
                raise TimeoutError(f"background save took over {limit_s} s")
        return steps, time.perf_counter() - started


# -- the measurements ----------------------------------------------------------------------
class Bench:
    """All methods on one workload; each method returns a record of metrics."""

    def __init__(self, work: Workload, scratch: Path, device: str, threads: int) -> None:
        self.work = work
        self.scratch = scratch
        self.device = device
        self.threads = threads
        self.loop_saves = 1  # saves per record of a method with a loop
        self.clock = CommitClock()
        pin = device == "cuda"
        self.targets = {
            k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pin) for k, v in work.tensors.items()
        }
        for target in self.targets.values():
            target.zero_()  # touched
        self.restore_targets = {k: torch.empty_like(v) for k, v in work.tensors.items()}
        self.manager = CheckpointManager(
            scratch / "ckptmgr",
            1,
            max_to_keep=1,
            chkpt_on_preemption=False,
            num_of_threads=threads,
        )
        self.process_manager: CheckpointManager | None = None  # async_mode="process", on demand
        self.step = 0
        self._serial = 0  # (see fresh())
        self._outputs: dict[str, list[Path]] = {}
        self.raw = scratch / "raw.bin"
        self.raw_write()  # a file for the read floor from round 0 on
        self.dcp_dir = scratch / "dcp-load"
        dcp.save(work.tensors, checkpoint_id=self.dcp_dir)
        self.loops = {"compute": Loop("compute"), "python": Loop("python")}
        self.blob: torch.Tensor | None = None  # for the loops' floor, made on first use

    def close(self) -> None:
        self.manager.close()
        if self.process_manager is not None:
            self.process_manager.close()

    def fresh(self, name: str) -> Path:
        """A new path for one more output named ``name`` (a file or a directory), beside the
        outputs of that name still there: :meth:`retire` deletes those, after the write.

        Every writer writes its new output while its previous one is still there and deletes
        that one only afterwards, untimed, as ckptmgr must (retention deletes the last good step
        only after the new one has committed). Deleting first would let the write reuse the
        blocks it just freed: on a thin-provisioned disk with online discard (the benchmark
        machine's ext4 is mounted with ``discard``), blocks freed seconds ago are still backed
        and write fast, blocks discarded long ago cost an allocation in the host (1.2 GB
        written and fsynced: 2.3-2.6 s into a file just deleted, 3.3-5.0 s beside it).
        """
        self._serial += 1
        path = self.scratch / f"{self._serial:04d}-{name}"
        self._outputs.setdefault(name, []).append(path)
        return path

    def retire(self, name: str) -> None:
        """Delete every output named ``name`` but the newest."""
        paths = self._outputs.get(name, [])
        for old in paths[:-1]:
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
        del paths[:-1]

    # floors
    def memcpy(self) -> Record:
        targets, sources = list(self.targets.values()), list(self.work.tensors.values())
        reset_peak()
        started = time.perf_counter()
        if self.device == "cuda":
            for target, source in zip(targets, sources, strict=True):
                target.copy_(source, non_blocking=True)
            torch.cuda.synchronize()
        else:
            torch._foreach_copy_(targets, sources)
        return {"blocking": time.perf_counter() - started}

    def raw_write(self) -> Record:
        # a new file beside the last, as every save writes (see fresh()): truncating the old
        # one would be timed too (freeing 1 GiB of cached pages takes about 0.3 s here)
        path = self.fresh("raw.bin")
        started = time.perf_counter()
        with open(path, "wb") as handle:
            for tensor in self.targets.values():
                handle.write(memoryview(tensor.numpy()).cast("B"))
            handle.flush()
            os.fsync(handle.fileno())
        took = time.perf_counter() - started
        self.raw = path  # (what the read floor reads)
        self.retire("raw.bin")
        return {"blocking": took}

    def raw_read(self) -> Record:
        drop_cache(self.raw)
        started = time.perf_counter()
        with open(self.raw, "rb", buffering=0) as handle:
            for tensor in self.restore_targets.values():
                view = memoryview(tensor.numpy()).cast("B") if self.device == "cpu" else None
                if view is None:
                    handle.read(tensor.numel() * tensor.element_size())
                else:
                    handle.readinto(view)
        return {"blocking": time.perf_counter() - started}

    def raw_write_background(self, loop: str) -> Record:
        """The loop's floor: the state's bytes written (one buffer, GIL released) and fsynced
        on a background thread, which costs the loop CPU and memory bandwidth too."""
        if self.blob is None:
            self.blob = torch.empty(self.work.nbytes, dtype=torch.uint8)
            self.blob.fill_(1)
        blob = self.blob

        def write(path: Path) -> None:
            with open(path, "wb", buffering=0) as handle:
                view = memoryview(blob.numpy()).cast("B")
                while view:
                    view = view[handle.write(view) :]
                os.fsync(handle.fileno())

        def start() -> threading.Thread:
            thread = threading.Thread(target=write, args=(self.fresh("raw-background.bin"),))
            thread.start()
            return thread

        return self._async(
            start,
            lambda t: not t.is_alive(),
            lambda t: t.join(),
            loop,
            cleanup=lambda: self.retire("raw-background.bin"),
        )

    # baselines
    def torch_save(self) -> Record:
        path = self.fresh("torch.pt")
        rss = reset_peak()
        started = time.perf_counter()
        with open(path, "wb") as handle:
            torch.save(self.work.tensors, handle)
            handle.flush()
            os.fsync(handle.fileno())
        took = time.perf_counter() - started
        self.retire("torch.pt")
        return {"blocking": took, "commit": took, "extra_mem": peak_rss() - rss}

    def dcp_save(self) -> Record:
        path = self.fresh("dcp")
        rss = reset_peak()
        started = time.perf_counter()
        dcp.save(self.work.tensors, checkpoint_id=path)
        took = time.perf_counter() - started
        record = {"blocking": took, "commit": took, "extra_mem": peak_rss() - rss}
        record.update(self._footprint(path, lambda p: p.suffix == ".distcp"))
        self.retire("dcp")
        return record

    def dcp_load(self) -> Record:
        drop_cache(self.dcp_dir)
        started = time.perf_counter()
        dcp.load(self.restore_targets, checkpoint_id=self.dcp_dir)
        return {"blocking": time.perf_counter() - started}

    def dcp_async(self, loop: str | None = None) -> Record:
        return self._async(
            lambda: dcp.async_save(self.work.tensors, checkpoint_id=self.fresh("dcp-async")),
            lambda future: future.done(),
            lambda future: future.result(),
            loop,
            cleanup=lambda: self.retire("dcp-async"),
            saves=1,  # its write lasts many steps of a loop already
        )

    # ckptmgr
    def ckpt_save(self) -> Record:
        self.step += 1
        rss = reset_peak()
        started = time.perf_counter()
        self.manager.save(self.step, self.work.state)
        took = time.perf_counter() - started
        committed = self.clock.committed_at[self.step] - started
        record = {"blocking": took, "commit": committed, "extra_mem": peak_rss() - rss}
        record.update(self._footprint(self._step_dir(), lambda p: p.suffix == ".distcp"))
        return record

    def ckpt_async(self, loop: str | None = None, process: bool = False) -> Record:
        manager = self._process_manager() if process else self.manager
        held = manager._staging.nbytes  # internal: staging memory kept between saves

        def start() -> int:
            self.step += 1
            manager.save_async(self.step, self.work.state)
            return self.step

        record = self._async(
            start,
            lambda _: writer_idle(manager),  # a loop runs on until retention has deleted too
            lambda _: manager.join(),
            loop,
            committed=lambda step: self.clock.committed_at[step],
        )
        record["extra_mem"] += held
        return record

    def _process_manager(self) -> CheckpointManager:
        if self.process_manager is None:
            self.process_manager = CheckpointManager(
                self.scratch / "ckptmgr-process",
                1,
                max_to_keep=1,
                chkpt_on_preemption=False,
                num_of_threads=self.threads,
                async_mode="process",
            )
            self.process_manager.save_async(0, self.work.state)  # starts the daemon
            self.process_manager.join()
        return self.process_manager

    def ckpt_restore(self) -> Record:
        drop_cache(self.scratch / "ckptmgr")
        state = self.work.state
        if state is self.work.tensors or set(state) == set(self.work.tensors):
            state = self.restore_targets
        started = time.perf_counter()
        self.manager.restore(self.manager.latest_step(), state)
        return {"blocking": time.perf_counter() - started}

    def _step_dir(self) -> Path:
        dirs = [p for p in (self.scratch / "ckptmgr").iterdir() if p.is_dir()]
        return max(dirs, key=lambda p: p.stat().st_mtime)

    def _control(self, loop: str, steps: int, base: float) -> float:
        """Seconds that ``steps`` steps of ``loop`` take now, with nothing running, after
        as many steps (at most 0.1 s of them) that let what the save left running in the kernel
        settle: the control a save's window is compared with."""
        old_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for _ in range(min(steps, max(1, int(0.1 / base)) if base > 0 else steps)):
                self.loops[loop].step()
            started = time.perf_counter()
            for _ in range(steps):
                self.loops[loop].step()
            return time.perf_counter() - started
        finally:
            torch.set_num_threads(old_threads)

    def _footprint(self, path: Path, is_data: Callable[[Path], bool]) -> Record:
        data = du(path, is_data)
        return {"data_bytes": data, "meta_bytes": du(path) - data}

    def _async(
        self,
        start: Callable[[], Any],
        done: Callable[[Any], bool],
        wait: Callable[[Any], Any],
        loop: str | None,
        cleanup: Callable[[], None] = lambda: None,
        saves: int | None = None,
        committed: Callable[[Any], float] | None = None,
    ) -> Record:
        """One async save (``start`` it, ``wait`` for it), or with ``loop`` ``saves`` (default
        ``self.loop_saves``) saves one after the other, the loop running on this thread while
        each is written (steps and windows summed over them: a background write of a small
        state lasts only a few steps of the loop).

        ``commit`` is the time to ``committed(handle)`` (a ``perf_counter`` time) where given,
        else to the end of ``wait``; ``done`` is always the latter."""
        record: Record = {}
        old_threads = torch.get_num_threads()
        base = 0.0
        if loop:  # the loop runs on one intra-op thread, its baseline too
            torch.set_num_threads(1)
            base = self.loops[loop].baseline()
            torch.set_num_threads(old_threads)
        rss = reset_peak()
        if not loop:
            started = time.perf_counter()
            handle = start()
            record["blocking"] = time.perf_counter() - started
            wait(handle)
            record["done"] = time.perf_counter() - started
            record["commit"] = record["done"] if committed is None else committed(handle) - started
        else:
            blocking, steps, window, total, control = 0.0, 0, 0.0, 0.0, 0.0
            saves = saves or self.loop_saves
            for _ in range(saves):
                started = time.perf_counter()
                handle = start()
                blocking += time.perf_counter() - started
                torch.set_num_threads(1)
                try:
                    done_steps, seconds = self.loops[loop].run_until(
                        lambda handle=handle: done(handle), 600
                    )
                finally:
                    torch.set_num_threads(old_threads)
                wait(handle)
                total += time.perf_counter() - started
                steps += done_steps
                window += seconds
                cleanup()
                control += self._control(loop, done_steps, base)
            record["blocking"] = blocking / saves
            record["slowdown"] = window / control if control > 0 else float("inf")
            record["slowdown_vs_baseline"] = (window / steps) / base if steps else float("inf")
            record["lost"] = (total - control) / saves
            record["window"] = total / saves
        record["extra_mem"] = peak_rss() - rss
        if not loop:
            cleanup()
        return record


def run_workload(work: Workload, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    bench = Bench(work, scratch, args.device, args.threads)
    bench.loop_saves = args.loop_saves
    methods: list[tuple[str, Callable[[], Record]]] = [
        ("floor: memcpy", bench.memcpy),
        ("floor: raw write+fsync", bench.raw_write),
        ("floor: raw read (cold)", bench.raw_read),
        ("torch.save", bench.torch_save),
        ("dcp.save", bench.dcp_save),
        ("dcp.async_save", bench.dcp_async),
        ("dcp.load", bench.dcp_load),
        ("ckptmgr save", bench.ckpt_save),
        ("ckptmgr save_async", bench.ckpt_async),
        ("ckptmgr save_async (process)", lambda: bench.ckpt_async(process=True)),
        ("ckptmgr restore", bench.ckpt_restore),
    ]
    for loop in args.loops:
        methods.append(
            (
                f"floor: raw write+fsync in a thread + {loop} loop",
                lambda loop=loop: bench.raw_write_background(loop),
            )
        )
        methods.append((f"dcp.async_save + {loop} loop", lambda loop=loop: bench.dcp_async(loop)))
        methods.append(
            (f"ckptmgr save_async + {loop} loop", lambda loop=loop: bench.ckpt_async(loop))
        )
        methods.append(
            (
                f"ckptmgr save_async (process) + {loop} loop",
                lambda loop=loop: bench.ckpt_async(loop, process=True),
            )
        )
    if args.skip:
        methods = [(n, m) for n, m in methods if n not in args.skip]
    rounds: dict[str, list[Record]] = {name: [] for name, _ in methods}
    # round 0 in a fixed order: the first dcp.async_save and the first ckptmgr save_async both
    # come before any other save of their kind, so they are first calls of the process
    shuffler = random.Random(args.seed)
    for index in range(args.repeats + 1):
        order = methods if index == 0 else shuffler.sample(methods, len(methods))
        for name, method in order:
            record = method()
            rounds[name].append(record)
            print(
                f"  [{work.name}] round {index} {name}: "
                + ", ".join(f"{k}={v:.3f}" for k, v in record.items()),
                flush=True,
            )
    leak: list[int] = []
    if args.leak_saves:
        for _ in range(args.leak_saves):
            bench.ckpt_async()
            leak.append(reset_peak())
    bench.close()
    summary: dict[str, Any] = {
        "workload": work.name,
        "state_bytes": work.nbytes,
        "tensors": len(work.tensors),
        "methods": {},
    }
    for name, records in rounds.items():
        first, later = records[0], records[1:] or records
        keys = sorted({k for r in later for k in r})
        summary["methods"][name] = {
            "first": first,
            "median": {k: statistics.median(r[k] for r in later if k in r) for k in keys},
            "all": records,
        }
    if leak:
        slope = (leak[-1] - leak[len(leak) // 2]) / max(1, len(leak) - 1 - len(leak) // 2)
        summary["leak"] = {"rss_after_each_save": leak, "growth_per_save": slope}
    return summary


def report(summary: dict[str, Any]) -> str:
    """A markdown table of medians and the ratios to the floors for one workload."""
    m = summary["methods"]
    size = summary["state_bytes"]
    get = lambda name, key, which="median": m.get(name, {}).get(which, {}).get(key)  # noqa: E731
    lines = [
        f"\n### {summary['workload']} ({size / 2**20:.0f} MiB, {summary['tensors']} tensors)\n"
    ]
    lines.append(
        "| method | first blocking s | blocking s | commit s | done s | extra mem / state | "
        "slowdown x | lost s | data / tensor bytes |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for name in m:

        def fmt(value: float | None, spec: str = ".3f") -> str:
            return "" if value is None else format(value, spec)

        mem = get(name, "extra_mem")
        data = get(name, "data_bytes")
        lines.append(
            f"| {name} | {fmt(get(name, 'blocking', 'first'))} | {fmt(get(name, 'blocking'))} | "
            f"{fmt(get(name, 'commit'))} | {fmt(get(name, 'done'))} | "
            f"{fmt(None if mem is None else mem / size, '.2f')} | "
            f"{fmt(get(name, 'slowdown'), '.2f')} | {fmt(get(name, 'lost'))} | "
            f"{fmt(None if data is None else data / size, '.2f')} |"
        )
    floor_copy = get("floor: memcpy", "blocking")
    floor_write = get("floor: raw write+fsync", "blocking")
    floor_read = get("floor: raw read (cold)", "blocking")

    def ratio(a: float | None, b: float | None) -> str:
        return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}x"

    lines.append("\n| ratio (same run, medians) | value |\n|---|---|")
    rows = [
        ("save_async blocking / memcpy floor", get("ckptmgr save_async", "blocking"), floor_copy),
        (
            "save_async first blocking / dcp.async_save first blocking",
            get("ckptmgr save_async", "blocking", "first"),
            get("dcp.async_save", "blocking", "first"),
        ),
        (
            "save_async blocking / dcp.async_save blocking",
            get("ckptmgr save_async", "blocking"),
            get("dcp.async_save", "blocking"),
        ),
        ("dcp.async_save blocking / memcpy floor", get("dcp.async_save", "blocking"), floor_copy),
        (
            "save_async to commit / raw write floor",
            get("ckptmgr save_async", "commit"),
            floor_write,
        ),
        (
            "save_async to the end of its background job (retention's deletion too) / raw "
            "write floor",
            get("ckptmgr save_async", "done"),
            floor_write,
        ),
        ("save to commit / raw write floor", get("ckptmgr save", "commit"), floor_write),
        ("dcp.save / raw write floor", get("dcp.save", "commit"), floor_write),
        ("restore / raw read floor", get("ckptmgr restore", "blocking"), floor_read),
        ("restore / dcp.load", get("ckptmgr restore", "blocking"), get("dcp.load", "blocking")),
        ("save_async extra memory / state", get("ckptmgr save_async", "extra_mem"), size),
        ("dcp.async_save extra memory / state", get("dcp.async_save", "extra_mem"), size),
    ]
    for label, a, b in rows:
        lines.append(f"| {label} | {ratio(a, b)} |")
    count = summary["tensors"]
    blocking = get("ckptmgr save_async", "blocking")
    if blocking is not None:
        lines.append(f"| save_async blocking per tensor | {blocking / count * 1e6:.1f} µs |")
    dcp_block = get("dcp.async_save", "blocking")
    if dcp_block is not None:
        lines.append(f"| dcp.async_save blocking per tensor | {dcp_block / count * 1e6:.1f} µs |")
    for loop in ("compute", "python"):
        for label, name in (
            ("save_async (thread)", f"ckptmgr save_async + {loop} loop"),
            ("save_async (process)", f"ckptmgr save_async (process) + {loop} loop"),
            (
                "floor: raw write+fsync in a thread",
                f"floor: raw write+fsync in a thread + {loop} loop",
            ),
            ("dcp.async_save", f"dcp.async_save + {loop} loop"),
        ):
            slowdown, lost = get(name, "slowdown"), get(name, "lost")
            if slowdown is None or lost is None:
                continue
            share = 1 - 1 / slowdown if slowdown > 0 else float("nan")
            lines.append(
                f"| {loop}-bound loop, {label}: steps lost during the "
                f"background write / lost s per save | {share * 100:.0f}% / {lost:.3f} s |"
            )
    if "leak" in summary:
        growth = summary["leak"]["growth_per_save"]
        saves = len(summary["leak"]["rss_after_each_save"])
        lines.append(
            f"| RSS growth per save_async (second half of {saves} saves) / state | "
            f"{growth / size * 100:.2f}% |"
        )
    return "\n".join(lines)


def main() -> None:
    """Run every workload and print markdown tables; write JSON with ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="a,c", help="comma-separated: a, b, c, d")
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--small", type=int, default=20_000)
    parser.add_argument("--layers", type=int, default=1000, help="layers of workload d")
    parser.add_argument(
        "--views", action="store_true", help="workload c's tensors as slices of one buffer"
    )
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds after round 0")
    parser.add_argument("--small-repeats", type=int, default=2, help="rounds for workload c")
    parser.add_argument("--loops", default="compute,python", help="loops run during saves")
    parser.add_argument(
        "--loop-saves", type=int, default=1, help="saves per loop measurement (c: x10)"
    )
    parser.add_argument("--skip", default="", help="comma-separated method names to leave out")
    parser.add_argument("--threads", type=int, default=1, help="num_of_threads for ckptmgr")
    parser.add_argument("--leak-saves", type=int, default=0, help="extra save_async (workload a)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where to write: a new directory in it, removed at the end (default: the temp dir)",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the method order of rounds 1 and later"
    )
    args = parser.parse_args()
    args.loops = [x for x in args.loops.split(",") if x]
    args.skip = [x for x in args.skip.split(",") if x]
    # (a directory of its own, even in --dir: all of it is removed at the end)
    scratch_root = Path(tempfile.mkdtemp(prefix="ckptmgr-bench-", dir=args.dir))
    machine = (
        f"torch {torch.__version__}; {os.cpu_count()} CPUs; {platform.platform()}; "
        f"loadavg at start {os.getloadavg()}"
    )
    results: list[dict[str, Any]] = []

    def write_json() -> None:
        # after each workload too: a run cut short (a time limit) keeps the workloads it finished
        if args.json:
            args.json.write_text(
                json.dumps(
                    {
                        "machine": machine,
                        "args": {k: str(v) for k, v in vars(args).items()},
                        "results": results,
                    },
                    indent=1,
                )
            )

    try:
        for name in args.workloads.split(","):
            scratch = scratch_root / name
            scratch.mkdir(parents=True, exist_ok=True)
            repeats = args.repeats
            if name == "a":
                work = workload_a(args.size_mib, args.tensors, args.device)
            elif name == "b":
                work = workload_b(args.device)
            elif name == "d":
                work = workload_d(args.layers, args.device)
                repeats = args.small_repeats  # (a few MiB: rounds are short)
            loop_saves = args.loop_saves
            if name not in ("a", "b", "d"):
                work = workload_c(args.small, args.device, args.views)
                repeats = args.small_repeats
                loop_saves *= 10  # its background write lasts a few steps of a loop
            run_args = argparse.Namespace(
                **{**vars(args), "repeats": repeats, "loop_saves": loop_saves}
            )
            if name != "a":
                run_args.leak_saves = 0
            results.append(run_workload(work, run_args, scratch))
            write_json()
            shutil.rmtree(scratch, ignore_errors=True)
            del work
    finally:
        shutil.rmtree(scratch_root, ignore_errors=True)
    print(f"\n{machine}; loadavg at end {os.getloadavg()}")
    for summary in results:
        print(report(summary))
    write_json()


if __name__ == "__main__":
    main()
