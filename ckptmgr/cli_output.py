"""How the ``ckptmgr`` command line prints: reports as JSON or tables, sizes, counts, times,
and progress bars on a terminal (see :mod:`ckptmgr.cli`)."""

from __future__ import annotations

import datetime as _dt
import json
import math
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TextIO

Report = dict[str, Any]
"""A command's report: a plain JSON-compatible dict, printed as JSON or for a person."""


# Control characters but newline and tab (C0, DEL, C1): ESC starts a terminal's escape sequences
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CONTROL_BUT_CARRIAGE_RETURN = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_LINE_BREAKS = re.compile("[\n\r]")


def _escaped(match: re.Match[str]) -> str:
    return f"\\x{ord(match.group()):02x}"


class PrintableStream:
    """A text stream that writes control characters as ``\\xNN`` escapes: names read from a
    checkpoint (steps' files, tensors, metrics, leftovers) may hold a terminal's escape
    sequences, which would rewrite the screen, set its title or fake other output."""

    def __init__(self, stream: TextIO, *, keep_carriage_return: bool = False) -> None:
        self._stream = stream
        self._pattern = _CONTROL_BUT_CARRIAGE_RETURN if keep_carriage_return else _CONTROL

    def write(self, text: str) -> int:
        """Write ``text``, its control characters escaped."""
        return self._stream.write(self._pattern.sub(_escaped, text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextmanager
def printable_output() -> Iterator[None]:
    """Standard output and standard error as :class:`PrintableStream` (a progress bar's ``\\r``
    kept on standard error; JSON output has none to escape: ``json`` writes them as ``\\u``)."""
    out, err = sys.stdout, sys.stderr
    sys.stdout = PrintableStream(out)  # type: ignore[assignment]
    sys.stderr = PrintableStream(err, keep_carriage_return=True)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err


def one_line_name(name: str) -> str:
    """``name`` (read from a checkpoint) on one line: its line breaks as ``\\xNN`` escapes, so
    that it cannot print lines of its own (the other control characters are escaped by
    :class:`PrintableStream`)."""
    return _LINE_BREAKS.sub(_escaped, name)


def one_line(error: BaseException) -> str:
    """``error``'s message on one line (its type's name when it has none)."""
    return " ".join(str(error).split()) or type(error).__name__


def emit(report: Report, as_json: bool, render: Callable[[Report, TextIO], None]) -> None:
    """Print ``report`` as indented JSON, or with ``render`` for a person."""
    if as_json:
        json.dump(_finite_numbers(report), sys.stdout, indent=2, allow_nan=False)
        sys.stdout.write("\n")
    else:
        render(report, sys.stdout)
    sys.stdout.flush()


_NON_FINITE_NAMES = {math.inf: "Infinity", -math.inf: "-Infinity"}


def _finite_numbers(value: Any) -> Any:
    """``value`` with every float that is not finite (a NaN loss) as the string ``"NaN"``,
    ``"Infinity"`` or ``"-Infinity"``: JSON has no such numbers, and Python's ``NaN`` tokens
    failed strict parsers (JavaScript's) or were read as other values (jq 1.6: null, and the
    largest float for infinity)."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else _NON_FINITE_NAMES[value]
    if isinstance(value, dict):
        return {key: _finite_numbers(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_numbers(item) for item in value]
    return value


def write_table(
    out: TextIO, header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[str] = ()
) -> None:
    """Columns padded to their widest cell; the last column is not padded. A cell is one line
    (names read from a checkpoint: see :func:`one_line_name`)."""
    rows = [[one_line_name(str(cell)) for cell in row] for row in rows]
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    right_aligned = {index for index, name in enumerate(header) if name in right}
    for line in [list(header), *rows]:
        cells = []
        for index, cell in enumerate(line):
            last = index == len(line) - 1
            if index in right_aligned:
                cells.append(cell.rjust(widths[index]))
            else:
                cells.append(cell if last else cell.ljust(widths[index]))
        print("  ".join(cells).rstrip(), file=out)


def format_timestamp(moment: _dt.datetime) -> str:
    """ISO 8601 in UTC with a ``Z``, as in ``commit.json``."""
    utc = moment.astimezone(_dt.timezone.utc) if moment.tzinfo else moment
    return utc.replace(tzinfo=None).isoformat() + "Z"


def format_display_time(timestamp: str) -> str:
    """``2026-11-22T22:56:57.660572Z`` -> ``2026-11-22 22:56:57``."""
    return timestamp.replace("T", " ").removesuffix("Z").split(".")[0]


def format_bytes(size: float) -> str:
    """Binary units: ``512 B``, ``3.1 KiB``, ``2.0 GiB``."""
    if size < 1024:
        return f"{int(size)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            break
    return f"{size:.1f} {unit}"


def format_count(count: float) -> str:
    """A whole number of things."""
    return str(int(count))


def format_age(seconds: float) -> str:
    """``42 s``, ``5 min``, ``3.0 h``, ``2.5 d``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def format_metrics(metrics: Mapping[str, float]) -> str:
    """``loss=0.25 acc=0.9`` (sorted by name)."""
    return " ".join(f"{one_line_name(name)}={value:g}" for name, value in sorted(metrics.items()))


def format_shape(shape: Sequence[int]) -> str:
    """``[2, 4]``; ``[]`` for a scalar."""
    return "[" + ", ".join(str(size) for size in shape) + "]"


def plural(count: int, noun: str) -> str:
    """``1 tensor``, ``2 tensors``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def or_dash(value: Any, formatter: Callable[[Any], str]) -> str:
    """``value`` formatted, or ``-`` when it is None (not known)."""
    return "-" if value is None else formatter(value)


# -- progress --------------------------------------------------------------------------------


class ProgressBar:
    """A one-line bar on a terminal, redrawn in place: ``reading [####....]  50% 1.0/2.0 MiB``."""

    WIDTH = 30
    MIN_REDRAW_S = 0.1

    def __init__(
        self, stream: TextIO, label: str, total: float, format_amount: Callable[[float], str]
    ) -> None:
        self.stream = stream
        self.label = label
        self.total = total
        self.format_amount = format_amount
        self.done = 0.0
        self._last_draw = -math.inf
        self._last_length = 0
        self._drew_complete = False
        self._draw()

    def advance(self, amount: float) -> None:
        """Count ``amount`` more as done; redraws at most every ``MIN_REDRAW_S`` seconds."""
        self.done += amount
        just_completed = self.done >= self.total and not self._drew_complete
        if just_completed or time.monotonic() - self._last_draw >= self.MIN_REDRAW_S:
            self._draw()

    def close(self) -> None:
        """Draw the final state and end the line."""
        self._draw()
        self.stream.write("\n")
        self.stream.flush()

    def _draw(self) -> None:
        fraction = 1.0 if self.total <= 0 else min(self.done / self.total, 1.0)
        filled = round(fraction * self.WIDTH)
        text = (
            f"{self.label} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {fraction:4.0%} "
            f"{self.format_amount(min(self.done, self.total))}/{self.format_amount(self.total)}"
        )
        padding = " " * max(self._last_length - len(text), 0)
        self.stream.write(f"\r{text}{padding}")
        self.stream.flush()
        self._last_length = len(text)
        self._last_draw = time.monotonic()
        self._drew_complete = fraction >= 1.0


class NoProgress:
    """Stands in for :class:`ProgressBar` when stderr is not a terminal: draws nothing."""

    def advance(self, amount: float) -> None:
        """Ignore progress."""


@contextmanager
def progress(
    label: str, total: float, format_amount: Callable[[float], str]
) -> Iterator[ProgressBar | NoProgress]:
    """A progress bar on stderr if stderr is a terminal, else one that prints nothing."""
    if not sys.stderr.isatty():
        yield NoProgress()
        return
    bar = ProgressBar(sys.stderr, label, total, format_amount)
    try:
        yield bar
    finally:
        bar.close()
