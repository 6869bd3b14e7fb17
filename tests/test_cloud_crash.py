"""A save killed with SIGKILL in the middle of an upload to GCS or S3 leaves no listed step.

A real child process (``tests/_cloud_crash_child.py``) commits step 0 and starts saving step 1;
the fault proxy holds the upload of step 1's data file, so the child is known to be mid-upload
when it is killed: no sleep decides the moment. The held request is then dropped (the upload
never completes). Afterwards a new manager lists only step 0, keeps the young leftover of step 1,
and a manager with ``leftover_grace_s=0`` removes it, after which step 1 can be saved again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _cloud_servers import (  # noqa: F401  (the *_fixture functions are fixtures)
    FaultProxy,
    Server,
    is_data_upload,
    proxy_fixture,
    require_cloud_modules,
    root_fixture,
    server_fixture,
)

require_cloud_modules()

from _cloud_state import blank_like, differences, make_state  # noqa: E402
from conftest import REPO  # noqa: E402

from ckptmgr import CheckpointManager, StepNotFoundError  # noqa: E402
from ckptmgr.storage import CheckpointStorage  # noqa: E402

pytestmark = [pytest.mark.cloud, pytest.mark.timeout(300)]
TESTS = Path(__file__).resolve().parent
CHILD = TESTS / "_cloud_crash_child.py"
MID_UPLOAD_TIMEOUT_S = 150.0  # importing torch on a busy 2-core machine, then step 0
EXIT_TIMEOUT_S = 30.0
STEP_1 = "step_000000000001"


def step_1_data_upload(method: str, path: str) -> bool:
    return is_data_upload(method, path) and STEP_1 in path


def test_sigkill_mid_upload_leaves_no_listed_step_and_the_next_manager_cleans_up(
    server: Server, root: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    options = server.storage_options(proxy.url)
    proxy.hold(step_1_data_upload)
    stderr_path = tmp_path / "child.stderr"
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    with open(stderr_path, "wb") as stderr:
        child = subprocess.Popen(
            [sys.executable, str(CHILD), root, json.dumps(options)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=TESTS,
            env=env,
        )
    try:
        arrived = proxy.wait_for(step_1_data_upload, 1, MID_UPLOAD_TIMEOUT_S)
        assert arrived, f"the child never uploaded step 1:\n{stderr_path.read_text()[-4000:]}"
        assert child.poll() is None, stderr_path.read_text()[-4000:]
        child.send_signal(signal.SIGKILL)
        assert child.wait(EXIT_TIMEOUT_S) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(EXIT_TIMEOUT_S)
        proxy.release(drop=True)  # the held upload never reaches the server
    assert child.stdout is not None
    assert child.stdout.read().decode().split() == ["committed", "0"]

    storage = CheckpointStorage(root, server.storage_options())
    assert storage.committed_steps() == [0]
    leftovers = storage.leftovers()
    assert [leftover.name for leftover in leftovers] == [STEP_1]
    assert leftovers[0].age_s is not None and leftovers[0].age_s < 600

    with CheckpointManager(root, 1, chkpt_on_preemption=False, storage_options=options) as mgr:
        assert mgr.all_steps() == [0]  # the young leftover is kept: it might be a live writer
        with pytest.raises(StepNotFoundError):
            mgr.restore(1, blank_like(make_state(1)))
    assert [leftover.name for leftover in storage.leftovers()] == [STEP_1]

    with CheckpointManager(
        root, 1, chkpt_on_preemption=False, storage_options=options, leftover_grace_s=0
    ) as mgr:
        assert storage.leftovers() == []
        assert mgr.all_steps() == [0]
        for step in (0, 1):
            if step == 1:
                assert mgr.save(1, make_state(1))
            state = blank_like(make_state(step))
            mgr.restore(step, state)
            assert differences(state, make_state(step)) == [], f"step {step}"
    assert storage.committed_steps() == [0, 1]
