"""How ckptmgr calls DCP to save: DCP's save without its per-item ``Stateful`` pass (which
wraps every item in DCP's method logger), and ``dcp.save`` where torch lacks that function."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint.state_dict_saver as state_dict_saver

from ckptmgr import CheckpointManager, dcp_io
from ckptmgr.packing import PACK_MAX_TENSOR_BYTES

ITEMS = 12


def state() -> dict[str, torch.Tensor]:
    """Tensors too large to be packed: each is an item of DCP's save."""
    numel = PACK_MAX_TENSOR_BYTES // 4 + 1
    return {f"t{i}": torch.arange(numel, dtype=torch.float32) + i for i in range(ITEMS)}


@pytest.fixture
def stateful_passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the states DCP's Stateful pass was called on."""
    calls: list[int] = []
    original: Callable[[Any], Any] = state_dict_saver._stateful_to_state_dict

    def counted(state_dict: Any) -> Any:
        calls.append(len(state_dict))
        return original(state_dict)

    monkeypatch.setattr(state_dict_saver, "_stateful_to_state_dict", counted)
    return calls


def save_and_restore(root: Path) -> None:
    saved = state()
    with CheckpointManager(root, 1, chkpt_on_preemption=False) as manager:
        manager.save(1, saved)
        assert manager.save_async(2, saved)
        manager.join()
        for step in (1, 2):
            restored = {key: torch.zeros_like(value) for key, value in saved.items()}
            manager.restore(step, restored)
            for key, value in saved.items():
                assert torch.equal(restored[key], value), (step, key)


def test_a_save_skips_dcps_stateful_pass(tmp_path: Path, stateful_passes: list[int]) -> None:
    assert dcp_io._SAVE_WITHOUT_STATEFUL_PASS is not None  # (this torch has it)
    save_and_restore(tmp_path)
    assert stateful_passes == []


def test_without_dcps_private_save_the_public_one_is_used(
    tmp_path: Path, stateful_passes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dcp_io, "_SAVE_WITHOUT_STATEFUL_PASS", None)
    save_and_restore(tmp_path)
    assert stateful_passes == [ITEMS, ITEMS]
