"""A real 2-rank ``torchrun`` job (gloo on 127.0.0.1, CPU) saving to and restoring from gs:// and
s3:// servers on 127.0.0.1.

The worker (``tests/_cloud_dist_worker.py``) saves with ``save`` and ``save_async`` under
``max_to_keep=2``, restores the kept steps (replicated tensors, a per-rank tensor, per-rank plain
values) and reopens the root with a new manager; here the records of both ranks are checked, and
the store is read directly. The launch is bounded; a launch that overruns is killed with its
process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _cloud_servers import (  # noqa: F401  (the *_fixture functions are fixtures)
    Server,
    free_port,
    require_cloud_modules,
    root_fixture,
    server_fixture,
)

require_cloud_modules()

from conftest import REPO  # noqa: E402

from ckptmgr.storage import CheckpointStorage  # noqa: E402

pytestmark = [pytest.mark.cloud, pytest.mark.timeout(300)]
TESTS = Path(__file__).resolve().parent
WORKER = TESTS / "_cloud_dist_worker.py"
LAUNCH_TIMEOUT_S = 200.0
PORT_ATTEMPTS = 3


def torchrun(out_dir: Path, root: str, options: dict[str, Any]) -> tuple[int | None, str]:
    """Run the worker on 2 ranks; (exit status or None after a kill, output tail)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    output = ""
    returncode: int | None = None
    for _ in range(PORT_ATTEMPTS):  # the free port may be taken between probing and binding
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            "--max-restarts=0",
            "--monitor-interval=0.1",
            str(WORKER),
            str(out_dir),
            root,
            json.dumps(options),
        ]
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=TESTS,
            env=env,
            start_new_session=True,
        )
        try:
            output, _ = process.communicate(timeout=LAUNCH_TIMEOUT_S)
            returncode = process.returncode
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate(timeout=30)
            output += f"\n[test] killed after {LAUNCH_TIMEOUT_S:.0f}s"
            returncode = None
        if returncode == 0 or "address already in use" not in output.lower():
            break
    return returncode, output[-6000:]


def test_two_ranks_save_and_restore_on_the_object_store(
    server: Server, root: str, tmp_path: Path
) -> None:
    started = time.monotonic()
    returncode, output = torchrun(tmp_path, root, server.storage_options())
    print(f"{server.kind}: torchrun took {time.monotonic() - started:.1f}s")
    assert returncode == 0, output
    records = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    for rank, record in records.items():
        assert "crash" not in record, f"rank {rank}:\n{record['crash']}\n{output}"
        assert record["rank"] == rank and record["world_size"] == 2
        assert record["initial"] == []
        assert record["after_saves"] == [2, 3], record
        assert record["restored"] == {"2": [], "3": []}, record
        assert record["reopened"] == [2, 3]
        assert record["reopened_restore"] == []

    storage = CheckpointStorage(root, server.storage_options())
    assert storage.committed_steps() == [2, 3]
    record = storage.read_record(3)
    assert record.world_size == 2
    names = {entry.path for entry in record.files}
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= names, names
    assert {"objects-rank00000.json", "objects-rank00001.json"} <= names, names
    assert storage.leftovers() == []
