"""Applying retention to what is in storage: list, read records, plan, delete.

Used by the manager after each commit (on rank 0) and by ``ckptmgr prune``. Everything a policy
sees comes from storage (the listing and the commit records), so retention is right after a
restart and over steps written by other runs or processes.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ckptmgr.errors import CheckpointError, describe_error
from ckptmgr.record import RECORD_NAME
from ckptmgr.retention import (
    CheckpointInfo,
    RetentionDecision,
    RetentionPolicy,
    plan_deletions,
    plan_retention,
)
from ckptmgr.storage import CheckpointStorage, step_dir_name

log = logging.getLogger("ckptmgr")


@dataclass
class RetentionPlan:
    """The committed steps found in storage and the decision for each."""

    listed: list[int]
    decisions: list[RetentionDecision]

    @property
    def doomed(self) -> list[int]:
        """The steps the plan deletes, sorted."""
        return sorted(d.step for d in self.decisions if not d.kept)


_COMMITS_BY_ROOT: Counter[str] = Counter()
"""How many commits this process's managers made, by root (:func:`root_key`): their own and
their checkpoint daemons'."""
_COMMITS_LOCK = threading.Lock()


def root_key(storage: CheckpointStorage) -> str:
    """One name per root: a local root reached through a link is the same root."""
    if storage.is_local:
        return os.path.realpath(storage.root)
    return storage.url_for(storage.root)


def commits_to(storage: CheckpointStorage) -> int:
    """How many commits this process's managers made to ``storage``'s root so far."""
    with _COMMITS_LOCK:
        return _COMMITS_BY_ROOT[root_key(storage)]


def local_record_stamp(root: str) -> Callable[[int], object]:
    """What identifies each step's commit record under the local ``root`` as written: its
    inode, modification time and size (None while there is none). A step deleted and saved
    again has a new record, in a new directory renamed into place."""

    def stamp(step: int) -> object:
        try:
            found = os.stat(os.path.join(root, step_dir_name(step), RECORD_NAME))
        except OSError:
            return None
        return (found.st_ino, found.st_mtime_ns, found.st_size)

    return stamp


@dataclass
class RecordReader:
    """Reads the retention-relevant part of commit records, each committed record once.

    A commit record never changes once written, so what was read for a step stays valid for as
    long as that step is listed, unless the step was deleted and committed again meanwhile
    unseen: by another manager of this process on the same root (where managers share the
    owner lease), whose commits this reader counts (:meth:`remember`); what it read is then
    read again. (Another process does not write the root while this one holds its lease.)

    ``stamp`` (a local root's :func:`local_record_stamp`), where given, is checked for every
    step read before: a record whose stamp changed is read again. The checkpoint daemon's
    reader has one: it cannot count the commits of the training process (another manager's
    during its write were unseen, and it judged a step saved again by its old record).
    """

    storage: CheckpointStorage
    stamp: Callable[[int], object] | None = None
    _cache: dict[int, CheckpointInfo] = field(default_factory=dict)
    _stamps: dict[int, object] = field(default_factory=dict)
    _key: str = ""
    _commits_seen: int = 0

    def __post_init__(self) -> None:
        self._key = root_key(self.storage)
        self._commits_seen = commits_to(self.storage)

    def remember(self, info: CheckpointInfo, *, keep: bool = True) -> None:
        """The manager of this reader committed ``info.step``: counted for the root, and what
        its record says is taken from memory instead of being read back (``keep`` False: not
        kept, where nothing plans retention with this reader)."""
        with _COMMITS_LOCK:
            seen = _COMMITS_BY_ROOT[self._key]
            _COMMITS_BY_ROOT[self._key] = seen + 1
            self._check_commits(seen)
            self._commits_seen = seen + 1
        if keep:
            self._cache[info.step] = info
            if self.stamp is not None:
                self._stamps[info.step] = self.stamp(info.step)
        else:
            self._cache.pop(info.step, None)

    def _check_commits(self, commits: int) -> None:
        """Forget what was read if the root had commits this reader did not make (``commits``:
        the count now)."""
        if commits != self._commits_seen:
            self._cache.clear()
            self._commits_seen = commits

    def infos(self, steps: Iterable[int]) -> tuple[list[CheckpointInfo], dict[int, str]]:
        """The infos of ``steps``, and the steps whose record could not be read (with why)."""
        with _COMMITS_LOCK:
            self._check_commits(_COMMITS_BY_ROOT[self._key])
        wanted = set(steps)
        for stale in set(self._cache) - wanted:
            del self._cache[stale]
        stamps: dict[int, object] = {}
        if self.stamp is not None:
            self._stamps = {step: self._stamps.get(step) for step in self._cache}
            for step in wanted:
                stamps[step] = self.stamp(step)
                if step in self._cache and stamps[step] != self._stamps[step]:
                    del self._cache[step]  # (written again since it was read)
        unreadable: dict[int, str] = {}
        for step in sorted(wanted - set(self._cache)):
            try:
                record = self.storage.read_record(step)
            except (CheckpointError, OSError) as exc:  # (OSError: say no permission)
                unreadable[step] = " ".join(str(exc).split())  # (on one line)
                continue
            self._cache[step] = CheckpointInfo(step, record.committed_at, dict(record.metrics))
            if self.stamp is not None:
                self._stamps[step] = stamps[step]  # (taken before the read)
        return [self._cache[s] for s in sorted(wanted) if s in self._cache], unreadable


def plan(
    policy: RetentionPolicy | None,
    reader: RecordReader,
    being_written: Iterable[int] = (),
) -> RetentionPlan:
    """List committed steps in storage and decide which ``policy`` keeps.

    Steps whose commit record cannot be read are kept (and say so): retention never deletes
    what it cannot judge.
    """
    listed = reader.storage.committed_steps()
    infos, unreadable = reader.infos(listed)
    decisions = plan_retention(policy, infos, being_written)
    decisions += [
        RetentionDecision(step, True, [f"protected: commit record unreadable ({why})"])
        for step, why in unreadable.items()
    ]
    decisions.sort(key=lambda d: d.step)
    return RetentionPlan(listed, decisions)


def list_and_plan_deletions(
    policy: RetentionPolicy | None,
    reader: RecordReader,
    being_written: Iterable[int] = (),
    listed: list[int] | None = None,
) -> tuple[list[int], list[RetentionDecision]]:
    """What :func:`plan` lists and the decisions of it that delete, without explaining the steps
    that are kept (what runs after every commit). Without a policy only the listing is made.
    ``listed``: the committed steps, listed from storage just now by the caller (else listed
    here)."""
    if listed is None:
        listed = reader.storage.committed_steps()
    if policy is None:
        return listed, []
    infos, _ = reader.infos(listed)  # a step whose record cannot be read is kept
    return listed, plan_deletions(policy, infos, being_written)


def confirm_owner_before_deleting(confirm: Callable[[], None], root: str) -> None:
    """``confirm()`` (reads the owner lease's record now) before retention deletes under
    ``root``: a ``CheckpointError`` (the lease was taken over) as it is, any other failure as a
    ``CheckpointError`` too: a record that cannot be read deletes nothing either."""
    try:
        confirm()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"retention deleted nothing: the owner lease could not be read to confirm that "
            f"this job still owns {root}: {describe_error(exc)}"
        ) from exc


def delete_steps(
    storage: CheckpointStorage,
    steps: Iterable[int],
    on_deleted: Callable[[int], None] | None = None,
    *,
    purpose: str = "retention",
    before_each: Callable[[], None] | None = None,
) -> None:
    """Delete ``steps``; tries every one, then raises ``CheckpointError`` naming the failures.

    ``on_deleted`` is called after each step that was deleted; ``purpose`` names the caller in
    logs and errors. ``before_each`` is called before each step is deleted: what it raises (the
    root's lease lost, say) stops the deletes and is raised.
    """
    failures: list[tuple[int, Exception]] = []
    stopped: tuple[int, Exception] | None = None
    for step in steps:
        if before_each is not None:
            try:
                before_each()
            except Exception as exc:  # (the root's lease lost, or not to be read)
                stopped = (step, exc)
                break
        try:
            storage.delete_step(step)
        except Exception as exc:
            failures.append((step, exc))
            continue
        log.info("deleted step %d (%s)", step, purpose)
        if on_deleted is not None:
            on_deleted(step)
    problems: list[str] = []
    if failures:
        first_step, first_error = failures[0]
        problems.append(
            f"{purpose} could not delete step(s) {[s for s, _ in failures]} (step {first_step}: "
            f"{type(first_error).__name__}: {_first_line(first_error)}); they stay in storage"
        )
    if stopped is not None:
        step, error = stopped
        problems.append(
            f"{purpose} stopped before step {step}: {type(error).__name__}: "
            f"{_first_line(error)}; it and the steps after it stay in storage"
        )
    if problems:
        cause = stopped[1] if stopped is not None else failures[0][1]
        raise CheckpointError("; ".join(problems)) from cause


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def log_plan(plan_: RetentionPlan, *, dry_run: bool) -> None:
    """Log what a plan deletes (or would delete, in a dry run), with the reasons."""
    log_deletions(plan_.decisions, dry_run=dry_run)


def log_deletions(decisions: Iterable[RetentionDecision], *, dry_run: bool) -> None:
    """Log the decisions that delete (or would, in a dry run), with the reasons."""
    for decision in decisions:
        if decision.kept:
            continue
        verb = "would delete" if dry_run else "deleting"
        log.info("retention %s step %d: %s", verb, decision.step, "; ".join(decision.reasons))
