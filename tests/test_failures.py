"""Failures: background and synchronous write errors, bad input, leftovers, backpressure.

Write failures are injected with a real fsspec file system (a subclass of fsspec's in-memory file
system, registered under the protocol ``flaky://``) that raises or blocks on purpose on chosen
paths. Everything else (the manager, DCP, the staging pool, the local disk) is real.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import select
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import pytest
import torch
from _dist_worker import FlakyLocalFileSystem
from conftest import in_forked_child
from fsspec.implementations.memory import MemoryFileSystem

from ckptmgr import (
    CheckpointError,
    CheckpointManager,
    CorruptCheckpointError,
    StepNotFoundError,
)
from ckptmgr.record import CommitRecord, utc_now
from ckptmgr.retry import RetryConfig
from ckptmgr.staging import StagingBuffers
from ckptmgr.storage import CheckpointStorage

# Upper bound of every wait on another thread in this file: generous, never reached when healthy.
BOUND_S = 60.0
PROTOCOL = "flaky"


@dataclass
class Faults:
    """What the flaky file system does on writes; set by each test."""

    fail_suffixes: tuple[str, ...] = ()
    block_suffixes: tuple[str, ...] = ()
    blocked: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    raised: list[OSError] = field(default_factory=list)
    fail_read_suffixes: tuple[str, ...] = ()  # reads (cat_file) that fail once each
    read_errno: int = errno.ECONNRESET  # (transient: retried; EIO is not)
    cut_short_suffixes: tuple[str, ...] = ()  # writes that fail once each, leaving an empty file
    cut_short_errno: int = errno.EIO
    fail_remove_suffixes: tuple[str, ...] = ()  # removals (rm_file) that fail once each

    def before_remove(self, path: str) -> None:
        """Fail the first removal of each path ending in one of ``fail_remove_suffixes``."""
        error = self._once("fail_remove_suffixes", path, errno.EIO, "removal failure for")
        if error is not None:
            raise error

    def cut_short(self, path: str) -> OSError | None:
        """The error for a write of ``path`` that fails midway (its file created, nothing in
        it), once per suffix of ``cut_short_suffixes``; None for other writes."""
        what = "failure midway through writing"
        return self._once("cut_short_suffixes", path, self.cut_short_errno, what)

    def before_read(self, path: str) -> None:
        """Fail the first read of each path ending in one of ``fail_read_suffixes``."""
        error = self._once("fail_read_suffixes", path, self.read_errno, "read failure for")
        if error is not None:
            raise error

    def _once(self, suffixes: str, path: str, number: int, what: str) -> OSError | None:
        """The injected error for ``path`` if it ends in one of the suffixes in the field named
        ``suffixes``, which then loses that suffix (each fails once); None otherwise."""
        pending: tuple[str, ...] = getattr(self, suffixes)
        suffix = next((s for s in pending if path.endswith(s)), None)
        if suffix is None:
            return None
        setattr(self, suffixes, tuple(s for s in pending if s != suffix))
        error = OSError(number, f"injected {what} {path}")
        self.raised.append(error)
        return error

    def before_write(self, path: str) -> None:
        """Block or fail the write of ``path`` as configured (called before anything is stored)."""
        if path.endswith(self.block_suffixes):
            self.blocked.set()
            if not self.release.wait(BOUND_S):
                raise OSError(errno.ETIMEDOUT, f"test never released the write of {path}")
        if path.endswith(self.fail_suffixes):
            error = OSError(errno.EIO, f"injected write failure for {path}")
            self.raised.append(error)
            raise error


class FlakyFileSystem(MemoryFileSystem):
    """fsspec's in-memory file system with its own store and injectable write faults.

    The faults are class-level because fsspec caches one instance per thread, and DCP writes
    from its own threads.
    """

    protocol = (PROTOCOL,)
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]
    faults: ClassVar[Faults] = Faults()

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str):
            path = path.removeprefix(f"{PROTOCOL}://")
        return super()._strip_protocol(path)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if any(flag in mode for flag in "wxa+"):
            self.faults.before_write(self._strip_protocol(path))
            error = self.faults.cut_short(self._strip_protocol(path))
            if error is not None:
                super()._open(path, mode).close()  # the file exists, empty, as the write began
                raise error
        return super()._open(path, mode, **kwargs)

    def cat_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self.faults.before_read(self._strip_protocol(path))
        return super().cat_file(path, *args, **kwargs)

    def rm_file(self, path: str) -> None:
        self.faults.before_remove(self._strip_protocol(path))
        super().rm_file(path)


@pytest.fixture
def flaky() -> Iterator[type[FlakyFileSystem]]:
    """The flaky file system, empty, without faults, registered as ``flaky://``."""
    FlakyFileSystem.store.clear()
    FlakyFileSystem.pseudo_dirs[:] = [""]
    FlakyFileSystem.faults = Faults()
    FlakyFileSystem.clear_instance_cache()
    fsspec.register_implementation(PROTOCOL, FlakyFileSystem, clobber=True)
    yield FlakyFileSystem
    FlakyFileSystem.faults.release.set()  # never leave a writer thread blocked
    FlakyFileSystem.store.clear()
    FlakyFileSystem.pseudo_dirs[:] = [""]
    FlakyFileSystem.clear_instance_cache()


def make_state(seed: int) -> dict[str, Any]:
    """A small state with several dtypes and plain values."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(8, 4, generator=gen),
            "half": torch.randn(5, generator=gen).to(torch.bfloat16),
            "ids": torch.randint(0, 1000, (6,), generator=gen, dtype=torch.int64),
            "mask": torch.rand(3, generator=gen) > 0.5,
            "scalar": torch.tensor(float(seed)),
        },
        "epoch": seed,
        "name": f"run-{seed}",
    }


def empty_like_state(state: dict[str, Any]) -> dict[str, Any]:
    """A state with the same structure and different values, to restore into."""
    model = {key: torch.zeros_like(value) for key, value in state["model"].items()}
    return {"model": model, "epoch": -1, "name": ""}


def assert_same_state(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Bit-exact equality of tensors (dtype included) and equality of plain values."""
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, dict):
            assert_same_state(actual[key], value)
        elif isinstance(value, torch.Tensor):
            assert actual[key].dtype == value.dtype, key
            assert torch.equal(actual[key], value), key
        else:
            assert actual[key] == value, key


def cause_chain(error: BaseException) -> list[BaseException]:
    """``error`` and its ``__cause__``s, outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__
    return chain


def files_of_step(fs: type[FlakyFileSystem], step: int) -> list[str]:
    """Paths stored in the flaky file system under the directory of ``step``."""
    return sorted(path for path in fs.store if f"/step_{step:012d}/" in path)


def flaky_manager(url: str, **kwargs: Any) -> CheckpointManager:
    return CheckpointManager(url, save_interval=1, chkpt_on_preemption=False, **kwargs)


# -- background (async) write failures ---------------------------------------------------------


def test_background_failure_raises_from_join_with_the_original_cause(
    flaky: type[FlakyFileSystem],
) -> None:
    mgr = flaky_manager(f"{PROTOCOL}://bg-cause")
    flaky.faults.fail_suffixes = (".distcp",)
    try:
        assert mgr.save_async(3, make_state(3)) is True
        with pytest.raises(CheckpointError) as caught:
            mgr.join()
        assert len(flaky.faults.raised) == 1, "the injected fault was never hit"
        original = flaky.faults.raised[0]
        chain = cause_chain(caught.value)
        assert any(link is original for link in chain), (
            f"the injected OSError is not in the __cause__ chain: {[repr(c) for c in chain]}"
        )
        assert "injected write failure" in str(caught.value), (
            f"the error message does not say what failed: {caught.value}"
        )
    finally:
        flaky.faults.fail_suffixes = ()
        mgr.join()  # the failure was reported above (or the test already failed)
        mgr.close()


def test_background_failure_commits_nothing_and_is_raised_once(
    flaky: type[FlakyFileSystem],
) -> None:
    url = f"{PROTOCOL}://bg-nothing"
    mgr = flaky_manager(url)
    assert mgr.save(1, make_state(1)) is True
    flaky.faults.fail_suffixes = (".distcp",)
    assert mgr.save_async(2, make_state(2)) is True
    with pytest.raises(CheckpointError):
        mgr.join()
    assert flaky.faults.raised, "the injected fault was never hit"
    assert mgr.all_steps() == [1]
    assert mgr.latest_step() == 1
    assert not [p for p in files_of_step(flaky, 2) if p.endswith("commit.json")]
    mgr.join()  # raised once: the second join has nothing to report
    flaky.faults.fail_suffixes = ()
    with flaky_manager(url) as fresh:
        assert fresh.all_steps() == [1]
        with pytest.raises(StepNotFoundError):
            fresh.restore(2, empty_like_state(make_state(2)))
    mgr.close()


def test_unjoined_background_failure_is_raised_by_the_next_save_async(
    flaky: type[FlakyFileSystem],
) -> None:
    mgr = flaky_manager(f"{PROTOCOL}://bg-next-async")
    flaky.faults.fail_suffixes = (".distcp",)
    assert mgr.save_async(1, make_state(1)) is True
    # restore() waits for pending writes without reporting their errors: a public barrier.
    with pytest.raises(StepNotFoundError):
        mgr.restore(1, empty_like_state(make_state(1)))
    flaky.faults.fail_suffixes = ()
    with pytest.raises(CheckpointError) as caught:
        mgr.save_async(2, make_state(2))
    assert isinstance(caught.value.__cause__, BaseException)
    assert "step 1" in str(caught.value)
    # Reported once: the same call now goes through and commits.
    assert mgr.save_async(2, make_state(2)) is True
    mgr.join()
    assert mgr.all_steps() == [2]
    mgr.close()


def test_unjoined_background_failure_is_raised_by_the_next_sync_save(
    flaky: type[FlakyFileSystem],
) -> None:
    mgr = flaky_manager(f"{PROTOCOL}://bg-next-sync")
    flaky.faults.fail_suffixes = (".distcp",)
    assert mgr.save_async(1, make_state(1)) is True
    with pytest.raises(StepNotFoundError):
        mgr.restore(1, empty_like_state(make_state(1)))
    flaky.faults.fail_suffixes = ()
    with pytest.raises(CheckpointError):
        mgr.save(2, make_state(2))
    assert mgr.all_steps() == []
    assert mgr.save(2, make_state(2)) is True
    assert mgr.all_steps() == [2]
    mgr.close()


def test_unjoined_background_failure_is_raised_by_close(flaky: type[FlakyFileSystem]) -> None:
    mgr = flaky_manager(f"{PROTOCOL}://bg-close")
    flaky.faults.fail_suffixes = (".distcp",)
    assert mgr.save_async(1, make_state(1)) is True
    with pytest.raises(CheckpointError) as caught:
        mgr.close()
    assert caught.value.__cause__ is not None
    assert mgr.all_steps() == []
    mgr.close()  # idempotent, and the error was reported once


# -- synchronous write failures ----------------------------------------------------------------


def test_failed_sync_save_raises_and_never_damages_committed_steps(
    flaky: type[FlakyFileSystem],
) -> None:
    url = f"{PROTOCOL}://sync"
    first = make_state(1)
    mgr = flaky_manager(url)
    assert mgr.save(1, first) is True
    committed_bytes = {p: bytes(flaky.store[p].getbuffer()) for p in files_of_step(flaky, 1)}
    assert any(p.endswith("commit.json") for p in committed_bytes)

    flaky.faults.fail_suffixes = (".distcp",)
    with pytest.raises(CheckpointError):
        mgr.save(2, make_state(2))
    assert flaky.faults.raised, "the injected fault was never hit"
    flaky.faults.fail_suffixes = ()
    assert mgr.all_steps() == [1]
    assert not [p for p in files_of_step(flaky, 2) if p.endswith("commit.json")]
    assert {p: bytes(flaky.store[p].getbuffer()) for p in files_of_step(flaky, 1)} == (
        committed_bytes
    )
    mgr.join()  # a synchronous failure was raised directly; nothing is left to report

    target = empty_like_state(first)
    mgr.restore(1, target)
    assert_same_state(target, first)
    with flaky_manager(url) as fresh:
        assert fresh.all_steps() == [1]
        target = empty_like_state(first)
        fresh.restore(1, target)
        assert_same_state(target, first)

    # The failed attempt does not block a retry of the same step.
    second = make_state(2)
    assert mgr.save(2, second) is True
    target = empty_like_state(second)
    mgr.restore(2, target)
    assert_same_state(target, second)
    mgr.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_failed_commit_record_write_lists_nothing(flaky: type[FlakyFileSystem], mode: str) -> None:
    url = f"{PROTOCOL}://commit-{mode}"
    mgr = flaky_manager(url)
    flaky.faults.fail_suffixes = ("commit.json",)
    with pytest.raises(CheckpointError):
        if mode == "sync":
            mgr.save(4, make_state(4))
        else:
            assert mgr.save_async(4, make_state(4)) is True
            mgr.join()
    assert flaky.faults.raised, "the injected fault was never hit"
    flaky.faults.fail_suffixes = ()
    assert mgr.all_steps() == []
    assert not [p for p in flaky.store if "commit" in p.rsplit("/", 1)[-1]]
    with flaky_manager(url) as fresh:
        assert fresh.all_steps() == []
    assert mgr.save(4, make_state(4)) is True
    assert mgr.all_steps() == [4]
    mgr.close()


@pytest.mark.parametrize(
    ("error", "then"),
    [
        (errno.EIO, ""),
        (errno.EIO, "unreadable"),
        (errno.EIO, "unremovable"),
        (errno.ECONNRESET, ""),
    ],
)
def test_a_commit_record_write_failing_midway_leaves_no_partial_record(
    flaky: type[FlakyFileSystem], error: int, then: str
) -> None:
    """A file system whose writes are not atomic (no object store) may keep the part of a
    record written before its write failed. An empty ``commit.json`` was left listed: the
    failed save's step looked committed and was damaged. A retried try (a reset connection)
    then found the file there and took the step for another writer's (``AlreadyCommittedError``).
    What the failed write left is removed, even if it cannot be read back (the write was
    create-only: nothing was there before it), and if its removal fails, by the removal of the
    save's directory that follows: nothing is listed after an EIO, and the retry commits."""
    url = f"{PROTOCOL}://cut-short-{error}-{then}"
    mgr = flaky_manager(url)
    flaky.faults.cut_short_suffixes = ("commit.json",)
    flaky.faults.cut_short_errno = error
    if then == "unreadable":  # its first read back fails (with an error that is not retried)
        flaky.faults.fail_read_suffixes = ("commit.json",)
        flaky.faults.read_errno = errno.EIO
    if then == "unremovable":  # its first removal fails
        flaky.faults.fail_remove_suffixes = ("commit.json",)
    try:
        if error == errno.EIO:
            with pytest.raises(CheckpointError, match="injected failure midway"):
                mgr.save(4, make_state(4))
            assert mgr.all_steps() == []
            assert not [p for p in flaky.store if p.endswith("commit.json")]
            with flaky_manager(url) as fresh:
                assert fresh.all_steps() == []
        else:
            assert mgr.save(4, make_state(4)) is True
        assert len(flaky.faults.raised) == (2 if then else 1)
        if error == errno.EIO:
            assert mgr.save(4, make_state(4)) is True
        assert mgr.all_steps() == [4]
        restored = empty_like_state(make_state(4))
        mgr.restore(4, restored)
        assert_same_state(restored, make_state(4))
    finally:
        mgr.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_failed_commit_record_write_keeps_the_original_cause(
    flaky: type[FlakyFileSystem], mode: str
) -> None:
    mgr = flaky_manager(f"{PROTOCOL}://commit-cause-{mode}")
    flaky.faults.fail_suffixes = ("commit.json",)
    try:
        with pytest.raises(CheckpointError) as caught:
            if mode == "sync":
                mgr.save(4, make_state(4))
            else:
                assert mgr.save_async(4, make_state(4)) is True
                mgr.join()
        assert len(flaky.faults.raised) == 1
        chain = cause_chain(caught.value)
        assert any(link is flaky.faults.raised[0] for link in chain), (
            f"the injected OSError is not in the __cause__ chain: {[repr(c) for c in chain]}"
        )
    finally:
        flaky.faults.fail_suffixes = ()
        mgr.close()


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [-1, -100, 1.5, 2.0, "3", None, True, False])
def test_bad_step_raises_value_error(ckpt_dir: Path, step: Any) -> None:
    state = make_state(0)
    with CheckpointManager(ckpt_dir, save_interval=1, chkpt_on_preemption=False) as mgr:
        with pytest.raises(ValueError, match="step"):
            mgr.save(step, state)
        with pytest.raises(ValueError, match="step"):
            mgr.save(step, state, force=True)
        with pytest.raises(ValueError, match="step"):
            mgr.save_async(step, state)
        with pytest.raises(ValueError, match="step"):
            mgr.should_save(step)
        assert mgr.save(0, state) is True
        with pytest.raises(ValueError, match="step"):
            mgr.restore(step, empty_like_state(state))
        with pytest.raises(ValueError, match="step"):
            mgr.verify(step)
        assert mgr.all_steps() == [0]


@pytest.mark.parametrize("force", ["yes", "no", 1, 0.0, None])
def test_a_force_that_is_not_a_bool_is_refused(ckpt_dir: Path, force: Any) -> None:
    """force="no" (or 0.0) saved like force=True would not: every value but True and False
    raises ValueError, and nothing is saved. verify's deep alike."""
    with CheckpointManager(ckpt_dir, save_interval=10, chkpt_on_preemption=False) as mgr:
        for call in (mgr.save, mgr.save_async):
            with pytest.raises(ValueError, match="force must be True or False"):
                call(1, make_state(1), force=force)
        mgr.join()
        assert mgr.all_steps() == []
        assert mgr.save(1, make_state(1), force=torch.tensor(True))  # a 0-d bool is one
        assert mgr.all_steps() == [1]
        with pytest.raises(ValueError, match="deep must be True or False"):
            mgr.verify(1, deep=force)  # (deep="no" read the files all the same)


class _TensorStateful:
    """An object whose state_dict() returns a tensor, not a dict."""

    def state_dict(self) -> torch.Tensor:
        return torch.ones(2)

    def load_state_dict(self, state: Any) -> None:
        raise AssertionError("not called")


def test_an_object_whose_state_dict_is_a_tensor_is_refused_saying_so(ckpt_dir: Path) -> None:
    """The error said the value at 'o' was "of type Tensor" and that tensors can be saved;
    it says what the object's state_dict() returned."""
    with CheckpointManager(ckpt_dir, save_interval=1, chkpt_on_preemption=False) as mgr:
        with pytest.raises(CheckpointError, match=r"'o': its state_dict\(\) \(_TensorStateful\) "):
            mgr.save(1, {"o": _TensorStateful(), "w": torch.ones(2)})
        assert mgr.all_steps() == []


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"save_interval": 0}, "save_interval"),
        ({"save_interval": -5}, "save_interval"),
        ({"save_interval": 1, "max_to_keep": -1}, "max_to_keep"),
        ({"save_interval": 1, "max_pending_async": 0}, "max_pending_async"),
    ],
)
def test_bad_settings_raise_value_error_naming_the_argument(
    ckpt_dir: Path, kwargs: dict[str, Any], name: str
) -> None:
    with pytest.raises(ValueError, match=name):
        CheckpointManager(ckpt_dir, chkpt_on_preemption=False, **kwargs)


class Opaque:
    """A custom object without state_dict(): not checkpointable."""


def unsaveable_values() -> list[tuple[str, Any]]:
    return [("lambda", lambda x: x), ("custom_object", Opaque()), ("a_set", {1, 2})]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize(("label", "value"), unsaveable_values())
def test_unsaveable_object_fails_at_save_naming_the_key_path(
    ckpt_dir: Path, mode: str, label: str, value: Any
) -> None:
    state = make_state(5)
    state["extras"] = {"weights": torch.ones(2), f"bad_{label}": value}
    with CheckpointManager(ckpt_dir, save_interval=1, chkpt_on_preemption=False) as mgr:
        save = mgr.save if mode == "sync" else mgr.save_async
        with pytest.raises(CheckpointError) as caught:
            save(5, state)
        assert f"bad_{label}" in str(caught.value)
        assert "extras" in str(caught.value)
        mgr.join()
        assert mgr.all_steps() == []
        assert os.listdir(ckpt_dir) in ([], ["owner.json"])
        # The manager stays usable and the step is free for a good state.
        del state["extras"][f"bad_{label}"]
        assert save(5, state) is True
        mgr.join()
        assert mgr.all_steps() == [5]


def test_unsaveable_object_inside_a_list_is_named(ckpt_dir: Path) -> None:
    state = {"w": torch.ones(2), "history": [1, 2, Opaque()]}
    with CheckpointManager(ckpt_dir, save_interval=1, chkpt_on_preemption=False) as mgr:
        with pytest.raises(CheckpointError, match="history"):
            mgr.save(0, state)
        assert mgr.all_steps() == []
        assert os.listdir(ckpt_dir) in ([], ["owner.json"])


def test_restore_of_unknown_step_lists_available_steps(ckpt_dir: Path) -> None:
    state = make_state(0)
    with CheckpointManager(ckpt_dir, save_interval=10, chkpt_on_preemption=False) as mgr:
        with pytest.raises(StepNotFoundError):
            mgr.restore(0, empty_like_state(state))
        assert mgr.save(0, state) is True
        assert mgr.save(10, state) is True
        with pytest.raises(StepNotFoundError) as caught:
            mgr.restore(5, empty_like_state(state))
    error = caught.value
    assert isinstance(error, CheckpointError)
    assert isinstance(error, LookupError)
    message = str(error)
    assert {"0", "5", "10"} <= set(re.findall(r"\d+", message)), message


def test_restore_with_keys_missing_from_the_checkpoint_names_them(ckpt_dir: Path) -> None:
    state = make_state(2)
    with CheckpointManager(ckpt_dir, save_interval=1, chkpt_on_preemption=False) as mgr:
        assert mgr.save(2, state) is True
        nested = empty_like_state(state)
        nested["model"]["missing_bias"] = torch.zeros(3)
        with pytest.raises(CheckpointError, match="missing_bias"):
            mgr.restore(2, nested)
        top_tensor = empty_like_state(state)
        top_tensor["ema_weights"] = torch.zeros(3)
        with pytest.raises(CheckpointError, match="ema_weights"):
            mgr.restore(2, top_tensor)
        top_plain = empty_like_state(state)
        top_plain["epoch_counter"] = 7
        with pytest.raises(CheckpointError, match="epoch_counter"):
            mgr.restore(2, top_plain)
        # A subset of the saved keys restores fine.
        subset = {"model": {"w": torch.zeros(8, 4)}}
        mgr.restore(2, subset)
        assert torch.equal(subset["model"]["w"], state["model"]["w"])


@pytest.mark.parametrize("bad_state", [[torch.ones(2)], None, "weights", (torch.ones(2),)])
def test_state_dict_that_is_not_a_dict_is_rejected(ckpt_dir: Path, bad_state: Any) -> None:
    errors = (CheckpointError, TypeError, ValueError)
    with CheckpointManager(ckpt_dir, save_interval=1, chkpt_on_preemption=False) as mgr:
        with pytest.raises(errors):
            mgr.save(1, bad_state)
        with pytest.raises(errors):
            mgr.save_async(2, bad_state)
        mgr.join()
        assert mgr.all_steps() == []
        assert mgr.save(3, {"w": torch.ones(2)}) is True
        with pytest.raises(errors):
            mgr.restore(3, bad_state)


@pytest.mark.parametrize(
    "metadata", [{1: "x"}, {"a": {2: "y"}}, {"a": [{None: 1}]}, {"f": float("nan")}]
)
def test_metadata_that_is_not_plain_json_is_rejected(ckpt_dir: Path, metadata: Any) -> None:
    with CheckpointManager(ckpt_dir, save_interval=1, chkpt_on_preemption=False) as mgr:
        with pytest.raises(ValueError, match="metadata"):
            mgr.save(1, {"w": torch.ones(2)}, metadata=metadata)
        assert mgr.all_steps() == []


@pytest.mark.parametrize("damage", ["missing", "not-json"])
def test_damaged_plain_values_file_fails_restore_with_checkpoint_error(
    ckpt_dir: Path, damage: str
) -> None:
    with CheckpointManager(ckpt_dir, save_interval=1, chkpt_on_preemption=False) as mgr:
        assert mgr.save(1, {"w": torch.ones(2), "n": 3}) is True
        objects_file = ckpt_dir / "step_000000000001" / "objects-rank00000.json"
        if damage == "missing":
            objects_file.unlink()
        else:
            objects_file.write_text("{not json")
        target = {"w": torch.zeros(2), "n": 0}
        with pytest.raises(CheckpointError, match=r"objects-rank00000\.json"):
            mgr.restore(1, target)
        assert target["n"] == 0


def test_a_written_file_that_storage_no_longer_holds_fails_the_commit(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A data file its writer wrote but that the listing before the commit does not show (lost,
    or deleted by someone else) fails the save: the step used to commit without it in the
    record, and restore then failed on it. Fault injection: the listing leaves it out (a local
    save lists its write directory in the DCP writer's finish, once every file is written)."""
    import ckptmgr.dcp_io
    import ckptmgr.storage

    original = ckptmgr.storage.local_file_sizes

    def losing_the_data_file(path: str) -> dict[str, int]:
        return {name: size for name, size in original(path).items() if ".distcp" not in name}

    with CheckpointManager(ckpt_dir, save_interval=1, chkpt_on_preemption=False) as mgr:
        monkeypatch.setattr(ckptmgr.dcp_io, "local_file_sizes", losing_the_data_file)
        monkeypatch.setattr(ckptmgr.storage, "local_file_sizes", losing_the_data_file)
        with pytest.raises(CheckpointError, match=r"__0_0\.distcp was written but storage"):
            mgr.save(1, make_state(1))
        monkeypatch.undo()
        assert mgr.all_steps() == []
        assert mgr.save(2, make_state(2)) is True
        assert mgr.all_steps() == [2]


class ListingFailingFileSystem(FlakyLocalFileSystem):
    """The local disk behind a non-local protocol, listed by fsspec's own ``find`` (a walk, one
    ``ls`` per directory); ``ls`` of a directory named in ``failing`` raises its errors first,
    one per call."""

    protocol = "ckptmgr-listing-fails"
    failing: ClassVar[dict[str, list[OSError]]] = {}

    def ls(self, path: Any, detail: bool = True, **kwargs: Any) -> Any:
        errors = self.failing.get(self._p(path).rstrip("/").rsplit("/", 1)[-1])
        if errors:
            raise errors.pop(0)
        return super().ls(path, detail=detail, **kwargs)


@pytest.mark.parametrize("persistent", [True, False])
def test_a_directory_that_cannot_be_listed_is_not_left_out_of_the_listing(
    tmp_path: Path, persistent: bool
) -> None:
    """fsspec's own ``find`` (every file system without one of its own: SFTP, HDFS, ...) leaves
    out a directory whose ``ls`` fails. A committed step whose directory could not be listed
    was silently missing: a manager opened then listed step 1 alone, and ``restore_latest``
    restored it instead of step 2. The error is raised now (an EIO, from the manager's
    construction), or retried (a reset connection), and the step is listed."""
    fsspec.register_implementation(
        ListingFailingFileSystem.protocol, ListingFailingFileSystem, clobber=True
    )
    url = f"{ListingFailingFileSystem.protocol}://{tmp_path / 'root'}"
    with flaky_manager(url) as mgr:
        assert mgr.save(1, make_state(1)) and mgr.save(2, make_state(2))
    if persistent:
        errors = [OSError(errno.EIO, "injected listing failure")] * 10
    else:
        errors = [ConnectionResetError(errno.ECONNRESET, "injected reset")]
    ListingFailingFileSystem.failing = {"step_000000000002": errors}
    try:
        if persistent:
            with pytest.raises(OSError, match="injected listing failure"):
                flaky_manager(url)
            return
        with flaky_manager(url) as mgr:
            assert not ListingFailingFileSystem.failing["step_000000000002"]  # it was hit
            assert mgr.all_steps() == [1, 2]
            restored = empty_like_state(make_state(2))
            assert mgr.restore_latest(restored) == 2
            assert_same_state(restored, make_state(2))
    finally:
        ListingFailingFileSystem.failing = {}


def test_a_commit_record_that_landed_though_every_try_failed_counts_as_committed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a remote store, the first write of the commit record lands but its reply is lost,
    and every retry fails: the commit reads the record back and, finding its own save id,
    succeeds. It raised, so the save was reported failed while the step was listed as
    committed. Fault injection: every create-only write raises after the first lands."""
    storage = CheckpointStorage(
        "memory://landed-commit",
        retry=RetryConfig(max_attempts=2, initial_backoff_s=0.0, max_backoff_s=0.0),
    )
    write_dir = storage.write_dir(9, "c" * 16)
    storage.prepare_write_dir(write_dir)
    storage.fs.pipe_file(f"{write_dir}/__0_0.distcp", b"data")
    real_create_only = storage._create_only
    tries: list[int] = []

    def landing_then_failing(path: str, data: bytes) -> None:
        tries.append(1)
        if len(tries) == 1:
            real_create_only(path, data)
        raise ConnectionResetError("injected: connection reset")

    monkeypatch.setattr(storage, "_create_only", landing_then_failing)
    record = CommitRecord(step=9, save_id="c" * 16, committed_at=utc_now(), world_size=1)
    storage.commit(9, write_dir, record)
    assert len(tries) == 2
    assert storage.committed_steps() == [9]
    other = CommitRecord(step=9, save_id="d" * 16, committed_at=utc_now(), world_size=1)
    monkeypatch.setattr(storage, "_create_only", landing_then_failing)
    with pytest.raises(ConnectionResetError):  # not ours: the failure stands
        storage.commit(9, write_dir, other)
    storage.fs.rm("/landed-commit", recursive=True)


def test_a_storage_error_reading_a_step_is_a_checkpoint_error_and_quarantines_nothing(
    flaky: type[FlakyFileSystem],
) -> None:
    """A read of a step's plain values that fails for good (an EIO, after its retries) raised
    the file system's own OSError from restore(), and from restore_latest(), which promise a
    CheckpointError. It is a CheckpointError now (the OSError its cause), not a
    CorruptCheckpointError: a read error says nothing of the checkpoint, which stays listed."""
    with flaky_manager(f"{PROTOCOL}://run") as manager:
        assert manager.save(1, make_state(1))
        flaky.faults.read_errno = errno.EIO
        for restore in (functools.partial(manager.restore, 1), manager.restore_latest):
            flaky.faults.fail_read_suffixes = ("objects-rank00000.json",)
            target = empty_like_state(make_state(1))
            with pytest.raises(
                CheckpointError, match=r"restore of step 1 failed: OSError"
            ) as raised:
                restore(target)
            assert not isinstance(raised.value, CorruptCheckpointError)
            assert isinstance(raised.value.__cause__, OSError)
            assert raised.value.__cause__.errno == errno.EIO
        assert len(flaky.faults.raised) == 2
        assert manager.all_steps() == [1]
        target = empty_like_state(make_state(1))
        manager.restore(1, target)
        assert_same_state(target, make_state(1))


def test_a_failed_read_of_a_data_file_names_the_error_not_dcps_tracebacks(
    flaky: type[FlakyFileSystem],
) -> None:
    """A data file's read that fails for good (an EIO) fails the restore with a
    CheckpointError whose message was DCP's CheckpointException as text: every failing rank's
    whole traceback. It names the error itself now, on one line; DCP's exception is still the
    cause."""
    with flaky_manager(f"{PROTOCOL}://run") as manager:
        assert manager.save(1, {"w": torch.rand(100_000)})  # (no pack: no read ahead of it)
        flaky.faults.read_errno = errno.EIO
        flaky.faults.fail_read_suffixes = (".distcp",)
        with pytest.raises(CheckpointError) as raised:
            manager.restore(1, {"w": torch.zeros(100_000)})
        message = str(raised.value)
        assert message.startswith("restore of step 1 failed: OSError: [Errno 5] injected read")
        assert "\n" not in message and "Traceback" not in message
        assert flaky.faults.raised
        assert type(raised.value.__cause__).__name__ == "CheckpointException"


# -- leftovers of interrupted saves ------------------------------------------------------------


def make_leftovers(root: Path, age_s: float = 0.0) -> list[Path]:
    """A temporary write directory and a step directory without commit record."""
    tmp_dir = root / ".tmp-step_000000000005-abc"
    uncommitted = root / "step_000000000007"
    for directory in (tmp_dir, uncommitted):
        directory.mkdir(parents=True)
        (directory / "__0_0.distcp").write_bytes(b"partial data")
    if age_s:
        past = time.time() - age_s
        for directory in (tmp_dir, uncommitted):
            for path in (directory / "__0_0.distcp", directory):
                os.utime(path, (past, past))
    return [tmp_dir, uncommitted]


def test_leftovers_are_removed_by_a_new_manager_after_the_grace_age(ckpt_dir: Path) -> None:
    with CheckpointManager(ckpt_dir, save_interval=1, chkpt_on_preemption=False) as mgr:
        assert mgr.save(3, make_state(3)) is True
    leftovers = make_leftovers(ckpt_dir)
    with CheckpointManager(
        ckpt_dir, save_interval=1, chkpt_on_preemption=False, leftover_grace_s=0
    ) as mgr:
        assert mgr.all_steps() == [3]
        assert [p for p in leftovers if p.exists()] == []
        assert sorted(n for n in os.listdir(ckpt_dir) if n != "owner.json") == ["step_000000000003"]
        assert mgr.save(5, make_state(5)) is True
        assert mgr.save(7, make_state(7)) is True
        assert mgr.all_steps() == [3, 5, 7]


def test_recent_leftovers_are_kept_during_the_grace_age_and_never_listed(
    ckpt_dir: Path,
) -> None:
    with CheckpointManager(ckpt_dir, save_interval=1, chkpt_on_preemption=False) as mgr:
        assert mgr.save(3, make_state(3)) is True
    leftovers = make_leftovers(ckpt_dir)
    with CheckpointManager(ckpt_dir, save_interval=1, chkpt_on_preemption=False) as mgr:
        assert [p for p in leftovers if not p.exists()] == []
        assert mgr.all_steps() == [3]
        assert mgr.latest_step() == 3
        assert mgr.should_save(7) is True
        with pytest.raises(StepNotFoundError):
            mgr.restore(7, empty_like_state(make_state(7)))
        # A new save of the uncommitted step replaces the leftover and commits.
        seventh = make_state(7)
        assert mgr.save(7, seventh) is True
        assert mgr.all_steps() == [3, 7]
        target = empty_like_state(seventh)
        mgr.restore(7, target)
        assert_same_state(target, seventh)


def test_old_leftovers_are_removed_with_the_default_grace(ckpt_dir: Path) -> None:
    leftovers = make_leftovers(ckpt_dir, age_s=3600.0)
    with CheckpointManager(ckpt_dir, save_interval=1, chkpt_on_preemption=False) as mgr:
        assert mgr.all_steps() == []
        assert [p for p in leftovers if p.exists()] == []


def test_a_leftover_gone_while_the_sweep_looks_at_it_is_skipped(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leftover that another process commits, discards or renames between the sweep's listing
    and its look at the leftover's age is skipped: it made the manager's constructor (and
    `ckptmgr ls --all`) fail with FileNotFoundError. Fault injection: the look removes it first."""
    leftovers = make_leftovers(ckpt_dir, age_s=3600.0)
    original = CheckpointStorage._is_leftover

    def vanishing(self: CheckpointStorage, name: str, full: str) -> bool:
        found = original(self, name, full)
        if found and name.startswith(".tmp-"):
            shutil.rmtree(full)  # another process's save committed or discarded it just now
        return found

    monkeypatch.setattr(CheckpointStorage, "_is_leftover", vanishing)
    assert [leftover.name for leftover in CheckpointStorage(str(ckpt_dir)).leftovers()] == [
        leftovers[1].name
    ]
    with CheckpointManager(ckpt_dir, save_interval=1, chkpt_on_preemption=False) as mgr:
        assert mgr.all_steps() == []
    assert [p for p in leftovers if p.exists()] == []


def test_the_sweep_never_removes_a_step_committed_while_it_sweeps(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An old uncommitted step_<N>/ is a leftover; if a save of step N commits (replacing that
    directory) after the sweep listed it and before it removes it, the committed step stays.
    The sweep removed it. Fault injection: the other save commits right after the listing."""
    stale = ckpt_dir / "step_000000000005"
    stale.mkdir(parents=True)
    (stale / "__0_0.distcp").write_bytes(b"partial data")
    past = time.time() - 3600
    for path in (stale / "__0_0.distcp", stale):
        os.utime(path, (past, past))
    writer = CheckpointStorage(str(ckpt_dir))
    write_dir = writer.write_dir(5, "b" * 16)
    writer.prepare_write_dir(write_dir)
    Path(write_dir, "__0_0.distcp").write_bytes(b"DATA")
    original = CheckpointStorage.leftovers

    def listing_then_a_commit(self: CheckpointStorage) -> Any:
        found = original(self)
        record = CommitRecord(step=5, save_id="b" * 16, committed_at=utc_now(), world_size=1)
        writer.commit(5, write_dir, record)
        return found

    monkeypatch.setattr(CheckpointStorage, "leftovers", listing_then_a_commit)
    assert CheckpointStorage(str(ckpt_dir)).remove_leftovers(600) == []
    assert writer.committed_steps() == [5]
    assert (stale / "__0_0.distcp").read_bytes() == b"DATA"


def test_the_remote_sweep_removes_nothing_written_since_it_listed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On an object store the sweep lists the leftover again before deleting it; files written
    since its first listing (a new save of that step has begun) are not deleted with it. They
    were: their age was never looked at. Fault injection: the first listing reports the
    leftover an hour old, and the other save replaces its file right after."""
    memory = fsspec.filesystem("memory")
    storage = CheckpointStorage("memory://remote-sweep")
    step_dir = storage.step_path(5)
    memory.pipe_file(f"{step_dir}/old.distcp", b"old")  # an interrupted delete of step 5
    original = CheckpointStorage._remote_leftovers

    def listing_then_a_new_save(self: CheckpointStorage) -> Any:
        found = [replace(leftover, age_s=3600.0) for leftover in original(self)]
        memory.rm_file(f"{step_dir}/old.distcp")  # the other save's prepare_write_dir ...
        memory.pipe_file(f"{step_dir}/__0_0.distcp", b"fresh data")  # ... and its first write
        return found

    monkeypatch.setattr(CheckpointStorage, "_remote_leftovers", listing_then_a_new_save)
    assert storage.remove_leftovers(600) == []
    assert memory.cat_file(f"{step_dir}/__0_0.distcp") == b"fresh data"
    memory.rm("/remote-sweep", recursive=True)


# -- backpressure --------------------------------------------------------------------------------


def second_save_async(
    mgr: CheckpointManager, state: dict[str, Any], flaky: type[FlakyFileSystem]
) -> tuple[threading.Thread, threading.Event, dict[str, Any]]:
    """A thread (not started) that calls ``mgr.save_async(2, state)``, then an event set when
    the call has returned, and its outcome: ``saved``, and ``release_was_set`` (whether the
    flaky store's blocked write had been let go by then), or ``error``."""
    returned = threading.Event()
    outcome: dict[str, Any] = {}

    def second_save() -> None:
        try:
            outcome["saved"] = mgr.save_async(2, state)
            outcome["release_was_set"] = flaky.faults.release.is_set()
        except BaseException as exc:
            outcome["error"] = exc
        finally:
            returned.set()

    return threading.Thread(target=second_save, name="second-save"), returned, outcome


def test_save_async_waits_for_a_free_slot_and_logs_the_wait(
    flaky: type[FlakyFileSystem], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ckptmgr")
    flaky.faults.block_suffixes = (".distcp",)
    mgr = flaky_manager(f"{PROTOCOL}://backpressure", max_pending_async=1)
    worker, second_returned, outcome = second_save_async(mgr, make_state(2), flaky)
    try:
        assert mgr.save_async(1, make_state(1)) is True
        assert flaky.faults.blocked.wait(BOUND_S), "the first write never reached the file system"
        worker.start()
        # Negative check, bounded: the second call must still be waiting for the slot. The
        # decisive assertion is release_was_set below, which holds however threads interleave.
        assert not second_returned.wait(0.5), "save_async did not wait for a free slot"
        flaky.faults.release.set()
        assert second_returned.wait(BOUND_S), "save_async never returned after the slot freed"
        worker.join(BOUND_S)
        assert not worker.is_alive()
        assert "error" not in outcome, outcome.get("error")
        assert outcome == {"saved": True, "release_was_set": True}
        mgr.join()
        assert mgr.all_steps() == [1, 2]
    finally:
        flaky.faults.release.set()
        if worker.ident is not None:
            worker.join(BOUND_S)
        mgr.close()
    waits = [r.getMessage() for r in caplog.records if "free async save slot" in r.getMessage()]
    assert len(waits) == 1, waits
    assert re.search(r"waited \d+(\.\d+)? s", waits[0]), waits[0]
    assert "step 2" in waits[0]


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_failed_copy_raises_from_save_async_and_leaves_nothing(
    ckpt_dir: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the copy of the state fails, save_async raises that error and nothing else: nothing
    is written or committed, no write directory is left, no second error is reported later, and
    the staging slot and the step are free for a retry."""
    original_stage = StagingBuffers.stage
    copies: list[int] = []

    def stage_failing_once(self: StagingBuffers, *args: Any, **kwargs: Any) -> Any:
        copies.append(1)
        if len(copies) == 1:
            raise MemoryError("injected: no memory for the copy")
        return original_stage(self, *args, **kwargs)

    monkeypatch.setattr(StagingBuffers, "stage", stage_failing_once)
    state = make_state(1)
    with CheckpointManager(
        ckpt_dir, save_interval=1, chkpt_on_preemption=False, async_mode=mode
    ) as mgr:
        with pytest.raises(MemoryError, match="injected"):
            mgr.save_async(1, state)
        mgr.join()  # raises if the job reported an error of its own
        assert mgr.all_steps() == []
        assert [p.name for p in ckpt_dir.iterdir() if p.name != "owner.json"] == []
        assert mgr.save_async(1, state) is True  # max_pending_async=1: the slot came back
        mgr.join()
        assert mgr.all_steps() == [1]
        restored = empty_like_state(state)
        mgr.restore(1, restored)
    assert_same_state(restored, state)
    assert len(copies) == 2


def test_a_written_save_frees_its_slot_before_its_commit_ends(flaky: type[FlakyFileSystem]) -> None:
    """The staging slot comes back once the data is written: the next save_async does not wait
    for the previous save's commit (nor for retention's deletions after it)."""
    flaky.faults.block_suffixes = ("commit.json",)  # every commit waits for release
    mgr = flaky_manager(f"{PROTOCOL}://early-slot", max_pending_async=1)
    states = {step: make_state(step) for step in (1, 2)}
    worker, second_returned, outcome = second_save_async(mgr, states[2], flaky)
    try:
        assert mgr.save_async(1, states[1]) is True
        assert flaky.faults.blocked.wait(BOUND_S), "the first save never reached its commit"
        worker.start()
        # Bounded below the flaky store's own give-up time, so a save_async that waits for the
        # blocked commit fails here instead of returning once that commit gave up.
        assert second_returned.wait(BOUND_S / 2), "save_async waited for the previous commit"
        assert "error" not in outcome, outcome.get("error")
        assert outcome == {"saved": True, "release_was_set": False}  # the first commit held
        flaky.faults.release.set()
        mgr.join()
        assert mgr.all_steps() == [1, 2]
        for step, state in states.items():  # step 2's staging reused the slot of step 1
            restored = empty_like_state(state)
            mgr.restore(step, restored)
            assert_same_state(restored, state)
    finally:
        flaky.faults.release.set()
        if worker.ident is not None:
            worker.join(BOUND_S)
        mgr.close()


@pytest.mark.parametrize("wildcard", ["[1]", "*", "?"])
def test_a_remote_root_with_a_wildcard_is_refused(wildcard: str, tmp_path: Path) -> None:
    """fsspec reads * ? [ in a path as a glob when it deletes or copies: deleting a step of
    memory://runs/exp[1] deleted the same step's data files of a sibling run memory://runs/exp1.
    Such remote roots are refused; a local root may hold them (os calls take paths as they are)."""
    memory = fsspec.filesystem("memory")
    sibling = "memory://runs-wildcard/exp1"
    with CheckpointManager(sibling, 1, max_to_keep=1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, {"w": torch.ones(3)})
    root = f"memory://runs-wildcard/exp{wildcard}"
    with pytest.raises(CheckpointError, match="wildcards"):
        CheckpointManager(root, 1, max_to_keep=1, chkpt_on_preemption=False)
    assert memory.exists("/runs-wildcard/exp1/step_000000000001/commit.json")
    local_root = tmp_path / f"exp{wildcard}"
    with CheckpointManager(local_root, 1, max_to_keep=1, chkpt_on_preemption=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((3,), float(step))})
        restored = {"w": torch.zeros(3)}
        mgr.restore(2, restored)
    assert torch.equal(restored["w"], torch.full((3,), 2.0))
    memory.rm("/runs-wildcard", recursive=True)


def test_a_data_file_whose_fsync_fails_leaves_no_hashing_thread(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the fsync of a data file fails, the save fails and the file's hashing thread ends
    (it waited forever, holding its batch of tensors). Fault injection: fsync of .distcp files
    raises EIO."""
    real_fsync = os.fsync

    def failing_for_data_files(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".distcp"):
            raise OSError(errno.EIO, "injected: I/O error on fsync")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_for_data_files)
    with CheckpointManager(
        ckpt_dir, save_interval=1, num_of_threads=2, chkpt_on_preemption=False
    ) as mgr:
        with pytest.raises(CheckpointError, match="I/O error on fsync"):
            mgr.save(1, {f"w{i}": torch.randn(100_000) for i in range(4)})
        hashing = [t for t in threading.enumerate() if t.name == "ckptmgr-crc32"]
        for thread in hashing:
            thread.join(BOUND_S)
        assert [t for t in hashing if t.is_alive()] == []
        assert mgr.all_steps() == []


def _unstorable(kind: str) -> torch.Tensor:
    """A tensor whose bytes do not hold its value, of one kind."""
    if kind == "quantized":
        with warnings.catch_warnings():  # (quantized tensors are deprecated in torch 2.13)
            warnings.simplefilter("ignore")
            return torch.quantize_per_tensor(torch.randn(8), 0.5, 3, torch.qint8)
    if kind == "sparse_coo":
        return torch.sparse_coo_tensor(torch.tensor([[0, 5]]), torch.tensor([1.0, 2.0]), (8,))
    if kind == "sparse_csr":
        return torch.eye(8).to_sparse_csr()
    if kind == "nested":
        with warnings.catch_warnings():  # (the strided layout of nested tensors is a prototype)
            warnings.simplefilter("ignore")
            return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    assert kind == "meta"
    return torch.empty(8, device="meta")


@pytest.mark.parametrize("kind", ["quantized", "sparse_coo", "sparse_csr", "meta", "nested"])
@pytest.mark.parametrize("call", ["save", "save_async"])
def test_a_tensor_whose_bytes_are_not_its_value_is_refused_by_name(
    tmp_path: Path, kind: str, call: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A quantized tensor was stored as its integers alone and restored with the destination's
    scale and zero point (silently wrong values); sparse and meta tensors failed with torch's
    own errors (save_async: a bare NotImplementedError), and so did nested tensors (torch's
    "NestedTensorImpl doesn't support sizes"). Each now raises ``CheckpointError`` naming the
    key, nothing is committed, and the next save of a good state commits. (save's packing of
    a nested one failed first, logged at ERROR level with torch's traceback: not any more.)"""
    small = {f"small/{i}": torch.full((4,), float(i)) for i in range(40)}  # (packed)
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as manager:
        with pytest.raises(
            CheckpointError, match=r"cannot checkpoint 'odd': .*" + kind[:6]
        ) as refused:
            getattr(manager, call)(1, {"odd": _unstorable(kind), "w": torch.ones(2), **small})
            manager.join()
        assert "rank 0" not in str(refused.value)  # (save's said so, in one process)
        assert "packing small tensors failed" not in caplog.text
        assert manager.all_steps() == []
        getattr(manager, call)(2, {"odd": torch.ones(8), "w": torch.ones(2), **small})
        manager.join()
        assert manager.all_steps() == [2]


def test_a_tensor_turned_sparse_under_a_reused_staging_layout_is_refused_by_name(
    tmp_path: Path,
) -> None:
    """A sparse tensor of a dense one's dtype and shape keeps the staging layout's quick
    signature; its copy fails, and the error names it."""
    small = {f"small/{i}": torch.full((4,), float(i)) for i in range(40)}
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as manager:
        manager.save_async(1, {"odd": torch.ones(8), **small})
        manager.join()
        for odd in (_unstorable("sparse_coo"), torch.ones(8).to_sparse()):
            with pytest.raises(CheckpointError, match=r"cannot checkpoint 'odd': a sparse_coo"):
                manager.save_async(2, {"odd": odd, **small})
        manager.save_async(3, {"odd": torch.ones(8), **small})
        manager.join()
        assert manager.all_steps() == [1, 3]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_forked_child_cannot_use_its_parents_manager_nor_release_its_things(
    tmp_path: Path,
) -> None:
    """The manager's writer thread, staging memory, daemon and lease are the parent's: a child
    that used them waited forever for the writer, or wrote into the parent's staged bytes, and
    its close() released the parent's lease. Each call now raises in the child, close() there
    leaves everything alone, and the parent goes on saving."""
    state = {"w": torch.arange(8.0), **{f"s/{i}": torch.full((4,), float(i)) for i in range(40)}}
    manager = CheckpointManager(tmp_path, 1, chkpt_on_preemption=False)
    manager.save_async(1, state)
    manager.join()
    lease = tmp_path / "owner.json"
    assert lease.exists()

    def use_in_child() -> bytes:
        refused = []
        for name, call in [
            ("save", lambda: manager.save(2, state)),
            ("save_async", lambda: manager.save_async(2, state)),
            ("join", manager.join),
            ("restore", lambda: manager.restore(1, state)),
            ("should_save", lambda: manager.should_save(2)),
        ]:
            try:
                call()
            except CheckpointError as exc:
                if "forked child" in str(exc):
                    refused.append(name)
        manager.close()  # leaves the parent's things alone
        return ",".join(refused).encode()

    answer = in_forked_child(use_in_child)
    assert answer == b"save,save_async,join,restore,should_save"
    assert lease.exists()
    state["w"].add_(1)
    assert manager.save_async(2, state)
    manager.join()
    restored = {key: torch.zeros_like(value) for key, value in state.items()}
    manager.restore(2, restored)
    assert all(torch.equal(restored[key], state[key]) for key in state)
    manager.close()
    assert not lease.exists()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_close_in_a_forked_child_puts_back_the_childs_own_signal_handlers(
    tmp_path: Path,
) -> None:
    """A forked child inherits the manager's SIGTERM handler, which only notes a preemption
    notice. close() there released nothing, the handler included, so the child went on
    ignoring SIGTERM (a multiprocessing terminate() left it running). It now puts back the
    child's own copy of the handlers, and the parent's stay installed."""
    before = signal.getsignal(signal.SIGTERM)
    manager = CheckpointManager(tmp_path, 1)  # chkpt_on_preemption=True: handles SIGTERM
    installed = signal.getsignal(signal.SIGTERM)
    assert installed != before
    closed_read, closed_write = os.pipe()
    alive_read, alive_write = os.pipe()  # the child's end closes when it dies
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(closed_read)
            os.close(alive_read)
            manager.close()
            os.write(closed_write, b"closed")
            select.select([], [], [], 2 * BOUND_S)  # until a signal ends it, or the bound
        finally:
            os._exit(3)
    os.close(closed_write)
    os.close(alive_write)
    try:
        ready, _, _ = select.select([closed_read], [], [], BOUND_S)
        assert ready and os.read(closed_read, 16) == b"closed"
        os.kill(pid, signal.SIGTERM)
        ready, _, _ = select.select([alive_read], [], [], BOUND_S)
        assert ready and os.read(alive_read, 16) == b"", "the child ignored SIGTERM"
    finally:
        os.close(closed_read)
        os.close(alive_read)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == installed  # the parent's, still in place
    manager.close()
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_step_whose_retention_delete_failed_stays_listed_and_restorable(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention drops the steps it deletes from the list first; when the deletion failed
    before anything was removed, the step stayed in storage but all_steps() omitted it and
    restore() of it raised StepNotFoundError. The failure is injected: the rename that makes a
    step invisible fails once."""
    import ckptmgr.storage as storage_module

    real_rename = os.rename
    failed: list[str] = []

    def rename_failing_once(source: str, target: str) -> None:
        if ".deleting-" in str(target) and not failed:
            failed.append(str(source))
            raise PermissionError(13, "Permission denied (injected)", source)
        real_rename(source, target)

    monkeypatch.setattr(storage_module.os, "rename", rename_failing_once)
    with CheckpointManager(ckpt_dir, 1, max_to_keep=1, chkpt_on_preemption=False) as manager:
        assert manager.save(1, {"w": torch.full((2,), 1.0)})
        assert manager.save(2, {"w": torch.full((2,), 2.0)})  # deleting step 1 fails
        assert failed, "the injected fault was never hit"
        assert manager.all_steps() == [1, 2]
        restored = {"w": torch.zeros(2)}
        manager.restore(1, restored)
        assert torch.equal(restored["w"], torch.full((2,), 1.0))
        with pytest.raises(CheckpointError, match=r"could not delete step\(s\) \[1\]"):
            manager.join()
        assert manager.save(3, {"w": torch.full((2,), 3.0)})  # deletes 1 and 2 now
        assert manager.all_steps() == [3]


def test_a_failed_read_of_the_lease_before_a_retention_delete_deletes_nothing_and_fails_no_save(
    flaky: type[FlakyFileSystem],
) -> None:
    """Retention reads owner.json right before it deletes. A read error there (an EIO) escaped
    as the save's own failure: save() raised for a step it had committed, and the step
    retention meant to delete stayed in storage but unlisted. Now nothing is deleted, the save
    returns True, both steps stay listed and restorable, and the error is reported like a
    failed deletion. (A transient error, a reset connection, is retried: the next test.)"""
    with CheckpointManager(
        f"{PROTOCOL}://run", 1, max_to_keep=1, chkpt_on_preemption=False
    ) as manager:
        assert manager.save(1, {"w": torch.full((2,), 1.0)})
        flaky.faults.fail_read_suffixes = ("owner.json",)
        flaky.faults.read_errno = errno.EIO
        assert manager.save(2, {"w": torch.full((2,), 2.0)})
        assert flaky.faults.raised, "the injected fault was never hit"
        assert manager.all_steps() == [1, 2]
        restored = {"w": torch.zeros(2)}
        manager.restore(1, restored)
        assert torch.equal(restored["w"], torch.full((2,), 1.0))
        with pytest.raises(CheckpointError, match="retention deleted nothing") as raised:
            manager.join()
        assert isinstance(raised.value.__cause__, OSError)
        assert raised.value.__cause__.errno == errno.EIO
        assert manager.save(3, {"w": torch.full((2,), 3.0)})  # deletes 1 and 2 now
        assert manager.all_steps() == [3]


def test_a_transient_failure_to_read_the_lease_before_a_retention_delete_is_retried(
    flaky: type[FlakyFileSystem],
) -> None:
    """A reset connection on the read of owner.json before retention deletes is retried, as
    every storage operation's transient failure: the deletion happens, nothing is raised."""
    with CheckpointManager(
        f"{PROTOCOL}://run", 1, max_to_keep=1, chkpt_on_preemption=False
    ) as manager:
        assert manager.save(1, {"w": torch.full((2,), 1.0)})
        flaky.faults.fail_read_suffixes = ("owner.json",)
        assert manager.save(2, {"w": torch.full((2,), 2.0)})
        assert [error.errno for error in flaky.faults.raised] == [errno.ECONNRESET]
        manager.join()
        assert manager.all_steps() == [2]


class _CtrlCAfterExit:
    """The manager's lock, raising a real SIGINT as it is let go while ``fire()`` says so."""

    def __init__(self, lock: Any, fire: Any) -> None:
        self._lock, self._fire = lock, fire

    def __enter__(self) -> Any:
        return self._lock.__enter__()

    def __exit__(self, *exc: object) -> Any:
        released = self._lock.__exit__(*exc)
        if self._fire():
            signal.raise_signal(signal.SIGINT)  # (Python's handler: a KeyboardInterrupt)
        return released


def _save_async_in_time(manager: CheckpointManager, step: int, state: Any) -> bool | None:
    """``save_async(step)`` then ``join()`` on a thread: what it returned, or None if it had
    not returned within 60 s (waiting for a staging slot no save will release)."""
    done: dict[str, bool] = {}

    def save() -> None:
        done["saved"] = manager.save_async(step, state)
        manager.join()

    thread = threading.Thread(target=save, daemon=True)
    thread.start()
    thread.join(60)
    return done.get("saved")


def test_a_ctrl_c_as_save_async_marks_its_step_in_flight_leaves_no_mark(tmp_path: Path) -> None:
    """A Ctrl-C right after the step was marked in flight (as the lock was let go) left it
    marked: a script that caught the KeyboardInterrupt and saved that step again got False
    ("already being saved"), and a preemption notice claimed there was never answered."""
    state = {"w": torch.arange(100, dtype=torch.float32)}
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as manager:
        armed = [True]

        def fire() -> bool:
            if armed and 1 in manager._in_flight:
                armed.pop()
                return True
            return False

        manager._lock = _CtrlCAfterExit(manager._lock, fire)  # type: ignore[assignment]
        with pytest.raises(KeyboardInterrupt):
            manager.save_async(1, state)
        assert not armed, "the lock was not let go with step 1 in flight"
        assert _save_async_in_time(manager, 1, state) is True
        assert manager.all_steps() == [1]


def test_a_ctrl_c_as_save_async_takes_its_staging_slot_leaves_the_slot_free(
    tmp_path: Path,
) -> None:
    """A Ctrl-C as save_async took its staging slot (as the pool's call returned) lost the
    slot: with max_pending_async=1 the next save_async waited for it for ever."""
    state = {"w": torch.arange(100, dtype=torch.float32)}
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as manager:
        acquire = manager._staging.acquire

        def acquire_then_ctrl_c(*args: Any, **kwargs: Any) -> Any:
            taken = acquire(*args, **kwargs)
            signal.raise_signal(signal.SIGINT)
            return taken

        manager._staging.acquire = acquire_then_ctrl_c  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            manager.save_async(1, state)
        manager._staging.acquire = acquire  # type: ignore[method-assign]
        assert _save_async_in_time(manager, 2, state) is True
        assert manager.all_steps() == [2]


@pytest.mark.parametrize("call", ["wait_for_queued_work", "FailureHandover"])
def test_a_ctrl_c_as_save_prepares_its_write_leaves_no_step_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """save() waits for work queued on the state's devices (a CUDA synchronize, right after a
    training step), and makes the handover of its failure, once the step is marked in flight:
    a Ctrl-C as either call returned left it marked, and save() of that step again returned
    False ("already being saved")."""
    from ckptmgr import manager as manager_module

    real = getattr(manager_module, call)
    armed = [True]

    def call_then_ctrl_c(*args: Any, **kwargs: Any) -> Any:
        returned = real(*args, **kwargs)
        if armed and threading.current_thread() is threading.main_thread():
            armed.pop()
            signal.raise_signal(signal.SIGINT)  # (Python's handler: a KeyboardInterrupt)
        return returned

    monkeypatch.setattr(manager_module, call, call_then_ctrl_c)
    state = {"w": torch.arange(100, dtype=torch.float32)}
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as manager:
        with pytest.raises(KeyboardInterrupt):
            manager.save(1, state)
        assert not armed
        assert manager.save(1, state)
        assert manager.all_steps() == [1]
