"""The few collectives the manager needs, with single-process fallbacks.

Background saves run their collectives on a dedicated gloo group, so they can never interleave
with (or deadlock against) collectives the training loop issues on its own group.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as _dt
import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ckptmgr.errors import CheckpointError, describe_error


class Collectives:
    """Rank information and object collectives over the manager's process group."""

    def __init__(self, process_group: dist.ProcessGroup | None, timeout_s: float) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = process_group
        self.timeout_s = timeout_s
        if not self.distributed:
            if process_group is not None:
                raise ValueError("process_group was given but torch.distributed is not initialised")
            self.rank, self.world_size = 0, 1
            self._groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None
            return
        self._agreement_flags = torch.zeros(3, dtype=torch.int32)
        if process_group is not None and (
            process_group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(process_group) < 0
        ):
            # Its rank and size would be -1, and its groups None: the default group's, where
            # its collectives would meet the training loop's (or wait for them).
            raise ValueError(
                f"this rank ({dist.get_rank()} of the default group) is not in process_group: "
                "make the manager only on the ranks of its process_group"
            )
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
        timeout = _dt.timedelta(seconds=timeout_s)
        # Only the group's own ranks take part (use_local_synchronization), so managers of
        # disjoint subgroups can be created independently of each other.
        background_group = self._new_group(ranks, timeout)
        try:
            control_group = self._new_group(ranks, timeout)
        except BaseException:
            with contextlib.suppress(Exception):  # (the error raised is the rendezvous')
                dist.destroy_process_group(background_group)
            raise
        self._groups = (background_group, control_group)
        self._released = False
        self._made_in = os.getpid()
        _MANAGERS_COLLECTIVES.add(self)
        _GROUPS_TO_DESTROY_AT_EXIT[:] = [
            entry for entry in _GROUPS_TO_DESTROY_AT_EXIT if entry[1]() is not None
        ] + [(self._made_in, weakref.ref(group)) for group in self._groups]

    @property
    def background_group(self) -> dist.ProcessGroup | None:
        """The gloo group of DCP's planning and the commit protocol (None without
        ``torch.distributed``)."""
        return self._group(0)

    @property
    def control_group(self) -> dist.ProcessGroup | None:
        """The gloo group of save decisions (None without ``torch.distributed``)."""
        return self._group(1)

    def _group(self, index: int) -> dist.ProcessGroup | None:
        if self._groups is not None:
            return self._groups[index]
        if self.distributed and self._released:
            raise CheckpointError(
                "the manager's process groups were destroyed at interpreter exit: a manager "
                "cannot save or restore from an atexit hook that runs after ckptmgr's"
            )
        return None

    def drop_groups(self) -> None:
        """Drop the manager's two gloo groups (at interpreter exit, where they are destroyed):
        a later collective raises ``CheckpointError``."""
        self._groups, self._released = None, True

    def _new_group(self, ranks: list[int], timeout: _dt.timedelta) -> dist.ProcessGroup:
        """A gloo group of ``ranks``; a rendezvous that failed (another rank did not make its
        manager within the timeout, or died: ``DistStoreError`` and the like) as the
        ``CheckpointError`` of a failed collective, with torch's error as its cause."""
        try:
            return dist.new_group(
                ranks=ranks, backend="gloo", timeout=timeout, use_local_synchronization=True
            )
        except dist.DistError as exc:
            raise CheckpointError(
                "creating the manager's process groups with the other ranks failed: a rank "
                "died, or did not make its CheckpointManager within collective_timeout_s "
                f"({self.timeout_s:g} s): {describe_error(exc)}"
            ) from exc

    @property
    def is_coordinator(self) -> bool:
        """True on the rank that writes commit records and deletes steps."""
        return self.rank == 0

    def broadcast(self, obj: Any, group: dist.ProcessGroup | None) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed or self.world_size == 1:
            return obj
        box = [obj]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        with self._with_the_other_ranks("a broadcast"):
            dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    def all_gather(self, obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if not self.distributed or self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self._with_the_other_ranks("an all_gather"):
            dist.all_gather_object(out, obj, group=group)
        return out

    def agree(
        self, highest: int, coordinator_flag: bool, failed: bool = False
    ) -> tuple[int, bool, bool]:
        """(the highest ``highest`` of any rank, rank 0's ``coordinator_flag``, ``failed`` on any
        rank) on every rank. ``highest`` is a number from 0 (the manager's: 0 for no preemption
        notice, else the exit status it asks for), or a bool.

        One 3-element all_reduce(MAX) on the control group: other ranks contribute 0 for the
        second flag, so rank 0's value wins.
        """
        if not self.distributed or self.world_size == 1:
            return int(highest), coordinator_flag, failed
        mine = coordinator_flag if self.is_coordinator else False
        flags = self._agreement_flags  # one reused buffer: gloo sets up each new one (~0.2 ms)
        flags[0] = int(highest)
        flags[1] = int(mine)
        flags[2] = int(failed)
        with self._with_the_other_ranks("an all_reduce"):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.control_group)
        agreed_highest, agreed_coordinator, any_failed = flags.tolist()
        return int(agreed_highest), bool(agreed_coordinator), bool(any_failed)

    @contextmanager
    def _with_the_other_ranks(self, what: str) -> Iterator[None]:
        """Run a collective; gloo's failure of it (a ``RuntimeError``: a rank died, or did not
        come within ``collective_timeout_s``) as a ``CheckpointError``, the type every call of
        the manager raises for a failed save or restore, with gloo's error as its cause."""
        try:
            yield
        except RuntimeError as exc:
            raise CheckpointError(
                f"{what} with the other ranks failed: a rank died, or did not make the same "
                f"call within collective_timeout_s ({self.timeout_s:g} s): {describe_error(exc)}"
            ) from exc


# Every distributed Collectives alive, and every group a manager made, with the process that
# made it (a forked child exiting normally leaves its parent's groups alone). Weakly: a group
# torch no longer holds (destroy_process_group()) and no manager holds is gone already.
_MANAGERS_COLLECTIVES: weakref.WeakSet[Collectives] = weakref.WeakSet()
_GROUPS_TO_DESTROY_AT_EXIT: list[tuple[int, weakref.ref[dist.ProcessGroup]]] = []


@atexit.register
def _destroy_groups_at_exit() -> None:
    """Destroy the groups of every manager, open, closed or garbage collected, once the
    interpreter's threads have been joined (a manager's background saves run on a thread that
    interpreter exit waits for); their gloo threads stop with them.

    Groups left alive into the interpreter's finalization abort the process now and then
    ("terminate called without an active exception"): a gloo thread that frees a finished
    collective's tensors then needs the GIL. ``destroy_process_group()`` of the whole job does
    not stop them while a manager still holds them. Not done at
    :meth:`~ckptmgr.CheckpointManager.close`: torch 2.13 names later groups after the count of
    live ones, so destroying two would give the next groups made the names of live ones (see
    docs/distributed.md).
    """
    for comm in list(_MANAGERS_COLLECTIVES):
        if comm._made_in == os.getpid():
            comm.drop_groups()
    groups, _GROUPS_TO_DESTROY_AT_EXIT[:] = list(_GROUPS_TO_DESTROY_AT_EXIT), []
    for pid, group_ref in groups:
        group = group_ref()
        if group is not None and pid == os.getpid():
            with contextlib.suppress(Exception):  # destroyed already (destroy_process_group())
                dist.destroy_process_group(group)
        del group
