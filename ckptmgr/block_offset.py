"""Where in a disk block the bytes of a large tensor start, in memory and in a data file.

A direct read (``O_DIRECT``) puts a file's bytes straight into a tensor only from the block
boundaries on where the tensor's address and its file offset are the same distance past a
boundary (:data:`~ckptmgr.direct_io.DIRECT_ALIGN`); the rest goes through a bounce buffer and a
copy (:mod:`ckptmgr.direct_read`). The destinations of a restore in place are the training
process's own tensors, allocated by torch: with glibc's ``malloc`` (torch's default on Linux) a
large CPU tensor gets memory mapped for it, whose data starts 64 bytes past a page boundary (the
allocation's header comes first, and torch asks for 64-byte alignment); allocators that hand
out whole pages (jemalloc, tcmalloc) start it on the boundary.

So ckptmgr starts every tensor of more than 64 KiB (``tensor_bytes.SMALL_TENSOR_BYTES``) in a
data file at that same distance past a block boundary (:func:`padding_before`: zeros before it,
less than a block, and none between tensors of whole blocks), and places large tensors and the
pack likewise in its staging arenas (:func:`placed`) and the pinned pieces of a restore to a
GPU: a restore into torch's tensors reads nearly all of their bytes straight in (the partial
blocks at their ends aside), where tensors that started on a block boundary of the file had
every byte copied out of a bounce buffer, and a save writes them straight from the staged copies
as before (and a synchronous save from torch's own tensors, which went through a bounce buffer).
Measured on the benchmark machine (2 cores, ext4 on a virtual disk), cold restores of the MLP +
AdamW state (b) in a throwaway script took a median of 0.73 s into tensors whose addresses line
up with their file offsets against 0.89 s into torch's own (a raw read: 0.70 s).
"""

from __future__ import annotations

import functools

import torch

from ckptmgr.direct_io import DIRECT_ALIGN

_PROBE_BYTES = 64 * 2**20
"""Size of the allocation that finds the offset: above glibc's largest threshold for mapping an
allocation of its own (32 MiB), as the large tensors of a model are."""


@functools.cache
def large_tensor_block_offset() -> int:
    """How far past a :data:`~ckptmgr.direct_io.DIRECT_ALIGN` boundary the data of a large CPU
    tensor starts in this process (64 with glibc's ``malloc``, 0 with allocators of whole
    pages): found once, from one allocation that is never touched."""
    probe = torch.empty(_PROBE_BYTES, dtype=torch.uint8)
    return probe.data_ptr() % DIRECT_ALIGN


def padding_before(position: int) -> int:
    """Bytes to put at ``position`` of a data file so that what follows starts at
    :func:`large_tensor_block_offset` past a block boundary (0 to ``DIRECT_ALIGN - 1``)."""
    return (large_tensor_block_offset() - position) % DIRECT_ALIGN


def placed(offset: int) -> int:
    """The first offset from ``offset`` on (in an arena that starts on a block boundary) that
    is :func:`large_tensor_block_offset` past a block boundary."""
    return offset + padding_before(offset)
