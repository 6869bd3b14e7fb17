"""DCP's save plans kept between the saves of a manager (ckptmgr.save_plans), in one process.

Saves with kept plans restore bit-exact through changes of the state's structure and write the
same ``.metadata`` as saves planned from scratch; each manager keeps its own plans and drops
them when a save fails and when it closes. The 2-rank case (one rank's plan changing alone, a
write failing on one rank) is in test_distributed.py.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptmgr import CheckpointError, CheckpointManager, dcp_io, save_plans
from ckptmgr.packing import PACK_MAX_TENSOR_BYTES
from ckptmgr.save_plans import SavePlanCache

BIG = PACK_MAX_TENSOR_BYTES // 4 + 1  # float32 items of a tensor that is not packed


def structure(kind: int, step: int) -> dict[str, Any]:
    """States of four structures (kind 1; 2: a tensor more, another of another shape; 3: the
    large tensors' dtypes changed to others of their item sizes, names and shapes the same; 4:
    one to a dtype of another item size), with small tensors (packed) beside the large ones,
    values depending on ``step``."""
    state: dict[str, Any] = {
        "w": torch.arange(BIG, dtype=torch.float32) + step,
        "h": torch.full((BIG,), step, dtype=torch.float16),
        "small": [torch.full((3,), float(step + i)) for i in range(20)],
    }
    if kind == 2:
        state["extra"] = torch.arange(BIG * 2, dtype=torch.int64) * step
        state["w"] = torch.arange(BIG + 7, dtype=torch.float32) - step
    if kind == 3:
        state["w"] = torch.arange(BIG, dtype=torch.int32) + step
        state["h"] = torch.full((BIG,), step + 0.5, dtype=torch.bfloat16)
    if kind == 4:
        state["w"] = torch.arange(BIG, dtype=torch.float64) / 3 + step
    return state


def blank(state: dict[str, Any]) -> dict[str, Any]:
    return {
        key: [torch.zeros_like(t) for t in value]
        if isinstance(value, list)
        else torch.zeros_like(value)
        for key, value in state.items()
    }


def assert_equal(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        pairs = (
            zip(actual[key], value, strict=True)
            if isinstance(value, list)
            else [(actual[key], value)]
        )
        for got, want in pairs:
            assert got.dtype == want.dtype and torch.equal(got, want), key


# (step, structure): hits, a change, back; dtypes changed (DCP's plans compare no dtype), back
PLAN = [(1, 1), (2, 1), (3, 2), (4, 2), (5, 1), (6, 3), (7, 3), (8, 4), (9, 1)]


def metadata_of(root: Path, step: int) -> Any:
    return pickle.loads(next(root.glob(f"step_{step:012d}/.metadata")).read_bytes())


def run_plan(root: Path) -> CheckpointManager:
    manager = CheckpointManager(root, 1, max_to_keep=10, chkpt_on_preemption=False)
    for step, kind in PLAN:
        state = structure(kind, step)
        if step % 2:
            manager.save(step, state)
        else:
            assert manager.save_async(step, state)
            manager.join()
        restored = blank(state)
        manager.restore(step, restored)
        assert_equal(restored, state)
    return manager


def test_this_torch_keeps_save_plans() -> None:
    assert save_plans.PLAN_CACHING  # (else every other test here checks only the fallback)


def test_kept_plans_restore_bit_exact_through_structure_changes(tmp_path: Path) -> None:
    manager = run_plan(tmp_path)
    try:
        assert manager._save_plans.holds_plans()
        for step, kind in PLAN:  # every step again, after all the others were written
            state = structure(kind, step)
            restored = blank(state)
            manager.restore(step, restored)
            assert_equal(restored, state)
    finally:
        manager.close()
    assert not manager._save_plans.holds_plans()


def test_kept_plans_write_the_metadata_of_plans_made_from_scratch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_plan(tmp_path / "kept").close()
    monkeypatch.setattr(save_plans, "PLAN_CACHING", False)
    scratch = run_plan(tmp_path / "scratch")
    assert not scratch._save_plans.holds_plans()
    scratch.close()
    for step, _ in PLAN:
        kept, fresh = metadata_of(tmp_path / "kept", step), metadata_of(tmp_path / "scratch", step)
        assert sorted(vars(kept)) == sorted(vars(fresh))  # (nothing of the last save left on it)
        assert kept.state_dict_metadata == fresh.state_dict_metadata, step
        assert kept.storage_data == fresh.storage_data, step
        assert kept.planner_data == fresh.planner_data, step


def test_two_managers_keep_plans_of_their_own(tmp_path: Path) -> None:
    first = CheckpointManager(tmp_path / "a", 1, chkpt_on_preemption=False)
    second = CheckpointManager(tmp_path / "b", 1, chkpt_on_preemption=False)
    try:
        assert first._save_plans.key != second._save_plans.key
        for step in (1, 2, 3):  # the same tensor names, of other shapes in each
            first.save(step, structure(1, step))
            second.save(step, structure(2, step))
        for manager, kind in ((first, 1), (second, 2)):
            state = structure(kind, 3)
            restored = blank(state)
            manager.restore(3, restored)
            assert_equal(restored, state)
        first.close()
        assert not first._save_plans.holds_plans() and second._save_plans.holds_plans()
    finally:
        first.close()
        second.close()


def test_a_failed_save_drops_the_plans_and_the_next_save_plans_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = dcp_io._RawTensorWriter._write_file
    failing = {"on": False}

    def write_file(self: Any, *args: Any, **kwargs: Any) -> Any:
        if failing["on"]:
            raise OSError("injected: the disk refused the write")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(dcp_io._RawTensorWriter, "_write_file", write_file)
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as manager:
        manager.save(1, structure(1, 1))
        assert manager._save_plans.holds_plans()
        failing["on"] = True
        with pytest.raises(CheckpointError, match="injected"):
            manager.save(2, structure(1, 2))
        assert not manager._save_plans.holds_plans()
        failing["on"] = False
        manager.save(3, structure(1, 3))
        assert manager._save_plans.holds_plans()
        assert manager.all_steps() == [1, 3]
        restored = blank(structure(1, 3))
        manager.restore(3, restored)
        assert_equal(restored, structure(1, 3))


def test_forget_drops_only_its_own_plans() -> None:
    from torch.distributed.checkpoint.planner import SavePlanner

    mine, other = SavePlanCache(), SavePlanCache()
    SavePlanner._cached_save_plan[mine.key] = "a"  # type: ignore[assignment]
    SavePlanner._cached_metadata[other.key] = "b"  # type: ignore[assignment]
    try:
        assert mine.holds_plans() and other.holds_plans()
        mine.forget()
        assert not mine.holds_plans() and other.holds_plans()
    finally:
        mine.forget()
        other.forget()
    assert not other.holds_plans()


def test_a_flat_dict_of_tensors_is_set_up_as_dcps_passes_would_without_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ckptmgr hands DCP a flat dict of tensors: its planner takes it as DCP's two passes over
    the state would leave it (the same items, each key mapped to itself), without making them;
    anything else (a nested value, a value that is not a tensor) goes through DCP's passes."""
    from torch import nn
    from torch.distributed.checkpoint import default_planner

    passes: list[str] = []
    real_flatten = default_planner.flatten_state_dict

    def counted_flatten(state_dict: Any) -> Any:
        passes.append("flatten")
        return real_flatten(state_dict)

    monkeypatch.setattr(default_planner, "flatten_state_dict", counted_flatten)
    flat = {
        "model.layers.0.weight": torch.randn(3, 4),
        "p": nn.Parameter(torch.randn(2)),
        "steps": torch.arange(4),
    }
    for state, fast in [
        (flat, True),
        ({**flat, "nested": {"x": torch.zeros(2)}}, False),
        ({**flat, "count": 3}, False),
        ({**flat, 7: torch.zeros(1)}, False),
    ]:
        ours = save_plans._SavePlanner()
        passes.clear()
        ours.set_up_planner(state, None, True)
        assert passes == ([] if fast else ["flatten"])
        dcps = default_planner.DefaultSavePlanner()
        dcps.set_up_planner(state, None, True)
        assert ours.mappings == dcps.mappings
        assert list(ours.state_dict) == list(dcps.state_dict)
        assert all(ours.state_dict[key] is dcps.state_dict[key] for key in dcps.state_dict)
        assert ours.state_dict is not state and ours.is_coordinator
