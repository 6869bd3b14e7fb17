"""CheckpointManager under real ``torchrun`` jobs (2 ranks, gloo on 127.0.0.1, CPU only).

Three launches share one checkpoint directory, in order (module-scoped fixtures):

1. ``train``: a 2-rank job saves steps 10..50 with ``save`` and ``save_async`` (``max_to_keep=2``),
   and restores the kept steps into fresh objects;
2. ``resume``: a new 2-rank job on the same directory lists and restores the same steps, then runs
   a manager on a file system whose writes fail on rank 1 only;
3. ``single``: a plain single process (no torch.distributed) on the same directory.

Each rank of a job writes what it observed to a JSON file (see ``tests/_dist_worker.py``); every
assertion is made here. Every launch is bounded in time, and a launch that overruns is killed with
its whole process group.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _dist_worker import (
    COLLECTIVE_TIMEOUT_S,
    EARLIER_RUN_LOSS,
    KEPT_STEPS,
    MAX_TO_KEEP,
    POLICY_KEPT_AFTER,
    POLICY_SAVES,
    POLICY_STEPS,
    SAVE_PLAN,
    make_model,
)
from conftest import checked_torch_only, packed_names

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "_dist_worker.py"
NPROC = 2
LAUNCH_TIMEOUT_S = 120.0
PORT_ATTEMPTS = 3

# all_steps() expected after each save of SAVE_PLAN that is followed by a join (max_to_keep=2).
EXPECTED_STEPS_AFTER: dict[int, list[int]] = {10: [10], 20: [10, 20], 30: [20, 30], 50: [40, 50]}
REPLICATED_AND_PLAIN_KEYS = ("model", "progress", "seed")
PER_RANK_TENSOR_KEYS = ("local", "local_counts")


@dataclass
class Launch:
    """One finished run of the worker: its exit status, output and every rank's record."""

    name: str
    command: list[str]
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    records: dict[int, dict[str, Any]] = field(default_factory=dict)

    def describe(self) -> str:
        tail = (self.stdout + self.stderr)[-6000:]
        return (
            f"{self.name}: exit status {self.returncode} after {self.seconds:.1f}s\n"
            f"command: {' '.join(self.command)}\n--- output (tail) ---\n{tail}"
        )

    def checked_records(self, ranks: int) -> dict[int, dict[str, Any]]:
        """Every rank's record; fails the test if the job failed, hung or a rank crashed."""
        assert self.returncode == 0, self.describe()
        assert sorted(self.records) == list(range(ranks)), (
            f"records of ranks {sorted(self.records)}\n{self.describe()}"
        )
        crashes = [
            f"rank {r}:\n{rec['crash']}" for r, rec in self.records.items() if "crash" in rec
        ]
        assert not crashes, "\n".join(crashes) + "\n" + self.describe()
        for rank, record in self.records.items():
            assert record["rank"] == rank and record["world_size"] == ranks
        return self.records


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_bounded(
    name: str,
    command: list[str],
    out_dir: Path,
    timeout: float,
    while_running: Callable[[], None] | None = None,
) -> Launch:
    """Run ``command`` in its own process group; on timeout kill the group (torchrun's workers
    included) so that nothing outlives the test. ``while_running`` is called once it started."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO), str(WORKER.parent)]),
        PYTHONWARNINGS="ignore",
        OMP_NUM_THREADS="1",
    )
    started = time.monotonic()
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
        start_new_session=True,
    )
    try:
        if while_running is not None:
            while_running()
        stdout, stderr = process.communicate(timeout=timeout)
        returncode: int | None = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate(timeout=30)
        stderr += f"\n[test] killed after {timeout:.0f}s: the job hung"
        returncode = None
    launch = Launch(name, command, returncode, stdout, stderr, time.monotonic() - started)
    for path in sorted(out_dir.glob(f"{name}-rank*.json")):
        record = json.loads(path.read_text())
        launch.records[int(record["rank"])] = record
    return launch


def torchrun(
    name: str,
    nproc: int,
    script: Path,
    out_dir: Path,
    *args: str | Path,
    timeout: float = LAUNCH_TIMEOUT_S,
    while_running: Callable[[], None] | None = None,
) -> Launch:
    """``torchrun --nproc-per-node nproc script args...`` on a free port, bounded in time."""
    launch: Launch | None = None
    for _ in range(PORT_ATTEMPTS):  # the free port may be taken between probing and binding
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(nproc),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            "--max-restarts",
            "0",
            "--monitor-interval",
            "0.1",
            str(script),
            *map(str, args),
        ]
        launch = _run_bounded(name, command, out_dir, timeout, while_running)
        if launch.returncode == 0 or "address already in use" not in launch.stderr.lower():
            break
    assert launch is not None
    return launch


def _torchrun(
    name: str, out_dir: Path, *paths: Path, while_running: Callable[[], None] | None = None
) -> Launch:
    """``torchrun --nproc-per-node 2 _dist_worker.py name out_dir paths...``."""
    return torchrun(
        name, NPROC, WORKER, out_dir, name, out_dir, *paths, while_running=while_running
    )


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("distributed")
    paths = {"ckpt": base / "ckpt", "flaky": base / "flaky", "out": base / "out"}
    paths["out"].mkdir()
    return paths


@pytest.fixture(scope="module")
def train(dirs: dict[str, Path]) -> Launch:
    return _torchrun("train", dirs["out"], dirs["ckpt"])


@pytest.fixture(scope="module")
def resume(train: Launch, dirs: dict[str, Path]) -> Launch:
    return _torchrun("resume", dirs["out"], dirs["ckpt"], dirs["flaky"])


@pytest.fixture(scope="module")
def single(resume: Launch, dirs: dict[str, Path]) -> Launch:
    command = [sys.executable, str(WORKER), "single", str(dirs["out"]), str(dirs["ckpt"])]
    return _run_bounded("single", command, dirs["out"], LAUNCH_TIMEOUT_S)


def _step_dirs(steps: list[int]) -> list[str]:
    return [f"step_{step:012d}" for step in steps]


# -- 1. one 2-rank job: save, list, prune, restore -------------------------------------------------
def test_every_save_is_listed_identically_on_both_ranks(train: Launch) -> None:
    records = train.checked_records(NPROC)
    for rank, record in records.items():
        assert record["initial_steps"] == []
        assert [(entry["step"], entry["how"]) for entry in record["saves"]] == SAVE_PLAN
        for entry in record["saves"]:
            where = f"rank {rank}, step {entry['step']} ({entry['how']})"
            assert entry["should_save"] is True, where
            assert entry["error"] is None, where
            assert entry["returned"] is True, where
            assert entry.get("join_error") is None, where
            if "training_all_reduce" in entry:  # the training group works during a background save
                assert entry["training_all_reduce"] == [3.0] * 4, where
            if entry["step"] in EXPECTED_STEPS_AFTER:
                expected = EXPECTED_STEPS_AFTER[entry["step"]]
                assert entry["all_steps_by_rank"] == [expected] * NPROC, where
                assert entry["latest_by_rank"] == [expected[-1]] * NPROC, where
        assert record["repeat_save"] is False, f"rank {rank}: step 50 was saved twice"
        assert record["restore_deleted"]["type"] == "StepNotFoundError"
        assert record["close_error"] is None
    assert records[0]["saves"] == records[1]["saves"]


def test_storage_holds_exactly_max_to_keep_step_dirs(train: Launch, dirs: dict[str, Path]) -> None:
    records = train.checked_records(NPROC)
    for rank, record in records.items():
        for entry in record["saves"]:
            if entry["step"] in EXPECTED_STEPS_AFTER:
                assert entry["disk"] == _step_dirs(EXPECTED_STEPS_AFTER[entry["step"]]), (
                    f"rank {rank} after step {entry['step']}"
                )
    assert len(KEPT_STEPS) == MAX_TO_KEEP
    assert sorted(n for n in os.listdir(dirs["ckpt"]) if n != "owner.json") == _step_dirs(
        KEPT_STEPS
    )


def test_replicated_small_tensors_are_packed_and_per_rank_ones_are_not(
    train: Launch, dirs: dict[str, Path]
) -> None:
    """Both ranks lay out the same pack of the replicated model's tensors (all small), by sync
    and async saves; per-rank tensors stay out of it. DCP writes the pack once."""
    model_keys = sorted(f"model/{name}" for name in make_model(0).state_dict())
    records = train.checked_records(NPROC)
    for entry in records[0]["saves"]:
        if entry["how"] != "async-nojoin":
            assert entry["packed"] == model_keys, f"step {entry['step']} ({entry['how']})"
    for step in KEPT_STEPS:
        step_dir = dirs["ckpt"] / _step_dirs([step])[0]
        record = json.loads((step_dir / "commit.json").read_text())
        assert not [name for name in packed_names(record) if name.startswith("%rank")]
        data = sum(p.stat().st_size for p in step_dir.glob("*.distcp"))
        model_bytes = sum(t.numel() * t.element_size() for t in make_model(0).state_dict().values())
        per_rank_bytes = 6 * 8 * 8 + 5 * 8  # "local" (float64 6x8) and "local_counts" (int64 5)
        assert data == model_bytes + NPROC * per_rank_bytes, f"step {step}"


@pytest.mark.parametrize("job", ["train", "resume"])
def test_restore_replicated_module_and_per_rank_plain_values(
    job: str, request: pytest.FixtureRequest
) -> None:
    launch: Launch = request.getfixturevalue(job)
    records = launch.checked_records(NPROC)
    for rank, record in records.items():
        assert [r["step"] for r in record["restores"]] == KEPT_STEPS
        for restored in record["restores"]:
            where = f"{job}: rank {rank}, step {restored['step']}"
            assert restored["error"] is None, where
            for key in REPLICATED_AND_PLAIN_KEYS:
                assert restored["differences"][key] is None, f"{where}: {key}"
            assert restored["progress"]["rank"] == rank, where
            assert restored["seed"] == 1000 + rank, where


@pytest.mark.parametrize("job", ["train", "resume"])
def test_restore_per_rank_tensors_bit_exact(job: str, request: pytest.FixtureRequest) -> None:
    """Each rank saved a PerRank tensor under the same key, values of its own; each gets its own."""
    launch: Launch = request.getfixturevalue(job)
    records = launch.checked_records(NPROC)
    wrong = [
        f"rank {rank}, step {restored['step']}: {restored['differences'][key]}"
        for rank, record in records.items()
        for restored in record["restores"]
        for key in PER_RANK_TENSOR_KEYS
        if restored["differences"][key] is not None
    ]
    assert not wrong, "per-rank tensors did not round-trip:\n" + "\n".join(wrong)


# -- 2. a new 2-rank job on the same directory -----------------------------------------------------
def test_new_job_lists_the_same_steps(resume: Launch) -> None:
    records = resume.checked_records(NPROC)
    for record in records.values():
        assert record["steps_by_rank"] == [KEPT_STEPS] * NPROC


# -- 3. a plain single process on the same directory -----------------------------------------------
def test_single_process_lists_and_restores_replicated_state(single: Launch) -> None:
    record = single.checked_records(1)[0]
    assert record["distributed"] is False
    assert record["steps"] == KEPT_STEPS
    assert record["latest"] == KEPT_STEPS[-1]
    assert [r["step"] for r in record["restores"]] == KEPT_STEPS
    for restored in record["restores"]:
        assert restored["error"] is None, restored
        assert restored["differences"] == dict.fromkeys(REPLICATED_AND_PLAIN_KEYS), restored


# -- 4. a write that fails on rank 1 only ----------------------------------------------------------
def test_write_failure_on_rank_1_fails_the_save_on_both_ranks(resume: Launch) -> None:
    records = resume.checked_records(NPROC)
    for rank, record in records.items():
        fault = record["fault"]
        assert fault["initial_steps"] == []
        # save_async only stages and queues: it succeeds on both ranks.
        assert fault["async_error"] is None, f"rank {rank}"
        assert fault["async_returned"] is True, f"rank {rank}"
        # The background write failed on rank 1; join() reports it on every rank, exactly once.
        join_error = fault["join_error"]
        assert join_error is not None, f"rank {rank}: join() did not raise"
        assert join_error["is_checkpoint_error"], f"rank {rank}: {join_error}"
        assert "rank 1" in join_error["message"], join_error
        assert "injected write failure" in join_error["message"], join_error
        assert join_error["cause"] is not None, f"rank {rank}: no __cause__"
        assert fault["second_join_error"] is None, f"rank {rank}: the error was raised twice"
        assert fault["steps_after_async_failure"] == [[]] * NPROC, f"rank {rank}"
        assert fault["disk_after_async_failure"] == [], f"rank {rank}: data of a failed save"
        # A synchronous save that fails on rank 1 raises on both ranks.
        assert fault["sync_returned"] is None, f"rank {rank}: save() returned"
        assert fault["sync_error"] is not None, f"rank {rank}: save() did not raise"
        assert fault["sync_error"]["is_checkpoint_error"], fault["sync_error"]
        assert fault["steps_after_sync_failure"] == [[]] * NPROC, f"rank {rank}"


def test_saves_work_again_after_the_fault_is_gone(resume: Launch, dirs: dict[str, Path]) -> None:
    records = resume.checked_records(NPROC)
    for rank, record in records.items():
        fault = record["fault"]
        assert fault["recovered_error"] is None, f"rank {rank}"
        assert fault["recovered_returned"] is True, f"rank {rank}"
        assert fault["steps_after_recovery"] == [[3]] * NPROC, f"rank {rank}"
        (restored,) = fault["recovered_restores"]
        assert restored["error"] is None, f"rank {rank}"
        for key in REPLICATED_AND_PLAIN_KEYS:
            assert restored["differences"][key] is None, f"rank {rank}: {key}"
        assert fault["close_error"] is None, f"rank {rank}"
        assert fault["disk_final"] == _step_dirs([3]), f"rank {rank}"
    assert sorted(n for n in os.listdir(dirs["flaky"]) if n != "owner.json") == _step_dirs([3])


def test_ranks_whose_small_tensors_differ_store_them_unpacked(dirs: dict[str, Path]) -> None:
    """When one rank holds a small plain tensor the other lacks, the ranks' packs would differ:
    sync and async saves then store every tensor on its own, and each restores bit-exact. A
    restore of another step on each rank fails on both, and loads nothing (it filled each rank
    from its own step: a state of two steps)."""
    launch = _torchrun("mismatch", dirs["out"], dirs["ckpt"].parent / "mismatch")
    records = launch.checked_records(NPROC)
    for rank, record in records.items():
        assert record["packed"] == [[], [], []], f"rank {rank}"
        assert record["differences"] == [None, None, None], f"rank {rank}"
        error = record["mixed_steps_error"]
        assert error is not None and error["is_checkpoint_error"], (rank, error)
        assert "rank 0: 1, rank 1: 2" in error["message"], (rank, error)
        assert record["mixed_steps_left"], f"rank {rank}: a restore of mixed steps loaded"


def test_a_failed_wait_for_the_devices_on_one_rank_fails_restore_on_both_at_once(
    dirs: dict[str, Path],
) -> None:
    """restore's wait for the destinations' devices runs before the ranks agree to load: a
    failure there on rank 1 is raised on both ranks well within the collective timeout (30 s),
    not after rank 0 waited for rank 1 inside DCP's load; the next restore works."""
    launch = _torchrun("device_wait_fails", dirs["out"], dirs["ckpt"].parent / "device_wait")
    records = launch.checked_records(NPROC)
    for rank, record in records.items():
        failure = record["failure"]
        assert failure is not None, f"rank {rank}"
        if rank == 1:
            assert "illegal memory access" in failure["message"], failure
        else:
            assert failure["is_checkpoint_error"], failure
            assert "rank 1" in failure["message"] and "illegal memory" in failure["message"]
        assert record["seconds"] < 10, f"rank {rank}: {record['seconds']:.1f} s"
        assert record["retry_error"] is None and record["difference"] is None, f"rank {rank}"


def test_a_save_that_fails_on_one_rank_fails_on_both_and_they_stay_in_step(
    dirs: dict[str, Path],
) -> None:
    """A copy that fails on rank 1 alone fails that save_async on both ranks (rank 0 names rank
    1's error), and ``save`` called with a different step on each rank commits neither: a rank
    left out of a save would otherwise meet its peers' collectives with those of its next save,
    and a commit would hold one rank's data of one step under another step's number."""
    launch = _torchrun("diverge", dirs["out"], dirs["ckpt"].parent / "diverge")
    records = launch.checked_records(NPROC)
    for rank, record in records.items():
        where = f"rank {rank}"
        failure = record["copy_failure"]
        assert failure is not None, where
        if rank == 1:
            assert failure["type"] == "MemoryError", where
        else:
            assert failure["is_checkpoint_error"], where
            assert "step 1" in failure["message"] and "rank 1: MemoryError" in failure["message"]
        assert record["join_after_copy_failure"] is None, where
        assert record["steps_after_copy_failure"] == [], where
        assert record["retry"] == [True, None], where
        assert record["join_after_retry"] is None, where
        different = record["different_steps"]
        assert different is not None and different["is_checkpoint_error"], where
        assert "rank 0 saves step 3" in (different["message"] + str(different["cause"])), where
        assert record["steps_after_different_steps"] == [2], where
        different = record["different_calls"]  # (save on one rank, save_async on the other)
        assert different is not None and different["is_checkpoint_error"], where
        made = "rank 0 saves step 4 with save_async(), rank 1 saves step 4 with save()"
        assert made in different["message"], where
        assert record["different_calls_seconds"] < COLLECTIVE_TIMEOUT_S / 3, where
        assert record["join_after_different_calls"] is None, where
        assert record["after"] == [True, None], where
        assert record["steps"] == [2, 5], where
        assert record["differences"] == [None, None], where
        assert record["disk"] == _step_dirs([2, 5]), where


def test_a_rank_that_is_gone_fails_the_others_calls_with_a_checkpoint_error(
    dirs: dict[str, Path],
) -> None:
    """Gloo's error (the peer closed its connection) came out of save, save_async and restore
    as a bare RuntimeError, which the documented ``except CheckpointError`` does not catch
    (join() already raised a CheckpointError for it)."""
    launch = _torchrun("peer_gone", dirs["out"], dirs["ckpt"].parent / "peer_gone")
    records = launch.checked_records(NPROC)
    assert records[1]["first"] == [True, None] and records[1]["gone"]
    record = records[0]
    assert record["first"] == [True, None]
    for name in ("save", "save_async", "restore"):
        error = record[name]
        assert error is not None and error["is_checkpoint_error"], f"{name}: {error}"
        assert "with the other ranks failed" in error["message"], f"{name}: {error}"
        assert record[f"{name}_seconds"] < COLLECTIVE_TIMEOUT_S / 3, f"{name}: {record}"


def test_a_rank_gone_before_the_outcome_leaves_rank_0_listing_the_step_it_committed(
    dirs: dict[str, Path],
) -> None:
    """Rank 1 ends after reporting its part of step 2 written, before rank 0 tells it the
    outcome. Rank 0 had committed the step, yet its save raised "a broadcast with the other
    ranks failed" and did not list it: a save reported failed whose step a restarted job
    restores. Now it raises saying the step is committed, and lists it."""
    ckpt = dirs["ckpt"].parent / "gone_before_outcome"
    launch = _torchrun("gone_before_outcome", dirs["out"], ckpt)
    records = launch.checked_records(NPROC)
    assert records[1]["first"] == [True, None] and records[1]["gone"]
    record = records[0]
    assert record["first"] == [True, None]
    error = record["second"]
    assert error is not None and error["is_checkpoint_error"], error
    assert "step 2 is committed, but telling the other ranks so failed" in error["message"]
    assert record["second_seconds"] < COLLECTIVE_TIMEOUT_S / 3, record
    assert record["all_steps"] == [1, 2]
    assert (ckpt / "step_000000000002" / "commit.json").is_file()


@checked_torch_only
def test_saves_with_kept_plans_restore_through_changes_on_one_rank_and_failures(
    dirs: dict[str, Path],
) -> None:
    """DCP's plans, the DTensors' write items, the pickled ``.metadata`` and the write results
    kept between saves (ckptmgr.save_plans, ckptmgr.write_items, ckptmgr.metadata_file,
    ckptmgr.kept_results): a rank whose plan is
    unchanged sends none, a rank whose plan changed
    alone sends its own, a DTensor resharded (Shard(0) to Replicate and back) is planned anew, so
    are tensors whose dtypes changed alone (names and shapes the same: DCP compares no dtype), a
    write failing on rank 1 fails the save on both and both drop what they kept; every
    committed step restores bit for bit."""
    from _dist_worker import PLANS_SEQUENCE

    launch = _torchrun("plans", dirs["out"], dirs["ckpt"].parent / "plans")
    records = launch.checked_records(NPROC)
    committed = [step for step, _, fails in PLANS_SEQUENCE if not fails]
    # rank 0 pickles .metadata anew only from storage_meta in the second save of a structure
    # (every restore below reads it back); rank 1 writes none
    reused = [save["metadata_reused"] for save in records[0]["saves"]]
    assert reused == [0, 3, 0, 3, 0, 0, 0, 0, 0, 3, 0, 0, 3], reused
    assert {save["metadata_reused"] for save in records[1]["saves"]} == {0}
    # a rank whose write results are those it last sent sends only its checksum report
    # (ckptmgr.kept_results): rank 0's own items stay in place when rank 1's change (step 3),
    # a failed save (6) makes both send everything again (7), as a new structure does
    sent = {
        rank: [save["results_unchanged_sent"] for save in records[rank]["saves"]] for rank in (0, 1)
    }
    assert sent[0] == [0, 1, 2, 3, 3, 4, 4, 4, 4, 5, 5, 5, 6], sent
    assert sent[1] == [0, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 4], sent
    kept = [save["results_reused"] for save in records[0]["saves"]]
    assert kept == [0, 2, 1, 2, 0, 1, 0, 0, 0, 2, 0, 0, 2], kept
    for rank, record in records.items():
        where = f"rank {rank}"
        for save, (step, _, fails) in zip(record["saves"], PLANS_SEQUENCE, strict=True):
            assert save["step"] == step, where
            if fails:
                assert save["error"] is not None and save["error"]["is_checkpoint_error"], where
                assert "injected on rank 1" in json.dumps(save["error"]), where
                assert save["holds_plans"] is False, (where, step)
                assert save["holds_items"] is False, (where, step)
            else:
                assert save["error"] is None, (where, step, save["error"])
                assert save["holds_plans"] is True, (where, step)
                assert save["holds_items"] is True, (where, step)
        assert record["steps"] == committed, where
        assert [restore["step"] for restore in record["restores"]] == committed, where
        for restore in record["restores"]:
            assert restore["error"] is None, (where, restore)
            assert all(d is None for d in restore["differences"].values()), (where, restore)
        assert record["holds_plans_after_close"] is False, where
        assert record["holds_items_after_close"] is False, where


def test_dcps_save_over_the_group_keeps_the_metadata_on_rank_0_and_fails_where_it_should(
    dirs: dict[str, Path],
) -> None:
    """ckptmgr.collective_save: rank 0 alone gets the finished metadata (DCP's save broadcast
    it to every rank); a planning failure on either rank fails the save on both before
    anything is written; a write failing on rank 1 with an exception that does not pickle fails
    it on rank 1 and on rank 0 (no .metadata); a save after them all succeeds on both."""
    launch = _torchrun("collective_save", dirs["out"], dirs["ckpt"].parent / "collective_save")
    records = launch.checked_records(NPROC)
    for rank, record in records.items():
        calls = record["calls"]
        for name in ("ok", "ok_again"):
            assert calls[name]["raised"] is None, (rank, name, calls[name])
            assert calls[name]["returned"] == ("Metadata" if rank == 0 else "NoneType"), rank
            assert calls[name]["read_back"], (rank, name)
            assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(calls[name]["files"])
        for name, failing_rank in (("local_plan", 1), ("global_plan", 0)):
            call = calls[name]
            assert call["raised"] is not None, (rank, name)
            assert call["raised"].startswith("CheckpointException"), (rank, call)
            assert call["failing_ranks"] == [failing_rank], (rank, call)
            assert f"injected: rank {failing_rank}'s" in call["raised"], (rank, call)
            assert not [f for f in call["files"] if f.endswith(".distcp")], (rank, call)
            assert ".metadata" not in call["files"], (rank, call)
        write = calls["write"]
        assert write["raised"] is not None and write["failing_ranks"] == [1], (rank, write)
        assert "injected: rank 1's write" in write["raised"], (rank, write)
        assert ".metadata" not in write["files"], (rank, write)


@checked_torch_only
def test_dcps_load_over_the_group_exchanges_plans_only_where_a_global_step_needs_them(
    dirs: dict[str, Path],
) -> None:
    """ckptmgr.collective_load: with DCP's global load step the plans do not go through rank 0
    (DCP's load sent them there and back), with a planner's own they do; both read back bit
    for bit. A planning failure on rank 1 fails the load on both before either reads, in both
    ways; a read failure on rank 0 fails it on both; a load after them reads back."""
    launch = _torchrun("collective_load", dirs["out"], dirs["ckpt"].parent / "collective_load")
    records = launch.checked_records(NPROC)
    for rank, record in records.items():
        calls = record["calls"]
        for name, scattered in (("dcps_global_step", 0), ("own_global_step", 1), ("again", 0)):
            call = calls[name]
            assert call["raised"] is None, (rank, name, call)
            assert call["read_back"] and call["scattered"] == scattered, (rank, name, call)
        for name, scattered in (("local_plan", 0), ("local_plan_exchanged", 1)):
            call = calls[name]
            assert call["raised"] is not None, (rank, name)
            assert call["raised"].startswith("CheckpointException"), (rank, call)
            assert call["failing_ranks"] == [1], (rank, call)
            assert "injected: rank 1's load plan" in call["raised"], (rank, call)
            assert not call["written"] and call["scattered"] == scattered, (rank, name, call)
        read = calls["read"]
        assert read["raised"] is not None and read["failing_ranks"] == [0], (rank, read)
        assert "injected: rank 0's read" in read["raised"], (rank, read)


def test_a_restore_works_each_dtensor_layouts_chunk_out_once_and_reads_bit_exact(
    dirs: dict[str, Path],
) -> None:
    """ckptmgr.load_chunks: 14 DTensors of 4 layouts (two share a shape under other
    placements) restore bit for bit into the saved layouts and resharded (an uneven shard
    among them), with DCP's chunk worked out once per layout (4, not 14)."""
    launch = _torchrun("shared_chunks", dirs["out"], dirs["ckpt"].parent / "shared_chunks")
    records = launch.checked_records(NPROC)
    for rank, record in records.items():
        for name in ("same", "resharded"):
            assert record[name]["wrong"] == [], (rank, name, record[name])
            assert record[name]["computed"] == 4, (rank, name, record[name])


def test_a_failure_one_rank_learns_of_alone_fails_the_next_save_on_both(
    dirs: dict[str, Path],
) -> None:
    """A failure only one rank knows of before a save (its own retention delete failed; its
    state or its metrics are refused) fails that save on every rank, at the agreement before
    any write, and the save after it commits on both; so does a restore whose load_state_dict
    fails on one rank (restore and restore_latest raise on both; nothing is quarantined). The
    rank used to raise alone, before the save's collectives, and the other rank's collectives
    then met its next save."""
    launch = _torchrun("learned", dirs["out"], dirs["ckpt"].parent / "learned")
    records = launch.checked_records(NPROC)
    for rank, record in records.items():
        where = f"rank {rank}"
        assert record["saves_1_2"] == [[True, None], [True, None]], where
        returned, error = record["after_failed_delete"]
        assert returned is None and error is not None and error["is_checkpoint_error"], where
        assert "injected on rank 0: could not delete" in error["message"], where
        if rank == 1:
            assert "step 3 was not saved" in error["message"], where
        assert record["next"] == [True, None], where
        assert record["join"] is None, where
        assert record["steps_after_4"] == [4], where
        returned, error = record["reserved_name"]
        assert returned is None and error is not None and error["is_checkpoint_error"], where
        assert "reserved by ckptmgr" in error["message"], where
        if rank == 0:
            assert "step 5 was not saved" in error["message"], where
        assert record["after_reserved_name"] == [True, None], where
        returned, error = record["bad_metric"]
        assert returned is None and error is not None, where
        assert error["type"] == ("CheckpointError" if rank == 0 else "ValueError"), where
        assert "metrics must map str -> number" in error["message"], where
        assert record["after_bad_metric"] == [True, None], where
        assert record["join_8"] is None, where
        assert record["steps"] == [8], where
        assert record["save_refusing"] == [True, None], where
        for key in ("restore_refused", "restore_latest_refused"):  # raised alike on both ranks
            error = record[key]
            assert error is not None, f"{where}: {key}"
            assert error["type"] == ("CheckpointError" if rank == 0 else "ValueError"), where
            assert "injected on rank 1: load_state_dict refused" in error["message"], where
        assert record["after_refused"] == [True, None], where
        assert record["difference"] is None, where
        assert record["steps_final"] == [10], where
        assert record["disk"] == _step_dirs([10]), where


def test_opening_the_root_failing_on_one_rank_raises_on_both_at_once(
    dirs: dict[str, Path],
) -> None:
    """A rank whose part of opening the root failed (rank 0's owner lease could not be written;
    rank 1 may not create the root) raised its error before the start's collective, and the
    other rank waited in it until the collective timeout, then raised gloo's error (a raw
    ``RuntimeError`` or ``DistStoreError``). Now both take part: the failed rank raises its own
    error, the other a ``CheckpointError`` naming it, and a manager opened next saves. A
    manager made on one rank only fails with a ``CheckpointError`` too."""
    launch = _torchrun("open_fails", dirs["out"], dirs["ckpt"].parent / "open_fails")
    records = launch.checked_records(NPROC)
    failed = "opening the checkpoint root failed"
    for rank, record in records.items():
        where = f"rank {rank}"
        lease, refused = record["lease_fails"], record["root_refused"]
        assert lease is not None and refused is not None, where
        if rank == 0:
            assert lease["type"] == "OSError", where
            assert "injected write failure on rank 0" in lease["message"], where
            assert refused["is_checkpoint_error"], where
            assert refused["message"].startswith(f"rank 1: {failed}: PermissionError: "), where
            assert "injected on rank 1: may not create" in refused["message"], where
        else:
            assert lease["is_checkpoint_error"], where
            assert lease["message"].startswith(f"rank 0: {failed}: OSError: "), where
            assert "injected write failure on rank 0" in lease["message"], where
            assert refused["type"] == "PermissionError", where
            assert "injected on rank 1: may not create" in refused["message"], where
        assert record["saved"] == [True, None], where
        assert record["steps"] == [[1], [1]], where
    # A manager made on rank 0 alone fails after collective_timeout_s (2 s) with a
    # CheckpointError, not the bare DistStoreError of creating its process groups.
    alone = records[0]["alone"]
    assert alone is not None and alone["is_checkpoint_error"], alone
    assert "with the other ranks failed" in alone["message"], alone
    assert records[0]["alone_seconds"] < COLLECTIVE_TIMEOUT_S / 3, records[0]


def test_a_failure_one_rank_learns_of_late_is_raised_once_on_each_rank(
    dirs: dict[str, Path],
) -> None:
    """Rank 0's part of an async save failed, but rank 1 reported the failure first, at the next
    save's agreement, which raised it on both ranks. Rank 0's writer posted it afterwards, and
    rank 0's ``join`` raised it a second time, on rank 0 alone (the ranks then took different
    paths). A failure a save's agreement raised on every rank is not raised again."""
    launch = _torchrun("late_failure", dirs["out"], dirs["ckpt"].parent / "late_failure")
    records = launch.checked_records(NPROC)
    for rank, record in records.items():
        where = f"rank {rank}"
        assert record["async_1"] == [True, None], where
        assert record["posted"] is True, where
        error = record["save_2"]
        assert error is not None and error["is_checkpoint_error"], where
        assert "save of step 1 failed" in error["message"], where
        assert "injected write failure on rank 0" in error["message"], where
        assert record["join"] is None, where
        assert record["save_3"] == [True, None], where
        assert record["steps"] == [[3], [3]], where
        assert record["close"] is None, where


def test_a_save_policy_raising_on_one_rank_raises_on_both_and_they_stay_in_step(
    dirs: dict[str, Path],
) -> None:
    """A save policy that raises on rank 1 alone fails that step's decision on both ranks, at
    once: rank 1 raised alone before, while rank 0 waited in the agreement's all_reduce, which
    then met rank 1's decision of the next step."""
    launch = _torchrun("raising_policy", dirs["out"], dirs["ckpt"].parent / "raising_policy")
    records = launch.checked_records(NPROC)
    for rank, record in records.items():
        where = f"rank {rank}"
        first, failed, third = record["steps"]
        assert first["should_save"] is True and first["saved"] == [True, None], where
        assert failed["should_save"] is None, where
        error = failed["error"]
        assert error is not None, where
        if rank == 1:
            assert error["type"] == "RuntimeError", where
            assert "injected on rank 1" in error["message"], where
        else:
            assert error["is_checkpoint_error"], where
            assert "a save policy raised on another rank" in error["message"], where
        assert failed["seconds"] < COLLECTIVE_TIMEOUT_S / 3, f"{where}: {failed['seconds']} s"
        assert third["should_save"] is True and third["saved"] == [True, None], where
        assert record["all_steps"] == [1, 3], where
        assert record["disk"] == _step_dirs([1, 3]), where


# -- 4. save and retention policies across ranks and runs ------------------------------------------
@pytest.fixture(scope="module")
def policies(dirs: dict[str, Path]) -> Launch:
    import torch

    from ckptmgr import CheckpointManager

    directory = dirs["ckpt"].parent / "policies"
    with CheckpointManager(directory, save_interval=1, chkpt_on_preemption=False) as earlier_run:
        for step, loss in EARLIER_RUN_LOSS.items():
            earlier_run.save(step, {"w": torch.ones(2)}, metrics={"loss": loss})
    return _torchrun("policies", dirs["out"], directory)


def test_rank0_save_policy_and_storage_based_retention_agree_on_every_rank(
    policies: Launch,
) -> None:
    records = policies.checked_records(NPROC)
    for rank, record in records.items():
        assert record["initial_steps"] == sorted(EARLIER_RUN_LOSS), f"rank {rank}"
        assert [entry["step"] for entry in record["steps"]] == list(POLICY_STEPS)
        saved = [entry["step"] for entry in record["steps"] if entry["saved"]]
        assert saved == POLICY_SAVES, f"rank {rank} saved {saved}: rank 0's policy must decide"
        for entry in record["steps"]:
            where = f"rank {rank}, step {entry['step']}"
            assert entry["should_save"] is (entry["step"] in POLICY_SAVES), where
            assert entry["error"] is None and entry["join_error"] is None, where
            expected = POLICY_KEPT_AFTER.get(entry["step"])
            if expected is not None:
                assert entry["all_steps_by_rank"] == [expected] * NPROC, where
                assert entry["disk"] == _step_dirs(expected), where
        explained = {step: (kept, reasons) for step, kept, reasons in record["explained"]}
        assert sorted(explained) == [3, 8]
        assert explained[3][0] and any("KeepBest" in r for r in explained[3][1])
        assert explained[8][0] and any("KeepLatest" in r for r in explained[8][1])
        assert record["close_error"] is None
    assert records[0]["steps"] == records[1]["steps"]


# -- 5. preemption noticed by one rank only --------------------------------------------------------
def _sigterm_rank1_once_it_trains(out_dir: Path) -> Callable[[], None]:
    def send() -> None:
        pid_file = out_dir / "rank1.pid"
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S / 2
        while not pid_file.exists():  # bounded poll of a file the worker writes atomically
            assert time.monotonic() < deadline, "rank 1 never reported its pid"
            time.sleep(0.02)
        os.kill(int(pid_file.read_text()), signal.SIGTERM)

    return send


@pytest.mark.parametrize("agree_every", [1, 4])
def test_sigterm_to_one_rank_saves_one_agreed_step_on_all_ranks(
    dirs: dict[str, Path], agree_every: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTMGR_TEST_AGREE_EVERY", str(agree_every))
    out_dir = dirs["out"].parent / f"preempt-out-{agree_every}"
    out_dir.mkdir()
    ckpt = dirs["ckpt"].parent / f"preempt-{agree_every}"
    launch = _torchrun(
        "preempt", out_dir, ckpt, while_running=_sigterm_rank1_once_it_trains(out_dir)
    )
    records = launch.checked_records(NPROC)
    reached = {rank: record["reached_step"] for rank, record in records.items()}
    assert reached[0] is not None and reached[0] == reached[1], reached
    for rank, record in records.items():
        assert record["saved_steps"] == [reached[0]], f"rank {rank}: {record['saved_steps']}"
        assert record["last_step"] == reached[0]
        assert record["all_steps"] == [reached[0]]
        assert record["close_error"] is None
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == _step_dirs(
        [reached[0]]
    )
