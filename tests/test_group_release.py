"""A manager's gloo groups are destroyed at interpreter exit, their threads stopped.

Groups left alive into the interpreter's finalization aborted a process now and then
("terminate called without an active exception": a gloo thread freeing a finished collective's
tensors needed the GIL then). Each child runs a 1-rank gloo job in a fresh interpreter and
counts its threads (``/proc/self/task``) in an atexit hook registered before ckptmgr is
imported, which therefore runs after ckptmgr's own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_python

CHILD = r"""
import atexit, gc, json, os, sys

def threads():
    return len(os.listdir("/proc/self/task"))

root, mode = sys.argv[1], sys.argv[2]
seen = {}

@atexit.register
def after_ckptmgrs_hook():
    seen["at_exit"] = threads()
    if mode in ("open", "process"):
        try:
            manager.save(2, state, force=True)
            seen["late_save"] = None
        except Exception as exc:
            seen["late_save"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(seen), flush=True)

import torch, torch.distributed as dist

dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=0, world_size=1)
torch.ones(1000).add_(1)
before = threads()
users_group = dist.new_group(backend="gloo")  # kept: one group's threads, for scale
seen["per_group"] = threads() - before

from ckptmgr import CheckpointManager

def made_and_saved():
    async_mode = "process" if mode == "process" else "thread"
    made = CheckpointManager(f"{root}/ckpt", 1, async_mode=async_mode)
    assert made.save_async(1, state)
    made.join()
    seen["made"] = threads()
    return made

state = {"w": torch.arange(10.0)}
if mode == "dropped":  # made in a function that returns (a main()): collected before exit
    made_and_saved().close()
    gc.collect()
else:
    manager = made_and_saved()
if mode == "closed":
    manager.close()
    dist.destroy_process_group()  # as a job ends: ckptmgr's groups are destroyed with it
"""


@pytest.mark.parametrize("mode", ["closed", "open", "process", "dropped"])
def test_the_managers_groups_and_their_threads_end_at_interpreter_exit(
    tmp_path: Path, mode: str
) -> None:
    """Closed (and the job's groups destroyed), left open, in thread and process mode, or
    closed and garbage collected before exit (its groups were left alive): at exit the
    manager's two groups' threads are gone, and a save from a later exit hook fails saying why
    (with the group gone, its collectives would have run on the job's own group)."""
    child = run_python(CHILD, str(tmp_path), mode)
    assert child.returncode == 0, child.stderr[-3000:]
    assert "terminate called" not in child.stderr
    seen = json.loads(child.stdout.strip().splitlines()[-1])
    assert seen["per_group"] >= 1, seen
    assert seen["at_exit"] <= seen["made"] - 2 * seen["per_group"], seen
    if mode in ("open", "process"):
        assert seen["late_save"] is not None, seen
        assert seen["late_save"].startswith("CheckpointError: the manager's process groups were")
