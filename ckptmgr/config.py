"""CheckpointConfig: every CheckpointManager setting, validated, loadable from dict/JSON/YAML."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ckptmgr.preemption import PreemptionConfig
from ckptmgr.retention import parse_policy
from ckptmgr.retry import RetryConfig
from ckptmgr.save_policy import parse_save_policy
from ckptmgr.setting_types import Seconds


class CheckpointConfig(BaseModel):
    """The settings of a :class:`~ckptmgr.CheckpointManager`.

    The first seven fields match PyTorch/XLA's CheckpointManager constructor. Invalid values raise
    ``pydantic.ValidationError`` (a ``ValueError``) naming the field.
    """

    model_config = ConfigDict(
        extra="forbid",
        arbitrary_types_allowed=True,
        validate_default=True,
    )

    path: str = Field(min_length=1, description="Local path or fsspec URL of the checkpoint root.")
    save_interval: int | None = Field(
        default=None,
        strict=True,
        gt=0,
        description="Save when step % save_interval == 0 (None: only save_policy decides).",
    )
    max_to_keep: int = Field(
        default=0, strict=True, ge=0, description="0 keeps every step; N keeps the N newest."
    )
    max_pending_async: int = Field(
        default=1,
        strict=True,
        gt=0,
        description="Host staging slots: the most async saves whose data is not yet written.",
    )
    num_of_threads: int = Field(
        default=1,
        strict=True,
        gt=0,
        description="Writer threads per rank: one data file each; restores read them in parallel.",
    )
    async_mode: Literal["thread", "process"] = Field(
        default="thread",
        description="Where save_async's background write runs: a thread of this process, or "
        "'process': a checkpoint daemon process (DCP's process-based async checkpointing), for "
        "Python-bound training loops.",
    )
    staging_budget_bytes: int | None = Field(
        default=None,
        strict=True,
        ge=0,
        description="Bound on host memory of all async staging buffers together (None: "
        "max_pending_async copies of the state). A save that would exceed it waits for "
        "in-flight saves (back-pressure).",
    )
    process_group: Any = Field(default=None, exclude=True, description="torch.distributed group.")
    chkpt_on_preemption: bool = Field(
        default=True, strict=True, description="Save at the first step after a preemption notice."
    )
    retention: list[Any] = Field(
        default_factory=list,
        description="Retention policies (objects or {type: ...} mappings); a step is kept if any "
        "keeps it.",
    )
    retention_dry_run: bool = Field(
        default=False, strict=True, description="Log what retention would delete; delete nothing."
    )
    save_policy: list[Any] = Field(
        default_factory=list,
        description="Save policies (objects or {type: ...} mappings); a step is saved if any "
        "wants it, in addition to save_interval.",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the fsspec file system."
    )
    retry: RetryConfig = Field(
        default_factory=RetryConfig,
        description="How transient errors of remote stores are retried (not used on local disks).",
    )
    preemption: PreemptionConfig = Field(
        default_factory=PreemptionConfig, description="Where preemption notices come from."
    )
    leftover_grace_s: Seconds = Field(
        default=600.0,
        ge=0,
        description="Age after which uncommitted leftovers of interrupted saves are removed.",
    )
    collective_timeout_s: Seconds = Field(
        default=600.0,
        gt=0,
        allow_inf_nan=False,
        description="Timeout of the manager's own collectives.",
    )
    take_over: bool = Field(
        default=False,
        strict=True,
        description="Take the owner lease (owner.json) of the root from another job that still "
        "looks alive; a dead or stale owner is taken over without it.",
    )
    lease_timeout_s: Seconds = Field(
        default=60.0,
        gt=0,
        allow_inf_nan=False,
        description="An owner lease whose heartbeat is older than this many seconds (and than "
        "the owner's own lease_timeout_s) is taken over (the heartbeat is refreshed every "
        "lease_timeout_s / 4).",
    )
    read_only: bool = Field(
        default=False,
        strict=True,
        description="List and restore only: no owner lease, no leftover sweep, no preemption "
        "handlers; save and save_async raise CheckpointError.",
    )

    @field_validator("path", mode="before")
    @classmethod
    def _path_to_str(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator("storage_options", mode="before")
    @classmethod
    def _none_is_empty(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("retry", mode="before")
    @classmethod
    def _default_retry(cls, value: Any) -> Any:
        return RetryConfig() if value is None else value

    @field_validator("preemption", mode="before")
    @classmethod
    def _default_preemption(cls, value: Any) -> Any:
        return PreemptionConfig() if value is None else value

    @field_validator("retention", mode="before")
    @classmethod
    def _retention_policies(cls, value: Any) -> Any:
        return [parse_policy(policy) for policy in _as_list(value)]

    @field_validator("save_policy", mode="before")
    @classmethod
    def _save_policies(cls, value: Any) -> Any:
        return [parse_save_policy(policy) for policy in _as_list(value)]

    @model_validator(mode="after")
    def _something_decides_saves(self) -> CheckpointConfig:
        if self.save_interval is None and not self.save_policy:
            raise ValueError("give save_interval (steps) or save_policy; neither was given")
        return self

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> CheckpointConfig:
        """Load a config from a ``.json``, ``.yaml`` or ``.yml`` file."""
        file = Path(path)
        text = file.read_text()
        if file.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        elif file.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            raise ValueError(f"config file must end in .json, .yaml or .yml: {file}")
        if not isinstance(data, dict):
            raise ValueError(f"config file {file} must hold a mapping of settings")
        return cls.model_validate(data)


def _as_list(value: Any) -> list[Any]:
    """None -> [], one item -> [item], a list or tuple -> its items (None items dropped)."""
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    return [item for item in items if item is not None]
