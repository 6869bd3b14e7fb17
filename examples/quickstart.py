"""Quick start: a training run is killed with SIGKILL and resumes exactly where it left off.

Run it with ``make demo`` (or ``python examples/quickstart.py [--dir DIR]``). It shows the whole
ckptmgr workflow on a small but real training loop, in under a minute on two CPU cores:

1. A child process trains a three-layer MLP (with dropout) on synthetic data with AdamW and a
   cosine learning-rate schedule. Every ``SAVE_INTERVAL`` steps it checkpoints with
   ``save_async`` into ``./checkpoints``, keeping the newest three, and it reports its loss and
   the committed steps after every step.
2. Once two checkpoints are committed and it has trained a few steps past the newest one, this
   script kills it with a real SIGKILL: no signal handler, no cleanup, no final save.
3. A second child process runs the very same ``train`` function on the same directory. It finds
   the committed steps, primes the optimizer (``prime_optimizer``) and restores the model,
   optimizer, scheduler, data position, step counter and random number generators from the
   newest step (``restore``), then trains to the end.
4. Every batch is a pure function of the data position, so the resumed run must reproduce the
   killed run's loss bit for bit at every step both of them ran. The table printed at the end
   is that proof; the script exits with status 1 if any loss differs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckptmgr import CheckpointManager, RNGState, StateDict, prime_optimizer

TOTAL_STEPS = 300
SAVE_INTERVAL = 10
BATCH, FEATURES, HIDDEN = 128, 32, 128
CHILD_TIMEOUT_S = 50.0  # a hard bound on each child process; a run takes a few seconds

Event = dict[str, Any]


# -- the training job: identical for the first run and for the resumed one --------------------
class SyntheticBatches:
    """An endless, reproducible data stream: batch ``i`` depends only on ``i``.

    It has ``state_dict``/``load_state_dict``, so its position is checkpointed like the sampler
    state of a real data loader.
    """

    def __init__(self) -> None:
        self.position = 0
        teacher_seed = torch.Generator().manual_seed(0)
        self.teacher = torch.randn(FEATURES, 1, generator=teacher_seed) / FEATURES**0.5

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs and targets at the current position; then advance."""
        generator = torch.Generator().manual_seed(1_000 + self.position)
        self.position += 1
        x = torch.randn(BATCH, FEATURES, generator=generator)
        noise = torch.randn(BATCH, 1, generator=generator)
        return x, torch.sin(x @ self.teacher) + 0.05 * noise

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def emit(**event: Any) -> None:
    """Report one event to the parent process as a JSON line."""
    print(json.dumps(event), flush=True)


def train(directory: str) -> None:
    """Train to ``TOTAL_STEPS``, resuming from the newest checkpoint in ``directory`` if any."""
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the same arithmetic in every run, and a core left for the saves
    model = nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.GELU(),
        nn.Dropout(0.1),  # consumes random numbers: the RNG state must be restored too
        nn.Linear(HIDDEN, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, 1),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=TOTAL_STEPS)
    data = SyntheticBatches()
    progress = StateDict(step=0)
    state = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "data": data,
        "progress": progress,
        "rng": RNGState(),
    }

    with CheckpointManager(directory, save_interval=SAVE_INTERVAL, max_to_keep=3) as mgr:
        found = mgr.all_steps()  # committed steps only: a save cut short is never listed
        resumed_from = mgr.latest_step()
        if resumed_from is not None:
            prime_optimizer(optimizer)  # AdamW builds its state lazily; restore fills it in place
            mgr.restore(resumed_from, state)
        emit(event="start", found=found, resumed_from=resumed_from)

        while progress.step < TOTAL_STEPS:
            x, y = data.next_batch()
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            progress.step += 1
            # Saves only at multiples of SAVE_INTERVAL. It returns once the state is copied, so
            # training goes on while the checkpoint is written in the background.
            mgr.save_async(progress.step, state)
            emit(event="step", step=progress.step, loss=loss.item(), committed=mgr.all_steps())
    # Leaving the `with` block joins the last save and raises if any background save failed.


# -- the parent: start, kill, restart, compare ---------------------------------------------------
def run_child(directory: str, kill_when: Callable[[Event], bool] | None = None) -> list[Event]:
    """Run ``train`` in a child process and collect its events.

    If ``kill_when(event)`` becomes true, the child is killed with SIGKILL right there.
    """
    command = [sys.executable, str(Path(__file__).resolve()), "--train", "--dir", directory]
    events: list[Event] = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as child:
        watchdog = threading.Timer(CHILD_TIMEOUT_S, child.kill)  # bounds every wait below
        watchdog.start()
        try:
            assert child.stdout is not None
            for line in child.stdout:
                events.append(json.loads(line))
                if kill_when is not None and kill_when(events[-1]):
                    child.kill()  # a real SIGKILL: the child cannot react to it
                    break
            returncode = child.wait()
        finally:
            watchdog.cancel()
    expected = -signal.SIGKILL if kill_when is not None else 0
    killed_as_planned = kill_when is None or (bool(events) and kill_when(events[-1]))
    if returncode != expected or not killed_as_planned:
        raise SystemExit(f"FAILED: training child exited with {returncode} after {events[-1:]}")
    return events


def ready_to_kill(event: Event) -> bool:
    """Two checkpoints committed and at least five steps trained past the newest one."""
    committed: list[int] = event.get("committed", [])
    return len(committed) >= 2 and event["step"] >= committed[-1] + 5


def losses(events: list[Event]) -> dict[int, float]:
    """The loss a run reported at each step."""
    return {e["step"]: e["loss"] for e in events if e["event"] == "step"}


def main() -> int:
    parser = argparse.ArgumentParser(description="ckptmgr quick start: kill and resume")
    parser.add_argument("--dir", default="checkpoints", help="checkpoint directory (recreated)")
    parser.add_argument("--train", action="store_true", help="internal: run the training job")
    args = parser.parse_args()
    if args.train:
        train(args.dir)
        return 0

    sys.stdout.reconfigure(line_buffering=True)  # keep our lines in order with the children's
    shutil.rmtree(args.dir, ignore_errors=True)
    print(f"checkpoint directory: {Path(args.dir).resolve()} (emptied)")

    print("\n== run 1: training from scratch in a child process")
    first = run_child(args.dir, kill_when=ready_to_kill)
    before = losses(first)
    killed_at = max(before)
    curve = ", ".join(f"{step}: {before[step]:.4f}" for step in (1, 10, 20, killed_at))
    print(f"loss by step: {curve}")
    print(f"committed steps reported by the child: {first[-1]['committed']}")
    print(f"SIGKILL at step {killed_at}: the child died without any cleanup")
    on_disk = sorted(p.name for p in Path(args.dir).iterdir())
    print(f"on disk after the kill: {on_disk}")

    print("\n== run 2: the same job restarted on the same directory")
    second = run_child(args.dir)
    start = second[0]
    resumed_from: int | None = start["resumed_from"]
    print(f"found committed steps: {start['found']}")
    print(f"resumed from step {resumed_from}")
    after = losses(second)

    print("\nthe loss curve continues where it left off (compared exactly, not rounded):")
    print(f"{'step':>6}  {'loss before kill':>20}  {'loss after resume':>20}  match")
    overlap = [step for step in sorted(after) if step in before]
    for step in overlap:
        match = "yes" if after[step] == before[step] else "NO"
        print(f"{step:>6}  {before[step]:>20.12f}  {after[step]:>20.12f}  {match}")
    final = max(after)
    print(f"\nloss at step 1: {before[1]:.6f}; final loss at step {final}: {after[final]:.6f}")

    exact = bool(overlap) and all(after[step] == before[step] for step in overlap)
    if resumed_from is None or not exact or after[final] >= before[1]:
        print("FAILED: the resumed run does not continue the killed run exactly")
        return 1
    print(f"OK: {len(overlap)} steps after the resume match the killed run bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
