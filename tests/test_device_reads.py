"""Reading a stored chunk into a device tensor in pieces (``read_chunk_to_device``).

A restore into CUDA tensors reads each whole chunk in pieces of pinned host memory and copies
each piece to the device while the next is read, instead of reading the whole chunk into new
pageable host memory first. On a machine without a GPU these tests run that path with CPU
destinations (unpinned pieces, blocking copies): the same reads, hashing and checks.
tests/test_cuda.py covers CUDA destinations.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

from ckptmgr import CheckpointManager, CorruptCheckpointError, tensor_bytes


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=gen).to(dtype)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


class _RecordingSource:
    """A TensorSource over bytes in memory that notes each read and holds each piece's owner
    until ``finish`` (as a source that hashes on another thread does)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.reads: list[tuple[int, int]] = []
        self.owners: list[object] = []
        self.crc = 0

    def read_into(self, offset: int, piece: memoryview, owner: object) -> None:
        piece[:] = self.data[offset : offset + piece.nbytes]
        self.reads.append((offset, piece.nbytes))
        self.owners.append(owner)
        self.crc = zlib.crc32(piece, self.crc)

    def finish(self) -> None:
        self.owners.clear()


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [
        (torch.float32, (1000, 7)),
        (torch.bfloat16, (3001,)),
        (torch.complex64, (257,)),
        (torch.bool, (4099,)),
        (torch.int64, ()),
        (torch.float32, (0, 5)),
    ],
)
def test_a_chunk_is_read_in_pieces_into_its_destination_bit_exact(
    dtype: torch.dtype, shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    piece_bytes = 1000  # (not a multiple of any item size: pieces split items)
    monkeypatch.setattr(tensor_bytes, "DEVICE_READ_PIECE_BYTES", piece_bytes)
    value = _random(dtype, shape, 1)
    stored = bytes(_bits(value).numpy()) if value.numel() else b""
    prefix = b"\x07" * 13  # the chunk lies at an offset in its file
    source = _RecordingSource(prefix + stored)
    target = torch.zeros(shape, dtype=dtype)
    if target.numel():
        target.reshape(-1).view(torch.uint8).fill_(0x5A)  # (any byte left unread shows)
    tensor_bytes.read_chunk_to_device(
        source, len(prefix), len(stored), dtype, tuple(shape), target, pin=False
    )
    assert torch.equal(_bits(target), _bits(value))
    expected_reads = [
        (len(prefix) + start, min(piece_bytes, len(stored) - start))
        for start in range(0, len(stored), piece_bytes)
    ]
    assert source.reads == expected_reads  # in order, each piece at most piece_bytes
    # each piece is its own tensor, handed to the source as the piece's owner
    assert all(isinstance(owner, torch.Tensor) for owner in source.owners)
    assert len({id(owner) for owner in source.owners}) == len(source.owners)
    assert source.crc == zlib.crc32(stored)


def test_a_chunk_whose_length_does_not_fit_its_shape_is_corruption() -> None:
    source = _RecordingSource(b"\x00" * 64)
    target = torch.zeros(4)
    with pytest.raises(CorruptCheckpointError, match="should be 16 bytes"):
        tensor_bytes.read_chunk_to_device(source, 0, 20, torch.float32, (4,), target, pin=False)
    assert source.reads == []


def test_only_whole_plain_cuda_destinations_stream_to_the_device() -> None:
    cpu = torch.zeros(4, 3)
    assert not tensor_bytes.streams_to_device(cpu, torch.float32, (4, 3))  # read directly
    meta = torch.empty(4, 3, device="meta")
    assert not tensor_bytes.streams_to_device(meta, torch.float32, (4, 3))


@pytest.fixture
def streamed_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The restore takes the device path for every whole CPU destination (instead of reading
    into it directly), in pieces of 10,000 bytes; returns the shapes it was taken for."""
    taken: list[tuple[int, ...]] = []
    real = tensor_bytes.read_chunk_to_device

    def noted(*args: object, **kwargs: object) -> None:
        taken.append(tuple(args[4]))  # type: ignore[arg-type]
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tensor_bytes, "reads_directly_into", lambda *args: False)
    monkeypatch.setattr(
        tensor_bytes,
        "streams_to_device",
        lambda target, dtype, sizes: (
            target.dtype == dtype and tuple(target.shape) == sizes and target.is_contiguous()
        ),
    )
    monkeypatch.setattr(tensor_bytes, "read_chunk_to_device", noted)
    monkeypatch.setattr(tensor_bytes, "DEVICE_READ_PIECE_BYTES", 10_000)
    return taken


def _state() -> dict[str, torch.Tensor]:
    return {
        "big": _random(torch.float32, (300, 101), 2),  # 121,200 bytes: 13 pieces
        "half": _random(torch.bfloat16, (70_001,), 3),
        "ints": _random(torch.int64, (9000,), 4),  # 72,000 bytes: stored alone
        "small": _random(torch.float32, (16,), 5),  # packed: read with the pack
    }


@pytest.mark.parametrize("threads", [1, 3])
def test_a_restore_through_the_device_path_is_bit_exact(
    tmp_path: Path, threads: int, streamed_on_cpu: list[tuple[int, ...]]
) -> None:
    state = _state()
    with CheckpointManager(tmp_path, 1, num_of_threads=threads) as manager:
        assert manager.save(1, state)
        target = {key: torch.full_like(value, 9) for key, value in state.items()}
        manager.restore(1, target)
    for key, value in state.items():
        assert torch.equal(_bits(target[key]), _bits(value)), key
    assert {(300, 101), (70_001,), (9000,)} <= set(streamed_on_cpu)


def test_a_flipped_byte_read_through_the_device_path_is_corruption(
    tmp_path: Path, streamed_on_cpu: list[tuple[int, ...]]
) -> None:
    """Pieces are hashed as they are read: a damaged data file fails the restore, naming it."""
    state = _state()
    with CheckpointManager(tmp_path, 1) as manager:
        assert manager.save(1, state)
        files = sorted(tmp_path.rglob("*.distcp"), key=lambda path: path.stat().st_size)
        damaged = files[-1]
        data = bytearray(damaged.read_bytes())
        data[len(data) // 2] ^= 0x01
        damaged.write_bytes(bytes(data))
        target = {key: torch.zeros_like(value) for key, value in state.items()}
        with pytest.raises(CorruptCheckpointError) as caught:
            manager.restore(1, target)
    assert caught.value.path == damaged.name
    assert streamed_on_cpu  # (the damage was found on the device path)
