"""Direct reads (ckptmgr.direct_read): a data file read past the page cache gives exactly its
bytes at any offset, into memory at any address; where the filesystem refuses direct I/O, or a
read fails, nothing is read wrong and the error is the file's."""

from __future__ import annotations

import errno
import itertools
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from _direct_io import (
    drop_from_page_cache,
    refuse_o_direct_at_open,
    resident_pages,
    skip_without_o_direct,
)

from ckptmgr import CheckpointManager, CorruptCheckpointError, direct_read
from ckptmgr.direct_io import BOUNCE_BYTES, DIRECT_ALIGN
from ckptmgr.direct_read import READ_AHEAD_WINDOWS, DirectReader, open_direct_read
from ckptmgr.tensor_bytes import VerifyingLocalFile, byte_view

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="O_DIRECT and mincore: Linux"
)


@pytest.fixture(autouse=True)
def _direct_reads_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Direct reads are on by default, but CKPTMGR_DIRECT_READS=0 may be set: on here."""
    monkeypatch.setattr(direct_read, "DIRECT_READS", True)


def _file(tmp_path: Path, nbytes: int, seed: int = 0) -> tuple[Path, bytes]:
    data = torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )
    blob = bytes(data.numpy())
    path = tmp_path / "data.distcp"
    path.write_bytes(blob)
    drop_from_page_cache(path)
    return path, blob


def _reader(path: Path) -> tuple[DirectReader, int]:
    """A reader of ``path`` (skipping the test where its filesystem takes no O_DIRECT), and the
    buffered descriptor to close after it."""
    buffered = os.open(path, os.O_RDONLY)
    direct_fd = open_direct_read(path)
    if direct_fd is None:
        os.close(buffered)
        pytest.skip(f"{path.parent} takes no O_DIRECT")
    return DirectReader(direct_fd, buffered), buffered


def _buffer(nbytes: int, skew: int) -> torch.Tensor:
    """``nbytes`` of memory that start ``skew`` bytes past a DIRECT_ALIGN boundary."""
    raw = torch.zeros(nbytes + 2 * DIRECT_ALIGN, dtype=torch.uint8)
    start = -raw.data_ptr() % DIRECT_ALIGN + skew
    return raw[start : start + nbytes]


SIZE = 3 * BOUNCE_BYTES + 5 * DIRECT_ALIGN + 123  # ends inside a block


@linux_only
@pytest.mark.parametrize("skew", [0, 64, 4095])
@pytest.mark.parametrize(
    "reads",
    [
        [(0, SIZE)],  # the whole file in one read
        [(0, 100), (100, BOUNCE_BYTES), (BOUNCE_BYTES + 100, SIZE - BOUNCE_BYTES - 100)],
        [(5 * DIRECT_ALIGN, 2 * BOUNCE_BYTES), (7, 3), (SIZE - 200, 200)],  # back and forth
        [(BOUNCE_BYTES - 10, 20), (2 * BOUNCE_BYTES + 1, BOUNCE_BYTES)],  # across windows
    ],
    ids=["whole", "in-order", "back-and-forth", "across-windows"],
)
def test_reads_at_any_offset_into_any_address_give_the_file_bytes(
    tmp_path: Path, skew: int, reads: list[tuple[int, int]]
) -> None:
    path, blob = _file(tmp_path, SIZE)
    reader, buffered = _reader(path)
    try:
        for offset, length in reads:
            target = _buffer(length, skew)
            assert reader.read(byte_view(target), offset) == length
            assert bytes(target.numpy()) == blob[offset : offset + length], (offset, length)
        assert reader.direct
        assert reader.buffered_bytes == 0
        if skew == 0 and reads[0] == (0, SIZE):  # lined up: straight into the target
            assert reader.direct_bytes == SIZE - SIZE % DIRECT_ALIGN
            assert reader.copied_bytes == SIZE % DIRECT_ALIGN
        if skew == 64:  # never lines up: every byte through a window
            assert reader.direct_bytes == 0
            assert reader.copied_bytes == sum(length for _, length in reads)
    finally:
        reader.close()
        os.close(buffered)


BOUND_S = 60.0


def _hold_helper_reads(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Barrier, list[int]]:
    """Fault injection: the first READ_AHEAD_WINDOWS reads on the reader's helper threads wait
    until all of them have started (the barrier breaks after BOUND_S where fewer are ever in
    flight at once). Returns the barrier and the offsets the helpers read, in order."""
    all_started = threading.Barrier(READ_AHEAD_WINDOWS, timeout=BOUND_S)
    offsets: list[int] = []
    real_pread_all = direct_read._pread_all

    def pread_all(fd: int, data: memoryview, offset: int) -> int:
        if threading.current_thread().name.startswith("ckptmgr-read-ahead"):
            offsets.append(offset)
            if len(offsets) <= READ_AHEAD_WINDOWS:
                all_started.wait()  # (BrokenBarrierError, where fewer are in flight)
        return real_pread_all(fd, data, offset)

    monkeypatch.setattr(direct_read, "_pread_all", pread_all)
    return all_started, offsets


@linux_only
def test_several_windows_are_read_ahead_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One direct read at a time got about 0.6 GB/s from the benchmark machine's disk: a file
    read in order has READ_AHEAD_WINDOWS windows in flight at once (each read ahead waits here
    until all of them have started), and any order of reads still gives the file's bytes."""
    windows = READ_AHEAD_WINDOWS + 4
    size = windows * BOUNCE_BYTES + 3 * DIRECT_ALIGN + 17
    path, blob = _file(tmp_path, size)
    reader, buffered = _reader(path)
    all_started, ahead = _hold_helper_reads(monkeypatch)
    try:
        reads = [(0, 100)]  # the first window here, the next READ_AHEAD_WINDOWS ahead
        reads += [(100 + k * 3_000_000, 3_000_000) for k in range(9)]  # in order, in steps
        reads += [((windows - 1) * BOUNCE_BYTES + 5, 50), (7, 10)]  # far ahead, then back
        reads += [(size - 1000, 1000)]
        for offset, length in reads:
            target = _buffer(length, 64)
            assert reader.read(byte_view(target), offset) == length
            assert bytes(target.numpy()) == blob[offset : offset + length], (offset, length)
        assert not all_started.broken
        assert ahead[:READ_AHEAD_WINDOWS] == [
            k * BOUNCE_BYTES for k in range(1, READ_AHEAD_WINDOWS + 1)
        ]
        assert all(offset < size for offset in ahead), "read ahead past the end of the file"
        assert reader.buffered_bytes == 0
    finally:
        reader.close()
        os.close(buffered)


@linux_only
@pytest.mark.parametrize("ends_early", [False, True], ids=["whole-file", "file-ends-in-part-2"])
def test_a_large_read_into_aligned_memory_is_split_into_reads_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ends_early: bool
) -> None:
    """Pinned pieces of a GPU restore line up with the file: up to DIRECT_READ_BYTES are read
    straight into them in 1 + READ_AHEAD_WINDOWS parts at once (the helpers' parts wait here
    until all have started), and a file that ends inside a part gives what there is."""
    parts = 1 + READ_AHEAD_WINDOWS
    size = BOUNCE_BYTES + 5 * DIRECT_ALIGN + 9 if ends_early else parts * 2 * BOUNCE_BYTES + 17
    path, blob = _file(tmp_path, size)
    reader, buffered = _reader(path)
    all_started, helper_reads = _hold_helper_reads(monkeypatch)
    try:
        length = size if not ends_early else parts * 2 * BOUNCE_BYTES
        target = _buffer(length, 0)
        assert reader.read(byte_view(target), 0) == size
        assert bytes(target.numpy()[:size]) == blob
        assert sorted(helper_reads)[: parts - 1] == [k * 2 * BOUNCE_BYTES for k in range(1, parts)]
        assert not all_started.broken
        tail = 0 if ends_early else size % DIRECT_ALIGN  # (the last block, whole in target)
        assert (reader.direct_bytes, reader.copied_bytes) == (size - tail, tail)
    finally:
        reader.close()
        os.close(buffered)


@linux_only
def test_a_read_past_the_end_of_the_file_returns_what_there_is(tmp_path: Path) -> None:
    path, blob = _file(tmp_path, SIZE)
    reader, buffered = _reader(path)
    try:
        for skew in (0, 64):
            target = _buffer(BOUNCE_BYTES, skew)
            offset = SIZE - 5000 - SIZE % DIRECT_ALIGN
            assert reader.read(byte_view(target), offset) == SIZE - offset
            assert bytes(target.numpy()[: SIZE - offset]) == blob[offset:]
            assert reader.read(byte_view(_buffer(10, skew)), SIZE) == 0
            assert reader.read(byte_view(_buffer(10, skew)), SIZE + 10**6) == 0
    finally:
        reader.close()
        os.close(buffered)


@linux_only
def test_a_read_only_buffer_is_filled_through_a_copy(tmp_path: Path) -> None:
    path, blob = _file(tmp_path, 3 * DIRECT_ALIGN)
    reader, buffered = _reader(path)
    try:
        target = bytearray(1000)
        assert reader.read(memoryview(target), 77) == 1000
        assert bytes(target) == blob[77:1077]
    finally:
        reader.close()
        os.close(buffered)


def _track_direct_fds(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """Descriptors opened for direct reads from now on (by ``VerifyingLocalFile``)."""
    found: set[int] = set()
    real = direct_read.open_direct_read

    def tracking(path: str | os.PathLike[str]) -> int | None:
        fd = real(path)
        if fd is not None:
            found.add(fd)
        return fd

    monkeypatch.setattr("ckptmgr.tensor_bytes.open_direct_read", tracking)
    return found


@linux_only
@pytest.mark.parametrize("refused_after", [0, 1, 2])
@pytest.mark.parametrize("skew", [0, 64])
def test_a_direct_read_refused_midway_falls_back_to_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused_after: int, skew: int
) -> None:
    # Fault injection: the filesystem took the O_DIRECT open but refuses direct reads after
    # ``refused_after`` of them (as some FUSE filesystems do from the first).
    path, blob = _file(tmp_path, SIZE)
    reader, buffered = _reader(path)
    direct_fd = reader._direct_fd
    real_preadv = os.preadv
    taken = [0]

    def refusing_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        if fd == direct_fd:
            if taken[0] >= refused_after:
                raise OSError(errno.EINVAL, "Invalid argument")
            taken[0] += 1
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(direct_read.os, "preadv", refusing_preadv)
    try:
        cuts = [0, BOUNCE_BYTES, 2 * BOUNCE_BYTES, 3 * BOUNCE_BYTES, SIZE]  # 4 reads, or more
        for start, end in itertools.pairwise(cuts):
            target = _buffer(end - start, skew)
            assert reader.read(byte_view(target), start) == end - start
            assert bytes(target.numpy()) == blob[start:end]
        assert taken[0] == refused_after
        assert not reader.direct
        assert reader.buffered_bytes > 0
    finally:
        reader.close()
        os.close(buffered)


@linux_only
def test_an_io_error_of_a_read_ahead_is_raised_by_the_read_that_needs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fault injection: the disk fails reads of the second window, which is read ahead on the
    # helper thread while the first is copied out.
    path, blob = _file(tmp_path, SIZE)
    reader, buffered = _reader(path)
    real_preadv = os.preadv
    failed = [0]

    def failing_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        if BOUNCE_BYTES <= offset < 2 * BOUNCE_BYTES:
            failed[0] += 1
            raise OSError(errno.EIO, "Input/output error")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(direct_read.os, "preadv", failing_preadv)
    try:
        first = _buffer(1000, 64)
        assert reader.read(byte_view(first), 0) == 1000  # the first window; the second ahead
        assert bytes(first.numpy()) == blob[:1000]
        with pytest.raises(OSError) as raised:
            reader.read(byte_view(_buffer(1000, 64)), BOUNCE_BYTES + 5)
        assert raised.value.errno == errno.EIO
        assert failed[0] == 2  # ahead, then again on the reading thread
        later = _buffer(100, 64)  # the reader still reads what the disk gives
        assert reader.read(byte_view(later), 2 * BOUNCE_BYTES + 1) == 100
        assert bytes(later.numpy()) == blob[2 * BOUNCE_BYTES + 1 : 2 * BOUNCE_BYTES + 101]
    finally:
        reader.close()
        os.close(buffered)


def test_where_direct_reads_are_off_everything_goes_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(direct_read, "DIRECT_READS", False)
    path, blob = _file(tmp_path, 2 * DIRECT_ALIGN + 9)
    assert open_direct_read(path) is None
    fd = os.open(path, os.O_RDONLY)
    reader = DirectReader(None, fd)
    try:
        target = bytearray(len(blob) - 3)
        assert reader.read(memoryview(target), 3) == len(blob) - 3
        assert bytes(target) == blob[3:]
        assert reader.buffered_bytes == len(blob) - 3
        assert not reader.direct
    finally:
        reader.close()
        os.close(fd)


def test_a_filesystem_that_refuses_o_direct_at_open_is_read_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_o_direct_at_open(monkeypatch)  # (fault injection)
    path, blob = _file(tmp_path, BOUNCE_BYTES + 11)
    source = VerifyingLocalFile(path, "data.distcp", None)
    try:
        target = torch.empty(len(blob), dtype=torch.uint8)
        source.read_into(0, byte_view(target), target)
        source.finish()
        assert bytes(target.numpy()) == blob
        assert not source.reader.direct
        assert source.reader.buffered_bytes == len(blob)
    finally:
        source.close()


@linux_only
def test_a_truncated_data_file_read_directly_is_reported_corrupt(tmp_path: Path) -> None:
    path, _ = _file(tmp_path, 2 * BOUNCE_BYTES)
    _reader(path)[0].close()  # (skips where the filesystem takes no O_DIRECT)
    os.truncate(path, BOUNCE_BYTES + 77)
    source = VerifyingLocalFile(path, "data.distcp", None)
    try:
        target = torch.empty(2 * BOUNCE_BYTES, dtype=torch.uint8)
        with pytest.raises(CorruptCheckpointError, match="ends at byte"):
            source.read_into(0, byte_view(target), target)
        assert source.reader.direct
    finally:
        source.close()


@linux_only
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "page-cache"])
def test_a_restore_reads_data_files_past_the_page_cache_unless_turned_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    # Read directly, the data files leave (almost) nothing in the page cache; with direct reads
    # off (the default) the restore's reads fill it. Either way every byte is back.
    skip_without_o_direct(tmp_path)
    monkeypatch.setattr(direct_read, "DIRECT_READS", direct)
    direct_fds = _track_direct_fds(monkeypatch)
    generator = torch.Generator().manual_seed(2)
    state = {
        "w": torch.randn(2048, 1024, generator=generator),
        "b": torch.randn(777, generator=generator),
        "steps": torch.arange(5),
    }
    with CheckpointManager(tmp_path / "ckpts", save_interval=1) as manager:
        manager.save(1, state)
        files = sorted((tmp_path / "ckpts").rglob("*.distcp"))
        drop_from_page_cache(tmp_path / "ckpts")
        target = {key: torch.zeros_like(value) for key, value in state.items()}
        manager.restore(1, target)
    for key, value in state.items():
        assert torch.equal(target[key], value), key
    resident, total = resident_pages(files)
    assert total >= 2048
    if direct:
        assert direct_fds
        assert resident <= 2 * len(files), f"{resident} of {total} pages in the page cache"
    else:
        assert not direct_fds
        assert resident >= total // 2, f"only {resident} of {total} pages in the page cache"


@pytest.mark.parametrize(
    ("value", "expected"), [(None, True), ("0", False), ("1", True), ("", False)]
)
def test_direct_reads_are_on_unless_the_environment_turns_them_off(
    value: str | None, expected: bool
) -> None:
    environment = {k: v for k, v in os.environ.items() if k != direct_read.DIRECT_READS_VARIABLE}
    if value is not None:
        environment[direct_read.DIRECT_READS_VARIABLE] = value
    shown = subprocess.run(
        [sys.executable, "-c", "import ckptmgr.direct_read as d; print(d.DIRECT_READS)"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.strip()
    assert shown == str(expected)
