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
(:func:`ckptmgr.storage.commit_local_step`) and lists the committed steps for retention; with a
:class:`DaemonRetention` (ckptmgr's own policies) it plans retention over that listing, reads the
lease again and deletes what is not kept. The answer carries a :class:`DaemonCommitResult`;
what the commit raised fails the save as a failed commit would (nothing is committed then:
never a half-written step). A save that fails after the rename (the daemon died during its
retention, say) finds its record in storage, and the training process reports it committed.
What retention meets (a policy that raises, a lost lease, a failed deletion) is in the result:
the step stays committed, and nothing, or what could be, is deleted.

Used for single-process saves on a local disk only: under ``torch.distributed`` rank 0 commits
after hearing from every rank, in the training process.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptmgr import pruning
from ckptmgr.errors import CheckpointError
from ckptmgr.gc_pause import gc_paused
from ckptmgr.packing import PackedTensor, RecordTableCache
from ckptmgr.record import CommitRecord, FileEntry, files_with_checksums, tensor_entries, utc_now
from ckptmgr.retention import CheckpointInfo, RetentionDecision, RetentionPolicy
from ckptmgr.save_process import CHECKSUMS_ATTRIBUTE, LISTING_ATTRIBUTE
from ckptmgr.storage import CheckpointStorage, commit_local_step, local_committed_steps

__all__ = ["DaemonCommit", "DaemonCommitResult", "DaemonRetention"]

_TABLES = RecordTableCache()
"""In the process that commits (the daemon): the tensor table of the last commit, reused while
the layout (the very object kept in the daemon) and DCP's entries are unchanged."""


_READERS: dict[str, tuple[int, pruning.RecordReader]] = {}
"""In the process that commits: by root, what retention knows of the steps' records there, with
the :attr:`DaemonRetention.commits_elsewhere` it was read under."""


@dataclass(frozen=True)
class DaemonRetention:
    """Retention right after a :class:`DaemonCommit`, in the same process: ``policy`` (made of
    ckptmgr's own policies only: :func:`ckptmgr.retention.is_builtin`) planned over the steps
    listed after the commit, ``being_written`` protected, and the doomed steps deleted once
    ``confirm_owner`` (None: no lease) found the root still the job's.

    ``commits_elsewhere``: how many commits to the root the training process made so far
    other than this daemon's (``save()``'s, another manager's on the same root). A commit
    record this process read stays valid while its step is listed, unless the step was deleted
    and committed again where this process did not see it: the records read are read again
    when the count changed (a step that retention here deleted, saved again by ``save()``, kept
    its old metrics, and KeepBest deleted the best step)."""

    policy: RetentionPolicy
    being_written: frozenset[int]
    confirm_owner: Callable[[], None] | None
    commits_elsewhere: int = 0


@dataclass(frozen=True)
class DaemonCommitResult:
    """What a :class:`DaemonCommit` did: when it committed (the record's ``committed_at``),
    whether it moved a quarantined step aside first (to ``aside``), and the committed steps
    listed in the root after the commit (before any deletion). With a :class:`DaemonRetention`:
    the decisions that delete (``doomed``), the steps deleted (``deleted``), why planning failed
    (``planning_error``: then nothing was deleted), and the error of the deletions
    (``deletion_error``: the steps it names were not deleted)."""

    committed_at: _dt.datetime
    moved_aside: bool
    listed: list[int]
    doomed: list[RetentionDecision] | None = None
    deleted: list[int] | None = None
    planning_error: str | None = None
    deletion_error: CheckpointError | None = None


class DaemonCommit:
    """The commit of one local step, run by the writer's ``finish`` where the step was written.

    ``fields``: the record's fields other than ``committed_at``, ``files`` and
    ``tensor_table`` (which are made here). ``layout``: the pack layout of the save (stored
    name -> :class:`~ckptmgr.packing.PackedTensor`), in a request as what
    :meth:`~ckptmgr.save_process.SaveProcess.kept_in_daemon` made of it. ``confirm_owner``:
    raises unless the root's owner lease is still the saving job's (None: no lease). The
    paths are those of :func:`ckptmgr.storage.commit_local_step`.
    """

    __slots__ = (
        "aside",
        "confirm_owner",
        "fields",
        "final",
        "layout",
        "retention",
        "root",
        "write_dir",
    )

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
        retention: DaemonRetention | None = None,
    ) -> None:
        self.root = root
        self.write_dir = write_dir
        self.final = final
        self.aside = aside
        self.fields = dict(fields)
        self.layout = layout
        self.confirm_owner = confirm_owner
        self.retention = retention

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
        listed = local_committed_steps(self.root)
        if self.retention is None:
            return DaemonCommitResult(committed_at, moved_aside, listed)
        info = CheckpointInfo(record.step, committed_at, dict(record.metrics))
        return self._retain(info, moved_aside, listed, self.retention)

    def _retain(
        self,
        committed: CheckpointInfo,
        moved_aside: bool,
        listed: list[int],
        retention: DaemonRetention,
    ) -> DaemonCommitResult:
        """Retention after the commit of ``committed`` (never raises: the step is committed)."""
        known = _READERS.get(self.root)
        if known is not None and known[0] == retention.commits_elsewhere:
            reader = known[1]
        else:
            reader = pruning.RecordReader(
                CheckpointStorage(self.root, create=False),
                stamp=pruning.local_record_stamp(self.root),
            )
            _READERS[self.root] = (retention.commits_elsewhere, reader)
        reader.remember(committed)
        done = DaemonCommitResult
        try:
            _, doomed = pruning.list_and_plan_deletions(
                retention.policy, reader, retention.being_written, listed
            )
        except Exception as exc:
            return done(committed.committed_at, moved_aside, listed, [], [], repr(exc))
        deleted: list[int] = []
        if not doomed:
            return done(committed.committed_at, moved_aside, listed, doomed, deleted)
        try:
            if retention.confirm_owner is not None:
                pruning.confirm_owner_before_deleting(retention.confirm_owner, self.root)
            steps = [decision.step for decision in doomed]
            pruning.delete_steps(reader.storage, steps, on_deleted=deleted.append)
        except CheckpointError as exc:
            return done(committed.committed_at, moved_aside, listed, doomed, deleted, None, exc)
        return done(committed.committed_at, moved_aside, listed, doomed, deleted)
