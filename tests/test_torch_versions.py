"""ckptmgr.torch_versions: on a torch outside the checked versions, DCP's own steps run, the
checkpoints are the same, and the log says so once per process."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from ckptmgr import CheckpointManager, torch_versions

LOGGER = "ckptmgr.torch_versions"


def _told(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


@pytest.fixture
def untold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_versions, "_told", False)


def test_a_checked_torch_is_not_logged(
    untold: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for version in torch_versions.CHECKED_TORCH:
        monkeypatch.setattr(torch_versions, "torch_version", lambda v=version: v)
        with caplog.at_level(logging.INFO, logger=LOGGER):
            assert torch_versions.checked_torch()
    assert _told(caplog) == []


def test_an_unchecked_torch_saves_and_restores_with_dcps_steps_and_is_logged_once(
    untold: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    (low, high) = torch_versions.CHECKED_TORCH
    monkeypatch.setattr(torch_versions, "torch_version", lambda: (high[0], high[1] + 1))
    state = {
        f"w{i}": torch.randn(1000, generator=torch.Generator().manual_seed(i)) for i in range(4)
    }
    state["epoch"] = 3
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert not torch_versions.checked_torch()
        with CheckpointManager(tmp_path / "run", 1, chkpt_on_preemption=False) as mgr:
            assert mgr.save(1, state)
            assert mgr.save_async(2, state)
            mgr.join()
            target = {
                k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0
                for k, v in state.items()
            }
            mgr.restore(2, target)
    assert all(torch.equal(target[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))
    assert target["epoch"] == 3
    told = _told(caplog)
    expected = f"torch {high[0]}.{high[1] + 1} is outside {low[0]}.{low[1]}-{high[0]}.{high[1]}"
    assert len(told) == 1 and told[0].startswith(expected), told
