"""The ``ckptmgr`` command line: list, inspect, verify, prune, export and delete checkpoints.

Every command reads the same storage layout the manager writes (see ``docs/format.md``), under a
local path or any fsspec URL, and never runs code from the checkpoint: commit records and plain
values are JSON, and DCP's ``.metadata`` is read with ckptmgr's restricted unpickler.

Each command first builds a *report*, a plain JSON-compatible dict, and then prints it either as
JSON (``--json``) or as tables, so the two outputs always agree. ``docs/cli.md`` documents the
report of every command. How reports are printed lives in :mod:`ckptmgr.cli_output`, the
export's reading and writing in :mod:`ckptmgr.cli_export`.

``ls``, ``verify``, ``prune`` and ``rm`` need neither torch nor DCP, whose imports take seconds:
this module imports them only inside the commands that do (``inspect``, ``export``,
``verify --deep``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import math
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TextIO

from fsspec.implementations.local import LocalFileSystem

from ckptmgr._version import __version__
from ckptmgr.cli_lease import holding_the_root
from ckptmgr.cli_output import (
    Report,
    emit,
    format_age,
    format_bytes,
    format_count,
    format_display_time,
    format_metrics,
    format_shape,
    format_timestamp,
    one_line,
    one_line_name,
    or_dash,
    plural,
    printable_output,
    progress,
    write_table,
)
from ckptmgr.errors import CheckpointError, CorruptCheckpointError, StepNotFoundError
from ckptmgr.integrity import FileProblem
from ckptmgr.pruning import RecordReader, delete_steps, plan
from ckptmgr.record import CommitRecord
from ckptmgr.retention import (
    KeepBest,
    KeepEveryNSeconds,
    KeepEveryNSteps,
    KeepLatest,
    KeepSteps,
    RetentionPolicy,
    combine,
)
from ckptmgr.storage import (
    DELETING_PREFIX,
    TMP_PREFIX,
    CheckpointStorage,
    Leftover,
    is_object_store,
    open_filesystem,
)

PROG = "ckptmgr"
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_INTERRUPTED = 130
# Errors a user can cause (bad path, missing step, damaged checkpoint, unknown protocol, missing
# fsspec backend): reported as their message on one line. Any other exception (a storage backend's
# own error type, such as missing cloud credentials) is reported as one line with its type.
EXPECTED_ERRORS: tuple[type[BaseException], ...] = (
    CheckpointError,
    OSError,
    ValueError,
    ImportError,
)
LEFTOVER_KINDS = {
    TMP_PREFIX: "interrupted_save",
    DELETING_PREFIX: "interrupted_delete",
}
UNCOMMITTED_STEP_KIND = "uncommitted_step"
QUARANTINED_KIND = "quarantined"
LEFTOVER_KIND_TEXT = {
    "interrupted_save": "interrupted save",
    "interrupted_delete": "interrupted delete",
    UNCOMMITTED_STEP_KIND: "step without commit.json",
    QUARANTINED_KIND: "quarantined (damaged, kept)",
}

Subparsers = Any  # argparse's _SubParsersAction is private


# -- argument parsing ------------------------------------------------------------------------


def parse_storage_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` for fsspec: VALUE is parsed as JSON when it parses, else kept as a string."""
    key, separator, raw_value = text.partition("=")
    key = key.strip()
    if not separator or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw_value)
    except ValueError:
        value = raw_value
    return key, value


def parse_step(text: str) -> int:
    """A step number: a non-negative integer."""
    return _non_negative_int(text, "a step")


def parse_rank(text: str) -> int:
    """A rank: a non-negative integer."""
    return _non_negative_int(text, "a rank")


def _non_negative_int(text: str, what: str) -> int:
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be an integer, got {text!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"{what} must be >= 0, got {number}")
    return number


def parse_root(text: str) -> str:
    """A checkpoint root: any text but an empty one (which named the working directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("PATH is empty")
    return text


def parse_step_list(text: str) -> list[int]:
    """Comma-separated steps, such as ``1,2,3``."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated steps, got {text!r}")
    return [parse_step(part) for part in parts]


def parse_positive_int(text: str) -> int:
    """An integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def parse_positive_seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``ckptmgr`` argument parser with its six commands."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="List, inspect, verify, prune, export and delete ckptmgr checkpoints.",
        epilog="PATH is a local directory or an fsspec URL (file://, memory://, gs://, s3://).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = _common_options()
    _add_ls(commands, common)
    _add_inspect(commands, common)
    _add_verify(commands, common)
    _add_prune(commands, common)
    _add_export(commands, common)
    _add_rm(commands, common)
    return parser


def _common_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "path", metavar="PATH", type=parse_root, help="checkpoint root: a directory or fsspec URL"
    )
    common.add_argument(
        "-o",
        "--storage-option",
        metavar="KEY=VALUE",
        type=parse_storage_option,
        action="append",
        default=[],
        help="fsspec storage option (repeatable); VALUE is parsed as JSON if it parses",
    )
    common.add_argument("--json", action="store_true", help="print a JSON document for scripts")
    common.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log progress at INFO level, and show tracebacks of errors",
    )
    return common


def _add_ls(commands: Subparsers, common: argparse.ArgumentParser) -> None:
    sub = commands.add_parser(
        "ls", parents=[common], help="list committed steps", description="List committed steps."
    )
    sub.add_argument(
        "--all",
        action="store_true",
        help="also list uncommitted leftovers of interrupted saves and deletes",
    )
    sub.set_defaults(handler=run_ls)


def _add_inspect(commands: Subparsers, common: argparse.ArgumentParser) -> None:
    sub = commands.add_parser(
        "inspect",
        parents=[common],
        help="list the tensors of a step",
        description="List the tensors of a step (default: the latest committed step).",
    )
    sub.add_argument("step", metavar="STEP", type=parse_step, nargs="?", help="default: latest")
    sub.set_defaults(handler=run_inspect)


def _add_verify(commands: Subparsers, common: argparse.ArgumentParser) -> None:
    sub = commands.add_parser(
        "verify",
        parents=[common],
        help="check the files of steps against their commit records",
        description=(
            "Check that every file listed in a step's commit record exists with its size "
            "(default: every committed step). With --deep, also read every file and compare its "
            "CRC-32, and parse .metadata with the restricted unpickler. Exits with status 1 if "
            "any step is damaged."
        ),
    )
    sub.add_argument(
        "step", metavar="STEP", type=parse_step, nargs="?", help="default: every committed step"
    )
    sub.add_argument("--deep", action="store_true", help="read every file and check checksums")
    sub.set_defaults(handler=run_verify)


def _add_prune(commands: Subparsers, common: argparse.ArgumentParser) -> None:
    sub = commands.add_parser(
        "prune",
        parents=[common],
        help="delete the steps no retention policy keeps",
        description=(
            "Apply retention: a step is kept if ANY of the given policies keeps it. The step "
            "committed most recently is always kept. At least one policy is required."
        ),
    )
    policies = sub.add_argument_group("retention policies (at least one)")
    policies.add_argument(
        "--keep-latest", metavar="N", type=parse_positive_int, help="the N highest steps"
    )
    policies.add_argument(
        "--keep-every-n-steps", metavar="K", type=parse_positive_int, help="multiples of K"
    )
    policies.add_argument(
        "--keep-every-n-seconds",
        metavar="S",
        type=parse_positive_seconds,
        help="the first step committed in each window of S seconds",
    )
    policies.add_argument(
        "--keep-best",
        metavar="N",
        type=parse_positive_int,
        help="the N best steps by --metric",
    )
    policies.add_argument("--metric", metavar="M", help="the metric of --keep-best")
    policies.add_argument(
        "--mode", choices=["min", "max"], default="min", help="--keep-best: lowest or highest"
    )
    policies.add_argument(
        "--keep-steps",
        metavar="1,2,3",
        type=parse_step_list,
        action="append",
        help="keep these steps (repeatable)",
    )
    sub.add_argument("--dry-run", action="store_true", help="show the plan, delete nothing")
    _add_force(sub)
    sub.set_defaults(handler=run_prune, subparser=sub)


def _add_export(commands: Subparsers, common: argparse.ArgumentParser) -> None:
    sub = commands.add_parser(
        "export",
        parents=[common],
        help="write one step as a single torch.save file",
        description=(
            "Write one step as a single torch.save file: a nested dict of the state as the "
            "given rank would restore it (torch.load(OUT, weights_only=True) reads it)."
        ),
    )
    sub.add_argument("step", metavar="STEP", type=parse_step)
    sub.add_argument("output", metavar="OUT.pt", help="local file to write")
    sub.add_argument(
        "--rank",
        type=parse_rank,
        default=0,
        help="whose per-rank tensors and plain values to export (default 0)",
    )
    sub.set_defaults(handler=run_export)


def _add_rm(commands: Subparsers, common: argparse.ArgumentParser) -> None:
    sub = commands.add_parser(
        "rm",
        parents=[common],
        help="delete committed steps",
        description="Delete committed steps. Nothing is deleted if any STEP is not committed.",
    )
    sub.add_argument("steps", metavar="STEP", type=parse_step, nargs="+")
    _add_force(sub)
    sub.set_defaults(handler=run_rm)


def _add_force(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--force",
        action="store_true",
        help="delete although a running job owns the root (its owner lease is not taken)",
    )


# -- entry point -----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``ckptmgr`` command; returns the exit status (argparse exits 2 on usage errors)."""
    args = build_parser().parse_args(argv)
    with printable_output(), log_to_stderr(verbose=args.verbose):
        return run_command(args)


def console_main() -> int:
    """The ``ckptmgr`` console script and ``python -m ckptmgr``: :func:`main`, whose objects are
    then frozen (``gc.freeze()``) so that the interpreter's finalization does not collect them.
    With torch loaded (``inspect``, ``export``, ``verify --deep``) that collection took about
    0.75 s, for nothing: the command is done (its files closed, its output written), exit
    handlers still run, and the kernel frees the process's memory."""
    try:
        return main()
    finally:
        gc.freeze()


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command; expected errors become one line on stderr and exit status 1."""
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader of stdout went away (``ckptmgr ls | head``): not worth a message.
        _silence_stdout()
        return EXIT_ERROR
    except EXPECTED_ERRORS as error:
        return report_error(error, verbose=args.verbose, name_type=False)
    except Exception as error:  # a storage backend's own error (credentials, HTTP) or a bug
        return report_error(error, verbose=args.verbose, name_type=True)


def report_error(error: Exception, *, verbose: bool, name_type: bool) -> int:
    """Print ``ckptmgr: error: ...`` on one line (after the traceback with ``--verbose``)."""
    if verbose:
        traceback.print_exc()
    message = one_line(error)
    if name_type:
        message = f"{type(error).__name__}: {message}"
        if not verbose:
            message += " (--verbose shows the traceback)"
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_ERROR


class OneLineFormatter(logging.Formatter):
    """``ckptmgr: warning: [<logger>: ]<message>`` on one line, without the traceback.

    Another library's error is shown as a warning: the command reports what failed itself
    (fsspec's prefetcher logs "Consumer caught an error." for a read of an object that another
    job's retention deleted, which ``verify`` then reports as a step deleted meanwhile)."""

    def format(self, record: logging.LogRecord) -> str:
        """The record's message, whitespace collapsed, behind its level."""
        message = " ".join(record.getMessage().split())
        ours = record.name.split(".")[0] == PROG
        source = "" if ours else f"{record.name}: "
        level = record.levelname.lower() if ours else "warning"
        return f"{PROG}: {level}: {source}{message}"


@contextmanager
def log_to_stderr(*, verbose: bool) -> Iterator[None]:
    """Route log records (ours and fsspec backends') to stderr while a command runs.

    Without ``--verbose`` only warnings and errors are shown, one line each, so that a backend
    that logs a retried request with its traceback does not flood the terminal.
    """
    handler = logging.StreamHandler(sys.stderr)
    if verbose:
        handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
    else:
        handler.setFormatter(OneLineFormatter())
    root = logging.getLogger()
    previous_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(previous_level)


def _silence_stdout() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


# -- storage ---------------------------------------------------------------------------------


def open_storage(url: str, option_pairs: Sequence[tuple[str, Any]]) -> CheckpointStorage:
    """The checkpoint root at ``url``; ``CheckpointError`` if it does not exist (none is made)."""
    options = dict(option_pairs)
    fs, root = open_filesystem(url, options)  # gcsfs/s3fs with ckptmgr's request retries
    if not fs.exists(root):
        if is_object_store(fs) and fs.exists(root.split("/", 1)[0]):
            # An object store has no empty directories: a root whose steps were all deleted
            # is no prefix of any object, and lists no steps, as an empty local root does.
            return CheckpointStorage(url, options, create=False)
        raise CheckpointError(f"{url} does not exist")
    if not (fs.isdir(root) or _holds_objects(fs, root)):
        raise CheckpointError(f"{url} is not a directory")
    return CheckpointStorage(url, options)


def _holds_objects(fs: Any, root: str) -> bool:
    """True where ``root`` is a prefix of objects, though ``fs.isdir`` says no: on an object
    store, an object whose name is the root's (``run`` beside ``run/...``) is what gcsfs
    answers for it."""
    if isinstance(fs, LocalFileSystem):
        return False
    try:
        listed = fs.ls(root, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return False
    own = root.rstrip("/")
    return any(str(entry).rstrip("/") != own for entry in listed)


def read_committed_record(storage: CheckpointStorage, step: int) -> CommitRecord:
    """The commit record of ``step``; ``StepNotFoundError`` if it is not committed."""
    committed = storage.committed_steps()
    if step not in committed:
        raise StepNotFoundError(step, committed)
    return storage.read_record(step)


def latest_step(storage: CheckpointStorage) -> int:
    """The highest committed step; ``CheckpointError`` if there is none."""
    committed = storage.committed_steps()
    if not committed:
        raise CheckpointError(f"no committed steps under {storage.url}")
    return committed[-1]


# -- ls --------------------------------------------------------------------------------------


def run_ls(args: argparse.Namespace) -> int:
    """``ckptmgr ls``: committed steps, and with ``--all`` the uncommitted leftovers."""
    storage = open_storage(args.path, args.storage_option)
    report = ls_report(storage, include_leftovers=args.all)
    emit(report, args.json, render_ls)
    return EXIT_OK


def ls_report(storage: CheckpointStorage, *, include_leftovers: bool) -> Report:
    """The JSON document of ``ckptmgr ls``."""
    steps = [step_summary(storage, step) for step in storage.committed_steps()]
    if any(row["error"] is not None for row in steps):  # a step deleted while it was read
        present = set(storage.committed_steps())  # (another job's retention) is not listed
        steps = [row for row in steps if row["error"] is None or row["step"] in present]
    leftovers = None
    if include_leftovers:
        leftovers = [leftover_summary(storage, leftover) for leftover in storage.leftovers()]
        leftovers += [
            {
                "name": quarantined.name,
                "kind": QUARANTINED_KIND,
                "age_s": None,
                "size": tree_size(storage, storage.path(quarantined.name)),
            }
            for quarantined in storage.quarantined()
        ]
        leftovers.sort(key=lambda row: row["name"])
    return {"root": storage.url, "steps": steps, "leftovers": leftovers}


def step_summary(storage: CheckpointStorage, step: int) -> Report:
    """One row of ``ls``: what the commit record says, or why it cannot be read."""
    try:
        record = storage.read_record(step)
    except (CheckpointError, OSError) as error:  # (OSError: unreadable, say no permission)
        return {
            "step": step,
            "committed_at": None,
            "size": None,
            "world_size": None,
            "metrics": {},
            "metadata": {},
            "error": one_line(error),
        }
    return {
        "step": step,
        "committed_at": format_timestamp(record.committed_at),
        "size": sum(entry.size for entry in record.files),
        "world_size": record.world_size,
        "metrics": dict(record.metrics),
        "metadata": dict(record.metadata),
        "error": None,
    }


def leftover_summary(storage: CheckpointStorage, leftover: Leftover) -> Report:
    """One row of ``ls --all``'s leftovers."""
    return {
        "name": leftover.name,
        "kind": leftover_kind(leftover.name),
        "age_s": None if leftover.age_s is None else round(leftover.age_s, 3),
        "size": tree_size(storage, leftover.path),
    }


def leftover_kind(name: str) -> str:
    """``interrupted_save``, ``interrupted_delete`` or ``uncommitted_step``."""
    for prefix, kind in LEFTOVER_KINDS.items():
        if name.startswith(prefix):
            return kind
    return UNCOMMITTED_STEP_KIND


def tree_size(storage: CheckpointStorage, path: str) -> int | None:
    """Total bytes of the files under ``path`` (None when the store cannot say)."""
    try:
        storage.fs.invalidate_cache(path)
        return int(storage.fs.du(path, total=True))
    except (OSError, ValueError, TypeError, NotImplementedError):
        return None


def render_ls(report: Report, out: TextIO) -> None:
    """The tables of ``ckptmgr ls``."""
    if report["steps"]:
        rows = [
            [
                str(row["step"]),
                or_dash(row["committed_at"], format_display_time),
                or_dash(row["size"], format_bytes),
                f"unreadable: {row['error']}" if row["error"] else format_metrics(row["metrics"]),
            ]
            for row in report["steps"]
        ]
        write_table(out, ["STEP", "COMMITTED (UTC)", "SIZE", "METRICS"], rows, right=("STEP",))
    else:
        print(f"no committed steps under {report['root']}", file=out)
    leftovers = report["leftovers"]
    if leftovers is None:
        return
    print(file=out)
    if not leftovers:
        print("no uncommitted leftovers", file=out)
        return
    print("uncommitted leftovers (never listed as steps):", file=out)  # and quarantined steps
    rows = [
        [
            row["name"],
            LEFTOVER_KIND_TEXT[row["kind"]],
            or_dash(row["age_s"], format_age),
            or_dash(row["size"], format_bytes),
        ]
        for row in leftovers
    ]
    write_table(out, ["NAME", "KIND", "AGE", "SIZE"], rows)


# -- inspect ---------------------------------------------------------------------------------


def run_inspect(args: argparse.Namespace) -> int:
    """``ckptmgr inspect``: the tensors of one step."""
    storage = open_storage(args.path, args.storage_option)
    step = latest_step(storage) if args.step is None else args.step
    report = inspect_report(storage, read_committed_record(storage, step))
    emit(report, args.json, render_inspect)
    return EXIT_OK


def inspect_report(storage: CheckpointStorage, record: CommitRecord) -> Report:
    """The JSON document of ``ckptmgr inspect``."""
    tensors = [
        {
            "name": name,
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "bytes": tensor_nbytes(entry.dtype, entry.shape),
        }
        for name, entry in record.tensors.items()
    ]
    known_sizes = [row["bytes"] for row in tensors]
    return {
        "root": storage.url,
        "step": record.step,
        "committed_at": format_timestamp(record.committed_at),
        "world_size": record.world_size,
        "metrics": dict(record.metrics),
        "metadata": dict(record.metadata),
        "tensors": tensors,
        "tensor_bytes": None if None in known_sizes else sum(known_sizes),
        "files": [entry.model_dump() for entry in record.files],  # path, size, crc32
        "size": sum(entry.size for entry in record.files),
        "ckptmgr_version": record.ckptmgr_version,
        "torch_version": record.torch_version,
    }


def tensor_nbytes(dtype_name: str, shape: Sequence[int]) -> int | None:
    """Bytes of a dense tensor of this dtype and shape (None for a dtype torch does not know)."""
    from ckptmgr.dtypes import dtype_named  # (imports torch: ls, prune, rm and verify do not)

    dtype = dtype_named(dtype_name)
    if dtype is None:
        return None
    return math.prod(shape) * dtype.itemsize


def render_inspect(report: Report, out: TextIO) -> None:
    """The header and tensor table of ``ckptmgr inspect``."""
    print(
        f"step {report['step']} of {report['root']}, committed "
        f"{format_display_time(report['committed_at'])} UTC by {report['world_size']} rank(s)",
        file=out,
    )
    if report["metrics"]:
        print(f"metrics: {format_metrics(report['metrics'])}", file=out)
    if report["metadata"]:
        print(f"metadata: {json.dumps(report['metadata'], sort_keys=True)}", file=out)
    print(file=out)
    rows = [
        [
            row["name"],
            row["dtype"],
            format_shape(row["shape"]),
            or_dash(row["bytes"], format_bytes),
        ]
        for row in report["tensors"]
    ]
    write_table(out, ["NAME", "DTYPE", "SHAPE", "SIZE"], rows, right=("SIZE",))
    print(file=out)
    print(
        f"{plural(len(report['tensors']), 'tensor')}, "
        f"{or_dash(report['tensor_bytes'], format_bytes)} of tensor data; "
        f"{plural(len(report['files']), 'file')}, {format_bytes(report['size'])} on storage",
        file=out,
    )


# -- verify ----------------------------------------------------------------------------------


def run_verify(args: argparse.Namespace) -> int:
    """``ckptmgr verify``: check steps against their commit records; status 1 if any is damaged."""
    storage = open_storage(args.path, args.storage_option)
    committed, quarantined = storage.listed_steps()
    if args.step is None:
        steps = committed
    else:
        if args.step not in {*committed, *quarantined}:
            raise StepNotFoundError(args.step, committed)
        steps = [args.step]
    report = verify_report(storage, steps, deep=args.deep, quarantined=quarantined)
    emit(report, args.json, render_verify)
    failed = [row for row in report["steps"] if not row["ok"]]
    damaged = [row["step"] for row in failed if not row["unreadable"]]
    unreadable = [row["step"] for row in failed if row["unreadable"]]
    if damaged:
        print(f"{PROG}: error: damaged step(s): {damaged}", file=sys.stderr)
    if unreadable:  # (a permission or network error says nothing of the checkpoint)
        print(f"{PROG}: error: step(s) that could not be read: {unreadable}", file=sys.stderr)
    return EXIT_ERROR if failed else EXIT_OK


def verify_report(
    storage: CheckpointStorage,
    steps: Sequence[int],
    *,
    deep: bool,
    quarantined: Sequence[int] | None = None,
) -> Report:
    """The JSON document of ``ckptmgr verify``. A step that failed its check and is no longer
    in storage was deleted meanwhile (retention of a job writing the root): it is listed under
    ``deleted_meanwhile``, not as damaged. ``quarantined``: the quarantined steps, listed just
    now (else listed here)."""
    marked = set(storage.quarantined_steps() if quarantined is None else quarantined)
    rows = [verify_step(storage, step, deep, step in marked) for step in steps]
    deleted: list[int] = []
    if any(not row["ok"] for row in rows):
        present = {step for listed in storage.listed_steps() for step in listed}
        deleted = [row["step"] for row in rows if not row["ok"] and row["step"] not in present]
    return {
        "root": storage.url,
        "deep": deep,
        "steps": [row for row in rows if row["step"] not in deleted],
        "deleted_meanwhile": deleted,
    }


def verify_step(storage: CheckpointStorage, step: int, deep: bool, quarantined: bool) -> Report:
    """One step of ``ckptmgr verify``: its problems, or why its record cannot be read."""
    row: Report = {
        "step": step,
        "ok": False,
        "quarantined": quarantined,
        "files": None,
        "size": None,
        "checksums": None,
        "problems": [],
        "error": None,
        "unreadable": False,
    }
    try:
        record = storage.read_record(step)
    except (CheckpointError, OSError) as error:  # (OSError: unreadable, say no permission)
        row["error"] = one_line(error)
        row["unreadable"] = not isinstance(error, CorruptCheckpointError)
        return row
    step_path = storage.step_path(step)
    row["files"] = len(record.files)
    row["size"] = sum(entry.size for entry in record.files)
    row["checksums"] = sum(entry.crc32 is not None for entry in record.files)
    unreadable: list[FileProblem] = []  # (no permission, say: the other files are checked)
    try:
        problems = storage.verify_files(step_path, record, deep=deep, unreadable=unreadable)
        row["problems"] = [{"path": p.path, "problem": p.problem} for p in problems]
        metadata_listed = any(entry.path == ".metadata" for entry in record.files)
        if deep and not problems and not unreadable and metadata_listed:
            from ckptmgr.dcp_io import read_metadata_file  # (imports DCP: only here)

            read_metadata_file(storage.fs, step_path, [entry.path for entry in record.files])
    except CorruptCheckpointError as error:
        row["problems"].append({"path": error.path or ".metadata", "problem": one_line(error)})
    except (CheckpointError, OSError) as error:  # (the listing of the step's files, say)
        unreadable.append(FileProblem("", one_line(error)))
    if unreadable:  # not read: the step is called unreadable, unless damage was found too
        row["error"] = "; ".join(
            f"{problem.path}: {problem.problem}" if problem.path else problem.problem
            for problem in unreadable
        )
        row["unreadable"] = not row["problems"]
    row["ok"] = not row["problems"] and row["error"] is None
    return row


def render_verify(report: Report, out: TextIO) -> None:
    """The table of ``ckptmgr verify``, then one line per problem."""
    for step in report["deleted_meanwhile"]:
        print(f"step {step} was deleted while it was being checked", file=out)
    if not report["steps"]:
        if not report["deleted_meanwhile"]:  # (else the root is not empty: it was written)
            print(f"no committed steps under {report['root']}", file=out)
        return
    rows = []
    for row in report["steps"]:
        if row["problems"]:  # (damage found, some file perhaps not read: said below)
            status = f"DAMAGED: {plural(len(row['problems']), 'problem')}"
        elif row["error"]:
            status = f"{'unreadable' if row['unreadable'] else 'DAMAGED'}: {row['error']}"
        elif row["ok"]:
            status = "ok" + (" (deep)" if report["deep"] else "")
        else:
            status = f"DAMAGED: {plural(len(row['problems']), 'problem')}"
        if row["quarantined"]:
            status += ", quarantined"
        rows.append(
            [
                str(row["step"]),
                or_dash(row["files"], str),
                or_dash(row["size"], format_bytes),
                status,
            ]
        )
    write_table(out, ["STEP", "FILES", "SIZE", "STATUS"], rows, right=("STEP", "FILES"))
    for row in report["steps"]:
        for problem in row["problems"]:
            path = one_line_name(problem["path"])
            print(f"step {row['step']}: {path} {problem['problem']}", file=out)
        if row["problems"] and row["error"]:
            print(f"step {row['step']}: not read: {row['error']}", file=out)


# -- prune -----------------------------------------------------------------------------------


def run_prune(args: argparse.Namespace) -> int:
    """``ckptmgr prune``: apply retention policies, print the decision for every step."""
    policies = policies_from_args(args)
    storage = open_storage(args.path, args.storage_option)
    report = prune_plan(args, storage, policies)
    if args.dry_run or not report["to_delete"]:  # nothing deleted: the root is not taken
        emit(report, args.json, render_prune)
        return EXIT_OK
    # Planned again and deleted under the root's lease: the plan of the root as no other
    # command changes it meanwhile, and nothing deleted once a job took it over.
    with holding_the_root(storage, "prune", force=args.force) as confirm:
        report = prune_plan(args, storage, policies)
        failure = None
        if report["to_delete"]:
            report["deleted"], failure = delete_with_progress(
                storage,
                report["to_delete"],
                functools.partial(delete_steps, before_each=confirm),
            )
    emit(report, args.json, render_prune)
    if failure is not None:  # (after the report of what was deleted)
        raise failure
    return EXIT_OK


def prune_plan(
    args: argparse.Namespace, storage: CheckpointStorage, policies: list[RetentionPolicy]
) -> Report:
    """The JSON document of ``ckptmgr prune`` before anything is deleted."""
    reader = RecordReader(storage)
    retention_plan = plan(combine(policies), reader)
    infos, unreadable = reader.infos(retention_plan.listed)
    if unreadable:  # a step deleted while its record was read (by a job's retention) is gone
        present = set(storage.committed_steps())
        retention_plan.listed = [step for step in retention_plan.listed if step in present]
        retention_plan.decisions = [
            d for d in retention_plan.decisions if d.step not in unreadable or d.step in present
        ]
    committed_at = {info.step: format_timestamp(info.committed_at) for info in infos}
    return {
        "root": storage.url,
        "dry_run": bool(args.dry_run),
        "policies": [str(policy) for policy in policies],
        "decisions": [
            {
                "step": decision.step,
                "committed_at": committed_at.get(decision.step),
                "kept": decision.kept,
                "reasons": list(decision.reasons),
            }
            for decision in retention_plan.decisions
        ],
        "to_delete": retention_plan.doomed,
        "deleted": [],
    }


def policies_from_args(args: argparse.Namespace) -> list[RetentionPolicy]:
    """The retention policies named on the command line (a usage error if there are none)."""
    parser: argparse.ArgumentParser = args.subparser
    if args.metric is not None and args.keep_best is None:
        parser.error("--metric is only used with --keep-best")
    if args.keep_best is not None and not args.metric:
        parser.error("--keep-best needs --metric")
    policies: list[RetentionPolicy] = []
    if args.keep_latest is not None:
        policies.append(KeepLatest(args.keep_latest))
    if args.keep_every_n_steps is not None:
        policies.append(KeepEveryNSteps(args.keep_every_n_steps))
    if args.keep_every_n_seconds is not None:
        policies.append(KeepEveryNSeconds(args.keep_every_n_seconds))
    if args.keep_best is not None:
        policies.append(KeepBest(args.keep_best, args.metric, args.mode))
    if args.keep_steps:
        policies.append(KeepSteps(frozenset(s for group in args.keep_steps for s in group)))
    if not policies:
        parser.error(
            "give at least one retention policy: --keep-latest, --keep-every-n-steps, "
            "--keep-every-n-seconds, --keep-best or --keep-steps"
        )
    return policies


def render_prune(report: Report, out: TextIO) -> None:
    """The decision table and summary of ``ckptmgr prune``."""
    if not report["decisions"]:
        print(f"no committed steps under {report['root']}", file=out)
        return
    deleted = set(report["deleted"])

    def action(row: Report) -> str:
        if row["kept"]:
            return "kept"
        if report["dry_run"]:
            return "would delete"
        return "deleted" if row["step"] in deleted else "not deleted"

    rows = [
        [
            str(row["step"]),
            or_dash(row["committed_at"], format_display_time),
            action(row),
            "; ".join(row["reasons"]),
        ]
        for row in report["decisions"]
    ]
    write_table(out, ["STEP", "COMMITTED (UTC)", "ACTION", "REASONS"], rows, right=("STEP",))
    print(file=out)
    total = len(report["decisions"])
    if not report["to_delete"]:
        print(f"nothing to delete: all {total} steps are kept", file=out)
    elif report["dry_run"]:
        print(
            f"dry run: would delete {len(report['to_delete'])} of {total} steps "
            f"{report['to_delete']}; nothing was deleted",
            file=out,
        )
    else:
        print(f"deleted {len(report['deleted'])} of {total} steps {report['deleted']}", file=out)


# -- rm --------------------------------------------------------------------------------------


def run_rm(args: argparse.Namespace) -> int:
    """``ckptmgr rm``: delete committed steps; none is deleted if one is not committed."""
    storage = open_storage(args.path, args.storage_option)
    steps = sorted(set(args.steps))
    with holding_the_root(storage, "rm", force=args.force) as confirm:
        committed = set(storage.committed_steps())
        for step in steps:
            if step not in committed:
                raise StepNotFoundError(step, committed)
        deleted, failure = delete_with_progress(
            storage, steps, functools.partial(delete_steps, purpose="rm", before_each=confirm)
        )
    emit({"root": storage.url, "deleted": deleted}, args.json, render_rm)
    if failure is not None:  # (after the report of what was deleted)
        raise failure
    return EXIT_OK


def render_rm(report: Report, out: TextIO) -> None:
    """One line per deleted step."""
    for step in report["deleted"]:
        print(f"deleted step {step}", file=out)


def delete_with_progress(
    storage: CheckpointStorage,
    steps: Sequence[int],
    deleter: Callable[..., None],
) -> tuple[list[int], CheckpointError | None]:
    """Delete ``steps`` with ``deleter(storage, steps, on_deleted=...)``, showing progress:
    (the steps deleted, sorted; the ``CheckpointError`` naming those that could not be, or
    None), so that the report says what was deleted before the error is raised."""
    deleted: list[int] = []

    def on_deleted(step: int) -> None:
        deleted.append(step)
        bar.advance(1)

    with progress("deleting", len(steps), format_count) as bar:
        try:
            deleter(storage, steps, on_deleted=on_deleted)
        except CheckpointError as exc:
            return sorted(deleted), exc
        except KeyboardInterrupt:  # (the report is not printed: what was deleted is said here)
            print(f"{PROG}: deleted step(s) {sorted(deleted)} before Ctrl-C", file=sys.stderr)
            raise
    return sorted(deleted), None


# -- export ----------------------------------------------------------------------------------


def run_export(args: argparse.Namespace) -> int:
    """``ckptmgr export``: one step as a single ``torch.save`` file."""
    from ckptmgr.cli_export import (  # (imports torch: only here and for inspect)
        check_output_path,
        export_state,
        render_export,
        write_torch_file,
    )

    storage = open_storage(args.path, args.storage_option)
    record = read_committed_record(storage, args.step)
    if not 0 <= args.rank < record.world_size:
        raise CheckpointError(
            f"--rank {args.rank} is out of range: step {args.step} was saved by "
            f"{record.world_size} rank(s)"
        )
    output = check_output_path(args.output, storage)
    exported = export_state(storage, record, args.rank)
    write_torch_file(exported.state, output, exported.tensor_bytes)
    report = {
        "root": storage.url,
        "step": record.step,
        "rank": args.rank,
        "output": str(output),
        "tensors": exported.tensor_count,
        "tensor_bytes": exported.tensor_bytes,
        "plain_values": exported.plain_value_count,
        "file_size": output.stat().st_size,
    }
    emit(report, args.json, render_export)
    return EXIT_OK
