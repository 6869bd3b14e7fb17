"""Small tensors packed into one stored item.

DCP plans, describes and writes every tensor as an item of its own: with thousands of small
tensors (optimizer steps, biases, norms) that per-item work, done on the background thread with
the GIL held, is what a checkpoint costs the training loop. A single-process save therefore
stores every plain tensor (on any device) of at most :data:`PACK_MAX_TENSOR_BYTES` bytes inside
one ``uint8`` host tensor, :data:`PACK_KEY`, one after another with no padding; the commit record
gives each packed tensor's dtype and shape (``tensors``) and byte offset (``packed``).

Restore loads the pack like any other tensor and copies every packed tensor out of it into its
destination (:mod:`ckptmgr.pack_load`).
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Callable, Iterable, Mapping

import torch

from ckptmgr.dtypes import dtype_named
from ckptmgr.errors import CheckpointError, CorruptCheckpointError
from ckptmgr.record import CommitRecord, TensorEntry, TensorTable
from ckptmgr.state import is_rank_private

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = None  # type: ignore[assignment,misc]

PACK_KEY = "__ckptmgr_packed__"
"""The stored name of the pack (a name no state may use)."""
PACK_MAX_TENSOR_BYTES = 64 * 1024
"""Tensors of at most this many bytes are packed."""
PACK_MIN_TENSORS = 2
"""Fewer small tensors than this are stored as they are."""


class PackedTensor:
    """Where one tensor lies in the pack: byte ``offset``, ``dtype``, ``shape`` and ``nbytes``."""

    __slots__ = ("_entry", "dtype", "nbytes", "offset", "shape")

    def __init__(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.offset = offset
        self.dtype = dtype
        self.shape = shape
        self.nbytes = math.prod(shape) * dtype.itemsize
        self._entry: TensorEntry | None = None

    @property
    def entry(self) -> TensorEntry:
        """Its record entry (built on first use, then kept: staging keeps the layout)."""
        if self._entry is None:
            self._entry = TensorEntry.trusted(_dtype_name(self.dtype), list(self.shape))
        return self._entry

    def __repr__(self) -> str:
        return f"PackedTensor(offset={self.offset}, dtype={self.dtype}, shape={self.shape})"


PackFilter = Callable[[str], bool]
"""Which stored names may go into the pack."""


def any_name(name: str) -> bool:
    """Every name may be packed: the filter for one process."""
    return True


def shared_name(name: str) -> bool:
    """Names that are the same tensor on every rank, i.e. not rank-private (``%rank00003%/...``,
    see :func:`ckptmgr.state.rank_private_name`): with several ranks only these are packed,
    since every rank must build the same pack (DCP then writes it once, as any replicated
    tensor)."""
    return not is_rank_private(name)


def pack_filter(world_size: int) -> PackFilter:
    """The names packed in a job of ``world_size`` ranks."""
    return any_name if world_size == 1 else shared_name


def fingerprint(placed: Mapping[str, PackedTensor]) -> str:
    """A digest of a pack layout (names, order, dtypes, shapes), the same on every rank that
    lays out the same pack (unlike ``hash()``, which differs between processes)."""
    digest = hashlib.sha256()
    for key, entry in placed.items():
        digest.update(f"{key}\0{entry.dtype}\0{entry.shape}\n".encode())
    return digest.hexdigest()


def check_names(names: Iterable[str]) -> None:
    """Raise ``CheckpointError`` when a state uses the pack's reserved name."""
    if PACK_KEY in names:
        raise CheckpointError(f"{PACK_KEY!r} is a name reserved by ckptmgr; rename that state key")


def candidates(tensors: Mapping[str, torch.Tensor], may_pack: PackFilter) -> list[str]:
    """The names of ``tensors`` that go into the pack: accepted by ``may_pack`` and packable."""
    return [key for key, tensor in tensors.items() if may_pack(key) and is_packable(tensor)]


def pack(
    tensors: Mapping[str, torch.Tensor], may_pack: PackFilter = any_name
) -> tuple[dict[str, torch.Tensor], dict[str, PackedTensor]]:
    """(the tensors to store, with the small ones replaced by :data:`PACK_KEY`; where each
    packed tensor lies). Only names ``may_pack`` accepts are packed; nothing is packed when
    there are fewer than ``PACK_MIN_TENSORS`` candidates.

    The pack is one new CPU tensor: the small tensors grouped by dtype, groups in decreasing
    item size (so every tensor's offset is a multiple of its item size, with no padding), each
    group flattened straight into it in one call per device it lies on (on a device, then copied
    into it once from there).
    Successive saves of one state pack faster through a :class:`SavePacker`.
    """
    return SavePacker().pack(tensors, may_pack)


class SavePacker:
    """:func:`pack` for successive saves of one state (``save()``'s, on the writer thread).

    The layout of the last save, its fingerprint and its runs are reused while the state keeps
    its keys in order and each tensor its type, dtype, shape and device (what the layout and
    the packability of a plain tensor depend on): a state of many small tensors then costs each
    save one look at every tensor and the copies into the pack, instead of laying the pack out,
    checking every candidate and describing the layout anew (about 120 ms per save of 20,000
    tensors). The same ``placed`` dict is returned each time, so that the record section made
    from it is reused too (:class:`RecordSectionCache`). It holds no tensor.
    """

    def __init__(self) -> None:
        self._quick: tuple[object, ...] | None = None
        self._placed: dict[str, PackedTensor] = {}
        self._runs: list[tuple[torch.dtype, list[str], int, int]] = []  # (+ first, end byte)
        self._pack_bytes = 0
        self._unpacked: list[str] = []
        self._fingerprint = fingerprint({})

    @property
    def fingerprint(self) -> str:
        """:func:`fingerprint` of the layout of the last :meth:`pack`."""
        return self._fingerprint

    def pack(
        self, tensors: Mapping[str, torch.Tensor], may_pack: PackFilter = any_name
    ) -> tuple[dict[str, torch.Tensor], dict[str, PackedTensor]]:
        """What :func:`pack` returns, the layout taken from the last call when it still fits."""
        quick = (
            may_pack,
            list(tensors),
            [(t.__class__, t.dtype, t.shape, t.device) for t in tensors.values()],
        )
        if quick != self._quick:
            self._quick = None  # (until the new layout is complete)
            check_names(tensors)
            placed = pack_layout(tensors, candidates(tensors, may_pack))
            self._placed = placed
            self._runs = [
                (dtype, run, placed[run[0]].offset, placed[run[-1]].offset + placed[run[-1]].nbytes)
                for dtype, run in (_runs(placed, placed) if placed else [])
            ]
            self._pack_bytes = max((end for _, _, _, end in self._runs), default=0)
            self._unpacked = [key for key in tensors if key not in placed]
            self._fingerprint = fingerprint(placed)
            self._quick = quick
        if not self._placed:
            return dict(tensors), {}
        stored = {key: tensors[key] for key in self._unpacked}
        pack_buffer = torch.empty(self._pack_bytes, dtype=torch.uint8)
        with torch.no_grad():  # parameters: no autograd graph (cat resolves conj and neg views)
            for dtype, run, start, end in self._runs:
                _flatten_on_host([tensors[key] for key in run], pack_buffer[start:end].view(dtype))
        stored[PACK_KEY] = pack_buffer
        return stored, self._placed


FLATTEN_MAX_DEVICE_BYTES = 32 * 2**20
"""The most bytes of small device tensors flattened on their device in one piece before the
copy to the host (a temporary there: device memory may be nearly all in use)."""


def _flatten_on_host(members: list[torch.Tensor], out: torch.Tensor) -> None:
    """``members`` (of one dtype) written back to back into the 1-d CPU tensor ``out`` (of
    their dtype and total size): each stretch of members on one device (up to
    ``FLATTEN_MAX_DEVICE_BYTES``) flattened in one call there, then copied into ``out`` in one
    piece."""
    if all(map(_IS_CPU, members)):
        _flatten(members, out)
        return
    start = 0
    stretch_bytes = 0
    filled = 0
    for end in range(len(members) + 1):
        if end < len(members):
            member = members[end]
            nbytes = member.numel() * member.element_size()
            if end == start or (
                member.device == members[start].device
                and (member.is_cpu or stretch_bytes + nbytes <= FLATTEN_MAX_DEVICE_BYTES)
            ):
                stretch_bytes += nbytes
                continue
        stretch = members[start:end]
        items = stretch_bytes // out.element_size()
        if stretch[0].is_cpu:
            _flatten(stretch, out[filled : filled + items])
        else:
            flat = torch.empty(items, dtype=out.dtype, device=stretch[0].device)
            _flatten(stretch, flat)
            out[filled : filled + items].copy_(flat)
        filled += items
        start = end
        stretch_bytes = nbytes if end < len(members) else 0


_IS_CPU = operator.attrgetter("is_cpu")


def _flatten(members: list[torch.Tensor], out: torch.Tensor) -> None:
    """``members`` (of one dtype, on ``out``'s device) back to back into the 1-d ``out``: one
    ``torch.cat``, of the members as they are when all are 1-d (a view of each otherwise costs
    as much again with thousands of them)."""
    dims = list(map(torch.Tensor.dim, members))
    if dims.count(1) == len(dims):
        torch.cat(members, out=out)
        return
    torch.cat(
        [
            member.reshape(-1) if dim != 1 else member
            for member, dim in zip(members, dims, strict=True)
        ],
        out=out,
    )


def pack_layout(
    tensors: Mapping[str, torch.Tensor], keys: Iterable[str]
) -> dict[str, PackedTensor]:
    """Where each of ``keys`` lies in a pack, in pack order: grouped by dtype, groups in
    decreasing item size, back to back (so every offset is a multiple of its item size, with no
    padding); within a group the CPU tensors first, then each device's, in ``keys``' order, so
    that a device's tensors of one dtype lie together (an optimizer's CPU ``step`` scalars would
    otherwise cut its moments on the GPU into pairs). Empty when there are fewer than
    ``PACK_MIN_TENSORS`` keys: nothing is packed."""
    groups: dict[torch.dtype, tuple[list[str], list[str]]] = {}
    count = 0
    for key in keys:
        tensor = tensors[key]
        on_cpu, elsewhere = groups.setdefault(tensor.dtype, ([], []))
        (on_cpu if tensor.is_cpu else elsewhere).append(key)
        count += 1
    if count < PACK_MIN_TENSORS:
        return {}
    placed: dict[str, PackedTensor] = {}
    offset = 0
    for dtype in sorted(groups, key=lambda d: -d.itemsize):
        on_cpu, elsewhere = groups[dtype]
        for key in on_cpu + _by_device(tensors, elsewhere) if elsewhere else on_cpu:
            entry = PackedTensor(offset, dtype, tuple(tensors[key].shape))
            placed[key] = entry
            offset += entry.nbytes
    return placed


def _by_device(tensors: Mapping[str, torch.Tensor], keys: list[str]) -> list[str]:
    """``keys`` grouped by their tensors' devices, in order of first appearance (several GPUs
    in one process), each group in ``keys``' order."""
    groups: dict[torch.device, list[str]] = {}
    for key in keys:
        groups.setdefault(tensors[key].device, []).append(key)
    if len(groups) == 1:
        return keys
    return [key for group in groups.values() for key in group]


def unpacked(
    pack_buffer: torch.Tensor, placed: Mapping[str, PackedTensor]
) -> dict[str, torch.Tensor]:
    """Every packed tensor as a new tensor, from a loaded pack."""
    return {key: _view(pack_buffer, entry).clone() for key, entry in placed.items()}


def _runs(
    wanted: Iterable[str], placed: Mapping[str, PackedTensor]
) -> list[tuple[torch.dtype, list[str]]]:
    """The ``wanted`` keys in pack order, cut into runs of one dtype that lie back to back."""
    runs: list[tuple[torch.dtype, list[str]]] = []
    end = -1
    keys = list(wanted)
    entries = [placed[key] for key in keys]
    offsets = [entry.offset for entry in entries]
    for index in sorted(range(len(keys)), key=offsets.__getitem__):  # usually sorted already
        key, entry = keys[index], entries[index]
        if runs and runs[-1][0] == entry.dtype and entry.offset == end:
            runs[-1][1].append(key)
        else:
            runs.append((entry.dtype, [key]))
        end = entry.offset + entry.nbytes
    return runs


def is_packable(tensor: torch.Tensor) -> bool:
    """True for a plain (not DTensor), strided, non-empty, not quantized tensor with data (on
    any device but ``meta``) of at most :data:`PACK_MAX_TENSOR_BYTES` bytes.

    Device tensors are packed too: staging copies them into the host pack, and a save from a
    GPU holds as many small tensors (biases, norms, their optimizer moments) as one from a CPU.
    """
    if DTensor is not None and isinstance(tensor, DTensor):
        return False
    return (
        tensor.device.type != "meta"
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and 0 < tensor.numel() * tensor.element_size() <= PACK_MAX_TENSOR_BYTES
    )


def _view(buffer: torch.Tensor, entry: PackedTensor) -> torch.Tensor:
    """The packed tensor ``entry`` in ``buffer`` (a copy when its offset is not aligned).
    Raises ``CorruptCheckpointError`` when it does not lie inside ``buffer``."""
    if entry.offset < 0 or entry.offset + entry.nbytes > buffer.numel():
        raise CorruptCheckpointError(
            f"the record places a packed tensor at bytes {entry.offset}-"
            f"{entry.offset + entry.nbytes} of a pack of {buffer.numel()} bytes"
        )
    piece = buffer[entry.offset : entry.offset + entry.nbytes]
    if entry.offset % entry.dtype.itemsize:
        piece = piece.clone()
    return piece.view(entry.dtype).view(entry.shape)


def placed_in_record(record: CommitRecord) -> dict[str, PackedTensor]:
    """The packed tensors of a commit record (those of its ``tensor_table`` with an offset)."""
    placed = {}
    dtypes: dict[str, torch.dtype] = {}
    table = record.tensor_table
    columns = zip(table.names, table.dtypes, table.shapes, table.pack_offsets, strict=True)
    for key, dtype_name, shape, offset in columns:
        if offset is None:
            continue
        dtype = dtypes.get(dtype_name)
        if dtype is None:
            dtype = dtype_named(dtype_name)
            if dtype is None:
                raise CorruptCheckpointError(f"{key!r} has the unknown dtype {dtype_name!r}")
            dtypes[dtype_name] = dtype
        placed[key] = PackedTensor(offset, dtype, tuple(shape))
    return placed


def record_table(
    stored: Mapping[str, TensorEntry], placed: Mapping[str, PackedTensor]
) -> TensorTable:
    """The record's tensor table: what DCP stored (less the pack itself), then every packed
    tensor with its byte offset in the pack (where a name is both, its packed entry: each name
    once, as a reader requires)."""
    names = [key for key in stored if key != PACK_KEY and key not in placed]
    entries = [stored[key] for key in names]
    offsets: list[int | None] = [None] * len(names)
    for key, where in placed.items():
        names.append(key)
        entries.append(where.entry)
        offsets.append(where.offset)
    dtypes = [entry.dtype for entry in entries]
    shapes = [entry.shape for entry in entries]
    return TensorTable(names, dtypes, shapes, offsets)


class RecordTableCache:
    """The :class:`~ckptmgr.record.TensorTable` of the last save, reused by the next save while
    the staging layout (the very same ``placed`` dict) and DCP's own entries are unchanged:
    a state of many small tensors then costs its record no per-tensor work from save to save
    (the table's JSON text is made once, too)."""

    def __init__(self) -> None:
        self._last: tuple[Mapping[str, PackedTensor], Mapping[str, TensorEntry], TensorTable]
        self._last = ({}, {}, TensorTable.empty())

    def table(
        self, stored: Mapping[str, TensorEntry], placed: Mapping[str, PackedTensor]
    ) -> TensorTable:
        """The tensor table for DCP's ``stored`` entries and the pack layout ``placed``."""
        last_placed, last_stored, last_table = self._last
        if placed is last_placed and stored == last_stored:
            return last_table
        table = record_table(stored, placed)
        self._last = (placed, stored, table)
        return table


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name
