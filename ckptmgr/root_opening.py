"""Opening a manager's checkpoint root: on every rank together, and failing on every rank together.

Every rank opens the root's file system (creating the root unless read-only); rank 0 also takes
the owner lease (see :mod:`ckptmgr.lease`), removes old leftovers and lists the committed steps.
Then the ranks exchange what happened in one collective, whatever failed: a rank whose own part
failed raises its error unchanged, and the others raise a :class:`CheckpointError` naming that
rank and its error. No rank is left waiting for the collective timeout in a collective that a
failed rank never joins.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

from ckptmgr.collectives import Collectives
from ckptmgr.config import CheckpointConfig
from ckptmgr.errors import CheckpointError, describe_error
from ckptmgr.lease import COMMAND_WAIT_S, OwnerLease, acquire_waiting_for_commands
from ckptmgr.storage import CheckpointStorage


@dataclass
class OpenedRoot:
    """A root opened by :func:`open_root` on this rank."""

    storage: CheckpointStorage
    lease: OwnerLease | None
    """The owner lease, held on rank 0 of a manager that writes; None elsewhere."""
    committed: list[int]
    """The committed steps rank 0 listed (the same list on every rank)."""


def open_root(config: CheckpointConfig, comm: Collectives) -> OpenedRoot:
    """Open ``config.path`` on every rank of ``comm`` (a collective over its background group).

    Raises this rank's own error unchanged (a file system's ``OSError``, a ``CheckpointError``
    refusing the root); if only another rank failed, a ``CheckpointError`` naming it. A lease
    taken here is given back before anything is raised.
    """
    storage: CheckpointStorage | None = None
    lease: OwnerLease | None = None
    listed: list[int] = []
    error: Exception | None = None
    try:
        storage = CheckpointStorage(
            config.path, config.storage_options, config.retry, create=not config.read_only
        )
        if config.async_mode == "process" and not storage.reachable_from_other_processes:
            raise CheckpointError(
                f"async_mode='process' writes from a daemon process, which cannot reach "
                f"{config.path!r} (an in-memory file system); use async_mode='thread'"
            )
        if comm.is_coordinator:
            # The other ranks wait in the collective below meanwhile: a command holding the
            # root is waited for well within its timeout.
            wait_s = COMMAND_WAIT_S
            if comm.world_size > 1:
                wait_s = min(wait_s, config.collective_timeout_s / 2)
            lease, listed = _list_as_coordinator(storage, config, wait_s)
    except Exception as exc:
        error = exc
    try:
        outcomes = comm.all_gather(
            (_told(error), listed if comm.is_coordinator else None), comm.background_group
        )
    except BaseException:  # a rank that never came (or an interrupt): no manager, no lease
        if lease is not None:
            lease.release()
        raise
    if error is not None or any(told is not None for told, _ in outcomes):
        if lease is not None:
            lease.release()
        if error is not None:
            raise error
        rank, (refusal, message) = next((r, told) for r, (told, _) in enumerate(outcomes) if told)
        # a refusal (a CheckpointError: the owner lease names the owner) reads the same everywhere
        raise CheckpointError(message if refusal else f"rank {rank}: {message}")
    assert storage is not None  # (no error: made on every rank)
    return OpenedRoot(storage, lease, outcomes[0][1])


def _told(error: Exception | None) -> tuple[bool, str] | None:
    """What the other ranks are told of this rank's ``error``: (is it a ``CheckpointError``,
    its message) for those, else its type and first line."""
    if error is None:
        return None
    if isinstance(error, CheckpointError):
        return True, str(error)
    return False, f"opening the checkpoint root failed: {describe_error(error)}"


def _list_as_coordinator(
    storage: CheckpointStorage, config: CheckpointConfig, wait_s: float
) -> tuple[OwnerLease | None, list[int]]:
    """Rank 0's part: (the owner lease, taken, after waiting up to ``wait_s`` for a ``ckptmgr``
    command that holds it; the committed steps, after the leftover sweep), or for a read-only
    manager (no lease, no sweep: another job may be writing) just the list."""
    if config.read_only:
        return None, storage.committed_steps()
    lease = OwnerLease(
        storage.fs, storage.root, timeout_s=config.lease_timeout_s, take_over=config.take_over
    )
    try:  # (a storage operation: retried on a transient error, as every other)
        try:
            what = f"acquire the owner lease of {config.path}"
            acquire_waiting_for_commands(lambda: storage.call(what, lease.acquire), wait_s)
        except FileNotFoundError as exc:  # (writing an object: its bucket is missing)
            if not storage.is_object_store:
                raise
            raise FileNotFoundError(
                errno.ENOENT,
                f"cannot write the owner lease of {config.path}: its bucket does not exist "
                f"(the store answered 'not found': {exc}); ckptmgr creates no bucket",
                lease.path,
            ) from exc
        return lease, storage.sweep_and_list(config.leftover_grace_s)
    except BaseException:
        lease.release()
        raise
