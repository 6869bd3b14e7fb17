"""Child process of tests/test_crash_safety.py: saves checkpoints in a loop until it is SIGKILLed.

Run as a script (``python tests/_crash_child.py``) with the repository root on ``PYTHONPATH``.
The test imports this module too, for :func:`expected_state`, :func:`blank_state` and
:func:`assert_bit_exact`, so that both sides agree on what each step must contain.

Protocol, one line per message, flushed at once:

* the child prints ``ready`` once ``ckptmgr`` (and torch) are imported;
* the parent writes one JSON line (the trial's configuration) to the child's stdin;
* the child prints ``attempt <step> <sync|async>`` right before each ``save``/``save_async``
  call, ``saved <step> <True|False>`` after ``save`` returned, ``queued <step> <True|False>``
  after ``save_async`` returned and ``joined <step>`` after ``join`` returned (every async save
  up to ``step`` is committed then). In ``big`` mode it prints ``timing <step> <seconds>`` after
  the first save and ``writing <step>`` right before the save that the parent kills; with
  ``pause_in_write`` it also prints ``inside write <step>`` once the first piece of that save's
  data file is written, and that write waits there to be killed.

Every wait is bounded: the configuration must arrive within ``CONFIG_WAIT_S`` and a watchdog
(``SIGALRM``) ends the child ``watchdog_s`` seconds after it started saving, should the parent
never kill it.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch

CONFIG_WAIT_S = 600.0

# Sizes (element counts) of the tensors of one state; see expected_state().
SMALL_SPEC: dict[str, int] = {"f32": 131072, "bf16": 65536, "i64": 32768, "bool": 8192, "opt": 4096}


def expected_state(step: int, spec: Mapping[str, int]) -> dict[str, Any]:
    """The state the child saves at ``step``: every value is a deterministic function of it."""
    state = blank_state(spec)
    fill_state(state, step)
    return state


def blank_state(spec: Mapping[str, int]) -> dict[str, Any]:
    """A state with the structure of :func:`expected_state` and values that no step has."""
    n_f32, n_bf16, n_i64, n_bool, n_opt = (
        spec["f32"],
        spec["bf16"],
        spec["i64"],
        spec["bool"],
        spec["opt"],
    )
    return {
        "model": {
            "weight": torch.full((n_f32 // 64, 64), -1.0, dtype=torch.float32),
            "bias": torch.full((n_bf16,), -1.0, dtype=torch.bfloat16),
            "counts": torch.full((n_i64,), -1, dtype=torch.int64),
            "mask": torch.zeros(n_bool, dtype=torch.bool),
            "scale": torch.tensor(-1.0, dtype=torch.float64),
            "empty": torch.empty(0, 4, dtype=torch.float32),
        },
        "optim": [
            torch.full((n_opt,), -1.0, dtype=torch.float32),
            torch.full((n_opt, 2), -1.0, dtype=torch.float16),
        ],
        "meta": {"step": -1},
        "epoch": -1,
        "name": "",
    }


def fill_state(state: dict[str, Any], step: int) -> None:
    """Write the values of ``step`` into ``state`` in place (tensors) or by replacement (plain)."""
    model = state["model"]
    weight = model["weight"]
    weight.copy_(
        (torch.arange(weight.numel(), dtype=torch.float32) * 0.5 + step).reshape(weight.shape)
    )
    bias = model["bias"]
    bias.copy_(((torch.arange(bias.numel()) % 251) + step % 97).to(torch.bfloat16))
    counts = model["counts"]
    counts.copy_(torch.arange(counts.numel(), dtype=torch.int64) * 3 + step * 1_000_003)
    mask = model["mask"]
    mask.copy_((torch.arange(mask.numel()) + step) % 3 == 0)
    model["scale"].fill_(step * 1.25)
    first, second = state["optim"]
    # Only correctly rounded operations (no sin, exp, ...): the values must not depend on the
    # process that computes them. MKL's sin, in its first call in a forked child that splits it
    # over two threads, computed the second thread's half up to 1.5e-4 off in 1 to 12 of 300
    # forks on a 2-core machine: the soak's worker then saved values the test did not expect.
    first.copy_((torch.arange(first.numel(), dtype=torch.float32) * 3 + 1) / 7 + step)
    second.copy_((torch.arange(second.numel()).reshape(second.shape) % 1000 + step % 7).half())
    state["meta"] = {
        "step": step,
        "tag": f"step-{step}",
        "history": [step, step + 1, "x" * (step % 5)],
        "lr": 0.1 / (step + 1),
        "nested": {"even": step % 2 == 0, "none": None},
    }
    state["epoch"] = step // 7
    state["name"] = f"run-{step % 3}"


def assert_bit_exact(actual: Any, expected: Any, path: str = "") -> None:
    """Raise AssertionError unless ``actual`` equals ``expected`` bit for bit, types included."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: {type(actual).__name__} is no tensor"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
        got = actual.detach().reshape(-1).contiguous().view(torch.uint8)
        want = expected.detach().reshape(-1).contiguous().view(torch.uint8)
        assert torch.equal(got, want), f"{path}: tensor bytes differ"
        return
    assert type(actual) is type(expected), (
        f"{path}: type {type(actual).__name__} != {type(expected).__name__}"
    )
    if isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key, value in expected.items():
            assert_bit_exact(actual[key], value, f"{path}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for index, (got, want) in enumerate(zip(actual, expected, strict=True)):
            assert_bit_exact(got, want, f"{path}[{index}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def _emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _read_config() -> dict[str, Any] | None:
    readable, _, _ = select.select([sys.stdin], [], [], CONFIG_WAIT_S)
    if not readable:
        return None
    line = sys.stdin.readline()
    return json.loads(line) if line.strip() else None


def _run_loop(manager: Any, config: dict[str, Any]) -> None:
    """Save steps 0, 1, 2, ... until killed; step 0 is a synchronous save."""
    rng = random.Random(config["seed"])
    spec = config["spec"]
    pattern = config["pattern"]
    state = blank_state(spec)
    for step in range(config["max_steps"]):
        fill_state(state, step)  # in place: the previous async save must hold its own copy
        if step == 0:
            sync = True
        elif pattern == "alternate":
            sync = step % 2 == 0
        else:
            sync = rng.random() < 0.5
        if sync:
            _emit(f"attempt {step} sync")
            committed = manager.save(step, state)
            _emit(f"saved {step} {committed}")
        else:
            _emit(f"attempt {step} async")
            queued = manager.save_async(step, state)
            _emit(f"queued {step} {queued}")
            if rng.random() < config["join_probability"]:
                manager.join()
                _emit(f"joined {step}")


def _pause_inside_the_write_of(step: int, wait_s: float) -> None:
    """Make the write of ``step``'s data files stop after their first piece: the child prints
    ``inside write <step>`` and the writing thread waits there (for ``wait_s`` at most, on its
    stdin, which the parent keeps open) to be killed. The kill then lands inside the write for
    certain, not by timing."""
    from ckptmgr import tensor_bytes
    from ckptmgr.storage import TMP_PREFIX, step_dir_name

    prefix = f"{TMP_PREFIX}{step_dir_name(step)}-"
    make, write_piece = tensor_bytes.LocalDataFile.__init__, tensor_bytes.LocalDataFile.write_piece

    def made(self: Any, path: Any, *, fsync: bool) -> None:
        make(self, path, fsync=fsync)
        self.crash_test_pause = os.path.basename(os.path.dirname(path)).startswith(prefix)

    def written(self: Any, piece: memoryview, owner: Any) -> None:
        write_piece(self, piece, owner)
        if getattr(self, "crash_test_pause", False):
            _emit(f"inside write {step}")
            select.select([sys.stdin], [], [], wait_s)

    tensor_bytes.LocalDataFile.__init__ = made  # type: ignore[method-assign]
    tensor_bytes.LocalDataFile.write_piece = written  # type: ignore[method-assign]


def _run_big(manager: Any, config: dict[str, Any]) -> None:
    """Commit step 0, then announce and start the (slow) save of step 1 that gets killed."""
    if config.get("pause_in_write"):
        _pause_inside_the_write_of(1, float(config["watchdog_s"]))
    state = blank_state(config["spec"])
    fill_state(state, 0)
    _emit("attempt 0 sync")
    started = time.monotonic()
    committed = manager.save(0, state)
    _emit(f"saved 0 {committed}")
    _emit(f"timing 0 {time.monotonic() - started:.6f}")
    fill_state(state, 1)
    _emit("attempt 1 sync")
    _emit("writing 1")
    committed = manager.save(1, state)
    _emit(f"saved 1 {committed}")


def main() -> int:
    from ckptmgr import CheckpointManager  # imported before "ready": that is the slow part

    _emit("ready")
    config = _read_config()
    if config is None:
        return 0
    signal.alarm(int(config["watchdog_s"]))  # the default action of SIGALRM ends the process
    manager = CheckpointManager(
        config["root"],
        save_interval=1,
        max_to_keep=config["max_to_keep"],
        max_pending_async=config["max_pending_async"],
        chkpt_on_preemption=False,
    )
    if config["mode"] == "big":
        _run_big(manager, config)
    else:
        _run_loop(manager, config)
    manager.close()
    _emit("done")
    # Wait to be killed rather than exiting on our own: the parent expects death by SIGKILL.
    select.select([sys.stdin], [], [], float(config["watchdog_s"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
