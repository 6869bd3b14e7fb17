"""Version of the ckptmgr package."""

__version__ = "0.1.0"
