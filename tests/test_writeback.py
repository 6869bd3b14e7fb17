"""Write-behind (ckptmgr.writeback): each written stretch of a data file is handed to the disk
while the rest is written, and the file's bytes stay exactly what was written."""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

from ckptmgr import direct_write, writeback
from ckptmgr.tensor_bytes import LocalDataFile, byte_view
from ckptmgr.writeback import WriteBehind, start_writeback

on_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range")


@on_linux
def test_the_kernel_takes_a_writeback_of_a_regular_file(tmp_path: Path) -> None:
    with open(tmp_path / "data.bin", "wb", buffering=0) as handle:
        handle.write(os.urandom(3 * 4096))
        assert start_writeback(handle.fileno(), 0, 3 * 4096)
        assert start_writeback(handle.fileno(), 4096, 100)  # any range, aligned or not


def test_a_refused_or_empty_writeback_is_false_and_raises_nothing(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"x" * 100)
        assert not start_writeback(write_end, 0, 100)  # a pipe: ESPIPE
    finally:
        os.close(read_end)
        os.close(write_end)
    with open(tmp_path / "empty.bin", "wb", buffering=0) as handle:
        assert not start_writeback(handle.fileno(), 0, 0)


def test_without_the_call_nothing_is_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writeback, "_SYNC_FILE_RANGE", None)  # as where the call is missing
    with open(tmp_path / "data.bin", "wb", buffering=0) as handle:
        handle.write(b"y" * 8192)
        assert not start_writeback(handle.fileno(), 0, 8192)
        behind = WriteBehind(handle.fileno(), 4096, offset=8192)
        handle.write(b"z" * 4096)
        behind.wrote(4096)
        assert behind.starts == 0 and behind.handed_over == 3 * 4096


@on_linux
@pytest.mark.parametrize("writes", [[1000] * 50, [5000, 1, 4095, 8192, 3, 20_000], [4096] * 7])
def test_each_full_stretch_is_handed_over_once_in_order(tmp_path: Path, writes: list[int]) -> None:
    stretch, offset = 4096, 123
    with open(tmp_path / "data.bin", "wb", buffering=0) as handle:
        handle.write(b"h" * offset)
        behind = WriteBehind(handle.fileno(), stretch, offset=offset)
        seen = offset
        for size in writes:
            while size:
                room = behind.room()
                assert 0 < room <= stretch
                count = min(size, room)
                handle.write(b"d" * count)
                behind.wrote(count)
                seen += count
                size -= count
                full = (seen - offset) // stretch
                assert behind.handed_over == offset + full * stretch
                assert behind.starts == full  # each one taken by the kernel
    assert os.path.getsize(tmp_path / "data.bin") == seen


def test_a_stretch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stretch must be positive"):
        WriteBehind(0, 0)


@pytest.mark.parametrize("fsync", [True, False])
def test_a_data_file_holds_exactly_its_pieces_across_stretch_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: bool
) -> None:
    monkeypatch.setattr(writeback, "WRITE_BEHIND_BYTES", 4096)
    # (write-behind is for a file written through the page cache: where direct writes are off
    # or refused, ckptmgr.direct_write)
    monkeypatch.setattr(direct_write, "DIRECT_WRITES", False)
    gen = torch.Generator().manual_seed(0)
    pieces = [
        torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
        for size in (10, 4086, 1, 9000, 4096, 0, 12_345, 3)
    ]
    path = tmp_path / "data.bin"
    sink = LocalDataFile(path, fsync=fsync)
    for piece in pieces:
        sink.write_piece(byte_view(piece), piece)
    behind = sink._write_behind
    size, crc = sink.close()
    expected = b"".join(piece.numpy().tobytes() for piece in pieces)
    assert path.read_bytes() == expected and size == len(expected)
    assert crc == zlib.crc32(expected)
    if not fsync:  # nothing to hand over early: the file is not made durable at all
        assert behind is None
        return
    assert behind is not None
    assert behind.handed_over == len(expected) // 4096 * 4096
    if sys.platform.startswith("linux"):
        assert behind.starts == len(expected) // 4096
