"""Crash safety: a child process that saves in a loop is SIGKILLed at random moments.

Each trial starts a real Python interpreter (``tests/_crash_child.py``) that saves steps 0, 1,
2, ... with ``save`` and ``save_async`` (and, with ``max_to_keep``, retention deletes), waits
until the child reports its first committed step, lets it run for a random extra time (that
delay *is* the kill moment, it synchronises nothing) and kills it with SIGKILL. Then, in this
process:

1. a new manager with the default ``leftover_grace_s`` lists only steps the child attempted, every
   listed step restores bit-exact, no unlisted step is restorable, every step whose ``save``
   (or ``join``) returned is listed unless retention may have deleted it, and fresh leftovers are
   left alone;
2. a manager with ``leftover_grace_s=0`` removes every leftover: the root then holds only
   committed ``step_*`` directories, exactly the listed steps, which still restore bit-exact;
   and it can save the step the kill interrupted again.

Trials are seeded by their index (the seed is printed), so a failure reproduces with the same
parameters; the kill moment itself depends on timing. Starting an interpreter with torch costs
seconds, so the children of the next trials are started (and import torch) while a trial runs.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _crash_child as child_state
import pytest
import torch
from conftest import REPO

from ckptmgr import CheckpointManager, StepNotFoundError

CHILD_SCRIPT = REPO / "tests" / "_crash_child.py"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
N_TRIALS = 20
READY_TIMEOUT_S = 90.0  # importing torch on a busy 2-core machine
FIRST_COMMIT_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 15.0
WATCHDOG_S = 120  # the child kills itself (SIGALRM) if the test never does
TRIAL_TIMEOUT_S = 180  # pytest-timeout per trial, above the sum of the waits of one trial
SPARES = 2  # children importing torch while a trial runs


class ChildProcess:
    """One child interpreter; its stdout lines are pumped into a queue by a reader thread."""

    def __init__(self, log_dir: Path, name: str) -> None:
        self.stderr_path = log_dir / f"{name}.stderr"
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._eof = False
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
        with open(self.stderr_path, "wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, str(CHILD_SCRIPT)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=env,
                cwd=str(log_dir),
            )
        self._reader = threading.Thread(target=self._pump, name=f"{name}-stdout", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            self._queue.put(raw.decode().rstrip("\n"))
        self._queue.put(None)

    def stderr_text(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def _next_line(self, deadline: float) -> str | None:
        """The next line before ``deadline`` (monotonic); None at EOF; raises queue.Empty."""
        if self._eof:
            return None
        line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
        if line is None:
            self._eof = True
        else:
            self.lines.append(line)
        return line

    def wait_for(self, predicate: Callable[[str], bool], timeout: float, what: str) -> str:
        """Consume lines until one satisfies ``predicate``; fail after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._next_line(deadline)
            except queue.Empty:
                pytest.fail(f"no {what} within {timeout:.0f}s; stderr:\n{self.stderr_text()}")
            if line is None:
                pytest.fail(
                    f"child exited (rc={self.proc.wait(EXIT_TIMEOUT_S)}) before {what}; "
                    f"stderr:\n{self.stderr_text()}"
                )
            if predicate(line):
                return line

    def consume_for(self, seconds: float) -> None:
        """Keep recording lines for ``seconds``: the random time the child runs before the kill."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if self._next_line(deadline) is None:
                    return
            except queue.Empty:
                return

    def start(self, config: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(config) + "\n").encode())
        self.proc.stdin.flush()

    def kill_and_collect(self) -> None:
        """SIGKILL the child (it must still be running), reap it and read what it printed."""
        alive = self.proc.poll() is None
        self.proc.kill()
        returncode = self.proc.wait(timeout=EXIT_TIMEOUT_S)
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while not self._eof:  # lines written before the kill are still in the pipe
            try:
                self._next_line(deadline)
            except queue.Empty:
                pytest.fail("the child's stdout did not reach EOF after the child was killed")
        self._reader.join(timeout=EXIT_TIMEOUT_S)
        assert alive and returncode == -signal.SIGKILL, (
            f"the child was not running when it was killed (rc={returncode}); "
            f"stderr:\n{self.stderr_text()}"
        )
        if "done" in self.lines:
            pytest.fail("the child finished its whole loop before the kill: raise max_steps")

    def discard(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=EXIT_TIMEOUT_S)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@dataclass
class ChildPool:
    """Hands out children that have finished importing, keeping up to SPARES warming up."""

    log_dir: Path
    _spares: list[ChildProcess] = field(default_factory=list)
    _all: list[ChildProcess] = field(default_factory=list)

    def _spawn(self) -> ChildProcess:
        child = ChildProcess(self.log_dir, f"child-{len(self._all) + 1}")
        self._all.append(child)
        return child

    def take(self, upcoming: int) -> ChildProcess:
        """A ready child; ``upcoming`` is how many more this module will ask for soon."""
        child = self._spares.pop(0) if self._spares else self._spawn()
        while len(self._spares) < min(SPARES, upcoming):
            self._spares.append(self._spawn())
        child.wait_for(lambda line: line == "ready", READY_TIMEOUT_S, "'ready' from the child")
        return child

    def close(self) -> None:
        for child in self._all:
            child.discard()


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChildPool]:
    children = ChildPool(tmp_path_factory.mktemp("crash-children"))
    try:
        yield children
    finally:
        children.close()


@dataclass
class ChildReport:
    """What the child said about its steps before it died."""

    attempted: set[int]
    confirmed: set[int]  # a save() returned True, or a join() returned after the async save


def parse_report(lines: list[str]) -> ChildReport:
    attempted: set[int] = set()
    confirmed: set[int] = set()
    for line in lines:
        words = line.split()
        if words[0] == "attempt":
            attempted.add(int(words[1]))
        elif words[0] == "saved" and words[2] == "True":
            confirmed.add(int(words[1]))
        elif words[0] == "joined":
            confirmed.update(s for s in attempted if s <= int(words[1]))
    assert confirmed <= attempted
    return ChildReport(attempted, confirmed)


def entries(root: Path) -> list[str]:
    """The names under ``root``, sorted, without the owner lease record (``owner.json``)."""
    return sorted(name for name in os.listdir(root) if name != "owner.json")


def committed_on_disk(root: Path) -> list[int]:
    """Steps whose step_<N>/commit.json exists, read from the directory itself."""
    steps = []
    for entry in root.iterdir():
        if entry.name.startswith("step_") and (entry / "commit.json").is_file():
            steps.append(int(entry.name.removeprefix("step_")))
    return sorted(steps)


def check_restores(
    manager: CheckpointManager, steps: list[int], spec: dict[str, int], unlisted: set[int]
) -> None:
    for step in steps:
        restored = child_state.blank_state(spec)
        manager.restore(step, restored)
        child_state.assert_bit_exact(restored, child_state.expected_state(step, spec), f"{step}")
    for step in sorted(unlisted):
        with pytest.raises(StepNotFoundError):
            manager.restore(step, child_state.blank_state(spec))


def verify_after_crash(
    root: Path, spec: dict[str, int], report: ChildReport, max_to_keep: int
) -> tuple[list[int], list[str]]:
    """The checks 1-2 of the module docstring; returns (listed steps, leftovers found)."""
    assert report.confirmed, "the child never confirmed a commit"
    before = entries(root)
    leftovers = [
        n for n in before if not (n.startswith("step_") and (root / n / "commit.json").exists())
    ]

    with CheckpointManager(root, save_interval=1, chkpt_on_preemption=False) as manager:
        listed = manager.all_steps()
        assert listed == committed_on_disk(root)
        assert set(listed) <= report.attempted, f"listed {listed} but attempted {report.attempted}"
        check_restores(manager, listed, spec, report.attempted - set(listed))
    # Fresh leftovers are younger than the default grace: a live writer could own them.
    assert entries(root) == before

    for step in report.confirmed:
        newer = [s for s in listed if s > step]
        assert step in listed or (max_to_keep > 0 and len(newer) >= max_to_keep), (
            f"step {step} was confirmed committed but is not listed (listed {listed}, "
            f"max_to_keep={max_to_keep})"
        )
    if max_to_keep > 0:  # a kill between a commit and its retention delete leaves one extra
        assert len(listed) <= max_to_keep + 1, f"listed {listed} with max_to_keep={max_to_keep}"

    with CheckpointManager(
        root, save_interval=1, chkpt_on_preemption=False, leftover_grace_s=0
    ) as manager:
        assert manager.all_steps() == listed
        after = entries(root)
        assert after == [f"step_{s:012d}" for s in listed], f"leftovers remain: {after}"
        assert all((root / name / "commit.json").is_file() for name in after)
        check_restores(manager, listed[-1:], spec, set())
        # Training resumes: the step the kill interrupted (or the next one) can be saved again.
        last = max(report.attempted)
        again = last if last not in listed else last + 1
        assert manager.save(again, child_state.expected_state(again, spec))
        assert manager.all_steps() == sorted([*listed, again])
        check_restores(manager, [again], spec, set())
    return listed, leftovers


def trial_config(index: int, root: Path) -> tuple[dict[str, Any], float]:
    """The child's configuration and the kill delay of trial ``index`` (seeded by the index)."""
    seed = 7919 * (index + 1)
    rng = random.Random(seed)
    spec = {
        "f32": 64 * rng.randrange(1024, 16384),  # 256 KiB .. 4 MiB
        "bf16": rng.randrange(1, 200_000),
        "i64": rng.randrange(1, 100_000),
        "bool": rng.randrange(1, 50_000),
        "opt": rng.randrange(1, 20_000),
    }
    config = {
        "mode": "loop",
        "root": str(root),
        "seed": seed,
        "spec": spec,
        "max_to_keep": rng.choice([0, 1, 2, 3]),
        "max_pending_async": rng.choice([1, 2]),
        "pattern": rng.choice(["alternate", "random"]),
        "join_probability": rng.choice([0.0, 0.3]),
        "max_steps": 100_000,
        "watchdog_s": WATCHDOG_S,
    }
    # Often right after the first commit (inside the next save), otherwise up to ~1.5 s later.
    delay = rng.uniform(0.0, 0.1) if rng.random() < 0.3 else rng.uniform(0.1, 1.5)
    return config, delay


@pytest.mark.timeout(TRIAL_TIMEOUT_S)
@pytest.mark.parametrize("index", range(N_TRIALS), ids=[f"trial-{i}" for i in range(N_TRIALS)])
def test_sigkill_during_save_loop(index: int, pool: ChildPool, tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    config, delay = trial_config(index, root)
    print(f"trial {index}: seed={config['seed']} delay={delay:.3f}s config={config}")
    child = pool.take(upcoming=N_TRIALS - index)  # the last one is for the large write
    child.start(config)
    child.wait_for(lambda line: line == "saved 0 True", FIRST_COMMIT_TIMEOUT_S, "first commit")
    child.consume_for(delay)
    child.kill_and_collect()

    report = parse_report(child.lines)
    listed, leftovers = verify_after_crash(root, config["spec"], report, config["max_to_keep"])
    print(
        f"attempted up to {max(report.attempted)}, confirmed {sorted(report.confirmed)[-3:]}, "
        f"listed {listed}, leftovers {leftovers}"
    )


@pytest.mark.timeout(2 * TRIAL_TIMEOUT_S)
def test_sigkill_inside_a_large_write(pool: ChildPool, tmp_path: Path) -> None:
    """Kill the child while it writes a large step: a .tmp leftover is never listed, then removed.

    The child's write of step 1 stops after the first piece of its data file and says so
    (``pause_in_write``), so the kill lands inside the write every time.
    """
    spec = dict(child_state.SMALL_SPEC, f32=64 * 262144)  # 64 MiB of float32
    root = tmp_path / "ckpts"
    child = pool.take(upcoming=0)
    child.start(
        {
            "mode": "big",
            "root": str(root),
            "seed": 0,
            "spec": spec,
            "max_to_keep": 0,
            "max_pending_async": 1,
            "watchdog_s": WATCHDOG_S,
            "pause_in_write": True,
        }
    )
    child.wait_for(lambda line: line == "saved 0 True", 60, "the commit of step 0")
    child.wait_for(lambda line: line == "inside write 1", 60, "the write of step 1")
    child.kill_and_collect()

    report = parse_report(child.lines)
    tmp = [n for n in os.listdir(root) if n.startswith(".tmp-step_000000000001-")]
    assert tmp, f"no write directory of step 1 was left: {sorted(os.listdir(root))}"
    data_files = [n for n in os.listdir(root / tmp[0]) if n.endswith(".distcp")]
    assert data_files, f"the write of step 1 had not begun its data: {os.listdir(root / tmp[0])}"
    listed, leftovers = verify_after_crash(root, spec, report, max_to_keep=0)  # (removes them)
    assert listed == [0], f"step 1 is listed although its write was interrupted: {tmp}"
    assert tmp[0] in leftovers, leftovers


def test_every_file_of_a_step_is_fsynced_with_all_its_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each file of a step is on disk in full when it is fsynced, so that a power loss after the
    commit cannot leave it short. DCP fsyncs .metadata through ckptmgr's checksumming stream
    without a flush: the fsync covered 0 of its bytes, which were still in Python's buffer."""
    sizes_at_fsync: dict[str, int] = {}
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        sizes_at_fsync[name] = os.fstat(fd).st_size
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, {"w": torch.ones(100_000), "step": 1})
    monkeypatch.undo()
    step_dir = tmp_path / "step_000000000001"
    files = {path.name: path.stat().st_size for path in step_dir.iterdir()}
    assert sizes_at_fsync[".metadata.tmp"] == files[".metadata"] > 0
    for name in ("__0_0.distcp", "objects-rank00000.json", "commit.json"):
        assert sizes_at_fsync[name] == files[name], name
