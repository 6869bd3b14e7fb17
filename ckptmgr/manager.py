"""CheckpointManager: decide -> stage -> write -> commit -> retain, for a PyTorch training loop."""

from __future__ import annotations

import functools
import json
import logging
import numbers
import operator
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from ckptmgr import dcp_io, packing, pruning, retention, tensor_bytes
from ckptmgr._version import __version__
from ckptmgr.background import BackgroundWriter, FailureHandover, result_of
from ckptmgr.bootstrap_guard import refuse_while_bootstrapping
from ckptmgr.collectives import Collectives
from ckptmgr.config import CheckpointConfig
from ckptmgr.daemon_commit import DaemonCommit, DaemonCommitResult, DaemonRetention
from ckptmgr.device_sync import wait_for_queued_work
from ckptmgr.errors import (
    CheckpointError,
    CorruptCheckpointError,
    StepNotFoundError,
    describe_error,
)
from ckptmgr.gc_pause import gc_paused
from ckptmgr.integrity import raise_problems
from ckptmgr.lease import LeaseLostError, OwnerLease
from ckptmgr.notices.base import DEFAULT_EXIT_CODE
from ckptmgr.packing import PackedTensor
from ckptmgr.preemption import PreemptionConfig, PreemptionMonitor, PreemptionNotice
from ckptmgr.process_exit import end_process_now
from ckptmgr.record import (
    CommitRecord,
    FileEntry,
    files_with_checksums,
    tensor_entries,
    utc_now,
)
from ckptmgr.retry import RetryConfig
from ckptmgr.root_opening import open_root
from ckptmgr.save_plans import SavePlanCache
from ckptmgr.save_policy import SavePolicy, is_rank_independent, schedule_from
from ckptmgr.save_process import (
    CHECKSUMS_ATTRIBUTE,
    COMMITTED_ATTRIBUTE,
    LISTING_ATTRIBUTE,
    TENSOR_ENTRIES_ATTRIBUTE,
    SaveProcess,
)
from ckptmgr.staging import StagingBuffers, StagingPool
from ckptmgr.state import flatten
from ckptmgr.step_restore import StepRestorer
from ckptmgr.storage import json_bytes, log_moved_aside, objects_file_name

log = logging.getLogger("ckptmgr")


@dataclass
class _SaveRequest:
    """Everything a write of one step needs, snapshotted on the training thread."""

    step: int
    tensors: dict[str, torch.Tensor]
    objects: dict[str, Any]
    metrics: dict[str, float]
    metadata: dict[str, Any]
    packed: dict[str, PackedTensor] = field(default_factory=dict)  # set by the write
    staged: bool = False  # tensors are save_async's staged copies (shared memory in process mode)
    # gives save_async's staging slot back (once): called when the data is written, before the
    # commit and retention's deletions, so the next save_async need not wait for those
    release_staging: Callable[[], None] | None = None


@dataclass
class _SaveOutcome:
    """What rank 0 decided after a write, broadcast so that every rank agrees."""

    committed: bool
    error: str | None
    deleted: list[int]
    listed: list[int] | None = None  # committed steps in storage after the commit, if listed
    # the daemon's retention deleted ``deleted`` already (with this error, if any failed)
    deleted_by_daemon: bool = False
    deletion_error: CheckpointError | None = None


class CheckpointManager:
    """Saves, lists, prunes and restores training checkpoints under one path or URL.

    Call-compatible with PyTorch/XLA's experimental ``CheckpointManager``: the first seven
    arguments are the same. See :class:`~ckptmgr.CheckpointConfig` for every setting.
    ``save_interval`` may be None when ``save_policy`` decides when to save.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        save_interval: int | None = None,
        max_to_keep: int = 0,
        max_pending_async: int = 1,
        num_of_threads: int = 1,
        process_group: dist.ProcessGroup | None = None,
        chkpt_on_preemption: bool = True,
        *,
        retention: retention.RetentionPolicy | list[retention.RetentionPolicy] | None = None,
        retention_dry_run: bool = False,
        staging_budget_bytes: int | None = None,
        save_policy: SavePolicy | list[SavePolicy] | None = None,
        storage_options: dict[str, Any] | None = None,
        retry: RetryConfig | None = None,
        preemption: PreemptionConfig | None = None,
        leftover_grace_s: float = 600.0,
        collective_timeout_s: float = 600.0,
        take_over: bool = False,
        lease_timeout_s: float = 60.0,
        read_only: bool = False,
        async_mode: str = "thread",
    ) -> None:
        config = CheckpointConfig(
            path=path,
            save_interval=save_interval,
            max_to_keep=max_to_keep,
            max_pending_async=max_pending_async,
            num_of_threads=num_of_threads,
            process_group=process_group,
            chkpt_on_preemption=chkpt_on_preemption,
            retention=retention,
            retention_dry_run=retention_dry_run,
            staging_budget_bytes=staging_budget_bytes,
            save_policy=save_policy,
            storage_options=storage_options,
            retry=retry,
            preemption=preemption,
            leftover_grace_s=leftover_grace_s,
            collective_timeout_s=collective_timeout_s,
            take_over=take_over,
            lease_timeout_s=lease_timeout_s,
            read_only=read_only,
            async_mode=async_mode,
        )
        self._start(config)

    @classmethod
    def from_config(
        cls, config: CheckpointConfig | Mapping[str, Any] | str | os.PathLike[str]
    ) -> CheckpointManager:
        """Build a manager from a config object, a dict, or a JSON/YAML file path."""
        if isinstance(config, (str, os.PathLike)):
            config = CheckpointConfig.from_file(config)
        elif not isinstance(config, CheckpointConfig):
            config = CheckpointConfig.model_validate(dict(config))
        else:  # fields set after it was made are not checked then: checked now, in place
            checked = CheckpointConfig.model_validate(
                {name: getattr(config, name) for name in CheckpointConfig.model_fields}
            )
            for name in CheckpointConfig.model_fields:
                setattr(config, name, getattr(checked, name))
        manager = cls.__new__(cls)
        manager._start(config)
        return manager

    def _start(self, config: CheckpointConfig) -> None:
        refuse_while_bootstrapping()  # before the root is touched
        self.config = config
        self._closed = True  # until fully started, so close() in error paths does nothing
        self._comm = Collectives(config.process_group, config.collective_timeout_s)
        self._policy = _build_policy(config)
        self._schedule = schedule_from(config.save_interval, config.save_policy, time.monotonic())
        self._record_tables = packing.RecordTableCache()  # used by the writer thread only
        self._save_packer = packing.SavePacker()  # save()'s packing, on the writer thread only
        # Names packed into one item (ckptmgr.packing); None once the ranks' packs differed.
        self._pack_filter: packing.PackFilter | None = packing.pack_filter(self._comm.world_size)
        self._save_plans = SavePlanCache()  # DCP's plans, kept between this manager's saves
        self._schedule_needs_agreement = not all(
            is_rank_independent(policy) for policy in self._schedule.policies
        )
        self._writer = BackgroundWriter()
        process_mode = config.async_mode == "process"
        self._staging = StagingPool(
            config.max_pending_async, config.staging_budget_bytes, shared=process_mode
        )
        self._save_process: SaveProcess | None = None
        if process_mode:
            self._save_process = SaveProcess(
                self._comm if self._comm.distributed else None,
                config.collective_timeout_s,
                kept_per_slot=config.max_pending_async,
            )
        # One writing job per root: rank 0 holds the owner lease for the job (see lease.py).
        opened = open_root(config, self._comm)  # on every rank, failing on every rank together
        self._storage = opened.storage
        self._lease: OwnerLease | None = opened.lease
        self._committed: set[int] = set(opened.committed)
        self._records = pruning.RecordReader(self._storage)
        self._restorer = StepRestorer(self._storage, self._comm)
        if self._save_process is not None:
            self._storage.run_local_file_work = self._save_process.run_when_idle
        self._lock = threading.Lock()
        self._in_flight: set[int] = set()
        # Commits the daemon made (process mode): the root's other commits in this process
        # (save()'s, another manager's) are those its own reader of commit records cannot know
        # of (see DaemonRetention.commits_elsewhere).
        self._daemon_commits = 0
        self._preemption_claimed: int | None = None
        self._preemption_reached: int | None = None
        # Steps restore_latest found damaged, listed no more even where the quarantine marker
        # could not be written (or, with read_only, was not).
        self._damaged: set[int] = set()
        # Keys of the background failures already raised on every rank by a save's agreement
        # (the same set on every rank): a rank that learns of one late does not fail another
        # save with it. One entry per failure.
        self._agreed_failures: set[str] = set()
        # Signals, cloud metadata servers, the trigger file and (on TPU VMs) XLA's sync manager.
        try:
            self._preemption = (
                PreemptionMonitor(config.preemption)
                if config.chkpt_on_preemption and not config.read_only
                else None
            )
        except BaseException:
            if self._lease is not None:
                self._lease.release()
            raise
        self._steps_decided = 0  # steps with an agreed decision, the same count on every rank
        self._last_decided_step: int | None = None
        self._answered_notice: PreemptionNotice | None = None  # this rank's, for the log
        # The exit status of exit_after_save, agreed by the ranks with the notice: the highest
        # of the notices' statuses (128 + the signal; 143 for notices that are not signals).
        self._preemption_exit_code = DEFAULT_EXIT_CODE
        self._closed = False
        self._pid = os.getpid()  # a forked child must not use what belongs to this process
        log.info("checkpoints at %s: committed steps %s", config.path, sorted(self._committed))

    # -- deciding --------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """True iff ``save_interval`` or a save policy wants ``step``, or a preemption notice is
        pending, and ``step`` is not already committed (or being written).

        Every rank gets the same answer: save policies are evaluated on rank 0 and preemption
        notices of any rank count (one small all_reduce when distributed). With
        ``preemption.exit_after_save``, exits the process once the preemption checkpoint is
        committed.
        """
        self._check_open()
        step = _checked_step(step)
        wanted = self._decide(step, force=False, warn=False)[0]
        self._exit_if_preemption_answered()
        return wanted

    def _decide(self, step: int, *, force: bool, warn: bool) -> tuple[bool, bool]:
        """(save now?, is it the preemption save?) for ``step``."""
        preempt, scheduled = self._agreed_notice_and_schedule(step)
        with self._lock:  # the writer commits and settles claims under the same lock
            committed = step in self._committed
            taken = committed or step in self._in_flight
            if preempt and committed:  # the notice is answered by the existing checkpoint
                self._preemption_reached = step
                self._clear_preemption_notice()
            elif preempt and taken:  # answered once the write in flight for this step commits
                self._preemption_claimed = step
        if taken:
            if warn and (force or scheduled):
                log.warning(
                    "step %d is already committed or being saved; not saving it again", step
                )
            return False, False
        return force or preempt or scheduled, preempt

    def _agreed_notice_and_schedule(self, step: int) -> tuple[bool, bool]:
        """(a preemption notice on any rank, rank 0's save policies want ``step``).

        With ``agree_every_n_steps=N`` the ranks agree at every decision of every Nth step
        decided (counted per step, so that ``save(s)`` after ``should_save(s)`` agrees too).
        """
        monitor = self._preemption
        # On XLA, ask its sync manager at every step on every host (it owns SIGTERM there).
        xla_sync = monitor.xla_sync_point(step) if monitor is not None else None
        notice = (
            monitor is not None
            and (monitor.notified or bool(xla_sync))
            and self._preemption_claimed is None
            and self._preemption_reached is None
        )
        current = monitor.notice if notice and monitor is not None else None
        if current is not None:
            self._answered_notice = current  # read before clear(); None on other ranks
        notice_code = 0  # none; else the exit status it asks for (an XLA sync point: SIGTERM's)
        if notice:
            notice_code = current.exit_code if current is not None else DEFAULT_EXIT_CODE
        policy_error: Exception | None = None
        try:
            scheduled = self._schedule.wants(step, time.monotonic())
        except Exception as exc:  # a save policy raised: raised on every rank that agrees
            policy_error, scheduled = exc, False
        if self._preemption is None and not self._schedule_needs_agreement:
            if policy_error is not None:
                raise policy_error
            return False, scheduled  # every rank computes the same answer: no collective
        if step != self._last_decided_step:
            self._last_decided_step = step
            self._steps_decided += 1
        if (
            self._comm.distributed
            and self._steps_decided % self.config.preemption.agree_every_n_steps
        ):
            if policy_error is not None:
                raise policy_error
            # Amortised: no collective at this step; rank-dependent policies wait for one.
            return False, scheduled and not self._schedule_needs_agreement
        # A policy that raised on one rank only fails this decision on every rank (a rank that
        # raised alone would leave the others waiting in this collective).
        agreed_code, scheduled, failed = self._comm.agree(
            notice_code, scheduled, policy_error is not None
        )
        preempt = agreed_code > 0
        if preempt:
            self._preemption_exit_code = agreed_code
        if policy_error is not None:
            raise policy_error
        if failed:
            raise CheckpointError(
                f"step {step}: a save policy raised on another rank (its error is raised there)"
            )
        return preempt, scheduled

    def _log_preemption_answered(self, step: int) -> None:
        notice = self._answered_notice
        if notice is None:  # another rank got the notice; this one learned it by all_reduce
            log.warning(
                "preemption checkpoint of step %d committed (notice from another rank)", step
            )
            return
        log.warning(
            "preemption checkpoint of step %d committed %.2f s after the notice (%s)",
            step,
            time.time() - notice.received_at,
            notice.source,
        )

    def _exit_if_preemption_answered(self) -> None:
        """With ``exit_after_save``: once the preemption checkpoint is committed, join, close
        and exit the process with 128+signal (143 when the notice was not a signal; the same
        status on every rank, the highest of the notices'): ``SystemExit`` on the main thread,
        :func:`~ckptmgr.process_exit.end_process_now` on any other."""
        if not self.config.preemption.exit_after_save:
            return
        if self._preemption_claimed is None and self._preemption_reached is None:
            return
        self._writer.wait()  # the preemption save's outcome, the same on every rank
        if self._preemption_reached is None:
            self.join()  # it failed: raises on every rank; training goes on, the next step retries
            return
        for error in self._writer.take_errors():  # committed: every rank exits, none raises
            log.error("exiting after the preemption checkpoint despite: %s", error)
        code = self._preemption_exit_code
        log.warning(
            "exiting with status %d after the preemption checkpoint (exit_after_save)", code
        )
        try:
            self.close()
        except Exception as exc:  # the checkpoint is committed: exit on every rank regardless
            log.error("exiting after the preemption checkpoint despite: %s", exc)
        if threading.current_thread() is threading.main_thread():
            raise SystemExit(code)
        # SystemExit would end this thread only, and the process would exit as its main thread
        # does (with status 0, the preemption hidden from the scheduler).
        end_process_now(code)

    def _clear_preemption_notice(self) -> None:
        if self._preemption is not None:
            self._preemption.clear()

    # -- saving ----------------------------------------------------------------------------------
    @gc_paused()  # many small objects: see ckptmgr.gc_pause
    def save(
        self,
        step: int,
        state_dict: Mapping[str, Any],
        force: bool = False,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> bool:
        """Write a checkpoint of ``state_dict`` for ``step`` and wait until it is committed.

        Returns True iff a checkpoint was committed, False when the interval says not to save or
        the step already has a checkpoint. ``metrics`` (name -> number) and ``metadata`` (any
        JSON document) are stored in the commit record. Raises ``CheckpointError`` when the save
        fails; nothing is committed then, except where a rank is lost after rank 0 committed
        (rank 0's error says so, and lists the step). With ``preemption.exit_after_save``, the
        preemption checkpoint is followed by ``close()`` and ``SystemExit(128 + signal)``.
        """
        request = self._request(step, state_dict, force, metrics, metadata, call="save")
        if request is None:
            self._exit_if_preemption_answered()
            return False
        try:  # (a Ctrl-C in a device's synchronize, say, leaves no step marked in flight)
            handover = FailureHandover(self._writer)
            wait_for_queued_work(request.tensors.values())  # the writer thread reads them
            if self._comm.distributed:
                self._agree_before_write(step, "save", None, None)
        except BaseException:
            self._abandon(request)
            raise
        future = self._writer.submit(
            f"save of step {step}",
            lambda: self._write(request),
            keep_error=handover,  # the caller gets a failure, or join() once it stops waiting
            cleanup=lambda: self._abandon(request),
        )
        try:
            result_of(future)
        except BaseException as exc:
            if not (future.done() and future.exception() is exc):  # interrupted (Ctrl-C): the
                handover.caller_gone()  # save goes on; its failure is kept for join()
            raise
        self._exit_if_preemption_answered()
        return True

    @gc_paused()  # many small objects: see ckptmgr.gc_pause
    def save_async(
        self,
        step: int,
        state_dict: Mapping[str, Any],
        force: bool = False,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> bool:
        """Copy ``state_dict`` to host memory and write it in the background.

        Returns True once the copy is taken and the write is queued: from then on the caller may
        change its tensors; the checkpoint holds the values of this call. Waits for a free slot
        when ``max_pending_async`` saves are still writing their data. A failed background write
        is raised as ``CheckpointError`` by :meth:`join`, or else by the next save or
        :meth:`close`. With ``preemption.exit_after_save``, the preemption save is joined, then
        the manager closes and raises ``SystemExit(128 + signal)``.
        """
        request = self._request(step, state_dict, force, metrics, metadata, call="save_async")
        if request is None:
            self._exit_if_preemption_answered()
            return False
        slot: list[StagingBuffers] = []  # (the slot taken, released from here in any case)

        def release_staging() -> None:  # once: after the write, or when it fails or never runs
            if slot:
                self._staging.release(slot.pop())

        try:
            buffers = self._staging.acquire(on_wait=f" (step {step})", into=slot)
            if not self._comm.distributed:  # (there, the agreement in _stage reports it)
                self._writer.raise_first_error()  # a save we waited for may just have failed
            request.tensors = self._stage(step, buffers, request.tensors)  # (agreed: save_async)
            request.packed = buffers.packed
            request.staged = True
            request.release_staging = release_staging
        except BaseException:
            release_staging()
            self._abandon(request)
            raise

        def cleanup() -> None:
            request.tensors = {}
            release_staging()  # if the write never got as far
            self._abandon(request)

        self._writer.submit(
            f"async save of step {step}", lambda: self._write(request), cleanup=cleanup
        )
        self._exit_if_preemption_answered()
        return True

    def _stage(
        self, step: int, buffers: StagingBuffers, tensors: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Stage ``tensors``, small ones into one pack (ckptmgr.packing) when every rank lays
        out the same pack.

        Collective under torch.distributed (:meth:`_agree_before_write`): a copy that fails on
        one rank fails the save on all of them.
        """
        pack = self._pack_filter
        while True:
            error: Exception | None = None
            staged: dict[str, torch.Tensor] = {}
            try:
                staged = buffers.stage(tensors, pack=pack)
            except Exception as exc:
                if not self._comm.distributed:
                    raise
                error = exc
            if not self._comm.distributed:
                return staged
            fingerprint = buffers.pack_fingerprint if pack is not None and error is None else None
            fingerprints = self._agree_before_write(step, "save_async", error, fingerprint)
            if pack is None or self._packs_agree(fingerprints):
                return staged
            pack = None  # the ranks' packs differ: stage again, each tensor on its own

    def _agree_before_write(
        self, step: int, call: str, local_error: Exception | None, fingerprint: str | None
    ) -> list[str | None]:
        """The ranks' agreement before a save writes anything (torch.distributed only; one
        all_gather on the control group): each says which save it makes (``step``, and
        ``call``: ``save`` or ``save_async``, whose writes issue different collectives),
        whether its part is ready (else the error flattening or copying it raised) and which
        background failures it has learned of since. If the saves differ, or any rank has an
        error or a failure, every rank raises: its own error, else a ``CheckpointError``
        naming the others'. A rank that raised alone, before this save's collectives, would
        meet its peers' collectives of this save with those of its next one. Returns the
        ranks' pack fingerprints."""
        learned = self._writer.take_errors()
        try:
            gathered = self._comm.all_gather(
                (
                    describe_error(local_error),
                    fingerprint,
                    [(self._failure_key(error), str(error)) for error in learned],
                    (step, call),
                ),
                self._comm.control_group,
            )
        except BaseException:
            for error in learned:  # not reported: join() or close() will
                self._writer.record_error(error)
            raise
        failures: list[str] = []
        saves = [save for *_, save in gathered]
        if len(set(saves)) > 1:  # a bug in the training script: fail it here, on every rank
            made = [f"rank {r} saves step {s} with {c}()" for r, (s, c) in enumerate(saves)]
            failures.append(f"{', '.join(made)}: every rank must make the same saves")
        new_keys: set[str] = set()
        for rank, (error_text, _, learned_failures, _) in enumerate(gathered):
            if error_text is not None:
                failures.append(f"rank {rank}: {error_text}")
            for key, text in learned_failures:
                if key not in self._agreed_failures:  # one failure fails one save
                    self._agreed_failures.add(key)
                    new_keys.add(key)
                    failures.append(f"rank {rank}: an earlier background failure: {text}")
        own: list[BaseException] = [] if local_error is None else [local_error]
        own += [error for error in learned if self._failure_key(error) in new_keys]
        if own:  # this rank's own error, with its cause; every rank's noted on it
            if len(failures) > 1 and hasattr(own[0], "add_note"):  # Python >= 3.11
                for failure in failures:
                    own[0].add_note(f"step {step} was not saved: {failure}")
            raise own[0]
        if failures:
            raise CheckpointError(
                f"step {step} was not saved: a rank could not save it ({'; '.join(failures)})"
            )
        return [fp for _, fp, _, _ in gathered]

    def _raise_background_failure(self) -> None:
        """Raise the oldest background failure not reported yet. One that a save's agreement
        already raised on every rank is dropped: this rank learned of it late (its own part of
        that save failed after a peer had told the others), and raising it again here, on this
        rank alone, would report one failure twice and set the ranks on different paths."""
        self._writer.raise_first_error(
            lambda error: self._failure_key(error) in self._agreed_failures
        )

    def _failure_key(self, error: BaseException) -> str:
        """What names one failure on every rank that learns of it: a failed save's key is its
        save id (every rank's error of it has the same); any other failure is this rank's own."""
        key = getattr(error, "failure_key", None)
        if key is None:
            key = f"rank {self._comm.rank} {uuid.uuid4().hex}"
            error.failure_key = key  # type: ignore[attr-defined]
        return str(key)

    def _packs_agree(self, fingerprints: list[str | None]) -> bool:
        """True when every rank has the same pack layout; else packing stops for good (the
        ranks' replicated small tensors differ in names or shapes: each is stored on its own)."""
        if None not in fingerprints and len(set(fingerprints)) == 1:
            return True
        if self._pack_filter is not None:
            log.warning(
                "the ranks hold different sets of small shared tensors (or hold them on "
                "different devices); they are no longer packed into one item (each is stored "
                "on its own, as DCP does)"
            )
        self._pack_filter = None
        return False

    def _request(
        self,
        step: int,
        state_dict: Mapping[str, Any],
        force: bool,
        metrics: Mapping[str, float] | None,
        metadata: Mapping[str, Any] | None,
        *,
        call: str,
    ) -> _SaveRequest | None:
        """Validate, decide, and snapshot the plain values; None when nothing is to be saved.
        ``call``: ``save`` or ``save_async`` (what the ranks agree on, with the step)."""
        self._check_open()
        if self.config.read_only:
            raise CheckpointError(
                "this CheckpointManager was opened with read_only=True: it lists and restores "
                "but never saves"
            )
        step = _checked_step(step)
        force = _checked_bool(force, "force")
        if not self._comm.distributed:
            checked_metrics = _checked_metrics(metrics)
            checked_metadata = _checked_metadata(metadata)
            self._writer.raise_first_error()
        # Under torch.distributed, a value one rank refuses (metrics, metadata, the state) fails
        # the save on every rank, at the agreement before the write (as do failures a rank has
        # learned of): a rank that raised alone would leave its peers in this save's collectives.
        wanted, preempt = self._decide(step, force=force, warn=True)
        try:
            if self._comm.distributed:
                checked_metrics = _checked_metrics(metrics)
                checked_metadata = _checked_metadata(metadata)
            if not wanted:
                return None
            flat = flatten(state_dict, self._comm.rank)
            packing.check_names(flat.tensors)
        except Exception as exc:
            if self._comm.distributed and wanted:  # the other ranks fail it at the agreement
                self._agree_before_write(step, call, exc, None)
            raise
        self._schedule.started(step, time.monotonic())
        request = _SaveRequest(step, flat.tensors, flat.objects, checked_metrics, checked_metadata)
        try:
            with self._lock:
                self._in_flight.add(step)
                if preempt:
                    self._preemption_claimed = step
        except BaseException:  # (Ctrl-C as the lock is let go: the step stayed in flight)
            self._abandon(request)
            raise
        return request

    def _abandon(self, request: _SaveRequest) -> None:
        """Forget an in-flight request (after its write ended or it was never queued)."""
        with self._lock:
            self._in_flight.discard(request.step)
            if self._preemption_claimed == request.step:
                self._preemption_claimed = None  # not answered: the next step tries again

    def _write(self, request: _SaveRequest) -> None:
        """Write, commit and prune one step; runs on the background thread of every rank."""
        comm, storage, group = self._comm, self._storage, self._comm.background_group
        step = request.step
        prepared: tuple[str, str | None, int] = ("", None, step)
        cause: Exception | None = None  # (rank 0's: the others get its description)
        if comm.is_coordinator:
            save_id = uuid.uuid4().hex[:16]
            try:
                if self._lease is not None:
                    self._lease.check()  # another job took the root over: write nothing
                storage.prepare_write_dir(storage.write_dir(step, save_id))
                prepared = (save_id, None, step)
            except Exception as exc:
                prepared = (save_id, f"{type(exc).__name__}: {exc}", step)
                cause = exc
        save_id, prepare_error, coordinator_step = comm.broadcast(prepared, group)
        if prepare_error is not None:
            error = CheckpointError(f"could not prepare step {step}: {prepare_error}")
            error.failure_key = f"save {save_id}"  # type: ignore[attr-defined]  # every rank's
            raise error from cause
        write_dir = storage.write_dir(coordinator_step, save_id)

        local_error: BaseException | None = None
        if coordinator_step != step:  # a save made on some ranks only: commit none of it
            local_error = CheckpointError(
                f"rank {comm.rank} saves step {step} while rank 0 saves step "
                f"{coordinator_step}: every rank must make the same saves"
            )
        # name -> (size, CRC-32) of every file this rank wrote, computed while writing it
        checksums: dict[str, tuple[int, int]] = {}
        small_files: dict[str, bytes] = {}  # written by the DCP writer beside the data files
        try:  # (from the daemon in process mode)
            small_files[objects_file_name(comm.rank)] = json_bytes(request.objects)
            if not comm.is_coordinator:
                storage.ensure_dir(write_dir)  # retried; no-op on object stores
        except Exception as exc:
            local_error = local_error or exc
        dcp_metadata = None
        writer = None
        daemon_commit: DaemonCommit | None = None  # the commit, made by the daemon's writer
        in_daemon = self._save_process is not None and request.staged
        if in_daemon and comm.distributed:  # daemons are replaced on every rank or on none
            assert self._save_process is not None
            if not all(comm.all_gather(self._save_process.healthy, group)):
                self._save_process.reset()
        tensors = request.tensors
        if not request.staged and self._pack_filter is not None:  # save(): pack here
            tensors, request.packed = self._pack(tensors, group)
        try:  # every rank joins DCP's collectives, even after a local error, so none hangs
            make = dcp_io.WriterRecipe if in_daemon else dcp_io.make_writer  # (made there)
            writer = make(
                storage.url_for(write_dir),
                local=storage.is_local,
                thread_count=self.config.num_of_threads,
                storage_options=storage.storage_options,
                retry=storage.retry,
                prepared=True,  # (rank 0's prepare_write_dir, broadcast above)
            )
            writer.small_files = small_files
            if not in_daemon:
                assert not isinstance(writer, dcp_io.WriterRecipe)
                writer.metadata_file = self._save_plans.metadata_file
            if in_daemon and storage.is_local and not comm.distributed and local_error is None:
                assert isinstance(writer, dcp_io.WriterRecipe)
                writer.commit = daemon_commit = self._daemon_commit(request, save_id, write_dir)
            if in_daemon:
                assert self._save_process is not None
                dcp_metadata = self._save_process.save(  # (replaced above, when distributed)
                    tensors, writer, replace_unhealthy=not comm.distributed
                )
            else:
                dcp_metadata = dcp_io.save_tensors(
                    tensors,
                    writer,
                    group if comm.distributed else None,
                    self._save_plans.planner(),
                    self._save_plans.kept_results,
                )
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            local_error = local_error or dcp_io.original_error(exc)
        if request.release_staging is not None:  # the staged bytes are written, or never will be
            request.tensors = tensors = {}
            request.release_staging()
        if writer is not None and not in_daemon:
            checksums.update(writer.checksums.snapshot())
        if dcp_metadata is not None:  # every rank's files, as finish() saw them (in process
            # mode the only account: the writer that wrote them lived in the daemon)
            checksums.update(getattr(dcp_metadata, CHECKSUMS_ATTRIBUTE, {}))
        gathered = comm.all_gather((describe_error(local_error), checksums), group)
        errors = [error for error, _ in gathered]

        outcome = _SaveOutcome(committed=False, error=None, deleted=[])
        commit_error: Exception | None = None
        if daemon_commit is not None and local_error is None:  # (non-distributed: rank 0)
            committed: DaemonCommitResult = getattr(dcp_metadata, COMMITTED_ATTRIBUTE)
            outcome = self._after_daemon_commit(request, daemon_commit, committed)
        elif daemon_commit is not None and self._committed_before_failing(
            step, save_id, local_error
        ):
            outcome = self._plan_after_commit(step, None)
        elif comm.is_coordinator:
            if isinstance(local_error, LeaseLostError) and self._lease is not None:
                self._lease.note_lost(local_error)  # found by the daemon: no more saves either
            written: dict[str, tuple[int, int]] = {}
            for _, rank_checksums in gathered:
                written.update(rank_checksums)
            outcome, commit_error = self._commit_and_plan_retention(
                request, save_id, write_dir, errors, dcp_metadata, written
            )
        try:
            outcome = comm.broadcast(outcome, group)
        except CheckpointError as exc:
            if not (comm.is_coordinator and outcome.committed):
                raise
            # The step is committed (this rank wrote its record) and listed as such; the other
            # ranks could not be told (one died, say): retention deletes nothing this time.
            self._list_committed(step, replace(outcome, deleted=[]))
            raise CheckpointError(
                f"step {step} is committed, but telling the other ranks so failed: {exc}"
            ) from exc
        if not outcome.committed:
            self._save_plans.forget()  # (on every rank: none keeps a plan the others dropped)
            if comm.is_coordinator:
                storage.discard(write_dir)
            error = CheckpointError(f"save of step {step} failed: {outcome.error}")
            error.failure_key = f"save {save_id}"  # type: ignore[attr-defined]  # every rank's
            raise error from (local_error or commit_error)

        self._list_committed(step, outcome)
        if outcome.deletion_error is not None:  # (the daemon's: it deleted what it could)
            self._report_failed_deletion(outcome.deletion_error)
        elif comm.is_coordinator and outcome.deleted and not outcome.deleted_by_daemon:
            try:
                self._confirm_lease_before_deleting()
                pruning.delete_steps(self._storage, outcome.deleted)
            except CheckpointError as exc:  # step is committed: report at join/next save/close
                if not comm.distributed:  # (the other ranks cannot know: every rank lists
                    self._relist_after_failed_deletion(outcome.deleted)  # the same steps)
                self._report_failed_deletion(exc)

    def _list_committed(self, step: int, outcome: _SaveOutcome) -> None:
        """List ``step`` as committed and the steps ``outcome`` deletes as gone; a preemption
        that ``step`` answers is answered."""
        with self._lock:
            self._damaged.discard(step)  # saved anew
            if outcome.listed is not None:  # storage's view, so other writers' changes show
                self._committed = set(outcome.listed) - self._damaged
            self._committed.add(step)
            self._committed.difference_update(outcome.deleted)
            answered_preemption = self._preemption_claimed == step
            if answered_preemption:
                self._preemption_reached = step
                self._preemption_claimed = None
                self._clear_preemption_notice()
        log.info("committed step %d", step)
        if answered_preemption:
            self._log_preemption_answered(step)

    def _report_failed_deletion(self, error: CheckpointError) -> None:
        """Log a failed deletion of retention's and raise it at the next join, save or close
        (the step is committed)."""
        log.error("%s", error, exc_info=error.__cause__)
        if isinstance(error, LeaseLostError) and self._lease is not None:
            self._lease.note_lost(error)  # found by the daemon: no more saves either
        self._writer.record_error(error)

    def _confirm_lease_before_deleting(self) -> None:
        """Raise ``CheckpointError`` unless the lease is still this job's, read from storage now:
        the heartbeat finds a take-over only at its next beat, and the steps may be the new
        owner's by then. A failed read deletes nothing either.

        The read is a storage operation like any other, retried on a transient error (each
        HTTP request is retried only ``client_attempts`` times: a longer burst of 503s failed
        the deletion, and the next save or join raised it), as is the lease's acquisition."""
        if self._lease is not None:
            confirm = functools.partial(
                self._storage.call, "read the owner lease", self._lease.confirm
            )
            pruning.confirm_owner_before_deleting(confirm, self.config.path)

    def _relist_after_failed_deletion(self, doomed: list[int]) -> None:
        """List again the steps of ``doomed`` that a failed deletion left committed in storage
        (they were dropped from the list before the deletion began)."""
        try:
            kept = set(self._storage.committed_steps()) & set(doomed)
        except Exception as exc:  # storage unreachable: the next save's listing corrects it
            log.warning("could not list the steps after a failed deletion: %s", exc)
            return
        with self._lock:
            self._committed |= kept - self._damaged

    def _pack(
        self, tensors: dict[str, torch.Tensor], group: Any
    ) -> tuple[dict[str, torch.Tensor], dict[str, packing.PackedTensor]]:
        """save()'s packing, on the writer thread (save_async's staging packed already): the
        tensors to store and the pack layout, or the tensors as they are when the ranks' packs
        would differ."""
        assert self._pack_filter is not None
        fingerprint: str | None = None
        try:
            packed, placed = self._save_packer.pack(tensors, self._pack_filter)
            fingerprint = self._save_packer.fingerprint
        except Exception:  # every rank must reach the agreement; this one stores unpacked
            if _all_storable(tensors):  # (else the write refuses the one that is not, by name)
                log.exception("packing small tensors failed; storing each on its own")
            packed, placed = tensors, {}
        if self._comm.distributed and not self._packs_agree(
            self._comm.all_gather(fingerprint, group)
        ):
            return tensors, {}
        return packed, placed

    def _commit_and_plan_retention(
        self,
        request: _SaveRequest,
        save_id: str,
        write_dir: str,
        errors: list[str | None],
        dcp_metadata: Any,
        written: dict[str, tuple[int, int]],
    ) -> tuple[_SaveOutcome, Exception | None]:
        """Commit if every rank wrote its part, then choose what retention deletes."""
        failed = {rank: text for rank, text in enumerate(errors) if text is not None}
        if failed:
            described = "; ".join(
                text if len(errors) == 1 else f"rank {rank}: {text}"  # (one process: no rank)
                for rank, text in failed.items()
            )
            return _SaveOutcome(committed=False, error=described, deleted=[]), None
        try:
            with gc_paused():  # the first save of a layout makes an entry per packed tensor
                entries = getattr(dcp_metadata, TENSOR_ENTRIES_ATTRIBUTE, None)
                if entries is None:  # (a daemon's answer carries them: see save_process)
                    entries = tensor_entries(dcp_metadata)
                table = self._record_tables.table(entries, request.packed)
            record = CommitRecord(
                step=request.step,
                save_id=save_id,
                committed_at=utc_now(),
                world_size=self._comm.world_size,
                metrics=request.metrics,
                metadata=request.metadata,
                files=files_with_checksums(self._written_files(write_dir, dcp_metadata), written),
                object_files=[objects_file_name(r) for r in range(self._comm.world_size)],
                ckptmgr_version=__version__,
                torch_version=torch.__version__,
                byteorder=sys.byteorder,
                tensor_table=table,
            )
            if self._lease is not None:  # a lease found lost while writing: commit nothing
                self._lease.check()
            self._storage.commit(request.step, write_dir, record)
            self._records.remember(  # (kept where a plan reads the records)
                retention.CheckpointInfo(record.step, record.committed_at, record.metrics),
                keep=self._policy is not None,
            )
        except Exception as exc:
            log.error("commit of step %d failed", request.step, exc_info=exc)
            outcome = _SaveOutcome(committed=False, error=f"commit failed: {exc!r}", deleted=[])
            return outcome, exc
        return self._plan_after_commit(request.step, None), None

    def _daemon_commit(self, request: _SaveRequest, save_id: str, write_dir: str) -> DaemonCommit:
        """The commit of ``request``'s step for the daemon's writer to make once it has written
        the step (a single-process save on a local disk)."""
        assert self._save_process is not None
        storage, step = self._storage, request.step
        confirm_owner = None if self._lease is None else self._lease.local_check()
        return DaemonCommit(
            root=storage.root,
            write_dir=write_dir,
            final=storage.step_path(step),
            aside=storage.aside_path(step),
            fields={
                "step": step,
                "save_id": save_id,
                "world_size": 1,
                "metrics": request.metrics,
                "metadata": request.metadata,
                "object_files": [objects_file_name(0)],
                "ckptmgr_version": __version__,
                "torch_version": torch.__version__,
                "byteorder": sys.byteorder,
            },
            layout=self._save_process.kept_in_daemon("pack layout", request.packed),
            confirm_owner=confirm_owner,
            retention=self._daemon_retention(step, confirm_owner),
        )

    def _daemon_retention(
        self, step: int, confirm_owner: Callable[[], None] | None
    ) -> DaemonRetention | None:
        """Retention for the daemon to apply after its commit of ``step``, when the policy is
        ckptmgr's own and deletes for real; None to plan here after the daemon's answer."""
        policy = self._policy
        if policy is None or self.config.retention_dry_run or not retention.is_builtin(policy):
            return None
        if self._lease is not None and confirm_owner is None:  # (a lease off the local disk)
            return None
        with self._lock:
            being_written = frozenset(self._in_flight | {step})
        elsewhere = pruning.commits_to(self._storage) - self._daemon_commits
        return DaemonRetention(policy, being_written, confirm_owner, elsewhere)

    def _after_daemon_commit(
        self, request: _SaveRequest, commit: DaemonCommit, result: DaemonCommitResult
    ) -> _SaveOutcome:
        """What follows the commit the daemon made: the step remembered for retention, and
        retention's plan over the steps the daemon listed after the commit."""
        step = request.step
        if result.moved_aside:
            log_moved_aside(step, commit.aside)
        self._daemon_commits += 1
        self._records.remember(  # (kept where a plan reads the records)
            retention.CheckpointInfo(step, result.committed_at, request.metrics),
            keep=self._policy is not None,
        )
        if commit.retention is None:
            return self._plan_after_commit(step, result.listed)
        if result.planning_error is not None:
            log.error(
                "retention after step %d failed; nothing deleted: %s", step, result.planning_error
            )
        pruning.log_deletions(result.doomed or [], dry_run=False)
        deleted = result.deleted or []
        for gone in deleted:
            log.info("deleted step %d (retention)", gone)
        return _SaveOutcome(
            committed=True,
            error=None,
            deleted=deleted,
            listed=result.listed,
            deleted_by_daemon=True,
            deletion_error=result.deletion_error,
        )

    def _committed_before_failing(
        self, step: int, save_id: str, error: BaseException | None
    ) -> bool:
        """True when the daemon committed ``step`` for the save ``save_id`` although the save
        failed with ``error`` (the daemon died after the rename, during its retention, say):
        the step's record in storage is this save's. The step is then reported committed, as it
        is, and retention is planned here; any other record, or none, leaves the failure."""
        try:
            record = self._storage.read_record(step)
        except Exception:  # (nothing committed, or not readable: the save failed)
            return False
        if record.save_id != save_id:
            return False
        log.warning(
            "the checkpoint daemon committed step %d, then failed before it answered (%s); "
            "the step is committed",
            step,
            error,
        )
        self._daemon_commits += 1
        self._records.remember(
            retention.CheckpointInfo(step, record.committed_at, dict(record.metrics)),
            keep=self._policy is not None,
        )
        return True

    def _plan_after_commit(self, step: int, listed: list[int] | None) -> _SaveOutcome:
        """The outcome of a committed save: retention's plan after it (over ``listed``, the
        committed steps in storage now; listed here when None)."""
        try:
            if self._lease is not None:  # another job owns the root now: delete none of its
                self._lease.check()  # steps (the step just committed is this job's last)
            listed, deleted = self._plan_retention(step, listed)
        except Exception as exc:  # the step is committed; pruning waits for the next save
            log.error("retention after step %d failed; nothing deleted", step, exc_info=exc)
            listed, deleted = None, []
        return _SaveOutcome(committed=True, error=None, deleted=deleted, listed=listed)

    def _written_files(self, write_dir: str, dcp_metadata: Any) -> list[FileEntry]:
        """Every file in ``write_dir``: as the writer listed it once every file was written
        (local saves: in process mode the daemon's listing, one GIL hand-over fewer per system
        call), else listed now."""
        listed = getattr(dcp_metadata, LISTING_ATTRIBUTE, None)
        if listed is None:
            return self._storage.list_files(write_dir)
        return [FileEntry(path=name, size=size) for name, size in sorted(listed.items())]

    def _plan_retention(
        self, just_committed: int, listed: list[int] | None
    ) -> tuple[list[int], list[int]]:
        """(committed steps in storage, steps retention deletes) after a commit, on rank 0
        (``listed``: the committed steps, listed just now; else listed here)."""
        with self._lock:
            being_written = self._in_flight | {just_committed}
        listed, doomed = pruning.list_and_plan_deletions(
            self._policy, self._records, being_written, listed
        )
        dry_run = self.config.retention_dry_run
        pruning.log_deletions(doomed, dry_run=dry_run)
        return listed, [] if dry_run else [decision.step for decision in doomed]

    def explain_retention(self) -> list[retention.RetentionDecision]:
        """What retention would decide now for every committed step, and why.

        Returns one ``RetentionDecision(step, kept, reasons)`` per committed step in storage,
        sorted by step. Reads storage (the listing and the commit records) on the calling rank;
        deletes nothing.
        """
        self._check_open()
        with self._lock:
            being_written = set(self._in_flight)
        reader = pruning.RecordReader(self._storage)
        return pruning.plan(self._policy, reader, being_written).decisions

    # -- waiting and closing ---------------------------------------------------------------------
    def join(self) -> None:
        """Wait for every pending async save and its retention work.

        Raises ``CheckpointError`` (with the original exception as ``__cause__``) if a background
        save failed since the last report; each failure is raised once.
        """
        self._check_process()
        self._writer.wait()
        self._raise_background_failure()

    def close(self) -> None:
        """Join, stop the background thread and put back signal handlers. Idempotent."""
        if self._closed:
            return
        if os.getpid() != self._pid:  # a forked child: the daemon, lease and writer are the
            self._closed = True  # parent's; only its copy of the signal handlers is its own
            if self._preemption is not None:
                self._preemption.close()
            return
        # Interrupted here (Ctrl-C), saves are still running: nothing is released, and close()
        # may be called again.
        self._writer.shutdown()  # from here on, a save (from another thread) is refused
        self._closed = True
        first_error: Exception | None = None
        interruption: BaseException | None = None
        for release in self._releases():  # each one, even after another failed
            try:
                release()
            except Exception as exc:
                log.error("closing the checkpoint manager: %s", exc, exc_info=exc)
                first_error = first_error or exc
            except BaseException as exc:  # Ctrl-C: the manager is closed, so the rest is
                interruption = interruption or exc  # released too (a second close() is a no-op)
        if interruption is not None:
            raise interruption
        self._warn_of_unanswered_notice()
        self._raise_background_failure()
        if first_error is not None:
            raise first_error

    def _releases(self) -> list[Callable[[], None]]:
        """What close() releases after the last save: daemon, staging memory (a closed
        manager that is still referenced held a copy of the state), lease, preemption sources
        (last: a signal that arrives meanwhile is still caught, see
        :meth:`_warn_of_unanswered_notice`)."""
        releases: list[Callable[[], None]] = [self._save_plans.forget]
        if self._save_process is not None:
            releases.append(self._save_process.close)  # (it holds staged views too)
        releases.append(self._staging.free_all)
        if self._lease is not None:
            releases.append(self._lease.release)
        if self._preemption is not None:
            releases.append(self._preemption.close)
        return releases

    def _warn_of_unanswered_notice(self) -> None:
        """A preemption notice that arrived and that no checkpoint answered (during close(),
        or after the loop's last decision) is acted on by nothing once the manager is closed:
        said so, so that a process that goes on (and is killed later) is not a mystery."""
        notice = self._preemption.notice if self._preemption is not None else None
        if notice is None:
            return
        log.warning(
            "a preemption notice (%s) arrived and no checkpoint answered it before the manager "
            "closed: nothing acts on it now (the signal handlers are put back)",
            notice.source,
        )

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except CheckpointError as close_error:  # do not hide the exception already unwinding
            log.error("error while closing the checkpoint manager: %s", close_error)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed")
        self._check_process()

    def _check_process(self) -> None:
        """Raise in a forked child: the manager's background writer, staging memory, checkpoint
        daemon and lease belong to the process that made it."""
        if os.getpid() != self._pid:
            raise CheckpointError(
                f"this CheckpointManager was made in process {self._pid}; a forked child "
                f"(process {os.getpid()}) cannot use it: its background writer, staging memory, "
                "checkpoint daemon and lease belong to the parent. Make a new CheckpointManager "
                "in the child."
            )

    # -- PyTorch/XLA's attributes (read-only) -----------------------------------------------------
    @property
    def base_path(self) -> str:
        """The root as given, ending in ``/`` (PyTorch/XLA's attribute; ``config.path``)."""
        return os.path.join(self.config.path, "")

    @property
    def save_interval(self) -> int | None:
        """``config.save_interval`` (PyTorch/XLA's attribute)."""
        return self.config.save_interval

    @property
    def max_to_keep(self) -> int:
        """``config.max_to_keep`` (PyTorch/XLA's attribute)."""
        return self.config.max_to_keep

    @property
    def num_of_threads(self) -> int:
        """``config.num_of_threads`` (PyTorch/XLA's attribute)."""
        return self.config.num_of_threads

    @property
    def chkpt_on_preemption(self) -> bool:
        """``config.chkpt_on_preemption`` (PyTorch/XLA's attribute)."""
        return self.config.chkpt_on_preemption

    # -- listing and restoring -------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Committed steps, sorted and unique (an async save appears once it is committed)."""
        with self._lock:
            return sorted(self._committed)

    def latest_step(self) -> int | None:
        """The highest committed step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def reached_preemption(self, step: int) -> bool:
        """True at the step whose checkpoint answered a preemption notice, once it is committed."""
        if self._preemption_claimed == step:
            self._check_process()
            self._writer.wait()
        return self._preemption_reached == step

    @gc_paused()  # many small objects: see ckptmgr.gc_pause
    def restore(self, step: int, state_dict: Mapping[str, Any]) -> None:
        """Load the checkpoint of ``step`` into ``state_dict`` in place.

        Tensors are filled in place; plain values are replaced in their dicts/lists; objects
        with ``load_state_dict`` get it called. Modules and optimizers are loaded as DCP's
        ``set_model_state_dict``/``set_optimizer_state_dict`` load them; an optimizer's missing
        state is created first. Raises :class:`StepNotFoundError` for a step that is not
        committed (or that another job deleted while it was read) and ``CheckpointError`` when
        ``state_dict`` has a key the checkpoint lacks.
        Under torch.distributed this is a collective, and it raises on every rank when the
        state of any rank does not match the checkpoint, or the ranks restore different steps.
        """
        self._check_open()
        step = _checked_step(step)
        self._writer.wait()
        with self._lock:
            known = set(self._committed)
        if step not in known:
            raise StepNotFoundError(step, known)
        deleted = self._restore_step(step, _mutable(state_dict), unlisted_raises=False)
        if deleted is not None:
            listed, failure = deleted
            raise StepNotFoundError(
                step, listed, "it was deleted while it was being restored"
            ) from failure

    def _restore_step(
        self, step: int, state_dict: MutableMapping[str, Any], *, unlisted_raises: bool
    ) -> tuple[list[int], Exception] | None:
        """Restore ``step``: None once restored; where it failed because the step was deleted
        meanwhile (another job's retention, say: storage no longer lists it), the steps storage
        lists and the failure. Any other failure is raised; where listing fails too, the listing's
        error with ``unlisted_raises`` (nothing then is known of the step), else the failure."""
        try:
            self._restorer.restore(step, state_dict)
        except Exception as exc:  # on every rank alike (restore is collective), so is this:
            listed: list[int] | None = None
            try:
                listed = self._list_from_storage()
            except CheckpointError as listing_error:
                if unlisted_raises:
                    raise listing_error from exc
                log.warning("could not list the steps after a failed restore: %s", listing_error)
            if listed is not None and step not in listed:
                return listed, exc
            raise
        return None

    def restore_latest(self, state_dict: Mapping[str, Any]) -> int | None:
        """Restore the newest committed step that is intact; returns it, or None if there is none.

        A step that turns out to be damaged (:class:`CorruptCheckpointError`: a missing or
        truncated file, a checksum mismatch, a damaged record or metadata) is logged, marked
        quarantined in storage (``quarantined.json`` in its directory: it is kept, never listed
        again and never deleted by retention) and the next older step is tried. Any other error,
        such as a ``state_dict`` that does not match the checkpoint, is raised as by
        :meth:`restore`: it says nothing about the checkpoint. Under torch.distributed this is a
        collective, and every rank restores (or quarantines) the same steps.
        """
        self._check_open()
        target = _mutable(state_dict)
        self._writer.wait()
        tried: set[int] = set()
        while True:
            left = [step for step in self._list_from_storage() if step not in tried]
            if not left:
                break
            step = left[-1]
            tried.add(step)
            try:
                deleted = self._restore_step(step, target, unlisted_raises=True)
            except CorruptCheckpointError as exc:  # (on every rank alike: restore is collective)
                self._quarantine(step, exc)
                continue
            if deleted is not None:  # another job's retention deleted it meanwhile
                log.warning(
                    "step %d was deleted while it was being restored (%s); trying the newest "
                    "step left",
                    step,
                    deleted[1],
                )
                continue
            return step
        log.warning("no intact committed checkpoint under %s", self.config.path)
        return None

    def _list_from_storage(self) -> list[int]:
        """The committed steps as storage lists them now (rank 0's listing on every rank), which
        the manager then lists too: steps another job committed or deleted since it looked."""
        listed: list[int] = []
        error: str | None = None
        if self._comm.is_coordinator:
            try:
                listed = self._storage.committed_steps()
            except Exception as exc:
                error = describe_error(exc)
        group = self._comm.background_group if self._comm.distributed else None
        listed, error = self._comm.broadcast((listed, error), group)
        if error is not None:
            raise CheckpointError(f"could not list the steps under {self.config.path}: {error}")
        with self._lock:
            self._committed = set(listed) - self._damaged
            return sorted(self._committed)

    def _quarantine(self, step: int, error: CorruptCheckpointError) -> None:
        """Mark ``step`` damaged in storage (rank 0; not with ``read_only``) and stop listing it
        (every rank)."""
        if self.config.read_only:
            log.error("step %d is damaged and is skipped (read_only: not marked): %s", step, error)
        elif not self._comm.is_coordinator:
            log.error("step %d is damaged and is quarantined: %s", step, error)
        else:
            try:
                marked = self._storage.quarantine(step, str(error))
            except Exception as exc:  # still skipped by this manager; retried by the next one
                log.error("step %d is damaged and is skipped: %s", step, error)
                log.error("could not record the quarantine of step %d: %s", step, exc)
            else:
                if marked:
                    log.error("step %d is damaged and is quarantined: %s", step, error)
                else:
                    log.error(
                        "step %d is damaged and is skipped (its directory is a symbolic link: "
                        "no marker is written through one): %s",
                        step,
                        error,
                    )
        with self._lock:
            self._committed.discard(step)
            self._damaged.add(step)

    def verify(self, step: int, deep: bool = False) -> None:
        """Check the files of a committed (or quarantined) step against its commit record.

        Checks that every file the record lists exists with its size (one listing of the step
        directory), and with ``deep=True`` also reads every file and compares its CRC-32, and
        parses ``.metadata`` with the restricted unpickler. Raises
        :class:`CorruptCheckpointError` naming every damaged file, :class:`StepNotFoundError`
        when the step is not in storage. Runs on the calling rank only (not a collective).
        """
        self._check_open()
        step = _checked_step(step)
        deep = _checked_bool(deep, "deep")
        storage = self._storage
        committed, quarantined = storage.listed_steps()
        if step not in committed and step not in quarantined:
            raise StepNotFoundError(step, committed)
        try:
            record = storage.read_record(step)
            problems = storage.verify_files(storage.step_path(step), record, deep=deep)
            if deep and not problems and any(entry.path == ".metadata" for entry in record.files):
                try:
                    dcp_io.read_metadata_file(
                        storage.fs, storage.step_path(step), [e.path for e in record.files]
                    )
                except CorruptCheckpointError as exc:
                    raise CorruptCheckpointError(
                        f"step {step} is damaged: {exc}", path=".metadata", step=step
                    ) from exc
            raise_problems(problems, step)
        except CheckpointError as exc:  # deleted meanwhile (another job's retention), or not
            try:
                committed, quarantined = storage.listed_steps()
            except Exception:  # (the failure at hand is the one raised)
                committed, quarantined = [step], []
            if step not in committed and step not in quarantined:
                raise StepNotFoundError(
                    step, committed, "it was deleted while it was being checked"
                ) from exc
            raise


def _build_policy(config: CheckpointConfig) -> retention.RetentionPolicy | None:
    """The configured policies plus ``KeepLatest(max_to_keep)``; None keeps everything."""
    policies = list(config.retention)
    if config.max_to_keep > 0:
        policies.append(retention.KeepLatest(config.max_to_keep))
    return retention.combine(policies)


def _mutable(state_dict: Any) -> MutableMapping[str, Any]:
    """``state_dict``, a ``MutableMapping`` (restore fills it), else ``CheckpointError``."""
    if not isinstance(state_dict, MutableMapping):
        raise CheckpointError(f"state_dict must be a dict, got {type(state_dict).__qualname__}")
    return state_dict


def _checked_bool(value: object, name: str) -> bool:
    """``value`` (the argument ``name``) as a bool: True, False, or a 0-d bool of numpy or
    torch (``step == last`` with a numpy step); "no", 0.0 and None, which read as true or
    false by chance, are refused alike."""
    if isinstance(value, bool):
        return value
    dtype = getattr(value, "dtype", None)
    if str(dtype) in ("bool", "torch.bool") and getattr(value, "shape", None) == ():
        return bool(value)
    raise ValueError(f"{name} must be True or False, got {value!r}")


def _all_storable(tensors: Mapping[str, torch.Tensor]) -> bool:
    """False when one of ``tensors`` is of a kind that cannot be stored (see
    :func:`tensor_bytes.check_storable`)."""
    try:
        tensor_bytes.check_all_storable(tensors)
    except CheckpointError:
        return False
    return True


def _checked_step(step: Any) -> int:
    if isinstance(step, bool):
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    try:
        value = operator.index(step)
    except TypeError:
        raise ValueError(f"step must be a non-negative int, got {step!r}") from None
    if value < 0:
        raise ValueError(f"step must be a non-negative int, got {value}")
    return value


def _checked_metrics(metrics: Mapping[str, float] | None) -> dict[str, float]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise ValueError(
            f"metrics must be a dict of str -> number, got {type(metrics).__qualname__}"
        )
    checked = {}
    for name, value in metrics.items():
        try:
            if not isinstance(name, str):
                raise TypeError("the name is not a str")
            checked[name] = _metric_value(value)
        except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
            raise ValueError(
                f"metrics must map str -> number; bad entry {name!r}: {value!r} ({exc})"
            ) from None
    return checked


def _metric_value(value: Any) -> float:
    """A metric as the float stored: a real number (Python's, NumPy's, any ``numbers.Real``)
    or a one-element tensor; never a bool. Raises TypeError, or the conversion's error (a
    number beyond a float's range: OverflowError; a tensor with no data: RuntimeError)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError("not a number")
    return float(value)


def _checked_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise ValueError(f"metadata must be a dict, got {type(metadata).__qualname__}")
    try:
        _require_str_keys(metadata, "metadata")
        return json.loads(json.dumps(dict(metadata), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"metadata must be a JSON document (str keys, finite numbers): {exc}"
        ) from None


def _require_str_keys(value: Any, path: str) -> None:
    """Raise TypeError for a dict key that JSON would silently turn into a string."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"key {key!r} at {path} is not a str")
            _require_str_keys(item, f"{path}/{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _require_str_keys(item, f"{path}[{index}]")
