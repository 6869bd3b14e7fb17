"""ckptmgr.daemon_commit: the commit (and retention) a DCP writer's finish makes of a local step.

In process mode this runs in the checkpoint daemon (tests/test_process_mode.py saves through a
real one). Here the same writer and commit run in this process, on real files, so that faults
can be injected where they are hard to time between processes: an owner lease lost between the
commit and retention's deletions, a policy that raises.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from ckptmgr import CheckpointError, CommitRecord, KeepBest, KeepLatest, dcp_io
from ckptmgr.daemon_commit import DaemonCommit, DaemonCommitResult, DaemonRetention
from ckptmgr.lease import LeaseLostError
from ckptmgr.retention import CheckpointInfo
from ckptmgr.save_process import COMMITTED_ATTRIBUTE
from ckptmgr.storage import CheckpointStorage, objects_file_name


def commit_step(
    root: Path,
    step: int,
    metrics: dict[str, float],
    *,
    retention: DaemonRetention | None = None,
    confirm_owner: Callable[[], None] | None = None,
) -> DaemonCommitResult:
    """Write ``step`` with ckptmgr's local DCP writer, committed by its finish."""
    storage = CheckpointStorage(str(root))
    write_dir = storage.write_dir(step, uuid.uuid4().hex[:16])
    storage.prepare_write_dir(write_dir)
    writer = dcp_io.make_writer(write_dir, local=True, thread_count=1, storage_options={})
    writer.small_files = {objects_file_name(0): b"{}"}
    writer.commit = DaemonCommit(
        root=storage.root,
        write_dir=write_dir,
        final=storage.step_path(step),
        aside=storage.aside_path(step),
        fields={"step": step, "save_id": "s", "world_size": 1, "metrics": metrics},
        layout={},
        confirm_owner=confirm_owner,
        retention=retention,
    )
    tensors = {"w": torch.arange(16, dtype=torch.float32) + step}
    metadata = dcp_io.save_tensors(tensors, writer, None)
    result: DaemonCommitResult = getattr(metadata, COMMITTED_ATTRIBUTE)
    return result


def step_dirs(root: Path) -> list[str]:
    return sorted(path.name for path in root.iterdir() if path.is_dir())


def test_the_writer_commits_the_step_and_lists_the_root(tmp_path: Path) -> None:
    first = commit_step(tmp_path, 1, {"loss": 1.0})
    second = commit_step(tmp_path, 2, {"loss": 2.0})
    assert (first.listed, second.listed) == ([1], [1, 2])
    assert not first.moved_aside and second.deleted is None
    record = CommitRecord.from_json((tmp_path / "step_000000000002" / "commit.json").read_bytes())
    assert record.committed_at == second.committed_at and record.metrics == {"loss": 2.0}
    assert sorted(entry.path for entry in record.files) == sorted(
        path.name
        for path in (tmp_path / "step_000000000002").iterdir()
        if path.name != "commit.json"
    )
    assert all(entry.crc32 is not None for entry in record.files)


def test_retention_reads_the_records_it_did_not_commit_and_deletes_what_it_keeps_not(
    tmp_path: Path,
) -> None:
    """Steps committed before (by another writer, say) are judged by their records on disk."""
    for step, loss in ((1, 0.1), (2, 0.9), (3, 0.8)):
        commit_step(tmp_path, step, {"loss": loss})
    policy = KeepBest(n=1, metric="loss") | KeepLatest(n=1)
    result = commit_step(
        tmp_path, 4, {"loss": 0.7}, retention=DaemonRetention(policy, frozenset({4}), None)
    )
    assert result.listed == [1, 2, 3, 4]
    assert result.deleted == [2, 3] and [d.step for d in result.doomed or []] == [2, 3]
    assert result.deletion_error is None and result.planning_error is None
    assert step_dirs(tmp_path) == ["step_000000000001", "step_000000000004"]


def test_retention_deletes_nothing_when_the_lease_is_lost_after_the_commit(
    tmp_path: Path,
) -> None:
    """The owner record is read before the commit and again before the deletions: lost in
    between, the step is committed and nothing is deleted, with the loss as the error."""
    commit_step(tmp_path, 1, {})
    reads: list[int] = []

    def lost_after_the_first_read() -> None:
        reads.append(1)
        if len(reads) > 1:
            raise LeaseLostError("the owner lease was taken over by job 'thief'")

    result = commit_step(
        tmp_path,
        2,
        {},
        confirm_owner=lost_after_the_first_read,
        retention=DaemonRetention(KeepLatest(n=1), frozenset({2}), lost_after_the_first_read),
    )
    assert len(reads) == 2 and result.listed == [1, 2]
    assert result.deleted == [] and [d.step for d in result.doomed or []] == [1]
    assert isinstance(result.deletion_error, LeaseLostError)
    assert step_dirs(tmp_path) == ["step_000000000001", "step_000000000002"]


def test_an_unreadable_lease_deletes_nothing(tmp_path: Path) -> None:
    commit_step(tmp_path, 1, {})

    def unreadable() -> None:
        raise OSError("I/O error")

    result = commit_step(
        tmp_path, 2, {}, retention=DaemonRetention(KeepLatest(n=1), frozenset({2}), unreadable)
    )
    assert result.deleted == []
    assert isinstance(result.deletion_error, CheckpointError)
    assert "retention deleted nothing" in str(result.deletion_error)
    assert step_dirs(tmp_path) == ["step_000000000001", "step_000000000002"]


class RaisingPolicy:
    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        raise RuntimeError("a broken policy")


def test_a_policy_that_raises_deletes_nothing_and_the_step_stays_committed(
    tmp_path: Path,
) -> None:
    commit_step(tmp_path, 1, {})
    result = commit_step(
        tmp_path, 2, {}, retention=DaemonRetention(RaisingPolicy(), frozenset({2}), None)
    )
    assert result.listed == [1, 2] and result.deleted == []
    assert result.planning_error is not None and "a broken policy" in result.planning_error
    assert step_dirs(tmp_path) == ["step_000000000001", "step_000000000002"]


def test_a_lease_lost_before_the_commit_commits_nothing(tmp_path: Path) -> None:
    def lost() -> None:
        raise LeaseLostError("the owner lease was taken over by job 'thief'")

    with pytest.raises(CheckpointException) as raised:  # DCP's, around what finish raised
        commit_step(tmp_path, 1, {}, confirm_owner=lost)
    first_failure = next(iter(raised.value.failures.values()))[0]
    assert isinstance(first_failure, LeaseLostError)
    assert [name for name in step_dirs(tmp_path) if name.startswith("step_")] == []


def test_a_daemon_commit_pickles_whole(tmp_path: Path) -> None:
    """What travels to the daemon: every field, the retention with it."""
    import pickle

    retention = DaemonRetention(KeepLatest(n=2), frozenset({3}), None)
    commit = DaemonCommit(
        root="/r",
        write_dir="/r/w",
        final="/r/f",
        aside="/r/a",
        fields={"step": 3},
        layout={},
        confirm_owner=None,
        retention=retention,
    )
    again: Any = pickle.loads(pickle.dumps(commit))
    assert (again.root, again.write_dir, again.final, again.aside) == ("/r", "/r/w", "/r/f", "/r/a")
    assert again.fields == {"step": 3} and again.retention == retention
