"""ckptmgr.write_items: a DTensor's write items kept between the saves of a manager.

Runs in fresh interpreters with a 1-rank gloo group (DTensors need a device mesh); each child
prints what it observed as JSON and the test asserts it. Saves through changes of shape, dtype,
names and ``requires_grad`` restore bit for bit and write the ``.metadata`` of items made from
scratch (and pickled whole by DCP's own ``finish``, where ckptmgr pickles only what changed:
ckptmgr.metadata_file); DCP's item making runs only for DTensors that are new or changed; a
torch whose planner does not use the kept items as expected plans from scratch. The 2-rank case
(resharding, a failure on one rank) is the ``plans`` scenario of test_distributed.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import checked_torch_only, run_python

COMMON = r"""
import json, pickle, sys
import torch, torch.distributed as dist
import torch.distributed.checkpoint.default_planner as default_planner
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ckptmgr import CheckpointError, CheckpointManager

root = sys.argv[1]
dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
made = {"count": 0}
make_items = DTensor.__create_write_items__

def counted(self, fqn, obj):
    made["count"] += 1
    return make_items(self, fqn, obj)

DTensor.__create_write_items__ = counted

def state_at(step, kind):
    generator = torch.Generator().manual_seed(step)
    rows = 8 if kind == "reshaped" else 6
    state = {
        "a": distribute_tensor(torch.randn(rows, 5, generator=generator), mesh, [Shard(0)]),
        "p": nn.Parameter(distribute_tensor(torch.randn(9, generator=generator), mesh, [Shard(0)])),
        "plain": torch.arange(4.0) + step,
        "big": torch.randn(300_000, generator=generator),
    }
    if kind != "dropped":
        dtype = torch.float64 if kind == "reshaped" else torch.float32
        state["b"] = distribute_tensor(
            torch.randn(7, generator=generator).to(dtype), mesh, [Replicate()]
        )
    else:
        state["c"] = distribute_tensor(torch.randn(3, 3, generator=generator), mesh, [Shard(1)])
    return state

def full(value):
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach()

def blank(state):
    out = {}
    for key, value in state.items():
        if isinstance(value, DTensor):
            zeros = torch.zeros(value.shape, dtype=value.dtype)
            out[key] = distribute_tensor(zeros, mesh, value.placements)
        else:
            out[key] = torch.zeros_like(value)
    return out

def round_trip(manager, step, state):
    fresh = blank(state)
    manager.restore(step, fresh)
    return all(
        full(fresh[key]).dtype == full(value).dtype and torch.equal(full(fresh[key]), full(value))
        for key, value in state.items()
    )

def metadata_of(where, step):
    with open(f"{root}/{where}/step_{step:012d}/.metadata", "rb") as handle:
        return pickle.load(handle)
"""

SEQUENCE = (
    COMMON
    + r"""
SEQUENCE = [(1, "base", "save"), (2, "base", "save"), (3, "reshaped", "async"),
            (4, "reshaped", "async"), (5, "dropped", "save"), (6, "base", "async"),
            (7, "base", "async")]
seen = {"made": [], "restored": [], "same_metadata": [], "reused": []}
metadata = {}
from ckptmgr import dcp_io, save_plans
ckptmgrs_metadata_file = dcp_io._RawTensorWriter._writes_one_metadata_file
ckptmgrs_flat = save_plans._flat
seen["flat"] = []

def noted_flat(state_dict):
    seen["flat"].append(ckptmgrs_flat(state_dict))
    return seen["flat"][-1]

for WHERE, keep in (("kept", True), ("scratch", False)):
    manager = CheckpointManager(f"{root}/{WHERE}", 1, max_to_keep=20, chkpt_on_preemption=False)
    # from scratch: DCP makes every item, flattens the state with its own passes, and its own
    # finish pickles .metadata whole
    dcp_io._RawTensorWriter._writes_one_metadata_file = (
        ckptmgrs_metadata_file if keep else lambda self: False
    )
    save_plans._flat = noted_flat if keep else lambda state_dict: False
    with manager:
        if not keep:
            manager._save_plans.write_items.turn_off()
        for step, kind, mode in SEQUENCE:
            state = state_at(step, kind)
            made["count"] = 0
            if mode == "save":
                manager.save(step, state)
            else:
                assert manager.save_async(step, state)
                manager.join()
            if keep:
                seen["made"].append(made["count"])
                seen["reused"].append(manager._save_plans.metadata_file.reused)
                seen["restored"].append(round_trip(manager, step, state))
            metadata[WHERE, step] = metadata_of(WHERE, step)
        if keep:
            seen["holds_items"] = manager._save_plans.write_items.holds_items()
            seen["enabled"] = manager._save_plans.write_items.enabled
    if keep:
        seen["holds_items_after_close"] = manager._save_plans.write_items.holds_items()
for step, _, _ in SEQUENCE:
    kept, scratch = metadata["kept", step], metadata["scratch", step]
    seen["same_metadata"].append(
        kept.state_dict_metadata == scratch.state_dict_metadata
        and kept.storage_data == scratch.storage_data
        and kept.planner_data == scratch.planner_data
        and kept.version == scratch.version
        and list(vars(kept)) == list(vars(scratch))
        and kept.storage_meta.save_id != scratch.storage_meta.save_id
    )
dist.destroy_process_group()
print(json.dumps(seen))
"""
)

FALLBACK = (
    COMMON
    + r"""
from ckptmgr import dcp_io
WHERE = sys.argv[2]
plan_of = default_planner.create_default_local_save_plan

def asks_twice(state_dict, is_coordinator):
    for fqn, value in state_dict.items():  # (a planner asking every item once more)
        if hasattr(value, "__create_write_items__") and not isinstance(value, torch.Tensor):
            value.__create_write_items__(fqn, value)
    return plan_of(state_dict, is_coordinator)

def refuses_others(state_dict, is_coordinator):
    for fqn, value in state_dict.items():  # (a planner taking tensors only)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{fqn}: not a tensor")
    return plan_of(state_dict, is_coordinator)

seen = {"restored": []}
with CheckpointManager(f"{root}/{WHERE}", 1, max_to_keep=20, chkpt_on_preemption=False) as manager:
    manager.save(1, state_at(1, "base"))
    seen["kept_after_first"] = manager._save_plans.write_items.holds_items()
    default_planner.create_default_local_save_plan = (
        asks_twice if WHERE == "asks_twice" else refuses_others
    )
    for step in (2, 3):  # the odd planning, then a save planned from scratch
        manager.save(step, state_at(step, "base"))
        seen["restored"].append(round_trip(manager, step, state_at(step, "base")))
    default_planner.create_default_local_save_plan = plan_of
    seen["enabled"] = manager._save_plans.write_items.enabled
    seen["holds_items"] = manager._save_plans.write_items.holds_items()
    seen["steps"] = manager.all_steps()
dist.destroy_process_group()
print(json.dumps(seen))
"""
)

PARTIAL = (
    COMMON
    + r"""
from torch.distributed.tensor import Partial
WHERE = "partial"
seen = {}
with CheckpointManager(f"{root}/{WHERE}", 1, max_to_keep=20, chkpt_on_preemption=False) as manager:
    manager.save(1, state_at(1, "base"))
    bad = state_at(2, "base")
    bad["a"] = DTensor.from_local(torch.ones(6, 5), mesh, [Partial()])
    try:
        manager.save(2, bad)
        seen["error"] = None
    except CheckpointError as exc:
        seen["error"] = str(exc)
    seen["enabled"] = manager._save_plans.write_items.enabled
    made["count"] = 0
    manager.save(3, state_at(3, "base"))
    seen["made_after"] = made["count"]
    seen["restored"] = round_trip(manager, 3, state_at(3, "base"))
    seen["steps"] = manager.all_steps()
dist.destroy_process_group()
print(json.dumps(seen))
"""
)


def child(code: str, tmp_path: Path, *args: str) -> Any:
    result = run_python(code, str(tmp_path), *args, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@checked_torch_only
def test_kept_items_restore_bit_exact_and_write_the_metadata_of_items_made_from_scratch(
    tmp_path: Path,
) -> None:
    seen = child(SEQUENCE, tmp_path)
    assert all(seen["restored"]), seen["restored"]
    assert all(seen["same_metadata"]), seen["same_metadata"]
    # DCP made items only for DTensors new or changed: a, p and b at first; none for the same
    # state; a (reshaped), b (float64) and p (save_async writes a staged copy, which does not
    # require grad); none; a (back), c (new) and p; b (back) and p; none
    assert seen["made"] == [3, 0, 3, 0, 3, 2, 0], seen["made"]
    # .metadata pickled anew only from storage_meta where DCP's plan was kept (equal to DCP's
    # own .metadata of the scratch saves, above): the second save of each structure
    assert seen["reused"] == [0, 3, 0, 3, 0, 0, 3], seen["reused"]
    # every save's flat dict of DTensors, parameters and tensors was set up without DCP's
    # passes over it (its planner_data equal to that of the scratch saves, which made them)
    assert seen["flat"] == [True] * 7, seen["flat"]
    assert seen["enabled"] and seen["holds_items"]
    assert not seen["holds_items_after_close"]


def test_a_planner_that_asks_the_kept_items_twice_plans_from_scratch(tmp_path: Path) -> None:
    seen = child(FALLBACK, tmp_path, "asks_twice")
    assert seen["kept_after_first"]
    assert seen["restored"] == [True, True]
    assert seen["steps"] == [1, 2, 3]
    assert not seen["enabled"] and not seen["holds_items"]


def test_a_planner_that_refuses_the_kept_items_plans_from_scratch(tmp_path: Path) -> None:
    seen = child(FALLBACK, tmp_path, "refuses_others")
    assert seen["kept_after_first"]
    assert seen["restored"] == [True, True]
    assert seen["steps"] == [1, 2, 3]
    assert not seen["enabled"] and not seen["holds_items"]


def test_a_state_dcp_cannot_plan_fails_its_save_and_the_next_save_keeps_items_again(
    tmp_path: Path,
) -> None:
    seen = child(PARTIAL, tmp_path)
    assert seen["error"] is not None and "artial" in seen["error"], seen["error"]
    assert seen["enabled"]  # (the state's own error: the kept items are not to blame)
    assert seen["made_after"] == 3  # (the failed save dropped them: made anew)
    assert seen["restored"]
    assert seen["steps"] == [1, 3]
