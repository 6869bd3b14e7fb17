"""Retention and save policies through a real CheckpointManager on a real directory.

Retention is planned from storage (the listing and the commit records) after every commit, so it
must be right after a restart, over steps of an earlier run, and with steps written by others.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from ckptmgr import (
    CheckpointConfig,
    CheckpointInfo,
    CheckpointManager,
    CommitRecord,
    KeepBest,
    KeepEveryNSteps,
    KeepLatest,
    RetentionDecision,
    SaveAtSteps,
    SaveContext,
    SaveEveryNSeconds,
    SaveFirstStep,
)
from ckptmgr.record import record_bytes
from ckptmgr.storage import CheckpointStorage


def _state(value: float = 1.0) -> dict[str, object]:
    return {"w": torch.full((4,), value), "note": "x"}


def _manager(path: Path, **kwargs: object) -> CheckpointManager:
    kwargs.setdefault("save_interval", 1)
    return CheckpointManager(path, chkpt_on_preemption=False, **kwargs)  # type: ignore[arg-type]


def _disk_steps(path: Path) -> list[int]:
    return sorted(
        int(p.name.removeprefix("step_"))
        for p in path.iterdir()
        if p.name.startswith("step_") and (p / "commit.json").exists()
    )


def test_a_step_is_kept_if_any_policy_keeps_it(ckpt_dir: Path) -> None:
    with _manager(ckpt_dir, retention=KeepEveryNSteps(10) | KeepLatest(2)) as manager:
        for step in range(1, 26):
            assert manager.save(step, _state(step))
        assert manager.all_steps() == [10, 20, 24, 25]
    assert _disk_steps(ckpt_dir) == [10, 20, 24, 25]


def test_max_to_keep_adds_keep_latest_to_a_list_of_policies(ckpt_dir: Path) -> None:
    with _manager(ckpt_dir, max_to_keep=1, retention=[KeepEveryNSteps(5)]) as manager:
        for step in range(1, 12):
            manager.save_async(step, _state(step))
        manager.join()
        assert manager.all_steps() == [5, 10, 11]


def test_without_policies_everything_is_kept(ckpt_dir: Path) -> None:
    with _manager(ckpt_dir) as manager:
        for step in range(5):
            manager.save(step, _state())
        assert manager.all_steps() == [0, 1, 2, 3, 4]
        decisions = manager.explain_retention()
    assert [d.step for d in decisions] == [0, 1, 2, 3, 4]
    assert all(d.kept and "no retention policy" in d.reasons[0] for d in decisions)


def test_retention_after_a_restart_covers_steps_of_the_earlier_run(ckpt_dir: Path) -> None:
    with _manager(ckpt_dir) as earlier:
        for step in (1, 2, 3, 4):
            earlier.save(step, _state(), metrics={"val_loss": 5.0 - step if step != 2 else 0.1})
    with _manager(ckpt_dir, max_to_keep=1, retention=KeepBest(1, "val_loss")) as later:
        assert later.all_steps() == [1, 2, 3, 4]
        later.save(5, _state(), metrics={"val_loss": 3.0})
        # Step 2 has the best loss, read from the earlier run's record; step 5 is the latest.
        assert later.all_steps() == [2, 5]
    assert _disk_steps(ckpt_dir) == [2, 5]


def test_the_most_recently_committed_step_survives_a_rewind(ckpt_dir: Path) -> None:
    with _manager(ckpt_dir) as first:
        for step in (100, 200, 300):
            first.save(step, _state())
    # The job rewinds to step 100 and saves 150: KeepLatest(1) keeps 300, but 150 is the
    # newest by commit time and is protected.
    with _manager(ckpt_dir, max_to_keep=1) as rewound:
        rewound.save(150, _state())
        assert rewound.all_steps() == [150, 300]
        reasons = {d.step: d.reasons for d in rewound.explain_retention()}
    assert any("most recently committed" in r for r in reasons[150])
    assert any("KeepLatest" in r for r in reasons[300])


@pytest.mark.parametrize("async_mode", ["thread", "process"])
def test_a_step_deleted_and_saved_again_is_judged_by_its_new_record(
    ckpt_dir: Path, async_mode: str
) -> None:
    """Retention read each commit record once, taking a record for good while its step stays
    listed. In process mode the daemon, which plans retention after its commits, kept its
    own copy of step 2's first record (loss 0.9) after retention deleted the step and save()
    (committing in the training process) saved it again with loss 0.1: the next save_async
    deleted the new step 2, the best one. Both modes keep it."""
    with _manager(
        ckpt_dir, retention=KeepBest(1, "loss") | KeepLatest(1), async_mode=async_mode
    ) as manager:
        for step, loss in ((1, 0.5), (2, 0.9), (3, 0.8)):
            assert manager.save_async(step, _state(step), metrics={"loss": loss})
            manager.join()
        assert _disk_steps(ckpt_dir) == [1, 3]  # (retention deleted 2 after step 3's commit)
        assert manager.save(2, _state(2), metrics={"loss": 0.1})  # a rewind saves 2 again
        assert manager.save_async(4, _state(4), metrics={"loss": 0.7})
        manager.join()
        assert manager.all_steps() == [2, 4]
    assert _disk_steps(ckpt_dir) == [2, 4]


@pytest.mark.parametrize("async_mode", ["thread", "process"])
def test_a_step_saved_again_by_another_manager_of_the_process_is_judged_by_its_new_record(
    ckpt_dir: Path, async_mode: str
) -> None:
    """Two managers of one process on one root (they share the owner lease): each kept the
    record it had read of step 2 (loss 0.9) while step 2 stayed listed, after the other
    deleted it and saved it again with loss 0.05, the best: its next save deleted the new
    step 2 (explain_retention, reading anew, said it was kept)."""
    policy = KeepBest(1, "loss") | KeepLatest(1)
    with _manager(ckpt_dir, retention=policy, async_mode=async_mode) as first:
        for step, loss in ((1, 0.1), (2, 0.9)):
            assert first.save_async(step, _state(step), metrics={"loss": loss})
            first.join()
        with _manager(ckpt_dir, retention=policy) as second:
            assert second.save(3, _state(3), metrics={"loss": 0.8})
            assert _disk_steps(ckpt_dir) == [1, 3]  # (retention deleted 2)
            assert second.save(2, _state(2), metrics={"loss": 0.05})  # saved again: the best
            assert _disk_steps(ckpt_dir) == [2, 3]
        assert first.save_async(4, _state(4), metrics={"loss": 0.7})
        first.join()
        assert first.all_steps() == [2, 4]
    assert _disk_steps(ckpt_dir) == [2, 4]


OTHER_MANAGER_DURING_THE_DAEMONS_WRITE = r"""
import os, sys, time
import torch

GATE, ENTERED = sys.argv[2] + "/gate", sys.argv[2] + "/entered"


def wait_for(path):
    deadline = time.monotonic() + 60
    while not os.path.exists(path):  # (a file another process makes: nothing to wait on)
        assert time.monotonic() < deadline, f"no {path} within 60 s"
        time.sleep(0.01)


if __name__ == "__mp_main__":  # the daemon: its third save waits for the gate
    import ckptmgr.daemon_save as daemon_save

    real, calls = daemon_save.save_in_daemon, []

    def gated(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            open(ENTERED, "w").close()
            wait_for(GATE)
        return real(*args, **kwargs)

    daemon_save.save_in_daemon = gated

from ckptmgr import CheckpointManager, KeepBest, KeepLatest

if __name__ == "__main__":
    root = sys.argv[1]
    policy = KeepBest(1, "loss") | KeepLatest(1)

    def make(**kwargs):
        return CheckpointManager(
            root, 1, chkpt_on_preemption=False, retention=policy, **kwargs
        )

    def state(value):
        return {"w": torch.full((4,), float(value))}

    with make(async_mode="process") as first:
        for step, loss in ((1, 0.1), (2, 0.9)):
            assert first.save_async(step, state(step), metrics={"loss": loss})
            first.join()
        late = sys.argv[3] == "late"
        second = None if late else make()
        assert first.save_async(4, state(4), metrics={"loss": 0.7})
        wait_for(ENTERED)  # the daemon writes step 4 (its retention planned after)
        second = second or make()
        assert second.save(3, state(3), metrics={"loss": 0.8})  # deletes 2
        assert second.save(2, state(2), metrics={"loss": 0.05})  # the best now
        open(GATE, "w").close()
        first.join()
        second.close()
        print("listed", first.all_steps())
"""


@pytest.mark.parametrize("second", ["before", "late"])
def test_a_step_saved_again_by_another_manager_during_the_daemons_write_is_judged_anew(
    tmp_path: Path, second: str
) -> None:
    """The daemon plans retention after its write, with what the training process knew when
    the save began: another manager of the process (made before that write, or during it)
    that deleted step 2 and saved it again (the best) during the write was unseen, and the
    daemon deleted the new step 2. The daemon reads a record again when its file changed."""
    from conftest import run_python

    script = tmp_path / "two_managers.py"  # (a file: the daemon imports the main script)
    script.write_text(OTHER_MANAGER_DURING_THE_DAEMONS_WRITE)
    result = run_python(script, str(tmp_path / "run"), str(tmp_path), second)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "listed [2, 4]" in result.stdout, result.stdout + result.stderr


class _KeepAsReturned:
    """A user's policy that keeps the two highest steps, returned as ``convert`` makes them."""

    def __init__(self, convert: object) -> None:
        self.convert = convert

    def keep(self, checkpoints: list[CheckpointInfo]) -> set[object]:
        steps = sorted(c.step for c in checkpoints)[-2:]
        return {self.convert(step) for step in steps}  # type: ignore[operator]


@pytest.mark.parametrize(
    ("convert", "kept"),
    [
        (str, [1, 2, 3, 4]),  # no step numbers: an error, and nothing is deleted
        (lambda step: step == 4, [1, 2, 3, 4]),
        (torch.tensor, [3, 4]),  # (0-d integer tensors, as from torch.topk: steps)
        (float, [3, 4]),
    ],
    ids=["str", "bool", "tensor", "float"],
)
def test_a_policy_that_keeps_what_is_no_step_number_deletes_nothing(
    ckpt_dir: Path, convert: object, kept: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    """A user's keep() returning {"3", "4"} (or 0-d tensors) was taken to keep none of the
    steps: every step but the newest was deleted, with nothing logged. What is not a step
    number fails the policy (logged; nothing deleted); integral numbers of other types are
    steps."""
    with _manager(ckpt_dir, retention=_KeepAsReturned(convert)) as manager:
        for step in (1, 2, 3, 4):
            assert manager.save(step, _state(step))
    assert _disk_steps(ckpt_dir) == kept
    failed = "must return a set of step numbers" in caplog.text
    assert failed == (kept == [1, 2, 3, 4])


def test_a_record_whose_commit_time_has_no_zone_is_taken_as_utc(ckpt_dir: Path) -> None:
    """A commit.json edited by hand (record_bytes) to a committed_at without a zone stopped
    retention for the whole root: comparing it with the others' times raised TypeError (each
    later save logged "retention ... failed; nothing deleted", and the root grew). It is
    read as UTC, as ckptmgr writes times."""
    with _manager(ckpt_dir) as manager:
        for step in (1, 2, 3):
            assert manager.save(step, _state(step))
    record_path = ckpt_dir / "step_000000000001" / "commit.json"
    document = json.loads(record_path.read_bytes().rsplit(b',\n "record_crc32"', 1)[0] + b"\n}")
    document["committed_at"] = "2026-01-01T00:00:00"
    record_path.write_bytes(record_bytes(document))
    assert CommitRecord.from_json(record_path.read_bytes()).committed_at.tzinfo is not None
    with _manager(ckpt_dir, max_to_keep=1) as manager:
        assert manager.save(4, _state(4))
        assert manager.all_steps() == [4]
    assert _disk_steps(ckpt_dir) == [4]


def test_steps_deleted_by_another_process_leave_the_listing_at_the_next_commit(
    ckpt_dir: Path,
) -> None:
    with _manager(ckpt_dir) as writer:
        writer.save(1, _state())
        writer.save(2, _state())
        with _manager(ckpt_dir, max_to_keep=1) as other:
            other.save(3, _state())  # deletes 1 and 2 behind the writer's back
        assert writer.all_steps() == [1, 2]  # not re-read until the writer's next commit
        writer.save(4, _state())
        assert writer.all_steps() == [3, 4]


def test_without_a_policy_each_commit_lists_storage_and_reads_no_record(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every step kept (the default), a commit only lists: no record is read, however many
    steps there are, and steps others committed or deleted still show at the next commit."""
    with _manager(ckpt_dir) as writer:
        writer.save(1, _state())
        writer.save(2, _state())
        with _manager(ckpt_dir) as other:
            other.save(3, _state())
        shutil.rmtree(ckpt_dir / "step_000000000001")

        def no_read(self: CheckpointStorage, step: int) -> object:
            raise AssertionError(f"the record of step {step} was read")

        monkeypatch.setattr(CheckpointStorage, "read_record", no_read)
        writer.save(4, _state())
        writer.save_async(5, _state())
        writer.join()
        assert writer.all_steps() == [2, 3, 4, 5]


def test_dry_run_deletes_nothing_and_logs_what_it_would_delete(
    ckpt_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ckptmgr")
    with _manager(ckpt_dir, max_to_keep=2, retention_dry_run=True) as manager:
        for step in range(1, 5):
            manager.save(step, _state())
        assert manager.all_steps() == [1, 2, 3, 4]
        decisions = manager.explain_retention()
    assert _disk_steps(ckpt_dir) == [1, 2, 3, 4]
    assert [(d.step, d.kept) for d in decisions] == [(1, False), (2, False), (3, True), (4, True)]
    assert isinstance(decisions[0], RetentionDecision)
    assert decisions[0].reasons == ["no policy keeps it"]
    would = [r.getMessage() for r in caplog.records if "would delete" in r.getMessage()]
    assert any("step 1" in m for m in would) and any("step 2" in m for m in would)
    assert not any("deleted step" in r.getMessage() for r in caplog.records)


def test_keep_best_keeps_the_best_and_explains_steps_without_the_metric(ckpt_dir: Path) -> None:
    with _manager(ckpt_dir, retention=KeepBest(1, "acc", mode="max")) as manager:
        manager.save(1, _state(), metrics={"acc": 0.9})
        manager.save(2, _state())
        manager.save(3, _state(), metrics={"acc": float("nan")})
        manager.save(4, _state(), metrics={"acc": 0.5})
        assert manager.all_steps() == [1, 4]
        manager.save(5, _state(), metrics={"acc": 0.7})
        assert manager.all_steps() == [1, 5]
    dry = ckpt_dir / "dry"
    with _manager(dry, retention=KeepBest(1, "acc"), retention_dry_run=True) as manager:
        manager.save(1, _state(), metrics={"acc": 0.9})
        manager.save(2, _state())
        manager.save(3, _state(), metrics={"acc": float("nan")})
        manager.save(4, _state(), metrics={"acc": 0.95})
        explained = {d.step: d for d in manager.explain_retention()}
    assert explained[1].kept and "KeepBest" in explained[1].reasons[0]
    assert not explained[2].kept and any("has no metric 'acc'" in r for r in explained[2].reasons)
    assert not explained[3].kept and any("NaN" in r for r in explained[3].reasons)
    assert explained[4].kept and explained[4].reasons == [
        "protected: the most recently committed step"
    ]


def test_nan_metrics_are_stored_and_read_back(ckpt_dir: Path) -> None:
    with _manager(ckpt_dir) as manager:
        manager.save(1, _state(), metrics={"loss": float("nan"), "gnorm": float("inf")})
    record = json.loads((ckpt_dir / "step_000000000001" / "commit.json").read_text())
    assert str(record["metrics"]["loss"]) == "nan" and record["metrics"]["gnorm"] == float("inf")


def test_numpy_numbers_are_metrics(ckpt_dir: Path) -> None:
    import numpy as np

    metrics = {"loss": np.float32(0.5), "tokens": np.int64(3), "acc": torch.tensor([0.25])}
    with _manager(ckpt_dir) as manager:
        assert manager.save(1, _state(), metrics=metrics)
    record = json.loads((ckpt_dir / "step_000000000001" / "commit.json").read_text())
    assert record["metrics"] == {"loss": 0.5, "tokens": 3.0, "acc": 0.25}


@pytest.mark.parametrize(
    ("value", "why"),
    [
        pytest.param(10**400, "int too large to convert to float", id="beyond-a-float"),
        pytest.param(torch.empty(1, device="meta"), "meta tensors", id="meta-tensor"),
        pytest.param(True, "not a number", id="bool"),
        pytest.param("0.5", "not a number", id="str"),
        pytest.param(torch.zeros(2), "not a number", id="two-elements"),
    ],
)
def test_a_metric_that_is_no_number_is_a_value_error_and_nothing_is_written(
    ckpt_dir: Path, value: object, why: str
) -> None:
    with _manager(ckpt_dir) as manager:
        with pytest.raises(ValueError, match=f"bad entry 'loss': .*{why}"):
            manager.save(1, _state(), metrics={"loss": value})
        with pytest.raises(ValueError, match="bad entry 'loss'"):
            manager.save_async(1, _state(), metrics={"loss": value})
        assert manager.all_steps() == []
    assert not list(ckpt_dir.glob("step_*"))


def test_save_policies_decide_when_save_interval_is_none(ckpt_dir: Path) -> None:
    policies = [SaveAtSteps([3, 7]), SaveFirstStep()]
    with _manager(ckpt_dir, save_interval=None, save_policy=policies) as manager:
        decided = {step: manager.should_save(step) for step in range(2, 9)}
        assert [s for s, yes in decided.items() if yes] == [2, 3, 7]
        saved = [step for step in range(2, 9) if manager.save(step, _state())]
        assert saved == [2, 3, 7]


def test_save_interval_and_save_policies_combine(ckpt_dir: Path) -> None:
    with _manager(ckpt_dir, save_interval=5, save_policy=SaveAtSteps([7])) as manager:
        assert [s for s in range(1, 12) if manager.should_save(s)] == [5, 7, 10]


def test_save_every_n_seconds_counts_from_the_last_started_save(ckpt_dir: Path) -> None:
    with _manager(ckpt_dir, save_interval=None, save_policy=SaveEveryNSeconds(3600)) as hourly:
        assert not any(hourly.should_save(step) for step in range(5))
        assert hourly.save(5, _state(), force=True)
        assert not hourly.should_save(6)
    with _manager(ckpt_dir / "often", save_interval=None, save_policy=SaveEveryNSeconds(1e-9)) as m:
        assert all(m.should_save(step) for step in range(3))


def test_a_custom_save_policy_sees_the_context(ckpt_dir: Path) -> None:
    seen: list[SaveContext] = []

    class Recorder:
        def should_save(self, context: SaveContext) -> bool:
            seen.append(context)
            return context.step == 11

    with _manager(ckpt_dir, save_interval=None, save_policy=Recorder()) as manager:
        manager.should_save(10)
        assert manager.save(11, _state())
        manager.should_save(12)
    assert [c.step for c in seen] == [10, 11, 12]
    assert {c.first_step for c in seen} == {10}
    assert [c.last_save_step for c in seen] == [None, None, 11]
    assert all(c.seconds_since_last_save >= 0 for c in seen)


def test_neither_save_interval_nor_save_policy_is_an_error(ckpt_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"save_interval.*save_policy"):
        CheckpointManager(ckpt_dir)


def test_policies_load_from_a_yaml_config(ckpt_dir: Path, tmp_path: Path) -> None:
    config_file = tmp_path / "ckpt.yaml"
    config_file.write_text(
        f"path: {ckpt_dir}\n"
        "save_interval: null\n"
        "chkpt_on_preemption: false\n"
        "save_policy:\n"
        "  - {type: save_every_n_steps, n: 2}\n"
        "retention:\n"
        "  - {type: keep_latest, n: 1}\n"
        "  - {type: keep_every_n_steps, n: 4}\n"
    )
    config = CheckpointConfig.from_file(config_file)
    assert config.retention == [KeepLatest(1), KeepEveryNSteps(4)]
    with CheckpointManager.from_config(config_file) as manager:
        saved = [step for step in range(1, 11) if manager.save(step, _state())]
        assert saved == [2, 4, 6, 8, 10]
        assert manager.all_steps() == [4, 8, 10]
    dumped = config.model_dump(mode="json")
    assert dumped["retention"][0] == {"n": 1, "type": "keep_latest"}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("retention", [{"type": "keep_newest", "n": 1}], "keep_newest"),
        ("retention", [{"type": "keep_latest", "n": 0}], "greater than 0"),
        ("retention", ["three"], "retention policy"),
        ("save_policy", [{"type": "save_every_n_seconds", "seconds": -1}], "greater than 0"),
        ("save_policy", [42], "save policy"),
    ],
)
def test_bad_policies_in_a_config_are_rejected(
    ckpt_dir: Path, field: str, value: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        CheckpointConfig.model_validate({"path": str(ckpt_dir), "save_interval": 1, field: value})
