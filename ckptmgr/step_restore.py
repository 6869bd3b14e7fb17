"""Reading one committed step into a state, in place: the restore path of the manager.

:class:`StepRestorer` reads a step's commit record, matches the state against it, reads the
step's files (the pack read ahead and unpacked as it is read; the rest by DCP's load) into the
state's tensors and sets its plain values and objects. Under torch.distributed every rank
learns whether any rank failed, before the load and after it, so that all raise or none does.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

import torch

from ckptmgr import dcp_io, direct_read, pack_load
from ckptmgr.collectives import Collectives
from ckptmgr.device_sync import wait_for_devices
from ckptmgr.errors import CheckpointError, CorruptCheckpointError, describe_error
from ckptmgr.integrity import expected_files
from ckptmgr.pack_read_ahead import PackReadAhead
from ckptmgr.packing import PACK_KEY
from ckptmgr.prefetch import Prefetch
from ckptmgr.record import CommitRecord, is_raw
from ckptmgr.retry import http_status
from ckptmgr.state import RestorePlan, plan_restore
from ckptmgr.storage import CheckpointStorage, objects_file_name

log = logging.getLogger("ckptmgr")


class StepRestorer:
    """Restores the committed steps of one storage root into states, in place (a collective
    under torch.distributed, over ``comm``'s background group)."""

    def __init__(self, storage: CheckpointStorage, comm: Collectives) -> None:
        self._storage = storage
        self._comm = comm

    def restore(self, step: int, state_dict: MutableMapping[str, Any]) -> None:
        """Load committed ``step`` into ``state_dict`` in place, as
        :meth:`ckptmgr.CheckpointManager.restore` describes; raises ``CheckpointError``, or
        ``CorruptCheckpointError`` for damage, on every rank when any rank fails."""
        # The disk reads ahead while the record is parsed and the state matched against it.
        prefetch = None
        if self._storage.is_local:
            read_directly = (dcp_io.DATA_SUFFIX,) if direct_read.DIRECT_READS else ()
            prefetch = Prefetch(self._storage.step_path(step), skip_suffixes=read_directly)
        pack_reads: list[PackReadAhead] = []
        try:
            self._restore(step, state_dict, pack_reads)
        finally:
            for pack_read in pack_reads:  # (a read ahead that the restore did not wait for)
                pack_read.wait()
            if prefetch is not None:
                prefetch.join()

    def _restore(
        self, step: int, state_dict: MutableMapping[str, Any], pack_reads: list[PackReadAhead]
    ) -> None:
        """The body of :meth:`restore`; adds the read ahead of the step's pack that it starts,
        if any, to ``pack_reads`` (for the caller to wait for)."""
        group = self._comm.background_group if self._comm.distributed else None
        pack_read: PackReadAhead | None = None
        plan: RestorePlan | None = None
        plan_error: Exception | None = None
        expected = None
        raw = True
        to_load: dict[str, torch.Tensor] = {}
        unpack: pack_load.Unpack = pack_load.unpack_nothing
        reader: Any = None
        try:
            record = self._storage.read_record(step)
            expected = expected_files(record.files, step=step) if record.files else None
            raw = is_raw(record)
            own_objects = objects_file_name(self._comm.rank)
            objects_rank = self._comm.rank if own_objects in record.object_files else 0
            objects_name = objects_file_name(objects_rank)
            # On a remote store, .metadata and the plain values are read beside the listing
            objects_ahead = self._storage.read_ahead(step, objects_name, expected)
            reader = self.step_reader(step, expected, raw)
            dcp_io.read_metadata_ahead(reader)
            if not self._comm.distributed:  # (DCP's load is collective under distributed)
                # (into a buffer of its own: started before the listing, which it overlaps)
                pack_read = self._read_pack_ahead(step, record, expected, raw, reader)
                if pack_read is not None:
                    pack_reads.append(pack_read)
            self._storage.check_sizes(step, record)  # every file, one listing
            saved_objects = self._storage.read_objects(step, objects_name, expected, objects_ahead)
            table = record.tensor_table
            plan = plan_restore(
                state_dict,
                table.names,
                saved_objects,
                self._comm.rank,
                objects_rank,
                saved_entries=table.entries,
                object_ranks=_object_ranks(record) if objects_rank != self._comm.rank else (),
            )
            to_load, unpack = pack_load.split_for_load(
                plan.tensors, record, None if pack_read is None else pack_read.buffer
            )
            # Work the caller still has queued on the destinations (on any stream) ends before
            # anything is written into them; here, so that a failure is agreed on like others.
            wait_for_devices(plan.tensors.values())
        except Exception as exc:
            plan_error = exc
        # DCP's load is collective: every rank learns first whether any rank could not match its
        # state against the checkpoint, so that such a rank never leaves the others waiting.
        try:
            self._agree_on_restore(step, plan_error, group)
        except BaseException:
            if plan is not None:  # another rank failed: leave this rank's state as it was
                plan.abandon()
            raise
        assert plan is not None and reader is not None
        load_error: Exception | None = None
        try:
            pack: dict[str, torch.Tensor] = {}  # the pack read ahead, unpacked as it is read
            if pack_read is not None and to_load.get(PACK_KEY) is pack_read.buffer:
                if pack_read.placed:
                    pack[PACK_KEY] = to_load.pop(PACK_KEY)
                elif pack_read.wait():  # (a read that looked up the pack's place itself)
                    del to_load[PACK_KEY]  # read ahead; else read below (and its damage raised)
            if to_load or self._comm.distributed:  # collective: also a rank with nothing to load
                # DCP's reader threads fill a non-contiguous device destination with a copy on
                # their own stream, which the caller's next work would not wait for: wait for
                # the devices after the load, a failed one too (its copies must not land after
                # restore raised), whose own error is then the one raised.
                try:
                    load_step(step, to_load, reader, group)
                except BaseException:
                    try:
                        wait_for_devices(to_load.values())
                    except Exception:
                        log.warning(
                            "restore of step %d: after the failed load, waiting for the "
                            "devices failed too",
                            step,
                            exc_info=True,
                        )
                    raise
                wait_for_devices(to_load.values())
            try:
                if pack:
                    assert pack_read is not None
                    self._unpack_as_read(step, unpack, pack_read, pack, reader)
                else:
                    unpack()
            except Exception as exc:
                if isinstance(exc, CheckpointError):
                    raise
                raise CheckpointError(f"restore of step {step} failed: {exc}") from exc
            plan.finish()  # plain values; objects' own load_state_dict (its error as raised)
        except Exception as exc:
            load_error = exc
        # ... and whether any rank failed after it (unpacking, a load_state_dict that raised),
        # so that every rank raises or none does (restore_latest then decides alike on all).
        self._agree_on_restore(step, load_error, group)
        log.info("restored step %d", step)

    @staticmethod
    def _unpack_as_read(
        step: int,
        unpack: pack_load.Unpack,
        pack_read: PackReadAhead,
        pack: dict[str, torch.Tensor],
        reader: Any,
    ) -> None:
        """Unpack the pack that ``pack_read`` reads ahead while it is read (one process only);
        where that read stops short or its file does not match the record, load the pack
        (``pack``: its key and buffer) with DCP, which raises what damage it finds, and unpack
        again in full."""
        try:
            unpack(filled_to=pack_read.filled_to)
            if pack_read.wait():
                return
        except pack_load.PackReadStopped:
            pack_read.wait()  # (it has ended: the buffer is no longer written)
        load_step(step, pack, reader, None)
        unpack()

    def _read_pack_ahead(
        self, step: int, record: CommitRecord, expected: Any, raw: bool, beside: Any
    ) -> PackReadAhead | None:
        """Start reading the pack of ``step`` (see :mod:`ckptmgr.pack_read_ahead`) with a
        reader of its own (sharing the files read ahead by ``beside``, the restore's); None when
        the step has no pack or its record lists no data file."""
        file_sizes = {entry.path: entry.size for entry in record.files}
        reader = self.step_reader(step, expected, raw, beside)
        return PackReadAhead.start(
            record.tensor_table, reader, file_sizes, local=self._storage.is_local
        )

    def step_reader(self, step: int, expected: Any, raw: bool, beside: Any = None) -> Any:
        """A DCP reader of ``step``'s files (see :func:`ckptmgr.dcp_io.make_reader`)."""
        return dcp_io.make_reader(
            self._storage.url_for(self._storage.step_path(step)),
            local=self._storage.is_local,
            storage_options=self._storage.storage_options,
            retry=self._storage.retry,
            expected=expected,
            raw=raw,
            beside=beside,
        )

    def _agree_on_restore(self, step: int, error: Exception | None, group: Any) -> None:
        """Raise on every rank if ``error`` (this rank's, or None) or any other rank's is not
        None, each rank alike ``CorruptCheckpointError`` when any rank found damage; a rank
        raises its own error where that is of the same kind. Every rank raises
        ``CheckpointError`` where the ranks restore different steps (each rank's state would be
        filled from its own step). Collective under distributed."""
        failures = self._comm.all_gather(
            (step, describe_error(error), isinstance(error, CorruptCheckpointError)), group
        )
        if any(other != step for other, _, _ in failures):
            steps = ", ".join(f"rank {rank}: {at}" for rank, (at, _, _) in enumerate(failures))
            raise CheckpointError(
                f"restore was called for different steps on the ranks ({steps}): every rank "
                "must restore the same step"
            ) from error
        failed = {rank: text for rank, (_, text, _) in enumerate(failures) if text is not None}
        if not failed:
            return
        damaged = any(corrupt for _, _, corrupt in failures)
        if error is not None and damaged == isinstance(error, CorruptCheckpointError):
            raise _storage_error_as_checkpoint_error(step, error)
        described = "; ".join(f"rank {rank}: {text}" for rank, text in failed.items())
        where = "another rank" if error is None else "more than one rank"
        message = f"restore of step {step} failed on {where}: {described}"
        if damaged:
            raise CorruptCheckpointError(message, step=step) from error
        raise CheckpointError(message) from error


def _storage_error_as_checkpoint_error(step: int, error: Exception) -> Exception:
    """``error``; or, for an error of storage (an ``OSError``, an HTTP error of gcsfs and the
    like) that reading the record, the plain values or a file's size ran into (after its
    retries), a ``CheckpointError`` naming the step, with ``error`` its cause: as a failed read
    of the data files raises (:func:`_load`), and as :meth:`StepRestorer.restore` promises.
    (The other ranks are told of ``error`` itself.)"""
    if isinstance(error, CheckpointError):
        return error
    if not (isinstance(error, OSError) or http_status(error) is not None):
        return error  # (the state's own: a Stateful's state_dict(), say, raised it)
    failure = CheckpointError(f"restore of step {step} failed: {describe_error(error)}")
    failure.__cause__ = error
    return failure


def _object_ranks(record: CommitRecord) -> list[int]:
    """The ranks whose plain values ``record``'s step holds (a file of its own each)."""
    files = set(record.object_files)
    return [rank for rank in range(record.world_size) if objects_file_name(rank) in files]


def load_step(
    step: int,
    tensors: dict[str, torch.Tensor],
    reader: Any,
    group: Any,
    planner: dcp_io.TensorOnlyLoadPlanner | None = None,
    *,
    what: str = "restore",
) -> None:
    """DCP's load of ``tensors`` (with ``planner``, see :func:`dcp_io.load_tensors`), its
    failures as one-line ``CheckpointError``s saying ``what`` of ``step`` failed (damage:
    ``CorruptCheckpointError``); Ctrl-C stays a ``KeyboardInterrupt``."""
    try:
        dcp_io.load_tensors(tensors, reader, group, planner)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # CheckpointException is a BaseException
        if isinstance(exc, CorruptCheckpointError):
            raise CorruptCheckpointError(
                f"{what} of step {step} failed: {exc}", path=exc.path, step=step
            ) from exc
        cause = describe_error(dcp_io.original_error(exc))  # (not every rank's traceback)
        raise CheckpointError(f"{what} of step {step} failed: {cause}") from exc
