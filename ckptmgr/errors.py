"""Exceptions raised by ckptmgr."""

from __future__ import annotations

from collections.abc import Iterable


class CheckpointError(Exception):
    """Base class of every error ckptmgr raises about a checkpoint.

    Errors that come from a background save carry the original exception as ``__cause__``.
    """


class StepNotFoundError(CheckpointError, LookupError):
    """A step was asked for that has no committed checkpoint."""

    def __init__(self, step: int, available: Iterable[int]) -> None:
        self.step = step
        self.available = sorted(available)
        super().__init__(
            f"no committed checkpoint for step {step}; available steps: {self.available or 'none'}"
        )
