"""Reading a step's pack of small tensors while a restore still matches the state against it.

A restore of a state of many small tensors spends most of its time in Python and torch calls per
tensor before it reads anything: parsing the record, planning, matching each destination against
the pack (tens of milliseconds for 20,000 tensors). The pack's bytes depend on none of that: its
size follows from the record alone. :class:`PackReadAhead` reads them into a buffer of their own
on a thread as soon as the record is parsed, and the restore uses that buffer when it is the one
its match asks for.

The thread finds the pack's place in DCP's metadata and reads its bytes through the reader's own
file system with :func:`ckptmgr.tensor_bytes.read_chunk`, the file checked whole against the
record (size and CRC-32) as the reader's ``read_data`` checks it, rather than through a whole DCP
load. While the restore's thread runs Python, a thread that has given up the GIL (for a file
operation, or the checksum) waits up to the interpreter's switch interval, 5 ms, to get it back;
a DCP load makes many more such calls than this read, and plans in Python besides (a pack of
20 MB took 35 ms to load alone, and 73 ms beside a restore).

Where the pack's place is known before the thread starts (a local disk), the thread reads it in
pieces of ``READ_PIECE_BYTES`` and says how far it got (:meth:`PackReadAhead.filled_to`): the
restore copies the tensors of the pieces read while the rest is read
(:func:`ckptmgr.pack_load.split_for_load`'s unpack with ``filled_to``), and only then waits for
the file's check. On the 2-core benchmark machine, a restore of 20,000 tensors of 1 KiB took a
median of 86 ms against 95 ms (four alternated runs of nine restores each).

It is an optimisation only: a read ahead that fails, or that the restore does not use, is waited
for and dropped, and the restore reads the pack itself as it would have (so its errors are raised
where and as they always are). The pack is read ahead only where it has a data file (nearly) to
itself: every file read is checked whole, so a pack that DCP stored in one file with large
tensors would have that file read twice. Only a restore in one process, of raw tensor bytes
(record format 2 and later), reads ahead: under torch.distributed, DCP's load is collective, and
a second load beside the restore's own collectives could not be ordered against them.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata

from ckptmgr import tensor_bytes
from ckptmgr.dtypes import dtype_named
from ckptmgr.packing import PACK_KEY
from ckptmgr.tensor_table import TensorTable

READ_PIECE_BYTES = 2 * 2**20
"""The pack is read in pieces of this many bytes, so that a restore can copy tensors out of
the first ones while the rest is read (:meth:`PackReadAhead.filled_to`)."""


class PackReadAhead:
    """The pack of one step, read through ``reader`` (a DCP reader of the step's raw tensor
    bytes) on a thread of its own into :attr:`buffer`."""

    def __init__(
        self, size: int, reader: Any, file_sizes: Mapping[str, int], *, local: bool = False
    ) -> None:
        """``local``: ``reader`` reads a local disk, and DCP's metadata is read here, before the
        thread starts (a small local read, whose file operations would each wait for the GIL
        on the thread); on a remote store the thread downloads it."""
        self.buffer = torch.empty(size, dtype=torch.uint8)
        """The pack's bytes, once :meth:`wait` returned True."""
        self.skipped = False
        """True when the pack shares its file with more bytes than its own (see :meth:`wait`)."""
        self._reader = reader
        self._file_sizes = file_sizes
        self._failed = False
        self._progress = threading.Condition()
        self._filled = 0  # bytes of the buffer read so far (not yet checked)
        self._ended = False  # the read ended: filled, failed or skipped
        self._thread: threading.Thread | None = None
        self.placed = False
        """True when the pack's place in its file was found before the read started (on a local
        disk): the read is then the pack's own, and can be followed (:meth:`filled_to`)."""
        place = None
        if local:
            try:
                place = self._place_of_pack()
            except Exception:  # (damaged metadata) the restore's own load raises what it finds
                self._failed = self._ended = True
                return
            if place is None:
                self.skipped = self._failed = True
                self._ended = True
                return
        self.placed = place is not None
        self._thread = threading.Thread(
            target=self._run, args=(place,), name="ckptmgr-pack-read", daemon=True
        )
        self._thread.start()

    @classmethod
    def start(
        cls, table: TensorTable, reader: Any, file_sizes: Mapping[str, int], *, local: bool = False
    ) -> PackReadAhead | None:
        """Start reading the pack that ``table`` describes with ``reader``; ``file_sizes``: the
        step's files as its record lists them (path -> bytes); ``local`` as for the
        constructor. None when the table packs nothing, or its pack's size cannot be told or is
        over the largest data file's (a damaged table, whose damage the restore's own checks
        name), or the reader's files do not hold raw tensor bytes."""
        size = pack_size(table)
        data_files = [length for path, length in file_sizes.items() if path.endswith(".distcp")]
        if size is None or not data_files or size > max(data_files):
            return None
        if not getattr(reader, "raw", False):
            return None
        try:
            return cls(size, reader, file_sizes, local=local)
        except (MemoryError, RuntimeError):  # (no memory for the buffer, no thread left)
            return None

    def _run(self, place: Any) -> None:
        """Read the pack from ``place`` (its place in DCP's metadata; None: look it up first),
        in pieces of ``READ_PIECE_BYTES``, telling :meth:`filled_to` after each."""
        try:
            place = place or self._place_of_pack()
            if place is None:
                self.skipped = self._failed = True
                return
            fs, size = self._reader.fs, self.buffer.numel()
            if place.length != size:  # (as read_chunk would find: the restore's load raises)
                self._failed = True
                return
            path = fs.concat_path(self._reader.path, place.relative_path)
            with fs.open_data_source(path, hash_inline=True) as source:
                done = 0
                while done < size:
                    count = min(READ_PIECE_BYTES, size - done)
                    piece = self.buffer[done : done + count]
                    tensor_bytes.read_chunk(
                        source, place.offset + done, count, torch.uint8, (count,), piece
                    )
                    done += count
                    with self._progress:
                        self._filled = done
                        self._progress.notify_all()
                source.finish()
        except BaseException:  # the restore reads the pack again and raises what it finds
            self._failed = True
        finally:
            with self._progress:
                self._ended = True
                self._progress.notify_all()

    def _place_of_pack(self) -> Any:
        """Where DCP stored the pack (its ``relative_path``, ``offset`` and ``length``), when
        it stored it whole, as one 1-d chunk of bytes of the size the record gives, in a file
        that holds at most as many other bytes as the pack's own; else None. Every file read
        is checked whole (its CRC-32), so reading the pack out of a file of large tensors too
        (where DCP put them together) would read that file twice: once here, once for the
        tensors, which then waits for nothing else."""
        metadata = self._reader.read_metadata()
        stored = metadata.state_dict_metadata.get(PACK_KEY)
        size = self.buffer.numel()
        if not (
            isinstance(stored, dcp_metadata.TensorStorageMetadata)
            and stored.properties.dtype is torch.uint8
            and tuple(stored.size) == (size,)
            and len(stored.chunks) == 1
            and tuple(stored.chunks[0].offsets) == (0,)
        ):
            return None
        places = [
            info
            for index, info in metadata.storage_data.items()
            if getattr(index, "fqn", None) == PACK_KEY
        ]
        if len(places) != 1:
            return None
        (place,) = places
        file_size = self._file_sizes.get(place.relative_path)
        if file_size is None or file_size - place.length > place.length:
            return None
        return place

    def filled_to(self, end: int) -> bool:
        """Wait until :attr:`buffer` holds the pack's bytes up to ``end`` (exclusive); False
        when the read ended short of it (failed or skipped). Bytes read are not yet checked:
        only :meth:`wait` tells whether the whole file matched its record."""
        with self._progress:
            while self._filled < end and not self._ended:
                self._progress.wait()
            return self._filled >= end and not (self._ended and self._failed)

    def wait(self) -> bool:
        """Wait until the read has ended; True when it filled :attr:`buffer` and the file
        matched its record (False when it failed or was skipped: the restore then reads the
        pack itself)."""
        if self._thread is not None:
            self._thread.join()
        return not self._failed


def pack_size(table: TensorTable) -> int | None:
    """Bytes of the pack that ``table`` describes: the end of its last tensor (the pack holds
    its tensors back to back); None when nothing is packed or a dtype is not a torch dtype."""
    offsets = table.pack_offsets
    packed = [offset for offset in offsets if offset is not None]
    if not packed:
        return None
    last = max(packed)
    positions = [offsets.index(last)]
    if offsets.count(last) > 1:  # a tensor of no bytes where the last one starts, say
        positions = [i for i, offset in enumerate(offsets) if offset == last]
    sizes = []
    for position in positions:
        dtype = dtype_named(table.dtypes[position])
        if dtype is None:
            return None
        sizes.append(math.prod(table.shapes[position]) * dtype.itemsize)
    return last + max(sizes)
