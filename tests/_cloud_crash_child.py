"""Child process of tests/test_cloud_crash.py: commits step 0, then starts saving step 1.

Run as ``python _cloud_crash_child.py ROOT OPTIONS_JSON`` from the tests directory with the
repository root on ``PYTHONPATH``. The parent's proxy holds the upload of step 1's data file and
the parent kills this process with SIGKILL while it waits in that upload. It prints
``committed <step>`` after each save returns; a watchdog (``SIGALRM``) ends it if nobody does.
"""

from __future__ import annotations

import json
import signal
import sys

from _cloud_state import make_state

from ckptmgr import CheckpointManager

WATCHDOG_S = 240


def main() -> int:
    root, options = sys.argv[1], json.loads(sys.argv[2])
    signal.alarm(WATCHDOG_S)  # the default action of SIGALRM ends the process
    with CheckpointManager(root, 1, chkpt_on_preemption=False, storage_options=options) as manager:
        manager.save(0, make_state(0))
        print("committed 0", flush=True)
        manager.save(1, make_state(1))
        print("committed 1", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
