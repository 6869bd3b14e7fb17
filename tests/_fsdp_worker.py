"""Worker of tests/test_fsdp.py: one rank of a real ``torchrun`` job with FSDP2 (gloo, CPU).

Run as ``torchrun --nproc-per-node N tests/_fsdp_worker.py <scenario> <out_dir> <paths...>`` with
the repository root and ``tests/`` on ``PYTHONPATH``. Scenarios, in the order the test runs them:

* ``save2 <ckpt2> <ckpt_sub>`` (2 ranks): a small transformer sharded with FSDP2 (``fully_shard``)
  and AdamW, a tensor-parallel style DTensor pair (``Shard(0)`` and ``Replicate()``), a DDP model
  with SGD, a replicated tensor, per-rank tensors and values. It trains 3 steps, saves step 3 with
  ``save_async``, trains steps 4 and 5 while the write runs (recording their losses), then joins.
  Rank 0 writes the unsharded reference of step 3 (every DTensor gathered) to ``ref3.pt``. Then a
  manager with ``process_group=`` a subgroup saves and restores on ``ckpt_sub``.
* ``one <ckpt2> <ckpt1>`` (1 rank): first without torch.distributed, restores step 3 of the 2-rank
  checkpoint into unsharded modules and plain tensors (2 -> 1), trains one step and saves step 4
  of this 1-rank job to ``ckpt1`` (reference ``ref1.pt``); then it initialises a 1-rank process
  group and restores step 3 into an FSDP2 model on a 1-rank mesh.
* ``restore2 <ckpt2> <ckpt1>`` (2 ranks): restores step 3 into a fresh FSDP2 model (2 -> 2) and
  trains steps 4 and 5 again; restores step 4 of the 1-rank checkpoint (1 -> 2); rank 1 asks for a
  per-rank tensor that the 1-rank job never saved.

Each rank writes what it observed to ``<out_dir>/<scenario>-rank<R>.json``; the test makes the
assertions. Comparisons are bit for bit (``first_difference`` of ``_dist_worker``), after
gathering every DTensor to its full tensor. ``faulthandler`` ends a rank still running after
``WATCHDOG_S`` seconds, and every collective has a timeout.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _dist_worker import first_difference
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from ckptmgr import CheckpointError, CheckpointManager, PerRank

COLLECTIVE_TIMEOUT_S = 30.0
WATCHDOG_S = 100.0
VOCAB, DIM, HEADS, SEQ, LAYERS, BATCH = 33, 16, 2, 8, 2, 4  # 33: rows shard unevenly on 2 ranks
SAVED_STEP = 3  # the 2-rank job's checkpoint
ONE_RANK_STEP = 4  # the 1-rank job's checkpoint
CONTINUED_STEPS = (4, 5)
PROCESS_STEPS = (6, 7)  # saved in process mode by the 2-rank job, after its own steps


# -- the model and the state -----------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm attention and MLP, as in a transformer layer."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 3 * DIM), nn.GELU(), nn.Linear(3 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, HEADS, DIM // HEADS).unbind(2)
        attn = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, DIM))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Token and position embeddings, ``LAYERS`` blocks, a final norm and an output head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_model(mesh: DeviceMesh | None, seed: int) -> nn.Module:
    """The transformer with seeded weights; sharded with FSDP2 over ``mesh`` when given."""
    torch.manual_seed(seed)
    model = TinyTransformer()
    if mesh is not None:
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int) -> float:
    """One step on this rank's batch of ``step``; returns the loss (FSDP2 averages gradients)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=gen)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def tp_values(step: int) -> dict[str, torch.Tensor]:
    """Full values of the tensor-parallel tensors at ``step``: 5 rows (of ``w``) and 5 columns
    (of ``c``) shard unevenly on 2 ranks."""
    weight = torch.arange(20, dtype=torch.float32).reshape(5, 4) * (step + 1) + 0.25
    columns = torch.arange(15, dtype=torch.bfloat16).reshape(3, 5) - step
    return {"w": weight, "b": torch.linspace(-1, 1, 4, dtype=torch.float64) * step, "c": columns}


def tp_state(mesh: DeviceMesh | None, step: int) -> dict[str, torch.Tensor]:
    """DTensors over ``mesh`` (``w`` Shard(0), ``b`` Replicate, ``c`` Shard(1): a column shard,
    not contiguous in memory), or plain tensors without a mesh."""
    values = tp_values(step)
    if mesh is None:
        return values
    return {
        "w": distribute_tensor(values["w"], mesh, [Shard(0)]),
        "b": distribute_tensor(values["b"], mesh, [Replicate()]),
        "c": distribute_tensor(values["c"], mesh, [Shard(1)]),
    }


def ddp_model(distributed: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A DDP-wrapped linear layer (a plain one without torch.distributed) and SGD+momentum."""
    torch.manual_seed(7)
    inner = nn.Linear(4, 3)
    model: nn.Module = DistributedDataParallel(inner) if distributed else inner
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def ddp_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    loss = model(torch.randn(8, 4, generator=gen)).square().mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def local_values(step: int, rank: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float64) + 100 * rank + step


def build_state(mesh: DeviceMesh | None, rank: int, step: int, seed: int = 0) -> dict[str, Any]:
    """Every kind of state this test checkpoints; ``mesh`` None builds the unsharded version."""
    model = make_model(mesh, seed)
    ddp, ddp_optim = ddp_model(distributed=mesh is not None)
    return {
        "model": model,
        "optim": make_optimizer(model),
        "tp": tp_state(mesh, step),
        "ddp": ddp,
        "ddp_optim": ddp_optim,
        "replicated": torch.full((3,), float(step), dtype=torch.float64),
        "local": PerRank(local_values(step, rank)),
        "rank_info": PerRank({"rank": rank, "tag": f"rank{rank}-step{step}"}),
        "progress": {"step": step},
    }


def full(value: Any) -> Any:
    """``value`` with every DTensor gathered into a full tensor and tensors cloned."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: full(item) for key, item in value.items()}
    if isinstance(value, list):
        return [full(item) for item in value]
    if isinstance(value, tuple):
        return tuple(full(item) for item in value)
    return value


def unsharded(state: dict[str, Any]) -> dict[str, Any]:
    """The replicated part of ``state``, unsharded, with parameter-name keys: the reference."""
    return full(
        {
            "model": get_model_state_dict(state["model"]),
            "optim": get_optimizer_state_dict(state["model"], state["optim"]),
            "tp": state["tp"],
            "ddp": get_model_state_dict(state["ddp"]),
            "ddp_optim": get_optimizer_state_dict(state["ddp"], state["ddp_optim"]),
            "replicated": state["replicated"],
        }
    )


def differences(state: dict[str, Any], reference: dict[str, Any]) -> dict[str, str | None]:
    """Where each part of ``state`` differs from ``reference`` (None: bit-identical)."""
    actual = unsharded(state)
    return {key: first_difference(actual[key], reference[key], key) for key in reference}


def per_rank_differences(state: dict[str, Any], rank: int, step: int) -> dict[str, str | None]:
    expected = {"rank": rank, "tag": f"rank{rank}-step{step}"}
    return {
        "local": first_difference(state["local"].value, local_values(step, rank), "local"),
        "rank_info": first_difference(state["rank_info"].value, expected, "rank_info"),
        "progress": first_difference(state["progress"], {"step": step}, "progress"),
    }


def fresh_state(mesh: DeviceMesh | None, rank: int) -> dict[str, Any]:
    """A state to restore into: other weights, no optimizer state, other values everywhere."""
    state = build_state(mesh, rank, step=-5, seed=99)
    state["local"] = PerRank(torch.full((6,), -1.0, dtype=torch.float64))
    state["rank_info"] = PerRank(None)
    state["progress"] = None
    return state


# -- helpers ---------------------------------------------------------------------------------------
def _error(exc: BaseException | None) -> dict[str, Any] | None:
    if exc is None:
        return None
    return {
        "type": type(exc).__name__,
        "is_checkpoint_error": isinstance(exc, CheckpointError),
        "message": str(exc)[:2000],
    }


def _call(action: Callable[[], Any]) -> tuple[Any, dict[str, Any] | None]:
    try:
        return action(), None
    except Exception as exc:
        return None, _error(exc)


def _gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _manager(path: str, **kwargs: Any) -> CheckpointManager:
    return CheckpointManager(
        path,
        save_interval=1,
        chkpt_on_preemption=False,
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
        **kwargs,
    )


def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (dist.get_world_size(),))


# -- scenarios -------------------------------------------------------------------------------------
def scenario_save2(rank: int, out_dir: str, ckpt2: str, ckpt_sub: str) -> dict[str, Any]:
    mesh = _mesh()
    state = build_state(mesh, rank, SAVED_STEP)
    record: dict[str, Any] = {"losses": {}}
    for step in range(1, SAVED_STEP + 1):
        record["losses"][step] = train_step(state["model"], state["optim"], step, rank)
        ddp_step(state["ddp"], state["ddp_optim"], step)
    reference = unsharded(state)
    if rank == 0:
        torch.save(reference, Path(out_dir) / "ref3.pt")
    record["local_shapes"] = {
        "embed": list(state["model"].embed.weight.to_local().shape),
        "tp_w": list(state["tp"]["w"].to_local().shape),
        "tp_c": list(state["tp"]["c"].to_local().shape),
    }

    with _manager(ckpt2) as manager:
        record["async_returned"], record["async_error"] = _call(
            lambda: manager.save_async(SAVED_STEP, state)
        )
        # Training goes on while the write runs: parameters, optimizer state, DTensors and
        # per-rank tensors change in place; the checkpoint must hold the values of step 3.
        for step in CONTINUED_STEPS:
            record["losses"][step] = train_step(state["model"], state["optim"], step, rank)
            ddp_step(state["ddp"], state["ddp_optim"], step)
        state["tp"]["w"].to_local().add_(1000.0)
        state["tp"]["c"].to_local().add_(1000.0)
        state["replicated"].add_(1000.0)
        state["local"].value.add_(1000.0)
        _, record["join_error"] = _call(manager.join)
        record["steps_by_rank"] = _gather(manager.all_steps())
        record["latest_by_rank"] = _gather(manager.latest_step())
        fresh = fresh_state(mesh, rank)
        _, record["restore_error"] = _call(lambda: manager.restore(SAVED_STEP, fresh))
        record["differences"] = differences(fresh, reference)
        record["per_rank"] = per_rank_differences(fresh, rank, SAVED_STEP)
    record["files"] = sorted(os.listdir(Path(ckpt2) / f"step_{SAVED_STEP:012d}"))
    record["process"] = process_mode_saves(state, mesh, rank, str(Path(ckpt_sub).parent / "proc"))

    # A manager restricted to a subgroup (a group object other than the default group).
    subgroup = dist.new_group(ranks=[0, 1], backend="gloo")
    sub_state = {"tp": tp_state(mesh, 1), "local": PerRank(local_values(1, rank))}
    with _manager(ckpt_sub, process_group=subgroup) as manager:
        record["sub_save"] = _call(lambda: manager.save(1, sub_state))
        record["sub_steps_by_rank"] = _gather(manager.all_steps())
        target = {"tp": tp_state(mesh, -1), "local": PerRank(torch.zeros(6, dtype=torch.float64))}
        _, record["sub_restore_error"] = _call(lambda: manager.restore(1, target))
        record["sub_differences"] = {
            "tp": first_difference(full(target["tp"]), tp_values(1), "tp"),
            "local": first_difference(target["local"].value, local_values(1, rank), "local"),
        }

    # A group of rank 0 alone: rank 1, not in it, is refused at once (its manager ran its
    # collectives on the default group, where they met the training loop's next one).
    solo = dist.new_group(ranks=[0], backend="gloo")
    solo_root = str(Path(ckpt_sub).parent / "solo")
    if rank == 0:
        with _manager(solo_root, process_group=solo) as manager:
            record["solo_save"] = _call(lambda: manager.save(1, {"w": torch.ones(3)}))
    else:
        record["solo_save"] = _call(lambda: _manager(solo_root, process_group=solo))[1]
    record["gathered_after_solo"] = _gather(f"training data of rank {rank}")
    return record


def process_mode_saves(
    state: dict[str, Any], mesh: DeviceMesh, rank: int, path: str
) -> list[dict[str, Any]]:
    """:data:`PROCESS_STEPS` saved with ``save_async`` in process mode (the checkpoint daemons
    write them), the state trained and changed in place after each call; each restored into a
    fresh state and compared with the state at its call."""
    saves: list[dict[str, Any]] = []
    with _manager(path, async_mode="process") as manager:
        for step in PROCESS_STEPS:
            train_step(state["model"], state["optim"], step, rank)
            ddp_step(state["ddp"], state["ddp_optim"], step)
            reference = unsharded(state)
            entry: dict[str, Any] = {"step": step}
            entry["returned"], entry["error"] = _call(
                lambda step=step: manager.save_async(step, state)
            )
            state["tp"]["w"].to_local().add_(1.0)
            state["replicated"].add_(1.0)
            train_step(state["model"], state["optim"], step, rank)  # (its loss not recorded)
            _, entry["join_error"] = _call(manager.join)
            fresh = fresh_state(mesh, rank)
            _, entry["restore_error"] = _call(
                lambda step=step, fresh=fresh: manager.restore(step, fresh)
            )
            entry["differences"] = differences(fresh, reference)
            saves.append(entry)
    return saves


def scenario_one(rank: int, out_dir: str, ckpt2: str, ckpt1: str) -> dict[str, Any]:
    reference = torch.load(Path(out_dir) / "ref3.pt", weights_only=True)
    record: dict[str, Any] = {"distributed_at_start": dist.is_initialized()}

    # 2 -> 1: a plain process, unsharded modules and plain tensors.
    state = fresh_state(None, rank)
    with _manager(ckpt2) as manager:
        record["plain_steps"] = manager.all_steps()
        _, record["plain_restore_error"] = _call(lambda: manager.restore(SAVED_STEP, state))
    record["plain_differences"] = differences(state, reference)
    record["plain_per_rank"] = per_rank_differences(state, rank, SAVED_STEP)

    # This 1-rank job trains on and writes its own checkpoint, for the 1 -> 2 restore.
    train_step(state["model"], state["optim"], ONE_RANK_STEP, rank)
    ddp_step(state["ddp"], state["ddp_optim"], ONE_RANK_STEP)
    state["tp"] = tp_values(ONE_RANK_STEP)
    state["replicated"] = torch.full((3,), float(ONE_RANK_STEP), dtype=torch.float64)
    state["local"] = PerRank(local_values(ONE_RANK_STEP, rank))
    state["rank_info"] = PerRank({"rank": rank, "tag": f"rank{rank}-step{ONE_RANK_STEP}"})
    state["progress"] = {"step": ONE_RANK_STEP}
    torch.save(unsharded(state), Path(out_dir) / "ref1.pt")
    with _manager(ckpt1) as manager:
        record["one_rank_save"] = _call(lambda: manager.save(ONE_RANK_STEP, state))

    # 2 -> 1 again, into FSDP2 and DTensors on a 1-rank mesh.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    mesh = _mesh()
    state = fresh_state(mesh, rank)
    with _manager(ckpt2) as manager:
        _, record["mesh_restore_error"] = _call(lambda: manager.restore(SAVED_STEP, state))
    record["mesh_param_type"] = type(state["model"].head.weight).__name__
    record["mesh_differences"] = differences(state, reference)
    record["mesh_per_rank"] = per_rank_differences(state, rank, SAVED_STEP)
    return record


def scenario_restore2(rank: int, out_dir: str, ckpt2: str, ckpt1: str) -> dict[str, Any]:
    mesh = _mesh()
    record: dict[str, Any] = {}

    # 2 -> 2: a new job, fresh FSDP2 model and optimizer; then training continues.
    state = fresh_state(mesh, rank)
    with _manager(ckpt2) as manager:
        _, record["restore_error"] = _call(lambda: manager.restore(SAVED_STEP, state))
    reference = torch.load(Path(out_dir) / "ref3.pt", weights_only=True)
    record["differences"] = differences(state, reference)
    record["per_rank"] = per_rank_differences(state, rank, SAVED_STEP)
    record["losses"] = {
        step: train_step(state["model"], state["optim"], step, rank) for step in CONTINUED_STEPS
    }

    # 1 -> 2: the checkpoint of the 1-rank job. Only rank 0 has a per-rank copy in it.
    state = fresh_state(mesh, rank)
    if rank != 0:
        del state["local"], state["rank_info"]
    with _manager(ckpt1) as manager:
        _, record["resharded_error"] = _call(lambda: manager.restore(ONE_RANK_STEP, state))
        reference = torch.load(Path(out_dir) / "ref1.pt", weights_only=True)
        record["resharded_differences"] = differences(state, reference)
        if rank == 0:
            record["resharded_per_rank"] = per_rank_differences(state, rank, ONE_RANK_STEP)
        record["resharded_progress"] = state["progress"]
        # Both ranks restore everything, and rank 1 asks for the per-rank tensor it never saved.
        target = fresh_state(mesh, rank)
        _, record["missing_per_rank_error"] = _call(lambda: manager.restore(ONE_RANK_STEP, target))
    return record


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "save2": scenario_save2,
    "one": scenario_one,
    "restore2": scenario_restore2,
}


def main(argv: list[str]) -> int:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    torch.set_num_threads(1)
    scenario, out_dir, *paths = argv
    rank = int(os.environ.get("RANK", "0"))
    if scenario != "one":  # "one" starts without torch.distributed and initialises it later
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    record: dict[str, Any] = {"rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
    try:
        record.update(SCENARIOS[scenario](rank, out_dir, *paths))
    except Exception:
        record["crash"] = traceback.format_exc()
    target = Path(out_dir) / f"{scenario}-rank{rank}.json"
    temporary = target.with_suffix(".tmp")
    temporary.write_text(json.dumps(record, indent=1, default=repr))
    temporary.rename(target)
    if dist.is_initialized():
        dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    finally:
        gc.freeze()  # (the interpreter's last collection skipped: about 0.7 s with torch loaded)
