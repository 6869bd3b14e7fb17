"""DCP's load over a process group, without sending the load plans through the coordinator
where DCP's global step would change nothing in them.

DCP's load (``dcp.load``) first asks every item of the state whether it is ``Stateful``, then
runs its steps as collectives: every rank plans its reads, the plans are gathered on the
coordinator, which runs the planner's and the storage reader's global step and scatters each
rank its plan back; every rank reads; every rank learns whether all read. With DCP's default
load planner and file system readers the global step returns the plans as they came (torch
2.10-2.14: ``create_default_global_load_plan`` and ``FileSystemReader.prepare_global_plan``),
so the exchange only carries every rank's reads to the coordinator and back: a read item per
tensor chunk, pickled and unpickled four times (2 ranks, 5,000 DTensors: about 0.2 s of a 1.1 s
restore per rank; on the coordinator it grows with ranks times tensors).

:func:`load_over_group` runs the same steps with DCP's planner and storage reader (their
public protocol, the same calls in the same order) and, where the global step is DCP's
unchanged one (:func:`global_step_changes_nothing`), replaces the exchange with an agreement:
each rank says only whether it planned. A planning failure on any rank still fails the load on
every rank before any rank reads, and a read failure on any rank fails it on every rank after
the reads, with DCP's ``CheckpointException`` (each failing rank's exception and traceback).
The state's items are tensors (ckptmgr's), so DCP's ``Stateful`` pass is not run.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from ckptmgr.step_collectives import (
    FailedStep,
    exchange_plans,
    failures_of,
    gather_everywhere,
    run_step,
)
from ckptmgr.torch_versions import checked_torch


def global_step_changes_nothing(planner: LoadPlanner, storage_reader: StorageReader) -> bool:
    """True where ``planner``'s global step and ``storage_reader``'s are DCP's own of a torch
    whose global load step returns the plans unchanged."""
    return (
        checked_torch()
        and type(planner).create_global_plan is DefaultLoadPlanner.create_global_plan
        and type(storage_reader).prepare_global_plan is FileSystemReader.prepare_global_plan
    )


def load_over_group(
    state_dict: dict[str, Any],
    storage_reader: StorageReader,
    planner: LoadPlanner,
    group: dist.ProcessGroup,
) -> None:
    """Fill ``state_dict`` (tensors) in place with DCP's ``planner`` and ``storage_reader``
    over ``group`` (rank 0 of the group coordinates). Raises DCP's ``CheckpointException`` on
    every rank where any rank failed (see the module's description)."""
    rank = dist.get_rank(group)
    world_size = dist.get_world_size(group)
    is_coordinator = rank == 0

    ordered = {key: state_dict[key] for key in sorted(state_dict)}  # (as dcp.load plans)

    def local_plan() -> Any:
        metadata = storage_reader.read_metadata()
        planner.set_up_planner(ordered, metadata, is_coordinator)
        if "kwargs" in inspect.signature(storage_reader.set_up_storage_reader).parameters:
            storage_reader.set_up_storage_reader(
                metadata, is_coordinator, rank=rank, use_collectives=True
            )
        else:
            storage_reader.set_up_storage_reader(metadata, is_coordinator)
        return storage_reader.prepare_local_plan(planner.create_local_plan())

    planned = run_step(local_plan)
    if global_step_changes_nothing(planner, storage_reader):
        failed = planned if isinstance(planned, FailedStep) else None
        failures = failures_of(gather_everywhere(failed, group, world_size))
        if failures:
            raise CheckpointException("plan", failures)
        plan = planned
    else:
        plan = exchange_plans(
            planned,
            lambda plans: storage_reader.prepare_global_plan(planner.create_global_plan(plans)),
            group,
        )

    def read() -> None:
        reads = storage_reader.read_data(planner.finish_plan(plan), planner)
        reads.wait()

    failures = failures_of(gather_everywhere(run_step(read), group, world_size))
    if failures:
        raise CheckpointException("read", failures)
