"""Exceptions raised by ckptmgr."""

from __future__ import annotations

from collections.abc import Iterable


class CheckpointError(Exception):
    """Base class of every error ckptmgr raises about a checkpoint.

    Errors that come from a background save carry the original exception as ``__cause__``.
    """


class StepNotFoundError(CheckpointError, LookupError):
    """A step was asked for that has no committed checkpoint."""

    def __init__(self, step: int, available: Iterable[int], detail: str = "") -> None:
        """``detail``: why, where more is known (a step deleted while it was being read)."""
        self.step = step
        self.available = sorted(available)
        why = f" ({detail})" if detail else ""
        super().__init__(
            f"no committed checkpoint for step {step}{why}; available steps: "
            f"{self.available or 'none'}"
        )


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files are damaged, missing or not what ckptmgr wrote.

    Raised for a file whose size or checksum differs from its commit record, a missing file, a
    record or metadata file that cannot be parsed, a path that would leave the checkpoint
    directory, and a ``.metadata`` that would run code when unpickled. ``path`` names the file
    (relative to the step directory) when one file is to blame, and ``step`` the step when known.
    """

    def __init__(self, message: str, *, path: str | None = None, step: int | None = None) -> None:
        self.path = path
        self.step = step
        super().__init__(message)


def describe_error(error: BaseException | None) -> str | None:
    """``error``'s type and the first line of its message (at most 2,000 characters), as ranks
    tell each other of their failures; None for None."""
    if error is None:
        return None
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line}"[:2000]
