"""Child process for test_preemption_dataloader.py: training over a DataLoader with 2 workers.

Usage: ``python _dataloader_child.py CHECKPOINT_DIR guard|plain``. ``guard`` passes
``ignore_preemption_signals_in_worker`` as the ``worker_init_fn``; ``plain`` passes nothing.

Prints ``step=<n>`` after each step. When ``reached_preemption`` is True it prints
``preempted step=<n>``, fetches one more batch (the workers must still be alive) and prints
``workers_alive batch=<n>``, then closes the manager and exits 0 *without* shutting the loader's
iterator down, so that interpreter exit has to stop the workers (multiprocessing sends them
SIGTERM then). Exits 4 if no preemption checkpoint was taken within MAX_STEPS.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

from ckptmgr import CheckpointManager
from ckptmgr.preemption import ignore_preemption_signals_in_worker

MAX_STEPS = 2000
ITEM_SECONDS = 0.01  # simulated decoding work per sample, so the main process waits on workers


class SlowSquares(Dataset[torch.Tensor]):
    """Sample i is the vector [i, i*i], produced after a little simulated work."""

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(ITEM_SECONDS)
        return torch.tensor([float(index), float(index * index)])


def main(root: str, mode: str) -> int:
    loader = DataLoader(
        SlowSquares(),
        batch_size=4,
        num_workers=2,
        worker_init_fn=ignore_preemption_signals_in_worker if mode == "guard" else None,
    )
    weights = torch.zeros(2)
    mgr = CheckpointManager(root, save_interval=1000)
    batches = iter(loader)
    for step in range(1, MAX_STEPS + 1):
        batch = next(batches)
        weights += batch.mean(dim=0) * 1e-6
        if mgr.should_save(step):
            mgr.save(step, {"weights": weights, "step": step})
        print(f"step={step}", flush=True)
        if mgr.reached_preemption(step):
            print(f"preempted step={step}", flush=True)
            extra = next(batches)
            print(f"workers_alive batch={int(extra[0, 0])}", flush=True)
            break
    else:
        return 4
    mgr.close()
    # Keep the iterator alive on purpose: exit must stop the workers itself.
    globals()["kept_iterator"] = batches
    return 0


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for stacks on a hang
    sys.exit(main(sys.argv[1], sys.argv[2]))
