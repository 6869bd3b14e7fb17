"""The owner lease held by the ``ckptmgr`` command line while it deletes steps.

``ckptmgr rm`` and ``ckptmgr prune`` delete as a manager's retention does, and like a manager
they hold the root's owner lease (:mod:`ckptmgr.lease`) while they do: a root that a running
job owns is refused, rather than having steps deleted under that job (the step it would resume
from, say), and a job that starts meanwhile waits for the command, as does another ``ckptmgr``
command (two prunes at once both do their work). A dead
owner, or one whose heartbeat is stale, is taken over as a manager would. ``--force`` deletes
without the lease.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ckptmgr.errors import CheckpointError
from ckptmgr.lease import (
    CLI_JOB_PREFIX,
    LeaseHeldError,
    OwnerLease,
    acquire_waiting_for_commands,
    is_command,
)
from ckptmgr.storage import CheckpointStorage


@contextmanager
def holding_the_root(
    storage: CheckpointStorage, command: str, *, force: bool
) -> Iterator[Callable[[], None]]:
    """Hold ``storage``'s owner lease for the body (nothing with ``force``); a root owned by a
    live job raises ``CheckpointError`` naming it, before anything is deleted; one held by
    another ``ckptmgr`` command is waited for, up to :data:`ckptmgr.lease.COMMAND_WAIT_S`.

    Yields a function to call before each delete: it raises ``LeaseLostError`` once a job took
    the root over (``take_over=True``), so that no step is deleted under that job."""
    if force:
        yield _nothing
        return
    # A job id of its own: a command run inside the training job's allocation (the same SLURM
    # or torchrun id) must not count as that job restarting, which takes its lease over.
    job_id = f"{CLI_JOB_PREFIX}{command}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    lease = OwnerLease(storage.fs, storage.root, job_id=job_id)
    what = f"acquire the owner lease of {storage.url}"
    try:
        acquire_waiting_for_commands(lambda: storage.call(what, lease.acquire))
    except LeaseHeldError as exc:
        if is_command(exc.owner):
            raise CheckpointError(f"{exc}; `ckptmgr {command}` deleted nothing") from exc
        raise CheckpointError(
            f"{storage.url} is owned by a running job ({exc.owner.describe(time.time())}); "
            f"`ckptmgr {command}` deletes nothing under it. Stop that job first (its manager's "
            "retention deletes as it saves), or pass --force to delete anyway"
        ) from exc
    try:
        yield lease.confirm
    finally:
        lease.release()


def _nothing() -> None:
    """What ``--force`` checks before each delete."""
