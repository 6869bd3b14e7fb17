"""Pausing Python's cyclic garbage collector while ckptmgr walks a big state.

Saving or restoring a state of many tensors allocates tens of thousands of small objects that
live on (paths, staged views, record entries). Each time enough of them survive, CPython runs a
full collection, which traverses every object of the process: with a big model and optimizer in
memory, these collections took more than half of a 20,000-tensor restore. Nothing ckptmgr makes
in such a section forms reference cycles that need the collector, so it is paused for the
section and resumes after it; garbage from elsewhere is collected then, as usual.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0  # sections open now, on any thread
_resume = False  # whether the collector was enabled when the first of them opened


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic garbage collector for the ``with`` block (nested and concurrent
    blocks are counted; the collector resumes when the last ends, if it was enabled before)."""
    global _depth, _resume
    counted = False
    try:
        with _lock:
            # Python raises a Ctrl-C after a call: one between gc.disable() and the count left
            # the collector disabled for good. So the state is whole after each call: nothing
            # changed after isenabled(), the count and what to resume set before disable().
            if _depth == 0:
                enabled = gc.isenabled()
                _resume, _depth, counted = enabled, 1, True
                gc.disable()
            else:
                _depth, counted = _depth + 1, True
        yield
    finally:
        if counted:
            with _lock:
                _depth -= 1
                if _depth == 0 and _resume:
                    gc.enable()
