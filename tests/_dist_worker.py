"""Worker of tests/test_distributed.py: one rank of a real ``torchrun`` job (gloo, CPU).

Run as ``torchrun --nproc-per-node 2 tests/_dist_worker.py <scenario> <out_dir> <ckpt_dir> ...``
with the repository root on ``PYTHONPATH``. Scenarios:

* ``train <ckpt_dir>``: save steps with ``save`` and ``save_async`` + ``join`` (``max_to_keep=2``),
  gathering every rank's ``all_steps()`` over the training group after each one, then restore the
  kept steps into fresh objects.
* ``resume <ckpt_dir> <flaky_dir>``: a new job on ``ckpt_dir`` lists and restores the same steps;
  then a manager on a file system (``FlakyLocalFileSystem``) whose writes fail on rank 1 only.
* ``policies <ckpt_dir>``: save and retention policies on a directory that already holds steps
  of an earlier run: a save policy that answers differently on each rank (rank 0's answer must
  win everywhere), ``KeepBest`` over metrics from the earlier run's records, ``max_to_keep``.
* ``preempt <ckpt_dir>``: a training loop (one training all_reduce per step) in which rank 1
  alone gets a real SIGTERM from the test, after it wrote ``<out_dir>/rank1.pid``; both ranks
  must save the same step, once, and stop there.
* ``diverge <ckpt_dir>``: saves that go wrong on one rank only (a failed copy on rank 1; a
  different step on each rank) must fail on both and commit nothing.
* ``plans <ckpt_dir>``: saves with DCP's plans and the DTensors' write items kept between them,
  of DTensors, per-rank and replicated tensors, through structure changes on one rank and on
  both, a DTensor resharded and back, and a write failing on rank 1 alone; every committed step
  restored.
* ``collective_save <ckpt_dir>``: DCP's save over the group as ckptmgr runs it, called
  directly: the metadata on rank 0 only, and failures injected in planning and writing on one
  rank fail the save where they should, with the ranks' collectives still paired.
* ``collective_load <ckpt_dir>``: DCP's load over the group as ckptmgr runs it, called
  directly: no exchange of plans where DCP's global step changes nothing, the exchange where a
  planner has its own, and failures injected in planning and reading on one rank.
* ``shared_chunks <ckpt_dir>``: restores planned with each DTensor layout's chunk worked out
  once, into the saved layouts and resharded.
* ``learned <ckpt_dir>``: failures one rank learns of alone (retention's delete on rank 0; a
  reserved name in rank 1's state) fail the next save on both ranks, and the ranks stay in step.
* ``late_failure <ckpt_dir>``: a failed async save that rank 0 learns of only after rank 1
  reported it at the next save's agreement is raised once on each rank, not again by rank 0's
  ``join``.
* ``open_fails <ckpt_dir>``: opening the root fails on one rank only (rank 0's owner lease, rank
  1's root creation): both ranks raise at once, and a manager opened next saves on both.
* ``single <ckpt_dir>``: run with plain ``python`` (no torchrun, no torch.distributed): a
  single-process manager lists the steps the 2-rank jobs wrote and restores the replicated state.

Each rank records what it observed and writes it to ``<out_dir>/<scenario>-rank<R>.json`` at the
end; the test makes every assertion. The test also imports this module for :func:`make_state`,
:func:`blank_state` and :func:`first_difference`, so that both sides agree on the expected values.

Every wait is bounded: the process group and the managers use short collective timeouts, and
``faulthandler`` ends (and dumps the stacks of) a rank that is still running after
``WATCHDOG_S`` seconds.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem
from torch import nn

from ckptmgr import CommitRecord, PerRank

COLLECTIVE_TIMEOUT_S = 30.0
WATCHDOG_S = 90.0
MAX_TO_KEEP = 2
# (step, how it is saved): "sync" = save, "async" = save_async + join, "async-nojoin" =
# save_async followed directly by the next save_async (which waits for a free slot).
SAVE_PLAN: list[tuple[int, str]] = [
    (10, "sync"),
    (20, "async"),
    (30, "sync"),
    (40, "async-nojoin"),
    (50, "async"),
]
KEPT_STEPS: list[int] = [40, 50]
FLAKY_PROTOCOL = "ckptmgr-dist-flaky"


# -- the state every rank saves --------------------------------------------------------------------
def make_model(step: int) -> nn.Module:
    """The replicated model at ``step``: the same on every rank (same seed, same updates)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            param.add_(step * 0.125 + index)
        batch_norm = model[1]
        assert isinstance(batch_norm, nn.BatchNorm1d)
        batch_norm.running_mean.fill_(step * 0.5)  # type: ignore[union-attr]
        batch_norm.num_batches_tracked.fill_(step)  # type: ignore[union-attr]
    return model


def make_state(step: int, rank: int) -> dict[str, Any]:
    """What rank ``rank`` saves at ``step``: a replicated model plus per-rank tensor and values."""
    return {
        "model": make_model(step),
        # Same key on every rank, values that depend on the rank: marked PerRank.
        "local": PerRank(
            torch.arange(48, dtype=torch.float64).reshape(6, 8) * (rank + 1) + step * 1000
        ),
        "local_counts": PerRank(torch.full((5,), rank * 100 + step, dtype=torch.int64)),
        "progress": {"rank": rank, "tag": f"rank{rank}-step{step}", "history": [rank, step, 0.5]},
        "seed": 1000 + rank,
    }


def blank_state() -> dict[str, Any]:
    """A fresh state with the structure of :func:`make_state` and values that no step has."""
    model = make_model(-1)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.fill_(-7)
    return {
        "model": model,
        "local": PerRank(torch.full((6, 8), -1.0, dtype=torch.float64)),
        "local_counts": PerRank(torch.full((5,), -1, dtype=torch.int64)),
        "progress": None,
        "seed": -1,
    }


def comparable(value: Any) -> Any:
    """``value`` with modules replaced by their state dicts, for :func:`first_difference`."""
    if isinstance(value, PerRank):
        return comparable(value.value)
    if isinstance(value, nn.Module):
        return {k: v.detach().clone() for k, v in value.state_dict().items()}
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items()}
    return value


def first_difference(actual: Any, expected: Any, path: str = "") -> str | None:
    """None if ``actual`` equals ``expected`` bit for bit (types included), else where not."""
    actual, expected = comparable(actual), comparable(expected)
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return f"{path}: {type(actual).__name__} is not a tensor"
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            got_kind = f"{actual.dtype}{list(actual.shape)}"
            return f"{path}: {got_kind} != {expected.dtype}{list(expected.shape)}"
        got = actual.detach().reshape(-1).contiguous().view(torch.uint8)
        want = expected.detach().reshape(-1).contiguous().view(torch.uint8)
        if not torch.equal(got, want):
            head = f"{actual.flatten()[:6].tolist()} != {expected.flatten()[:6].tolist()}"
            return f"{path}: tensor values differ (first values {head})"
        return None
    if type(actual) is not type(expected):
        return f"{path}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, dict):
        if list(actual) != list(expected):
            return f"{path}: keys {list(actual)} != {list(expected)}"
        for key, value in expected.items():
            found = first_difference(actual[key], value, f"{path}/{key}")
            if found is not None:
                return found
        return None
    if isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            return f"{path}: length {len(actual)} != {len(expected)}"
        for index, (got, want) in enumerate(zip(actual, expected, strict=True)):
            found = first_difference(got, want, f"{path}[{index}]")
            if found is not None:
                return found
        return None
    return None if actual == expected else f"{path}: {actual!r} != {expected!r}"


# -- a file system whose writes fail on chosen ranks -----------------------------------------------
class FlakyLocalFileSystem(AbstractFileSystem):
    """The local disk behind a non-local protocol; opening a file for writing raises OSError on
    the ranks in ``failing_ranks``. Not a LocalFileSystem, so ckptmgr and DCP go through fsspec."""

    protocol = FLAKY_PROTOCOL
    root_marker = "/"
    failing_ranks: ClassVar[frozenset[int]] = frozenset()

    def __init__(self, **storage_options: Any) -> None:
        super().__init__(**storage_options)
        self.local = LocalFileSystem()

    def _p(self, path: Any) -> str:
        return self._strip_protocol(path)

    def _open(self, path: Any, mode: str = "rb", **kwargs: Any) -> Any:
        rank = int(os.environ.get("RANK", "0"))
        if any(flag in mode for flag in "wax+") and rank in type(self).failing_ranks:
            raise OSError(f"injected write failure on rank {rank}: {path}")
        return self.local._open(self._p(path), mode=mode, **kwargs)

    def ls(self, path: Any, detail: bool = True, **kwargs: Any) -> Any:
        return self.local.ls(self._p(path), detail=detail)

    def info(self, path: Any, **kwargs: Any) -> dict[str, Any]:
        return self.local.info(self._p(path))

    def makedirs(self, path: Any, exist_ok: bool = False) -> None:
        self.local.makedirs(self._p(path), exist_ok=exist_ok)

    def mkdir(self, path: Any, create_parents: bool = True, **kwargs: Any) -> None:
        self.local.mkdir(self._p(path), create_parents=create_parents)

    def rm_file(self, path: Any) -> None:
        self.local.rm_file(self._p(path))

    def rmdir(self, path: Any) -> None:
        self.local.rmdir(self._p(path))

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        self.local.rm(self._p(path), recursive=recursive, maxdepth=maxdepth)

    def mv(self, path1: Any, path2: Any, **kwargs: Any) -> None:
        self.local.mv(self._p(path1), self._p(path2))

    def cp_file(self, path1: Any, path2: Any, **kwargs: Any) -> None:
        self.local.cp_file(self._p(path1), self._p(path2))

    def modified(self, path: Any) -> datetime.datetime:
        return self.local.modified(self._p(path))


# -- running the scenarios -------------------------------------------------------------------------
def _error_record(exc: BaseException | None) -> dict[str, Any] | None:
    if exc is None:
        return None
    cause = exc.__cause__
    return {
        "type": type(exc).__name__,
        "is_checkpoint_error": _is_checkpoint_error(exc),
        "message": str(exc)[:2000],
        "cause": None if cause is None else f"{type(cause).__name__}: {str(cause)[:2000]}",
    }


def _is_checkpoint_error(exc: BaseException) -> bool:
    from ckptmgr import CheckpointError

    return isinstance(exc, CheckpointError)


def _call(action: Callable[[], Any]) -> tuple[Any, dict[str, Any] | None]:
    """(result, None) or (None, a description of the exception ``action`` raised)."""
    try:
        return action(), None
    except Exception as exc:
        return None, _error_record(exc)


def _gather(value: Any) -> list[Any]:
    """Every rank's ``value`` over the default (training) group."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _disk_steps(directory: str) -> list[str]:
    return (
        sorted(n for n in os.listdir(directory) if n != "owner.json")
        if os.path.isdir(directory)
        else []
    )


def _packed_names(directory: str, step: int) -> list[str]:
    """The names in the pack of small tensors of ``step``, from its commit record."""
    record = Path(directory) / f"step_{step:012d}" / "commit.json"
    return sorted(CommitRecord.from_json(record.read_bytes()).packed)


def _restore_checks(manager: Any, steps: list[int], rank: int) -> list[dict[str, Any]]:
    """Restore each of ``steps`` into a fresh state; where each top-level key differs, if at all."""
    results = []
    for step in steps:
        fresh = blank_state()
        _, error = _call(lambda fresh=fresh, step=step: manager.restore(step, fresh))
        expected = make_state(step, rank)
        results.append(
            {
                "step": step,
                "error": error,
                "differences": {
                    key: first_difference(fresh[key], value, key) for key, value in expected.items()
                },
                "progress": fresh["progress"],
                "seed": fresh["seed"],
            }
        )
    return results


def scenario_train(rank: int, ckpt_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    from ckptmgr import CheckpointManager

    manager = CheckpointManager(
        ckpt_dir,
        save_interval=10,
        max_to_keep=MAX_TO_KEEP,
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
    )
    record: dict[str, Any] = {"initial_steps": manager.all_steps(), "saves": []}
    state = make_state(0, rank)
    for step, how in SAVE_PLAN:
        fresh = make_state(step, rank)
        state["model"].load_state_dict(fresh["model"].state_dict())
        state["local"].value.copy_(fresh["local"].value)
        state["local_counts"].value.copy_(fresh["local_counts"].value)
        state["progress"], state["seed"] = fresh["progress"], fresh["seed"]
        entry: dict[str, Any] = {"step": step, "how": how, "should_save": manager.should_save(step)}
        if how == "sync":
            entry["returned"], entry["error"] = _call(lambda step=step: manager.save(step, state))
        else:
            entry["returned"], entry["error"] = _call(
                lambda step=step: manager.save_async(step, state)
            )
            # Training goes on while the write runs: mutate the state and use the training group.
            state["local"].value.add_(0.5)
            state["local_counts"].value.add_(1)
            grad = torch.full((4,), float(rank + 1))
            dist.all_reduce(grad)
            entry["training_all_reduce"] = grad.tolist()
            if how == "async":
                _, entry["join_error"] = _call(manager.join)
        if how != "async-nojoin":
            entry["all_steps_by_rank"] = _gather(manager.all_steps())
            entry["latest_by_rank"] = _gather(manager.latest_step())
            # Rank 0 deletes in its own background job: look at the disk once every rank is here.
            dist.barrier()
            entry["disk"] = _disk_steps(ckpt_dir)
            entry["packed"] = _packed_names(ckpt_dir, step)
        record["saves"].append(entry)
    record["repeat_save"] = _call(lambda: manager.save(50, state))[0]
    record["restores"] = _restore_checks(manager, KEPT_STEPS, rank)
    record["restore_deleted"] = _call(lambda: manager.restore(10, blank_state()))[1]
    record["close_error"] = _call(manager.close)[1]
    return record


def scenario_resume(rank: int, ckpt_dir: str, flaky_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    from ckptmgr import CheckpointManager

    record: dict[str, Any] = {}
    with CheckpointManager(
        ckpt_dir,
        save_interval=10,
        max_to_keep=MAX_TO_KEEP,
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
    ) as manager:
        record["steps_by_rank"] = _gather(manager.all_steps())
        record["restores"] = _restore_checks(manager, KEPT_STEPS, rank)

    # A failure on rank 1 only, in the middle of the background write.
    fsspec.register_implementation(FLAKY_PROTOCOL, FlakyLocalFileSystem, clobber=True)
    FlakyLocalFileSystem.failing_ranks = frozenset({1})
    url = f"{FLAKY_PROTOCOL}://{flaky_dir}"
    manager = CheckpointManager(
        url, save_interval=1, max_to_keep=MAX_TO_KEEP, collective_timeout_s=COLLECTIVE_TIMEOUT_S
    )
    state = make_state(1, rank)
    fault: dict[str, Any] = {"initial_steps": manager.all_steps()}
    fault["async_returned"], fault["async_error"] = _call(lambda: manager.save_async(1, state))
    _, fault["join_error"] = _call(manager.join)
    _, fault["second_join_error"] = _call(manager.join)
    fault["steps_after_async_failure"] = _gather(manager.all_steps())
    dist.barrier()
    fault["disk_after_async_failure"] = _disk_steps(flaky_dir)
    fault["sync_returned"], fault["sync_error"] = _call(lambda: manager.save(2, state))
    fault["steps_after_sync_failure"] = _gather(manager.all_steps())

    # The fault is gone: the same manager (same groups) must still save and agree.
    FlakyLocalFileSystem.failing_ranks = frozenset()
    fault["recovered_returned"], fault["recovered_error"] = _call(
        lambda: manager.save(3, make_state(3, rank))
    )
    fault["steps_after_recovery"] = _gather(manager.all_steps())
    fault["recovered_restores"] = _restore_checks(manager, [3], rank)
    fault["close_error"] = _call(manager.close)[1]
    dist.barrier()
    fault["disk_final"] = _disk_steps(flaky_dir)
    record["fault"] = fault
    return record


# Steps the earlier (single-process) run wrote before the ``policies`` job, with their loss.
EARLIER_RUN_LOSS: dict[int, float] = {2: 0.5, 3: 0.1}
POLICY_STEPS = range(4, 10)
POLICY_SAVES = [4, 6, 8]  # rank 0's policy: even steps
# all_steps() after each save: the best loss (step 3, from the earlier run) and the newest.
POLICY_KEPT_AFTER: dict[int, list[int]] = {4: [3, 4], 6: [3, 6], 8: [3, 8]}


class RankDependentPolicy:
    """A save policy whose answer differs between ranks (as a clock-based one may)."""

    def should_save(self, context: Any) -> bool:
        import torch.distributed as dist

        if dist.get_rank() == 0:
            return context.step % 2 == 0
        return context.step % 3 == 0


def scenario_policies(rank: int, ckpt_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    from ckptmgr import CheckpointManager, KeepBest

    manager = CheckpointManager(
        ckpt_dir,
        save_interval=None,
        max_to_keep=1,
        retention=KeepBest(1, "loss"),
        save_policy=RankDependentPolicy(),
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
    )
    record: dict[str, Any] = {"initial_steps": manager.all_steps(), "steps": []}
    state = make_state(0, rank)
    for step in POLICY_STEPS:
        entry: dict[str, Any] = {"step": step, "should_save": manager.should_save(step)}
        entry["saved"], entry["error"] = _call(
            lambda step=step: manager.save_async(step, state, metrics={"loss": 1.0 + step})
        )
        _, entry["join_error"] = _call(manager.join)
        entry["all_steps_by_rank"] = _gather(manager.all_steps())
        dist.barrier()
        entry["disk"] = _disk_steps(ckpt_dir)
        record["steps"].append(entry)
    record["explained"] = [[d.step, d.kept, d.reasons] for d in manager.explain_retention()]
    record["close_error"] = _call(manager.close)[1]
    return record


class RaisingOnRank1AtStep2:
    """A save policy that wants every step, but raises on rank 1 when asked about step 2."""

    def should_save(self, context: Any) -> bool:
        import torch.distributed as dist

        if context.step == 2 and dist.get_rank() == 1:
            raise RuntimeError("injected on rank 1: the save policy failed at step 2")
        return True


def _manager_after_a_save(ckpt_dir: str) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """A manager that saved step 1 (on every rank), its state, and a record of that save."""
    import torch

    from ckptmgr import CheckpointManager

    manager = CheckpointManager(
        ckpt_dir, 1, collective_timeout_s=COLLECTIVE_TIMEOUT_S, chkpt_on_preemption=False
    )
    state = {"w": torch.arange(10.0)}
    return manager, state, {"first": _call(lambda: manager.save(1, state))}


def _gone(out_dir: str, scenario: str, rank: int, record: dict[str, Any]) -> None:
    """Write this rank's record, then end the process: no close, no goodbye, as a rank whose
    machine went away."""
    record.update(gone=True, rank=rank, world_size=2)  # (what main() puts in a record)
    _write_record(out_dir, scenario, rank, record)
    os._exit(0)


def scenario_peer_gone(rank: int, ckpt_dir: str, out_dir: str) -> dict[str, Any]:
    """Rank 1 saves step 1 with rank 0, then its process ends (its record written first);
    rank 0 then calls should_save, save, save_async and restore: each must fail with a
    CheckpointError (gloo's error its cause), at once, not with gloo's bare RuntimeError."""
    import torch

    manager, state, record = _manager_after_a_save(ckpt_dir)
    if rank == 1:
        _gone(out_dir, "peer_gone", rank, record)
    for name, action in [
        ("save", lambda: manager.save(2, state)),
        ("save_async", lambda: manager.save_async(3, state)),
        ("restore", lambda: manager.restore(1, {"w": torch.zeros(10)})),
    ]:
        started = time.monotonic()
        record[name] = _call(action)[1]
        record[f"{name}_seconds"] = time.monotonic() - started
    record["close"] = _call(manager.close)[1]
    return record


def scenario_gone_before_outcome(rank: int, ckpt_dir: str, out_dir: str) -> dict[str, Any]:
    """Rank 1 reports its part of step 2 written, then its process ends before rank 0 tells it
    the outcome (rank 0 has committed the step): rank 0's save raises, saying the step is
    committed, and lists it (it reported a failed save, with the step committed in storage)."""
    import torch

    from ckptmgr import collectives
    from ckptmgr import manager as manager_module

    manager, _, record = _manager_after_a_save(ckpt_dir)
    if rank == 1:
        broadcast = collectives.Collectives.broadcast

        def gone_before_the_outcome(self: Any, value: Any, group: Any) -> Any:
            if isinstance(value, manager_module._SaveOutcome):
                _gone(out_dir, "gone_before_outcome", rank, record)
            return broadcast(self, value, group)

        collectives.Collectives.broadcast = gone_before_the_outcome  # type: ignore[method-assign]
    started = time.monotonic()
    record["second"] = _call(lambda: manager.save(2, {"w": torch.arange(10.0) + 2}))[1]
    record["second_seconds"] = time.monotonic() - started
    record["all_steps"] = manager.all_steps()
    record["close"] = _call(manager.close)[1]
    return record


def scenario_raising_policy(rank: int, ckpt_dir: str) -> dict[str, Any]:
    """A save policy that raises on rank 1 alone: the decision of that step must raise on both
    ranks at once (not leave rank 0 in the agreement's collective), and the ranks stay in step."""
    from ckptmgr import CheckpointManager

    record: dict[str, Any] = {"steps": []}
    with CheckpointManager(
        ckpt_dir,
        save_interval=None,
        save_policy=RaisingOnRank1AtStep2(),
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
        chkpt_on_preemption=False,
    ) as manager:
        for step in (1, 2, 3):
            started = time.monotonic()
            wanted, error = _call(lambda step=step: manager.should_save(step))
            entry = {"step": step, "should_save": wanted, "error": error}
            entry["seconds"] = time.monotonic() - started
            if wanted:
                entry["saved"] = _call(lambda step=step: manager.save(step, make_state(step, rank)))
            record["steps"].append(entry)
        record["all_steps"] = manager.all_steps()
    record["disk"] = _disk_steps(ckpt_dir)
    return record


PREEMPT_PID_AT_STEP = 3
PREEMPT_DEADLINE_S = 60.0


def scenario_preempt(rank: int, ckpt_dir: str, out_dir: str) -> dict[str, Any]:
    import time

    import torch.distributed as dist

    from ckptmgr import CheckpointManager, PreemptionConfig

    agree_every = int(os.environ.get("CKPTMGR_TEST_AGREE_EVERY", "1"))
    manager = CheckpointManager(
        ckpt_dir,
        save_interval=10**9,
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
        preemption=PreemptionConfig(agree_every_n_steps=agree_every),
    )
    state = make_state(0, rank)
    record: dict[str, Any] = {"saved_steps": [], "reached_step": None}
    deadline = time.monotonic() + PREEMPT_DEADLINE_S
    step = 0
    while time.monotonic() < deadline:
        step += 1
        grad = torch.ones(1)
        dist.all_reduce(grad)  # the training loop's own collective
        if rank == 1 and step == PREEMPT_PID_AT_STEP:
            pid_file = Path(out_dir) / "rank1.pid"
            pid_file.with_suffix(".tmp").write_text(str(os.getpid()))
            pid_file.with_suffix(".tmp").rename(pid_file)
        if manager.save_async(step, state):
            record["saved_steps"].append(step)
        if manager.reached_preemption(step):
            record["reached_step"] = step
            break
    record["last_step"] = step
    record["all_steps"] = manager.all_steps()
    record["close_error"] = _call(manager.close)[1]
    return record


def scenario_mismatch(rank: int, ckpt_dir: str) -> dict[str, Any]:
    """Rank 1 holds one more small plain tensor than rank 0: the ranks' packs would differ, so
    nothing is packed, and every save still restores bit-exact on both ranks. Then a restore of
    another step on each rank."""
    import torch

    from ckptmgr import CheckpointManager

    def state_at(step: int) -> dict[str, Any]:
        state = {"w": torch.arange(10.0) + step, "b": torch.full((3,), float(step))}
        if rank == 1:
            state["extra"] = torch.full((4,), 7.0 + step)
        return state

    record: dict[str, Any] = {"packed": [], "differences": []}
    with CheckpointManager(
        ckpt_dir, 1, collective_timeout_s=COLLECTIVE_TIMEOUT_S, chkpt_on_preemption=False
    ) as manager:
        assert manager.save_async(1, state_at(1))
        manager.join()
        assert manager.save(2, state_at(2))
        assert manager.save_async(3, state_at(3))
        manager.join()
        for step in (1, 2, 3):
            record["packed"].append(_packed_names(ckpt_dir, step))
            fresh = {key: torch.zeros_like(value) for key, value in state_at(step).items()}
            manager.restore(step, fresh)
            record["differences"].append(first_difference(fresh, state_at(step)))
        # Misuse: a restore of another step on each rank (1 on rank 0, 2 on rank 1) fails on
        # both before anything is loaded (it filled each rank from its own step).
        fresh = {key: torch.zeros_like(value) for key, value in state_at(1).items()}
        _, record["mixed_steps_error"] = _call(lambda: manager.restore(1 + rank, fresh))
        record["mixed_steps_left"] = all(not value.any() for value in fresh.values())
    return record


def scenario_device_wait_fails(rank: int, ckpt_dir: str) -> dict[str, Any]:
    """Rank 1's wait for the destinations' devices fails (fault injection: the CUDA call it
    makes raises, as after a sticky CUDA error): restore fails on both ranks at once, rank 0
    naming rank 1's error, instead of rank 0 waiting in DCP's load until the collective timeout;
    then both restore."""
    import time

    import torch

    import ckptmgr.step_restore as step_restore
    from ckptmgr import CheckpointManager

    state = {f"w/{i}": torch.full((64,), float(i)) for i in range(10)}
    state["big"] = torch.arange(100_000.0)
    record: dict[str, Any] = {}
    with CheckpointManager(
        ckpt_dir, 1, collective_timeout_s=COLLECTIVE_TIMEOUT_S, chkpt_on_preemption=False
    ) as manager:
        assert manager.save(1, state)
        real_wait = step_restore.wait_for_devices
        if rank == 1:

            def failing_wait(tensors: Any) -> None:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

            step_restore.wait_for_devices = failing_wait
        started = time.monotonic()
        _, record["failure"] = _call(
            lambda: manager.restore(1, {k: torch.zeros_like(v) for k, v in state.items()})
        )
        record["seconds"] = time.monotonic() - started
        step_restore.wait_for_devices = real_wait
        fresh = {k: torch.zeros_like(v) for k, v in state.items()}
        _, record["retry_error"] = _call(lambda: manager.restore(1, fresh))
        record["difference"] = first_difference(fresh, state)
    return record


def scenario_diverge(rank: int, ckpt_dir: str) -> dict[str, Any]:
    """Saves that go wrong on one rank only: rank 1's copy of step 1 fails (``save_async``), then
    the ranks call ``save`` with different steps (3 on rank 0, 4 on rank 1). Each must fail on
    both ranks and commit nothing; the saves in between and after (2, 5) must commit and restore."""
    import torch

    from ckptmgr import CheckpointManager
    from ckptmgr.staging import StagingBuffers

    def state_at(step: int) -> dict[str, Any]:  # packed small tensors and a per-rank value
        return {
            "w": torch.arange(10.0) + step,
            "b": torch.full((3,), float(step)),
            "r": PerRank(torch.full((5,), float(100 * rank + step))),
        }

    original_stage = StagingBuffers.stage
    copies: list[int] = []

    def stage_failing_once_on_rank_1(self: StagingBuffers, *args: Any, **kwargs: Any) -> Any:
        copies.append(1)
        if rank == 1 and len(copies) == 1:
            raise MemoryError("injected on rank 1: no memory for the copy")
        return original_stage(self, *args, **kwargs)

    StagingBuffers.stage = stage_failing_once_on_rank_1  # type: ignore[method-assign]
    record: dict[str, Any] = {}
    with CheckpointManager(
        ckpt_dir, 1, collective_timeout_s=COLLECTIVE_TIMEOUT_S, chkpt_on_preemption=False
    ) as manager:
        record["copy_failure"] = _call(lambda: manager.save_async(1, state_at(1)))[1]
        record["join_after_copy_failure"] = _call(manager.join)[1]
        record["steps_after_copy_failure"] = manager.all_steps()
        record["retry"] = _call(lambda: manager.save_async(2, state_at(2)))
        record["join_after_retry"] = _call(manager.join)[1]
        different = 3 if rank == 0 else 4
        record["different_steps"] = _call(lambda: manager.save(different, state_at(different)))[1]
        record["steps_after_different_steps"] = manager.all_steps()
        started = time.monotonic()  # save on one rank, save_async on the other: their writes
        if rank == 0:  # issue different collectives (they met in them until the timeout)
            record["different_calls"] = _call(lambda: manager.save_async(4, state_at(4)))[1]
        else:
            record["different_calls"] = _call(lambda: manager.save(4, state_at(4)))[1]
        record["different_calls_seconds"] = time.monotonic() - started
        record["join_after_different_calls"] = _call(manager.join)[1]
        record["after"] = _call(lambda: manager.save(5, state_at(5)))
        record["steps"] = manager.all_steps()
        record["differences"] = []
        for step in (2, 5):
            fresh = {"w": torch.zeros(10), "b": torch.zeros(3), "r": PerRank(torch.zeros(5))}
            manager.restore(step, fresh)
            record["differences"].append(first_difference(fresh, state_at(step)))
    record["disk"] = _disk_steps(ckpt_dir)
    return record


# (step, structure, whether rank 1's write of it fails): the same structure again (no plan sent),
# rank 1's per-rank tensor changing shape alone, both ranks' structures changing, a write failing
# on rank 1 alone, then the first structure again.
PLANS_SEQUENCE: list[tuple[int, str, bool]] = [
    (1, "base", False),
    (2, "base", False),
    (3, "rank1", False),
    (4, "rank1", False),
    (5, "both", False),
    (6, "both", True),
    (7, "both", False),
    (8, "base", False),
    (9, "reshard", False),
    (10, "reshard", False),
    (11, "base", False),
    (12, "dtypes", False),
    (13, "dtypes", False),
]


def scenario_plans(rank: int, ckpt_dir: str) -> dict[str, Any]:
    """Saves with DCP's plans, the DTensors' write items and the pickled ``.metadata`` kept
    between them (ckptmgr.save_plans, ckptmgr.write_items, ckptmgr.metadata_file) on 2 ranks, of
    DTensors,
    per-rank and replicated tensors, through the changes of ``PLANS_SEQUENCE``. Each save that
    commits is restored into fresh tensors and compared bit for bit (as local tensors)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from ckptmgr import CheckpointManager, dcp_io

    mesh = init_device_mesh("cpu", (2,))

    def state_at(step: int, kind: str) -> dict[str, Any]:
        generator = torch.Generator().manual_seed(step)  # (the same on both ranks)
        rows = 48 if kind == "both" else 64
        placements = [Replicate()] if kind == "reshard" else [Shard(0)]
        dt = torch.randn(rows, 300, generator=generator)
        r_size = 40 if kind not in ("base", "dtypes") and rank == 1 else 30
        state: dict[str, Any] = {
            "dt": distribute_tensor(dt, mesh, placements),
            "big": torch.full((20_000,), float(step)),
            "r": PerRank(torch.arange(r_size) + 1000 * rank),
        }
        if kind == "dtypes":  # base's names and shapes, other dtypes (DCP's plans compare none)
            state["dt"] = distribute_tensor(dt.to(torch.bfloat16), mesh, placements)
            state["big"] = torch.full((20_000,), step, dtype=torch.int32)
        if kind == "both":
            state["dt2"] = distribute_tensor(
                torch.randn(10, 2000, generator=generator).double(), mesh, [Shard(1)]
            )
        return state

    def blank(state: dict[str, Any]) -> dict[str, Any]:
        fresh: dict[str, Any] = {}
        for key, value in state.items():
            if isinstance(value, DTensor):
                fresh[key] = distribute_tensor(
                    torch.zeros(value.shape, dtype=value.dtype), mesh, value.placements
                )
            elif isinstance(value, PerRank):
                fresh[key] = PerRank(torch.zeros_like(value.value))
            else:
                fresh[key] = torch.zeros_like(value)
        return fresh

    def local(value: Any) -> Any:
        if isinstance(value, DTensor):
            return value.to_local()
        return value.value if isinstance(value, PerRank) else value

    original_write_file = dcp_io._RawTensorWriter._write_file
    failing = {"on": False}

    def write_file(self: Any, *args: Any, **kwargs: Any) -> Any:
        if failing["on"]:
            raise OSError("injected on rank 1: the disk refused the write")
        return original_write_file(self, *args, **kwargs)

    dcp_io._RawTensorWriter._write_file = write_file  # type: ignore[method-assign]
    record: dict[str, Any] = {"saves": [], "restores": []}
    with CheckpointManager(
        ckpt_dir,
        1,
        max_to_keep=20,
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
        chkpt_on_preemption=False,
    ) as manager:
        for step, kind, fails in PLANS_SEQUENCE:
            failing["on"] = fails and rank == 1
            state = state_at(step, kind)
            _, error = _call(lambda state=state, step=step: manager.save(step, state))
            failing["on"] = False
            record["saves"].append(
                {
                    "step": step,
                    "error": error,
                    "holds_plans": manager._save_plans.holds_plans(),
                    "holds_items": manager._save_plans.write_items.holds_items(),
                    "metadata_reused": manager._save_plans.metadata_file.reused,
                    "results_unchanged_sent": manager._save_plans.kept_results.unchanged_sent,
                    "results_reused": manager._save_plans.kept_results.reused,
                }
            )
        record["steps"] = manager.all_steps()
        for step, kind, _ in PLANS_SEQUENCE:
            if step not in record["steps"]:
                continue
            expected = state_at(step, kind)
            fresh = blank(expected)
            _, error = _call(lambda fresh=fresh, step=step: manager.restore(step, fresh))
            differences = {
                key: first_difference(local(fresh[key]), local(value), key)
                for key, value in expected.items()
            }
            record["restores"].append({"step": step, "error": error, "differences": differences})
    record["holds_plans_after_close"] = manager._save_plans.holds_plans()
    record["holds_items_after_close"] = manager._save_plans.write_items.holds_items()
    return record


class _Unpicklable(Exception):
    """An exception that cannot be sent to another rank (its pickling fails)."""

    def __reduce__(self) -> Any:
        raise TypeError("this exception does not pickle")


def _release(group: Any) -> None:
    """End a scenario's own gloo ``group`` while the interpreter is fully alive: both ranks done
    with it, garbage (exceptions and their frames, holding tensors) collected, then destroyed.
    (A 2-rank job once aborted in teardown, "terminate called without an active exception",
    after the collective_load scenario had written its records.)"""
    import gc

    import torch.distributed as dist

    dist.barrier(group)
    gc.collect()
    dist.destroy_process_group(group)


def scenario_collective_save(rank: int, ckpt_dir: str) -> dict[str, Any]:
    """``dcp_io.save_tensors`` over a 2-rank group (ckptmgr.collective_save), called directly:
    a save that succeeds, then failures injected in each of its steps on one rank (local
    planning on rank 1, global planning on rank 0, a write on rank 1 that raises an exception
    that does not pickle), then a save that succeeds again. Each call records what it returned
    or raised and the files of its directory; the successful saves are read back."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptmgr import dcp_io
    from ckptmgr.save_plans import _SavePlanner

    mesh = init_device_mesh("cpu", (2,))
    group = dist.new_group(backend="gloo")  # (the manager saves over a group of its own)
    generator = torch.Generator().manual_seed(0)  # (the same on both ranks)
    full = torch.randn(64, 30, generator=generator)
    replicated = torch.randn(500, generator=generator)
    state = {"dt": distribute_tensor(full, mesh, [Shard(0)]), "replicated": replicated}

    class FailingLocalPlan(_SavePlanner):
        def create_local_plan(self) -> Any:
            if rank == 1:
                raise ValueError("injected: rank 1's local plan")
            return super().create_local_plan()

    class FailingGlobalPlan(_SavePlanner):
        def create_global_plan(self, all_plans: Any) -> Any:
            raise ValueError("injected: rank 0's global plan")

    def write_fails(plan: Any, planner: Any) -> Any:
        raise _Unpicklable("injected: rank 1's write")

    def save(name: str, planner: Any, failing_write: bool = False) -> dict[str, Any]:
        directory = os.path.join(ckpt_dir, name)
        writer = dcp_io.make_writer(directory, local=True, thread_count=2, storage_options={})
        if failing_write and rank == 1:
            writer.write_data = write_fails  # type: ignore[method-assign,union-attr]
        seen: dict[str, Any] = {"returned": None, "raised": None, "failing_ranks": None}
        try:
            seen["returned"] = type(dcp_io.save_tensors(state, writer, group, planner)).__name__
        except BaseException as exc:  # (DCP's CheckpointException is a BaseException)
            seen["raised"] = f"{type(exc).__name__}: {exc}"
            failures = getattr(exc, "failures", None)
            seen["failing_ranks"] = sorted(failures) if isinstance(failures, dict) else None
        dist.barrier()
        seen["files"] = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
        if seen["raised"] is None:
            fresh = {
                "dt": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]),
                "replicated": torch.zeros_like(replicated),
            }
            reader = dcp_io.make_reader(directory, local=True, storage_options={})
            dcp_io.load_tensors(fresh, reader, group)
            seen["read_back"] = bool(
                torch.equal(fresh["dt"].full_tensor(), full)
                and torch.equal(fresh["replicated"], replicated)
            )
        return seen

    calls = {
        "ok": save("ok", _SavePlanner()),
        "local_plan": save("local_plan", FailingLocalPlan()),
        "global_plan": save("global_plan", FailingGlobalPlan()),
        "write": save("write", _SavePlanner(), failing_write=True),
        "ok_again": save("ok_again", _SavePlanner()),
    }
    _release(group)
    return {"calls": calls}


def scenario_collective_load(rank: int, ckpt_dir: str) -> dict[str, Any]:
    """DCP's load over a 2-rank group as ckptmgr runs it (ckptmgr.collective_load), called
    directly on a step saved by ``dcp_io.save_tensors``: with DCP's global step (no exchange of
    plans) and with a planner whose global step is its own (the exchange), each read back and
    with failures injected: local planning on rank 1, reading on rank 0. Each call records what
    it raised, whether the plans went through the coordinator, and whether this rank's
    destination was written."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptmgr import collective_load, dcp_io, step_collectives
    from ckptmgr.save_plans import _SavePlanner

    mesh = init_device_mesh("cpu", (2,))
    group = dist.new_group(backend="gloo")
    generator = torch.Generator().manual_seed(0)  # (the same on both ranks)
    full = torch.randn(64, 30, generator=generator)
    replicated = torch.randn(500, generator=generator)
    directory = os.path.join(ckpt_dir, "step")
    writer = dcp_io.make_writer(directory, local=True, thread_count=2, storage_options={})
    state = {"dt": distribute_tensor(full, mesh, [Shard(0)]), "replicated": replicated}
    dcp_io.save_tensors(state, writer, group, _SavePlanner())
    dist.barrier()

    scatters = {"count": 0}
    scatter = step_collectives.scatter_from

    def counted_scatter(*args: Any, **kwargs: Any) -> Any:
        scatters["count"] += 1
        return scatter(*args, **kwargs)

    step_collectives.scatter_from = counted_scatter  # type: ignore[assignment]

    class OwnGlobalStep(dcp_io.TensorOnlyLoadPlanner):
        def create_global_plan(self, global_plan: Any) -> Any:
            return super().create_global_plan(global_plan)

    def failing_local_plan(base: type) -> type:
        class FailingLocalPlan(base):  # type: ignore[misc,valid-type]
            def create_local_plan(self) -> Any:
                if rank == 1:
                    raise ValueError("injected: rank 1's load plan")
                return super().create_local_plan()

        return FailingLocalPlan

    def read_fails(plan: Any, planner: Any) -> Any:
        raise OSError("injected: rank 0's read")

    def load(planner: Any, failing_read: bool = False) -> dict[str, Any]:
        fresh = {
            "dt": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]),
            "replicated": torch.zeros_like(replicated),
        }
        reader = dcp_io.make_reader(directory, local=True, storage_options={})
        if failing_read and rank == 0:
            reader.read_data = read_fails  # type: ignore[method-assign,union-attr]
        scatters["count"] = 0
        seen: dict[str, Any] = {"raised": None, "failing_ranks": None}
        try:
            collective_load.load_over_group(fresh, reader, planner, group)
        except BaseException as exc:  # (DCP's CheckpointException is a BaseException)
            seen["raised"] = f"{type(exc).__name__}: {exc}"
            failures = getattr(exc, "failures", None)
            seen["failing_ranks"] = sorted(failures) if isinstance(failures, dict) else None
        dist.barrier()
        seen["scattered"] = scatters["count"]
        seen["written"] = bool(fresh["dt"].to_local().any() or fresh["replicated"].any())
        seen["read_back"] = bool(
            torch.equal(fresh["dt"].full_tensor(), full)
            and torch.equal(fresh["replicated"], replicated)
        )
        return seen

    calls = {
        "dcps_global_step": load(dcp_io.TensorOnlyLoadPlanner()),
        "own_global_step": load(OwnGlobalStep()),
        "local_plan": load(failing_local_plan(dcp_io.TensorOnlyLoadPlanner)()),
        "local_plan_exchanged": load(failing_local_plan(OwnGlobalStep)()),
        "read": load(dcp_io.TensorOnlyLoadPlanner(), failing_read=True),
        "again": load(dcp_io.TensorOnlyLoadPlanner()),
    }
    step_collectives.scatter_from = scatter  # type: ignore[assignment]
    _release(group)
    return {"calls": calls}


def scenario_shared_chunks(rank: int, ckpt_dir: str) -> dict[str, Any]:
    """Restores planned with each DTensor layout's chunk worked out once (ckptmgr.load_chunks)
    on 2 ranks: DTensors of repeated layouts (the same shape under other placements among them)
    and a plain tensor, restored into the saved layouts and into others (resharding, an uneven
    shard among them), each checked bit for bit; DCP's chunk computations are counted."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from ckptmgr import dcp_io
    from ckptmgr.save_plans import _SavePlanner

    mesh = init_device_mesh("cpu", (2,))
    group = dist.new_group(backend="gloo")
    generator = torch.Generator().manual_seed(0)  # (the same on both ranks)
    full = {f"a{i}": torch.randn(64, 30, generator=generator) for i in range(6)}
    full.update({f"b{i}": torch.randn(10, 40, generator=generator) for i in range(4)})
    full.update({f"d{i}": torch.randn(64, 30, generator=generator) for i in range(3)})
    full["c"] = torch.randn(7, generator=generator)
    plain = torch.randn(100, generator=generator)
    saved = {"a": [Shard(0)], "b": [Shard(1)], "c": [Replicate()], "d": [Replicate()]}
    other = {"a": [Shard(1)], "b": [Replicate()], "c": [Shard(0)], "d": [Shard(0)]}

    def state(layout: dict[str, Any], zeros: bool) -> dict[str, Any]:
        made: dict[str, Any] = {
            key: distribute_tensor(
                torch.zeros_like(value) if zeros else value, mesh, layout[key[0]]
            )
            for key, value in full.items()
        }
        made["plain"] = torch.zeros_like(plain) if zeros else plain
        return made

    directory = os.path.join(ckpt_dir, "step")
    writer = dcp_io.make_writer(directory, local=True, thread_count=2, storage_options={})
    dcp_io.save_tensors(state(saved, zeros=False), writer, group, _SavePlanner())
    dist.barrier()
    computed = {"count": 0}
    chunk_list = DTensor.__create_chunk_list__

    def counted(self: Any) -> Any:
        computed["count"] += 1
        return chunk_list(self)

    DTensor.__create_chunk_list__ = counted  # type: ignore[method-assign]
    record: dict[str, Any] = {}
    for name, layout in (("same", saved), ("resharded", other)):
        fresh = state(layout, zeros=True)
        computed["count"] = 0
        reader = dcp_io.make_reader(directory, local=True, storage_options={})
        dcp_io.load_tensors(fresh, reader, group)
        record[name] = {
            "computed": computed["count"],
            "wrong": sorted(
                key
                for key, value in full.items()
                if not torch.equal(fresh[key].full_tensor(), value)
            )
            + ([] if torch.equal(fresh["plain"], plain) else ["plain"]),
        }
    DTensor.__create_chunk_list__ = chunk_list  # type: ignore[method-assign]
    _release(group)
    return record


def scenario_learned(rank: int, ckpt_dir: str) -> dict[str, Any]:
    """Failures one rank learns of alone, before a save's collectives: retention's delete after
    step 2 fails on rank 0 (which alone deletes), and rank 1's state for step 5 uses the pack's
    reserved name. The next save must fail on both ranks, and the one after commit on both."""
    import torch

    from ckptmgr import CheckpointError, CheckpointManager, pruning
    from ckptmgr.packing import PACK_KEY

    original_delete = pruning.delete_steps
    deletes: list[int] = []

    def delete_failing_once_on_rank_0(storage: Any, steps: Any) -> None:
        deletes.append(1)
        if rank == 0 and len(deletes) == 1:
            raise CheckpointError("injected on rank 0: could not delete the old step")
        original_delete(storage, steps)

    pruning.delete_steps = delete_failing_once_on_rank_0  # type: ignore[assignment]

    def state_at(step: int) -> dict[str, Any]:
        return {"w": torch.arange(10.0) + step, "b": torch.full((3,), float(step))}

    record: dict[str, Any] = {}
    with CheckpointManager(
        ckpt_dir,
        1,
        max_to_keep=1,
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
        chkpt_on_preemption=False,
    ) as manager:
        record["saves_1_2"] = [_call(lambda s=s: manager.save(s, state_at(s))) for s in (1, 2)]
        record["after_failed_delete"] = _call(lambda: manager.save_async(3, state_at(3)))
        record["next"] = _call(lambda: manager.save_async(4, state_at(4)))
        record["join"] = _call(manager.join)[1]
        record["steps_after_4"] = manager.all_steps()
        bad = state_at(5)
        if rank == 1:
            bad[PACK_KEY] = torch.zeros(2)
        record["reserved_name"] = _call(lambda: manager.save(5, bad))
        record["after_reserved_name"] = _call(lambda: manager.save(6, state_at(6)))
        metrics = {"loss": 0.5 if rank == 0 else "not a number"}
        record["bad_metric"] = _call(lambda: manager.save(7, state_at(7), metrics=metrics))
        record["after_bad_metric"] = _call(lambda: manager.save_async(8, state_at(8)))
        record["join_8"] = _call(manager.join)[1]
        record["steps"] = manager.all_steps()

        class Refusing:  # an object whose load_state_dict fails on rank 1 only
            def state_dict(self) -> dict[str, Any]:
                return {"x": 1}

            def load_state_dict(self, state: dict[str, Any]) -> None:
                if rank == 1:
                    raise ValueError("injected on rank 1: load_state_dict refused")

        record["save_refusing"] = _call(lambda: manager.save(9, {**state_at(9), "o": Refusing()}))
        restored = {"w": torch.zeros(10), "b": torch.zeros(3), "o": Refusing()}
        record["restore_refused"] = _call(lambda: manager.restore(9, restored))[1]
        record["restore_latest_refused"] = _call(lambda: manager.restore_latest(restored))[1]
        record["after_refused"] = _call(lambda: manager.save(10, state_at(10)))
        fresh = {"w": torch.zeros(10), "b": torch.zeros(3)}
        manager.restore(10, fresh)
        record["difference"] = first_difference(fresh, state_at(10))
        record["steps_final"] = manager.all_steps()
    record["disk"] = _disk_steps(ckpt_dir)
    return record


class RootRefusingLocalFileSystem(FlakyLocalFileSystem):
    """:class:`FlakyLocalFileSystem` whose ``makedirs`` raises ``PermissionError`` on the ranks in
    ``refusing_ranks`` (a root this rank may not create)."""

    protocol = "ckptmgr-dist-refusing"
    refusing_ranks: ClassVar[frozenset[int]] = frozenset()

    def makedirs(self, path: Any, exist_ok: bool = False) -> None:
        rank = int(os.environ.get("RANK", "0"))
        if rank in type(self).refusing_ranks:
            raise PermissionError(f"injected on rank {rank}: may not create {path}")
        super().makedirs(path, exist_ok=exist_ok)


def scenario_open_fails(rank: int, ckpt_dir: str) -> dict[str, Any]:
    """Opening the root fails on one rank only: rank 0's owner lease cannot be written, then
    rank 1 may not create the root. Each time the failing rank raises its own error and the
    other a ``CheckpointError`` naming it, without waiting for the collective timeout in a
    collective the failed rank never joined; then a manager opens and saves on both ranks
    (their collectives still paired). Last, rank 0 makes a manager that rank 1 does not."""
    import torch

    from ckptmgr import CheckpointManager

    fsspec.register_implementation(FLAKY_PROTOCOL, FlakyLocalFileSystem, clobber=True)
    fsspec.register_implementation(
        RootRefusingLocalFileSystem.protocol, RootRefusingLocalFileSystem, clobber=True
    )

    def open_manager(url: str) -> CheckpointManager:
        return CheckpointManager(
            url,
            1,
            collective_timeout_s=COLLECTIVE_TIMEOUT_S,
            chkpt_on_preemption=False,
            retry={"max_attempts": 1},
        )

    record: dict[str, Any] = {}
    FlakyLocalFileSystem.failing_ranks = frozenset({0})  # the lease's write, on rank 0 alone
    record["lease_fails"] = _call(lambda: open_manager(f"{FLAKY_PROTOCOL}://{ckpt_dir}"))[1]
    FlakyLocalFileSystem.failing_ranks = frozenset()
    RootRefusingLocalFileSystem.refusing_ranks = frozenset({1})
    url = f"{RootRefusingLocalFileSystem.protocol}://{ckpt_dir}/refused"
    record["root_refused"] = _call(lambda: open_manager(url))[1]
    RootRefusingLocalFileSystem.refusing_ranks = frozenset()
    with open_manager(f"{FLAKY_PROTOCOL}://{ckpt_dir}") as manager:
        record["saved"] = _call(lambda: manager.save(1, {"w": torch.arange(4.0)}))
        record["steps"] = _gather(manager.all_steps())
    if rank == 0:  # last: rank 1 makes no manager (it waits in a barrier of the training's)
        started = time.monotonic()
        record["alone"] = _call(
            lambda: CheckpointManager(
                ckpt_dir, 1, collective_timeout_s=2.0, chkpt_on_preemption=False
            )
        )[1]
        record["alone_seconds"] = time.monotonic() - started
    _gather(None)
    return record


def scenario_late_failure(rank: int, ckpt_dir: str) -> dict[str, Any]:
    """Rank 0's part of the async save of step 1 fails, and rank 0 learns of the failure only
    after rank 1 has reported it at the next save's agreement (rank 0's writer is held in
    removing the failed write). That save raises on both ranks; then ``join`` must raise the
    failure on neither (it was raised once, on both: rank 0's join raised it again, alone),
    and the next save commits on both."""
    import threading

    import torch

    from ckptmgr import CheckpointManager

    fsspec.register_implementation(FLAKY_PROTOCOL, FlakyLocalFileSystem, clobber=True)
    manager = CheckpointManager(
        f"{FLAKY_PROTOCOL}://{ckpt_dir}",
        1,
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
        chkpt_on_preemption=False,
    )
    posted, released = threading.Event(), threading.Event()
    record_error, discard = manager._writer.record_error, manager._storage.discard

    def posting(error: Any) -> None:  # the writer reports a background failure
        record_error(error)
        posted.set()

    def held_discard(path: str) -> None:  # rank 0 removes the failed write (the coordinator)
        released.wait(WATCHDOG_S)
        discard(path)

    manager._writer.record_error = posting  # type: ignore[method-assign]
    manager._storage.discard = held_discard  # type: ignore[method-assign]
    state = {"w": torch.arange(4.0)}
    record: dict[str, Any] = {}
    FlakyLocalFileSystem.failing_ranks = frozenset({0})
    record["async_1"] = _call(lambda: manager.save_async(1, state))
    if rank == 1:
        record["posted"] = posted.wait(WATCHDOG_S)  # rank 1 knows of the failure
    record["save_2"] = _call(lambda: manager.save(2, state))[1]
    FlakyLocalFileSystem.failing_ranks = frozenset()
    released.set()
    if rank == 0:
        record["posted"] = posted.wait(WATCHDOG_S)  # rank 0 learns of it only now
    record["join"] = _call(manager.join)[1]
    record["save_3"] = _call(lambda: manager.save(3, state))
    record["steps"] = _gather(manager.all_steps())
    record["close"] = _call(manager.close)[1]
    return record


def scenario_single(ckpt_dir: str) -> dict[str, Any]:
    """A plain single process (no torch.distributed) on the directory the 2-rank jobs wrote."""
    import torch.distributed as dist

    from ckptmgr import CheckpointManager

    with CheckpointManager(
        ckpt_dir, save_interval=10, max_to_keep=MAX_TO_KEEP, chkpt_on_preemption=False
    ) as manager:
        record: dict[str, Any] = {
            "distributed": dist.is_available() and dist.is_initialized(),
            "steps": manager.all_steps(),
            "latest": manager.latest_step(),
            "restores": [],
        }
        for step in KEPT_STEPS:
            # The replicated part of the state, and rank 0's plain values (the fallback file).
            fresh = blank_state()
            state = {key: fresh[key] for key in ("model", "progress", "seed")}
            _, error = _call(lambda state=state, step=step: manager.restore(step, state))
            expected = make_state(step, 0)
            record["restores"].append(
                {
                    "step": step,
                    "error": error,
                    "differences": {
                        key: first_difference(state[key], expected[key], key) for key in state
                    },
                }
            )
    return record


def _write_record(out_dir: str, scenario: str, rank: int, record: dict[str, Any]) -> None:
    """This rank's record, where the test reads it (written whole: renamed into place)."""
    target = Path(out_dir) / f"{scenario}-rank{rank}.json"
    temporary = target.with_suffix(".tmp")
    temporary.write_text(json.dumps(record, indent=1, default=repr))
    temporary.rename(target)


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    scenario, out_dir, *paths = argv
    distributed = scenario != "single"
    if distributed:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    rank = dist.get_rank() if distributed else 0
    record: dict[str, Any] = {
        "rank": rank,
        "world_size": dist.get_world_size() if distributed else 1,
    }
    try:
        if scenario == "train":
            record.update(scenario_train(rank, *paths))
        elif scenario == "resume":
            record.update(scenario_resume(rank, *paths))
        elif scenario == "policies":
            record.update(scenario_policies(rank, *paths))
        elif scenario == "preempt":
            record.update(scenario_preempt(rank, *paths, out_dir))
        elif scenario == "mismatch":
            record.update(scenario_mismatch(rank, *paths))
        elif scenario == "diverge":
            record.update(scenario_diverge(rank, *paths))
        elif scenario == "device_wait_fails":
            record.update(scenario_device_wait_fails(rank, *paths))
        elif scenario == "plans":
            record.update(scenario_plans(rank, *paths))
        elif scenario == "collective_save":
            record.update(scenario_collective_save(rank, *paths))
        elif scenario == "collective_load":
            record.update(scenario_collective_load(rank, *paths))
        elif scenario == "shared_chunks":
            record.update(scenario_shared_chunks(rank, *paths))
        elif scenario == "learned":
            record.update(scenario_learned(rank, *paths))
        elif scenario == "open_fails":
            record.update(scenario_open_fails(rank, *paths))
        elif scenario == "late_failure":
            record.update(scenario_late_failure(rank, *paths))
        elif scenario == "peer_gone":
            record.update(scenario_peer_gone(rank, *paths, out_dir))
        elif scenario == "gone_before_outcome":
            record.update(scenario_gone_before_outcome(rank, *paths, out_dir))
        elif scenario == "raising_policy":
            record.update(scenario_raising_policy(rank, *paths))
        elif scenario == "single":
            record.update(scenario_single(*paths))
        else:
            raise ValueError(f"unknown scenario {scenario!r}")
    except Exception:
        record["crash"] = traceback.format_exc()
    _write_record(out_dir, scenario, rank, record)
    if distributed:
        dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    finally:
        gc.freeze()  # (the interpreter's last collection skipped: about 0.7 s with torch loaded)
