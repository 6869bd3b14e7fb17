"""The save a checkpoint daemon runs (``async_mode="process"``): the writer thread's, not DCP's.

DCP's daemon (``torch.distributed.checkpoint._async_process_executor``) saves each request with
``dcp.save`` and DCP's default planner: every save is planned from scratch, its whole metadata
is broadcast back to every rank, and every rank sends all its write results to the
coordinator. With thousands of DTensors that is most of a save (2 ranks, 5,000 small DTensors:
4.9 s a save in the daemon against 0.20 s on thread mode's writer thread, which keeps its
plans, its pickled ``.metadata`` and its write results from one save to the next and stops at
the coordinator's ``finish``). :func:`save_in_daemon` replaces the daemon's save with
:func:`ckptmgr.dcp_io.save_tensors`, over the daemons' own gloo group, with a
:class:`~ckptmgr.save_plans.SavePlanCache` that lives in the daemon: a daemon serves one
manager, so its plans are that manager's.

A save that fails drops what the daemon kept (the next plans from scratch, as in thread mode).
Under ``torch.distributed`` the ranks replace their daemons together after any failed save, so
no daemon keeps a plan that another dropped; a save that every daemon wrote but whose commit
then failed in the training process leaves each daemon's plans in place, which stay the same on
every rank.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import metadata as dcp_metadata

from ckptmgr import dcp_io
from ckptmgr.save_plans import SavePlanCache

_PLANS: SavePlanCache | None = None
"""In a daemon: the plans of its manager's saves, made on its first save."""


def save_in_daemon(
    state_dict: dict[str, Any],
    *,
    checkpoint_request_id: Any,
    storage_writer: Any = None,
    planner: Any = None,
    no_dist: bool = False,
    use_collectives: bool = True,
) -> dcp_metadata.Metadata:
    """In a daemon: save one request (the arguments of DCP's daemon-side save) as the writer
    thread of thread mode saves; the finished metadata on the coordinator, an empty one on the
    other ranks (whose manager needs none). ckptmgr never sends a checkpoint id, a planner of
    its own or ``use_collectives=False``; a request with any of them is refused."""
    checkpoint_id = getattr(checkpoint_request_id, "checkpoint_id", None)
    if checkpoint_id is not None or planner is not None or not use_collectives:
        raise ValueError(
            "the checkpoint daemon saves ckptmgr's requests only: no checkpoint id, planner "
            f"or use_collectives=False (got {checkpoint_id!r}, {planner!r}, {use_collectives})"
        )
    global _PLANS
    if _PLANS is None:
        _PLANS = SavePlanCache()
    plans = _PLANS
    if hasattr(storage_writer, "metadata_file"):  # ckptmgr's writers: .metadata kept pickled
        storage_writer.metadata_file = plans.metadata_file
    group = None if no_dist else dist.group.WORLD
    try:
        metadata = dcp_io.save_tensors(
            dict(state_dict),  # (the daemon keeps the dict it was sent: see SaveProcess)
            storage_writer,
            group,
            plans.planner(),
            plans.kept_results,
            no_dist=no_dist,
        )
    except BaseException:
        plans.forget()
        raise
    return metadata if metadata is not None else dcp_metadata.Metadata(state_dict_metadata={})


def holds_plans() -> bool:
    """In a daemon: True while it keeps DCP's plans of an earlier save (a module-level function,
    for :meth:`ckptmgr.save_process.SaveProcess.run_when_idle` to ask the daemon)."""
    return _PLANS is not None and _PLANS.holds_plans()
