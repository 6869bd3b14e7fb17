"""The owner lease (ckptmgr.lease) between real processes on a real directory.

A child interpreter acquires or probes the lease and reports over its stdout what happened;
the test waits for those lines (bounded) and kills the child with a real SIGKILL where the test
is about a dead owner. Records of other hosts and old heartbeats are written as files, because
they cannot be produced on one machine in reasonable time.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
from conftest import REPO, in_forked_child, run_python
from fsspec.implementations.local import LocalFileSystem

from ckptmgr import CheckpointError
from ckptmgr import lease as lease_module
from ckptmgr.lease import (
    LEASE_NAME,
    LeaseHeldError,
    LeaseLostError,
    Owner,
    OwnerLease,
    read_owner,
)

BOUND_S = 90.0  # every wait on a child: importing ckptmgr (torch) on a busy machine

CHILD_CODE = r"""
import json, sys
from fsspec.implementations.local import LocalFileSystem
from ckptmgr.lease import LeaseHeldError, OwnerLease
root, job_id, take_over = sys.argv[1], sys.argv[2] or None, sys.argv[3] == "1"
lease = OwnerLease(LocalFileSystem(), root, job_id=job_id, take_over=take_over,
                   heartbeat_interval_s=float(sys.argv[4]))
try:
    owner = lease.acquire()
except LeaseHeldError as error:
    print("refused " + json.dumps({"message": str(error), "pid": error.owner.pid}), flush=True)
    sys.exit(0)
print("held " + json.dumps({"pid": owner.pid, "lease_id": owner.lease_id}), flush=True)
command = sys.stdin.readline().strip()  # the parent says when to let go (or kills us)
if command == "release":
    lease.release()
    print("released", flush=True)
"""


class LeaseChild:
    """A child interpreter running CHILD_CODE; its first stdout line says what it got."""

    def __init__(
        self,
        root: Path,
        job_id: str = "",
        take_over: bool = False,
        interval_s: float = 15.0,
        prefix: tuple[str, ...] = (),
    ) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
        self.proc = subprocess.Popen(
            [
                *prefix,
                sys.executable,
                "-c",
                CHILD_CODE,
                str(root),
                job_id,
                "1" if take_over else "0",
                str(interval_s),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    def first_line(self) -> tuple[str, dict[str, object]]:
        """(``held`` or ``refused``, details), waiting at most BOUND_S."""
        line = self._readline()
        word, _, payload = line.partition(" ")
        return word, json.loads(payload)

    def _readline(self) -> str:
        assert self.proc.stdout is not None
        import selectors

        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            if not selector.select(BOUND_S):
                self.proc.kill()
                pytest.fail(f"the child said nothing within {BOUND_S:.0f}s")
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(BOUND_S)
            assert self.proc.stderr is not None
            pytest.fail(f"the child exited (rc={self.proc.returncode}): {self.proc.stderr.read()}")
        return line.strip()

    def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("release\n")
        self.proc.stdin.flush()
        assert self._readline() == "released"
        assert self.proc.wait(BOUND_S) == 0

    def sigkill(self) -> None:
        """SIGKILL the child and reap it: its pid no longer exists afterwards."""
        assert self.proc.poll() is None, "the child was not running"
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(BOUND_S) == -signal.SIGKILL

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(BOUND_S)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def children() -> Iterator[list[LeaseChild]]:
    started: list[LeaseChild] = []
    yield started
    for child in started:
        child.close()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "ckpts"
    path.mkdir()
    return path


def lease_of(root: Path, **kwargs: object) -> OwnerLease:
    return OwnerLease(LocalFileSystem(), str(root), **kwargs)  # type: ignore[arg-type]


def record(root: Path) -> dict[str, object]:
    return json.loads((root / LEASE_NAME).read_text())


def write_record(root: Path, **fields: object) -> None:
    """An owner.json as another job would have written it."""
    now = time.time()
    values: dict[str, object] = {
        "format_version": 1,
        "job_id": "other-job",
        "host": "some-other-host",
        "boot_id": None,
        "pid": 4242,
        "pid_start": None,
        "lease_id": "f" * 32,
        "acquired_at": now,
        "heartbeat": now,
        "timeout_s": 60.0,
    }
    values.update(fields)
    (root / LEASE_NAME).write_text(json.dumps(values))


def test_second_process_refuses_while_the_owner_lives(
    root: Path, children: list[LeaseChild]
) -> None:
    owner = lease_of(root, job_id="job-A")
    held = owner.acquire()
    try:
        assert record(root)["pid"] == os.getpid() == held.pid
        child = LeaseChild(root, job_id="job-B")
        children.append(child)
        word, details = child.first_line()
        assert word == "refused", details
        message = str(details["message"])
        assert "owned by another job" in message
        assert "'job-A'" in message and f"pid {os.getpid()}" in message
        assert "take_over=True" in message
        assert record(root)["lease_id"] == held.lease_id  # untouched by the refused child
    finally:
        owner.release()
    assert not (root / LEASE_NAME).exists()


def test_owner_killed_with_sigkill_is_taken_over(root: Path, children: list[LeaseChild]) -> None:
    child = LeaseChild(root, job_id="job-A")
    children.append(child)
    word, details = child.first_line()
    assert word == "held", details
    assert record(root)["pid"] == details["pid"] == child.proc.pid

    # While the child lives, this process (another job) is refused, naming the child.
    with pytest.raises(LeaseHeldError) as refused:
        lease_of(root, job_id="job-B").acquire()
    assert refused.value.owner.pid == child.proc.pid
    assert f"pid {child.proc.pid}" in str(refused.value)

    child.sigkill()  # no release: owner.json stays behind, naming a pid that is gone
    assert record(root)["pid"] == child.proc.pid
    lease = lease_of(root, job_id="job-B")
    owner = lease.acquire()
    try:
        assert lease.previous is not None and lease.previous.pid == child.proc.pid
        assert record(root)["lease_id"] == owner.lease_id
        assert record(root)["job_id"] == "job-B"
    finally:
        lease.release()


def test_killed_but_unreaped_owner_counts_as_dead(root: Path, children: list[LeaseChild]) -> None:
    child = LeaseChild(root, job_id="job-A")
    children.append(child)
    assert child.first_line()[0] == "held"
    os.kill(child.proc.pid, signal.SIGKILL)
    # Wait (bounded) until the kernel made it a zombie; it is not reaped yet.
    deadline = time.monotonic() + BOUND_S
    while Path(f"/proc/{child.proc.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child never became a zombie"
        time.sleep(0.01)
    with lease_of(root, job_id="job-B") as lease:
        assert lease.previous is not None and lease.previous.pid == child.proc.pid


# unshare(1) as an unprivileged user maps it to root in a new user namespace (--map-root-user).
NEW_PID_NAMESPACE = ("unshare", "--pid", "--fork", "--map-root-user", "--mount-proc")


def _can_unshare() -> bool:
    try:
        done = subprocess.run([*NEW_PID_NAMESPACE, "true"], capture_output=True, timeout=BOUND_S)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="unshare(1) cannot make a PID namespace here")
def test_a_live_owner_in_another_pid_namespace_is_not_taken_for_dead(
    root: Path, children: list[LeaseChild]
) -> None:
    """A container on the same host may share its host name and boot id (host networking):
    its owner's pid, of its own PID namespace, names no process or another one here, and must
    not make a live owner look dead."""
    child = LeaseChild(root, job_id="job-A", interval_s=0.2, prefix=NEW_PID_NAMESPACE)
    children.append(child)
    word, details = child.first_line()
    assert word == "held", details
    owner = read_owner(LocalFileSystem(), str(root))
    assert owner is not None and owner.pid == details["pid"]
    assert owner.pid_ns is not None and owner.pid_ns != os.readlink("/proc/self/ns/pid")
    with pytest.raises(LeaseHeldError):
        lease_of(root, job_id="job-B").acquire()
    assert record(root)["job_id"] == "job-A"


def test_an_owner_record_of_another_pid_namespace_waits_for_its_heartbeat(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An owner on this host whose pid does not exist here is dead at once only when the record
    is of this process's PID namespace (or says none, as older records do). One of another
    namespace is watched: a heartbeat that moves is a live owner (refused), one that goes stale
    a dead one (taken over then, as a container restarted in a new namespace needs)."""
    from ckptmgr.lease import _boot_id

    here = {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": _unused_pid()}
    stop = threading.Event()

    def heartbeat() -> None:  # the owner's heartbeat, as its holder thread rewrites it
        while not stop.wait(0.05):
            write_record(root, **here, pid_ns="pid:[1]", timeout_s=5.0)

    write_record(root, **here, pid_ns="pid:[1]", timeout_s=5.0)
    beating = threading.Thread(target=heartbeat)
    beating.start()
    try:
        with pytest.raises(LeaseHeldError):  # watched: its heartbeat moves
            lease_of(root, job_id="me", timeout_s=10).acquire()
    finally:
        stop.set()
        beating.join(BOUND_S)
    assert record(root)["job_id"] == "other-job"

    write_record(root, **here, pid_ns="pid:[1]", timeout_s=1.0)  # its heartbeat never moves
    with caplog.at_level(logging.WARNING, logger="ckptmgr.lease"):
        with lease_of(root, job_id="me", timeout_s=1) as lease:  # taken over once stale
            assert lease.previous is not None and lease.previous.pid_ns == "pid:[1]"
            assert time.time() - lease.previous.heartbeat > 1.0
    assert "in another PID namespace" in caplog.text
    write_record(root, **here, pid_ns="pid:[1]", timeout_s=3600.0)  # its own timeout: 1 h
    started = time.monotonic()
    with pytest.raises(LeaseHeldError):  # watched for our own timeout only, then refused
        lease_of(root, job_id="me", timeout_s=1).acquire()
    assert time.monotonic() - started < 30.0

    class OwnerLetsGo(logging.Handler):  # the watched owner releases once the watch begins
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting up to" in record.getMessage():
                (root / LEASE_NAME).unlink()

    write_record(root, **here, pid_ns="pid:[1]", timeout_s=3600.0)
    letting_go = OwnerLetsGo()
    logging.getLogger("ckptmgr.lease").addHandler(letting_go)
    try:
        with lease_of(root, job_id="me", timeout_s=5) as lease:  # released meanwhile: ours
            assert record(root)["job_id"] == "me" and lease.previous is None
    finally:
        logging.getLogger("ckptmgr.lease").removeHandler(letting_go)
    for pid_ns in (os.readlink("/proc/self/ns/pid"), None):
        write_record(root, **here, pid_ns=pid_ns)
        started = time.monotonic()
        with lease_of(root, job_id="me") as lease:  # dead: taken over at once
            assert lease.previous is not None and lease.previous.job_id == "other-job"
        assert time.monotonic() - started < 5.0


def _unused_pid() -> int:
    """A pid that no process has now: the highest free one below pid_max (pids are handed
    out upwards, so it is the last to be taken)."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    for pid in range(pid_max - 1, 300, -1):
        if not Path(f"/proc/{pid}").exists():
            return pid
    raise AssertionError("no free pid")


def test_released_lease_is_free_for_the_next_process(
    root: Path, children: list[LeaseChild]
) -> None:
    first = LeaseChild(root, job_id="job-A")
    children.append(first)
    assert first.first_line()[0] == "held"
    first.release()
    assert not (root / LEASE_NAME).exists()
    second = LeaseChild(root, job_id="job-B")
    children.append(second)
    assert second.first_line()[0] == "held"
    assert record(root)["job_id"] == "job-B"


def test_take_over_displaces_a_live_owner_which_then_learns_it_lost(
    root: Path, children: list[LeaseChild]
) -> None:
    lease = lease_of(root, job_id="job-A", heartbeat_interval_s=3600)
    lease.acquire()
    try:
        child = LeaseChild(root, job_id="job-B", take_over=True)
        children.append(child)
        word, details = child.first_line()
        assert word == "held", details
        assert record(root)["pid"] == child.proc.pid
        with pytest.raises(LeaseLostError, match="taken over by job 'job-B'"):
            lease.refresh()
        with pytest.raises(LeaseLostError):
            lease.check()
    finally:
        lease.release()
    assert record(root)["pid"] == child.proc.pid, "releasing a lost lease deleted the new owner's"
    child.release()
    assert not (root / LEASE_NAME).exists()


def test_the_same_job_restarting_takes_over(root: Path, children: list[LeaseChild]) -> None:
    """A torchelastic restart: same job id, the old rank 0 may not even be dead yet."""
    child = LeaseChild(root, job_id="TORCHELASTIC_RUN_ID=run-7")
    children.append(child)
    assert child.first_line()[0] == "held"
    with lease_of(root, job_id="TORCHELASTIC_RUN_ID=run-7") as lease:
        assert lease.previous is not None and lease.previous.pid == child.proc.pid


def test_job_id_comes_from_the_environment(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTMGR_JOB_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc123")
    with lease_of(root) as lease:
        assert record(root)["job_id"] == "TORCHELASTIC_RUN_ID=abc123"
        assert lease.job_id == "TORCHELASTIC_RUN_ID=abc123"


def test_torchruns_default_run_id_names_no_job(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun sets TORCHELASTIC_RUN_ID to "none" unless given --rdzv-id (torch 2.13's
    default, e.g. with --master-port): two such jobs counted as one, and the second took a
    live job's root over as its own restart."""
    for name in ("CKPTMGR_JOB_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    with lease_of(root) as lease:
        assert lease.job_id.startswith("process:") and f":{os.getpid()}:" in lease.job_id
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with lease_of(root) as lease:
        assert lease.job_id == "SLURM_JOB_ID=4242"


def test_a_new_record_is_never_seen_empty(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The record was created empty and written after: a job that read it in between took it
    for damaged, so stale, and took it over while its writer went on as the owner. Now the
    record appears with its content (here: while the content is made durable, the record does
    not exist yet)."""

    seen_while_syncing: list[bool] = []
    real_fsync = os.fsync

    def spying_fsync(fd: int) -> None:
        seen_while_syncing.append((root / LEASE_NAME).exists())
        real_fsync(fd)

    monkeypatch.setattr(lease_module.os, "fsync", spying_fsync)
    with lease_of(root, job_id="me") as lease:
        assert seen_while_syncing and not seen_while_syncing[0]
        assert record(root)["lease_id"] == lease.owner.lease_id  # type: ignore[union-attr]
    assert sorted(p.name for p in root.iterdir()) == []  # no temporary file left


def test_without_hard_links_the_record_is_still_created_once(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some FUSE mounts refuse link(): the record is then created with O_EXCL and written."""

    def no_links(source: str, target: str) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(lease_module.os, "link", no_links)
    with lease_of(root, job_id="me") as lease:
        assert record(root)["lease_id"] == lease.owner.lease_id  # type: ignore[union-attr]
        assert [p.name for p in root.iterdir()] == [LEASE_NAME]
        with pytest.raises(FileExistsError):  # (another process would be refused on this)
            lease_module._create_only(LocalFileSystem(), str(root / LEASE_NAME), b"{}")
        assert record(root)["lease_id"] == lease.owner.lease_id  # type: ignore[union-attr]


def test_live_owner_on_another_host_is_respected_until_its_heartbeat_is_stale(
    root: Path,
) -> None:
    write_record(root, heartbeat=time.time() - 30)
    with pytest.raises(LeaseHeldError) as refused:
        lease_of(root, job_id="me", timeout_s=60).acquire()
    assert "'other-job' on host 'some-other-host'" in str(refused.value)
    assert record(root)["job_id"] == "other-job"

    write_record(root, heartbeat=time.time() - 30, timeout_s=20.0)
    with lease_of(root, job_id="me", timeout_s=20) as lease:  # 30 s old > 20 s: stale
        assert lease.previous is not None and lease.previous.job_id == "other-job"
        assert record(root)["job_id"] == "me"


def test_a_newcomer_with_a_shorter_timeout_respects_the_owners_own(root: Path) -> None:
    """The owner refreshes its heartbeat by its own timeout (every quarter of it): a newcomer
    with a shorter one must not call a live owner stale between two of its heartbeats."""
    write_record(root, heartbeat=time.time() - 30, timeout_s=400.0)
    with pytest.raises(LeaseHeldError):
        lease_of(root, job_id="me", timeout_s=2).acquire()
    assert record(root)["job_id"] == "other-job"
    write_record(root, heartbeat=time.time() - 30, timeout_s=20.0)  # stale by both
    with lease_of(root, job_id="me", timeout_s=2) as lease:
        assert lease.previous is not None and lease.previous.job_id == "other-job"


def test_take_over_true_displaces_a_fresh_owner(root: Path) -> None:
    write_record(root)
    with lease_of(root, job_id="me", take_over=True) as lease:
        assert lease.previous is not None and lease.previous.host == "some-other-host"
        assert record(root)["job_id"] == "me"


def test_damaged_record_is_taken_over(root: Path) -> None:
    (root / LEASE_NAME).write_text("{not json")
    with lease_of(root, job_id="me"):
        assert record(root)["job_id"] == "me"
    with pytest.raises(CheckpointError, match="damaged"):
        (root / LEASE_NAME).write_text("[]")
        read_owner(LocalFileSystem(), str(root))


def test_confirming_a_local_lease_reads_the_record_without_fsspec(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention confirms the lease before every deletion: on a local disk the record is read
    with four system calls, not through fsspec's ``cat_file`` (made to fail here). A take-over
    written meanwhile is still found."""
    with lease_of(root, job_id="me") as lease:

        def no_fsspec(*args: object, **kwargs: object) -> bytes:
            raise AssertionError("read through fsspec")

        monkeypatch.setattr(LocalFileSystem, "cat_file", no_fsspec)
        lease.confirm()
        theirs = dict(record(root), lease_id="someone-else")
        (root / LEASE_NAME).write_text(json.dumps(theirs))
        with pytest.raises(LeaseLostError):
            lease.confirm()


def test_heartbeat_thread_refreshes_the_record(root: Path) -> None:
    with lease_of(root, job_id="me", heartbeat_interval_s=0.05) as lease:
        first = float(record(root)["heartbeat"])  # type: ignore[arg-type]
        deadline = time.monotonic() + BOUND_S
        while float(record(root)["heartbeat"]) <= first:  # type: ignore[arg-type]
            assert time.monotonic() < deadline, "the heartbeat was never refreshed"
            time.sleep(0.01)
        assert record(root)["lease_id"] == lease.owner.lease_id  # type: ignore[union-attr]
        assert not [p for p in os.listdir(root) if p.endswith(".tmp")]


def test_heartbeat_thread_notices_a_take_over(root: Path) -> None:
    with lease_of(root, job_id="me", heartbeat_interval_s=0.05) as lease:
        write_record(root, job_id="thief", lease_id="e" * 32)
        deadline = time.monotonic() + BOUND_S
        while True:
            try:
                lease.check()
            except LeaseLostError as lost:
                assert "'thief'" in str(lost)
                break
            assert time.monotonic() < deadline, "the heartbeat never noticed the take-over"
            time.sleep(0.01)
    assert record(root)["job_id"] == "thief", "the loser deleted or overwrote the new record"


class _TakeOverInTheMiddle:
    """Fault injection for the read-then-write race: the first record write of ``victim``
    (its heartbeat's, after its read) first lets ``thief`` take over on another thread, and
    writes once the thief has either finished or waits for the record's lock."""

    def __init__(self, thief: OwnerLease, monkeypatch: pytest.MonkeyPatch) -> None:

        self.thief = thief
        self.thief_waits = threading.Event()
        self.errors: list[BaseException] = []
        self.thread: threading.Thread | None = None
        self._original = lease_module._overwrite
        monkeypatch.setattr(lease_module, "_overwrite", self._overwrite)
        seen = self.thief_waits

        class WaitingSeen(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if "waiting for the lock" in record.getMessage():
                    seen.set()

        self._logger = logging.getLogger("ckptmgr.lease")
        self._handler, self._level = WaitingSeen(logging.DEBUG), self._logger.level
        self._logger.addHandler(self._handler)
        self._logger.setLevel(logging.DEBUG)

    def _take_over(self) -> None:
        try:
            self.holding, _ = self.thief._acquire_fresh()  # internal: one process, one holding
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)

    def _overwrite(self, fs: object, path: str, data: bytes) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._take_over)
            self.thread.start()
            deadline = time.monotonic() + BOUND_S
            while not self.thief_waits.wait(0.01) and self.thread.is_alive():
                assert time.monotonic() < deadline, "the take-over neither ended nor waited"
        self._original(fs, path, data)

    def close(self) -> None:
        self._logger.removeHandler(self._handler)
        self._logger.setLevel(self._level)


def _refuse_flock_of_directories(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: ``flock`` of a directory fails with EBADF, as on NFS (which locks only
    files open for writing)."""
    import stat

    real_flock = lease_module.fcntl.flock

    def flock(fd: int, operation: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EBADF, "Bad file descriptor")
        real_flock(fd, operation)

    monkeypatch.setattr(lease_module.fcntl, "flock", flock)


@pytest.mark.parametrize("lock", ["directory", "lock-file"])
def test_a_heartbeat_never_overwrites_a_take_over_written_after_its_read(
    root: Path, monkeypatch: pytest.MonkeyPatch, lock: str
) -> None:
    """A heartbeat reads the record, then rewrites it: a take-over written in between was
    overwritten, so the new owner was displaced in turn (found only at its own next beat).
    The lock is the root directory's, or (NFS) a file beside the record."""
    if lock == "lock-file":
        _refuse_flock_of_directories(monkeypatch)
    victim = lease_of(root, job_id="victim", heartbeat_interval_s=3600)
    thief = lease_of(root, job_id="thief", take_over=True, heartbeat_interval_s=3600)
    victim.acquire()
    race = _TakeOverInTheMiddle(thief, monkeypatch)
    try:
        victim.refresh()  # its read comes first, the take-over waits for its write
        assert race.thread is not None
        race.thread.join(BOUND_S)
        assert not race.thread.is_alive() and not race.errors, race.errors
        assert record(root)["job_id"] == "thief", "the heartbeat overwrote the take-over"
        assert race.thief_waits.is_set(), "the take-over never waited for the lock"
        with pytest.raises(LeaseLostError, match="taken over by job 'thief'"):
            victim.refresh()
    finally:
        race.close()
        victim.release()
        if race.thread is not None and not race.errors:
            race.holding.stop()
    assert record(root)["job_id"] == "thief", "the displaced owner's release deleted the record"
    expected = [LEASE_NAME] + ([LEASE_NAME + ".lock"] if lock == "lock-file" else [])
    assert sorted(os.listdir(root)) == expected


def test_where_nothing_can_be_locked_the_lease_still_works_and_says_so(
    root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:

    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lease_module.fcntl, "flock", no_flock)
    with caplog.at_level(logging.WARNING, logger="ckptmgr.lease"):
        with lease_of(root, job_id="me") as lease:
            assert record(root)["lease_id"] == lease.owner.lease_id  # type: ignore[union-attr]
    assert not (root / LEASE_NAME).exists()
    assert any("no lock could be had" in r.getMessage() for r in caplog.records)


def test_without_fcntl_the_lease_works_unlocked(
    root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Windows has no ``fcntl``: importing ckptmgr must not fail there, and the lease works
    without the lock (quietly: nothing could have it)."""

    monkeypatch.setattr(lease_module, "fcntl", None)
    with caplog.at_level(logging.WARNING, logger="ckptmgr.lease"):
        with lease_of(root, job_id="me") as lease:
            assert record(root)["lease_id"] == lease.owner.lease_id  # type: ignore[union-attr]
    assert not (root / LEASE_NAME).exists()
    assert not caplog.records


def test_handles_in_one_process_share_the_lease(root: Path) -> None:
    first = lease_of(root, job_id="job-A")
    second = lease_of(root, job_id="job-A")
    a, b = first.acquire(), second.acquire()
    assert a.lease_id == b.lease_id
    first.release()
    assert record(root)["lease_id"] == a.lease_id, "released while another handle holds it"
    second.release()
    assert not (root / LEASE_NAME).exists()
    second.release()  # idempotent


def test_handles_on_one_root_through_a_symlink_share_the_lease(root: Path, tmp_path: Path) -> None:
    """A second manager of this process on the same root under another path (a symlink) shares
    the first one's lease: it used to take it over as "the same job restarting", and the first
    manager lost it at its next heartbeat."""
    link = tmp_path / "link"
    link.symlink_to(root)
    first, second = lease_of(root, job_id="job-A"), lease_of(link, job_id="job-A")
    a = first.acquire()
    b = second.acquire()
    assert b.lease_id == a.lease_id and second.previous is None
    first.release()
    assert record(root)["lease_id"] == a.lease_id, "released while another handle holds it"
    second.release()
    assert not (root / LEASE_NAME).exists()


def test_a_released_lease_is_not_reused_after_its_symlink_moved(root: Path, tmp_path: Path) -> None:
    """release() forgets the holding under the key it was registered with, even when the
    symlinked root now points elsewhere: a later handle gets a fresh lease with a live
    heartbeat, not the stopped one (which another job would take over while check() passes)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "current"
    link.symlink_to(root)
    first = lease_of(link, job_id="job-A")
    held = first.acquire()
    link.unlink()
    link.symlink_to(elsewhere)
    first.release()
    link.unlink()
    link.symlink_to(root)
    second = lease_of(link, job_id="job-A")
    again = second.acquire()
    try:
        assert again.lease_id != held.lease_id
        assert record(root)["lease_id"] == again.lease_id
    finally:
        second.release()


def test_lease_on_an_fsspec_store() -> None:
    """Non-local stores take the create-only write path; memory:// stands in for them."""
    fs = fsspec.filesystem("memory")
    url_root = "/lease-test-root"
    fs.makedirs(url_root, exist_ok=True)
    foreign = Owner(
        job_id="other-job",
        host="some-other-host",
        boot_id=None,
        pid=4242,
        pid_start=None,
        lease_id="f" * 32,
        acquired_at=time.time(),
        heartbeat=time.time(),
        timeout_s=60.0,
    )
    fs.pipe_file(f"{url_root}/{LEASE_NAME}", foreign.to_json())
    with pytest.raises(LeaseHeldError, match="'other-job'"):
        OwnerLease(fs, url_root, job_id="job-A").acquire()
    fs.rm_file(f"{url_root}/{LEASE_NAME}")
    lease = OwnerLease(fs, url_root, job_id="job-A")
    lease.acquire()
    try:
        owner = read_owner(fs, url_root)
        assert isinstance(owner, Owner) and owner.job_id == "job-A"
    finally:
        lease.release()
    assert read_owner(fs, url_root) is None


def test_invalid_timeout_is_rejected(root: Path) -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        lease_of(root, timeout_s=0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_forked_child_neither_releases_nor_inherits_its_parents_lease(root: Path) -> None:
    """The child's copy of a held OwnerLease (a with block it leaves, say) deleted the
    parent's owner.json on release, and a manager of the child shared the parent's hold. Now
    release() there only forgets the holding, and acquire() there acquires anew, as a process
    of its own: refused while the parent (the same job, by the handle's job id) lives."""
    with lease_of(root) as held:
        lease_id = record(root)["lease_id"]

        def leave_then_acquire() -> bytes:
            held.release()
            try:
                held.acquire()
            except LeaseHeldError:
                return b"refused"
            return b"acquired"

        assert in_forked_child(leave_then_acquire) == b"refused"
        assert record(root)["lease_id"] == lease_id
        held.refresh()  # still the parent's
    assert not (root / LEASE_NAME).exists()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_descendant_whose_forking_parent_exited_is_not_taken_for_the_jobs_restart(
    root: Path,
) -> None:
    """The owner forks A, A forks B and exits (B is reparented, as a daemon is): /proc's parent
    links no longer lead from B to the owner, and B, of the same job, took the live owner's
    lease over as its restart. The processes a process was forked from are now remembered."""
    with lease_of(root, job_id="job-7") as held:
        go_read, go_write = os.pipe()
        answer_read, answer_write = os.pipe()
        a = os.fork()
        if a == 0:  # pragma: no cover - child A: forks B, then exits
            if os.fork() == 0:  # child B: acquires once A is gone (reaped: B is reparented)
                answer = b"no answer"
                try:
                    if select.select([go_read], [], [], BOUND_S)[0]:
                        lease_of(root, job_id="job-7").acquire()
                        answer = b"acquired"
                except LeaseHeldError:
                    answer = b"refused"
                finally:
                    os.write(answer_write, answer)
                    os._exit(0)
            os._exit(0)
        os.close(answer_write)
        os.waitpid(a, 0)
        os.write(go_write, b"go")
        ready, _, _ = select.select([answer_read], [], [], BOUND_S)
        answer = os.read(answer_read, 64) if ready else b"timed out"
        for fd in (go_read, go_write, answer_read):
            os.close(fd)
        assert answer == b"refused"
        held.refresh()  # still the owner's


PID_1_OWNER_CODE = r"""
import os, sys
from fsspec.implementations.local import LocalFileSystem
from ckptmgr.lease import LeaseHeldError, OwnerLease
root = sys.argv[1]
with OwnerLease(LocalFileSystem(), root, job_id="job-7") as held:
    pid = os.fork()
    if pid == 0:
        try:
            OwnerLease(LocalFileSystem(), root, job_id="job-7").acquire()
            print("child acquired", flush=True)
        except LeaseHeldError:
            print("child refused", flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    held.refresh()
    print(f"owner pid {os.getpid()} still holds", flush=True)
"""


@pytest.mark.skipif(not _can_unshare(), reason="unshare(1) cannot make a PID namespace here")
def test_an_owner_that_is_pid_1_is_an_ancestor_too(root: Path) -> None:
    """In a container the trainer may be pid 1, which the walk up the parent links left out:
    its forked child, of the same job, took its lease over as the job's restart."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    done = subprocess.run(
        [*NEW_PID_NAMESPACE, sys.executable, "-c", PID_1_OWNER_CODE, str(root)],
        capture_output=True,
        text=True,
        timeout=BOUND_S,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["child refused", "owner pid 1 still holds"]


COLLECTED_INSIDE_ACQUIRE = r"""
import gc, sys
from pathlib import Path
from fsspec.implementations.local import LocalFileSystem
from ckptmgr import lease as lease_module
from ckptmgr.lease import LEASE_NAME, OwnerLease

root = Path(sys.argv[1])
lease = OwnerLease(LocalFileSystem(), str(root))
lease.acquire()
holding = lease_module._HOLDINGS[lease._key()]
lease.cycle = lease  # (freed by a collection)
with lease_module._HOLDINGS_LOCK:  # as inside acquire()
    del lease
    gc.collect()  # runs the finalizer here
held = (root / LEASE_NAME).exists()
holding.give_back_dropped()  # (what its heartbeat, or an acquire of the root, runs)
print("given back" if held and not (root / LEASE_NAME).exists() else "not given back")
"""


def test_a_handle_collected_inside_acquire_is_given_back_after_it(tmp_path: Path) -> None:
    """A handle dropped without release() is given back, but not by its finalizer itself: a
    collection can start anywhere, inside acquire() too, which holds the lock of the process's
    holdings; a finalizer that gave back there waited for that lock for ever. (In a fresh
    interpreter: a forked child of a test process whose other threads held locks at the fork
    could hang for reasons of its own.)"""
    root = tmp_path / "run"
    root.mkdir()
    result = run_python(COLLECTED_INSIDE_ACQUIRE, str(root), timeout=BOUND_S)
    assert result.returncode == 0 and result.stdout.strip() == "given back", result
