"""Background threads run at one level below the training loop: never lower for being started
by another background thread, never higher than they already are."""

from __future__ import annotations

import json
import os
import sys
import threading

import pytest
from conftest import run_python

from ckptmgr.niceness import BACKGROUND_NICENESS, run_calling_thread_in_background

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread nice values: Linux"
)
WAIT_S = 60.0


def _own_niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _in_thread(work: object) -> None:
    thread = threading.Thread(target=work)  # type: ignore[arg-type]
    thread.start()
    thread.join(WAIT_S)
    assert not thread.is_alive()


def test_a_background_thread_started_by_one_stays_at_the_same_level() -> None:
    # The writer starts the hashing thread and the daemon: steps would add up to 19.
    main = os.getpriority(os.PRIO_PROCESS, os.getpid())
    seen: dict[str, int] = {}

    def inner() -> None:
        run_calling_thread_in_background()
        seen["inner"] = _own_niceness()

    def outer() -> None:
        run_calling_thread_in_background()
        seen["outer"] = _own_niceness()
        _in_thread(inner)

    _in_thread(outer)
    expected = min(19, main + BACKGROUND_NICENESS)
    assert seen == {"outer": expected, "inner": expected}
    assert os.getpriority(os.PRIO_PROCESS, os.getpid()) == main


def test_a_thread_already_below_the_level_is_not_raised() -> None:
    seen: list[int] = []

    def work() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        run_calling_thread_in_background()
        seen.append(_own_niceness())

    _in_thread(work)
    assert seen == [19]


def test_a_helper_process_takes_its_training_process_level_for_all_its_threads() -> None:
    # The daemon is started by the writer thread (already at the background level) and is told
    # its training process's level: it must not go BACKGROUND_NICENESS lower still.
    result = run_python(
        """
import json, os, threading
from ckptmgr import niceness
main = os.getpriority(os.PRIO_PROCESS, os.getpid())
release = threading.Event()
waiting = threading.Thread(target=lambda: release.wait(60))
waiting.start()
niceness.set_background_niceness(main + 3)
tids = [int(task) for task in os.listdir("/proc/self/task")]
before = {str(tid): os.getpriority(os.PRIO_PROCESS, tid) for tid in tids}
later = []
def late():
    niceness.run_calling_thread_in_background()
    later.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
thread = threading.Thread(target=late)
thread.start(); thread.join(60)
release.set(); waiting.join(60)
print(json.dumps({"main": main, "level": niceness.background_niceness(), "threads": before,
                  "later": later}))
""",
        timeout=WAIT_S,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    level = seen["main"] + 3
    assert seen["level"] == level
    assert len(seen["threads"]) >= 2 and set(seen["threads"].values()) == {level}
    assert seen["later"] == [level]
