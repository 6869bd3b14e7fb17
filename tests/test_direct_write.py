"""Direct writes (ckptmgr.direct_write): a data file written past the page cache holds exactly
its pieces, whatever their sizes and addresses; where the filesystem refuses direct I/O the
file is written through the page cache instead, and holds the same bytes."""

from __future__ import annotations

import errno
import itertools
import os
import sys
import zlib
from pathlib import Path

import pytest
import torch
from _direct_io import refuse_o_direct_at_open, resident_pages, skip_without_o_direct

from ckptmgr import CheckpointManager, direct_write
from ckptmgr.direct_write import BOUNCE_BYTES, DIRECT_ALIGN, DirectWriter, open_direct
from ckptmgr.tensor_bytes import LocalDataFile, byte_view


@pytest.fixture(autouse=True)
def _direct_writes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Direct writes are on by default (CKPTMGR_DIRECT_WRITES=0 turns them off): on here."""
    monkeypatch.setattr(direct_write, "DIRECT_WRITES", True)


def _aligned_bytes(nbytes: int, seed: int = 0) -> torch.Tensor:
    """``nbytes`` random bytes starting on a DIRECT_ALIGN boundary."""
    raw = torch.randint(
        0,
        256,
        (nbytes + DIRECT_ALIGN,),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(seed),
    )
    start = -raw.data_ptr() % DIRECT_ALIGN
    return raw[start : start + nbytes]


def _write(path: Path, pieces: list[memoryview], owner: object) -> tuple[LocalDataFile, int, int]:
    sink = LocalDataFile(path, fsync=True)
    for piece in pieces:
        sink.write_piece(piece, owner)
    size, crc = sink.close()
    return sink, size, crc


def _check_file(path: Path, pieces: list[memoryview], size: int, crc: int) -> None:
    expected = b"".join(bytes(piece) for piece in pieces)
    data = path.read_bytes()
    assert len(data) == size == len(expected)
    assert data == expected
    assert crc == zlib.crc32(expected)


def test_pieces_that_line_up_are_written_from_their_own_memory(tmp_path: Path) -> None:
    path = tmp_path / "data.distcp"
    path.touch()
    skip_without_o_direct(path.parent)
    source = _aligned_bytes(5 * 2**20 + 3 * DIRECT_ALIGN + 100)
    whole = byte_view(source)
    # Whole blocks, back to back from a block boundary, then a tail that fills no block.
    cuts = [0, DIRECT_ALIGN, 3 * 2**20, 5 * 2**20 + 3 * DIRECT_ALIGN, whole.nbytes]
    pieces = [whole[a:b] for a, b in itertools.pairwise(cuts)]
    sink, size, crc = _write(path, pieces, source)
    _check_file(path, pieces, size, crc)
    writer = sink.direct_writer
    assert writer is not None and writer.direct
    assert writer.copied_bytes == 100  # only the tail went through the bounce buffer...
    assert writer.buffered_bytes == 100  # ...and the page cache
    assert writer.direct_bytes == whole.nbytes - 100


@pytest.mark.parametrize(
    "sizes",
    [
        [1, 4095, 4096, 4097, 3 * 4096 + 5, 17],
        [BOUNCE_BYTES + 12_345, 3, BOUNCE_BYTES * 2 + 4096, 77],
        [100] * 300,
        [4096 * 3] * 5,
    ],
)
@pytest.mark.parametrize("skew", [0, 64, 1000])
def test_any_sizes_and_addresses_give_exactly_the_pieces(
    tmp_path: Path, sizes: list[int], skew: int
) -> None:
    # skew: the pieces start that far past a block boundary in memory (0: only the file offset
    # decides which bytes line up).
    path = tmp_path / "data.distcp"
    source = _aligned_bytes(sum(sizes) + skew, seed=len(sizes) + skew)
    whole = byte_view(source)[skew:]
    pieces, start = [], 0
    for size in sizes:
        pieces.append(whole[start : start + size])
        start += size
    sink, size, crc = _write(path, pieces, source)
    _check_file(path, pieces, size, crc)
    writer = sink.direct_writer
    if writer is not None:
        assert writer.direct_bytes + writer.buffered_bytes == size
        assert writer.buffered_bytes < DIRECT_ALIGN  # only the end of the file
        assert writer.direct_bytes % DIRECT_ALIGN == 0


def test_pieces_that_never_line_up_go_through_the_bounce_buffer(tmp_path: Path) -> None:
    path = tmp_path / "data.distcp"
    path.touch()
    skip_without_o_direct(path.parent)
    source = _aligned_bytes(3 * BOUNCE_BYTES + 64)
    whole = byte_view(source)
    pieces = [whole[0:100], whole[164 : 164 + 3 * BOUNCE_BYTES - 100]]  # offsets 100, addr 164
    sink, size, crc = _write(path, pieces, source)
    _check_file(path, pieces, size, crc)
    writer = sink.direct_writer
    assert writer is not None
    assert writer.copied_bytes == size
    assert writer.direct_bytes == size - size % DIRECT_ALIGN


def test_read_only_pieces_are_copied(tmp_path: Path) -> None:
    path = tmp_path / "data.distcp"
    blob = os.urandom(3 * DIRECT_ALIGN + 5)
    pieces = [memoryview(blob), memoryview(blob)[7:]]
    _, size, crc = _write(path, pieces, blob)
    _check_file(path, pieces, size, crc)


def test_a_filesystem_that_refuses_o_direct_is_written_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_o_direct_at_open(monkeypatch)  # (fault injection)
    path = tmp_path / "data.distcp"
    source = _aligned_bytes(2 * 2**20 + 3)
    pieces = [byte_view(source)]
    sink, size, crc = _write(path, pieces, source)
    _check_file(path, pieces, size, crc)
    assert sink.direct_writer is None


def test_direct_writes_can_be_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(direct_write, "DIRECT_WRITES", False)
    path = tmp_path / "data.distcp"
    source = _aligned_bytes(2 * 2**20)
    sink, size, crc = _write(path, [byte_view(source)], source)
    assert sink.direct_writer is None
    _check_file(path, [byte_view(source)], size, crc)


@pytest.mark.parametrize("refused_after", [0, 1, 3])
def test_a_direct_write_refused_midway_falls_back_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused_after: int
) -> None:
    # Fault injection: the filesystem took the O_DIRECT open but refuses direct writes after
    # ``refused_after`` of them (as some FUSE filesystems do from the first).
    path = tmp_path / "data.distcp"
    path.touch()
    skip_without_o_direct(path.parent)
    direct_fds: set[int] = set()
    real_open_direct, real_pwrite = direct_write.open_direct, os.pwrite
    taken = [0]

    def tracking_open_direct(target: str | os.PathLike[str]) -> int | None:
        fd = real_open_direct(target)
        if fd is not None:
            direct_fds.add(fd)
        return fd

    def refusing_pwrite(fd: int, data: memoryview, offset: int) -> int:
        if fd in direct_fds:
            if taken[0] >= refused_after:
                raise OSError(errno.EINVAL, "Invalid argument")
            taken[0] += 1
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr("ckptmgr.tensor_bytes.open_direct", tracking_open_direct)
    monkeypatch.setattr(direct_write.os, "pwrite", refusing_pwrite)
    source = _aligned_bytes(3 * BOUNCE_BYTES + 5000)
    whole = byte_view(source)
    pieces = [whole[:5000], whole[5000 : BOUNCE_BYTES + 9000], whole[BOUNCE_BYTES + 9000 :]]
    sink, size, crc = _write(path, pieces, source)
    _check_file(path, pieces, size, crc)
    writer = sink.direct_writer
    assert writer is not None and not writer.direct
    assert taken[0] == refused_after
    assert writer.direct_bytes + writer.buffered_bytes == size


def test_a_bounce_buffer_is_reused_by_the_next_file(tmp_path: Path) -> None:
    path = tmp_path / "a.distcp"
    path.touch()
    fd = open_direct(path)
    if fd is None:
        pytest.skip("no O_DIRECT here")
    with open(path, "wb", buffering=0) as handle:
        first = DirectWriter(fd, handle.fileno())
        bounce = first._bounce
        first.finish()
        first.close()
    fd = open_direct(path)
    assert fd is not None
    with open(path, "wb", buffering=0) as handle:
        second = DirectWriter(fd, handle.fileno())
        assert second._bounce is bounce
        second.close()


@pytest.mark.parametrize("use_async", [False, True], ids=["save", "save_async"])
def test_a_saved_state_is_written_from_its_staged_memory_without_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, use_async: bool
) -> None:
    # The tensors of whole blocks come first in a data file (dcp_io._balanced) and their staged
    # copies start on page boundaries (staging.PAGE_ALIGNED_BYTES): the disk takes them from
    # there. Only the pack of small tensors and the tensor of an odd size are copied. (A
    # synchronous save writes from the state's own tensors, wherever the allocator put them:
    # through the bounce buffer, still directly.)
    skip_without_o_direct(tmp_path)
    closed: list[DirectWriter] = []
    real_close = DirectWriter.close

    def recording_close(self: DirectWriter) -> None:
        closed.append(self)
        real_close(self)

    monkeypatch.setattr(DirectWriter, "close", recording_close)
    generator = torch.Generator().manual_seed(5)
    state = {
        "model": {
            "small": torch.randn(1001, generator=generator),  # packed
            "odd": torch.randn(70_003, generator=generator),
            "w1": torch.randn(512, 1024, generator=generator),
            "w2": torch.randn(256, 1024, generator=generator),
            "bias": torch.randn(4096, generator=generator),
        }
    }
    whole_blocks = (512 + 256) * 1024 * 4 + 4096 * 4
    with CheckpointManager(tmp_path / "ckpts", save_interval=1) as manager:
        if use_async:
            assert manager.save_async(1, state)
            manager.join()
        else:
            assert manager.save(1, state)
        writers = list(closed)
        restored = {
            "model": {key: torch.zeros_like(value) for key, value in state["model"].items()}
        }
        manager.restore(1, restored)
    for key, value in state["model"].items():
        assert torch.equal(restored["model"][key].view(torch.uint8), value.view(torch.uint8)), key
    assert writers and all(writer.direct for writer in writers)
    direct = sum(writer.direct_bytes for writer in writers)
    copied = sum(writer.copied_bytes for writer in writers)
    assert direct >= whole_blocks
    if use_async:
        assert copied <= 70_003 * 4 + 1001 * 4 + 4096  # the odd tensor, the pack, the last block


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="O_DIRECT and mincore: Linux")
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "page-cache"])
def test_the_checkpoint_daemon_writes_directly_unless_turned_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    # Process mode: the daemon writes the data files. Written directly, they leave (almost)
    # nothing in the page cache; with CKPTMGR_DIRECT_WRITES=0 (inherited by the daemon), the
    # written pages stay cached after the fsync.
    skip_without_o_direct(tmp_path)
    monkeypatch.setenv(direct_write.DIRECT_WRITES_VARIABLE, "1" if direct else "0")
    state = {"w": torch.randn(2048, 1024, generator=torch.Generator().manual_seed(1))}
    with CheckpointManager(tmp_path / "ckpts", save_interval=1, async_mode="process") as manager:
        assert manager.save_async(1, state)
        manager.join()
    files = sorted((tmp_path / "ckpts").rglob("*.distcp"))
    assert files
    resident, total = resident_pages(files)
    assert total >= 2048
    if direct:
        assert resident <= len(files), f"{resident} of {total} pages in the page cache"
    else:
        assert resident >= total // 2, f"only {resident} of {total} pages in the page cache"
