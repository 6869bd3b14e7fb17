"""Reading a step's pack of small tensors while a restore still matches the state against it.

A restore of a state of many small tensors spends most of its time in Python and torch calls per
tensor before it reads anything: parsing the record, planning, matching each destination against
the pack (tens of milliseconds for 20,000 tensors). The pack's bytes, read and checked by DCP,
depend on none of that: its size follows from the record alone. :class:`PackReadAhead` reads them
into a buffer of their own on a thread (the file read and the checksum release the GIL) as soon as
the record is parsed, and the restore uses that buffer when it is the one its match asks for.

It is an optimisation only: a read ahead that fails, or that the restore does not use, is waited
for and dropped, and the restore reads the pack itself as it would have (so its errors are raised
where and as they always are). The pack is read ahead only where it has a data file (nearly) to
itself: every file read is checked whole, so a pack that DCP stored in one file with large
tensors would have that file read twice. Only a restore in one process reads ahead: under
torch.distributed, DCP's load is collective, and a second load beside the restore's own
collectives could not be ordered against them.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from typing import Any

import torch

from ckptmgr import dcp_io
from ckptmgr.packing import PACK_KEY
from ckptmgr.tensor_table import TensorTable


class PackReadAhead:
    """The pack of one step, read with ``reader`` (a DCP reader of the step) on a thread of its
    own into :attr:`buffer`."""

    def __init__(self, size: int, reader: Any, file_sizes: Mapping[str, int]) -> None:
        self.buffer = torch.empty(size, dtype=torch.uint8)
        """The pack's bytes, once :meth:`wait` returned True."""
        self.skipped = False
        """True when the pack shares its file with more bytes than its own (see :meth:`wait`)."""
        self._reader = reader
        self._file_sizes = file_sizes
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="ckptmgr-pack-read", daemon=True)
        self._thread.start()

    @classmethod
    def start(
        cls, table: TensorTable, reader: Any, file_sizes: Mapping[str, int]
    ) -> PackReadAhead | None:
        """Start reading the pack that ``table`` describes with ``reader``; ``file_sizes``: the
        step's files as its record lists them (path -> bytes). None when the table packs
        nothing, or its pack's size cannot be told or is over the largest data file's (a damaged
        table, whose damage the restore's own checks name)."""
        size = pack_size(table)
        data_files = [length for path, length in file_sizes.items() if path.endswith(".distcp")]
        if size is None or not data_files or size > max(data_files):
            return None
        try:
            return cls(size, reader, file_sizes)
        except (MemoryError, RuntimeError):  # (no memory for the buffer, no thread left)
            return None

    def _run(self) -> None:
        try:
            if not self._pack_has_its_file():
                self.skipped = self._failed = True
                return
            dcp_io.load_tensors({PACK_KEY: self.buffer}, self._reader, None)
        except BaseException:  # (DCP's CheckpointException is one) the restore reads the
            self._failed = True  # pack again and raises what it finds

    def _pack_has_its_file(self) -> bool:
        """True when the file that holds the pack holds at most as many other bytes as the
        pack's own. Every file read is checked whole (its CRC-32), so reading the pack out of a
        file of large tensors too (where DCP put them together) would read that file twice:
        once here, once for the tensors, which then waits for nothing else."""
        metadata = self._reader.read_metadata()
        places = [
            info
            for index, info in metadata.storage_data.items()
            if getattr(index, "fqn", None) == PACK_KEY
        ]
        if len(places) != 1:
            return False
        (place,) = places
        file_size = self._file_sizes.get(place.relative_path)
        return file_size is not None and file_size - place.length <= place.length

    def wait(self) -> bool:
        """Wait until the read has ended; True when it filled :attr:`buffer` (False when it
        failed or was skipped: the restore then reads the pack itself)."""
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
        dtype = getattr(torch, table.dtypes[position], None)
        if not isinstance(dtype, torch.dtype):
            return None
        sizes.append(math.prod(table.shapes[position]) * dtype.itemsize)
    return last + max(sizes)
