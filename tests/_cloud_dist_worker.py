"""Worker of tests/test_cloud_dist.py: one rank of a real 2-rank ``torchrun`` job on gs:// or s3://.

Run as ``torchrun --nproc-per-node 2 _cloud_dist_worker.py OUT_DIR ROOT OPTIONS_JSON`` from the
tests directory, with the repository root on ``PYTHONPATH``. Each rank saves steps 1 (``save``),
2 (``save_async``) and 3 (``save`` after ``save_async`` of 2 without a join) with
``max_to_keep=2``, restores the kept steps into blank state, and then a second manager (what a
restarted job does) lists them again. Each rank writes what it saw to
``OUT_DIR/rank<R>.json``; the test makes the assertions. ``faulthandler`` ends a rank that is
still running after ``WATCHDOG_S`` seconds.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _cloud_state import blank_like, differences, make_state

from ckptmgr import CheckpointManager, PerRank

COLLECTIVE_TIMEOUT_S = 60.0
WATCHDOG_S = 150.0
STEPS = (1, 2, 3)
KEPT = [2, 3]


def rank_state(step: int, rank: int) -> dict[str, Any]:
    """The replicated state of ``step`` plus a per-rank tensor and a per-rank plain value."""
    state = make_state(step)
    state["local"] = PerRank(torch.arange(16, dtype=torch.int64) + 1000 * rank + step)
    state["who"] = {"rank": rank}
    return state


def blank_rank_state(step: int) -> dict[str, Any]:
    state = blank_like(make_state(step))
    state["local"] = PerRank(torch.full((16,), -1, dtype=torch.int64))
    state["who"] = {"rank": -1}
    return state


def compare(actual: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    found = differences(actual, expected)
    if not torch.equal(actual["local"].value, expected["local"].value):
        found.append("local: per-rank tensor differs")
    if actual["who"] != expected["who"]:
        found.append(f"who: {actual['who']} != {expected['who']}")
    return found


def run(rank: int, root: str, options: dict[str, Any]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    with CheckpointManager(
        root,
        1,
        max_to_keep=2,
        chkpt_on_preemption=False,
        storage_options=options,
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
    ) as manager:
        seen["initial"] = manager.all_steps()
        assert manager.save(1, rank_state(1, rank))
        assert manager.save_async(2, rank_state(2, rank))
        assert manager.save(3, rank_state(3, rank))
        manager.join()
        seen["after_saves"] = manager.all_steps()
        seen["restored"] = {}
        for step in manager.all_steps():
            state = blank_rank_state(step)
            manager.restore(step, state)
            seen["restored"][step] = compare(state, rank_state(step, rank))
    with CheckpointManager(
        root,
        1,
        chkpt_on_preemption=False,
        storage_options=options,
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
    ) as manager:
        seen["reopened"] = manager.all_steps()
        state = blank_rank_state(3)
        manager.restore(3, state)
        seen["reopened_restore"] = compare(state, rank_state(3, rank))
    return seen


def main(argv: list[str]) -> int:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    out_dir, root, options = argv[0], argv[1], json.loads(argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    rank = dist.get_rank()
    record: dict[str, Any] = {"rank": rank, "world_size": dist.get_world_size()}
    try:
        record.update(run(rank, root, options))
    except Exception:
        record["crash"] = traceback.format_exc()
    target = Path(out_dir) / f"rank{rank}.json"
    target.with_suffix(".tmp").write_text(json.dumps(record, indent=1, default=repr))
    target.with_suffix(".tmp").rename(target)
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    finally:
        gc.freeze()  # (the interpreter's last collection skipped: about 0.7 s with torch loaded)
