"""``async_mode="process"``: DCP saves run in a checkpoint daemon process.

In thread mode the background write (DCP's planning, the metadata, the data files) runs on a
thread of the training process, so the work it does while holding the GIL slows a training loop
that is itself Python-bound. In process mode that part runs in a daemon process instead: DCP's
process-based async checkpointing (``torch.distributed.checkpoint._async_process_executor``),
whose daemon is started on the first save (with ``spawn``), serves every later save of its
manager, and forms a gloo group of its own with the daemons of the other ranks.

The staged tensors reach the daemon without a copy: in process mode the staging arena lives in
shared memory (:mod:`ckptmgr.staging`), so only handles travel over the pipe. The arena's file
descriptor goes to a daemon once (the first save that uses that arena); the daemon keeps the
arena mapped, and later saves send each tensor as the arena's token and the tensor's place in
it (:class:`_ArenaView`). Each request also names the arenas still alive in the training
process, and the daemon lets go of any other one as it reads the request, which is when DCP's
daemon let go of the previous request's tensors anyway: no memory is held longer than before.
(Handing a descriptor over costs the training process a connection to its resource sharer: a
thread of Python and about 30 system calls that share the GIL with the training loop.) The
daemon returns DCP's metadata with the sizes and CRC-32s of the files it wrote
(``CHECKSUMS_ATTRIBUTE``), or, for a save its writer committed, the commit's result alone
(:meth:`_CallServingConnection.send`). A daemon that died (killed, out of memory) fails the
save that was running; the next save starts a new one. A single-process save on a local disk is
committed by the daemon's writer too (:mod:`ckptmgr.daemon_commit`; what it needs of the record
beyond the per-save fields, the layout of the packed tensors, is kept in the daemon:
:meth:`SaveProcess.kept_in_daemon`), and so is the retention of ckptmgr's own policies that
follows. A retention policy of the user's own decides in the training process; the file work
that follows may be handed to the daemon between saves (:meth:`SaveProcess.run_when_idle`: on a
local disk, deleting the steps retention let go of), so that its system calls do not hand the
training process's GIL back and forth.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing.connection
import multiprocessing.process
import multiprocessing.resource_sharer
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import pickle
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import metadata as dcp_metadata

from ckptmgr.bootstrap_guard import ENTRY_POINT_HINT
from ckptmgr.errors import CheckpointError
from ckptmgr.niceness import background_niceness, set_background_niceness
from ckptmgr.process_exit import end_process_now
from ckptmgr.staging import shared_arenas

if TYPE_CHECKING:
    from ckptmgr.collectives import Collectives

log = logging.getLogger(__name__)

CHECKSUMS_ATTRIBUTE = "ckptmgr_checksums"
"""Attribute of the returned DCP metadata: file name -> (size, CRC-32) of what the daemon wrote."""
LISTING_ATTRIBUTE = "ckptmgr_listing"
"""Attribute of the returned DCP metadata, local saves only: every file in the step's write
directory (relative path -> size), listed by the coordinator's writer once ``.metadata`` was
written (in process mode, by the daemon)."""

ANSWERED_ATTRIBUTE = "ckptmgr_answered_by_daemon"
"""Set (True) on an exception that the daemon sent back as its answer to a save: the daemon
caught it, answered, and serves on (DCP's serving loop continues after a failed save)."""

TENSOR_ENTRIES_ATTRIBUTE = "ckptmgr_tensor_entries"
"""Attribute of the metadata a daemon answers a save it did not commit with, in place of DCP's
whole metadata: the stored tensors (name -> :class:`~ckptmgr.tensor_table.TensorEntry`, as
:func:`ckptmgr.record.tensor_entries` makes them from DCP's metadata), all that the training
process reads of it beside the attributes of checksums and listing; ``SAME_TENSOR_ENTRIES``
where they are those of the daemon's last such answer (:meth:`SaveProcess.save` puts them
back)."""
SAME_TENSOR_ENTRIES = "the tensor entries of the last answer"

COMMITTED_ATTRIBUTE = "ckptmgr_committed"
"""Attribute of the returned DCP metadata when the writer committed the step in its ``finish``
(:mod:`ckptmgr.daemon_commit`): what the commit returned."""

_LONGEST_POLL_S = 2_000_000.0  # Connection.poll's limit (its select takes milliseconds in an int)
_EXIT_WAIT_S = 5.0  # a daemon whose pipe broke is given this long to be gone
_EXIT_PRIORITY = 100
"""Of the exit hook that stops a manager's daemon: multiprocessing runs hooks of priority >= 0
first at interpreter exit, before it sends SIGTERM to its daemonic children and waits for them
(the daemon ignores SIGTERM, and waits on a pipe this process still holds: without the hook,
a process that ends without close() would wait forever). Exit itself first waits for the queued
saves (the background worker is not a daemon thread), so no save is cut short."""
DAEMON_IGNORED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
"""Signals the daemon ignores (from the start of its entry function): a scheduler's preemption
notice or Ctrl-C sent to the whole process group is the training process's to handle, and would
otherwise kill the daemon with the save in flight (and the preemption save would wait for a new
one). The daemon ends when the training process asks it to, or is killed (SIGKILL)."""

try:
    # Starting a daemon imported this module on first use, on the writer thread. A fork of the
    # training process while that import held its module lock left the lock held in the child
    # for good, and the child's own manager then waited for it in its first daemon start.
    # Imported here, by the thread that imports ckptmgr, a daemon start imports nothing.
    import multiprocessing.popen_spawn_posix
except ImportError:  # pragma: no cover - Windows (no spawn from a POSIX fork server)
    pass

try:
    from torch.distributed.checkpoint._async_process_executor import (
        _AsyncCheckpointProcess,
        _ProcessGroupInitInfo,
    )
except ImportError:  # pragma: no cover - torch without process-based async checkpointing
    _AsyncCheckpointProcess = None  # type: ignore[assignment,misc]
    _ProcessGroupInitInfo = None  # type: ignore[assignment,misc]

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = None  # type: ignore[assignment,misc]


if _AsyncCheckpointProcess is not None:

    class _CheckpointProcess(_AsyncCheckpointProcess):  # type: ignore[misc,valid-type]
        """DCP's checkpoint daemon, with six changes made inside the daemon: it saves each
        request as thread mode's writer thread does (:mod:`ckptmgr.daemon_save`), it runs
        :func:`ckptmgr.niceness.background_niceness` of the training process (``ckptmgr_niceness``
        on the init info: below the training loop), it ignores
        :data:`DAEMON_IGNORED_SIGNALS`, its logging stays
        at WARNING (DCP's sets the daemon's root logger to INFO: three lines on stderr for
        every save), and its gloo group times out after ``ckptmgr_timeout_s`` (set on the
        init info), so a daemon whose partner died fails its save instead of waiting for
        torch's default of 30 minutes; asked to stop, it ends without the interpreter's
        finalization (:func:`_end_daemon_without_finalizing`)."""

        def __init__(self, pg_init_info: Any) -> None:
            self._made_in = os.getpid()
            # Held from its start until the daemon ignores them (see _hold_daemon_signals)
            self._held_signals = _hold_daemon_signals()
            try:
                super().__init__(pg_init_info)
            except BaseException as exc:
                process = getattr(self, "_save_process", None)
                if process is None:
                    raise
                if not isinstance(exc, RuntimeError):  # (an interrupt: Ctrl-C)
                    _kill_unready(process)
                    raise
                # DCP's "Checkpoint background process is dead", or its timeout
                pipe_closed = isinstance(exc.__context__, EOFError)
                if pipe_closed or process.exitcode is not None:
                    raise _ended_at_start(process) from exc
                _kill_unready(process)  # nothing holds it: it would outlive close() and exit
                raise CheckpointError(
                    f"the checkpoint daemon process (pid {process.pid}) did not become ready: "
                    f"{exc}; it was killed"
                ) from exc
            finally:
                self._release_signals()

        def _release_signals(self) -> None:
            """Unblock, in this thread, the signals held while the daemon was started."""
            held, self._held_signals = self._held_signals, None
            if held is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)

        def _wait_for_response(self, timeout: float | None = None) -> Any:
            self._release_signals()  # (DCP's first wait follows the daemon's start at once)
            return super()._wait_for_response(timeout)

        def __del__(self) -> None:
            # DCP's stops the daemon; in a forked child, which inherited this object, the
            # daemon is not its child ("AssertionError: can only test a child process" printed
            # at the child's exit), and the parent's to stop
            if getattr(self, "_made_in", None) == os.getpid() and hasattr(self, "_save_process"):
                super().__del__()

        @staticmethod
        def _checkpointing_subprocess(pg_init_info: Any, parent_conn: Any) -> None:
            niceness = getattr(pg_init_info, "ckptmgr_niceness", None)
            if niceness is not None:  # first: threads started later inherit it
                set_background_niceness(niceness)
            for signum in DAEMON_IGNORED_SIGNALS:  # process-wide, whichever thread gets one
                signal.signal(signum, signal.SIG_IGN)
            if hasattr(signal, "pthread_sigmask"):  # held since the start: dropped now
                signal.pthread_sigmask(signal.SIG_UNBLOCK, DAEMON_IGNORED_SIGNALS)
            import datetime
            import functools

            from torch.distributed.checkpoint import _async_process_executor

            def warnings_only(rank: int) -> None:
                logging.getLogger().setLevel(logging.WARNING)

            _async_process_executor._init_logger = warnings_only  # type: ignore[assignment]
            timeout_s = getattr(pg_init_info, "ckptmgr_timeout_s", None)
            if timeout_s is not None:
                _async_process_executor.dist.init_process_group = functools.partial(  # type: ignore[attr-defined]
                    dist.init_process_group, timeout=datetime.timedelta(seconds=timeout_s)
                )
            from ckptmgr.daemon_save import save_in_daemon

            _AsyncCheckpointProcess._execute_save = staticmethod(save_in_daemon)  # type: ignore[method-assign]
            _AsyncCheckpointProcess._checkpointing_subprocess(
                pg_init_info, _CallServingConnection(parent_conn)
            )
            _end_daemon_without_finalizing()


def _main_script_spawn_cannot_read() -> str | None:
    """The path multiprocessing's spawn would run the main module from where no file is there
    (``python - < script.py``: ``<stdin>``), else None; as ``spawn.get_preparation_data``
    finds it (a module run with ``-m`` is imported by name, ``-c`` and notebooks have no path)."""
    main = sys.modules.get("__main__")
    if main is None or getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return None
    if getattr(sys, "frozen", False):  # (PyInstaller: spawn runs the frozen program again)
        return None
    path = getattr(main, "__file__", None)
    if not isinstance(path, str):
        return None
    if not os.path.isabs(path) and multiprocessing.process.ORIGINAL_DIR is not None:
        path = os.path.join(multiprocessing.process.ORIGINAL_DIR, path)
    return None if os.path.exists(path) else os.path.normpath(path)


def _hold_daemon_signals() -> set[signal.Signals] | None:
    """Block :data:`DAEMON_IGNORED_SIGNALS` in this thread (the one starting a daemon); returns
    the mask to set again once the daemon is started (None where threads have no masks). A
    spawned process starts with its parent thread's mask, and the daemon keeps them blocked
    until it ignores them: from its start until then (seconds: it imports the main script and
    torch) a Ctrl-C or SIGTERM sent to the process group killed it, and the save it had
    accepted was lost. Signals to the training process reach its other threads meanwhile (the
    main thread, where Python handles them)."""
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - Windows
        return None
    # Started first: a start of multiprocessing's resource tracker (by the daemon's start, the
    # first time) blocks SIGINT and SIGTERM for its own start, then unblocks them in this thread.
    multiprocessing.resource_tracker.ensure_running()
    return signal.pthread_sigmask(signal.SIG_BLOCK, DAEMON_IGNORED_SIGNALS)


def _kill_unready(process: multiprocessing.process.BaseProcess) -> None:
    """Kill a daemon that failed to become ready (it ignores ``SIGTERM``), and reap it: left
    running, multiprocessing's exit would wait for it forever."""
    if process.is_alive():
        process.kill()
    process.join(_EXIT_WAIT_S)


def _ended_at_start(process: multiprocessing.process.BaseProcess) -> CheckpointError:
    """The error for a daemon that closed its pipe before it was ready: its exit awaited (on
    its sentinel, without reaping it) for its exit code."""
    multiprocessing.connection.wait([process.sentinel], timeout=_EXIT_WAIT_S)
    code = process.exitcode
    if code is not None and code < 0:  # killed (the OOM killer's SIGKILL): no advice on code
        try:
            killer = signal.Signals(-code).name
        except ValueError:
            killer = f"signal {-code}"
        return CheckpointError(
            f"the checkpoint daemon process (pid {process.pid}) was killed by {killer} before "
            f"it was ready (exit code {code})"
        )
    return CheckpointError(
        f"the checkpoint daemon process (pid {process.pid}) ended before it was ready, exit code "
        f"{code}; what it raised is on its standard error. If the main script makes "
        f"the manager at its top level, {ENTRY_POINT_HINT}"
    )


def _end_daemon_without_finalizing() -> NoReturn:
    """End the daemon once DCP's serving loop has returned (asked to stop; its gloo group
    destroyed, its pipe closed): logging's handlers and the standard streams flushed, then
    ``os._exit(0)``, which skips the interpreter's finalization. That finalization, with torch
    loaded, took 0.7 s of the 0.9 s a ``close()`` of a process-mode manager waited for its
    daemon to end (``benchmarks/bench_close.py``), and there is nothing left for it to do: every
    save was answered (after its files were synced) before the loop read the request to stop,
    and the kernel releases what the daemon holds (shared memory mappings, descriptors,
    sockets)."""
    end_process_now(0)


class _CallResult:
    """What :class:`_DaemonCall` returned, or the exception it raised, on its way back."""

    __slots__ = ("error", "value")

    def __init__(self, value: Any, error: BaseException | None) -> None:
        self.value = value
        self.error = error

    def unwrap(self) -> Any:
        """The value, or raise the error."""
        if self.error is not None:
            raise self.error
        return self.value


class _DaemonCall:
    """A request to the daemon, between two saves, to run ``function(*args)`` (a function of a
    module the daemon imports: pickled by name)."""

    __slots__ = ("args", "function")

    def __init__(self, function: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.function = function
        self.args = args

    def run(self) -> _CallResult:
        """In the daemon: the call's result, or what it raised (as a ``CheckpointError`` naming
        it when that cannot be pickled)."""
        try:
            return _CallResult(self.function(*self.args), None)
        except Exception as exc:
            try:
                pickle.dumps(exc)
            except Exception:
                return _CallResult(None, CheckpointError(f"in the checkpoint daemon: {exc!r}"))
            return _CallResult(None, exc)


class _CallServingConnection:
    """In the daemon: its end of the pipe as DCP's serving loop sees it. Between DCP's requests
    the training process may send a :class:`_DaemonCall`; :meth:`recv` runs it and answers it
    before it returns the next request to DCP's loop."""

    def __init__(self, connection: multiprocessing.connection.Connection) -> None:
        self._connection = connection
        self._last_stored: Any = None  # DCP's state_dict_metadata of the last slimmed answer

    def recv(self) -> Any:
        """The next request that is not a :class:`_DaemonCall`."""
        while True:
            try:
                request = self._connection.recv()
            except EOFError:  # the training process is gone (killed): nothing is left to serve
                _end_daemon_without_finalizing()
            if not isinstance(request, _DaemonCall):
                return request
            self._connection.send(request.run())

    def send(self, answer: Any) -> None:
        """Send DCP's answer. An exception (a save that failed here) is marked with
        :data:`ANSWERED_ATTRIBUTE`: the training process then knows this daemon answered it and
        serves on (:meth:`SaveProcess.save` keeps it). The answer to a save the daemon's writer
        committed (``COMMITTED_ATTRIBUTE`` set) goes with nothing the training process does not
        read: DCP's metadata emptied (the step's own is in its ``.metadata`` file), the file
        sizes and checksums left out (they are in the commit record). Unpickling the whole answer
        (1.4 KB, a dozen classes) took the training process's writer thread, which holds the
        GIL meanwhile, 0.33 ms per save of 20,000 tensors (median of 35).

        The answer to a save left for the training process to commit (under torch.distributed,
        on the coordinator; or on a remote store) goes with what the training process reads of
        it: the checksums, the listing and the stored tensors' entries
        (``TENSOR_ENTRIES_ATTRIBUTE``; ``SAME_TENSOR_ENTRIES`` while DCP's kept plans keep the
        very same metadata). DCP's whole metadata of 5,000 DTensors over 2 ranks took about
        0.7 s to pickle here and unpickle on the training process's writer thread, every
        save."""
        if isinstance(answer, BaseException):
            try:
                setattr(answer, ANSWERED_ATTRIBUTE, True)  # (travels in the exception's dict)
            except (AttributeError, TypeError):  # (an exception type without a __dict__)
                pass
        committed = getattr(answer, COMMITTED_ATTRIBUTE, None)
        if committed is not None and isinstance(answer, dcp_metadata.Metadata):
            answer = dcp_metadata.Metadata(state_dict_metadata={})
            setattr(answer, COMMITTED_ATTRIBUTE, committed)
        elif isinstance(answer, dcp_metadata.Metadata) and answer.state_dict_metadata:
            answer = self._slimmed(answer)
        self._connection.send(answer)

    def _slimmed(self, metadata: dcp_metadata.Metadata) -> dcp_metadata.Metadata:
        """``metadata`` as :meth:`send` sends it to be committed by the training process."""
        from ckptmgr.record import tensor_entries

        stored = metadata.state_dict_metadata
        entries: Any = SAME_TENSOR_ENTRIES
        if stored is not self._last_stored:
            entries = tensor_entries(metadata)
            self._last_stored = stored
        slim = dcp_metadata.Metadata(state_dict_metadata={})
        for name in (CHECKSUMS_ATTRIBUTE, LISTING_ATTRIBUTE):
            if hasattr(metadata, name):
                setattr(slim, name, getattr(metadata, name))
        setattr(slim, TENSOR_ENTRIES_ATTRIBUTE, entries)
        return slim

    def __getattr__(self, name: str) -> Any:  # close, poll, ...: the pipe's own
        return getattr(self._connection, name)


_STAGED_TENSORS = "staged tensors"
"""The :meth:`SaveProcess.kept_in_daemon` slot of the staged tensors of a save request."""
_DAEMON_KEPT: dict[str, dict[int, Any]] = {}
"""In a daemon: by slot, the values it keeps for it, by token."""
_KEPT_TOKENS = itertools.count(1)


def _kept_value(slot: str, token: int, sent: bool, value: Any, kept_tokens: frozenset[int]) -> Any:
    """In the daemon, while a request is read: the value kept in ``slot`` under ``token``
    (``value`` itself when ``sent``: kept from now on). The slot's values whose tokens are not
    in ``kept_tokens`` (those the training process stopped counting on) are dropped first."""
    kept = _DAEMON_KEPT.setdefault(slot, {})
    for gone in kept.keys() - kept_tokens:
        del kept[gone]
    if sent:
        kept[token] = value
        return value
    if token not in kept:  # (the training process keeps count: never expected)
        raise CheckpointError(f"the checkpoint daemon does not keep {slot} {token}")
    return kept[token]


class _KeptInDaemon:
    """A value in a save request that the daemon keeps: pickled whole the first time its daemon
    is sent it, by token after that (see :meth:`SaveProcess.kept_in_daemon`)."""

    __slots__ = ("_keeper", "_slot", "_value")

    def __init__(self, keeper: SaveProcess, slot: str, value: Any) -> None:
        self._keeper = keeper
        self._slot = slot
        self._value = value

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_kept_value, self._keeper._kept_arguments(self._slot, self._value))


_DAEMON_ARENAS: dict[int, torch.UntypedStorage] = {}
"""In a daemon: the staging arenas it keeps mapped, by token."""


def _arena_view(
    token: int,
    storage: torch.UntypedStorage | None,
    alive: frozenset[int],
    dtype: torch.dtype,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    offset: int,
) -> torch.Tensor:
    """In the daemon, while a request is read: a staged tensor, as a view of the arena named
    ``token`` (``storage`` is that arena the first time this daemon is sent it). Arenas that
    are not in ``alive`` (the training process let go of them) are dropped first."""
    if storage is not None:
        _DAEMON_ARENAS[token] = storage
    for gone in _DAEMON_ARENAS.keys() - alive:
        del _DAEMON_ARENAS[gone]
    arena = _DAEMON_ARENAS.get(token)
    if arena is None:  # (the training process keeps count of what it sent: never expected)
        raise CheckpointError(f"the checkpoint daemon was never sent staging arena {token}")
    return torch.empty(0, dtype=dtype).set_(arena, offset, shape, stride)


class _ArenaView:
    """A staged tensor on its way to the daemon: pickled as a view of its arena (by token,
    with the arena's storage only when ``storage`` is given), unpickled by :func:`_arena_view`
    as a tensor on the arena the daemon keeps."""

    __slots__ = ("_args",)

    def drop_storage(self) -> None:
        """Forget the arena's storage (the daemon has it by now): a view kept after its save
        must not keep the arena's memory alive in this process."""
        if self._args[1] is not None:
            self._args = (self._args[0], None, *self._args[2:])

    def __init__(
        self,
        tensor: torch.Tensor,
        token: int,
        storage: torch.UntypedStorage | None,
        alive: frozenset[int],
    ) -> None:
        self._args = (
            token,
            storage,
            alive,
            tensor.dtype,
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.storage_offset(),
        )

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_arena_view, self._args)


def _dtensor(local: torch.Tensor, spec: Any) -> torch.Tensor:
    """In the daemon, while a request is read: a staged DTensor, rebuilt from its local tensor
    and its spec (see :class:`_SentDTensor`)."""
    return DTensor(local, spec, requires_grad=False)


class _SentDTensor:
    """A staged DTensor on its way to the daemon: pickled as its local tensor (an
    :class:`_ArenaView` when that is a view of an arena) and its spec, rebuilt by
    :func:`_dtensor`.

    A DTensor is not pickled as it is: torch gives its wrapper the storage offset of its local
    tensor, and pickles a wrapper whose offset is not 0 as if it had a storage of its own,
    which it has not (torch 2.13: ``pickle`` raises "invalid python storage";
    ``ForkingPickler``, whose storage reducer shares the storage's memory, crashes the process
    with SIGSEGV). Every staged local tensor but the first of a shared arena has such an
    offset."""

    __slots__ = ("_args",)

    def __init__(self, local: Any, spec: Any) -> None:
        self._args = (local, spec)

    @property
    def local(self) -> Any:
        """The local tensor as sent (an :class:`_ArenaView`, or a tensor)."""
        return self._args[0]

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_dtensor, self._args)


class _SentState:
    """The staged tensors of a save request, as sent (:meth:`SaveProcess._by_arena`), and
    which tensor objects they were (weakly: a state kept here must not keep staging memory
    alive)."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], state: dict[str, Any], arenas: frozenset[int]
    ) -> None:
        """``arenas``: the tokens of the staging arenas that ``state``'s views are views of."""
        self.state = state
        self.arenas = arenas
        self._keys = list(tensors)
        self._tensors = [weakref.ref(tensor) for tensor in tensors.values()]
        self._storages_dropped = False

    def holds(self, tensors: dict[str, torch.Tensor]) -> bool:
        """True when ``tensors`` are the very objects sent, under the same keys in order."""
        if self._tensors and not _refers_to(self._tensors[0], next(iter(tensors.values()), None)):
            return False  # (another slot's: told by its first tensor)
        return list(tensors) == self._keys and all(map(_refers_to, self._tensors, tensors.values()))

    def sent(self) -> None:
        """The request was answered: the arenas' storages it carried are the daemon's now."""
        if self._storages_dropped:
            return
        self._storages_dropped = True
        for value in self.state.values():
            view = value.local if isinstance(value, _SentDTensor) else value
            if isinstance(view, _ArenaView):
                view.drop_storage()


def _refers_to(reference: weakref.ref[Any], value: Any) -> bool:
    return reference() is value


def available() -> bool:
    """True when this torch has DCP's process-based async checkpointing."""
    return _AsyncCheckpointProcess is not None


class SaveProcess:
    """One manager's checkpoint daemon, started on first use.

    Distributed (``comm`` given), starting a daemon is a collective over its background group:
    every rank calls :meth:`save` in the same order, and when any rank's daemon is not
    :attr:`healthy` every rank calls :meth:`reset` first (the manager agrees on that before
    each save), so the daemons are always replaced together.
    """

    def __init__(
        self, comm: Collectives | None, timeout_s: float, *, kept_per_slot: int = 1
    ) -> None:
        """``kept_per_slot``: how many values the daemon keeps in each slot of
        :meth:`kept_in_daemon`, the most recently sent ones (the manager's staging slots,
        ``max_pending_async``: saves take turns between them, each with its own staged tensors
        and pack layout)."""
        if kept_per_slot < 1:
            raise ValueError(f"kept_per_slot must be at least 1, not {kept_per_slot}")
        if not available():
            raise CheckpointError(
                f"async_mode='process' needs DCP's process-based async checkpointing, which "
                f"torch {torch.__version__} does not have; use async_mode='thread'"
            )
        if multiprocessing.process.current_process().daemon:
            raise CheckpointError(
                "async_mode='process' cannot start its checkpoint daemon in a daemonic process "
                "(multiprocessing does not let one have children: a Process made with "
                "daemon=True, or a Pool's worker); use async_mode='thread'"
            )
        unreadable_main = _main_script_spawn_cannot_read()
        if unreadable_main is not None:
            raise CheckpointError(
                f"async_mode='process' cannot start its checkpoint daemon: multiprocessing's "
                f"spawn runs the main script again in it, from {unreadable_main!r}, which is no "
                f"file (a script read from standard input); run the script from a file, or use "
                f"async_mode='thread'"
            )
        self._comm = comm  # (its group is read when used: it is destroyed at interpreter exit)
        self._timeout_s = timeout_s
        self._daemon: Any = None
        self._exit_hook: multiprocessing.util.Finalize | None = None  # stops the daemon
        self._failed = False  # the last save failed so that the daemon (and group) is replaced
        self._arenas_sent: set[int] = set()  # tokens of the arenas the daemon keeps
        self._kept_per_slot = kept_per_slot
        # slot -> (token, value) of each value the daemon keeps, the most recently used last
        self._kept_sent: dict[str, list[tuple[int, Any]]] = {}
        self._sent_states: list[_SentState] = []  # the staged tensors the daemon keeps, alike
        self._last_entries: Any = None  # TENSOR_ENTRIES_ATTRIBUTE of the daemon's last answer
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The daemon's process id, or None when none is running."""
        daemon = self._daemon
        return None if daemon is None else daemon._save_process.pid

    @property
    def healthy(self) -> bool:
        """True when a daemon is running and its last save did not fail (or, in a single
        process, failed in the daemon, which answered it: see :meth:`save`)."""
        daemon = self._daemon
        return daemon is not None and daemon._save_process.is_alive() and not self._failed

    def save(
        self, tensors: dict[str, torch.Tensor], writer: Any, *, replace_unhealthy: bool = True
    ) -> dcp_metadata.Metadata:
        """Save ``tensors`` with ``writer`` in the daemon (started first if there is none) and
        return DCP's metadata (with ``CHECKSUMS_ATTRIBUTE``; emptied, with
        ``COMMITTED_ATTRIBUTE`` alone, when the daemon's writer committed the step). Raises
        what the daemon raised, or ``CheckpointError`` when it died. A save that the daemon
        failed and answered (a write that failed, a commit refused) leaves it serving the next
        save in a single process; after any other failure (the daemon died, the pipe broke), and
        after any failure when distributed (the ranks replace their daemons together), the next
        save uses a new daemon.

        ``replace_unhealthy=False`` (distributed: starting a daemon is a collective, decided by
        the ranks together before this call) starts a daemon only where there is none; a daemon
        found dead here fails this save, and the ranks replace theirs before the next."""
        with self._lock:
            if self._daemon is None or (replace_unhealthy and not self.healthy):
                self._replace()
            daemon = self._daemon
            try:
                staged = self._state_to_send(tensors)
                metadata = daemon.save(staged, storage_writer=writer, no_dist=self._comm is None)
                self._sent_state_kept()
                return self._with_entries(metadata)
            except BaseException as exc:
                process = daemon._save_process
                answered = getattr(exc, ANSWERED_ATTRIBUTE, False)
                if self._comm is None and answered and process.is_alive():
                    self._sent_state_kept()
                    raise  # the daemon failed the save itself and serves on: kept
                self._failed = True
                # A broken pipe means the daemon closed its end: it died, or is dying. Its
                # exit is awaited on its sentinel, without reaping it (another thread may).
                # (An OSError the daemon answered, a write that failed there, is no broken
                # pipe: it was taken for one, waited on for _EXIT_WAIT_S and reported as the
                # daemon's death.)
                broken = not answered and (
                    isinstance(exc, (OSError, EOFError))
                    or isinstance(exc.__context__, EOFError)  # DCP's "process is dead"
                )
                if broken:
                    multiprocessing.connection.wait([process.sentinel], timeout=_EXIT_WAIT_S)
                if broken or not process.is_alive():
                    raise CheckpointError(
                        f"the checkpoint daemon process (pid {process.pid}) died during the "
                        f"save: {exc!r}"
                    ) from exc
                raise

    def kept_in_daemon(self, slot: str, value: Any) -> Any:
        """``value``, to be put in a save request, for the daemon to keep in ``slot``: sent whole
        to each daemon the first time, and by token while it is the very same object as one of
        the slot's ``kept_per_slot`` most recently sent values (a new value replaces the least
        recently sent). For what stays the same from save to save but is too big to send every
        time (the pack layout of 20,000 tensors)."""
        return _KeptInDaemon(self, slot, value)

    def _kept_arguments(self, slot: str, value: Any) -> tuple[str, int, bool, Any, frozenset[int]]:
        """:func:`_kept_value`'s arguments for ``value`` in ``slot``, as the request that holds
        it is pickled (within :meth:`save`, for the daemon that reads it)."""
        kept = self._kept_sent.setdefault(slot, [])
        found = next((i for i, (_, held) in enumerate(kept) if held is value), None)
        if found is not None:
            kept.append(kept.pop(found))
            sent, token = False, kept[-1][0]
        else:  # (a failed send replaces the daemon: see _stop)
            sent, token = True, next(_KEPT_TOKENS)
            kept.append((token, value))
            del kept[: -self._kept_per_slot]
        return (slot, token, sent, value if sent else None, frozenset(t for t, _ in kept))

    def _forget_kept(self, slot: str, value: Any) -> None:
        """Stop counting on the daemon keeping ``value`` in ``slot``: it drops it as it reads
        the next request that carries the slot."""
        kept = self._kept_sent.get(slot, [])
        kept[:] = [(token, held) for token, held in kept if held is not value]

    def run_when_idle(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)`` (a module-level function), run by the daemon when one is running,
        healthy and not busy with a save; else (never waiting for a save), or when the daemon
        dies during the call, run in this process. Returns its result; raises what it raised.

        For file work after a save (removing a deleted step's files): done by the daemon, its
        system calls share no GIL with the training loop. ``function`` must be safe to run
        twice: a daemon that dies during the call may have done part of it."""
        if not self._lock.acquire(blocking=False):  # a save is running: no wait
            return function(*args)
        try:
            answer = self._call_daemon(function, args) if self.healthy else None
        finally:
            self._lock.release()
        if answer is None:
            return function(*args)
        return answer.unwrap()

    def _call_daemon(self, function: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """The daemon's :class:`_CallResult` of the call; None when the daemon could not take
        it (marked failed then: the next save replaces it). Called with the lock held."""
        daemon = self._daemon
        try:
            request = ForkingPickler.dumps(_DaemonCall(function, args))
        except Exception as exc:  # (a function not importable by name): run here
            log.warning("cannot send %r to the checkpoint daemon: %r", function, exc)
            return None
        try:
            daemon._process_pipe.send_bytes(request)
            if not daemon._process_pipe.poll(min(self._timeout_s, _LONGEST_POLL_S)):
                # A daemon hung (stopped, or stuck in a system call): the training process
                # waited for it for ever (a save() with retention too)
                self._failed = True
                log.warning(
                    "the checkpoint daemon (pid %s) did not answer a call of %s within %g s; "
                    "running it here (the next save replaces the daemon)",
                    daemon._save_process.pid,
                    getattr(function, "__qualname__", function),
                    self._timeout_s,
                )
                return None
            answer = daemon._process_pipe.recv()
        except Exception as exc:  # the pipe broke: the daemon died, or is dying
            self._failed = True
            log.warning(
                "the checkpoint daemon (pid %s) could not run %s: %r; running it here",
                daemon._save_process.pid,
                getattr(function, "__qualname__", function),
                exc,
            )
            return None
        if not isinstance(answer, _CallResult):  # never expected: the pipe is out of step
            self._failed = True
            log.warning("the checkpoint daemon answered a call with %r; running it here", answer)
            return None
        return answer

    def _state_to_send(self, tensors: dict[str, torch.Tensor]) -> Any:
        """What a save request carries for ``tensors``: kept by the daemon
        (:meth:`kept_in_daemon`), so that the very same staged tensor objects as one of the
        ``kept_per_slot`` last saves sent (a staging slot hands out the same ones while the
        state's layout and DTensor specs are unchanged) cost the request only a token; else
        :meth:`_by_arena`, sent whole. Sent whole, 5,000 DTensors (each with its spec) took the
        training process's writer thread, holding the GIL, about 0.25 s to pickle and the
        daemon 0.7 s to rebuild, every save; with two staging slots taking turns and one kept,
        20,000 small tensors and their pack layout went whole every save (a save of them
        blocked the next one 0.3-0.4 s instead of 0.07 s). What is kept of an arena the
        training process let go of is dropped, in the daemon too."""
        alive = {token for token, _ in shared_arenas().values()}
        for gone in [held for held in self._sent_states if not held.arenas <= alive]:
            # views of an arena the training process let go of: the daemon must not keep it
            self._sent_states.remove(gone)
            self._forget_kept(_STAGED_TENSORS, gone.state)
        held = next((held for held in self._sent_states if held.holds(tensors)), None)
        if held is None:
            held = _SentState(tensors, *self._by_arena(tensors))
        else:
            self._sent_states.remove(held)
        self._sent_states.append(held)  # the most recently sent last, as the kept values
        for dropped in self._sent_states[: -self._kept_per_slot]:
            self._forget_kept(_STAGED_TENSORS, dropped.state)
        del self._sent_states[: -self._kept_per_slot]
        return self.kept_in_daemon(_STAGED_TENSORS, held.state)

    def _with_entries(self, metadata: dcp_metadata.Metadata) -> dcp_metadata.Metadata:
        """``metadata`` as answered, with the tensor entries the daemon said were unchanged
        put back (:meth:`_CallServingConnection.send`)."""
        entries = getattr(metadata, TENSOR_ENTRIES_ATTRIBUTE, None)
        if entries is None:
            return metadata
        if isinstance(entries, str):  # SAME_TENSOR_ENTRIES
            if self._last_entries is None:  # (each side keeps count: never expected)
                raise CheckpointError("the checkpoint daemon answered with entries it never sent")
            setattr(metadata, TENSOR_ENTRIES_ATTRIBUTE, self._last_entries)
        else:
            self._last_entries = entries
        return metadata

    def _sent_state_kept(self) -> None:
        """The daemon answered the request: it keeps the staged tensors it was sent."""
        if self._sent_states:
            self._sent_states[-1].sent()

    def _by_arena(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Any], frozenset[int]]:
        """``tensors`` as sent, and the tokens of the arenas they are views of: each view of a
        staging arena as an :class:`_ArenaView` (the arena's storage only in the first view of
        an arena the daemon was not yet sent), each DTensor as a :class:`_SentDTensor` of its
        local tensor (sent alike) and its spec, any other tensor as it is (pickled by torch: a
        file descriptor per storage)."""
        arenas = shared_arenas()
        alive = frozenset(token for token, _ in arenas.values())
        self._arenas_sent &= alive  # the daemon drops the others as it reads this request
        sent: dict[str, Any] = {}
        for key, tensor in tensors.items():
            if DTensor is not None and isinstance(tensor, DTensor):
                local = self._sent_tensor(tensor._local_tensor, arenas, alive)
                sent[key] = _SentDTensor(local, tensor._spec)
            else:
                sent[key] = self._sent_tensor(tensor, arenas, alive)
        used = {
            view._args[0]
            for value in sent.values()
            if isinstance(
                view := value.local if isinstance(value, _SentDTensor) else value, _ArenaView
            )
        }
        return sent, frozenset(used)

    def _sent_tensor(
        self,
        tensor: torch.Tensor,
        arenas: dict[int, tuple[int, torch.UntypedStorage]],
        alive: frozenset[int],
    ) -> Any:
        """``tensor`` as :meth:`_by_arena` sends it (not a DTensor)."""
        found = None
        if type(tensor) is torch.Tensor and tensor.layout == torch.strided:
            found = arenas.get(tensor.untyped_storage().data_ptr())
        if found is None or tensor.is_conj() or tensor.is_neg():
            return tensor
        token, storage = found
        first = token not in self._arenas_sent
        self._arenas_sent.add(token)  # (a failed send replaces the daemon: see _stop)
        return _ArenaView(tensor, token, storage if first else None, alive)

    def reset(self) -> None:
        """Stop the daemon (if any); the next :meth:`save` starts a new one."""
        with self._lock:
            self._stop()

    def close(self) -> None:
        """Ask the daemon to stop; terminate it if it does not within a few seconds."""
        self.reset()

    def _stop(self) -> None:
        daemon, self._daemon = self._daemon, None
        hook, self._exit_hook = self._exit_hook, None
        self._failed = False
        self._arenas_sent = set()  # a new daemon keeps none
        self._kept_sent = {}
        self._sent_states = []
        self._last_entries = None
        if hook is not None:
            hook.cancel()
        if daemon is not None:
            _stop_daemon(daemon)

    def _replace(self) -> None:
        daemon = self._daemon
        if daemon is not None:
            process = daemon._save_process
            log.warning(
                "replacing the checkpoint daemon process (pid %s, %s)",
                process.pid,
                "its last save or call failed"
                if process.is_alive()
                else f"gone with exit code {process.exitcode}",
            )
        self._stop()
        info = self._init_info()
        info.ckptmgr_timeout_s = self._timeout_s
        info.ckptmgr_niceness = background_niceness()
        log.info("starting the checkpoint daemon process (async_mode='process')")
        self._daemon = _CheckpointProcess(pg_init_info=info)
        _STARTED_DAEMONS.add(self._daemon._save_process)
        # Stopped at interpreter exit, or when this object is collected (a dropped manager).
        self._exit_hook = multiprocessing.util.Finalize(
            self, _stop_daemon, args=(self._daemon,), exitpriority=_EXIT_PRIORITY
        )

    def _init_info(self) -> Any:
        """Where the daemons' gloo group meets: the ranks' own group's rank and size, and a
        store address chosen by its rank 0 (a collective); a private 1-rank group otherwise,
        whose store the daemon binds to a port of the kernel's choice (port 0: a port chosen
        here, free when probed, was taken by another process's daemon started at the same
        time, a forked child's, before this daemon bound it: EADDRINUSE)."""
        if self._comm is not None:
            return _ProcessGroupInitInfo(self._comm.background_group)
        info = _ProcessGroupInitInfo.__new__(_ProcessGroupInitInfo)
        info.local_rank = 0
        info.global_rank = 0
        info.world_size = 1
        info.tcp_store_master_addr = "127.0.0.1"
        info.tcp_store_master_port = 0
        info.use_prefix_store = False
        info.disable_automatic_gc = False
        info.disable_manual_gc = False
        return info


_STARTED_DAEMONS: weakref.WeakSet[Any] = weakref.WeakSet()
"""The ``multiprocessing`` process objects of the daemons this process started."""


def _forget_the_parents_daemons_in_forked_child() -> None:
    """In a child made by ``os.fork`` (multiprocessing does the same for the children it
    makes): the parent's daemons are not the child's children, so the child's exit neither
    signals nor joins them; and the resource sharer that hands a daemon the file descriptors of
    the staged tensors is the parent's, so a daemon started by the child would ask the parent's
    listener for them, and each of the child's saves would fail. And a lock that a thread of
    the parent held at the fork (the resource tracker's, held while the parent's writer thread
    started a daemon) stays held in the child, whose first daemon start would wait for it for
    ever: it is replaced by a new one."""
    try:
        for daemon in list(_STARTED_DAEMONS):
            multiprocessing.process._children.discard(daemon)  # type: ignore[attr-defined]
        _STARTED_DAEMONS.clear()
        tracker = getattr(multiprocessing.resource_tracker, "_resource_tracker", None)
        lock = getattr(tracker, "_lock", None)
        if lock is not None:
            if lock.acquire(blocking=False):  # (the child's only thread: nobody else holds it)
                lock.release()
            else:  # held by a thread of the parent, which the child does not have
                reentrant = "RLock" in type(lock).__name__  # (an RLock from Python 3.12 on)
                tracker._lock = threading.RLock() if reentrant else threading.Lock()  # type: ignore[union-attr]
        sharer = getattr(multiprocessing.resource_sharer, "_resource_sharer", None)
        after_fork = getattr(sharer, "_afterfork", None)
        if after_fork is not None:
            after_fork()
    except Exception as exc:  # never fail a fork; the child's own daemons may fail then
        log.warning("resetting the checkpoint daemons' state in a forked child: %r", exc)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_the_parents_daemons_in_forked_child)


def _stop_daemon(daemon: Any) -> None:
    """DCP's shutdown of ``daemon`` (TERMINATE, a wait of 5 s, then SIGTERM, which it ignores),
    then SIGKILL if it is still there: also when the shutdown raised (its pipe already broken)."""
    process = daemon._save_process
    try:
        daemon.__del__()
    except Exception as exc:  # a daemon that is dying: killed below if it is still there
        log.debug("the checkpoint daemon (pid %s) did not take TERMINATE: %r", process.pid, exc)
    if process.is_alive():
        process.kill()
        process.join(_EXIT_WAIT_S)
