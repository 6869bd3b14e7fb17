"""Soak: 100 SIGKILLs at random moments during saves, retention deletes and restores.

Marked ``slow`` (deselect with ``-m 'not slow'``); CI runs it. One zygote interpreter
(``tests/_soak_child.py``) imports torch once and forks a worker per trial, so a trial costs
milliseconds of start-up instead of seconds. Each trial's worker runs one workload:

* ``save``: saves in a loop, sync and async, with a random ``max_to_keep``;
* ``delete``: ``max_to_keep=1``, so every commit is followed by a retention delete;
* ``restore``: mostly restores random committed steps (checking them bit for bit itself), with a
  save now and then.

and dies by a real SIGKILL, either sent by this test at a random time after the worker announced
``armed``, or sent by the worker to itself right before its k-th file system operation (k random;
during ``delete`` only operations inside a retention delete count), which lands exactly inside a
commit, a rename, a directory removal, ...

After every kill, the checks of ``tests/test_crash_safety.py`` (``verify_after_crash``) run: only
attempted steps are listed, every listed step restores bit-exact (zero corrupt restores), every
step whose save the worker saw succeed is still listed unless retention may have deleted it
(zero lost committed steps), fresh leftovers are left alone, a manager with
``leftover_grace_s=0`` removes them all, and the interrupted step saves again. A worker that
found a corrupt restore itself reports ``CORRUPT`` and fails the trial.

Trials are seeded by their index (printed), so a failing self-kill trial reproduces exactly.
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
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from test_crash_safety import parse_report, verify_after_crash

ZYGOTE_SCRIPT = REPO / "tests" / "_soak_child.py"
N_TRIALS = 100
READY_TIMEOUT_S = 120.0  # importing torch on a busy 2-core machine
ARMED_TIMEOUT_S = 60.0
REAP_TIMEOUT_S = 60.0
WATCHDOG_S = 120  # a worker kills itself (SIGALRM) if nothing else does
TRIAL_TIMEOUT_S = 180
PHASES = ("save", "delete", "restore")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


class Zygote:
    """The forking child interpreter; its stdout lines are pumped into a queue by a thread."""

    def __init__(self, log_dir: Path) -> None:
        self.stderr_path = log_dir / "zygote.stderr"
        self._queue: queue.Queue[str | None] = queue.Queue()
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
        with open(self.stderr_path, "wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, str(ZYGOTE_SCRIPT)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=env,
                cwd=str(log_dir),
            )
        self._reader = threading.Thread(target=self._pump, name="zygote-stdout", daemon=True)
        self._reader.start()
        self.wait_for(lambda line: line == "ready", READY_TIMEOUT_S, "'ready'", [])

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            self._queue.put(raw.decode(errors="replace").rstrip("\n"))
        self._queue.put(None)

    def stderr_text(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def wait_for(
        self, predicate: Callable[[str], bool], timeout: float, what: str, lines: list[str]
    ) -> str:
        """Append lines to ``lines`` until one satisfies ``predicate``; fail after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no {what} within {timeout:.0f}s; stderr:\n{self.stderr_text()}")
            if line is None:
                pytest.fail(f"the zygote exited before {what}; stderr:\n{self.stderr_text()}")
            lines.append(line)
            if line.startswith(("ERROR ", "CORRUPT ")):
                pytest.fail(f"worker reported: {line}; stderr:\n{self.stderr_text()}")
            if predicate(line):
                return line

    def record_for(self, seconds: float, lines: list[str]) -> bool:
        """Append lines for ``seconds`` (the random time before the kill); False if reaped."""
        deadline = time.monotonic() + seconds
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True
            try:
                line = self._queue.get(timeout=remaining)
            except queue.Empty:
                return True
            if line is None:
                return False
            lines.append(line)
            if line.startswith(("reaped ", "ERROR ", "CORRUPT ")):
                return False

    def start_trial(self, config: dict[str, Any]) -> int:
        """Send a configuration; returns the pid of the worker forked for it."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(config) + "\n").encode())
        self.proc.stdin.flush()
        forked = self.wait_for(lambda line: line.startswith("forked "), 30, "'forked'", [])
        return int(forked.split()[1])

    def close(self) -> None:
        for stream in (self.proc.stdin,):
            if stream is not None:
                stream.close()  # the zygote exits at EOF
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    forker = Zygote(tmp_path_factory.mktemp("soak-zygote"))
    try:
        yield forker
    finally:
        forker.close()


SUMMARY: Counter[str] = Counter()


def soak_config(index: int, root: Path) -> tuple[dict[str, Any], float]:
    """The worker's configuration and the kill delay (external kills) of trial ``index``."""
    seed = 104_729 * (index + 1)
    rng = random.Random(seed)
    phase = PHASES[index % len(PHASES)]
    self_kill = phase != "restore" and (index // len(PHASES)) % 2 == 1
    spec = {
        "f32": 64 * rng.randrange(256, 4096),  # 64 KiB .. 1 MiB
        "bf16": rng.randrange(1, 50_000),
        "i64": rng.randrange(1, 20_000),
        "bool": rng.randrange(1, 10_000),
        "opt": rng.randrange(1, 5_000),
    }
    if self_kill:
        # A save does ~10 counted operations (fsyncs, mkdir, renames); a local delete ~7
        # (rename, fsync, an unlink per file, rmdir).
        after_ops = rng.randrange(0, 8) if phase == "delete" else rng.randrange(0, 24)
        kill: dict[str, Any] = {"mode": "self", "after_ops": after_ops}
    else:
        kill = {"mode": "external"}
    config = {
        "phase": phase,
        "kill": kill,
        "root": str(root),
        "seed": seed,
        "spec": spec,
        "max_to_keep": 1 if phase == "delete" else rng.choice([0, 2, 3]),
        "max_pending_async": rng.choice([1, 2]),
        "join_probability": rng.choice([0.0, 0.3]),
        "max_steps": 100_000,
        "watchdog_s": WATCHDOG_S,
    }
    delay = rng.uniform(0.0, 0.05) if rng.random() < 0.3 else rng.uniform(0.05, 0.6)
    return config, delay


@pytest.mark.timeout(TRIAL_TIMEOUT_S)
@pytest.mark.parametrize("index", range(N_TRIALS), ids=[f"soak-{i}" for i in range(N_TRIALS)])
def test_soak_sigkill(index: int, zygote: Zygote, tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    config, delay = soak_config(index, root)
    print(f"trial {index}: seed={config['seed']} delay={delay:.3f}s config={config}")
    lines: list[str] = []
    pid = zygote.start_trial(config)
    zygote.wait_for(lambda line: line == "armed", ARMED_TIMEOUT_S, "'armed'", lines)
    if config["kill"]["mode"] == "external":
        alive = zygote.record_for(delay, lines)
        assert alive, f"the worker died before the kill: {lines[-3:]}"
        os.kill(pid, signal.SIGKILL)
    reaped = zygote.wait_for(
        lambda line: line.startswith(f"reaped {pid} "), REAP_TIMEOUT_S, "'reaped'", lines
    )
    assert reaped == f"reaped {pid} {int(signal.SIGKILL)}", f"not killed by SIGKILL: {reaped}"
    assert "done" not in lines, "the worker finished its loop before the kill: raise max_steps"

    report = parse_report(lines)
    restored = sum(1 for line in lines if line.startswith("restored "))
    listed, leftovers = verify_after_crash(root, config["spec"], report, config["max_to_keep"])
    SUMMARY[f"{config['phase']}/{config['kill']['mode']}"] += 1
    SUMMARY["restores checked by workers"] += restored
    SUMMARY["trials with leftovers"] += bool(leftovers)
    before_kill = lines[-2] if len(lines) >= 2 else ""
    SUMMARY["killed inside a restore"] += before_kill.startswith("restoring ")
    print(
        f"attempted up to {max(report.attempted)}, confirmed {sorted(report.confirmed)[-3:]}, "
        f"listed {listed}, leftovers {leftovers}, worker restores {restored}; "
        f"so far {dict(SUMMARY)}"
    )
