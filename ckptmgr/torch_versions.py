"""Which torch versions ckptmgr's own versions of DCP's steps were checked against.

ckptmgr runs some of DCP's steps itself (the load steps over a group, the writing of
``.metadata``), relying on what DCP's own code does in them. Where that was read in DCP's code
of a range of torch versions, the shortcut is taken only on those versions; on any other,
DCP's own step runs.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)
_told = False  # (checked_torch logged that this torch is not checked)

CHECKED_TORCH = ((2, 10), (2, 14))
"""The lowest and highest (major, minor) torch versions whose DCP code ckptmgr's steps were
checked against."""


def torch_version() -> tuple[int, int]:
    """This torch's (major, minor) version."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def checked_torch() -> bool:
    """True where this torch is within :data:`CHECKED_TORCH`. Where it is not, says so once
    per process in the log (INFO): DCP's own steps run, which are slower."""
    global _told
    low, high = CHECKED_TORCH
    version = torch_version()
    checked = low <= version <= high
    if not checked and not _told:
        _told = True
        log.info(
            "torch %d.%d is outside %d.%d-%d.%d, the versions whose DCP code ckptmgr's own "
            "versions of some of DCP's steps were checked against: DCP's own steps run instead "
            "(the same checkpoints, more time per save and restore)",
            *version,
            *low,
            *high,
        )
    return checked
