"""Fault injection inside the checkpoint daemon of ``async_mode="process"``, a spawned process
that a test cannot monkeypatch: a :class:`HeldRead` travels to it with the daemon's start-up
arguments, and unpickling it there installs the fault before the daemon serves a save."""

from __future__ import annotations

import os
from typing import Any


def hold_reads_of(path: str, release: str) -> None:
    """In this process, a read of the local file ``path`` by ckptmgr's storage waits until the
    FIFO ``release`` is opened for writing (and closed) by another process."""
    from ckptmgr import storage

    read = storage.read_regular_file

    def held_read(target: str) -> bytes:
        if os.path.abspath(target) == path:
            with open(release, "rb") as fifo:  # blocks until a writer opens it
                fifo.read()
        return read(target)

    storage.read_regular_file = held_read  # type: ignore[assignment]


class HeldRead:
    """Pickled into the daemon (set as an attribute of its start-up arguments), it calls
    :func:`hold_reads_of` there."""

    def __init__(self, path: str, release: str) -> None:
        self.path = os.path.abspath(path)
        self.release = release

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return hold_reads_of, (self.path, self.release)
