"""DCP's save over a process group, ending where the coordinator has written ``.metadata``.

DCP's save (``_save_state_dict``) runs its steps as collectives over the group: every rank's
local plan is gathered on the coordinator, which makes the global plan and scatters each rank
its part; every rank writes; the write results are gathered on the coordinator, which writes
``.metadata``; and then DCP broadcasts the whole metadata back to every rank. That metadata has
an entry per tensor and rank (a sharded state: a chunk per DTensor and rank), so each rank
unpickles all of it on every save, holding the GIL of the training process (2 ranks, 5,000
small DTensors: 1.6 MB, about 0.1 s per rank and save; it grows with ranks times tensors).

ckptmgr needs the metadata on the coordinator only: every save is followed by the manager's own
collectives (each rank's error, then the commit's outcome), from which every rank learns
whether the step committed. :func:`save_over_group` runs DCP's steps with DCP's planner and
storage writer (their public protocol: the same calls, in the same order, as DCP's own save) and
stops after the coordinator's ``finish``. A rank's write results that are the same as at its
last save are not sent again (:mod:`ckptmgr.kept_results`).

Failures are DCP's too: an error of any rank while planning fails the save on every rank, with
DCP's ``CheckpointException`` (each failing rank's exception and traceback), before anything is
written. An error while writing raises on the rank that had it and on the coordinator (which
then writes no ``.metadata``); the other ranks return and learn of it from the manager's
collectives.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter

from ckptmgr.kept_results import KeptResults
from ckptmgr.step_collectives import FailedStep, exchange_plans, failures_of, gather_on, run_step


def save_over_group(
    state_dict: dict[str, Any],
    storage_writer: StorageWriter,
    planner: SavePlanner,
    group: dist.ProcessGroup,
    kept: KeptResults | None = None,
) -> Metadata | None:
    """Save ``state_dict`` with DCP's ``planner`` and ``storage_writer`` over ``group`` (rank 0
    of the group coordinates); returns the finished metadata on the coordinator, None on the
    other ranks. Raises DCP's ``CheckpointException`` (see the module's description).
    ``kept``: the write results of this rank's last save (and, on the coordinator, of every
    rank's), so that results unchanged since are not sent again (:mod:`ckptmgr.kept_results`)."""
    rank = dist.get_rank(group)
    world_size = dist.get_world_size(group)
    coordinator = dist.get_global_rank(group, 0)
    is_coordinator = rank == 0

    def local_plan() -> Any:
        planner.set_up_planner(
            state_dict=state_dict,
            storage_meta=storage_writer.storage_meta(),
            is_coordinator=is_coordinator,
        )
        if "kwargs" in inspect.signature(storage_writer.set_up_storage_writer).parameters:
            storage_writer.set_up_storage_writer(is_coordinator, rank=rank, use_collectives=True)
        else:
            storage_writer.set_up_storage_writer(is_coordinator)
        return storage_writer.prepare_local_plan(planner.create_local_plan())

    metadata: Metadata | None = None

    def global_plan(plans: list[Any]) -> list[Any]:
        nonlocal metadata
        global_plans, metadata = planner.create_global_plan(plans)
        return storage_writer.prepare_global_plan(global_plans)

    reply = exchange_plans(run_step(local_plan), global_plan, group)

    def write() -> Any:
        writes = storage_writer.write_data(planner.finish_plan(reply), planner)
        writes.wait()
        return writes.value()

    written = run_step(write)
    sent = written if kept is None else kept.outgoing(written)
    results = gather_on(sent, group, coordinator, is_coordinator, world_size)
    if results is not None and kept is not None:
        results = kept.incoming(results)
    if not is_coordinator:
        if isinstance(written, FailedStep):
            raise CheckpointException("write", {rank: written.wrapped})
        return None
    assert results is not None and metadata is not None
    failures = failures_of(results)
    if failures:
        raise CheckpointException("write", failures)
    storage_writer.finish(metadata=metadata, results=results)
    return metadata
