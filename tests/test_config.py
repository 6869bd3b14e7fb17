"""CheckpointConfig validation, CheckpointManager.from_config, and the XLA-compatible signature."""

from __future__ import annotations

import inspect
import json
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from ckptmgr import CheckpointConfig, CheckpointManager

INVALID = [
    pytest.param("save_interval", 0, id="save_interval=0"),
    pytest.param("save_interval", -1, id="save_interval=-1"),
    pytest.param("save_interval", True, id="save_interval=True"),
    pytest.param("save_interval", 1.5, id="save_interval=1.5"),
    pytest.param("save_interval", "5", id="save_interval='5'"),
    pytest.param("save_interval", None, id="save_interval=None"),
    pytest.param("max_to_keep", -1, id="max_to_keep=-1"),
    pytest.param("max_to_keep", 1.0, id="max_to_keep=1.0"),
    pytest.param("max_pending_async", 0, id="max_pending_async=0"),
    pytest.param("max_pending_async", False, id="max_pending_async=False"),
    pytest.param("num_of_threads", 0, id="num_of_threads=0"),
    # inf broke the lease heartbeat (OverflowError) and the process group's timeout
    pytest.param("lease_timeout_s", float("inf"), id="lease_timeout_s=inf"),
    pytest.param("collective_timeout_s", float("inf"), id="collective_timeout_s=inf"),
    pytest.param("collective_timeout_s", float("nan"), id="collective_timeout_s=nan"),
    # a bool is no number of seconds or attempts: True was taken for 1
    pytest.param("leftover_grace_s", True, id="leftover_grace_s=True"),
    pytest.param("collective_timeout_s", True, id="collective_timeout_s=True"),
    pytest.param("lease_timeout_s", True, id="lease_timeout_s=True"),
    pytest.param("retry", {"max_attempts": True}, id="retry.max_attempts=True"),
    pytest.param("retry", {"deadline_s": True}, id="retry.deadline_s=True"),
    pytest.param("preemption", {"gce_long_poll_s": True}, id="preemption.gce_long_poll_s=True"),
    pytest.param("preemption", {"poll_interval_s": True}, id="preemption.poll_interval_s=True"),
    pytest.param("lease_timeout_s", np.True_, id="lease_timeout_s=np.True_"),
]

XLA_PARAMETERS = [
    "path",
    "save_interval",
    "max_to_keep",
    "max_pending_async",
    "num_of_threads",
    "process_group",
    "chkpt_on_preemption",
]


def settings(path: Path, **overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {"path": str(path), "save_interval": 10}
    values["chkpt_on_preemption"] = False
    values.update(overrides)
    return values


def save_steps(manager: CheckpointManager, steps: range) -> list[int]:
    """Save a tiny state at every step of ``steps``; returns the steps that were saved."""
    saved = []
    for step in steps:
        if manager.save(step, {"w": torch.full((2,), float(step))}):
            saved.append(step)
    return saved


@pytest.mark.parametrize(("name", "value"), INVALID)
def test_invalid_setting_raises_value_error_naming_it(
    ckpt_dir: Path, name: str, value: Any
) -> None:
    with pytest.raises(ValueError, match=name):
        CheckpointConfig(**settings(ckpt_dir, **{name: value}))
    with pytest.raises(ValueError, match=name):
        CheckpointManager(**settings(ckpt_dir, **{name: value}))
    with pytest.raises(ValueError, match=name):
        CheckpointManager.from_config(settings(ckpt_dir, **{name: value}))
    assert not ckpt_dir.exists()  # validation happens before anything touches storage


def test_invalid_positional_arguments_raise_value_error(ckpt_dir: Path) -> None:
    with pytest.raises(ValueError, match="save_interval"):
        CheckpointManager(ckpt_dir, 0)
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointManager(ckpt_dir, 10, -1)
    with pytest.raises(ValueError, match="max_pending_async"):
        CheckpointManager(ckpt_dir, 10, 2, 0)
    assert not ckpt_dir.exists()


def test_numbers_as_yaml_and_numpy_give_them_are_settings(ckpt_dir: Path) -> None:
    """Seconds and counts take what YAML and numpy give: PyYAML reads `1e3` as a string, and
    a count may be a numpy integer (a bool is refused, above)."""
    config = CheckpointConfig(
        **settings(ckpt_dir, leftover_grace_s="1e3", lease_timeout_s=np.float64(30.0)),
        retry={"max_attempts": np.int64(3)},
        preemption={"gce_long_poll_s": np.int64(30)},
    )
    assert config.leftover_grace_s == 1000.0 and config.lease_timeout_s == 30.0
    assert config.retry.max_attempts == 3 and config.preemption.gce_long_poll_s == 30


def test_from_config_checks_a_config_changed_after_it_was_made(ckpt_dir: Path) -> None:
    """A field assigned after the config was made is not checked then (pydantic checks fields
    as they are given): from_config took max_to_keep = -5 and lease_timeout_s = True (a 1 s
    lease). It checks the config again, in place."""
    config = CheckpointConfig(**settings(ckpt_dir))
    config.max_to_keep = -5
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointManager.from_config(config)
    config.max_to_keep = 3
    config.retention = [{"type": "keep_every_n_steps", "n": 100}]  # (a form the model parses)
    with CheckpointManager.from_config(config) as manager:
        assert manager.config is config and manager.max_to_keep == 3
        assert [type(policy).__name__ for policy in config.retention] == ["KeepEveryNSteps"]


def test_unknown_setting_is_rejected(ckpt_dir: Path) -> None:
    with pytest.raises(ValueError, match="save_intervall"):
        CheckpointConfig.model_validate({"path": str(ckpt_dir), "save_intervall": 5})
    with pytest.raises(ValueError, match="save_intervall"):
        CheckpointManager.from_config({"path": str(ckpt_dir), "save_intervall": 5})


def test_valid_config_defaults(ckpt_dir: Path) -> None:
    config = CheckpointConfig(path=ckpt_dir, save_interval=1)
    assert config.path == str(ckpt_dir)
    assert (config.max_to_keep, config.max_pending_async, config.num_of_threads) == (0, 1, 1)
    assert config.process_group is None
    assert config.chkpt_on_preemption is True
    assert config.storage_options == {}


def check_built(manager: CheckpointManager, path: Path) -> None:
    """The manager uses the settings: interval 5, keep 2, no SIGTERM handler installed."""
    assert manager.config.path == str(path)
    assert manager.config.save_interval == 5
    assert manager.config.max_to_keep == 2
    assert manager.config.max_pending_async == 3
    assert manager.config.chkpt_on_preemption is False
    assert save_steps(manager, range(16)) == [0, 5, 10, 15]
    assert manager.all_steps() == [10, 15]
    assert sorted(p.name for p in path.iterdir() if p.name != "owner.json") == [
        "step_000000000010",
        "step_000000000015",
    ]


FILE_SETTINGS = {
    "save_interval": 5,
    "max_to_keep": 2,
    "max_pending_async": 3,
    "chkpt_on_preemption": False,
}


def test_from_config_object(ckpt_dir: Path) -> None:
    config = CheckpointConfig(path=str(ckpt_dir), **FILE_SETTINGS)
    with CheckpointManager.from_config(config) as manager:
        assert manager.config == config
        check_built(manager, ckpt_dir)


def test_from_config_dict(ckpt_dir: Path) -> None:
    with CheckpointManager.from_config({"path": str(ckpt_dir), **FILE_SETTINGS}) as manager:
        check_built(manager, ckpt_dir)


def test_from_config_json_file(ckpt_dir: Path, tmp_path: Path) -> None:
    file = tmp_path / "ckpt.json"
    file.write_text(json.dumps({"path": str(ckpt_dir), **FILE_SETTINGS}))
    with CheckpointManager.from_config(file) as manager:
        check_built(manager, ckpt_dir)
    assert CheckpointConfig.from_file(str(file)) == CheckpointConfig.from_file(file)


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_from_config_yaml_file(ckpt_dir: Path, tmp_path: Path, suffix: str) -> None:
    file = tmp_path / f"ckpt{suffix}"
    file.write_text(
        f"# checkpointing\npath: {ckpt_dir}\nsave_interval: 5\nmax_to_keep: 2\n"
        "max_pending_async: 3\nchkpt_on_preemption: false\n"
    )
    assert yaml.safe_load(file.read_text())["chkpt_on_preemption"] is False
    with CheckpointManager.from_config(str(file)) as manager:
        check_built(manager, ckpt_dir)


def test_invalid_config_file_raises_value_error_naming_the_setting(tmp_path: Path) -> None:
    json_file = tmp_path / "bad.json"
    json_file.write_text(json.dumps({"path": str(tmp_path / "c"), "save_interval": 0}))
    with pytest.raises(ValueError, match="save_interval"):
        CheckpointManager.from_config(json_file)
    yaml_file = tmp_path / "bad.yaml"
    yaml_file.write_text(f"path: {tmp_path / 'c'}\nsave_interval: 5\nmax_to_keep: -1\n")
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointManager.from_config(yaml_file)
    other = tmp_path / "ckpt.toml"
    other.write_text("save_interval = 5\n")
    with pytest.raises(ValueError, match=r"\.json"):
        CheckpointManager.from_config(other)
    assert not (tmp_path / "c").exists()


def test_positional_call_like_torch_xla(ckpt_dir: Path) -> None:
    handler = signal.getsignal(signal.SIGTERM)
    with CheckpointManager(ckpt_dir, 10, 2, 1, 1, None, False) as manager:
        config = manager.config
        assert config.path == str(ckpt_dir)
        assert config.save_interval == 10
        assert config.max_to_keep == 2
        assert config.max_pending_async == 1
        assert config.num_of_threads == 1
        assert config.process_group is None
        assert config.chkpt_on_preemption is False
        # PyTorch/XLA's attributes, read-only
        assert manager.base_path == str(ckpt_dir) + os.sep
        assert (manager.save_interval, manager.max_to_keep) == (10, 2)
        assert (manager.num_of_threads, manager.chkpt_on_preemption) == (1, False)
        with pytest.raises(AttributeError):
            manager.save_interval = 5  # type: ignore[misc]
        assert signal.getsignal(signal.SIGTERM) is handler  # no preemption handler installed
        assert save_steps(manager, range(31)) == [0, 10, 20, 30]
        assert manager.all_steps() == [20, 30]
    assert signal.getsignal(signal.SIGTERM) is handler


def test_signature_matches_torch_xla() -> None:
    parameters = list(inspect.signature(CheckpointManager).parameters.values())
    positional = [p for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in positional] == XLA_PARAMETERS
    defaults = {p.name: p.default for p in positional[2:]}
    assert defaults == {
        "max_to_keep": 0,
        "max_pending_async": 1,
        "num_of_threads": 1,
        "process_group": None,
        "chkpt_on_preemption": True,
    }
    keyword_only = {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert {"retention", "storage_options", "preemption"} <= keyword_only


def test_extra_positional_argument_is_rejected(ckpt_dir: Path) -> None:
    with pytest.raises(TypeError):
        CheckpointManager(ckpt_dir, 10, 2, 1, 1, None, False, None)  # type: ignore[misc]
    assert not ckpt_dir.exists()


def test_keyword_call_like_torch_xla(ckpt_dir: Path) -> None:
    with CheckpointManager(
        path=str(ckpt_dir),
        save_interval=3,
        max_to_keep=0,
        max_pending_async=2,
        num_of_threads=2,
        process_group=None,
        chkpt_on_preemption=False,
    ) as manager:
        assert manager.config.num_of_threads == 2
        assert manager.config.max_pending_async == 2
        assert save_steps(manager, range(7)) == [0, 3, 6]
        assert manager.all_steps() == [0, 3, 6]  # max_to_keep=0 keeps every step


@pytest.mark.parametrize("name", ["CHLD", "SIGWINCH", "CONT", "SIGSEGV", "SIGBUS", "URG"])
def test_signals_of_normal_operation_or_faults_are_not_preemption_notices(name: str) -> None:
    """SIGCHLD arrives whenever a child process (a DataLoader worker) exits: as a notice it
    saved and, with exit_after_save, ended the job; faults and job control are no notices
    either."""
    from ckptmgr import PreemptionConfig

    with pytest.raises(ValueError, match="cannot be a preemption notice"):
        PreemptionConfig(signals=[name])
    assert PreemptionConfig(signals=["TERM", "SIGUSR1"]).signals == ["SIGTERM", "SIGUSR1"]
