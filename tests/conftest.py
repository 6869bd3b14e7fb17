"""Shared fixtures: real processes and real files, nothing mocked."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptmgr.torch_versions import CHECKED_TORCH, checked_torch

REPO = Path(__file__).resolve().parent.parent
ABORT_GRACE_S = 10.0  # for a timed-out child to print its tracebacks

checked_torch_only = pytest.mark.skipif(
    not checked_torch(),
    reason=f"on a torch outside {CHECKED_TORCH}, ckptmgr runs DCP's own steps where it would run "
    "its own (ckptmgr.torch_versions), and the requests and collectives differ",
)
"""For tests of what ckptmgr's own versions of DCP's steps save in requests or collectives."""


def run_python(
    code_or_path: str | Path, *args: str, timeout: float = 120, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run Python code (a string) or a script (a Path) in a fresh interpreter; bounded in time."""
    command = [sys.executable, "-X", "faulthandler"]
    command += [str(code_or_path)] if isinstance(code_or_path, Path) else ["-c", code_or_path]
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    return run_bounded([*command, *args], timeout=timeout, cwd=cwd, env=env)


def run_bounded(
    command: list[str], *, timeout: float, env: dict[str, str], cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` to its end within ``timeout`` seconds, its output captured.

    A child still running then fails the test with what it printed and, when it runs Python
    with ``-X faulthandler``, where each of its threads was: it gets SIGABRT first (which
    faulthandler answers with every thread's traceback), and SIGKILL if that does not end it.
    """
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        try:
            stdout, stderr = process.communicate(timeout=ABORT_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        pytest.fail(
            f"{command[:3]} still ran after {timeout} s; its stdout:\n{stdout[-3000:]}\n"
            f"its stderr (with its threads' tracebacks):\n{stderr[-12000:]}"
        )
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


ONE_GLOO_RANK = r"""
import os, socket
import torch.distributed as dist

with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
"""
"""The start of a script run by :func:`run_on_one_gloo_rank`: a process group of one rank."""


def run_on_one_gloo_rank(tmp_path: Path, name: str, body: str) -> None:
    """Run ``ONE_GLOO_RANK`` and then ``body`` (which imports what it uses and destroys the
    group) as a script in a new interpreter, with the repository and ``tests/`` importable,
    bounded in time; it must print "ok"."""
    script = tmp_path / f"{name}.py"
    script.write_text(ONE_GLOO_RANK + body)
    path = os.pathsep.join([str(REPO), str(REPO / "tests")])
    command = [sys.executable, "-X", "faulthandler", str(script)]
    result = run_bounded(command, timeout=120, env={**os.environ, "PYTHONPATH": path})
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr


def in_forked_child(work: Callable[[], bytes], timeout_s: float = 60.0) -> bytes:
    """What ``work`` returns when run in a forked child (or what went wrong there)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        answer = b"child raised"
        try:
            import torch  # (imported by the caller already)

            torch.set_num_threads(1)  # (no intra-op thread pool in a forked child)
            answer = work()
        except BaseException as exc:
            answer = f"child raised {exc!r}".encode()
        finally:
            os.write(write_end, answer)
            os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], timeout_s)
        answer = os.read(read_end, 4096) if ready else b"timed out"
    finally:
        os.close(read_end)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    assert answer, f"the child died without answering (wait status {status})"
    return answer


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    """An empty directory for one test's checkpoints."""
    path = tmp_path / "ckpts"
    return path


def held_dcp_writes(bound_s: float) -> tuple[threading.Event, threading.Event, Any]:
    """Fault injection, a slow write: (writing, release, save_tensors), where ``save_tensors``
    replaces ``ckptmgr.dcp_io.save_tensors`` (set it with monkeypatch): each write sets
    ``writing``, then waits for ``release`` (at most ``bound_s``) before it writes."""
    from ckptmgr import dcp_io

    writing, release = threading.Event(), threading.Event()
    original = dcp_io.save_tensors

    def held_write(*args: Any, **kwargs: Any) -> Any:
        writing.set()
        assert release.wait(bound_s), "the test never released the write"
        return original(*args, **kwargs)

    return writing, release, held_write


def listed_table(record: dict[str, Any]) -> dict[str, list[Any]]:
    """The ``tensor_table`` of a parsed commit.json (format 3 or 4), stored again in it with
    every column a list (format 4 may store columns in runs), to read or edit row by row."""
    from ckptmgr.tensor_table import TensorTable

    table = TensorTable.from_columns(record["tensor_table"])
    columns = [table.names, table.dtypes, table.shapes, table.pack_offsets]
    record["tensor_table"] = {
        "names": list(table.names),
        "dtypes": list(table.dtypes),
        "shapes": [list(shape) for shape in table.shapes],  # (a run shares one list)
        "pack_offsets": list(table.pack_offsets),
    }
    assert [len(column) for column in columns] == [len(table.names)] * 4
    return record["tensor_table"]


def tensor_rows(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The ``tensor_table`` of a parsed commit.json (format 3 or 4) as stored name ->
    ``{"dtype", "shape", "offset"}`` (``offset`` None: stored on its own, not in the pack).
    Leaves every column of ``record``'s table a list (see :func:`listed_table`)."""
    table = listed_table(record)
    columns = zip(
        table["names"], table["dtypes"], table["shapes"], table["pack_offsets"], strict=True
    )
    return {
        name: {"dtype": dtype, "shape": shape, "offset": offset}
        for name, dtype, shape, offset in columns
    }


def set_tensor_rows(record: dict[str, Any], rows: dict[str, dict[str, Any]]) -> None:
    """Store ``rows`` (as :func:`tensor_rows` gives them) as ``record``'s ``tensor_table``."""
    record["tensor_table"] = {
        "names": list(rows),
        "dtypes": [row["dtype"] for row in rows.values()],
        "shapes": [row["shape"] for row in rows.values()],
        "pack_offsets": [row["offset"] for row in rows.values()],
    }


def packed_names(record: dict[str, Any]) -> set[str]:
    """The stored names of the packed tensors of a parsed commit.json (format 3 or 4)."""
    return {name for name, row in tensor_rows(record).items() if row["offset"] is not None}
