"""Sharded state on many ranks and resharding on restore, in real ``torchrun`` jobs (gloo, CPU).

Three launches of ``tests/_fsdp_worker.py`` share one checkpoint directory, in order:

1. ``save2`` (2 ranks): FSDP2 transformer + AdamW, tensor-parallel DTensors, a DDP model, replicated
   and per-rank state; ``save_async`` of step 3 while training goes on; a subgroup manager.
2. ``one`` (1 rank): restores the 2-rank checkpoint without torch.distributed (unsharded modules)
   and into FSDP2 on a 1-rank mesh; writes a 1-rank checkpoint of its own.
3. ``restore2`` (2 ranks): restores the 2-rank checkpoint and continues training; restores the
   1-rank checkpoint (1 -> 2); asks for a per-rank tensor that was never saved.

Every comparison is bit for bit against an unsharded reference that the writing job gathered
(``ref3.pt``, ``ref1.pt``), and the continued losses against those of the run that saved. Then
``examples/train_fsdp.py`` runs twice (fresh, resume). Single-process tests at the end cover how
modules and optimizers are keyed, located and restored.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO
from test_distributed import Launch
from test_distributed import torchrun as distributed_torchrun
from torch import nn

from ckptmgr import CheckpointError, CheckpointManager, PerRank
from ckptmgr.module_state import OptimizerState
from ckptmgr.state import plan_restore
from ckptmgr.storage import CheckpointStorage

WORKER = Path(__file__).resolve().parent / "_fsdp_worker.py"
EXAMPLE = REPO / "examples" / "train_fsdp.py"
LAUNCH_TIMEOUT_S = 150.0
REPLICATED_PARTS = ("model", "optim", "tp", "ddp", "ddp_optim", "replicated")
PER_RANK_PARTS = ("local", "rank_info", "progress")


def torchrun(name: str, nproc: int, script: Path, out_dir: Path, *args: str | Path) -> Launch:
    """``torchrun --nproc-per-node nproc script args...`` on a free port, bounded in time."""
    return distributed_torchrun(name, nproc, script, out_dir, *args, timeout=LAUNCH_TIMEOUT_S)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("fsdp")
    paths = {name: base / name for name in ("ckpt2", "ckpt1", "sub", "out")}
    paths["out"].mkdir()
    return paths


@pytest.fixture(scope="module")
def save2(dirs: dict[str, Path]) -> dict[int, dict[str, Any]]:
    launch = torchrun(
        "save2", 2, WORKER, dirs["out"], "save2", dirs["out"], dirs["ckpt2"], dirs["sub"]
    )
    return launch.checked_records(2)


@pytest.fixture(scope="module")
def one(save2: dict[int, dict[str, Any]], dirs: dict[str, Path]) -> dict[str, Any]:
    launch = torchrun(
        "one", 1, WORKER, dirs["out"], "one", dirs["out"], dirs["ckpt2"], dirs["ckpt1"]
    )
    return launch.checked_records(1)[0]


@pytest.fixture(scope="module")
def restore2(one: dict[str, Any], dirs: dict[str, Path]) -> dict[int, dict[str, Any]]:
    launch = torchrun(
        "restore2", 2, WORKER, dirs["out"], "restore2", dirs["out"], dirs["ckpt2"], dirs["ckpt1"]
    )
    return launch.checked_records(2)


def assert_all_equal(
    differences: dict[str, str | None], parts: tuple[str, ...], where: str
) -> None:
    assert sorted(differences) == sorted(parts), where
    wrong = {part: text for part, text in differences.items() if text is not None}
    assert not wrong, f"{where}: differs from the reference: {wrong}"


# -- 1. the 2-rank job ----------------------------------------------------------------------------
def test_each_rank_holds_and_writes_only_its_shards(save2: dict[int, dict[str, Any]]) -> None:
    # 33 embedding rows and 5 tensor-parallel rows or columns shard unevenly: rank 0 holds more.
    assert save2[0]["local_shapes"] == {"embed": [17, 16], "tp_w": [3, 4], "tp_c": [3, 3]}
    assert save2[1]["local_shapes"] == {"embed": [16, 16], "tp_w": [2, 4], "tp_c": [3, 2]}
    for record in save2.values():
        assert record["files"] == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
            "commit.json",
            "objects-rank00000.json",
            "objects-rank00001.json",
        ]


def test_async_save_of_sharded_state_commits_on_every_rank(
    save2: dict[int, dict[str, Any]], dirs: dict[str, Path]
) -> None:
    for rank, record in save2.items():
        assert record["async_error"] is None and record["async_returned"] is True, rank
        assert record["join_error"] is None, rank
        assert record["steps_by_rank"] == [[3], [3]]
        assert record["latest_by_rank"] == [3, 3]
    record = CheckpointStorage(str(dirs["ckpt2"])).read_record(3)
    assert record.world_size == 2
    # Global shapes, parameter names, and the optimizer state keyed by parameter name.
    assert record.tensors["model/embed.weight"].shape == [33, 16]
    assert record.tensors["optim/state/embed.weight/exp_avg"].shape == [33, 16]
    assert record.tensors["tp/w"].shape == [5, 4]
    assert (record.tensors["tp/c"].shape, record.tensors["tp/c"].dtype) == ([3, 5], "bfloat16")
    assert "ddp/weight" in record.tensors  # DDP's "module." prefix is not part of the name
    assert "ddp_optim/state/weight/momentum_buffer" in record.tensors
    assert {"%rank00000%/local", "%rank00001%/local"} <= record.tensors.keys()
    assert not any(re.match(r"optim/state/\d+/", name) for name in record.tensors)


def test_same_world_size_restore_is_exact_while_training_mutated_the_originals(
    save2: dict[int, dict[str, Any]],
) -> None:
    """The job trained two more steps and changed every tensor in place right after
    ``save_async``; the restore still holds step 3."""
    for rank, record in save2.items():
        assert record["restore_error"] is None, rank
        assert_all_equal(record["differences"], REPLICATED_PARTS, f"rank {rank}")
        assert_all_equal(record["per_rank"], PER_RANK_PARTS, f"rank {rank}")


def test_process_mode_saves_of_the_fsdp2_state_restore_exactly(
    save2: dict[int, dict[str, Any]],
) -> None:
    """The same state saved twice with ``async_mode="process"``: the daemons write the FSDP2
    and tensor-parallel shards (the second save sends the staged tensors by token), training
    changes everything in place after each call, and each step restores bit for bit."""
    for rank, record in save2.items():
        assert [entry["step"] for entry in record["process"]] == [6, 7], rank
        for entry in record["process"]:
            where = f"rank {rank}, step {entry['step']}"
            assert entry["error"] is None and entry["returned"] is True, where
            assert entry["join_error"] is None and entry["restore_error"] is None, where
            assert_all_equal(entry["differences"], REPLICATED_PARTS, where)


def test_manager_on_a_subgroup(save2: dict[int, dict[str, Any]], dirs: dict[str, Path]) -> None:
    for rank, record in save2.items():
        assert record["sub_save"] == [True, None], rank
        assert record["sub_steps_by_rank"] == [[1], [1]], rank
        assert record["sub_restore_error"] is None, rank
        assert record["sub_differences"] == {"tp": None, "local": None}, rank
    assert sorted(p.name for p in dirs["sub"].iterdir()) == ["step_000000000001"]


def test_a_rank_outside_the_managers_group_is_refused(save2: dict[int, dict[str, Any]]) -> None:
    """A manager over a group of rank 0 alone saves on rank 0; on rank 1, which is not in the
    group, making one raises ValueError at once, and the next collective of the training job
    gets each rank's own value (rank 1's manager ran its collectives on the default group: the
    training job's all_gather got the manager's message as rank 1's value, or waited for it)."""
    assert save2[0]["solo_save"] == [True, None]
    refused = save2[1]["solo_save"]
    assert refused is not None and refused["type"] == "ValueError", refused
    assert "is not in process_group" in refused["message"], refused
    for rank, record in save2.items():
        assert record["gathered_after_solo"] == [
            "training data of rank 0",
            "training data of rank 1",
        ], rank


# -- 2. 2 -> 1 ------------------------------------------------------------------------------------
def test_two_rank_checkpoint_restores_in_one_plain_process(one: dict[str, Any]) -> None:
    assert one["distributed_at_start"] is False
    assert one["plain_steps"] == [3]
    assert one["plain_restore_error"] is None
    assert_all_equal(one["plain_differences"], REPLICATED_PARTS, "unsharded process")
    assert_all_equal(one["plain_per_rank"], PER_RANK_PARTS, "unsharded process (rank 0's copy)")
    assert one["one_rank_save"] == [True, None]


def test_two_rank_checkpoint_restores_on_a_one_rank_mesh(one: dict[str, Any]) -> None:
    assert one["mesh_restore_error"] is None
    assert one["mesh_param_type"] == "DTensor"
    assert_all_equal(one["mesh_differences"], REPLICATED_PARTS, "1-rank FSDP2 job")
    assert_all_equal(one["mesh_per_rank"], PER_RANK_PARTS, "1-rank FSDP2 job")


# -- 3. a new 2-rank job --------------------------------------------------------------------------
def test_new_two_rank_job_restores_and_trains_on_identically(
    save2: dict[int, dict[str, Any]], restore2: dict[int, dict[str, Any]]
) -> None:
    for rank, record in restore2.items():
        assert record["restore_error"] is None, rank
        assert_all_equal(record["differences"], REPLICATED_PARTS, f"rank {rank}")
        assert_all_equal(record["per_rank"], PER_RANK_PARTS, f"rank {rank}")
        # Parameters and AdamW state (moments, step counts) are exact: the losses are too.
        continued = {step: save2[rank]["losses"][step] for step in ("4", "5")}
        assert record["losses"] == continued, rank


def test_one_rank_checkpoint_restores_on_two_ranks(restore2: dict[int, dict[str, Any]]) -> None:
    for rank, record in restore2.items():
        assert record["resharded_error"] is None, rank
        assert_all_equal(record["resharded_differences"], REPLICATED_PARTS, f"rank {rank}")
        assert record["resharded_progress"] == {"step": 4}, rank  # plain values: rank 0's file
    assert_all_equal(restore2[0]["resharded_per_rank"], PER_RANK_PARTS, "rank 0")


def test_per_rank_tensor_never_saved_for_this_rank_is_a_clear_error(
    restore2: dict[int, dict[str, Any]],
) -> None:
    error = restore2[1]["missing_per_rank_error"]
    assert error is not None and error["is_checkpoint_error"], error
    assert "per-rank state 'local' has no copy for rank 1" in error["message"]
    assert "copies for ranks [0]" in error["message"]
    other = restore2[0]["missing_per_rank_error"]
    assert other is not None and other["is_checkpoint_error"], other
    assert "failed on another rank: rank 1: CheckpointError" in other["message"]
    assert "per-rank state 'local' has no copy for rank 1" in other["message"]


# -- 4. the example --------------------------------------------------------------------------------
def losses_of(output: str) -> dict[int, str]:
    return {int(step): loss for step, loss in re.findall(r"^step (\d+) loss (\S+)$", output, re.M)}


def test_train_fsdp_example_saves_and_resumes_exactly(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints"
    first = torchrun("example", 2, EXAMPLE, tmp_path, "--dir", ckpt, "--steps", "8")
    assert first.returncode == 0, first.describe()
    assert "starting fresh, world size 2" in first.stdout
    assert "saving step 3" in first.stdout and "saving step 6" in first.stdout
    assert "committed steps: [3, 6]" in first.stdout, first.describe()
    before = losses_of(first.stdout)
    assert sorted(before) == list(range(1, 9))

    second = torchrun("example", 2, EXAMPLE, tmp_path, "--dir", ckpt, "--steps", "10")
    assert second.returncode == 0, second.describe()
    assert "resumed from step 6, world size 2" in second.stdout, second.describe()
    after = losses_of(second.stdout)
    assert sorted(after) == [7, 8, 9, 10]
    assert after[7] == before[7] and after[8] == before[8]  # bit for bit (repr of the float)
    assert "committed steps: [6, 9]" in second.stdout
    steps = sorted(p.name for p in ckpt.iterdir())
    assert steps == ["step_000000000006", "step_000000000009"]
    assert float(after[10]) < float(before[1])


# -- 5. single process: modules and optimizers through DCP's state-dict API ------------------------
def make_trainer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        loss = nn.functional.mse_loss(model(torch.randn(8, 4, generator=gen)), torch.zeros(8, 2))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def manager(path: Path) -> CheckpointManager:
    return CheckpointManager(path, save_interval=1, chkpt_on_preemption=False)


def test_saving_before_the_first_step_leaves_the_optimizer_untouched(ckpt_dir: Path) -> None:
    """DCP's get_optimizer_state_dict would create AdamW's state with a step; the save must not
    change the optimizer, or the next real step would use other bias corrections."""
    model, optimizer = make_trainer(0)
    control_model, control_optimizer = make_trainer(0)
    with manager(ckpt_dir) as mgr:
        assert mgr.save(0, {"model": model, "optim": optimizer})
        assert not optimizer.state
        assert train(model, optimizer, range(3)) == train(
            control_model, control_optimizer, range(3)
        )

        # Restoring step 0 into a trained optimizer gives it "no state" again: the next steps
        # repeat those of a fresh run.
        mgr.restore(0, {"model": model, "optim": optimizer})
        assert not optimizer.state
        fresh_model, fresh_optimizer = make_trainer(0)
        assert train(model, optimizer, range(2)) == train(fresh_model, fresh_optimizer, range(2))


def test_optimizer_keyed_by_position_still_restores_into_optimizer_objects(
    ckpt_dir: Path,
) -> None:
    """Checkpoints of plain ``optimizer.state_dict()`` (as earlier ckptmgr versions wrote for
    Optimizer objects too) restore into Optimizer objects."""
    model, optimizer = make_trainer(0)
    train(model, optimizer, range(3))
    with manager(ckpt_dir) as mgr:
        mgr.save(3, {"model": model.state_dict(), "optim": optimizer.state_dict()})
        record = CheckpointStorage(str(ckpt_dir)).read_record(3)
        assert "optim/state/0/exp_avg" in record.tensors
        new_model, new_optimizer = make_trainer(1)
        mgr.restore(3, {"model": new_model, "optim": new_optimizer})
    assert train(new_model, new_optimizer, range(3, 6)) == train(model, optimizer, range(3, 6))


def test_params_without_state_stay_without_state(ckpt_dir: Path) -> None:
    """AdamW keeps no state for a parameter that never had a gradient; restore must not invent
    it (and must not fail because the checkpoint lacks it)."""
    model, optimizer = make_trainer(0)
    model[2].bias.requires_grad_(False)
    train(model, optimizer, range(2))
    model[2].bias.requires_grad_(True)
    assert len(optimizer.state) == 3
    with manager(ckpt_dir) as mgr:
        mgr.save(2, {"model": model, "optim": optimizer})
        new_model, new_optimizer = make_trainer(1)
        mgr.restore(2, {"model": new_model, "optim": new_optimizer})
    assert len(new_optimizer.state) == 3
    assert new_model[2].bias not in new_optimizer.state
    assert train(new_model, new_optimizer, range(2, 4)) == train(model, optimizer, range(2, 4))


def test_optimizer_needs_its_module_in_the_state(ckpt_dir: Path) -> None:
    model, optimizer = make_trainer(0)
    first_layer = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    train(model, optimizer, range(1))
    train(model, first_layer, range(1))
    with manager(ckpt_dir) as mgr:
        with pytest.raises(CheckpointError, match="no module in the state holds all parameters"):
            mgr.save(1, {"optim": optimizer})
        twin = nn.ModuleList([model[0], model[2]])  # holds the same parameters, not a submodule
        with pytest.raises(CheckpointError, match=r"several modules in the state \('a', 'b'\)"):
            mgr.save(1, {"a": model, "b": twin, "optim": optimizer})
        assert mgr.all_steps() == []
        # A model and one of its submodules both hold the first layer's parameters: the
        # outermost wins, so the names are those in the whole model.
        assert mgr.save(1, {"model": model, "first": model[0], "optim": first_layer})
        # An explicit OptimizerState names the module.
        assert mgr.save(2, {"twin": twin, "optim": OptimizerState(twin, optimizer)})
    storage = CheckpointStorage(str(ckpt_dir))
    assert "optim/state/0.weight/momentum_buffer" in storage.read_record(1).tensors
    assert "optim/state/1.weight/exp_avg" in storage.read_record(2).tensors  # twin's names


def test_per_rank_plain_values_restore_only_from_the_ranks_own_file(ckpt_dir: Path) -> None:
    """Rank 1 of a job restarted with more ranks reads rank 0's plain values; values marked
    PerRank in them are rank 0's and must not be taken as rank 1's."""
    with manager(ckpt_dir) as mgr:
        mgr.save(1, {"shared": {"epoch": 3}, "mine": PerRank({"cursor": 17})})
    storage = CheckpointStorage(str(ckpt_dir))
    tensors = storage.read_record(1).tensors.keys()
    rank0_objects = storage.read_objects(1, "objects-rank00000.json")
    state: dict[str, Any] = {"shared": None, "mine": PerRank(None)}
    plan = plan_restore(state, tensors, rank0_objects, rank=0, objects_rank=0)
    plan.finish()
    assert state["shared"] == {"epoch": 3} and state["mine"].value == {"cursor": 17}
    state = {"shared": None}
    plan_restore(state, tensors, rank0_objects, rank=1, objects_rank=0).finish()
    assert state["shared"] == {"epoch": 3}
    with pytest.raises(CheckpointError, match="per-rank state 'mine' has no copy for rank 1"):
        plan_restore({"mine": PerRank(None)}, tensors, rank0_objects, rank=1, objects_rank=0)
    # A step saved by ranks 0 and 1, restored on rank 2: the message named rank 0 alone.
    with pytest.raises(
        CheckpointError, match=r"no copy for rank 2 .*plain values of ranks \[0, 1\]"
    ):
        plan_restore({"mine": PerRank(None)}, tensors, rank0_objects, 2, 0, object_ranks=[0, 1])
