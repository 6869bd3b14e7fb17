"""``python -m ckptmgr``: the same command line as the ``ckptmgr`` console script."""

from __future__ import annotations

import sys

from ckptmgr.cli import console_main

if __name__ == "__main__":
    sys.exit(console_main())
