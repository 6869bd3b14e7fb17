"""Ranged reads of a remote data file (``ckptmgr.remote_read``), over a fetch of bytes in memory.

The restores through real object stores (GCS emulator, moto) that read this way are in
``test_cloud_storage.py`` and ``test_cloud_faults.py``; here, every path of the source on its
own: windows consumed in order and copied exactly, bytes passed fetched again, every byte hashed
once in order whatever was read, at most ``windows_ahead`` windows fetched beyond what was read,
and a file shorter or longer than its record, a wrong checksum and a failing fetch raised.
"""

from __future__ import annotations

import random
import threading
import zlib

import pytest
import torch

from ckptmgr import CorruptCheckpointError, remote_read, tensor_bytes
from ckptmgr.remote_read import RemoteRangeSource

WINDOW = 1000


class Fetches:
    """A fetch over ``data`` that records each call's range."""

    def __init__(self, data: bytes, fail_at: int | None = None) -> None:
        self.data = data
        self.calls: list[tuple[int, int]] = []
        self.fail_at = fail_at
        self.threads: set[int] = set()
        self._lock = threading.Lock()

    def __call__(self, start: int, end: int) -> bytes:
        with self._lock:
            self.calls.append((start, end))
            self.threads.add(threading.get_ident())
        if self.fail_at is not None and start <= self.fail_at < end:
            raise OSError("HTTP 503: injected")
        return self.data[start:end]

    @property
    def count(self) -> int:
        with self._lock:
            return len(self.calls)


class Checks:
    """A ``check(size, crc)`` that records what it was given."""

    def __init__(self, size: int, crc: int) -> None:
        self.expected = (size, crc)
        self.given: list[tuple[int, int]] = []

    def __call__(self, size: int, crc: int) -> None:
        self.given.append((size, crc))
        if (size, crc) != self.expected:
            raise CorruptCheckpointError("damaged", path="data")


def file_of(size: int) -> bytes:
    return random.Random(size).randbytes(size)


def source_over(data: bytes, *, ahead: int = 3) -> tuple[RemoteRangeSource, Fetches, Checks]:
    fetches = Fetches(data)
    checks = Checks(len(data), zlib.crc32(data))
    source = RemoteRangeSource(
        fetches, len(data), "data", checks, window_bytes=WINDOW, windows_ahead=ahead
    )
    return source, fetches, checks


def read(source: RemoteRangeSource, offset: int, count: int) -> bytes:
    buffer = torch.zeros(count, dtype=torch.uint8)
    source.read_into(offset, tensor_bytes.byte_view(buffer), buffer)
    return bytes(buffer.numpy())


@pytest.mark.parametrize("hash_inline", [False, True])
def test_pieces_read_in_order_across_windows_are_the_files_bytes(hash_inline: bool) -> None:
    data = file_of(10 * WINDOW + 123)
    fetches = Fetches(data)
    checks = Checks(len(data), zlib.crc32(data))
    pieces = [(0, 10), (10, 990), (1000, 1), (1500, 2600), (4100, 0), (7000, 3123)]
    with RemoteRangeSource(
        fetches, len(data), "data", checks, window_bytes=WINDOW, hash_inline=hash_inline
    ) as source:
        for offset, count in pieces:  # within, at the edges of, and across windows, and a gap
            assert read(source, offset, count) == data[offset : offset + count]
        source.finish()
    assert checks.given == [(len(data), zlib.crc32(data))]
    windows = [(start, min(start + WINDOW, len(data))) for start in range(0, len(data), WINDOW)]
    # every window fetched once, the last asked for with one byte more (the file must end there)
    assert sorted(fetches.calls) == [*windows[:-1], (10 * WINDOW, len(data) + 1)]


def test_a_tensor_is_read_whole_into_its_memory() -> None:
    values = torch.arange(3000, dtype=torch.float64)
    data = b"head" + bytes(tensor_bytes.byte_view(values)) + b"tail"
    source, _, checks = source_over(data)
    with source:
        into = torch.zeros(3000, dtype=torch.float64)
        assert tensor_bytes.read_chunk(source, 4, 24000, torch.float64, (3000,), into) is into
        source.finish()
    assert torch.equal(into, values)
    assert len(checks.given) == 1


def test_bytes_already_passed_are_fetched_again_on_their_own() -> None:
    data = file_of(5 * WINDOW)
    source, fetches, checks = source_over(data)
    with source:
        assert read(source, 3500, 100) == data[3500:3600]
        before = fetches.count
        assert read(source, 200, 1500) == data[200:1700]  # windows 0 and 1 are gone by now
        assert fetches.calls[before:] == [(200, 1700)]
        assert read(source, 3600, 50) == data[3600:3650]
        source.finish()
    assert checks.given == [(len(data), zlib.crc32(data))]  # hashed once, in order


def test_a_file_read_in_part_is_fetched_and_hashed_whole_by_finish() -> None:
    data = file_of(8 * WINDOW - 1)
    source, fetches, checks = source_over(data)
    with source:
        assert read(source, 10, 20) == data[10:30]
        source.finish()
    assert checks.given == [(len(data), zlib.crc32(data))]
    assert sum(min(end, len(data)) - start for start, end in fetches.calls) == len(data)


def test_a_damaged_file_fails_its_check_at_finish() -> None:
    data = bytearray(file_of(4 * WINDOW))
    stored = bytes(data)
    data[2500] ^= 0x10
    source, _, checks = source_over(bytes(data))
    checks.expected = (len(stored), zlib.crc32(stored))
    with source:
        read(source, 0, 100)
        with pytest.raises(CorruptCheckpointError, match="damaged"):
            source.finish()


@pytest.mark.parametrize("actual", [3 * WINDOW + 500, 2 * WINDOW, 4 * WINDOW + 1, 6 * WINDOW])
def test_a_file_shorter_or_longer_than_its_record_is_damage(actual: int) -> None:
    recorded = 4 * WINDOW
    data = file_of(actual)
    fetches = Fetches(data)
    source = RemoteRangeSource(fetches, recorded, "data", None, window_bytes=WINDOW)
    message = "goes on past byte 4000" if actual > recorded else "the file ends at byte"
    with source, pytest.raises(CorruptCheckpointError, match=message) as caught:
        read(source, 0, 1000)
        source.finish()
    assert caught.value.path == "data"


def test_a_read_past_the_recorded_size_is_damage() -> None:
    data = file_of(2 * WINDOW)
    source, _, _ = source_over(data)
    with source, pytest.raises(CorruptCheckpointError, match="ends at byte 2000"):
        read(source, 1900, 200)


def test_a_failing_fetch_is_raised_to_the_reader_and_close_ends_the_others() -> None:
    data = file_of(20 * WINDOW)
    fetches = Fetches(data, fail_at=5 * WINDOW + 7)
    source = RemoteRangeSource(fetches, len(data), "data", None, window_bytes=WINDOW)
    with source, pytest.raises(OSError, match="injected"):
        read(source, 0, len(data))
    assert fetches.count < 20  # the windows after the failure were never all asked for


def test_no_more_than_windows_ahead_are_fetched_beyond_the_one_being_read() -> None:
    data = file_of(40 * WINDOW)
    source, fetches, _ = source_over(data, ahead=3)
    with source:
        for window in range(40):
            read(source, window * WINDOW, WINDOW)
            # windows 0..window read, and at most 3 more asked for (none waits to be read)
            assert fetches.count <= window + 1 + 3
        source.finish()
    assert fetches.count == 40


def test_files_read_at_once_share_the_processs_fetch_threads() -> None:
    """Each source asks for up to ``windows_ahead`` windows at once; what runs at once in the
    process, over all of them, is ``FETCH_THREADS`` reads."""
    files = [file_of(12 * WINDOW + n) for n in range(3)]
    sources = [source_over(data, ahead=4) for data in files]
    for (source, _, _), data in zip(sources, files, strict=True):
        with source:
            assert read(source, 0, len(data)) == data
            source.finish()
    threads = set().union(*(fetches.threads for _, fetches, _ in sources))
    assert len(threads) <= remote_read.FETCH_THREADS
    assert all(checks.given == [checks.expected] for _, _, checks in sources)


def test_an_empty_file_fetches_nothing_and_checks_zero_bytes() -> None:
    source, fetches, checks = source_over(b"")
    with source:
        source.finish()
    assert fetches.calls == []
    assert checks.given == [(0, 0)]


def test_window_and_ahead_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        RemoteRangeSource(Fetches(b""), 0, "data", None, window_bytes=0)
    with pytest.raises(ValueError, match="positive"):
        RemoteRangeSource(Fetches(b""), 0, "data", None, windows_ahead=0)
