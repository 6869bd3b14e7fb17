"""The ``ckptmgr`` command line, run as real processes on checkpoints written by a real manager.

Every subprocess imports torch (seconds on a busy 2-core machine), so each test runs as few
commands as it can: one source checkpoint is written once per module, tests that delete work on
copies of it, and the less central cases run as several ``ckptmgr.cli.main`` calls inside one
child interpreter.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import pty
import select
import shutil
import stat
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, listed_table, run_python
from torch import nn

from ckptmgr import CheckpointManager, PerRank, cli, dcp_io, objects
from ckptmgr.cli import parse_storage_option
from ckptmgr.cli_export import NestedState, tensors_for_rank, unescape_key
from ckptmgr.errors import CheckpointError
from ckptmgr.lease import Owner, OwnerLease
from ckptmgr.record import record_bytes
from ckptmgr.state import flatten
from ckptmgr.storage import CheckpointStorage

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

COMMAND_TIMEOUT_S = 120.0  # one CLI process, torch import included, on a loaded machine
LOSSES = {10: 0.9, 20: 0.2, 40: 0.4, 50: 0.6, 30: 0.5}  # saved in this order: 30 is newest
NEWEST_BY_COMMIT_TIME = 30
EXPORTED_STEP = 20


@dataclass
class SourceCheckpoint:
    """A checkpoint root with steps 10..50 and what was saved in it."""

    root: Path
    flat_tensors: dict[int, dict[str, torch.Tensor]]  # step -> stored name -> tensor
    nested_states: dict[int, dict[str, Any]]  # step -> the dict `export` should produce


@dataclass
class CliResult:
    """Exit status and output of one command."""

    returncode: int
    stdout: str
    stderr: str


def cli_env() -> dict[str, str]:
    """The environment of a CLI process: this checkout first on the path."""
    return dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")


def run_cli(*args: str, console_script: bool = False, cwd: Path | None = None) -> CliResult:
    """``python -m ckptmgr ARGS`` (or the installed console script), bounded in time."""
    if console_script:
        script = Path(sys.executable).parent / "ckptmgr"
        assert script.is_file(), (
            f"{script} is missing: reinstall with `pip install -c constraints.txt -e '.[dev]'`"
        )
        command = [str(script), *args]
    else:
        command = [sys.executable, "-m", "ckptmgr", *args]
    completed = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        env=cli_env(),
        cwd=cwd,
        check=False,
    )
    return CliResult(completed.returncode, completed.stdout, completed.stderr)


def run_cli_with_terminal_stderr(*args: str) -> CliResult:
    """``python -m ckptmgr ARGS`` with stderr on a pseudo-terminal (stdout stays a pipe)."""
    master, slave = pty.openpty()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "ckptmgr", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=slave,
            env=cli_env(),
        )
    finally:
        os.close(slave)
    deadline = time.monotonic() + COMMAND_TIMEOUT_S
    terminal = bytearray()
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ckptmgr {args} did not finish in {COMMAND_TIMEOUT_S} s")
            ready, _, _ = select.select([master], [], [], min(remaining, 0.5))
            if not ready:
                continue
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal (it exited)
                break
            if not chunk:
                break
            terminal += chunk
        stdout, _ = process.communicate(timeout=max(deadline - time.monotonic(), 1.0))
    finally:
        os.close(master)
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    return CliResult(process.returncode, stdout.decode(), terminal.decode(errors="replace"))


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """Nested dicts from stored paths, rank 0's per-rank tensors at their path (the spec)."""
    root: dict[str, Any] = {}
    for name, value in flat.items():
        path = name.removeprefix("%rank00000%/")
        keys = [part.replace("%2F", "/").replace("%25", "%") for part in path.split("/")]
        node = root
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return root


def committed_steps(root: Path) -> list[int]:
    """Steps with a commit record, read straight from the directory."""
    return sorted(
        int(path.parent.name.removeprefix("step_")) for path in root.glob("step_*/commit.json")
    )


def copy_root(source: SourceCheckpoint, tmp_path: Path) -> Path:
    """A private copy of the source checkpoint root, for a test that deletes."""
    target = tmp_path / "copy"
    shutil.copytree(source.root, target)
    return target


def one_error_line(stderr: str) -> str:
    """The single ``ckptmgr: error:`` line of a failed command (and nothing else)."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("ckptmgr: error: "), stderr
    return lines[0]


def assert_same(actual: Any, expected: Any, where: str = "state") -> None:
    """Equal values of equal types; tensors bit-exact with the same dtype and shape."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (left, right) in enumerate(zip(actual, expected, strict=True)):
            assert_same(left, right, f"{where}[{index}]")
    else:
        assert actual == expected, where


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> SourceCheckpoint:
    """Five steps of a small model with AdamW state, per-rank stats and awkward keys.

    Step 30 is saved last, so it is the newest by commit time while 50 is the highest step.
    """
    root = tmp_path_factory.mktemp("cli") / "run"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    flat_tensors: dict[int, dict[str, torch.Tensor]] = {}
    nested_states: dict[int, dict[str, Any]] = {}
    with CheckpointManager(str(root), save_interval=10, chkpt_on_preemption=False) as mgr:
        for step, loss in LOSSES.items():
            model(torch.randn(16, 4)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            stats = torch.tensor([float(step), loss])
            half = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) * step
            odd = torch.arange(3, dtype=torch.int64) + step
            state = {
                "model": model,
                "optimizer": optimizer,
                "epoch": step // 10,
                "extras": {"names": ("a", "b"), "raw": b"\x00\x01", "half": half, "a/b%": odd},
                "stats": PerRank(stats),
            }
            assert mgr.save(step, state, metrics={"loss": loss})
            saved = flatten(state)  # what the manager stored: stored name -> tensor, path -> value
            flat_tensors[step] = {name: t.detach().clone() for name, t in saved.tensors.items()}
            plain_values = {path: objects.decode(value) for path, value in saved.objects.items()}
            nested_states[step] = nest({**flat_tensors[step], **plain_values})
    assert committed_steps(root) == sorted(LOSSES)
    return SourceCheckpoint(root, flat_tensors, nested_states)


# -- ls ----------------------------------------------------------------------------------------


def test_ls_all_json_lists_steps_and_leftovers_for_a_file_url(
    source: SourceCheckpoint, tmp_path: Path
) -> None:
    root = copy_root(source, tmp_path)
    interrupted_save = root / ".tmp-step_000000000005-abc"
    interrupted_save.mkdir()
    (interrupted_save / "__0_0.distcp").write_bytes(b"x" * 100)
    (root / "step_000000000060").mkdir()
    (root / "step_000000000060" / ".metadata").write_bytes(b"y" * 7)
    (root / "notes.txt").write_text("not a checkpoint")

    result = run_cli("ls", root.as_uri(), "--all", "--json", "-o", "auto_mkdir=false")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    report = json.loads(result.stdout)
    assert set(report) == {"root", "steps", "leftovers"}
    assert report["root"] == root.as_uri()
    assert [row["step"] for row in report["steps"]] == sorted(LOSSES)
    for row in report["steps"]:
        assert set(row) == {
            "step",
            "committed_at",
            "size",
            "world_size",
            "metrics",
            "metadata",
            "error",
        }
        record = json.loads((root / f"step_{row['step']:012d}" / "commit.json").read_text())
        assert row["committed_at"] == record["committed_at"]
        assert dt.datetime.fromisoformat(row["committed_at"].replace("Z", "+00:00")).tzinfo
        assert row["size"] == sum(entry["size"] for entry in record["files"])
        assert row["metrics"] == {"loss": LOSSES[row["step"]]}
        assert (row["world_size"], row["metadata"], row["error"]) == (1, {}, None)
    leftovers = {row["name"]: row for row in report["leftovers"]}
    assert set(leftovers) == {".tmp-step_000000000005-abc", "step_000000000060"}
    assert leftovers[".tmp-step_000000000005-abc"]["kind"] == "interrupted_save"
    assert leftovers[".tmp-step_000000000005-abc"]["size"] == 100
    assert leftovers["step_000000000060"]["kind"] == "uncommitted_step"
    assert leftovers["step_000000000060"]["size"] == 7
    assert all(0 <= row["age_s"] < 600 for row in report["leftovers"])
    assert (root / "step_000000000060").is_dir(), "ls must not remove anything"


# -- inspect -----------------------------------------------------------------------------------


def test_inspect_json_lists_the_latest_steps_tensors_with_their_nbytes(
    source: SourceCheckpoint,
) -> None:
    result = run_cli("inspect", str(source.root), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    latest = max(LOSSES)
    expected = source.flat_tensors[latest]
    assert report["step"] == latest
    assert report["metrics"] == {"loss": LOSSES[latest]}
    by_name = {row["name"]: row for row in report["tensors"]}
    assert set(by_name) == set(expected)
    for name, tensor in expected.items():
        assert by_name[name] == {
            "name": name,
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
            "bytes": tensor.nbytes,
        }
    assert report["tensor_bytes"] == sum(t.nbytes for t in expected.values())
    record = json.loads((source.root / f"step_{latest:012d}" / "commit.json").read_text())
    assert report["files"] == record["files"]
    assert report["size"] == sum(entry["size"] for entry in record["files"])
    assert report["world_size"] == 1 and report["torch_version"] == torch.__version__


# -- prune -------------------------------------------------------------------------------------


def test_prune_dry_run_deletes_nothing_and_prune_deletes_exactly_the_plan(
    source: SourceCheckpoint, tmp_path: Path
) -> None:
    root = copy_root(source, tmp_path)
    policy = ["--keep-latest", "1", "--keep-steps", "20"]

    dry = run_cli("prune", str(root), *policy, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert dry.stderr == "", "no progress bar when stderr is not a terminal"
    plan = json.loads(dry.stdout)
    assert set(plan) == {"root", "dry_run", "policies", "decisions", "to_delete", "deleted"}
    assert plan["dry_run"] is True and plan["deleted"] == []
    assert plan["to_delete"] == [10, 40]
    assert committed_steps(root) == sorted(LOSSES), "a dry run deletes nothing"
    decisions = {row["step"]: row for row in plan["decisions"]}
    assert decisions[NEWEST_BY_COMMIT_TIME]["kept"]
    assert decisions[NEWEST_BY_COMMIT_TIME]["reasons"] == [
        "protected: the most recently committed step"
    ]
    assert decisions[50]["reasons"] == ["KeepLatest(1): one of the 1 highest steps"]
    assert decisions[20]["reasons"] == ["KeepSteps: listed explicitly"]
    assert decisions[10] == {
        "step": 10,
        "committed_at": decisions[10]["committed_at"],
        "kept": False,
        "reasons": ["no policy keeps it"],
    }

    real = run_cli_with_terminal_stderr("prune", str(root), *policy)
    assert real.returncode == 0, real.stderr
    assert committed_steps(root) == [20, 30, 50]
    assert sorted(set(sorted(LOSSES)) - set(committed_steps(root))) == plan["to_delete"]
    assert "deleting [" in real.stderr and "100%" in real.stderr and "2/2" in real.stderr
    assert "\r" not in real.stdout and "#" not in real.stdout
    lines = real.stdout.strip().splitlines()
    assert lines[0].split()[:5] == ["STEP", "COMMITTED", "(UTC)", "ACTION", "REASONS"]
    actions = {int(line.split()[0]): line.split()[3] for line in lines[1:6]}
    assert actions == {10: "deleted", 20: "kept", 30: "kept", 40: "deleted", 50: "kept"}
    assert lines[-1] == "deleted 2 of 5 steps [10, 40]"


# -- export ------------------------------------------------------------------------------------
@pytest.mark.parametrize("offset", [-12, 10_000])
def test_export_refuses_a_record_placing_a_packed_tensor_outside_the_pack(
    tmp_path: Path, offset: int
) -> None:
    """A negative offset read the pack's end (Python slicing): exit 0 and wrong bytes."""
    root = tmp_path / "ckpts"
    with CheckpointManager(root, 1, chkpt_on_preemption=False) as manager:
        manager.save(1, {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0, 4.0])})
    (record_path,) = root.rglob("commit.json")
    record = json.loads(record_path.read_text())
    table = listed_table(record)
    table["pack_offsets"][table["names"].index("a")] = offset
    record_path.write_bytes(record_bytes(record))
    output = tmp_path / "out.pt"
    result = run_cli("export", str(root), "1", str(output))
    assert result.returncode != 0 and not output.exists(), result.stdout + result.stderr
    assert "damaged" in result.stderr or "outside" in result.stderr or "pack" in result.stderr


def test_export_writes_a_torch_save_file_with_bit_exact_tensors(
    source: SourceCheckpoint, tmp_path: Path
) -> None:
    output = tmp_path / "exported.pt"
    result = run_cli("export", str(source.root), str(EXPORTED_STEP), str(output), "--json")
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", "no progress bar when stderr is not a terminal"
    report = json.loads(result.stdout)
    expected_tensors = source.flat_tensors[EXPORTED_STEP]
    assert report == {
        "root": str(source.root),
        "step": EXPORTED_STEP,
        "rank": 0,
        "output": str(output),
        "tensors": len(expected_tensors),
        "tensor_bytes": sum(t.nbytes for t in expected_tensors.values()),
        "plain_values": 4,  # optimizer/param_groups, epoch, extras/names, extras/raw
        "file_size": output.stat().st_size,
    }
    exported = torch.load(output, weights_only=True)
    assert_same(exported, source.nested_states[EXPORTED_STEP])
    assert exported["epoch"] == EXPORTED_STEP // 10
    assert exported["extras"]["names"] == ("a", "b") and exported["extras"]["raw"] == b"\x00\x01"
    assert torch.equal(exported["extras"]["a/b%"], torch.arange(3) + EXPORTED_STEP)
    assert exported["extras"]["half"].dtype == torch.bfloat16
    assert torch.equal(
        exported["stats"], torch.tensor([float(EXPORTED_STEP), LOSSES[EXPORTED_STEP]])
    )
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model.load_state_dict(exported["model"])  # the model part loads as it is

    on_terminal = run_cli_with_terminal_stderr(
        "export", str(source.root), str(EXPORTED_STEP), str(tmp_path / "again.pt")
    )
    assert on_terminal.returncode == 0, on_terminal.stderr
    assert "reading [" in on_terminal.stderr and "writing [" in on_terminal.stderr
    assert on_terminal.stderr.count("100%") >= 2
    assert on_terminal.stdout.startswith(f"wrote step {EXPORTED_STEP} (rank 0) to ")
    assert_same(torch.load(tmp_path / "again.pt", weights_only=True), exported)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.pt", "exported.pt"], (
        "no temporary file is left"
    )


# -- rm ----------------------------------------------------------------------------------------


def test_tensors_for_rank_takes_each_per_rank_path_from_the_rank_or_else_rank_0() -> None:
    names = [
        "w",
        "%rank00000%/seen",
        "%rank00001%/seen",
        "%rank00000%/only0",
        "%rank00002%/a\nb",  # a key holding a newline is a per-rank path too
    ]
    assert tensors_for_rank(names, 1) == {
        "w": "w",
        "%rank00001%/seen": "seen",
        "%rank00000%/only0": "only0",
    }
    assert tensors_for_rank(names, 2) == {
        "w": "w",
        "%rank00000%/seen": "seen",
        "%rank00000%/only0": "only0",
        "%rank00002%/a\nb": "a\nb",
    }


def test_export_refuses_a_damaged_plain_values_file(
    source: SourceCheckpoint, tmp_path: Path
) -> None:
    """export checks the plain-values file against the record's size and CRC-32, as restore
    does: a damaged one (same size, other bytes) was exported silently."""
    root = copy_root(source, tmp_path)
    objects_file = root / f"step_{EXPORTED_STEP:012d}" / "objects-rank00000.json"
    data = bytearray(objects_file.read_bytes())
    digit = next(i for i, byte in enumerate(data) if chr(byte).isdigit())
    data[digit] = ord("7") if data[digit] != ord("7") else ord("8")  # still valid JSON
    objects_file.write_bytes(bytes(data))
    output = tmp_path / "exported.pt"
    result = run_cli("export", str(root), str(EXPORTED_STEP), str(output))
    assert result.returncode == 1
    assert "objects-rank00000.json" in one_error_line(result.stderr)
    assert not output.exists()


@pytest.mark.parametrize("damage", ["truncated", "flipped-byte", "deleted"])
def test_export_of_a_damaged_data_file_fails_on_one_line(
    source: SourceCheckpoint, tmp_path: Path, damage: str
) -> None:
    """Damage found while the tensors were read came out of DCP as its CheckpointException
    (a BaseException): the command ended in a Python traceback instead of one line."""
    root = copy_root(source, tmp_path)
    data_file = root / f"step_{EXPORTED_STEP:012d}" / "__0_0.distcp"
    data = bytearray(data_file.read_bytes())
    if damage == "truncated":
        data_file.write_bytes(bytes(data[:10]))
    elif damage == "flipped-byte":
        data[len(data) // 2] ^= 0x01
        data_file.write_bytes(bytes(data))
    else:
        data_file.unlink()
    output = tmp_path / "exported.pt"
    result = run_cli("export", str(root), str(EXPORTED_STEP), str(output))
    assert result.returncode == 1, result.stderr
    line = one_error_line(result.stderr)
    assert "__0_0.distcp" in line and "damaged" in line, line
    assert not output.exists()


INTERRUPTED_EXPORT = r"""
import signal, sys

from ckptmgr import dcp_io
from ckptmgr.cli import main

real_read_data = dcp_io._RawTensorReader.read_data


def interrupted_read_data(self, *args, **kwargs):
    signal.raise_signal(signal.SIGINT)  # Ctrl-C, while DCP reads the tensors
    return real_read_data(self, *args, **kwargs)


dcp_io._RawTensorReader.read_data = interrupted_read_data
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_while_export_reads_the_tensors_exits_130(
    source: SourceCheckpoint, tmp_path: Path
) -> None:
    """DCP wraps the KeyboardInterrupt of its read in its CheckpointException: it was not taken
    for Ctrl-C (a traceback, exit 1)."""
    output = tmp_path / "exported.pt"
    result = run_python(
        INTERRUPTED_EXPORT, "export", str(source.root), str(EXPORTED_STEP), str(output)
    )
    assert result.returncode == 130, result.stderr
    assert result.stderr.strip() == "ckptmgr: interrupted", result.stderr
    assert not output.exists()


def test_names_from_the_checkpoint_are_printed_with_their_control_characters_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A metric name, a tensor name and a leftover's name holding a terminal's escape
    sequences (clear the screen, set the title) reached the terminal as they were, and a
    line break in a name printed a line of its own."""
    from ckptmgr.cli import main

    root = tmp_path / "run"
    clear, title = "\x1b[2J", "\x1b]0;owned\x07"
    with CheckpointManager(root, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(
            1,
            {f"w{clear}": torch.ones(3), "v\nstep 7 ok FAKE": torch.ones(2)},
            metrics={f"loss{title}": 0.5, "acc\nFAKE-METRIC": 1.0},
        )
    (root / f".tmp-step_000000000002-{clear}").mkdir()
    for args in (["ls", "--all", str(root)], ["inspect", str(root)], ["verify", str(root)]):
        assert main(args) == 0, args
        output = capsys.readouterr()
        assert "\x1b" not in output.out + output.err, (args, output)
        assert not any(line.startswith(("step 7", "FAKE")) for line in output.out.splitlines())
    assert main(["ls", "--all", str(root)]) == 0
    shown = capsys.readouterr().out
    assert "loss\\x1b]0;owned\\x07=0.5" in shown and "\\x1b[2J" in shown, shown
    assert main(["inspect", str(root), "--json"]) == 0
    assert "w\x1b[2J" in json.loads(capsys.readouterr().out)["tensors"][0]["name"]


@pytest.mark.parametrize("command", ["rm", "prune"])
def test_a_failed_delete_reports_what_was_deleted_then_fails(
    source: SourceCheckpoint,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    """The report (stdout, --json too) was printed only when every delete succeeded: after a
    failed one, nothing said which steps had been deleted."""
    import ckptmgr.storage as storage_module
    from ckptmgr.cli import main

    root = copy_root(source, tmp_path)
    real_rename = os.rename

    def rename_refusing_step_20(source_path: Any, target: Any) -> None:
        if os.fspath(source_path).endswith("step_000000000020"):
            raise PermissionError(13, "Permission denied (injected)", os.fspath(source_path))
        real_rename(source_path, target)

    monkeypatch.setattr(storage_module.os, "rename", rename_refusing_step_20)
    if command == "rm":
        args = ["rm", str(root), "10", "20", "40", "--json"]
    else:  # keeps 30 (the newest by commit time) and 50
        args = ["prune", str(root), "--keep-latest", "1", "--json"]
    assert main(args) == 1
    output = capsys.readouterr()
    report = json.loads(output.out)
    assert report["deleted"] == [10, 40]
    assert "could not delete step(s) [20]" in output.err
    monkeypatch.undo()
    assert committed_steps(root) == [20, 30, 50]


def test_rm_refuses_a_missing_step_and_deletes_committed_ones(
    source: SourceCheckpoint, tmp_path: Path
) -> None:
    root = copy_root(source, tmp_path)
    missing = run_cli("rm", str(root), "10", "99")
    assert missing.returncode == 1
    assert one_error_line(missing.stderr) == (
        "ckptmgr: error: no committed checkpoint for step 99; available steps: [10, 20, 30, 40, 50]"
    )
    assert missing.stdout == ""
    assert committed_steps(root) == sorted(LOSSES), "nothing is deleted when a step is missing"

    deleted = run_cli("rm", str(root), "20", "10", "--json", console_script=True)
    assert deleted.returncode == 0, deleted.stderr
    assert json.loads(deleted.stdout) == {"root": str(root), "deleted": [10, 20]}
    assert committed_steps(root) == [30, 40, 50]
    assert not list(root.glob(".deleting-*")), "a finished delete leaves nothing behind"


def test_rm_and_prune_refuse_a_root_a_running_job_owns_unless_forced(
    source: SourceCheckpoint, tmp_path: Path
) -> None:
    """rm and prune deleted steps under a running job (the step it would resume from, say):
    they take the root's owner lease as a manager does, so a root a live job owns is refused
    and nothing is deleted; --force deletes without it; once the job is gone they delete and
    give the lease back."""
    root = copy_root(source, tmp_path)
    lease_record = root / "owner.json"
    with CheckpointManager(root, 10, chkpt_on_preemption=False):  # the running job
        for command in (["rm", str(root), "10"], ["prune", str(root), "--keep-latest", "1"]):
            refused = run_cli(*command)
            assert refused.returncode == 1, refused
            message = one_error_line(refused.stderr)
            assert f"{root} is owned by a running job" in message and "--force" in message
            assert committed_steps(root) == sorted(LOSSES)
        nothing_to_delete = run_cli("prune", str(root), "--keep-latest", "10")
        assert nothing_to_delete.returncode == 0, nothing_to_delete.stderr  # (takes no lease)
        forced = run_cli("rm", str(root), "10", "--force")
        assert forced.returncode == 0, forced.stderr
        assert committed_steps(root) == [20, 30, 40, 50]
        assert json.loads(lease_record.read_text())["pid"] == os.getpid()  # still the job's
    pruned = run_cli("prune", str(root), "--keep-latest", "1")
    assert pruned.returncode == 0, pruned.stderr
    assert committed_steps(root) == [NEWEST_BY_COMMIT_TIME, 50]
    assert not lease_record.exists()


@pytest.mark.parametrize("command", ["ls", "prune"])
def test_a_step_deleted_while_its_record_is_read_is_left_out(
    source: SourceCheckpoint,
    tmp_path: Path,
    command: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Beside a job whose retention deletes as it saves (on GCS and S3 most often), ls listed a
    step deleted between the listing and the read of its record as "unreadable: commit record
    ... is gone", and prune as kept, "protected: commit record unreadable". Both leave it out."""
    root = copy_root(source, tmp_path)
    read_record = CheckpointStorage.read_record

    def deleted_first(self: CheckpointStorage, step: int, *args: Any, **kwargs: Any) -> Any:
        if step == 20:  # another job's retention deletes it now
            shutil.rmtree(root / "step_000000000020", ignore_errors=True)
        return read_record(self, step, *args, **kwargs)

    monkeypatch.setattr(CheckpointStorage, "read_record", deleted_first)
    extra = ["--keep-latest", "9", "--dry-run"] if command == "prune" else []
    assert cli.main([command, str(root), "--json", *extra]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["steps"] if command == "ls" else report["decisions"]
    assert [row["step"] for row in rows] == [10, 30, 40, 50]
    if command == "ls":
        assert all(row["error"] is None for row in rows)
    else:
        assert all(row["kept"] for row in rows)


def test_verify_tells_a_record_it_may_not_read_from_a_damaged_one(
    source: SourceCheckpoint,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A record that could not be read for want of permission (credentials without read
    rights: every step of a bucket) was reported as "damaged step(s)"; it is a step that could
    not be read, apart from a damaged one."""
    root = copy_root(source, tmp_path)
    (root / "step_000000000040" / "commit.json").write_bytes(b"not json")
    read_record = CheckpointStorage.read_record

    def forbidden(self: CheckpointStorage, step: int, *args: Any, **kwargs: Any) -> Any:
        if step == 20:
            raise PermissionError(13, "Forbidden", f"step_{step:012d}/commit.json")
        return read_record(self, step, *args, **kwargs)

    monkeypatch.setattr(CheckpointStorage, "read_record", forbidden)
    assert cli.main(["verify", str(root), "--json"]) == 1
    captured = capsys.readouterr()
    rows = {row["step"]: row for row in json.loads(captured.out)["steps"]}
    assert [step for step, row in rows.items() if not row["ok"]] == [20, 40]
    assert rows[20]["unreadable"] and "Forbidden" in rows[20]["error"]
    assert not rows[40]["unreadable"]
    assert "damaged step(s): [40]" in captured.err
    assert "step(s) that could not be read: [20]" in captured.err


def test_export_refuses_an_output_that_is_not_a_regular_file(
    source: SourceCheckpoint, tmp_path: Path
) -> None:
    """export renames its new file over OUT.pt: given a FIFO (or, as root, /dev/null) it
    replaced it with a regular file, exiting 0. Such a path is refused and left as it was."""
    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)
    refused = run_cli("export", str(source.root), str(EXPORTED_STEP), str(fifo))
    assert refused.returncode == 1
    assert one_error_line(refused.stderr) == (
        f"ckptmgr: error: {fifo} is not a regular file: export writes a new file and renames "
        "it over the path, which would replace it; give the path of a regular file or a new one"
    )
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_export_refuses_an_output_under_the_root_or_named_as_a_directory(
    source: SourceCheckpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An OUT.pt under the root was written: a step's own data file or commit record was
    replaced (exit 0; verify found the step damaged). An OUT.pt ending in a slash was written
    as a file of that name (pathlib drops the slash)."""
    root = copy_root(source, tmp_path)
    step_dir = root / f"step_{EXPORTED_STEP:012d}"
    linked = tmp_path / "linked"
    linked.symlink_to(root)
    targets = [step_dir / "__0_0.distcp", step_dir / "commit.json", root / "out.pt"]
    before = {path: path.read_bytes() for path in targets if path.exists()}
    for output in (*targets, linked / step_dir.name / "commit.json", root):
        assert cli.main(["export", str(root), str(EXPORTED_STEP), str(output)]) == 1, output
        assert "is under the checkpoint root" in capsys.readouterr().err
    assert {path: path.read_bytes() for path in targets if path.exists()} == before
    assert not (root / "out.pt").exists()
    assert cli.main(["verify", str(root), "--deep"]) == 0
    capsys.readouterr()
    directory = tmp_path / "exports"
    assert cli.main(["export", str(root), str(EXPORTED_STEP), f"{directory}/"]) == 1
    assert "names a directory" in capsys.readouterr().err
    assert not directory.exists()


def test_export_writes_an_output_whose_name_is_as_long_as_a_name_may_be(
    source: SourceCheckpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The temporary file's name was OUT.pt's with a prefix and a suffix: past 255 bytes for
    a name of 248 (ENAMETOOLONG), then its cleanup failed too, in place of the message."""
    output = tmp_path / ("m" * 252 + ".pt")
    assert cli.main(["export", str(source.root), str(EXPORTED_STEP), str(output)]) == 0
    capsys.readouterr()
    exported = torch.load(output, weights_only=True)
    assert_same(exported, source.nested_states[EXPORTED_STEP])
    assert sorted(path.name for path in tmp_path.iterdir()) == [output.name]


def test_json_gives_numbers_that_are_not_finite_as_strings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """NaN and infinite metrics were printed as NaN and Infinity, which are no JSON: strict
    parsers failed, jq 1.6 read null and the largest float."""
    root = tmp_path / "run"
    metrics = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "loss": 0.5}
    with CheckpointManager(root, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, {"w": torch.ones(2)}, metrics=metrics)

    def refuse(token: str) -> Any:
        raise AssertionError(f"{token} is no JSON")

    for command in (["ls", str(root), "--json"], ["inspect", str(root), "--json"]):
        assert cli.main(command) == 0
        report = json.loads(capsys.readouterr().out, parse_constant=refuse)
        shown = report["steps"][0]["metrics"] if command[0] == "ls" else report["metrics"]
        assert shown == {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity", "loss": 0.5}


def test_verify_deep_reports_a_data_file_it_may_not_read_and_checks_the_other_steps(
    source: SourceCheckpoint,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A data file that could not be opened (no permission) ended verify --deep with one
    error line and no report: the other steps went unchecked."""
    root = copy_root(source, tmp_path)
    crc32_of = CheckpointStorage._crc32_of

    def forbidden(self: CheckpointStorage, path: str, *args: Any) -> Any:
        if f"step_{EXPORTED_STEP:012d}" in path:
            raise PermissionError(13, "Permission denied", path)
        return crc32_of(self, path, *args)

    monkeypatch.setattr(CheckpointStorage, "_crc32_of", forbidden)
    read_metadata_file = dcp_io.read_metadata_file

    def metadata_of_a_readable_step(fs: Any, step_path: str, *args: Any) -> Any:
        # (.metadata not read again where a file was not read: its reason was given twice)
        assert f"step_{EXPORTED_STEP:012d}" not in step_path
        return read_metadata_file(fs, step_path, *args)

    monkeypatch.setattr(dcp_io, "read_metadata_file", metadata_of_a_readable_step)
    assert cli.main(["verify", str(root), "--deep", "--json"]) == 1
    captured = capsys.readouterr()
    rows = {row["step"]: row for row in json.loads(captured.out)["steps"]}
    assert sorted(rows) == sorted(LOSSES)
    assert [step for step, row in rows.items() if not row["ok"]] == [EXPORTED_STEP]
    assert rows[EXPORTED_STEP]["unreadable"]
    assert "Permission denied" in rows[EXPORTED_STEP]["error"]
    assert f"step(s) that could not be read: [{EXPORTED_STEP}]" in captured.err
    # Damage found in one file is reported though another file could not be read (the
    # step was called unreadable alone: not damaged).
    data = next((root / f"step_{EXPORTED_STEP:012d}").glob("*.distcp"))
    damaged = bytearray(data.read_bytes())
    damaged[-1] ^= 0xFF
    data.write_bytes(bytes(damaged))

    def forbidden_objects(self: CheckpointStorage, path: str, *args: Any) -> Any:
        if f"step_{EXPORTED_STEP:012d}" in path and path.endswith(".json"):
            raise PermissionError(13, "Permission denied", path)
        return crc32_of(self, path, *args)

    monkeypatch.setattr(CheckpointStorage, "_crc32_of", forbidden_objects)
    assert cli.main(["verify", str(root), "--deep", "--json"]) == 1
    captured = capsys.readouterr()
    row = {row["step"]: row for row in json.loads(captured.out)["steps"]}[EXPORTED_STEP]
    assert [problem["path"] for problem in row["problems"]] == [data.name]
    assert not row["unreadable"] and "Permission denied" in row["error"]
    assert f"damaged step(s): [{EXPORTED_STEP}]" in captured.err
    assert cli.main(["verify", str(root), "--deep"]) == 1
    shown = capsys.readouterr().out
    assert f"step {EXPORTED_STEP}: not read: " in shown, shown


def test_another_librarys_error_is_shown_as_a_warning() -> None:
    """fsspec's prefetcher logs "Consumer caught an error." when an object it reads is deleted
    (another job's retention): verify showed "ckptmgr: error: ..." and then reported the step
    as deleted meanwhile, exiting 0. The command says what failed; a library's log is a
    warning. ckptmgr's own errors keep their level."""
    formatter = cli.OneLineFormatter()

    def shown(name: str, level: int, message: str) -> str:
        return formatter.format(logging.LogRecord(name, level, __file__, 1, message, (), None))

    assert shown("fsspec.prefetcher", logging.ERROR, "Consumer caught\n an error.") == (
        "ckptmgr: warning: fsspec.prefetcher: Consumer caught an error."
    )
    assert shown("ckptmgr.storage", logging.ERROR, "a failure") == "ckptmgr: error: a failure"
    assert shown("gcsfs", logging.WARNING, "retrying") == "ckptmgr: warning: gcsfs: retrying"


def test_rm_stops_once_a_job_took_the_root_over(
    source: SourceCheckpoint,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A job made with take_over=True takes the lease from a command still deleting; the
    command checks the lease before each delete and stops, deleting nothing more under the job
    (it went on deleting)."""
    root = copy_root(source, tmp_path)
    record = root / "owner.json"
    delete_step = CheckpointStorage.delete_step

    def then_taken_over(self: CheckpointStorage, step: int) -> None:
        delete_step(self, step)
        owner = Owner.from_json(record.read_bytes())  # a job takes the root over now
        record.write_bytes(Owner(**{**asdict(owner), "lease_id": "the-job"}).to_json())

    monkeypatch.setattr(CheckpointStorage, "delete_step", then_taken_over)
    assert cli.main(["rm", str(root), "10", "20", "30", "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["deleted"] == [10]
    assert "taken over" in captured.err
    assert committed_steps(root) == [20, 30, 40, 50]


def test_rm_whose_lease_check_fails_reports_every_problem(
    source: SourceCheckpoint,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A check of the lease that failed with an OSError (owner.json not to be read) escaped
    the report (empty stdout under --json, the deleted steps named nowhere), and a lease lost
    hid the steps that had failed to delete before it. Both are said, after the report."""
    root = copy_root(source, tmp_path)
    delete_step = CheckpointStorage.delete_step

    def failing_at_10(self: CheckpointStorage, step: int) -> None:
        if step == 10:
            raise PermissionError(13, "Permission denied (injected)", "step_000000000010")
        delete_step(self, step)

    checks = iter([None, None, PermissionError(13, "owner.json unreadable (injected)")])

    def confirm(self: Any) -> None:
        error = next(checks)
        if error is not None:
            raise error

    monkeypatch.setattr(CheckpointStorage, "delete_step", failing_at_10)
    monkeypatch.setattr(OwnerLease, "confirm", confirm)
    assert cli.main(["rm", str(root), "10", "20", "30", "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["deleted"] == [20]
    assert "could not delete step(s) [10]" in captured.err
    assert (
        "stopped before step 30: PermissionError: [Errno 13] owner.json unreadable" in captured.err
    )
    assert committed_steps(root) == [10, 30, 40, 50]
    assert not (root / "owner.json").exists()  # (the lease was given back)


def test_ctrl_c_while_rm_deletes_says_what_was_deleted(
    source: SourceCheckpoint,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Ctrl-C during the deletes printed only "ckptmgr: interrupted" (status 130), although
    steps were deleted; it names them."""
    root = copy_root(source, tmp_path)
    delete_step = CheckpointStorage.delete_step

    def interrupted_at_20(self: CheckpointStorage, step: int) -> None:
        if step == 20:
            raise KeyboardInterrupt
        delete_step(self, step)

    monkeypatch.setattr(CheckpointStorage, "delete_step", interrupted_at_20)
    assert cli.main(["rm", str(root), "10", "20", "30"]) == 130
    err = capsys.readouterr().err
    assert "ckptmgr: deleted step(s) [10] before Ctrl-C" in err and "interrupted" in err
    assert committed_steps(root) == [20, 30, 40, 50]


WITHOUT_TORCH = r"""
import contextlib, io, json, sys

import ckptmgr

assert "torch" not in sys.modules, "import ckptmgr imported torch"
from ckptmgr.cli import main

root = sys.argv[1]
codes = {}
for argv in (
    ["ls", root, "--all", "--json"],
    ["verify", root],
    ["prune", root, "--keep-latest", "2", "--dry-run"],
    ["rm", root, "10"],
):
    with contextlib.redirect_stdout(io.StringIO()):
        codes[argv[0]] = main(argv)
imported = sorted(name for name in sys.modules if name.split(".")[0] == "torch")
print(json.dumps({"codes": codes, "torch_modules": imported[:5]}))
"""


def test_ls_verify_prune_and_rm_run_without_importing_torch(
    source: SourceCheckpoint, tmp_path: Path
) -> None:
    """These commands read commit records and list files: without torch and DCP, which they
    do not need, a command takes a fraction of a second instead of 3-5 s of imports."""
    root = copy_root(source, tmp_path)
    result = run_python(WITHOUT_TORCH, str(root), timeout=COMMAND_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"codes": {"ls": 0, "verify": 0, "prune": 0, "rm": 0}, "torch_modules": []}
    assert committed_steps(root) == [20, 30, 40, 50], "rm deleted step 10 (and prune nothing)"


# -- the rest, as several main() calls in one child interpreter ------------------------------

BATCH_SCRIPT = r"""
import contextlib, gc, io, json, pickle, shutil, sys, zlib
from pathlib import Path

import fsspec
import torch
import torch.distributed.checkpoint as dcp

from ckptmgr import CheckpointManager
from ckptmgr.cli import console_main, main
from ckptmgr.record import record_bytes

source, work = Path(sys.argv[1]), Path(sys.argv[2])
results = {}


def run(name, *argv):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(list(argv))
        except SystemExit as exit_:
            code = exit_.code
    results[name] = {"rc": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}


# Object store semantics, in memory: no renames, leftovers are step dirs without commit.json.
with CheckpointManager("memory://cli-test", 1, chkpt_on_preemption=False) as mgr:
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.full((4,), float(step)), "epoch": step}, metrics={"acc": step})
fsspec.filesystem("memory").pipe("/cli-test/step_000000000009/__0_0.distcp", b"half")
run("mem_ls", "ls", "memory://cli-test", "--all", "--json", "-o", "skip_instance_cache=true")
run("mem_inspect", "inspect", "memory://cli-test", "2")
run("mem_export", "export", "memory://cli-test", "2", str(work / "mem.pt"))
run("mem_prune", "prune", "memory://cli-test", "--keep-best", "1", "--metric", "acc",
    "--mode", "min", "--json")
run("mem_rm", "rm", "memory://cli-test", "3")
run("mem_ls_after", "ls", "memory://cli-test", "--json")
results["mem_export_value"] = torch.load(work / "mem.pt", weights_only=True)["w"].tolist()

# Usage errors (argparse: exit 2) and expected errors (exit 1, one line).
run("prune_no_policy", "prune", str(source))
run("prune_metric_missing", "prune", str(source), "--keep-best", "2")
run("prune_bad_steps", "prune", str(source), "--keep-steps", "1,x")
run("bad_option", "ls", str(source), "-o", "novalue")
run("negative_rank", "export", str(source), "10", str(work / "r.pt"), "--rank", "-1")
run("empty_path", "ls", "")  # (it listed the working directory)
run("ls_missing", "ls", str(work / "nope"))
run("unknown_protocol", "ls", "nosuchprotocol://x")
run("inspect_missing_step", "inspect", str(source), "7")
run("export_bad_rank", "export", str(source), "10", str(work / "x.pt"), "--rank", "3")
run("export_no_dir", "export", str(source), "10", str(work / "no" / "x.pt"))
run("inspect_table", "inspect", str(source), "10")
run("ls_table", "ls", str(source))
run("ls_json_no_all", "ls", str(source), "--json")
results["nope_created"] = (work / "nope").exists()

# A step whose DCP data holds a pickled (BYTE_IO) item: refused, never unpickled.
pickled = work / "pickled"
shutil.copytree(source, pickled)
step_dir = pickled / "step_000000000010"
for data in step_dir.glob("*.distcp"):
    data.unlink()
dcp.save({"w": torch.ones(2), "note": "pickled"}, checkpoint_id=str(step_dir))


def match_record(step_dir):
    # The commit record is made to list the files as they are now (sizes and checksums), so
    # that only what the files hold can be refused.
    record_path = step_dir / "commit.json"
    record = json.loads(record_path.read_text())
    record["files"] = [
        {"path": p.name, "size": p.stat().st_size, "crc32": zlib.crc32(p.read_bytes())}
        for p in sorted(step_dir.iterdir())
        if p.is_file() and p.name != "commit.json"
    ]
    record_path.write_bytes(record_bytes(record))


match_record(step_dir)
run("export_pickled", "export", str(pickled), "10", str(work / "p.pt"))


# A .metadata that would call a function when unpickled: refused.
class Payload:
    def __reduce__(self):
        return (print, ("this must never run",))


(pickled / "step_000000000020" / ".metadata").write_bytes(pickle.dumps(Payload()))
match_record(pickled / "step_000000000020")
run("export_evil", "export", str(pickled), "20", str(work / "e.pt"))
results["pickled_outputs"] = sorted(p.name for p in work.glob("*.pt"))

# The console script's entry, last: main(), then what it made frozen (main() freezes nothing).
results["frozen_before_console_main"] = gc.get_freeze_count()
sys.argv = ["ckptmgr", "ls", str(source), "--json"]
with contextlib.redirect_stdout(io.StringIO()) as listed:
    results["console_main_rc"] = console_main()
results["console_main_listed"] = json.loads(listed.getvalue())
results["frozen_after_console_main"] = gc.get_freeze_count()
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def batch(source: SourceCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The results of the commands in ``BATCH_SCRIPT``, by name."""
    work = tmp_path_factory.mktemp("batch")
    result = run_python(BATCH_SCRIPT, str(source.root), str(work), timeout=COMMAND_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "this must never run" not in result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_memory_url_supports_every_command(batch: dict[str, Any]) -> None:
    ls = json.loads(batch["mem_ls"]["stdout"])
    assert [row["step"] for row in ls["steps"]] == [1, 2, 3]
    assert ls["leftovers"] == [
        {
            "name": "step_000000000009",
            "kind": "uncommitted_step",
            "age_s": ls["leftovers"][0]["age_s"],
            "size": 4,
        }
    ]
    assert batch["mem_inspect"]["rc"] == 0
    assert "w     float32  [4]    16 B" in batch["mem_inspect"]["stdout"]
    assert batch["mem_export"]["rc"] == 0 and batch["mem_export_value"] == [2.0] * 4
    assert batch["mem_export"]["stdout"].startswith("wrote step 2 (rank 0) to ")
    prune = json.loads(batch["mem_prune"]["stdout"])
    assert prune["to_delete"] == prune["deleted"] == [2]
    assert prune["policies"] == ["KeepBest(1, 'acc', min): one of the 1 lowest 'acc'"]
    assert batch["mem_rm"] == {"rc": 0, "stdout": "deleted step 3\n", "stderr": ""}
    assert [row["step"] for row in json.loads(batch["mem_ls_after"]["stdout"])["steps"]] == [1]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("prune_no_policy", "give at least one retention policy"),
        ("prune_metric_missing", "--keep-best needs --metric"),
        ("prune_bad_steps", "a step must be an integer, got 'x'"),
        ("bad_option", "expected KEY=VALUE, got 'novalue'"),
        ("negative_rank", "a rank must be >= 0, got -1"),
        ("empty_path", "argument PATH: PATH is empty"),
    ],
)
def test_usage_errors_exit_2(batch: dict[str, Any], name: str, message: str) -> None:
    assert batch[name]["rc"] == 2
    assert message in batch[name]["stderr"]
    assert batch[name]["stderr"].startswith("usage: ckptmgr")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("ls_missing", "/nope does not exist"),
        ("unknown_protocol", "Protocol not known: nosuchprotocol"),
        ("inspect_missing_step", "no committed checkpoint for step 7; available steps: [10,"),
        ("export_bad_rank", "--rank 3 is out of range: step 10 was saved by 1 rank(s)"),
        ("export_no_dir", "/no is not a directory"),
        ("export_pickled", "the checkpoint holds pickled objects ['note']; ckptmgr never"),
        ("export_evil", "refusing to load builtins.print"),
    ],
)
def test_expected_errors_exit_1_with_one_line(
    batch: dict[str, Any], name: str, message: str
) -> None:
    assert batch[name]["rc"] == 1
    assert message in one_error_line(batch[name]["stderr"])
    assert batch[name]["stdout"] == ""


def test_read_commands_create_and_write_nothing(batch: dict[str, Any]) -> None:
    assert batch["nope_created"] is False
    assert batch["pickled_outputs"] == ["mem.pt"], "refused exports leave no file"


def test_ls_prints_a_table_of_committed_steps(batch: dict[str, Any]) -> None:
    assert batch["ls_table"]["rc"] == 0 and batch["ls_table"]["stderr"] == ""
    header, *rows = batch["ls_table"]["stdout"].strip().splitlines()
    assert header.split() == ["STEP", "COMMITTED", "(UTC)", "SIZE", "METRICS"]
    assert [int(row.split()[0]) for row in rows] == sorted(LOSSES)
    for row in rows:
        step = int(row.split()[0])
        assert row.endswith(f"  loss={LOSSES[step]:g}"), row
        assert " KiB " in row


def test_the_console_script_runs_main_and_leaves_its_objects_to_the_kernel(
    batch: dict[str, Any],
) -> None:
    """``console_main`` (the ``ckptmgr`` script, ``python -m ckptmgr``) freezes the objects
    ``main`` left, so that the interpreter's finalization does not collect them (about 0.75 s
    with torch loaded); ``main`` itself, which a program may call, freezes nothing."""
    assert batch["frozen_before_console_main"] == 0, "main() froze the caller's objects"
    assert batch["console_main_rc"] == 0
    assert [entry["step"] for entry in batch["console_main_listed"]["steps"]] == sorted(LOSSES)
    assert batch["frozen_after_console_main"] > 0


def test_inspect_table_and_ls_json_without_all(batch: dict[str, Any]) -> None:
    table = batch["inspect_table"]["stdout"].splitlines()
    assert table[0].startswith("step 10 of ") and "by 1 rank(s)" in table[0]
    assert table[1] == "metrics: loss=0.9"
    assert table[3].split() == ["NAME", "DTYPE", "SHAPE", "SIZE"]
    assert any(line.split()[:3] == ["extras/half", "bfloat16", "[2,"] for line in table)
    assert table[-1].startswith("19 tensors, ")
    assert json.loads(batch["ls_json_no_all"]["stdout"])["leftovers"] is None


# -- helpers, in this process ------------------------------------------------------------------


def test_storage_option_values_are_json_when_they_parse() -> None:
    assert parse_storage_option("anon=true") == ("anon", True)
    assert parse_storage_option("retries=3") == ("retries", 3)
    assert parse_storage_option('headers={"a": 1}') == ("headers", {"a": 1})
    assert parse_storage_option("project=my-proj") == ("project", "my-proj")
    assert parse_storage_option("token=a=b") == ("token", "a=b")
    assert parse_storage_option("empty=") == ("empty", "")


def test_paths_unescape_into_nested_dicts_and_clashes_are_refused() -> None:
    assert unescape_key("a%2Fb%25c%252F") == "a/b%c%2F"
    tree = NestedState()
    tree.insert("model/fc.weight", 1)
    tree.insert("x/a%2Fb", 2)
    assert tree.root == {"model": {"fc.weight": 1}, "x": {"a/b": 2}}
    with pytest.raises(CheckpointError, match="also under or above it"):
        tree.insert("model/fc.weight/extra", 3)
    with pytest.raises(CheckpointError, match="also under or above it"):
        tree.insert("model", 4)
