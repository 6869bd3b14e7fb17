"""The owner lease held by the ``ckptmgr`` command line while it deletes steps.

``ckptmgr rm`` and ``ckptmgr prune`` delete as a manager's retention does, and like a manager
they hold the root's owner lease (:mod:`ckptmgr.lease`) while they do: a root that a running
job owns is refused, rather than having steps deleted under that job (the step it would resume
from, say), and a job that starts meanwhile is refused until the command is done. A root that
another ``ckptmgr`` command holds is waited for (two prunes at once both do their work). A dead
owner, or one whose heartbeat is stale, is taken over as a manager would. ``--force`` deletes
without the lease.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from ckptmgr.errors import CheckpointError
from ckptmgr.lease import LeaseHeldError, OwnerLease
from ckptmgr.storage import CheckpointStorage

COMMAND_WAIT_S = 300.0
"""How long a command waits for another ``ckptmgr`` command that holds the root."""
_POLL_S = 0.2
_JOB_PREFIX = "ckptmgr-cli-"


@contextmanager
def holding_the_root(storage: CheckpointStorage, command: str, *, force: bool) -> Iterator[None]:
    """Hold ``storage``'s owner lease for the body (nothing with ``force``); a root owned by a
    live job raises ``CheckpointError`` naming it, before anything is deleted; one held by
    another ``ckptmgr`` command is waited for, up to :data:`COMMAND_WAIT_S`."""
    if force:
        yield
        return
    # A job id of its own: a command run inside the training job's allocation (the same SLURM
    # or torchrun id) must not count as that job restarting, which takes its lease over.
    job_id = f"{_JOB_PREFIX}{command}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    lease = OwnerLease(storage.fs, storage.root, job_id=job_id)
    deadline = time.monotonic() + COMMAND_WAIT_S
    while True:
        try:
            storage.call(f"acquire the owner lease of {storage.url}", lease.acquire)
            break
        except LeaseHeldError as exc:
            owner = exc.owner
            if not owner.job_id.startswith(_JOB_PREFIX):
                raise CheckpointError(
                    f"{storage.url} is owned by a running job ({owner.describe(time.time())}); "
                    f"`ckptmgr {command}` deletes nothing under it. Stop that job first (its "
                    "manager's retention deletes as it saves), or pass --force to delete anyway"
                ) from exc
            if time.monotonic() >= deadline:
                raise CheckpointError(
                    f"{storage.url} was held by another ckptmgr command "
                    f"({owner.describe(time.time())}) for {COMMAND_WAIT_S:g} s; "
                    f"`ckptmgr {command}` deleted nothing"
                ) from exc
            time.sleep(_POLL_S)  # (another command's deletes: seconds, as a rule)
    try:
        yield
    finally:
        lease.release()
