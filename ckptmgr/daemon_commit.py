"""The commit of a local step, made by the DCP writer that wrote it (in the checkpoint daemon).

In process mode the training process used to commit each local step itself once the daemon
answered: it built the commit record, wrote and synced it, renamed the write directory and
listed the root for retention. All of that holds the training process's GIL at times, and each
of its twenty-odd system calls hands the GIL back and forth with a Python-bound training loop.
Sending the record to the daemon instead (tried at b0ed874) cost more than it saved: 0.7 MB of
record for 20,000 tensors crossed the pipe in several writes.

So the save request carries a :class:`DaemonCommit` instead: the record's few per-save fields
and the layout of the pack of small tensors (sent once per layout, then by token: see
:meth:`ckptmgr.save_process.SaveProcess.kept_in_daemon`). The writer's ``finish`` (in the daemon,
once ``.metadata`` is written and the files are listed) calls it: it makes the record there
(the tensor table from DCP's metadata and the layout, its JSON text cached while the layout
holds), confirms the owner lease from storage, commits the step
(:func:`ckptmgr.storage.commit_local_step`) and lists the committed steps for retention. The
answer carries a :class:`DaemonCommitResult`; what it raised fails the save as a failed commit
would (nothing is committed then, or, if the daemon died after the rename, a step is
committed that the training process reports as failed: never a half-written one).

Used for single-process saves on a local disk only: under ``torch.distributed`` rank 0 commits
after hearing from every rank, in the training process.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptmgr.gc_pause import gc_paused
from ckptmgr.packing import PackedTensor, RecordTableCache
from ckptmgr.record import CommitRecord, FileEntry, files_with_checksums, tensor_entries, utc_now
from ckptmgr.save_process import CHECKSUMS_ATTRIBUTE, LISTING_ATTRIBUTE
from ckptmgr.storage import commit_local_step, local_committed_steps

__all__ = ["DaemonCommit", "DaemonCommitResult"]

_TABLES = RecordTableCache()
"""In the process that commits (the daemon): the tensor table of the last commit, reused while
the layout (the very object kept in the daemon) and DCP's entries are unchanged."""


@dataclass(frozen=True)
class DaemonCommitResult:
    """What a :class:`DaemonCommit` did: when it committed (the record's ``committed_at``),
    whether it moved a quarantined step aside first (to ``aside``), and the committed steps
    listed in the root after the commit."""

    committed_at: _dt.datetime
    moved_aside: bool
    listed: list[int]


class DaemonCommit:
    """The commit of one local step, run by the writer's ``finish`` where the step was written.

    ``fields``: the record's fields other than ``committed_at``, ``files`` and
    ``tensor_table`` (which are made here). ``layout``: the pack layout of the save (stored
    name -> :class:`~ckptmgr.packing.PackedTensor`), in a request as what
    :meth:`~ckptmgr.save_process.SaveProcess.kept_in_daemon` made of it. ``confirm_owner``:
    raises unless the root's owner lease is still the saving job's (None: no lease). The
    paths are those of :func:`ckptmgr.storage.commit_local_step`.
    """

    __slots__ = ("aside", "confirm_owner", "fields", "final", "layout", "root", "write_dir")

    def __init__(
        self,
        *,
        root: str,
        write_dir: str,
        final: str,
        aside: str,
        fields: Mapping[str, Any],
        layout: Any,
        confirm_owner: Callable[[], None] | None,
    ) -> None:
        self.root = root
        self.write_dir = write_dir
        self.final = final
        self.aside = aside
        self.fields = dict(fields)
        self.layout = layout
        self.confirm_owner = confirm_owner

    def __getstate__(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for name, value in zip(self.__slots__, state, strict=True):
            setattr(self, name, value)

    def __call__(self, dcp_metadata: Any) -> DaemonCommitResult:
        """Commit the step DCP just finished (``dcp_metadata`` carries the writer's listing and
        checksums); raises what stops the commit, and commits nothing then."""
        listing: Mapping[str, int] = getattr(dcp_metadata, LISTING_ATTRIBUTE)
        written: Mapping[str, tuple[int, int]] = getattr(dcp_metadata, CHECKSUMS_ATTRIBUTE)
        layout: Mapping[str, PackedTensor] = self.layout
        with gc_paused():  # the first commit of a layout makes an entry per packed tensor
            table = _TABLES.table(tensor_entries(dcp_metadata), layout)
        listed = [FileEntry(path=name, size=size) for name, size in sorted(listing.items())]
        committed_at = utc_now()
        record = CommitRecord(
            **self.fields,
            committed_at=committed_at,
            files=files_with_checksums(listed, written),
            tensor_table=table,
        )
        if self.confirm_owner is not None:  # another job took the root over: commit nothing
            self.confirm_owner()
        moved_aside = commit_local_step(
            self.root, self.write_dir, self.final, self.aside, record.to_json()
        )
        return DaemonCommitResult(committed_at, moved_aside, local_committed_steps(self.root))
