"""Retention policies: which committed steps to keep.

A policy is one small object with one method, ``keep(checkpoints) -> set of steps``. Policies
compose with ``|``: a step is kept if any policy keeps it.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class CheckpointInfo:
    """What a retention policy may look at for one committed step (read from its commit record)."""

    step: int
    committed_at: _dt.datetime
    metrics: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class RetentionPolicy(Protocol):
    """Decides which of the committed checkpoints to keep."""

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        """Return the steps this policy wants kept."""
        ...


class _Composable:
    def __or__(self, other: RetentionPolicy) -> AnyOf:
        return AnyOf([self, other])  # type: ignore[list-item]


@dataclass(frozen=True)
class KeepLatest(_Composable):
    """Keep the ``n`` highest-numbered steps."""

    n: int

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"KeepLatest n must be a positive int, got {self.n!r}")

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        """The ``n`` highest steps."""
        return set(sorted(c.step for c in checkpoints)[-self.n :])


@dataclass(frozen=True)
class KeepAll(_Composable):
    """Keep every step."""

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        """Every step."""
        return {c.step for c in checkpoints}


@dataclass(frozen=True)
class AnyOf(_Composable):
    """Keep a step if any of ``policies`` keeps it."""

    policies: Sequence[RetentionPolicy]

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        """The union of what every policy keeps."""
        kept: set[int] = set()
        for policy in self.policies:
            kept |= policy.keep(checkpoints)
        return kept

    def __or__(self, other: RetentionPolicy) -> AnyOf:
        return AnyOf([*self.policies, other])


def steps_to_delete(
    policy: RetentionPolicy | None,
    checkpoints: Sequence[CheckpointInfo],
    protected: set[int],
) -> list[int]:
    """Steps that no policy keeps and that are not protected; nothing when there is no policy."""
    if policy is None or not checkpoints:
        return []
    kept = policy.keep(checkpoints) | protected
    return sorted(c.step for c in checkpoints if c.step not in kept)
