"""The ``ckptmgr`` command line on gs:// and s3:// roots (servers on 127.0.0.1).

The storage options reach the CLI as ``-o KEY=VALUE``, as a user would pass credentials and an
endpoint; the JSON output is checked against what the manager wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from _cloud_servers import (  # noqa: F401  (the *_fixture functions are fixtures)
    Server,
    require_cloud_modules,
    root_fixture,
    server_fixture,
)

require_cloud_modules()

from _cloud_state import make_state  # noqa: E402
from conftest import REPO  # noqa: E402

from ckptmgr import CheckpointManager  # noqa: E402
from ckptmgr.storage import CheckpointStorage  # noqa: E402

pytestmark = [pytest.mark.cloud, pytest.mark.timeout(240)]
CLI_TIMEOUT_S = 120.0


def cli(*args: str, options: dict[str, Any]) -> Any:
    """``python -m ckptmgr ARGS --json -o KEY=VALUE...``, parsed; fails on a non-zero exit."""
    flags = [f"-o{key}={value}" for key, value in options.items()]
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    result = subprocess.run(
        [sys.executable, "-m", "ckptmgr", *args, "--json", *flags],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        cwd=REPO,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


def test_ls_and_inspect_read_the_object_store(server: Server, root: str) -> None:
    options = server.storage_options()
    with CheckpointManager(root, 1, chkpt_on_preemption=False, storage_options=options) as mgr:
        mgr.save(1, make_state(1), metrics={"loss": 0.5})
        mgr.save(2, make_state(2), metadata={"git": "abc123"})
    storage = CheckpointStorage(root, options)
    storage.fs.pipe_file(f"{storage.step_path(9)}/__0_0.distcp", b"an interrupted save")

    listing = cli("ls", root, "--all", options=options)
    assert [entry["step"] for entry in listing["steps"]] == [1, 2]
    assert listing["steps"][0]["metrics"] == {"loss": 0.5}
    assert listing["steps"][1]["metadata"] == {"git": "abc123"}
    sizes = {step: sum(f.size for f in storage.read_record(step).files) for step in (1, 2)}
    assert [entry["size"] for entry in listing["steps"]] == [sizes[1], sizes[2]]
    assert [leftover["name"] for leftover in listing["leftovers"]] == ["step_000000000009"]

    report = cli("inspect", root, "2", options=options)
    assert report["step"] == 2
    expected = {
        f"model/{name}": (str(tensor.dtype).removeprefix("torch."), list(tensor.shape))
        for name, tensor in make_state(2)["model"].items()
    }
    assert {t["name"]: (t["dtype"], t["shape"]) for t in report["tensors"]} == expected
    assert {f["path"] for f in report["files"]} == {
        ".metadata",
        "__0_0.distcp",
        "objects-rank00000.json",
    }


def test_an_object_named_as_the_root_does_not_hide_it(server: Server, root: str) -> None:
    """An object whose key is the root's (``run`` beside ``run/...``): gcsfs answers it for
    the root, which the command line then refused ("is not a directory"), while the manager
    used the root as it is."""
    options = server.storage_options()
    with CheckpointManager(root, 1, chkpt_on_preemption=False, storage_options=options) as mgr:
        mgr.save(1, make_state(1))
    storage = CheckpointStorage(root, options)
    storage.fs.pipe_file(storage.root, b"an object of another tool")
    assert [entry["step"] for entry in cli("ls", root, options=options)["steps"]] == [1]
    assert [entry["step"] for entry in cli("verify", root, options=options)["steps"]] == [1]


def test_a_root_whose_steps_were_all_deleted_lists_none(server: Server, root: str) -> None:
    """An object store has no empty directories: after rm of every step the root was no
    prefix of any object, and ls and prune failed with "does not exist" (status 1) where an
    emptied local root lists no steps. A root in a bucket that does not exist still fails."""
    options = server.storage_options()
    with CheckpointManager(root, 1, chkpt_on_preemption=False, storage_options=options) as mgr:
        mgr.save(1, make_state(1))
    assert cli("rm", root, "1", options=options)["deleted"] == [1]
    assert cli("ls", root, options=options)["steps"] == []
    assert cli("prune", root, "--keep-latest", "1", options=options)["decisions"] == []
    flags = [f"-o{key}={value}" for key, value in options.items()]
    missing = f"{server.scheme}://no-such-bucket-for-cli/run"
    result = subprocess.run(
        [sys.executable, "-m", "ckptmgr", "ls", missing, *flags],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore"),
        check=False,
    )
    assert result.returncode == 1 and f"{missing} does not exist" in result.stderr
