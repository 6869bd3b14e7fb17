"""The cyclic garbage collector is paused inside save/restore and always resumes after."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckptmgr import CheckpointError, CheckpointManager
from ckptmgr.gc_pause import gc_paused


@pytest.fixture(autouse=True)
def collector_enabled() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_nested_and_concurrent_pauses_resume_when_the_last_ends() -> None:
    inside = threading.Event()
    release = threading.Event()

    def other_thread() -> None:
        with gc_paused():
            inside.set()
            assert release.wait(30)

    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer block is still open
        thread = threading.Thread(target=other_thread)
        thread.start()
        assert inside.wait(30)
    assert not gc.isenabled()  # the other thread's block is still open
    release.set()
    thread.join(30)
    assert not thread.is_alive()
    assert gc.isenabled()


def test_a_collector_disabled_by_the_user_stays_disabled() -> None:
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def test_an_exception_inside_resumes_the_collector() -> None:
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("boom")
    assert gc.isenabled()


def test_save_and_restore_leave_the_collector_as_they_found_it(tmp_path: Path) -> None:
    state = {"w": torch.arange(6.0), "opt": {"step": 3}}
    seen: list[bool] = []

    class Probe:
        def state_dict(self) -> dict[str, object]:
            seen.append(gc.isenabled())
            return {"x": 1}

        def load_state_dict(self, value: dict[str, object]) -> None:
            seen.append(gc.isenabled())

    state["probe"] = Probe()
    with CheckpointManager(tmp_path, 1) as mgr:
        assert mgr.save(1, state)
        assert mgr.save_async(2, state)
        mgr.join()
        assert gc.isenabled()
        mgr.restore(2, state)
        assert gc.isenabled()
        with pytest.raises(CheckpointError):
            mgr.restore(2, {**state, "missing": torch.zeros(1)})
        assert gc.isenabled()
    assert len(seen) >= 3 and not any(seen)  # paused while ckptmgr walked the state


def test_a_ctrl_c_as_the_collector_is_disabled_leaves_it_enabled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C between ``gc.disable()`` and the count of open pauses (Python raises it after a
    call) left the collector disabled for good: a notebook or a script that caught the
    KeyboardInterrupt and went on grew without bound on its cyclic garbage."""
    import signal

    from ckptmgr import gc_pause

    armed = [True]

    class DisableThenCtrlC:
        def __getattr__(self, name: str) -> object:
            return getattr(gc, name)

        def disable(self) -> None:
            gc.disable()
            # (once, here: not in a background thread of another test's manager)
            if armed and threading.current_thread() is threading.main_thread():
                armed.pop()
                signal.raise_signal(signal.SIGINT)  # (Python's handler: a KeyboardInterrupt)

    monkeypatch.setattr(gc_pause, "gc", DisableThenCtrlC())
    with pytest.raises(KeyboardInterrupt), gc_paused():
        pass
    assert not armed
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_ctrl_c_as_the_collector_is_asked_about_leaves_it_as_the_user_set_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the count taken before ``gc.isenabled()``, a Ctrl-C as that call returned resumed
    the collector by an earlier pause's answer: one the user had turned off came back on."""
    import signal

    from ckptmgr import gc_pause

    with gc_paused():  # an earlier pause, made with the collector on
        pass
    armed = [True]

    class AskThenCtrlC:
        def __getattr__(self, name: str) -> object:
            return getattr(gc, name)

        def isenabled(self) -> bool:
            enabled = gc.isenabled()
            if armed and threading.current_thread() is threading.main_thread():
                armed.pop()
                signal.raise_signal(signal.SIGINT)  # (Python's handler: a KeyboardInterrupt)
            return enabled

    gc.disable()  # the user's
    try:
        monkeypatch.setattr(gc_pause, "gc", AskThenCtrlC())
        with pytest.raises(KeyboardInterrupt), gc_paused():
            pass
        assert not armed
        assert not gc.isenabled()
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
