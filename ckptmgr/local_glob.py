"""Matching a pattern under a local directory in one call of the C library, without the GIL.

Listing the committed steps of a local root looks inside every step directory (is its commit
record there? its quarantine marker?). Done with ``os.path.exists``, that is a ``stat`` per step,
and each one releases and takes back the GIL. A training loop that is itself Python-bound, on
another thread, loses every such hand-over: 7-8 ms of its time per 1000 ``stat`` calls here (2
cores), against 0.4-0.5 ms for one ``glob(3)`` over the same files, which does the same work in
C, in one call that ctypes makes with the GIL released (docs/benchmarks.md, "The listing and
retention after each commit").

Only on Linux (glibc and musl lay out ``glob_t`` alike in the fields read here); elsewhere, and
whenever the C library reports an error, :func:`match` returns None and the caller lists in
Python, which then raises or skips exactly as it always did.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

_GLOB_ERR = 1 << 0  # return on a directory that cannot be read (the caller lists in Python)
_GLOB_NOSORT = 1 << 2
_GLOB_NOMATCH = 3
_SPECIAL = "\\*?["  # what glob(3) reads as a pattern in a path; escaped in the directory


class _GlobT(ctypes.Structure):
    """The leading fields of ``glob_t`` (glibc, musl), and room for the rest of it."""

    _fields_ = [
        ("gl_pathc", ctypes.c_size_t),
        ("gl_pathv", ctypes.POINTER(ctypes.c_char_p)),
        ("gl_offs", ctypes.c_size_t),
        ("gl_rest", ctypes.c_void_p * 16),
    ]


def _load() -> tuple[Any, Any] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the process's C library; CDLL calls release the GIL
        glob, globfree = libc.glob, libc.globfree
    except (OSError, AttributeError):
        return None
    glob.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(_GlobT)]
    glob.restype = ctypes.c_int
    globfree.argtypes = [ctypes.POINTER(_GlobT)]
    globfree.restype = None
    return glob, globfree


_FUNCTIONS = _load()


def available() -> bool:
    """Whether :func:`match` can answer here (else it always returns None)."""
    return _FUNCTIONS is not None


def escape(directory: str) -> str:
    """``directory`` with every character glob(3) would read as a pattern escaped."""
    return "".join("\\" + char if char in _SPECIAL else char for char in directory)


def match(directory: str, pattern: str) -> list[str] | None:
    """The paths under ``directory`` that match ``pattern`` (relative to it, ``/``-separated;
    ``*``, ``?`` and ``[...]`` as in the shell, no leading dot matched), relative to
    ``directory``, in no particular order; ``[]`` where nothing matches.

    None where this cannot answer: not Linux, no ``glob`` in the C library, or a directory on
    the way that could not be opened, ``directory`` itself included where it is missing (the
    caller then lists in Python).
    """
    if _FUNCTIONS is None:
        return None
    glob, globfree = _FUNCTIONS
    prefix = directory.rstrip("/") + "/"
    found = _GlobT()
    code = glob(os.fsencode(escape(prefix) + pattern), _GLOB_ERR | _GLOB_NOSORT, None, found)
    try:
        if code == _GLOB_NOMATCH:
            return []
        if code != 0:
            return None
        raw_prefix = os.fsencode(prefix)
        start = len(raw_prefix)
        encoding, errors = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()
        paths = found.gl_pathv[: found.gl_pathc]
        relative = [p[start:].decode(encoding, errors) for p in paths if p.startswith(raw_prefix)]
        return relative if len(relative) == len(paths) else None
    finally:
        globfree(found)
