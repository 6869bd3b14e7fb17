"""The owner lease: one writing job per checkpoint root.

Two jobs that are misconfigured to write the same root would interleave their steps and delete
each other's checkpoints through retention. The lease detects this. The writing job keeps a
record, ``owner.json``, at the root::

    {"format_version": 1, "job_id": "...", "host": "...", "boot_id": "...", "pid": 1234,
     "pid_start": "...", "pid_ns": "pid:[4026531836]", "lease_id": "...",
     "acquired_at": 1700000000.0, "heartbeat": 1700000030.0, "timeout_s": 60.0}

* **Acquire.** With no record, the record is written create-only (``O_EXCL`` locally, a
  conditional write on object stores that support it). A record of another job makes
  :meth:`OwnerLease.acquire` raise :class:`LeaseHeldError` naming the owner, unless the owner is
  **dead** (same host and PID namespace, and its pid no longer exists or is now another
  process; containers on one host may share its name and boot id), its heartbeat is
  **stale** (older than ``timeout_s``, and than the ``timeout_s`` in the owner's record, by which
  it refreshes its heartbeat), it belongs to the **same job** (a restart of the same
  ``job_id``, such as a torchelastic restart), or ``take_over=True``. Taking over rewrites the
  record and reads it back.
* **Heartbeat.** A daemon thread rewrites ``heartbeat`` every ``heartbeat_interval_s`` (default a
  quarter of ``timeout_s``). If the record it finds is no longer its own (another job took over),
  it stops and :meth:`OwnerLease.check` raises :class:`LeaseLostError` from then on.
* **Release.** :meth:`OwnerLease.release` stops the heartbeat and deletes the record if it is
  still this holder's.

Managers in one process share one holding per root (reference counted), so a process never
conflicts with itself; ranks of one job share the lease because only rank 0 acquires it.
Read-only use (listing, restoring, the command line) never touches the lease.

On a local file system every read-then-write of the record (heartbeat, acquire, take-over,
release) holds an exclusive ``flock`` of the root's directory (on NFS, which locks only files
open for writing, of ``owner.json.lock`` beside the record), so none of them overwrites or
deletes a record written between its read and its write.

Limits: the lease detects misconfiguration, it is no lock service. Between two heartbeats a
writer that lost the lease can still commit one step (once its heartbeat has found the loss, it
commits and deletes nothing more; the checkpoint daemon of a single-process save on a local
disk reads the record before it commits: :class:`LocalOwnerCheck`); "stale" compares the
record's time with the local clock, so hosts with skewed clocks need a ``timeout_s`` above the
skew. Object stores
have no such lock: a heartbeat whose read came just before a take-over's write can still
overwrite it (a window of one storage round trip); the new owner then finds the loss at its
own next heartbeat, and its saves fail with :class:`LeaseLostError`.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from ckptmgr.errors import CheckpointError
from ckptmgr.local_files import read_regular_file
from ckptmgr.retry import http_status, is_s3_class

try:
    import fcntl
except ImportError:  # (Windows: no flock; the record is read and written without a lock)
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

LEASE_NAME = "owner.json"
LEASE_FORMAT_VERSION = 1
DEFAULT_TIMEOUT_S = 60.0
JOB_ID_VARIABLES = ("CKPTMGR_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
"""Environment variables that name the job, first found wins; else the process is the job."""
S3_READ_BYTES = 1 << 20
"""The record is read on S3 as a GET of this many bytes at most (records are far smaller)."""
_NO_RUN_ID = "none"
"""What torchrun sets ``TORCHELASTIC_RUN_ID`` to without ``--rdzv-id`` (its default): every such
job would have the same id, so it names no job."""


CLI_JOB_PREFIX = "ckptmgr-cli-"
"""How the job id of a ``ckptmgr rm`` or ``prune`` command begins (see
:mod:`ckptmgr.cli_lease`): such an owner holds a root for the seconds its deletes take."""
COMMAND_WAIT_S = 300.0
"""How long a manager or a command waits for a ``ckptmgr`` command that holds the root."""
_COMMAND_POLL_S = 0.2


def is_command(owner: Owner) -> bool:
    """True when ``owner`` is a ``ckptmgr rm`` or ``prune`` command, not a job."""
    return owner.job_id.startswith(CLI_JOB_PREFIX)


class LeaseHeldError(CheckpointError):
    """The root is owned by another live job; ``owner`` is its record."""

    def __init__(self, path: str, owner: Owner, now: float) -> None:
        self.owner = owner
        if is_command(owner):
            super().__init__(
                f"checkpoint root {path} is held by a ckptmgr command that deletes steps "
                f"({owner.describe(now)}); try again once it is done"
            )
            return
        super().__init__(
            f"checkpoint root {path} is owned by another job: {owner.describe(now)}. Two jobs "
            "must not write the same root; point this job at another path, or pass "
            "take_over=True if that job is gone (a dead owner on this host, or one whose "
            f"heartbeat is older than {owner.timeout_s:g} s, is taken over automatically)"
        )


class LeaseLostError(CheckpointError):
    """Another job took over the lease of a root that this process held."""


@dataclass(frozen=True)
class Owner:
    """The record in ``owner.json``: who writes the root, and since when."""

    job_id: str
    host: str
    boot_id: str | None
    pid: int
    pid_start: str | None
    lease_id: str
    acquired_at: float
    heartbeat: float
    timeout_s: float
    pid_ns: str | None = None  # the PID namespace the pid is of (Linux), else None
    format_version: int = LEASE_FORMAT_VERSION

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Owner:
        """Parse a record; ``ValueError`` for anything that is not one."""
        raw = json.loads(data)
        if not isinstance(raw, Mapping):
            raise ValueError("owner record is not a JSON object")
        try:
            return cls(
                job_id=str(raw["job_id"]),
                host=str(raw["host"]),
                boot_id=None if raw.get("boot_id") is None else str(raw["boot_id"]),
                pid=int(raw["pid"]),
                pid_start=None if raw.get("pid_start") is None else str(raw["pid_start"]),
                lease_id=str(raw["lease_id"]),
                acquired_at=float(raw["acquired_at"]),
                heartbeat=float(raw["heartbeat"]),
                timeout_s=float(raw.get("timeout_s", DEFAULT_TIMEOUT_S)),
                pid_ns=None if raw.get("pid_ns") is None else str(raw["pid_ns"]),
                format_version=int(raw.get("format_version", LEASE_FORMAT_VERSION)),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"owner record lacks a field or has a bad one: {exc!r}") from None

    def describe(self, now: float) -> str:
        return (
            f"job {self.job_id!r} on host {self.host!r}, pid {self.pid}, heartbeat "
            f"{max(now - self.heartbeat, 0.0):.1f} s ago"
        )

    def same_host(self) -> bool:
        """True when the record was written on this machine, in this boot."""
        if self.host != socket.gethostname():
            return False
        return self.boot_id is None or self.boot_id == _boot_id()

    def is_dead(self) -> bool:
        """True when the owner ran on this host and its process is gone (or the pid reused)."""
        if not self.same_host():
            return False
        if self.in_other_pid_namespace():
            return False  # another container on this host: its pid means nothing here
        if not _pid_exists(self.pid):
            return True
        return not _same_start(_pid_start(self.pid), self.pid_start)

    def is_live_ancestor(self) -> bool:
        """True when the owner is an ancestor of this process (its parent, the parent's parent,
        ..., or a process it was forked from through one that has exited since) and still runs:
        a forked child of the owner, of the same job, is not the job's restart."""
        if not self.same_host() or self.in_other_pid_namespace():
            return False
        forked_from = any(
            pid == self.pid and _same_start(start, self.pid_start) for pid, start in _FORKED_FROM
        )
        if not (forked_from or self.pid in _ancestor_pids()) or not _pid_exists(self.pid):
            return False
        return _same_start(_pid_start(self.pid), self.pid_start)

    def in_other_pid_namespace(self) -> bool:
        """True when the owner ran on this host in another PID namespace (a container)."""
        return self.same_host() and self.pid_ns is not None and self.pid_ns != _pid_namespace()

    def is_stale(self, now: float, timeout_s: float) -> bool:
        return now - self.heartbeat > timeout_s


def default_job_id() -> str:
    """The job's identity from the environment (``JOB_ID_VARIABLES``), else this process's."""
    for name in JOB_ID_VARIABLES:
        value = os.environ.get(name)
        if value and not (name == "TORCHELASTIC_RUN_ID" and value == _NO_RUN_ID):
            return f"{name}={value}"
    start = _pid_start(os.getpid()) or ""
    return f"process:{socket.gethostname()}:{_pid_namespace() or ''}:{os.getpid()}:{start}"


def read_owner(fs: AbstractFileSystem, root: str) -> Owner | None:
    """The owner record under ``root``, or None; ``CheckpointError`` if it is damaged."""
    path = _lease_path(root)
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        return None
    try:
        return Owner.from_json(data)
    except ValueError as exc:
        raise CheckpointError(f"owner record {path} is damaged: {exc}") from exc


class _Holding:
    """This process's hold on one root's lease, shared by every manager of the process."""

    def __init__(self, fs: AbstractFileSystem, path: str, owner: Owner, interval_s: float) -> None:
        self.fs = fs
        self.path = path
        self.owner = owner
        self.interval_s = interval_s
        self.users = 0
        self.key = ""  # where _HOLDINGS lists it
        self.pid = os.getpid()  # a forked child inherits the object, not the hold
        self.lost: LeaseLostError | None = None
        self.dropped: collections.deque[None] = collections.deque()
        """One item per handle garbage collected without ``release()``, put here by its
        finalizer and given back by :meth:`give_back_dropped` later: outside the garbage
        collector, which runs a finalizer anywhere (inside ``acquire()``, which holds
        ``_HOLDINGS_LOCK``, say: a give-back there waited for that lock for ever).
        ``deque.append`` takes no lock of Python's."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._beat, name=f"ckptmgr-lease {self.path}", daemon=True
        )
        self._thread.start()

    def give_back_dropped(self) -> None:
        """Give back the uses of the handles dropped without ``release()`` (see
        :attr:`dropped`): run by each heartbeat, and by ``acquire()`` of the same root."""
        while True:
            try:
                self.dropped.popleft()
            except IndexError:
                return
            _give_back(self)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.give_back_dropped()  # (the last use given back: it stops)
            if self._stop.is_set():
                return
            try:
                self.refresh()
            except LeaseLostError as exc:
                log.error("%s", exc)
                return
            except Exception as exc:  # a transient storage error: the next beat tries again
                log.warning("could not refresh the owner lease %s: %s", self.path, exc)

    def confirm(self) -> None:
        """Read the record now; remember and raise the loss unless it is still ours."""
        if self.lost is not None:
            raise self.lost
        try:
            confirm_owner(self.fs, self.path, self.owner.lease_id)
        except LeaseLostError as exc:
            self.lost = exc
            raise

    def refresh(self) -> None:
        """Rewrite the heartbeat if the record is still ours; else remember and raise the loss.
        Read and rewrite under the record's lock: a take-over written in between would
        otherwise be overwritten with this record, and the new owner displaced in turn."""
        with _record_lock(self.fs, self.path):
            self.confirm()
            updated = Owner(**{**asdict(self.owner), "heartbeat": time.time()})
            _overwrite(self.fs, self.path, updated.to_json())
        self.owner = updated

    def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        # (from its own heartbeat, which gave it back: that thread ends once this returns)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(5.0, 2 * self.interval_s))
            self._thread = None


_HOLDINGS: dict[str, _Holding] = {}
_HOLDINGS_LOCK = threading.Lock()


_FORKED_FROM: tuple[tuple[int, str | None], ...] = ()
"""(pid, start time) of each process this one was forked from, the parent last. ``/proc``'s
parent links lose an ancestor that exited (its children are reparented); this does not."""
_forking: tuple[int, str | None] | None = None  # this process, while it forks


def _note_the_forking_process() -> None:
    global _forking
    _forking = (os.getpid(), _pid_start(os.getpid()))


def _forget_holdings_in_forked_child() -> None:
    """A forked child holds none of its parent's leases (it has no heartbeat thread, and its
    pid is not the owner's): a manager it makes acquires anew, and is refused while the parent
    owns the root. The lock may have been held by another thread at the fork."""
    global _HOLDINGS_LOCK, _FORKED_FROM
    _HOLDINGS.clear()
    _HOLDINGS_LOCK = threading.Lock()
    if _forking is not None:
        _FORKED_FROM = (*_FORKED_FROM, _forking)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_note_the_forking_process, after_in_child=_forget_holdings_in_forked_child
    )


class OwnerLease:
    """A handle on the lease of one checkpoint root (see the module docstring).

    ``fs``/``root`` name the root as fsspec sees it. ``job_id`` defaults to
    :func:`default_job_id`. ``timeout_s`` is how old a heartbeat must be before the lease counts
    as abandoned (the owner's own ``timeout_s`` if that is longer); ``heartbeat_interval_s``
    (default ``timeout_s / 4``) how often it is refreshed.
    """

    def __init__(
        self,
        fs: AbstractFileSystem,
        root: str,
        *,
        job_id: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        heartbeat_interval_s: float | None = None,
        take_over: bool = False,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"lease timeout_s must be > 0, got {timeout_s}")
        self.fs = fs
        self.path = _lease_path(root)
        self.job_id = job_id or default_job_id()
        self.timeout_s = float(timeout_s)
        self.heartbeat_interval_s = (
            float(heartbeat_interval_s) if heartbeat_interval_s else self.timeout_s / 4
        )
        self.take_over = take_over
        self.previous: Owner | None = None
        """The record this handle replaced when it acquired (a dead, stale or displaced owner)."""
        self._holding: _Holding | None = None
        self._dropped: weakref.finalize | None = None  # gives the holding back, once

    @property
    def owner(self) -> Owner | None:
        """The record this handle holds, or None when it holds nothing."""
        return None if self._holding is None else self._holding.owner

    def _own_holding(self) -> _Holding | None:
        """The holding, unless this is a forked child of the process that holds it: the child
        forgets it (touching nothing in storage), and holds nothing."""
        holding = self._holding
        if holding is not None and holding.pid != os.getpid():
            self._holding = holding = None
        return holding

    def acquire(self) -> Owner:
        """Become the owner, or raise :class:`LeaseHeldError`; returns the record written.

        Safe to call again after it raised another error (a transient storage error: the
        manager retries it as one storage operation): a record it wrote before it failed is
        this job's, which a later call takes over."""
        holding = self._own_holding()
        if holding is not None:
            return holding.owner
        key = self._key()
        earlier = _HOLDINGS.get(key)
        if earlier is not None:  # (this root's handles dropped meanwhile: given back first)
            earlier.give_back_dropped()
        for _ in range(3):
            with _HOLDINGS_LOCK:
                holding = _HOLDINGS.get(key)
                unjudged: Owner | None = None
                if holding is None or holding.lost is not None:
                    holding, unjudged = self._acquire_fresh()
                    if holding is not None:
                        holding.key = key
                        _HOLDINGS[key] = holding
                        holding.start()
                if holding is not None:
                    holding.users += 1
                    self._holding = holding
                    # A handle dropped without release() (a manager never closed, garbage
                    # collected) gives its use back: else the root stayed owned, its heartbeat
                    # beating, until the process ended. Not at exit: a dead owner is taken over.
                    self._dropped = weakref.finalize(self, holding.dropped.append, None)
                    self._dropped.atexit = False
                    return holding.owner
            assert unjudged is not None
            self._watch_heartbeat(unjudged)  # outside the lock: raises if it lives
        raise CheckpointError(
            f"could not acquire the owner lease {self.path}: its owner could not be judged "
            "(an owner in another PID namespace on this host, whose record kept changing)"
        )

    def _acquire_fresh(self) -> tuple[_Holding | None, Owner | None]:
        """(the new holding, None), or (None, the record of an owner whose heartbeat must be
        watched before it can be judged: on this host, in another PID namespace)."""
        mine = self._record()
        with _record_lock(self.fs, self.path):
            return self._acquire_locked(mine)

    def _acquire_locked(self, mine: Owner) -> tuple[_Holding | None, Owner | None]:
        """:meth:`_acquire_fresh` under the record's lock."""
        for _ in range(3):  # without a lock another process may write the record in between
            current = _read(self.fs, self.path)
            if current is None:
                try:
                    _create_only(self.fs, self.path, mine.to_json())
                except FileExistsError:
                    continue
                return _Holding(self.fs, self.path, mine, self.heartbeat_interval_s), None
            reason = self._why_take(current)
            if reason is None and current.in_other_pid_namespace():
                return None, current
            if reason is None:
                raise LeaseHeldError(self.path, current, time.time())
            log.warning(
                "taking over the owner lease of %s from %s: %s",
                self.path,
                current.describe(time.time()),
                reason,
            )
            _overwrite(self.fs, self.path, mine.to_json())
            written = _read(self.fs, self.path)
            if written is None or written.lease_id != mine.lease_id:
                continue  # another process took over at the same time: decide again
            self.previous = current
            return _Holding(self.fs, self.path, mine, self.heartbeat_interval_s), None
        raise CheckpointError(
            f"could not acquire the owner lease {self.path}: it kept changing under us "
            "(several jobs starting on the same root at once?)"
        )

    def _watch_heartbeat(self, current: Owner) -> None:
        """Wait until ``current``'s heartbeat moves (it lives: :class:`LeaseHeldError`) or goes
        stale, or the record changes; for an owner whose pid cannot tell (a container on this
        host restarted in a new PID namespace must not fail until the old record is stale)."""
        timeout_s = max(self.timeout_s, current.timeout_s)
        until_stale_s = max(current.heartbeat + timeout_s - time.time(), 0.0)
        wait_s = min(until_stale_s, self.timeout_s)  # at most our own timeout
        log.warning(
            "the owner lease of %s is held by %s, in another PID namespace on this host (a "
            "container?), whose pid cannot tell whether it still runs: waiting up to %.0f s "
            "for its heartbeat (a restarted job is recognised at once with CKPTMGR_JOB_ID)",
            self.path,
            current.describe(time.time()),
            wait_s,
        )
        poll_s = min(1.0, timeout_s / 20)
        end = time.monotonic() + wait_s + poll_s
        while time.monotonic() < end:
            time.sleep(poll_s)
            again = _read(self.fs, self.path)
            if again is None or again.lease_id != current.lease_id:
                return
            if again.heartbeat != current.heartbeat:
                raise LeaseHeldError(self.path, again, time.time())
        if wait_s < until_stale_s:  # its own timeout outlasts ours, and it kept its record
            raise LeaseHeldError(self.path, current, time.time())

    def _why_take(self, current: Owner) -> str | None:
        """Why ``current``'s lease may be taken over, or None when it must be respected."""
        now = time.time()
        if current.job_id == self.job_id and not current.is_live_ancestor():
            return "the same job (a restart)"
        if current.is_dead():
            return f"its process {current.pid} no longer exists on this host"
        # The owner's own timeout too: it refreshes its heartbeat by that, so a newcomer with a
        # shorter timeout would take a live owner's lease between two of its heartbeats.
        timeout_s = max(self.timeout_s, current.timeout_s)
        if current.is_stale(now, timeout_s):
            return f"its heartbeat is older than {timeout_s:g} s"
        if self.take_over:
            return "take_over=True"
        return None

    def _record(self) -> Owner:
        now = time.time()
        return Owner(
            job_id=self.job_id,
            host=socket.gethostname(),
            boot_id=_boot_id(),
            pid=os.getpid(),
            pid_start=_pid_start(os.getpid()),
            pid_ns=_pid_namespace(),
            lease_id=uuid.uuid4().hex,
            acquired_at=now,
            heartbeat=now,
            timeout_s=self.timeout_s,
        )

    def _key(self) -> str:
        """One key per record: a local root reached through a symlink is the same root."""
        if isinstance(self.fs, LocalFileSystem):
            return os.path.realpath(self.path)
        return self.fs.unstrip_protocol(self.path)

    def refresh(self) -> None:
        """Refresh the heartbeat now (the daemon thread does this on its own)."""
        holding = self._own_holding()
        if holding is None:
            raise CheckpointError("the owner lease is not held (by this process)")
        with _HOLDINGS_LOCK:
            holding.refresh()

    def check(self) -> None:
        """Raise :class:`LeaseLostError` if the heartbeat found the lease taken over."""
        holding = self._own_holding()
        if holding is not None and holding.lost is not None:
            raise holding.lost

    def confirm(self) -> None:
        """Read the record now and raise :class:`LeaseLostError` unless it is still this
        lease's: the heartbeat finds a take-over only at its next beat (up to a quarter of
        ``timeout_s`` later), which is too late before deleting anything."""
        holding = self._own_holding()
        if holding is not None:
            holding.confirm()

    def note_lost(self, error: LeaseLostError) -> None:
        """Remember a loss that another process found (the checkpoint daemon, reading the
        record before a commit): :meth:`check` raises it from now on, as if the heartbeat had
        found it."""
        holding = self._own_holding()
        if holding is not None and holding.lost is None:
            holding.lost = error

    def local_check(self) -> LocalOwnerCheck | None:
        """What reads this lease's record on a local disk and raises :class:`LeaseLostError`
        unless it is still this lease's, from any process (the checkpoint daemon, just before
        it commits); None when nothing is held or the record is not on a local disk."""
        holding = self._own_holding()
        if holding is None or type(holding.fs) is not LocalFileSystem:
            return None
        return LocalOwnerCheck(holding.path, holding.owner.lease_id)

    def release(self) -> None:
        """Give the lease back: delete the record if it is still ours. Idempotent. In a forked
        child of the holding process it only forgets the holding: the lease is the parent's."""
        holding, self._holding = self._own_holding(), None
        if holding is None or self._dropped is None:
            return
        if self._dropped.detach() is not None:  # (once: two threads may release at once)
            _give_back(holding)

    def __enter__(self) -> OwnerLease:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def acquire_waiting_for_commands(
    acquire: Callable[[], object], wait_s: float = COMMAND_WAIT_S
) -> None:
    """Call ``acquire`` (an :meth:`OwnerLease.acquire`, retried as a storage operation, say);
    while a ``ckptmgr rm`` or ``prune`` holds the root (seconds, as a rule), wait for it, up to
    ``wait_s``. Raises :class:`LeaseHeldError` for another owner at once, and for such a
    command once the wait is over: a job restarted during a scheduled prune waits for it."""
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            acquire()
            return
        except LeaseHeldError as exc:
            if not is_command(exc.owner) or time.monotonic() >= deadline:
                raise
            if not told:
                log.warning(
                    "the checkpoint root is held by a ckptmgr command that deletes steps (%s); "
                    "waiting for it to finish",
                    exc.owner.describe(time.time()),
                )
                told = True
            time.sleep(_COMMAND_POLL_S)


def _give_back(holding: _Holding) -> None:
    """One handle's release of ``holding``: the last user of the process stops its heartbeat
    and deletes the record if it is still ours. Nothing in a forked child (the parent's)."""
    if holding.pid != os.getpid():
        return
    with _HOLDINGS_LOCK:
        holding.users -= 1
        if holding.users > 0:
            return
        if _HOLDINGS.get(holding.key) is holding:  # the key it was registered under
            del _HOLDINGS[holding.key]
    holding.stop()
    if holding.lost is not None:
        return
    fs = holding.fs
    try:
        with _record_lock(fs, holding.path):  # not a take-over written in between
            current = _read(fs, holding.path)
            if current is not None and current.lease_id == holding.owner.lease_id:
                fs.rm_file(holding.path)
    except Exception as exc:  # a dead-owner record is taken over by the next job anyway
        log.warning("could not release the owner lease %s: %s", holding.path, exc)


def confirm_owner(fs: AbstractFileSystem, path: str, lease_id: str) -> None:
    """Read the owner record at ``path`` now and raise :class:`LeaseLostError` unless it is the
    lease ``lease_id``'s."""
    current = _read(fs, path)
    if current is None or current.lease_id != lease_id:
        now = time.time()
        by = "nobody (the record was deleted)" if current is None else current.describe(now)
        raise LeaseLostError(
            f"the owner lease of {path} was taken over by {by}; this process must stop writing "
            "checkpoints there"
        )


@dataclass(frozen=True)
class LocalOwnerCheck:
    """:func:`confirm_owner` of one lease on a local disk, to be sent to another process."""

    path: str
    lease_id: str

    def __call__(self) -> None:
        """Raise :class:`LeaseLostError` unless the record is still the lease's (read now)."""
        confirm_owner(LocalFileSystem(), self.path, self.lease_id)


def _lease_path(root: str) -> str:
    return f"{root.rstrip('/')}/{LEASE_NAME}"


_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_LOCK_SUFFIX = ".lock"
"""The lock file beside a local record (``owner.json.lock``), where the root's directory cannot
be locked (network file systems): empty, and left in place."""


@contextlib.contextmanager
def _record_lock(fs: AbstractFileSystem, path: str) -> Iterator[None]:
    """Hold the record's lock while reading the record and writing what follows from it.

    Every read-then-write of the record (a heartbeat, an acquisition, a take-over, a release)
    runs under it, so none of them overwrites or deletes a record written between its read
    and its write. Only local file systems have it: an exclusive ``flock`` of the root's
    directory, or where that is refused (NFS locks only files open for writing) of a lock
    file beside the record; among processes, and among threads (each call opens anew). Where
    neither can be locked, and on object stores, the record is read and written without it
    (see the module's limits).
    """
    if not isinstance(fs, LocalFileSystem):
        yield
        return
    fd = _lock_record(path)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _lock_record(path: str) -> int | None:
    """A descriptor holding the record's lock (see :func:`_record_lock`), None for none."""
    if fcntl is None:
        return None
    directory = os.path.dirname(path) or "."
    refusals: list[str] = []
    for target, flags in (
        (directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC),
        (path + _LOCK_SUFFIX, os.O_RDWR | os.O_CREAT | _CLOEXEC),
    ):
        try:
            fd = os.open(target, flags, 0o644)
        except OSError as exc:
            refusals.append(f"{target}: {exc}")
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.debug("waiting for the lock of the owner record %s", path)
                fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:  # EBADF on NFS for a directory, ENOLCK, ...
            os.close(fd)
            refusals.append(f"{target}: {exc}")
            continue
        return fd
    log.warning(
        "owner record %s: no lock could be had (%s); reading and writing it without one",
        path,
        "; ".join(refusals),
    )
    return None


def _read(fs: AbstractFileSystem, path: str) -> Owner | None:
    """The record at ``path``, None if absent; a damaged record counts as absent-but-taken."""
    try:
        data = _read_file(fs, path)
    except FileNotFoundError:
        return None
    try:
        return Owner.from_json(data)
    except ValueError as exc:
        log.warning("owner record %s is damaged (%s); treating it as stale", path, exc)
        return Owner(
            job_id="<damaged record>",
            host="",
            boot_id=None,
            pid=-1,
            pid_start=None,
            lease_id="",
            acquired_at=0.0,
            heartbeat=0.0,
            timeout_s=DEFAULT_TIMEOUT_S,
        )


def _read_file(fs: AbstractFileSystem, path: str) -> bytes:
    """The bytes of ``path``, read fresh. On a local disk with the system calls themselves:
    five (:func:`~ckptmgr.local_files.read_regular_file`, which refuses a FIFO or a device
    there), where fsspec's ``cat_file`` makes eleven, each a hand-over of the GIL with a
    Python-bound training loop (the lease is read before every deletion by retention). On S3
    as one ranged GET: s3fs' ``cat_file`` of a whole file asks its size first (a HEAD)."""
    if type(fs) is not LocalFileSystem:
        fs.invalidate_cache(path)
        if is_s3_class(type(fs)):
            return _read_s3_file(fs, path)
        return bytes(fs.cat_file(path))
    return read_regular_file(path)


def _read_s3_file(fs: AbstractFileSystem, path: str) -> bytes:
    """``path`` on S3 by a GET of its first ``S3_READ_BYTES`` (all of a record); an empty
    object, whose range no server can satisfy (HTTP 416), is read as empty."""
    try:
        data = bytes(fs.cat_file(path, start=0, end=S3_READ_BYTES))
    except OSError as exc:
        if http_status(exc) == 416:
            return b""
        raise
    if len(data) >= S3_READ_BYTES:  # (no record is this long: read it whole all the same)
        return bytes(fs.cat_file(path))
    return data


def _create_only(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    """Write ``path`` unless it exists (``FileExistsError``)."""
    if isinstance(fs, LocalFileSystem):
        # Written whole under another name, then linked in place: link() fails if ``path``
        # exists, and a reader never sees it empty (an empty record reads as damaged, so as
        # stale, and was once taken over while its writer went on to think it the owner).
        tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(tmp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError:  # no hard links here (some FUSE mounts): create-only, then write
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    os.write(fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return
    try:
        fs.pipe_file(path, data, mode="create")
        return
    except TypeError:  # an fsspec without conditional writes: check, then write
        pass
    fs.invalidate_cache(path)
    if fs.exists(path):
        raise FileExistsError(path)
    fs.pipe_file(path, data)


def _overwrite(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    """Replace ``path`` in one step (write a temporary file and rename it, locally)."""
    if isinstance(fs, LocalFileSystem):
        tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        return
    fs.pipe_file(path, data)


def _pid_exists(pid: int) -> bool:
    """True while process ``pid`` runs (a zombie, killed but not yet reaped, does not count)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _proc_stat(pid)
    return not (fields and fields[0] in ("Z", "X"))


def _same_start(start: str | None, recorded: str | None) -> bool:
    """False only when both start times are known and differ (the pid was reused)."""
    return start is None or recorded is None or start == recorded


def _ancestor_pids() -> set[int]:
    """The pids of this process's parent, its parent, and so on up to pid 1 (from ``/proc``
    on Linux; elsewhere the parent's only). Pid 1 counts: in a container, the trainer may be
    it."""
    found: set[int] = set()
    pid = os.getppid()
    while pid > 0 and pid not in found:
        found.add(pid)
        fields = _proc_stat(pid)
        if not fields or len(fields) < 2 or not fields[1].isdigit():
            break
        pid = int(fields[1])  # the parent's pid
    return found


def _pid_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), else None."""
    fields = _proc_stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read().decode(errors="replace")
    except OSError:
        return None
    return stat.rpartition(")")[2].split()


def _pid_namespace() -> str | None:
    """This process's PID namespace (``pid:[<inode>]``, Linux), else None."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return handle.read().strip() or None
    except OSError:
        return None
