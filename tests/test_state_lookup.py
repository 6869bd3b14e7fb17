"""ckptmgr.state_lookup: a DTensor's local tensor found directly, everything else as DCP finds it.

Runs in a fresh interpreter with a 1-rank gloo group (DTensors need a device mesh); the child
prints what it observed as JSON and the test asserts it.
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_python

CHILD = r"""
import json, sys, tempfile
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.utils import find_state_dict_object
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from ckptmgr import CheckpointManager
from ckptmgr.state_lookup import find_item_tensor

root = sys.argv[1]
dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
generator = torch.Generator().manual_seed(0)
state = {
    "param": nn.Parameter(
        distribute_tensor(torch.randn(6, 5, generator=generator), mesh, [Shard(0)])
    ),
    "replicated": distribute_tensor(torch.randn(7, generator=generator), mesh, [Replicate()]),
    "plain": torch.arange(4.0),
}
partial = DTensor.from_local(torch.ones(3), mesh, [Partial()])
seen = {}
for key, value in state.items():
    index = MetadataIndex(key, torch.Size([0] * value.dim()))
    ours, dcps = find_item_tensor(state, index), find_state_dict_object(state, index)
    seen[key] = {
        "type": type(ours).__name__,
        "is_dcps": ours is dcps,
        "same_memory": ours.data_ptr() == dcps.data_ptr(),
        "equal": bool(torch.equal(ours.detach(), dcps.detach())),
        "grad_fn": ours.grad_fn is not None,
    }
errors = []
for lookup in (find_item_tensor, find_state_dict_object):
    try:
        lookup({"partial": partial}, MetadataIndex("partial", torch.Size([0])))
        errors.append(None)
    except Exception as exc:
        errors.append(type(exc).__name__)
    try:
        lookup(state, MetadataIndex("missing"))
        errors.append(None)
    except Exception as exc:
        errors.append(type(exc).__name__)
seen["errors"] = errors

def refused(self, index):
    raise AssertionError("DCP's __get_tensor_shard__ was called")

DTensor.__get_tensor_shard__ = refused
with CheckpointManager(f"{root}/ckpt", 1, chkpt_on_preemption=False) as manager:
    manager.save(1, state)
    assert manager.save_async(2, state)
    manager.join()
    expected = {key: value.full_tensor().clone() if isinstance(value, DTensor) else value.clone()
                for key, value in state.items()}
    with torch.no_grad():
        for value in state.values():
            (value.to_local() if isinstance(value, DTensor) else value).zero_()
    manager.restore(2, state)
    full = {
        key: (value.full_tensor() if isinstance(value, DTensor) else value).detach()
        for key, value in state.items()
    }
    seen["restored"] = {key: bool(torch.equal(full[key], expected[key])) for key in state}
    seen["param_still_requires_grad"] = state["param"].requires_grad
dist.destroy_process_group()
print(json.dumps(seen))
"""


def test_a_dtensors_local_tensor_is_found_directly_and_the_rest_as_dcp_finds_it(
    tmp_path: Path,
) -> None:
    result = run_python(CHILD, str(tmp_path), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("param", "replicated"):
        assert seen[key]["type"] == "Tensor", key  # the local tensor, not a DTensor
        assert seen[key]["same_memory"] and seen[key]["equal"], key
        assert not seen[key]["grad_fn"], key  # (DCP's is a view through autograd)
    assert seen["plain"]["is_dcps"]
    # a Partial DTensor and a missing name: the errors DCP raises, from DCP's own lookup
    assert seen["errors"][0] == seen["errors"][2] and seen["errors"][0] is not None
    assert seen["errors"][1] == seen["errors"][3] == "ValueError"
    # saves and a restore never went through DCP's __get_tensor_shard__, and round-trip
    assert seen["restored"] == {"param": True, "replicated": True, "plain": True}
    assert seen["param_still_requires_grad"]
