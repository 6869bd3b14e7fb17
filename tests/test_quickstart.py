"""``make demo``: examples/quickstart.py kills a real training child and resumes it exactly."""

from __future__ import annotations

import re
import time
from pathlib import Path

from conftest import REPO, run_python

QUICKSTART = REPO / "examples" / "quickstart.py"


def test_quickstart_kills_resumes_and_proves_the_loss_curve(tmp_path: Path) -> None:
    started = time.monotonic()
    result = run_python(QUICKSTART, timeout=120, cwd=tmp_path)
    elapsed = time.monotonic() - started
    output = result.stdout
    assert result.returncode == 0, f"stdout:\n{output}\nstderr:\n{result.stderr}"
    assert elapsed < 60, f"the demo took {elapsed:.1f} s; it must finish in under a minute"

    # It checkpointed into ./checkpoints of the working directory.
    assert (tmp_path / "checkpoints").is_dir()
    assert "SIGKILL at step" in output

    found = re.search(r"found committed steps: \[([\d, ]+)\]", output)
    resumed = re.search(r"resumed from step (\d+)", output)
    assert found and resumed, output
    found_steps = [int(step) for step in found.group(1).split(",")]
    assert len(found_steps) >= 2
    assert int(resumed.group(1)) == max(found_steps)

    rows = re.findall(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+(yes|NO)$", output, re.MULTILINE)
    assert rows, output
    assert int(rows[0][0]) == int(resumed.group(1)) + 1
    assert all(before == after and match == "yes" for _, before, after, match in rows)
    assert "match the killed run bit for bit" in output

    losses = re.search(r"loss at step 1: ([\d.]+); final loss at step \d+: ([\d.]+)", output)
    assert losses, output
    assert float(losses.group(2)) < float(losses.group(1))
