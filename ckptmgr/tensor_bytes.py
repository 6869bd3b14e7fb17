"""Tensors as raw bytes: how ckptmgr lays tensors out in DCP's data files (record format 2).

DCP's own writer wraps every tensor in a ``torch.save`` zip container (about 1.5 KiB of framing
per tensor, and a pickle to run per tensor on the background thread). ckptmgr writes each tensor's
bytes as they lie in memory instead: C order, native byte order (recorded in the commit record),
one tensor after another. DCP's metadata still gives each item's file, offset and length, and its
dtype and chunk shape, so nothing else is needed to read the bytes back.

* Writing goes straight from the (staged) tensor's memory to the file, with the GIL released for
  the whole ``write`` call; the file's CRC-32 is computed on a second thread while the next
  bytes are written (:class:`ckptmgr.ordered_hash.OrderedHasher`).
* Reading goes straight into the destination tensor when it is the whole stored chunk and laid
  out like it (the usual in-place restore); into a CUDA destination laid out like it, through
  pieces of pinned host memory, each copied to the device while the next is read
  (:func:`read_chunk_to_device`); otherwise into a temporary that is then narrowed and copied.
  A local file is hashed while it is read and checked at the end (``finish``), and read past
  the page cache where direct reads are on and the filesystem allows
  (:mod:`ckptmgr.direct_read`).
"""

from __future__ import annotations

import ctypes
import io
import itertools
import operator
import os
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch

from ckptmgr.direct_read import DirectReader, open_direct_read
from ckptmgr.direct_write import DirectWriter, open_direct
from ckptmgr.errors import CheckpointError, CorruptCheckpointError
from ckptmgr.local_files import open_step_file
from ckptmgr.ordered_hash import HANDOFF_BYTES, OrderedHasher
from ckptmgr.writeback import WriteBehind


def check_storable(name: str, tensor: torch.Tensor) -> None:
    """Raise ``CheckpointError`` when ``tensor`` (stored as ``name``) is of a kind whose bytes
    do not hold its value: sparse (no dense bytes), quantized (the bytes are its integers; the
    scale and zero point would be lost), meta (no data) or nested (no single dense shape).

    An efficient zero tensor (``torch._efficientzerotensor``, what forward-mode AD makes) is
    storable although it has no memory: it is stored as zeros of its dtype and shape (see
    :func:`write_tensor`; staging copies it, which writes the zeros)."""
    if tensor.layout != torch.strided:
        layout = str(tensor.layout).removeprefix("torch.")
        reason = f"a {layout} tensor has no dense bytes (store tensor.to_dense() instead)"
    elif tensor.is_quantized:
        reason = (
            "a quantized tensor's scale and zero point would be lost (store "
            "tensor.dequantize(), or tensor.int_repr() with its q_scale() and q_zero_point())"
        )
    elif tensor.is_meta:
        reason = "a tensor on the meta device holds no data"
    elif tensor.is_nested:
        reason = "a nested tensor has no single dense shape (store tensor.unbind() instead)"
    else:
        return
    raise CheckpointError(f"cannot checkpoint {name!r}: {reason}")


def check_all_storable(tensors: Mapping[str, torch.Tensor]) -> None:
    """:func:`check_storable` for each of ``tensors`` (name -> tensor): run where torch failed on
    a state, so that the error names the tensor rather than torch's internals."""
    for name, tensor in tensors.items():
        check_storable(name, tensor)


def check_all_restorable(tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise ``CheckpointError`` naming the first of ``tensors`` (name -> destination of a
    restore) that cannot be written to in place: an efficient zero tensor (immutable), a sparse,
    nested or other tensor that is not strided (no dense memory to fill), an inference tensor
    outside ``torch.inference_mode`` (torch refuses in-place writes to it), or a tensor whose
    elements share memory (an ``expand()``-ed one). Run where a restore failed, so that the
    error names the destination rather than torch's internals (asking every destination up
    front would cost each restore a torch call per tensor)."""
    for name, tensor in tensors.items():
        reason = _unwritable(tensor)
        if reason is not None:
            raise CheckpointError(f"cannot restore into {name!r}: {reason}")


def _unwritable(tensor: torch.Tensor) -> str | None:
    """Why a restore cannot fill ``tensor`` in place, or None (also where asking fails)."""
    try:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's part
        if local.layout != torch.strided or local.is_nested:
            kind = "nested" if local.is_nested else str(local.layout).removeprefix("torch.")
            return (
                f"it is a {kind} tensor, which has no dense memory to fill; restore into a "
                "dense tensor (tensor.to_dense()) and convert it afterwards"
            )
        if local._is_zerotensor():
            return (
                "it is an efficient zero tensor (what forward-mode AD makes), which is "
                "immutable; restore into an ordinary tensor (tensor.clone() makes one)"
            )
        if local.is_inference() and not torch.is_inference_mode_enabled():
            return (
                "it is an inference tensor (made under torch.inference_mode()), which torch "
                "does not let be written to outside inference mode; make the model outside "
                "inference mode, or restore into tensor.clone()"
            )
        if torch._debug_has_internal_overlap(local) == 1:  # (MemOverlap::Yes)
            return (
                "several of its elements share memory (an expand()-ed tensor, say); restore "
                "into a tensor of its own memory (tensor.contiguous() makes one)"
            )
    except Exception:  # (a tensor of a kind this cannot ask: torch's own error stands)
        return None
    return None


_IS_META = operator.attrgetter("is_meta")


def check_none_on_meta(tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise ``CheckpointError`` naming the first of ``tensors`` (name -> destination of a
    restore) on the meta device: it holds no data, and a restore into it did nothing, silently.
    (One C-level pass over the tensors.)"""
    if any(map(_IS_META, tensors.values())):
        name = next(name for name, tensor in tensors.items() if tensor.is_meta)
        raise CheckpointError(
            f"cannot restore into {name!r}: it is on the meta device, which holds no data; "
            f"give it memory first (module.to_empty(device=...) for a module built on 'meta')"
        )


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable ``memoryview`` of the bytes of the contiguous CPU ``tensor`` (no copy).

    The view does not keep ``tensor`` alive: the caller holds a reference while it is used.
    Raises :class:`NoMemoryError` for a tensor with elements but no memory (an efficient zero
    tensor: its address is 0, and reading or writing there would crash the process).
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("byte_view needs a contiguous CPU tensor")
    address = tensor.data_ptr()
    if not address:
        raise NoMemoryError(f"a tensor of {nbytes} bytes has no memory (its address is 0)")
    array = (ctypes.c_char * nbytes).from_address(address)
    return memoryview(array).cast("B")


class NoMemoryError(ValueError):
    """:func:`byte_view` of a tensor that has elements but no memory behind them."""


def contiguous_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when it is a contiguous CPU tensor, else a contiguous CPU copy."""
    tensor = tensor.detach().resolve_conj().resolve_neg()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor if tensor.is_contiguous() else tensor.contiguous()


class TensorSink(Protocol):
    """Where :func:`write_tensor` puts bytes: a data file being written."""

    def tell(self) -> int:
        """Bytes written so far."""

    def write_piece(self, piece: memoryview, owner: Any) -> None:
        """Append ``piece`` (a view of ``owner``'s memory) to the file."""


class LocalDataFile:
    """A local data file written with unbuffered ``write`` calls, hashed on a helper thread,
    fsynced on ``close`` (which returns its size and CRC-32).

    A file fsynced at the end is written past the page cache where the filesystem allows
    (:mod:`ckptmgr.direct_write`), and otherwise has each written stretch handed to the disk at
    once (:mod:`ckptmgr.writeback`)."""

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool) -> None:
        self._file = open(path, "wb", buffering=0)
        self._fsync = fsync
        self._hasher = OrderedHasher()
        self._size = 0
        self._direct: DirectWriter | None = None
        self._write_behind: WriteBehind | None = None
        if fsync:
            try:
                direct_fd = open_direct(path)
            except BaseException:
                self.abort()
                raise
            if direct_fd is not None:
                self._direct = DirectWriter(direct_fd, self._file.fileno())
            else:
                self._write_behind = WriteBehind(self._file.fileno())

    @property
    def direct_writer(self) -> DirectWriter | None:
        """The direct writer of this file, or None when it is written through the page cache."""
        return self._direct

    def tell(self) -> int:
        """Bytes written so far."""
        return self._size

    def write_piece(self, piece: memoryview, owner: Any) -> None:
        """Write all of ``piece`` (the GIL is released during each ``write``), directly or cut
        where a stretch of :class:`~ckptmgr.writeback.WriteBehind` ends."""
        self._hasher.add(piece, owner)
        if self._direct is not None:
            self._direct.write(piece)
            self._size += piece.nbytes
            return
        behind, written = self._write_behind, 0
        while written < piece.nbytes:
            end = piece.nbytes if behind is None else min(piece.nbytes, written + behind.room())
            count = self._file.write(piece[written:end])
            written += count
            if behind is not None:
                behind.wrote(count)
        self._size += written

    def close(self) -> tuple[int, int]:
        """Flush to disk (with ``fsync``), close, and return (size, CRC-32). On failure the
        hashing thread is ended too (as by :meth:`abort`)."""
        try:
            if self._direct is not None:
                self._direct.finish()
                self._direct.close()
            if self._fsync:
                os.fsync(self._file.fileno())
        except BaseException:
            self.abort()
            raise
        self._file.close()
        return self._size, self._hasher.result()

    def abort(self) -> None:
        """Close after a failure (the caller removes the step directory)."""
        if self._direct is not None:
            self._direct.close()
        self._file.close()
        try:
            self._hasher.result()
        except BaseException:  # pragma: no cover
            pass


class StreamSink:
    """A :class:`TensorSink` over a binary stream that hashes what it is given itself."""

    def __init__(self, stream: io.RawIOBase | Any) -> None:
        self._stream = stream
        self._size = 0

    def tell(self) -> int:
        """Bytes written so far."""
        return self._size

    def write_piece(self, piece: memoryview, owner: Any) -> None:
        """Write ``piece`` to the stream."""
        del owner  # the stream copies or writes the bytes before returning
        self._stream.write(piece)
        self._size += piece.nbytes


def write_tensor(sink: TensorSink, tensor: torch.Tensor) -> tuple[int, int]:
    """Append ``tensor``'s bytes to ``sink``; returns (offset, length). An efficient zero tensor
    (no memory) is written as the zeros it stands for."""
    data = contiguous_cpu(tensor)
    offset = sink.tell()
    nbytes = data.numel() * data.element_size()
    if nbytes:
        try:
            piece = byte_view(data)
        except NoMemoryError:  # (asked only here: ordinary tensors cost no check)
            if not data._is_zerotensor():
                raise
            data = torch.zeros(data.shape, dtype=data.dtype)
            piece = byte_view(data)
        sink.write_piece(piece, data)
    return offset, nbytes


SMALL_TENSOR_BYTES = 64 * 1024
"""Tensors of at most this many bytes are written in runs by :func:`write_tensors`."""
RUN_BYTES = 4 * 2**20
"""A run of small tensors is written once it holds this many bytes."""


def write_tensors(sink: TensorSink, tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """Append the bytes of each of ``tensors`` to ``sink`` in turn, as :func:`write_tensor`
    does; returns the (offset, length) of each.

    Consecutive small tensors (up to :data:`SMALL_TENSOR_BYTES`) that are plain CPU tensors
    (contiguous, with memory, no lazy conjugate or negative view) are joined into one buffer
    (a ``torch.cat`` per stretch of one dtype) and written at once, up to :data:`RUN_BYTES` at
    a time: the same bytes in the same places, for about a microsecond per tensor instead of a
    write (a rank of a sharded state writes a small shard of every DTensor; each on its own
    took about 20 µs)."""
    spans: list[tuple[int, int]] = []
    run: list[torch.Tensor] = []
    lengths: list[int] = []
    run_bytes = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if 0 < nbytes <= SMALL_TENSOR_BYTES and _plain_cpu(tensor):
            run.append(tensor)
            lengths.append(nbytes)
            run_bytes += nbytes
            if run_bytes >= RUN_BYTES:
                _write_run(sink, run, lengths, spans)
                run, lengths, run_bytes = [], [], 0
            continue
        if run:
            _write_run(sink, run, lengths, spans)
            run, lengths, run_bytes = [], [], 0
        spans.append(write_tensor(sink, tensor))
    if run:
        _write_run(sink, run, lengths, spans)
    return spans


def _plain_cpu(tensor: torch.Tensor) -> bool:
    return (
        tensor.is_cpu
        and tensor.is_contiguous()
        and not tensor.is_conj()
        and not tensor.is_neg()
        and not tensor._is_zerotensor()
    )


_DTYPE = operator.attrgetter("dtype")


def _write_run(
    sink: TensorSink, run: list[torch.Tensor], lengths: list[int], spans: list[tuple[int, int]]
) -> None:
    """Write the plain CPU tensors of ``run`` (of ``lengths`` bytes) back to back with one
    write; their spans are added to ``spans``."""
    if len(run) == 1:
        spans.append(write_tensor(sink, run[0]))
        return
    with torch.no_grad():  # (tensors that require grad)
        flat = [tensor if tensor.dim() == 1 else tensor.view(-1) for tensor in run]
        joined = [_joined(list(same)) for _, same in itertools.groupby(flat, key=_DTYPE)]
        data = joined[0] if len(joined) == 1 else torch.cat(joined)
    offset = sink.tell()
    sink.write_piece(byte_view(data), data)
    spans.extend(zip(itertools.accumulate(lengths, initial=offset), lengths, strict=False))


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 1-d ``tensors`` of one dtype back to back, as bytes."""
    try:
        return torch.cat(tensors).view(torch.uint8)
    except RuntimeError:  # (a dtype torch cannot concatenate): their bytes, viewed one by one
        return torch.cat([tensor.view(torch.uint8) for tensor in tensors])


class TensorSource(Protocol):
    """Where :func:`read_chunk` gets bytes: a data file being read."""

    def read_into(self, offset: int, piece: memoryview, owner: Any) -> None:
        """Fill ``piece`` with the file's bytes at ``offset`` (``CorruptCheckpointError`` when
        the file ends first)."""

    def finish(self) -> None:
        """Called once every chunk is read: checks the whole file when the source does."""


READ_HASH_BACKLOG_BYTES = 64 * 2**20
"""A file being read runs at most this far ahead of its hashing: a restore of a few tensors from
a large file reads the rest of it only to hash it, in buffers that would otherwise pile up."""


class VerifyingLocalFile:
    """A local data file read in increasing offsets, hashed while it is read; past the page
    cache where direct reads are on and the filesystem allows (:mod:`ckptmgr.direct_read`).

    ``finish`` reads what is left, then checks the size and CRC-32 against ``check`` (a callable
    ``(size, crc) -> None`` that raises ``CorruptCheckpointError``), so damage anywhere in the
    file is found even when only part of it was needed. ``hash_inline``: hash on the reading
    thread rather than beside it (for a reader that is a background thread itself and reads one
    piece: handing it to a hashing thread would only add a wait for the GIL).
    """

    def __init__(
        self, path: str | os.PathLike[str], name: str, check: Any, *, hash_inline: bool = False
    ) -> None:
        self._file = open_step_file(path, name, buffering=0)
        try:
            direct_fd = open_direct_read(path)
        except BaseException:
            self._file.close()
            raise
        self._reader = DirectReader(direct_fd, self._file.fileno())
        self._name = name
        self._check = check
        self._hasher: OrderedHasher | None = None
        if check is not None:  # unneeded bytes are read into new buffers just to be hashed
            self._hasher = OrderedHasher(
                max_backlog_bytes=READ_HASH_BACKLOG_BYTES, inline=hash_inline
            )
        self._position = 0

    def read_into(self, offset: int, piece: memoryview, owner: Any) -> None:
        """Read ``piece.nbytes`` bytes at ``offset`` into ``piece``."""
        if offset < self._position:  # already hashed: a plain positioned read
            self._read_exactly(piece, offset, hashed=False, owner=owner)
            return
        if offset > self._position:
            self._skip_to(offset)
        self._read_exactly(piece, offset, hashed=True, owner=owner)

    def finish(self) -> None:
        """Hash the rest of the file and check it."""
        self._skip_to(None)
        if self._hasher is not None:
            crc = self._hasher.result()
            self._hasher = None
            self._check(self._position, crc)

    @property
    def reader(self) -> DirectReader:
        """How the file is read: past the page cache where direct reads are on and the
        filesystem allows (:mod:`ckptmgr.direct_read`)."""
        return self._reader

    def close(self) -> None:
        """Close the file (and end the hashing thread)."""
        self._reader.close()
        self._file.close()
        if self._hasher is not None:
            try:
                self._hasher.result()
            except BaseException:  # pragma: no cover
                pass
            self._hasher = None

    def _read_exactly(self, piece: memoryview, offset: int, *, hashed: bool, owner: Any) -> None:
        done = self._reader.read(piece, offset)
        if done < piece.nbytes:
            raise CorruptCheckpointError(
                f"the file ends at byte {offset + done}, before the tensor bytes it should "
                f"hold at {offset}..{offset + piece.nbytes}",
                path=self._name,
            )
        if hashed:
            if self._hasher is not None:
                self._hasher.add(piece, owner)
            self._position = offset + piece.nbytes

    def _skip_to(self, offset: int | None) -> None:
        """Read (and hash) the bytes up to ``offset`` (None: to the end of the file)."""
        while offset is None or self._position < offset:
            want = HANDOFF_BYTES * 8 if offset is None else min(offset - self._position, 1 << 23)
            buffer = torch.empty(want, dtype=torch.uint8)
            count = self._reader.read(byte_view(buffer), self._position)
            if not count:
                if offset is None:
                    return
                raise CorruptCheckpointError(
                    f"the file ends at byte {self._position}, before byte {offset}",
                    path=self._name,
                )
            if self._hasher is not None:
                self._hasher.add(byte_view(buffer)[:count], buffer)
            self._position += count


def read_chunk(
    source: TensorSource,
    offset: int,
    length: int,
    dtype: torch.dtype,
    sizes: tuple[int, ...],
    into: torch.Tensor | None,
) -> torch.Tensor:
    """The stored chunk (``sizes``, ``dtype``) at ``offset``, read from ``source``.

    With ``into`` (a contiguous CPU tensor of exactly that shape and dtype) the bytes land in it
    directly and it is returned; otherwise a new tensor is returned.
    """
    _check_chunk_length(length, dtype, sizes)
    target = into if into is not None else torch.empty(sizes, dtype=dtype)
    if length:
        source.read_into(offset, byte_view(target), target)
    return target


DEVICE_READ_PIECE_BYTES = 8 * 2**20
"""A stored chunk bound for a CUDA tensor is read in pieces of at most this many bytes, each into
pinned host memory and copied to the device while the next piece is read."""


def streams_to_device(target: torch.Tensor, dtype: torch.dtype, sizes: tuple[int, ...]) -> bool:
    """True when a stored chunk of ``sizes``/``dtype`` can be read into ``target``, a CUDA
    tensor, piece by piece (:func:`read_chunk_to_device`)."""
    return target.device.type == "cuda" and _holds_chunk_bytes(target, dtype, sizes)


def read_chunk_to_device(
    source: TensorSource,
    offset: int,
    length: int,
    dtype: torch.dtype,
    sizes: tuple[int, ...],
    target: torch.Tensor,
    *,
    pin: bool,
) -> None:
    """Read the stored chunk (``sizes``, ``dtype``) at ``offset`` into ``target`` (contiguous,
    of exactly that shape and dtype, on any device) without a host copy of the whole chunk.

    Each piece of at most ``DEVICE_READ_PIECE_BYTES`` is read into a new host tensor (pinned
    with ``pin``, from torch's caching host allocator) and copied to its place in ``target``,
    non-blocking when pinned, on the current stream of ``target``'s device: the next piece is
    read while it is copied. The caller synchronises that stream before ``target`` is used.
    A piece's memory is reused only once its copy is done (the caching host allocator waits
    for the copy it recorded) and once ``source`` has hashed it (it holds the piece, as the
    piece's owner, until then). The pinned pieces stay in torch's host cache after the restore:
    per file read at once, at most the hashing backlog (``READ_HASH_BACKLOG_BYTES``) and one
    piece.
    """
    _check_chunk_length(length, dtype, sizes)
    flat = target.reshape(-1).view(torch.uint8)
    done = 0
    while done < length:
        count = min(DEVICE_READ_PIECE_BYTES, length - done)
        piece = torch.empty(count, dtype=torch.uint8, pin_memory=pin)
        source.read_into(offset + done, byte_view(piece), piece)
        flat[done : done + count].copy_(piece, non_blocking=pin)
        done += count


def _check_chunk_length(length: int, dtype: torch.dtype, sizes: tuple[int, ...]) -> None:
    """Raise ``CorruptCheckpointError`` unless a chunk of ``sizes``/``dtype`` is ``length``
    bytes."""
    element = dtype.itemsize
    numel = 1
    for size in sizes:
        numel *= size
    if numel * element != length:
        raise CorruptCheckpointError(
            f"a stored chunk of {list(sizes)} {dtype} should be {numel * element} bytes, the "
            f"metadata says {length}"
        )


def byte_extent(tensor: torch.Tensor) -> tuple[int, int]:
    """[low, high) byte range of ``tensor``'s storage that it can touch."""
    size = tensor.element_size()
    low = tensor.storage_offset() * size
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True) if n > 0)
    return low, low + (last + 1) * size


def overlapping(tensors: list[torch.Tensor]) -> set[int]:
    """Positions in ``tensors`` of the CPU tensors whose memory overlaps another's there."""
    spans = []
    for position, tensor in enumerate(tensors):
        if tensor.device.type == "cpu" and tensor.numel():
            base = tensor.untyped_storage().data_ptr()
            low, high = byte_extent(tensor)
            spans.append((base + low, base + high, position))
    spans.sort()
    found: set[int] = set()
    reach, reacher = -1, -1  # the furthest end so far, and whose it is
    for low, high, position in spans:
        if low < reach:  # overlaps the span that reaches furthest
            found.update((position, reacher))
        if high > reach:
            reach, reacher = high, position
    return found


def reads_directly_into(target: torch.Tensor, dtype: torch.dtype, sizes: tuple[int, ...]) -> bool:
    """True when a stored chunk of ``sizes``/``dtype`` can be read straight into ``target``."""
    return target.device.type == "cpu" and _holds_chunk_bytes(target, dtype, sizes)


def _holds_chunk_bytes(target: torch.Tensor, dtype: torch.dtype, sizes: tuple[int, ...]) -> bool:
    """True when ``target``'s memory, as laid out, is a stored chunk of ``sizes``/``dtype``
    byte for byte: that dtype and shape, contiguous, and no lazy conjugate or negative bit."""
    return (
        target.dtype == dtype
        and tuple(target.shape) == tuple(sizes)
        and target.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
    )
