"""Restoring packed tensors (see :mod:`ckptmgr.packing`): match, check, and copy out of the pack.

With thousands of small tensors, restore's cost is per tensor, so this module does one pass over
the destinations that matches each against the record (its offset, dtype and shape) and copies
runs of back-to-back tensors of one dtype on one device with ``torch.split_with_sizes_copy``,
which copies the pack's pieces straight into the destinations without making a view of each
piece: on the CPU one call per piece of about ``UNPACK_PIECE_BYTES``, on up to
:func:`unpack_threads` threads; on a device such as CUDA one call per run, after one
host-to-device copy of the run's bytes.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import threading
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, cast

import torch
from torch.nn.parameter import is_lazy

from ckptmgr.dtypes import dtype_named
from ckptmgr.errors import CheckpointError, CorruptCheckpointError
from ckptmgr.packing import PACK_KEY
from ckptmgr.record import CommitRecord, TensorTable
from ckptmgr.tensor_bytes import check_all_restorable, check_none_on_meta

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = None  # type: ignore[assignment,misc]

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
"""Destination types copied into directly (anything else, a ``DTensor`` say, gets a copy)."""
_PLAIN_TENSOR_TYPES_SET = frozenset(_PLAIN_TENSOR_TYPES)


class _Run:
    """Tensors back to back in the pack, of one dtype, on one device (None: the CPU): copied
    out in one call (on a device, from ``on_device``: the first byte of a copy of the pack's
    bytes there, and that copy)."""

    __slots__ = ("device", "dtype", "end", "on_device", "outs", "sizes", "start")

    def __init__(self, start: int, dtype: torch.dtype, device: torch.device | None) -> None:
        self.start = start
        self.end = start
        self.dtype = dtype
        self.device = device
        self.on_device: tuple[int, torch.Tensor] | None = None
        self.outs: list[torch.Tensor] = []
        self.sizes: list[int] = []

    def take(self, out: torch.Tensor, numel: int, nbytes: int) -> int:
        """Append the tensor at ``end`` (``numel`` items, ``nbytes`` bytes) copied into
        ``out``; returns ``nbytes``."""
        self.outs.append(out)
        self.sizes.append(numel)
        self.end += nbytes
        return nbytes


_Later = tuple[torch.Tensor, torch.Tensor, list[int]]
"""(destination, piece, stored shape) of a destination that is not copied into directly."""


def unpack_nothing(*, filled_to: FilledTo | None = None) -> None:
    """The :class:`Unpack` of a restore that wants nothing of a pack."""


FilledTo = Callable[[int], bool]
"""Waits until the pack's buffer holds its bytes up to the given end (exclusive); False when it
never will (the read stopped)."""


class PackReadStopped(Exception):
    """The read of the pack that unpacking was following stopped short: the pack is to be read
    again (and unpacked again, in full)."""


class Unpack(Protocol):
    """The function :func:`split_for_load` returns: copies the packed tensors out of the pack's
    buffer into their destinations, once the buffer is loaded; with ``filled_to``, while it is
    still being read (see :func:`_unpack`)."""

    def __call__(self, *, filled_to: FilledTo | None = None) -> None: ...


UNPACK_PIECE_BYTES = 2 * 2**20
"""Unpacking that follows the pack's read copies out at most about this many bytes of tensors
at a time, once the read has passed their end."""


def split_for_load(
    destinations: Mapping[str, torch.Tensor],
    record: CommitRecord,
    pack_buffer: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], Unpack]:
    """(what to load from storage, a function to call after loading it).

    Destinations of tensors in the record's pack are replaced by one buffer for the pack (when
    any is wanted); the function then copies each packed tensor into its destination (a plain
    tensor on any device, converting the dtype as DCP does for tensors stored on their own, or a
    ``DTensor``, which gets its local part). Plain destinations of the stored dtype are filled
    straight from the pack, on the CPU or, after one copy of each run's bytes there, on their
    device. A destination whose shape differs from the stored one raises ``CheckpointError``
    now, before anything is read or written; a record that places a packed tensor outside the
    pack, or gives it an unknown dtype, raises ``CorruptCheckpointError`` (a table whose columns
    do not describe each tensor once is refused as the record is read).

    ``pack_buffer`` (a 1-d ``uint8`` CPU tensor) is used as the pack's buffer when it has the
    pack's size (see :mod:`ckptmgr.pack_read_ahead`); otherwise a new one is made.
    """
    table = record.tensor_table
    if table.pack_offsets.count(None) == len(table.pack_offsets):  # nothing packed
        check_none_on_meta(destinations)
        return dict(destinations), unpack_nothing
    dtypes: dict[str, _StoredDtype] = {}
    try:
        direct = _direct_runs(destinations, table, dtypes)
        if direct is not None:
            later: list[_Later] = []
            to_load, runs, wanted_bytes, wanted_count = direct
        else:
            to_load, runs, later, wanted_bytes, wanted_count = _matched_runs(
                destinations, table, dtypes
            )
    except RuntimeError as exc:  # (looked for only then: no cost to a restore that works)
        _refuse_uninitialized(destinations, exc)
        check_all_restorable(destinations)  # (a sparse one has no nbytes)
        raise
    # A destination on the meta device holds no data (a copy into it does nothing): the ones
    # loaded on their own are looked at, and of the packed ones those of a run on a device
    # other than the CPU (one look per run) or copied to later.
    check_none_on_meta(to_load)
    if any(run.device is not None and run.device.type == "meta" for run in runs) or (
        later and any(dest.is_meta for dest, _, _ in later)
    ):
        check_none_on_meta(destinations)
    if not runs:
        return to_load, unpack_nothing
    size = _check_layout(record, runs, wanted_bytes, wanted_count, dtypes)
    if pack_buffer is not None and pack_buffer.shape == (size,):
        buffer = pack_buffer
    else:
        buffer = torch.empty(size, dtype=torch.uint8)
    to_load[PACK_KEY] = buffer
    return to_load, functools.partial(_unpack, buffer, runs, later, destinations)


def _refuse_uninitialized(destinations: Mapping[str, torch.Tensor], error: RuntimeError) -> None:
    """Raise ``CheckpointError`` naming the first of ``destinations`` that is an uninitialized
    parameter or buffer of a lazy module (``nn.LazyLinear`` before its first forward pass),
    whose shape torch refused to tell (``error``); nothing if there is none."""
    name = next(
        (name for name, dest in destinations.items() if is_lazy(dest)),
        None,
    )
    if name is not None:
        raise CheckpointError(
            f"cannot restore into {name!r}: it is an uninitialized parameter of a lazy module "
            "(nn.LazyLinear, say), whose shape is not known yet; run one forward pass first"
        ) from error


_DTYPE = operator.attrgetter("dtype")
_ITEMSIZE = operator.attrgetter("itemsize")
_DTYPE_CPU_DIMS_BYTES = operator.attrgetter("dtype", "is_cpu", "ndim", "nbytes")
_DTYPE_CUDA_DIMS_BYTES = operator.attrgetter("dtype", "is_cuda", "ndim", "nbytes")
_DTYPE_DEVICE_DIMS_BYTES = operator.attrgetter("dtype", "device", "ndim", "nbytes")
_FIRST = operator.itemgetter(0)
_ONES = itertools.repeat(1)  # (endless and stateless: shared by every call)
_NONES = itertools.repeat(None)  # (the same)


def _direct_runs(
    destinations: Mapping[str, torch.Tensor],
    table: TensorTable,
    dtypes: dict[str, _StoredDtype],
) -> tuple[dict[str, torch.Tensor], list[_Run], int, int] | None:
    """(destinations to load on their own, runs, bytes they span, count of the packed
    destinations) of :func:`split_for_load` for the usual restore: every destination a stored
    tensor, and each packed one a plain tensor of its stored dtype (not complex) and shape,
    1-d or contiguous, all on the CPU or all on one device (a GPU, say: then the runs are
    there). None when any destination is not, for :func:`_matched_runs` to match them one at a
    time (and to raise what is wrong).

    The checks are a few C-level passes over all destinations (``map`` of an attribute getter,
    a comparison of whole lists) rather than a Python step per tensor. Lazy negative views are
    not looked for here: :func:`_split_copy` copies into them.
    """
    keys = list(destinations)
    if keys == table.names:  # the usual case: the state as it was saved, in the same order
        found, names, shapes = table.pack_offsets, table.dtypes, table.shapes
    else:
        positions = list(map(table.index.get, keys))
        if None in positions:
            return None
        at = cast(list[int], positions)
        found = list(map(table.pack_offsets.__getitem__, at))
        names = list(map(table.dtypes.__getitem__, at))
        shapes = list(map(table.shapes.__getitem__, at))
    dests = list(destinations.values())
    to_load: dict[str, torch.Tensor] = {}
    if None in found:  # tensors stored on their own (large ones): loaded as they are
        packed = list(map(operator.is_not, found, _NONES))
        alone = list(map(operator.not_, packed))
        to_load = dict(itertools.compress(zip(keys, dests, strict=True), alone))
        found = list(itertools.compress(found, packed))
        names = list(itertools.compress(names, packed))
        shapes = list(itertools.compress(shapes, packed))
        dests = list(itertools.compress(dests, packed))
        if not dests:
            return to_load, [], 0, 0
    offsets = cast(list[int], found)
    if not set(map(type, dests)) <= _PLAIN_TENSOR_TYPES_SET:  # (before any attribute is read)
        return None
    by_name: dict[str, _StoredDtype] = {}
    for name in set(names):
        dtype = dtype_named(name)
        if dtype is None or dtype.is_complex:
            return None
        by_name[name] = dtypes.setdefault(name, _StoredDtype(dtype))
    # dtype, device, number of dimensions and of bytes in one pass over the destinations (each
    # pass costs a cache miss per tensor: with 20,000 of them scattered in memory, this pass
    # takes 40 ms where the five it replaced took 65). Equal number of dimensions and of bytes,
    # with equal dtype, is equal shape up to 1-d; only the destinations of more dimensions have
    # theirs read below (a torch.Size made for each costs more). What is expected of each is
    # made from the table's columns with as few passes over them as the usual case needs (one
    # dtype, 1-d tensors) and compared item by item as it is made, without a list of it.
    dims = list(map(len, shapes))
    all_1d = dims.count(1) == len(dims)
    numels = list(map(_FIRST, shapes)) if all_1d else list(map(math.prod, shapes))
    only = next(iter(by_name.values())) if len(by_name) == 1 else None
    if only is not None:
        stored_dtypes = [only] * len(names)
        nbytes = list(map(operator.mul, numels, itertools.repeat(only.itemsize)))
        expected_dtypes: Iterable[torch.dtype] = itertools.repeat(only.dtype)
    else:
        stored_dtypes = list(map(by_name.__getitem__, names))
        nbytes = list(map(operator.mul, numels, map(_ITEMSIZE, stored_dtypes)))
        expected_dtypes = map(_DTYPE, stored_dtypes)
    # All on the CPU or all on the only CUDA device (a bool per tensor), or all on the first
    # one's device (a torch.device made per tensor: dearer, but one pass still).
    first_device = dests[0].device if dests else None
    device = None if first_device is None or first_device.type == "cpu" else first_device
    if device is None:
        found_attributes = map(_DTYPE_CPU_DIMS_BYTES, dests)
        expected = zip(expected_dtypes, itertools.repeat(True), dims, nbytes)
    elif device.type == "cuda" and torch.cuda.device_count() == 1:
        found_attributes = map(_DTYPE_CUDA_DIMS_BYTES, dests)
        expected = zip(expected_dtypes, itertools.repeat(True), dims, nbytes)
    else:
        found_attributes = map(_DTYPE_DEVICE_DIMS_BYTES, dests)
        expected = zip(expected_dtypes, itertools.repeat(device), dims, nbytes)
    if not all(map(operator.eq, found_attributes, expected)):
        return None
    outs = dests
    if not all_1d:  # others than 1-d are given as 1-d views
        outs = list(dests)
        for index in itertools.compress(range(len(dims)), map(operator.ne, dims, _ONES)):
            dest = dests[index]
            if dest.shape != tuple(shapes[index]) or not dest.is_contiguous():
                return None
            outs[index] = dest.view(-1)
    if only is not None and offsets[0] % only.itemsize == 0:
        ends = list(itertools.accumulate(nbytes, initial=offsets[0]))
        if ends[:-1] == offsets:  # back to back: one run
            run = _Run(offsets[0], only.dtype, device)
            run.outs, run.sizes, run.end = outs, numels, ends[-1]
            return to_load, [run], ends[-1] - offsets[0], len(dests)
    cut = _cut_into_runs(offsets, numels, stored_dtypes, outs, device)
    return None if cut is None else (to_load, *cut, len(dests))


def _cut_into_runs(
    offsets: list[int],
    numels: list[int],
    stored: list[_StoredDtype],
    outs: list[torch.Tensor],
    device: torch.device | None,
) -> tuple[list[_Run], int] | None:
    """(runs of back-to-back tensors of one dtype on ``device``, their bytes) in the given
    order; None when an offset is not aligned to its dtype's items (for :func:`_matched_runs`
    to raise)."""
    runs: list[_Run] = []
    run: _Run | None = None
    wanted_bytes = 0
    for offset, numel, each, out in zip(offsets, numels, stored, outs, strict=True):
        if offset % each.itemsize:
            return None
        if run is None or offset != run.end or each.dtype is not run.dtype:
            run = _Run(offset, each.dtype, device)
            runs.append(run)
        wanted_bytes += run.take(out, numel, numel * each.itemsize)
    return runs, wanted_bytes


def _matched_runs(
    destinations: Mapping[str, torch.Tensor],
    table: TensorTable,
    dtypes: dict[str, _StoredDtype],
) -> tuple[dict[str, torch.Tensor], list[_Run], list[_Later], int, int]:
    """(destinations to load on their own, runs, later copies, bytes and count of the packed
    tensors wanted): :func:`split_for_load`'s match of every destination against the record,
    one at a time, for destinations of any kind and any subset and order of the stored ones."""
    index, offsets = table.index, table.pack_offsets
    dtype_names, shapes = table.dtypes, table.shapes
    to_load: dict[str, torch.Tensor] = {}
    runs: list[_Run] = []
    later: list[_Later] = []
    open_runs: dict[torch.device | None, _Run] = {}  # per device, its latest run
    wanted_bytes = wanted_count = 0
    # Every torch call below costs 0.1-0.3 µs, and there are tens of thousands of tensors: the
    # loop makes as few as its checks need (no numel(), which the stored shape gives, and no
    # is_conj() unless the dtype is complex).
    for key, dest in destinations.items():
        position = index.get(key)
        if position is None or offsets[position] is None:
            to_load[key] = dest
            continue
        offset = offsets[position]
        dtype_name = dtype_names[position]
        stored = dtypes.get(dtype_name) or dtypes.setdefault(
            dtype_name, _stored_dtype(key, dtype_name)
        )
        dtype = stored.dtype
        shape = shapes[position]
        if dest.shape != tuple(shape):  # torch.Size is a tuple
            raise CheckpointError(
                f"{key!r}: the checkpoint holds shape {list(shape)}, the state to restore "
                f"has {list(dest.shape)}"
            )
        numel = shape[0] if len(shape) == 1 else math.prod(shape)
        if offset % stored.itemsize:  # (ckptmgr aligns every packed tensor to its item size)
            raise CorruptCheckpointError(
                f"the record places the packed tensor {key!r} at offset {offset}, not aligned "
                f"to its {dtype_name} items"
            )
        device: torch.device | None = None  # where ``out`` lies: None for the CPU
        if (
            type(dest) in _PLAIN_TENSOR_TYPES
            and dest.dtype is dtype
            and not dest.is_neg()  # lazy negative/conjugate views cannot be an ``out=``
            and not (stored.is_complex and dest.is_conj())
        ):
            if not dest.is_cpu:
                device = dest.device
            if len(shape) == 1:
                out = dest
            elif dest.is_contiguous():
                out = dest.view(-1)
            else:
                device = None
                out = _later(dest, dtype, shape, numel, later)
        else:
            out = _later(dest, dtype, shape, numel, later)
        # A run per device (so CPU tensors between GPU ones, an optimizer's step scalars say,
        # do not cut the GPU's run). Within a device the runs are made in key order; on the
        # CPU a run's outputs are written one after another too (destinations that overlap
        # end as key order says), while CUDA may write one call's outputs at once.
        run = open_runs.get(device)
        if run is None or offset != run.end or dtype is not run.dtype:
            run = open_runs[device] = _Run(offset, dtype, device)
            runs.append(run)
        wanted_bytes += run.take(out, numel, numel * stored.itemsize)
        wanted_count += 1
    return to_load, runs, later, wanted_bytes, wanted_count


def _later(
    dest: torch.Tensor, dtype: torch.dtype, shape: list[int], numel: int, later: list[_Later]
) -> torch.Tensor:
    """A new piece to copy the pack's bytes into, copied on to ``dest`` after the runs."""
    piece = torch.empty(numel, dtype=dtype)
    later.append((dest, piece, shape))
    return piece


class _StoredDtype:
    """A dtype named in the record, with what the loop above asks of it per tensor."""

    __slots__ = ("dtype", "is_complex", "itemsize")

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.itemsize = dtype.itemsize
        self.is_complex = dtype.is_complex


def _stored_dtype(key: str, dtype_name: str) -> _StoredDtype:
    dtype = dtype_named(dtype_name)
    if dtype is None:
        raise CorruptCheckpointError(f"{key!r} has the unknown dtype {dtype_name!r}")
    return _StoredDtype(dtype)


def _check_layout(
    record: CommitRecord,
    runs: list[_Run],
    wanted_bytes: int,
    wanted_count: int,
    dtypes: dict[str, _StoredDtype],
) -> int:
    """The size of the stored pack: its tensors back to back, with no gaps. Raises
    ``CorruptCheckpointError`` when a wanted tensor lies outside it (a damaged record)."""
    table = record.tensor_table
    if wanted_count == len(table.packed):  # the usual case: every packed tensor is restored
        size = wanted_bytes
        ends_at_size = max(run.end for run in runs) == size
    else:
        size = 0
        columns = zip(table.names, table.dtypes, table.shapes, table.pack_offsets, strict=True)
        for key, dtype_name, shape, offset in columns:
            if offset is not None:
                stored = dtypes.get(dtype_name) or dtypes.setdefault(
                    dtype_name, _stored_dtype(key, dtype_name)
                )
                size += math.prod(shape) * stored.itemsize
        ends_at_size = True
    if not ends_at_size or min(run.start for run in runs) < 0:
        raise CorruptCheckpointError("the record places packed tensors outside the pack")
    data_files = [entry.size for entry in record.files if entry.path.endswith(".distcp")]
    if data_files and size > max(data_files):  # checked before a buffer that big is allocated
        raise CorruptCheckpointError(
            f"the record describes a pack of {size} bytes, more than any data file of the step "
            f"holds ({max(data_files)} bytes)"
        )
    for run in runs:
        if run.end > size:
            raise CorruptCheckpointError(
                f"the record places a packed tensor outside the pack (offset {run.start})"
            )
    return size


def _unpack(
    buffer: torch.Tensor,
    runs: list[_Run],
    later: list[_Later],
    destinations: Mapping[str, torch.Tensor],
    *,
    filled_to: FilledTo | None = None,
) -> None:
    """Copy every wanted tensor out of the loaded pack ``buffer``: the runs on the CPU in
    pieces of about ``UNPACK_PIECE_BYTES``, on up to :func:`unpack_threads` threads (see
    :func:`_copy_pieces`); one call per run on a device, after one copy there of the bytes they
    span; then the pieces that could not be copied into their destinations directly. A
    destination that cannot be written to raises ``CheckpointError`` naming it (its key in
    ``destinations``).

    With ``filled_to``, ``buffer`` is still being read, in increasing offsets: each piece on
    the CPU is copied once ``filled_to`` says the read has passed its end, so that copying
    overlaps reading; everything else waits for the whole buffer. Raises
    :class:`PackReadStopped` when ``filled_to`` says the read stopped (the destinations copied
    into so far then hold what was read, until the caller unpacks again)."""
    flat: torch.Tensor | None = None
    there: torch.Tensor | None = None
    try:
        with torch.no_grad():  # destinations may be parameters
            if filled_to is not None and any(run.on_device is not None for run in runs):
                _wait_for(filled_to, buffer.numel())  # (device copies span many runs)
            _copy_to_devices(buffer, runs)
            _copy_pieces(buffer, _pieces_on_the_cpu(runs), filled_to)
            for run in runs:
                if run.on_device is None:  # (on the CPU: copied above)
                    continue
                start, there = run.on_device
                run.on_device = None  # the device copy goes once its last run is done
                flat = there[run.start - start : run.end - start]
                there = None
                _split_copy(flat.view(run.dtype), run.sizes, run.outs)
                flat = None
            if later and filled_to is not None:
                _wait_for(filled_to, buffer.numel())
            for dest, piece, shape in later:
                value = piece.view(shape)
                if DTensor is not None and isinstance(dest, DTensor):
                    dest.to_local().copy_(_local_part(value, dest))
                else:
                    dest.copy_(value)
    except Exception as exc:
        # The traceback keeps this frame and those below alive (through the ranks' agreement
        # and the caller's handler): let go of every device copy they hold.
        del flat, there
        traceback.clear_frames(exc.__traceback__)
        check_all_restorable(destinations)  # (asked only here: no check per destination)
        raise
    finally:
        for run in runs:  # (after a failure: device copies not used yet)
            run.on_device = None


def _wait_for(filled_to: FilledTo, end: int) -> None:
    if not filled_to(end):
        raise PackReadStopped(f"the read of the pack stopped before byte {end}")


_Piece = tuple[torch.dtype, int, int, list[int], list[torch.Tensor]]
"""(dtype, first byte, end byte, sizes, destinations) of tensors back to back in the pack that
one ``torch.split_with_sizes_copy`` copies out."""

MAX_UNPACK_THREADS = 4
"""At most this many threads copy tensors out of the pack (see :func:`unpack_threads`)."""


def unpack_threads() -> int:
    """Threads that copy tensors out of the pack: torch's own count of threads for one
    operation (the cores it was given), at most ``MAX_UNPACK_THREADS``. With thousands of small
    tensors the copy is bound by torch's work per tensor (about a microsecond each), not by
    memory, and ``torch.split_with_sizes_copy`` releases the GIL while it runs: on the 2-core
    benchmark machine, two threads copied 20,000 tensors of 1 KiB in 24 ms where one took 42."""
    return max(1, min(MAX_UNPACK_THREADS, torch.get_num_threads()))


def _pieces_on_the_cpu(runs: list[_Run]) -> list[_Piece]:
    """The runs on the CPU cut into pieces of about ``UNPACK_PIECE_BYTES`` (a whole number of
    their tensors each), in the order of their ends in the pack (the order it is read in)."""
    pieces: list[_Piece] = []
    for run in runs:
        if run.device is not None:
            continue
        itemsize = run.dtype.itemsize
        sizes, outs = run.sizes, run.outs
        count = max(1, min(len(sizes), -(-(run.end - run.start) // UNPACK_PIECE_BYTES)))
        start = run.start
        low = 0
        for index in range(1, count + 1):
            high = len(sizes) * index // count
            end = start + sum(sizes[low:high]) * itemsize
            pieces.append((run.dtype, start, end, sizes[low:high], outs[low:high]))
            start, low = end, high
    pieces.sort(key=operator.itemgetter(2))
    return pieces


def _copy_pieces(buffer: torch.Tensor, pieces: list[_Piece], filled_to: FilledTo | None) -> None:
    """Copy ``pieces`` out of ``buffer``, each once ``filled_to`` (when given) says the read has
    passed its end, on this thread and up to ``unpack_threads() - 1`` more, which take the next
    piece in turn, in this thread's inference mode. Returns once every thread has stopped
    (nothing is written into a destination after it returns or raises); raises the first
    failure of any thread, after which the others take no further piece."""
    helpers = min(unpack_threads(), len(pieces)) - 1
    if helpers <= 0:
        for piece in pieces:
            _copy_piece(buffer, piece, filled_to)
        return
    remaining = iter(pieces)
    taking = threading.Lock()
    failures: list[BaseException] = []
    inference = torch.is_inference_mode_enabled()

    def copy_in_turn() -> None:
        # Grad and inference mode are per thread: destinations may be parameters, or tensors
        # made under inference mode (which refuse an in-place write outside it).
        with torch.inference_mode(inference), torch.no_grad():
            while not failures:
                with taking:
                    piece = next(remaining, None)
                if piece is None:
                    return
                try:
                    _copy_piece(buffer, piece, filled_to)
                except BaseException as exc:
                    failures.append(exc)
                    return

    threads = [
        threading.Thread(target=copy_in_turn, name="ckptmgr-unpack", daemon=True)
        for _ in range(helpers)
    ]
    try:
        for thread in threads:
            try:
                thread.start()
            except RuntimeError:  # (no thread left: the ones started do the copying)
                break
        copy_in_turn()
    finally:
        failures.append(_STOP)  # (the others take no further piece when this thread stops)
        for thread in threads:
            if thread.ident is not None:
                thread.join()
    failed = [failure for failure in failures if failure is not _STOP]
    if failed:  # (also one that failed its last piece after this thread ran out of pieces)
        raise failed[0]


_STOP = PackReadStopped("(the copying threads were told to stop)")


def _copy_piece(buffer: torch.Tensor, piece: _Piece, filled_to: FilledTo | None) -> None:
    dtype, start, end, sizes, outs = piece
    if filled_to is not None:
        _wait_for(filled_to, end)
    _split_copy(buffer[start:end].view(dtype), sizes, outs)


def _split_copy(source: torch.Tensor, sizes: list[int], outs: list[torch.Tensor]) -> None:
    """``torch.split_with_sizes_copy(source, sizes, 0, out=outs)``, also where some of ``outs``
    are lazy negative views (``z.conj().imag`` of a complex ``z``, say), which that call refuses:
    then each piece is copied on its own (``copy_`` writes such a view as its value says). The
    direct path does not look for them (a pass over every destination for what hardly occurs):
    a failed call is made again in full, so what it wrote before failing does not matter."""
    try:
        torch.split_with_sizes_copy(source, sizes, 0, out=outs)
    except RuntimeError:
        if not any(map(torch.Tensor.is_neg, outs)):
            raise
        for out, piece in zip(outs, source.split(sizes), strict=True):
            out.copy_(piece)


_DEVICE_COPY_GAP_BYTES = 64 * 1024
"""Runs of one device closer than this (or than the bytes already gathered) share one copy."""


def _copy_to_devices(buffer: torch.Tensor, runs: list[_Run]) -> None:
    """Copy the pack's bytes that the runs on each device need to that device, in few pieces:
    one per stretch of runs whose gaps are at most ``_DEVICE_COPY_GAP_BYTES`` or the bytes the
    stretch already holds (a restore into a layout other than the saved one would otherwise
    make a copy per run; a single copy of a device's whole span could carry much of the pack
    for a few bytes). Sets each such run's ``on_device``. A piece starts at a multiple of 16
    bytes, so every run keeps its items aligned there."""
    by_device: dict[torch.device, list[_Run]] = {}
    for run in runs:
        if run.device is not None:
            by_device.setdefault(run.device, []).append(run)
    for device, device_runs in by_device.items():
        device_runs.sort(key=lambda run: run.start)
        piece: list[_Run] = []
        end = held = 0
        for run in [*device_runs, None]:
            if run is not None and piece and run.start - end <= max(_DEVICE_COPY_GAP_BYTES, held):
                piece.append(run)
                end = max(end, run.end)
                held += run.end - run.start
                continue
            if piece:
                start = piece[0].start - piece[0].start % 16
                there = buffer[start:end].to(device)
                for member in piece:
                    member.on_device = (start, there)
            if run is not None:
                piece = [run]
                end = run.end
                held = run.end - run.start


def _local_part(value: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """The part of the global ``value`` that the DTensor ``dest`` holds on this rank."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(
        dest.shape, dest.device_mesh, dest.placements
    )
    for dim, (start, length) in enumerate(zip(offsets, shape, strict=True)):
        value = value.narrow(dim, start, length)
    return value
