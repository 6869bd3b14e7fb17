"""A file trigger: preemption when a path appears (Kubernetes preStop hooks, custom tooling)."""

from __future__ import annotations

import os

from ckptmgr.notices.base import NoticeBoard, Watcher, log

_Identity = tuple[int, int, int]


def _identity(path: str) -> _Identity | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_mtime_ns)


class FileWatcher(Watcher):
    """Checks ``path`` every ``poll_interval_s``; posts ``"file <path>"`` when it appears, or is
    touched or replaced. A file that exists already at start is stale (left by an earlier run)
    and is ignored until it changes."""

    name = "file"

    def __init__(self, board: NoticeBoard, path: str, *, poll_interval_s: float) -> None:
        super().__init__(board, auto=False, poll_interval_s=poll_interval_s)
        self.path = path
        self._seen: _Identity | None = None

    def start(self) -> None:
        """Note what is at ``path`` now, on the caller's thread, then start watching: a file
        made once the manager (or monitor) is made is a notice, however late the watcher's
        thread first looks (it took such a file for a stale one, now and then)."""
        self._seen = _identity(self.path)
        super().start()

    def probe(self, timeout: float) -> None:
        if self._seen is not None:
            log.warning(
                "preemption trigger file %s exists already: ignored until it is touched or "
                "recreated (delete it when a job restarts)",
                self.path,
            )

    def poll(self) -> None:
        current = _identity(self.path)
        if current is not None and current != self._seen:
            self.post(f"file {self.path}")
        self._seen = current
