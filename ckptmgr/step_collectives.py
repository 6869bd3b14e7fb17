"""The collectives of DCP's steps as ckptmgr runs them (:mod:`ckptmgr.collective_save`,
:mod:`ckptmgr.collective_load`): each rank's outcome of a step (what it returned, or the
exception it raised) sent to the coordinator or to every rank, as DCP's own ``_DistWrapper``
sends them, so that a rank that failed still joins every collective and no rank waits alone.
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ckptmgr.errors import CheckpointError


class FailedStep:
    """What a rank sends instead of a step's result: its exception and traceback, as DCP's
    ``CheckpointException`` holds them (``wrapped``)."""

    def __init__(self, error: BaseException) -> None:
        summary = traceback.extract_tb(error.__traceback__)
        for frame in summary:  # (code objects do not pickle: Python 3.13's frames hold them)
            if hasattr(frame, "_code"):
                object.__setattr__(frame, "_code", None)
        try:
            pickle.dumps(error)
        except Exception:  # an exception that does not pickle still fails the step everywhere
            error = CheckpointError(f"{type(error).__name__}: {error}")
        self.wrapped = (error, summary)


def failures_of(outcomes: list[Any]) -> dict[int, Any]:
    """The wrapped exceptions of the ranks whose outcome is a :class:`FailedStep`, by rank."""
    return {rank: got.wrapped for rank, got in enumerate(outcomes) if isinstance(got, FailedStep)}


def run_step(step: Callable[[], Any]) -> Any:
    """What ``step()`` returns, or a :class:`FailedStep` with what it raised."""
    try:
        return step()
    except BaseException as exc:  # (as DCP: every rank joins the next collective regardless)
        return FailedStep(exc)


def gather_on(
    value: Any, group: dist.ProcessGroup, coordinator: int, is_coordinator: bool, world_size: int
) -> list[Any] | None:
    """Every rank's ``value`` on the coordinator (a global rank), in rank order; None
    elsewhere."""
    gathered: list[Any] | None = [None] * world_size if is_coordinator else None
    dist.gather_object(value, gathered, dst=coordinator, group=group)
    return gathered


def scatter_from(values: list[Any] | None, group: dist.ProcessGroup, coordinator: int) -> Any:
    """This rank's value of the coordinator's ``values`` (one per rank)."""
    received: list[Any] = [None]
    dist.scatter_object_list(received, values, src=coordinator, group=group)
    return received[0]


def gather_everywhere(value: Any, group: dist.ProcessGroup, world_size: int) -> list[Any]:
    """Every rank's ``value`` on every rank, in rank order."""
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def exchange_plans(
    planned: Any, global_step: Callable[[list[Any]], list[Any]], group: dist.ProcessGroup
) -> Any:
    """DCP's exchange of plans: every rank's ``planned`` (its local plan, or a
    :class:`FailedStep`) gathered on the group's rank 0, which runs ``global_step`` on them
    (one plan per rank back) and scatters each rank its plan, returned here. Where any rank
    failed, or ``global_step`` raised, raises DCP's ``CheckpointException`` on every rank."""
    rank = dist.get_rank(group)
    world_size = dist.get_world_size(group)
    coordinator = dist.get_global_rank(group, 0)
    plans = gather_on(planned, group, coordinator, rank == 0, world_size)
    replies: list[Any] | None = None
    if plans is not None:
        failures = failures_of(plans)
        if not failures:
            try:
                replies = global_step(plans)
            except BaseException as exc:
                failures[rank] = FailedStep(exc).wrapped
        if failures:
            replies = [CheckpointException("plan", failures)] * world_size
    plan = scatter_from(replies, group, coordinator)
    if isinstance(plan, CheckpointException):
        raise plan
    return plan
