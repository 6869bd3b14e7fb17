"""Core save/restore behaviour: intervals, bit-exact round trips, async snapshots, retention.

Everything is real: the local disk, fsspec's in-memory file system, DCP, fresh interpreters.
The one test double is a file system (fsspec's in-memory one with its own store) whose writes
wait on an event, so that "mutate the state while the write is still pending" is a certainty
rather than a race.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import random
import re
import struct
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import numpy as np
import pytest
import torch
from conftest import REPO, run_python
from fsspec.implementations.memory import MemoryFileSystem
from torch import nn

from ckptmgr import (
    CheckpointError,
    CheckpointManager,
    CommitRecord,
    RNGState,
    StateDict,
)

# Upper bound of every wait on another thread in this file; never reached when healthy.
BOUND_S = 60.0
STEP_DIR = re.compile(r"step_\d{12}")


# -- states and bit-exact comparison ---------------------------------------------------------------
def build_state(seed: int) -> dict[str, Any]:
    """A state with every supported kind of value; deterministic in ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(4, 6, generator=gen)
    wide = torch.randn(3, 8, generator=gen)
    return {
        "f32": torch.randn(3, 5, generator=gen),
        "bf16": torch.randn(7, generator=gen).to(torch.bfloat16),
        "f16": torch.randn(2, 3, generator=gen).to(torch.float16),
        "i64": torch.randint(-(2**62), 2**62, (5,), generator=gen, dtype=torch.int64),
        "u8": torch.randint(0, 256, (9,), generator=gen, dtype=torch.uint8),
        "mask": torch.rand(6, generator=gen) > 0.5,
        "empty": torch.empty(0, 3),
        "empty_i64": torch.empty(0, dtype=torch.int64),
        "zero_dim": torch.tensor(seed + 0.25),
        "zero_dim_i64": torch.tensor(-(2**40) - seed),
        "special": torch.tensor([math.nan, math.inf, -math.inf, -0.0, 1e-45, 3.4e38]),
        "transposed": base.t(),  # non-contiguous source, restored into a non-contiguous target
        "strided": wide[:, ::2],  # non-contiguous source (a strided slice)
        "into_transposed": torch.randn(5, 3, generator=gen),  # contiguous source, see target
        "nested": {
            "a": {"b": torch.randn(2, 2, generator=gen), "c": [torch.arange(seed, seed + 4), 3]},
            "list": [torch.ones(2, dtype=torch.float16) * seed, {"d": torch.zeros(1) + seed}, "x"],
        },
        "tuple": (torch.full((2,), float(seed)), 7, "seven"),
        "int": seed * 1000 + 7,
        "big_int": 2**62 + seed,
        "neg_int": -5 - seed,
        "float": 0.1 + seed,
        "nan": math.nan,
        "inf": math.inf,
        "ninf": -math.inf,
        "neg_zero": -0.0,
        "str": f'héllo ✓ {seed}\n"quoted"',
        "none": None,
        "bytes": bytes(range(256)) + bytes([seed % 256]),
        "py_bool": True,
        "plain_list": [1, 2.5, "three", None, [4, (5, 6)], b"\x00"],
        "plain_dict": {"k": [1, 2], "n": None, "nested": {"deep": -1.5}},
        "plain_tuple": (1, "two", 3.0),
        "int_keys": {1: "one", 2: "two"},
        "empty_list": [],
        "empty_dict": {},
    }


def contains_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(contains_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(contains_tensor(v) for v in value)
    return False


UNSET = "<not restored>"


def build_target(expected: Any) -> Any:
    """Same structure, tensors of the same layout holding other values, plain leaves unset."""
    if isinstance(expected, torch.Tensor):
        target = torch.empty_strided(expected.size(), expected.stride(), dtype=expected.dtype)
        target.copy_(expected)
        if target.dtype == torch.bool:
            target.logical_not_()
        else:
            target.add_(1)
        return target
    if isinstance(expected, dict) and contains_tensor(expected):
        target = {key: build_target(value) for key, value in expected.items()}
        if "into_transposed" in target:  # a contiguous source restored into a transposed view
            rows, cols = expected["into_transposed"].shape
            target["into_transposed"] = torch.zeros(cols, rows).t()
        return target
    if isinstance(expected, (list, tuple)) and contains_tensor(expected):
        return type(expected)(build_target(value) for value in expected)
    return UNSET


def tensor_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``tensor``'s values, in logical order."""
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_bit_equal(actual: Any, expected: Any, where: str = "state") -> None:
    """Same types, same structure, same bits (nan == nan, -0.0 != 0.0)."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, where
        assert actual.shape == expected.shape, where
        assert torch.equal(tensor_bits(actual), tensor_bits(expected)), where
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), where
        for key in expected:
            assert_bit_equal(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (got, want) in enumerate(zip(actual, expected, strict=True)):
            assert_bit_equal(got, want, f"{where}[{index}]")
    elif isinstance(expected, float):
        same_nan = math.isnan(actual) and math.isnan(expected)
        assert same_nan or struct.pack("<d", actual) == struct.pack("<d", expected), where
    else:
        assert actual == expected, where


def tensor_identities(value: Any, where: str = "") -> dict[str, tuple[int, int, tuple[int, ...]]]:
    """Path -> (id, data_ptr, stride) of every tensor in ``value``."""
    if isinstance(value, torch.Tensor):
        return {where: (id(value), value.data_ptr(), value.stride())}
    found: dict[str, tuple[int, int, tuple[int, ...]]] = {}
    if isinstance(value, dict):
        for key, item in value.items():
            found.update(tensor_identities(item, f"{where}/{key}"))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found.update(tensor_identities(item, f"{where}[{index}]"))
    return found


def restore_and_check(manager: CheckpointManager, step: int, expected: dict[str, Any]) -> None:
    """Restore ``step`` into a fresh target; tensors filled in place, everything bit-exact."""
    target = build_target(expected)
    identities = tensor_identities(target)
    assert not target["into_transposed"].is_contiguous()
    assert not target["transposed"].is_contiguous()
    manager.restore(step, target)
    assert tensor_identities(target) == identities  # the very same tensors, filled in place
    assert_bit_equal(target, expected)


def verify_in_fresh_process(path: str, seeds: dict[int, int]) -> None:
    """Run in a fresh interpreter: a new manager lists and restores every step bit-exact."""
    with CheckpointManager(path, 1, chkpt_on_preemption=False) as manager:
        assert manager.all_steps() == sorted(seeds)
        for step, seed in seeds.items():
            restore_and_check(manager, step, build_state(seed))


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of a state (tensors cloned, layout kept)."""
    return copy.deepcopy(state)


def mutate_in_place(value: Any) -> None:
    """Change every tensor of ``value`` in place."""
    for tensor in iter_tensors(value):
        if tensor.dtype == torch.bool:
            tensor.logical_not_()
        else:
            tensor.add_(1)


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from iter_tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from iter_tensors(item)


def small_state(value: float) -> dict[str, Any]:
    return {"w": torch.full((4, 3), value), "ids": torch.arange(5) + int(value), "tag": value}


def disk_files(path: Path) -> dict[str, bytes]:
    """Relative path -> contents of every file under ``path``."""
    return {
        str(file.relative_to(path)): file.read_bytes()
        for file in sorted(path.rglob("*"))
        if file.is_file()
    }


def manager(path: str | Path, save_interval: int = 1, **kwargs: Any) -> CheckpointManager:
    kwargs.setdefault("chkpt_on_preemption", False)
    return CheckpointManager(path, save_interval, **kwargs)


# -- a file system whose writes wait for the test -------------------------------------------------
GATED = "gatedsr"


class GatedFileSystem(MemoryFileSystem):
    """fsspec's in-memory file system with its own store; every checkpoint write waits for
    ``gate`` (the owner lease record is not gated).

    Class-level state because fsspec caches one instance per thread and DCP writes from its own.
    """

    protocol = (GATED,)
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]
    gate: ClassVar[threading.Event] = threading.Event()
    writing: ClassVar[threading.Event] = threading.Event()

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str):
            path = path.removeprefix(f"{GATED}://")
        return super()._strip_protocol(path)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if any(flag in mode for flag in "wxa+") and not path.endswith("owner.json"):
            self.writing.set()
            if not self.gate.wait(BOUND_S):
                raise OSError(f"the test never opened the gate for {path}")
        return super()._open(path, mode, **kwargs)


@pytest.fixture
def gated() -> Iterator[type[GatedFileSystem]]:
    """The gated file system, empty and closed, registered as ``gatedsr://``."""
    GatedFileSystem.store.clear()
    GatedFileSystem.pseudo_dirs[:] = [""]
    GatedFileSystem.gate = threading.Event()
    GatedFileSystem.writing = threading.Event()
    GatedFileSystem.clear_instance_cache()
    fsspec.register_implementation(GATED, GatedFileSystem, clobber=True)
    yield GatedFileSystem
    GatedFileSystem.gate.set()  # never leave a writer thread blocked
    GatedFileSystem.store.clear()
    GatedFileSystem.pseudo_dirs[:] = [""]
    GatedFileSystem.clear_instance_cache()


@pytest.fixture
def memory_url() -> Iterator[str]:
    """A unique ``memory://`` root, removed afterwards."""
    root = f"/ckptmgr-test-{uuid.uuid4().hex}"
    yield f"memory://{root}"
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


# -- deciding when to save -------------------------------------------------------------------------
def test_save_returns_true_exactly_at_multiples_of_the_interval(ckpt_dir: Path) -> None:
    with manager(ckpt_dir, save_interval=5) as mgr:
        assert mgr.latest_step() is None
        assert mgr.all_steps() == []
        results = {}
        for step in range(23):
            wanted = mgr.should_save(step)
            results[step] = mgr.save(step, small_state(float(step)))
            assert wanted == results[step], step
            assert not mgr.should_save(step), step  # committed now, or never wanted
        assert [s for s, saved in results.items() if saved] == [0, 5, 10, 15, 20]
        assert mgr.all_steps() == [0, 5, 10, 15, 20]
        assert mgr.latest_step() == 20

        assert not mgr.should_save(7)
        assert mgr.save(7, small_state(7.0), force=True)
        assert mgr.save_async(8, small_state(8.0), force=True)
        assert not mgr.save_async(9, small_state(9.0))
        mgr.join()
        assert mgr.all_steps() == [0, 5, 7, 8, 10, 15, 20]
        assert mgr.latest_step() == 20
        restore_into = small_state(-1.0)
        mgr.restore(7, restore_into)
        assert torch.equal(restore_into["w"], torch.full((4, 3), 7.0))
        assert restore_into["tag"] == 7.0


def test_all_steps_sorted_unique_and_latest_step(ckpt_dir: Path) -> None:
    with manager(ckpt_dir, save_interval=10) as mgr:
        assert mgr.save(30, small_state(1.0))
        assert mgr.save(5, small_state(2.0), force=True)
        assert mgr.save_async(20, small_state(3.0))
        assert not mgr.save_async(20, small_state(3.0), force=True)  # in flight or committed
        mgr.join()
        assert mgr.save(12, small_state(4.0), force=True)
        assert not mgr.save(30, small_state(5.0))
        assert mgr.all_steps() == [5, 12, 20, 30]
        assert mgr.latest_step() == 30


@pytest.mark.parametrize("force", [False, True], ids=["interval", "force"])
@pytest.mark.parametrize("use_async", [False, True], ids=["save", "save_async"])
def test_saving_a_committed_step_again_warns_and_leaves_it_untouched(
    ckpt_dir: Path, caplog: pytest.LogCaptureFixture, use_async: bool, force: bool
) -> None:
    with manager(ckpt_dir, save_interval=10) as mgr:
        assert mgr.save(10, small_state(1.0), metrics={"loss": 0.5})
        before = disk_files(ckpt_dir)
        assert "step_000000000010/commit.json" in before
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ckptmgr"):
            save = mgr.save_async if use_async else mgr.save
            saved = save(10, small_state(2.0), force=force, metrics={"loss": 9.0})
            mgr.join()
        assert saved is False
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert any("10" in r.getMessage() for r in warnings), caplog.text
        assert disk_files(ckpt_dir) == before
        assert mgr.all_steps() == [10]
        restored = small_state(-1.0)
        mgr.restore(10, restored)
        assert_bit_equal(restored, small_state(1.0))


# -- round trips -----------------------------------------------------------------------------------
def test_round_trip_in_the_same_process_fills_tensors_in_place(ckpt_dir: Path) -> None:
    with manager(ckpt_dir) as mgr:
        assert mgr.save(3, build_state(3))
        assert mgr.save_async(4, build_state(4))
        mgr.join()
    with manager(ckpt_dir) as mgr:
        assert mgr.all_steps() == [3, 4]
        restore_and_check(mgr, 3, build_state(3))
        restore_and_check(mgr, 4, build_state(4))


def test_round_trip_bit_exact_in_a_fresh_interpreter(ckpt_dir: Path) -> None:
    state_sync, state_async = build_state(0), build_state(1)
    # The sources really are what the test claims.
    assert not state_sync["transposed"].is_contiguous()
    assert not state_sync["strided"].is_contiguous()
    assert state_sync["zero_dim"].dim() == 0 and state_sync["empty"].numel() == 0
    with manager(ckpt_dir, save_interval=100) as mgr:
        assert mgr.save(0, state_sync)
        assert mgr.save_async(1, state_async, force=True)
        mutate_in_place(state_async)  # the checkpoint still holds build_state(1)
        mgr.join()
        assert mgr.all_steps() == [0, 1]
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(REPO / 'tests')!r})\n"
        "import test_save_restore as t\n"
        f"t.verify_in_fresh_process({str(ckpt_dir)!r}, {{0: 0, 1: 1}})\n"
        "print('VERIFIED')\n"
    )
    result = run_python(code, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("VERIFIED"), result.stdout


def test_restore_replaces_plain_values_in_the_dict(ckpt_dir: Path) -> None:
    with manager(ckpt_dir) as mgr:
        assert mgr.save(0, {"t": torch.ones(2), "epoch": 3, "cfg": {"lr": 0.1, "names": ["a"]}})
        target: dict[str, Any] = {"t": torch.zeros(2), "epoch": None, "cfg": "stale"}
        tensor = target["t"]
        mgr.restore(0, target)
        assert target["t"] is tensor
        assert torch.equal(tensor, torch.ones(2))
        assert target["epoch"] == 3 and type(target["epoch"]) is int
        assert target["cfg"] == {"lr": 0.1, "names": ["a"]}


# -- async snapshots -------------------------------------------------------------------------------
def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: int) -> float:
    gen = torch.Generator().manual_seed(500 + batch)
    inputs, targets = torch.randn(16, 5, generator=gen), torch.randn(16, 2, generator=gen)
    loss = nn.functional.mse_loss(model(inputs), targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def test_async_checkpoint_holds_values_at_the_time_of_the_call(
    gated: type[GatedFileSystem], caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in range(2):
        train_step(model, optimizer, batch)
    tensors = build_state(7)
    expected_tensors = snapshot(tensors)
    expected_model = snapshot(model.state_dict())
    expected_optim = snapshot(optimizer.state_dict())
    state = {"data": tensors, "model": model, "optim": optimizer}

    with manager(f"{GATED}://root", save_interval=5) as mgr:
        assert mgr.save_async(5, state)
        # The write is held at the gate: everything below happens before any byte is stored.
        mutate_in_place(tensors)
        train_step(model, optimizer, 2)
        assert not torch.equal(model.state_dict()["0.weight"], expected_model["0.weight"])
        with caplog.at_level(logging.WARNING, logger="ckptmgr"):
            assert not mgr.save(5, state, force=True)  # being written: not saved twice
        assert "step 5" in caplog.text
        assert not mgr.should_save(5)
        assert mgr.all_steps() == []
        assert GatedFileSystem.writing.wait(BOUND_S)  # the writer is really waiting at the gate
        GatedFileSystem.gate.set()
        mgr.join()
        assert mgr.all_steps() == [5]

        fresh_model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
        fresh_optim = torch.optim.AdamW(fresh_model.parameters(), lr=1e-2)
        target = {"data": build_target(expected_tensors), "model": fresh_model}
        target["optim"] = fresh_optim
        mgr.restore(5, target)
    assert_bit_equal(target["data"], expected_tensors)
    assert_bit_equal(dict(fresh_model.state_dict()), dict(expected_model))
    assert_bit_equal(fresh_optim.state_dict(), expected_optim)


def test_back_to_back_async_saves_each_hold_their_own_values(ckpt_dir: Path) -> None:
    state = {"w": torch.zeros(64, 64), "ids": torch.zeros(100, dtype=torch.int64), "n": 0}
    with manager(ckpt_dir, save_interval=1, max_pending_async=2) as mgr:
        for step in range(6):
            state["w"].fill_(step)
            state["ids"].copy_(torch.arange(100) * step)
            state["n"] = step
            assert mgr.save_async(step, state)
            state["w"].fill_(-1.0)  # overwritten right away, before the write can finish
            state["ids"].fill_(-1)
            state["n"] = -1
        mgr.join()
        assert mgr.all_steps() == list(range(6))
    with manager(ckpt_dir) as mgr:
        for step in range(6):
            target = {"w": torch.empty(64, 64), "ids": torch.empty(100, dtype=torch.int64)}
            target["n"] = None
            mgr.restore(step, target)
            assert torch.equal(target["w"], torch.full((64, 64), float(step))), step
            assert torch.equal(target["ids"], torch.arange(100) * step), step
            assert target["n"] == step


# -- training objects ------------------------------------------------------------------------------
def make_trainer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def draw_random() -> tuple[torch.Tensor, float, np.ndarray]:
    return torch.rand(4), random.random(), np.random.rand(3)


def test_model_optimizer_scheduler_statedict_and_rng_round_trip(ckpt_dir: Path) -> None:
    model, optimizer, scheduler = make_trainer(seed=1)
    for batch in range(5):
        train_step(model, optimizer, batch)
        scheduler.step()
    progress = StateDict(epoch=2, batch=5, name="run-a", history=[1.0, 0.5])
    torch.manual_seed(11)
    random.seed(11)
    np.random.seed(11)
    draw_random()  # move the streams away from their seeds
    state = {
        "model": model,
        "optim": optimizer,
        "sched": scheduler,
        "progress": progress,
        "rng": RNGState(),
    }
    with manager(ckpt_dir, save_interval=5) as mgr:
        assert mgr.save(5, state)
    expected_draws = draw_random()
    expected_model = snapshot(dict(model.state_dict()))
    expected_optim = snapshot(optimizer.state_dict())
    expected_sched = snapshot(scheduler.state_dict())
    expected_losses = [train_step(model, optimizer, batch) for batch in range(5, 8)]

    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    new_model, new_optim, new_sched = make_trainer(seed=2)
    new_progress = StateDict(epoch=0, batch=0, name="", history=[])
    assert not torch.equal(new_model[0].weight, expected_model["0.weight"])
    assert not new_optim.state  # unprimed: the manager primes the Optimizer object itself
    new_state = {
        "model": new_model,
        "optim": new_optim,
        "sched": new_sched,
        "progress": new_progress,
        "rng": RNGState(),
    }
    with manager(ckpt_dir, save_interval=5) as mgr:
        weight = new_model[0].weight
        mgr.restore(5, new_state)
    assert new_model[0].weight is weight
    draws = draw_random()
    assert torch.equal(draws[0], expected_draws[0])
    assert draws[1] == expected_draws[1]
    assert np.array_equal(draws[2], expected_draws[2])

    assert_bit_equal(dict(new_model.state_dict()), expected_model)
    assert_bit_equal(new_optim.state_dict(), expected_optim)
    assert new_optim.param_groups[0]["lr"] == expected_optim["param_groups"][0]["lr"] == 2.5e-3
    assert_bit_equal(new_sched.state_dict(), expected_sched)
    assert new_progress == progress
    assert new_progress.name == "run-a" and new_progress.history == [1.0, 0.5]
    assert type(new_progress.epoch) is int
    # Training continues exactly as the original did.
    losses = [train_step(new_model, new_optim, batch) for batch in range(5, 8)]
    assert losses == expected_losses


# -- retention -------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_async", [False, True], ids=["save", "save_async"])
def test_max_to_keep_deletes_old_steps_from_disk(ckpt_dir: Path, use_async: bool) -> None:
    with manager(ckpt_dir, save_interval=10, max_to_keep=2) as mgr:
        for step in (10, 20, 30):
            save = mgr.save_async if use_async else mgr.save
            assert save(step, small_state(float(step)))
        mgr.join()
        assert mgr.all_steps() == [20, 30]
    assert sorted(p.name for p in ckpt_dir.iterdir() if p.name != "owner.json") == [
        "step_000000000020",
        "step_000000000030",
    ]
    assert not (ckpt_dir / "step_000000000010").exists()
    with manager(ckpt_dir, save_interval=10, max_to_keep=2) as mgr:
        assert mgr.all_steps() == [20, 30]
        restored = small_state(0.0)
        mgr.restore(20, restored)
        assert_bit_equal(restored, small_state(20.0))


def test_the_step_committed_last_is_never_deleted(ckpt_dir: Path) -> None:
    with manager(ckpt_dir, save_interval=100, max_to_keep=1) as mgr:
        assert mgr.save(100, small_state(100.0))
        assert mgr.save(50, small_state(50.0), force=True)  # e.g. resumed from an older step
        assert 50 in mgr.all_steps()
        assert (ckpt_dir / "step_000000000050" / "commit.json").is_file()
        restored = small_state(0.0)
        mgr.restore(50, restored)
        assert_bit_equal(restored, small_state(50.0))
        assert mgr.save(200, small_state(200.0))
        assert mgr.all_steps() == [200]
    assert [p.name for p in ckpt_dir.iterdir() if p.name != "owner.json"] == ["step_000000000200"]


# -- on-storage layout and commit records --------------------------------------------------------
def test_layout_commit_record_and_a_new_manager_agree(ckpt_dir: Path) -> None:
    metrics = {"loss": 0.25, "accuracy": 0.875, "tokens": 1024}
    metadata = {"run": "abc", "config": {"layers": [1, 2]}, "note": None}
    with manager(ckpt_dir, save_interval=10) as mgr:
        assert mgr.save(0, build_state(0), metrics=metrics, metadata=metadata)
        assert mgr.save_async(10, small_state(1.0), metrics={"loss": 0.125})
        mgr.join()
        listed = mgr.all_steps()
    assert listed == [0, 10]
    with manager(ckpt_dir, save_interval=10) as mgr:
        assert mgr.all_steps() == listed
        assert mgr.latest_step() == 10

    names = sorted(p.name for p in ckpt_dir.iterdir() if p.name != "owner.json")
    assert names == ["step_000000000000", "step_000000000010"]  # no leftovers
    for name, step in zip(names, listed, strict=True):
        assert STEP_DIR.fullmatch(name)
        step_dir = ckpt_dir / name
        record_path = step_dir / "commit.json"
        raw = json.loads(record_path.read_text())
        assert raw["step"] == step
        assert raw["world_size"] == 1
        files = {entry["path"]: entry["size"] for entry in raw["files"]}
        on_disk = {
            str(p.relative_to(step_dir)): p.stat().st_size
            for p in step_dir.rglob("*")
            if p.is_file() and p.name != "commit.json"
        }
        assert files == on_disk
        assert files and all(size >= 0 for size in files.values())
        record = CommitRecord.from_json(record_path.read_bytes())
        assert record.step == step
        assert record.committed_at.utcoffset() is not None  # timezone-aware UTC time
    first = CommitRecord.from_json((ckpt_dir / names[0] / "commit.json").read_bytes())
    assert first.metrics == {"loss": 0.25, "accuracy": 0.875, "tokens": 1024.0}
    assert first.metadata == metadata
    assert first.tensors["f32"].dtype == "float32" and first.tensors["f32"].shape == [3, 5]
    assert first.tensors["bf16"].dtype == "bfloat16"
    second = CommitRecord.from_json((ckpt_dir / names[1] / "commit.json").read_bytes())
    assert second.metrics == {"loss": 0.125}
    assert second.metadata == {}


# -- closing ---------------------------------------------------------------------------------------
def test_context_manager_and_close_are_idempotent_and_final(ckpt_dir: Path) -> None:
    with manager(ckpt_dir, save_interval=10) as mgr:
        assert isinstance(mgr, CheckpointManager)
        assert mgr.save(0, small_state(0.0))
        assert mgr.save_async(10, small_state(10.0))  # close() waits for it
    mgr.close()
    mgr.close()
    assert mgr.all_steps() == [0, 10]
    for call in (
        lambda: mgr.save(20, small_state(20.0)),
        lambda: mgr.save(30, small_state(30.0), force=True),
        lambda: mgr.save_async(20, small_state(20.0)),
        lambda: mgr.restore(0, small_state(0.0)),
    ):
        with pytest.raises(CheckpointError, match="closed"):
            call()
    assert sorted(p.name for p in ckpt_dir.iterdir() if p.name != "owner.json") == [
        "step_000000000000",
        "step_000000000010",
    ]

    second = manager(ckpt_dir, save_interval=10)
    assert second.all_steps() == [0, 10]
    second.close()
    with pytest.raises(CheckpointError):
        second.save(40, small_state(40.0))


# -- fsspec URLs -----------------------------------------------------------------------------------
def test_memory_url_end_to_end(memory_url: str) -> None:
    fs = fsspec.filesystem("memory")
    root = memory_url.removeprefix("memory://")
    with manager(memory_url, save_interval=10, max_to_keep=2) as mgr:
        assert mgr.save(0, build_state(0), metrics={"loss": 1.0})
        state = build_state(1)
        assert mgr.save_async(10, state)
        mutate_in_place(state)  # the checkpoint holds the values of the call
        assert not mgr.save(15, build_state(2))
        assert mgr.save(20, build_state(2))
        mgr.join()
        assert mgr.all_steps() == [10, 20]
    assert not fs.exists(f"{root}/step_000000000000")
    names = sorted(p.rstrip("/").split("/")[-1] for p in fs.ls(root, detail=False))
    assert names == ["step_000000000010", "step_000000000020"]
    for name in names:
        assert fs.exists(f"{root}/{name}/commit.json")
    with manager(memory_url, save_interval=10) as mgr:
        assert mgr.all_steps() == [10, 20]
        restore_and_check(mgr, 10, build_state(1))
        restore_and_check(mgr, 20, build_state(2))


def test_a_namedtuple_holding_tensors_keeps_its_type(ckpt_dir: Path) -> None:
    """A namedtuple with a tensor in it is replaced on restore by one of the destination's own
    namedtuple type (it came back as a plain tuple, without its fields); plain tuples stay
    plain tuples."""
    import collections

    stats_type = collections.namedtuple("stats_type", "mean count")
    saved = {"stats": stats_type(torch.arange(3.0), 5), "pair": (torch.ones(2), 1)}
    target = {"stats": stats_type(torch.zeros(3), 0), "pair": (torch.zeros(2), 0)}
    with CheckpointManager(ckpt_dir, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, saved)
        mgr.restore(1, target)
    assert type(target["stats"]) is stats_type
    assert target["stats"].count == 5 and torch.equal(target["stats"].mean, torch.arange(3.0))
    assert type(target["pair"]) is tuple and target["pair"][1] == 1


def test_ints_too_long_for_json_decimals_round_trip(ckpt_dir: Path) -> None:
    """An int of more than 4,300 digits (Python refuses its decimal text) round-trips, by
    save_async too: it passed the snapshot and failed the background write."""
    huge, negative = 10**5000 + 7, -(2**20000) + 1
    with CheckpointManager(ckpt_dir, 1, chkpt_on_preemption=False) as mgr:
        assert mgr.save_async(1, {"n": huge, "m": [negative, 3]})
        mgr.join()
        target: dict[str, Any] = {"n": 0, "m": [0, 0]}
        mgr.restore(1, target)
    assert target == {"n": huge, "m": [negative, 3]}


@pytest.mark.parametrize("where", ["packed", "packed-other-dtype", "alone", "module"])
def test_a_restore_into_a_meta_tensor_raises_naming_it(ckpt_dir: Path, where: str) -> None:
    """A tensor on the meta device holds no data: a restore into one (a model built on 'meta'
    and not given memory yet) did nothing and returned as if it had filled it. It raises,
    naming the tensor, before anything is filled."""
    saved = {
        "small": torch.arange(6.0),
        "other": torch.ones(3),
        "big": torch.arange(2.0**15),  # 128 KiB: stored on its own, not packed
        "model": nn.Linear(3, 2),
    }
    with CheckpointManager(ckpt_dir, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, saved)
        target: dict[str, Any] = {"other": torch.zeros(3)}
        with torch.device("meta"):
            if where == "packed":
                target["small"], name = torch.empty(6), "small"
            elif where == "packed-other-dtype":
                target["small"], name = torch.empty(6, dtype=torch.float16), "small"
            elif where == "alone":
                target["big"], name = torch.empty(2**15), "big"
            else:
                target["model"], name = nn.Linear(3, 2), "model/weight"
        with pytest.raises(
            CheckpointError, match=f"cannot restore into '{name}': it is on the meta"
        ):
            mgr.restore(1, target)
        assert torch.equal(target["other"], torch.zeros(3))  # nothing filled
        if where == "module":
            target["model"].to_empty(device="cpu")
            mgr.restore(1, target)
            assert torch.equal(target["model"].weight, saved["model"].weight)


@pytest.mark.parametrize("failing", ["nothing", "load", "load and wait"])
def test_restore_waits_for_the_devices_before_writing_and_after_the_load(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    failing: str,
) -> None:
    """The order of restore's device waits (what they do is CUDA's: tests/test_cuda.py): one
    while planning, for every destination, before anything is read; one after DCP's load, for
    what it loaded (its reader threads copy on streams of their own), also when the load fails,
    so that none of its copies lands after restore has raised. When that wait fails too, the
    load's error is the one raised (an OSError injected here: as a CheckpointError, the OSError
    its cause), and the wait's is logged."""
    import ckptmgr.step_restore as step_restore

    events: list[tuple[str, int]] = []
    real_load = step_restore.load_step

    def noting_wait(tensors: Any) -> None:
        events.append(("wait", len(list(tensors))))
        if failing == "load and wait" and len(events) > 1:
            raise RuntimeError("injected: CUDA error")

    def noting_load(step: int, tensors: dict[str, torch.Tensor], *args: Any) -> None:
        events.append(("load", len(tensors)))
        if failing != "nothing":
            raise OSError("injected: the read failed")
        real_load(step, tensors, *args)

    monkeypatch.setattr(step_restore, "wait_for_devices", noting_wait)
    monkeypatch.setattr(step_restore, "load_step", noting_load)
    state = {f"small/{i}": torch.rand(8) for i in range(10)} | {"big": torch.rand(100_000)}
    with manager(tmp_path, save_interval=1) as mgr:
        assert mgr.save(1, state)
        target = {key: torch.zeros_like(value) for key, value in state.items()}
        if failing == "nothing":
            mgr.restore(1, target)
            assert all(torch.equal(target[key], value) for key, value in state.items())
        else:
            with caplog.at_level(logging.WARNING, logger="ckptmgr"):
                with pytest.raises(CheckpointError, match="injected: the read failed") as raised:
                    mgr.restore(1, target)  # (a storage error, as a CheckpointError)
                assert isinstance(raised.value.__cause__, OSError)
            logged = "waiting for the devices failed too" in caplog.text
            assert logged == (failing == "load and wait")
    # 11 destinations; DCP loads "big" and the pack of the 10 small ones
    assert events == [("wait", 11), ("load", 2), ("wait", 2)]


def test_more_writer_threads_than_tensors_write_one_data_file_per_tensor(tmp_path: Path) -> None:
    # num_of_threads is an upper bound: a save of three tensors writes three data files (three
    # threads), whatever the setting; before, the tensors were spread over num_of_threads
    # lists made up front, and num_of_threads=10**9 got the process killed for its memory.
    generator = torch.Generator().manual_seed(11)
    state = {f"t{i}": torch.randn(100_000, generator=generator) for i in range(3)}
    with CheckpointManager(tmp_path, 1, num_of_threads=10**9, chkpt_on_preemption=False) as manager:
        assert manager.save(1, state)
        assert manager.save_async(2, state)
        manager.join()
        for step in (1, 2):
            restored = {name: torch.zeros(100_000) for name in state}
            manager.restore(step, restored)
            assert all(torch.equal(restored[name], state[name]) for name in state)
            data_files = list((tmp_path / f"step_{step:012d}").glob("*.distcp"))
            assert len(data_files) == 3


def test_the_spread_of_tensors_over_writer_threads_makes_no_list_per_idle_thread() -> None:
    import tracemalloc

    from torch.distributed.checkpoint.default_planner import create_default_local_save_plan

    from ckptmgr import dcp_io

    generator = torch.Generator().manual_seed(12)
    state = {f"t{i}": torch.randn(1000, generator=generator) for i in range(4)}
    items = create_default_local_save_plan(state, is_coordinator=True).items
    tracemalloc.start()
    try:
        buckets = dcp_io._balanced(10**6, items)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sorted(len(bucket) for bucket in buckets) == [1, 1, 1, 1]
    assert peak < 1_000_000  # a million empty lists and their loads took about 70 MB


INTERRUPTED_RESTORE = r"""
import signal, sys, traceback

import torch

from ckptmgr import CheckpointManager, dcp_io

state = {"w": torch.arange(10_000, dtype=torch.float32)}
real_read_data = dcp_io._RawTensorReader.read_data
interrupt = [True]


def read_data(self, *args, **kwargs):
    if interrupt:
        interrupt.pop()
        signal.raise_signal(signal.SIGINT)  # Ctrl-C, while DCP reads the tensors
    return real_read_data(self, *args, **kwargs)


dcp_io._RawTensorReader.read_data = read_data
with CheckpointManager(sys.argv[1], 1, chkpt_on_preemption=False) as manager:
    manager.save(1, state)
    target = {"w": torch.zeros(10_000)}
    try:
        manager.restore(1, target)
    except BaseException as exc:
        print(type(exc).__name__)
        shown = "".join(traceback.format_exception(exc))
        print("CheckpointException" in shown or "During handling" in shown)
    manager.restore(1, target)
    print(torch.equal(target["w"], state["w"]))
"""


def test_ctrl_c_during_a_restore_is_a_keyboard_interrupt(tmp_path: Path) -> None:
    # DCP wraps the KeyboardInterrupt of its read in its CheckpointException: the restore
    # raised CheckpointError("restore of step 1 failed: KeyboardInterrupt"), which a script
    # that starts afresh when a restore fails would have taken for a failed restore. Then its
    # traceback showed DCP's exception around it (each frame twice: about 100 lines).
    result = run_python(INTERRUPTED_RESTORE, str(tmp_path / "ckpts"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["KeyboardInterrupt", "False", "True"], result.stdout


@pytest.mark.parametrize("container", ["list", "dict"])
def test_a_container_that_holds_itself_is_refused_clearly(tmp_path: Path, container: str) -> None:
    # The walk of the state ended in Python's RecursionError, out of save and save_async.
    looped: Any = [] if container == "list" else {}
    if isinstance(looped, list):
        looped.append(looped)
    else:
        looped["again"] = looped
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as manager:
        for save in (manager.save, manager.save_async):
            with pytest.raises(CheckpointError, match="holds itself"):
                save(1, {"w": torch.ones(2), "looped": looped})
        assert manager.save(2, {"w": torch.ones(2)})
        assert manager.all_steps() == [2]


def test_a_restore_into_a_lazy_module_not_run_yet_is_refused_clearly(tmp_path: Path) -> None:
    # Its parameters are uninitialized: torch's RuntimeError ("Can't access the shape of an
    # uninitialized parameter") came out of restore, where a CheckpointError is promised.
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(3), nn.Tanh(), nn.Linear(3, 1))
    model(torch.ones(2, 4))
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as manager:
        assert manager.save(1, {"model": model})
        fresh = nn.Sequential(nn.LazyLinear(3), nn.Tanh(), nn.Linear(3, 1))
        with pytest.raises(CheckpointError, match=r"'model/0\.weight'.*run one forward pass"):
            manager.restore(1, {"model": fresh})
        fresh(torch.zeros(2, 4))  # as the message says
        manager.restore(1, {"model": fresh})
    assert all(
        torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters(), strict=True)
    )
