"""Ending the process from a thread that is not the main thread."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn


def end_process_now(code: int) -> NoReturn:
    """Flush logging and the standard streams, then end the process with status ``code``.

    For a thread that is not the main thread, where ``SystemExit`` ends only that thread:
    ``os._exit``, so exit hooks (``atexit``), other threads' ``finally`` blocks (another
    manager's pending saves) and the interpreter's finalization do not run.
    """
    with contextlib.suppress(Exception):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
