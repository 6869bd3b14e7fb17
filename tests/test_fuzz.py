"""Property-based fuzzing: the commit record parser, and restore of randomly damaged checkpoints.

Whatever the damage (bit flips, truncation, deleted files, garbage appended, a garbage record),
the outcome is a clean ``CheckpointError`` or, when only harmless bytes of ``commit.json`` changed,
exactly the saved data: never another exception, never a hang, never wrong data.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptmgr import CheckpointError, CheckpointManager, CommitRecord, CorruptCheckpointError
from ckptmgr.integrity import check_relative_path
from ckptmgr.storage import CheckpointStorage

STEP = 7
STEP_DIR = f"step_{STEP:012d}"
FUZZ_SETTINGS = settings(
    max_examples=60,
    deadline=None,  # restores take tens of milliseconds; the test's timeout bounds the total
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,  # reproducible in CI
)


def saved_state() -> dict[str, Any]:
    return {
        "model": {"w": torch.linspace(-1, 1, 3000), "b": torch.arange(5, dtype=torch.int64)},
        "progress": {"epoch": 3, "tag": "fuzz", "seen": (1, 2, 3)},
    }


def empty_state() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(3000), "b": torch.zeros(5, dtype=torch.int64)},
        "progress": {"epoch": 0, "tag": "", "seen": ()},
    }


def same_state(left: dict[str, Any], right: dict[str, Any]) -> bool:
    return (
        torch.equal(left["model"]["w"], right["model"]["w"])
        and torch.equal(left["model"]["b"], right["model"]["b"])
        and left["progress"] == right["progress"]
    )


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One committed step, copied afresh for every example."""
    root = tmp_path_factory.mktemp("fuzz-template")
    with CheckpointManager(root, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(STEP, saved_state())
    return root


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("fuzz-scratch")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def fresh_copy(template: Path, scratch: Path) -> Path:
    root = Path(tempfile.mkdtemp(dir=scratch))
    shutil.copytree(template / STEP_DIR, root / STEP_DIR)
    return root


MUTATIONS = st.lists(
    st.tuples(
        st.sampled_from(["flip", "truncate", "delete", "append"]),
        st.integers(min_value=0),  # which file (modulo the number of files)
        st.integers(min_value=0),  # where (modulo the file size)
        st.integers(min_value=0, max_value=7),  # which bit
    ),
    min_size=1,
    max_size=3,
)


def mutate(step_dir: Path, mutations: list[tuple[str, int, int, int]]) -> set[str]:
    """Apply ``mutations``; returns the names of the files whose bytes really changed (two
    flips of one bit, or a truncation and the append of the byte cut, change nothing)."""
    before = {path.name: path.read_bytes() for path in step_dir.iterdir() if path.is_file()}
    for kind, which, where, bit in mutations:
        files = sorted(p for p in step_dir.iterdir() if p.is_file())
        if not files:
            break
        path = files[which % len(files)]
        data = bytearray(path.read_bytes())
        if kind == "delete":
            path.unlink()
        elif kind == "append":
            path.write_bytes(bytes(data) + bytes([where % 256]))
        elif kind == "truncate":
            if not data:
                continue
            path.write_bytes(bytes(data[: where % len(data)]))
        else:
            if not data:
                continue
            data[where % len(data)] ^= 1 << bit
            path.write_bytes(bytes(data))
    after = {path.name: path.read_bytes() for path in step_dir.iterdir() if path.is_file()}
    return {name for name, data in before.items() if after.get(name) != data}


@pytest.mark.timeout(280)
@FUZZ_SETTINGS
@given(mutations=MUTATIONS)
def test_restore_of_a_damaged_checkpoint_fails_cleanly_or_restores_exact_data(
    template: Path, scratch: Path, mutations: list[tuple[str, int, int, int]]
) -> None:
    root = fresh_copy(template, scratch)
    changed = mutate(root / STEP_DIR, mutations)
    with CheckpointManager(root, 1, chkpt_on_preemption=False, leftover_grace_s=1e9) as mgr:
        state = empty_state()
        try:
            if STEP in mgr.all_steps():
                mgr.restore(STEP, state)
                restored = True
            else:  # commit.json deleted: the step is simply not committed
                restored = False
        except CheckpointError:
            restored = False
        if restored:
            # Only commit.json may have changed, in a way that names the same data.
            assert changed <= {"commit.json"}, f"damage to {changed} went unnoticed"
            assert same_state(state, saved_state()), "restore returned wrong data"
        if changed - {"commit.json"} and STEP in mgr.all_steps():
            with pytest.raises(CheckpointError):
                mgr.verify(STEP, deep=True)
        # restore_latest never raises for damage: it quarantines and reports None.
        state = empty_state()
        outcome = mgr.restore_latest(state)
        assert outcome in (None, STEP)
        if outcome == STEP:
            assert same_state(state, saved_state())
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.timeout(280)
@FUZZ_SETTINGS
@given(mutations=MUTATIONS.filter(lambda ms: all(kind != "delete" for kind, *_ in ms)))
def test_damage_to_data_files_is_always_detected(
    template: Path, scratch: Path, mutations: list[tuple[str, int, int, int]]
) -> None:
    root = fresh_copy(template, scratch)
    step_dir = root / STEP_DIR
    record = (step_dir / "commit.json").read_bytes()
    changed = mutate(step_dir, mutations)
    (step_dir / "commit.json").write_bytes(record)  # keep the record intact: data damage only
    changed.discard("commit.json")
    with CheckpointManager(root, 1, chkpt_on_preemption=False, leftover_grace_s=1e9) as mgr:
        if changed:
            with pytest.raises(CorruptCheckpointError) as caught:
                mgr.restore(STEP, empty_state())
            assert caught.value.path is not None
            with pytest.raises(CorruptCheckpointError):
                mgr.verify(STEP, deep=True)
        else:
            state = empty_state()
            mgr.restore(STEP, state)
            assert same_state(state, saved_state())
    shutil.rmtree(root, ignore_errors=True)


# -- the commit record parser ------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
PATHS = st.sampled_from(
    ["../x", "/etc/passwd", "a/../../b", "", ".", "a//b", "C:\\x", "ok.bin", "d/e.bin", "\x00"]
)


def valid_record() -> dict[str, Any]:
    return {
        "format_version": 1,
        "step": STEP,
        "save_id": "0123456789abcdef",
        "committed_at": "2026-11-22T22:56:57.660572Z",
        "world_size": 1,
        "metrics": {"loss": 0.5},
        "metadata": {"git": "x"},
        "files": [{"path": ".metadata", "size": 10, "crc32": 5}],
        "tensors": {"w": {"dtype": "float32", "shape": [3]}},
        "object_files": ["objects-rank00000.json"],
    }


def assert_parsed_or_refused(data: bytes) -> None:
    try:
        record = CommitRecord.from_json(data)
    except ValueError:
        return
    for entry in record.files:
        check_relative_path(entry.path)  # never a path outside the step directory
        assert entry.size >= 0
        assert entry.crc32 is None or 0 <= entry.crc32 < 2**32
    for name in record.object_files:
        check_relative_path(name)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.binary(max_size=300))
def test_parser_refuses_arbitrary_bytes_with_a_value_error(data: bytes) -> None:
    assert_parsed_or_refused(data)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    field=st.sampled_from(sorted(valid_record())),
    value=JSON_VALUES,
    file_field=st.sampled_from(["path", "size", "crc32", "extra"]),
    file_value=JSON_VALUES | PATHS,
)
def test_parser_validates_every_field_of_a_record(
    field: str, value: Any, file_field: str, file_value: Any
) -> None:
    raw = valid_record()
    raw[field] = value
    assert_parsed_or_refused(json.dumps(raw).encode())
    raw = valid_record()
    raw["files"][0][file_field] = file_value
    assert_parsed_or_refused(json.dumps(raw).encode())
    raw = valid_record()
    raw["object_files"] = [file_value]
    assert_parsed_or_refused(json.dumps(raw).encode())


@pytest.mark.timeout(280)
@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.binary(max_size=200) | JSON_VALUES.map(lambda v: json.dumps(v).encode()))
def test_a_garbage_record_is_a_checkpoint_error(template: Path, scratch: Path, data: bytes) -> None:
    root = fresh_copy(template, scratch)
    (root / STEP_DIR / "commit.json").write_bytes(data)
    storage = CheckpointStorage(str(root))
    with pytest.raises(CheckpointError):
        storage.read_record(STEP)
    with CheckpointManager(root, 1, chkpt_on_preemption=False, leftover_grace_s=1e9) as mgr:
        with pytest.raises(CorruptCheckpointError):
            mgr.restore(STEP, empty_state())
        assert mgr.restore_latest(empty_state()) is None
    assert CheckpointStorage(str(root)).quarantined_steps() == [STEP]
    shutil.rmtree(root, ignore_errors=True)


def test_fuzz_helpers_restore_the_template(template: Path, scratch: Path) -> None:
    """The undamaged copy restores exactly (so the properties above are not vacuous), and
    ``mutate`` reports the files whose bytes changed, not the files it touched."""
    root = fresh_copy(template, scratch)
    assert mutate(root / STEP_DIR, []) == set()
    first = sorted(path.name for path in (root / STEP_DIR).iterdir())[0]
    assert mutate(root / STEP_DIR, [("flip", 0, 0, 0), ("flip", 0, 0, 0)]) == set()
    assert mutate(root / STEP_DIR, [("flip", 0, 0, 0)]) == {first}
    assert mutate(root / STEP_DIR, [("flip", 0, 0, 0)]) == {first}  # (flipped back)
    with CheckpointManager(root, 1, chkpt_on_preemption=False) as mgr:
        state = empty_state()
        mgr.restore(STEP, state)
        assert same_state(state, saved_state())
