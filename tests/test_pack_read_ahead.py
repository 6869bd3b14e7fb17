"""The read ahead of a step's pack of small tensors while a restore matches the state
(ckptmgr.pack_read_ahead): its size from the record alone, its use by restore, no read ahead of
a pack that shares its file with large tensors, and a restore that reads the pack itself, as
before, whenever the read ahead failed or is not used."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from ckptmgr import CheckpointError, CheckpointManager, CorruptCheckpointError, dcp_io, tensor_bytes
from ckptmgr.pack_read_ahead import PackReadAhead, pack_size
from ckptmgr.packing import PACK_KEY
from ckptmgr.tensor_table import TensorTable


def _state() -> dict[str, torch.Tensor]:
    """Small tensors of several dtypes and shapes, all packed (the pack alone in its file)."""
    gen = torch.Generator().manual_seed(3)
    state: dict[str, torch.Tensor] = {}
    for index in range(40):
        state[f"small/f32/{index}"] = torch.randn(index % 5 + 1, 3, generator=gen)
        state[f"small/i64/{index}"] = torch.randint(0, 9, (index % 3 + 1,), generator=gen)
        state[f"small/bf16/{index}"] = torch.randn(5, generator=gen).to(torch.bfloat16)
    return state


def _stored_pack_bytes(step_dir: Path) -> int:
    """The size of the pack as DCP's metadata of the step stores it."""
    fs = fsspec.filesystem("file")
    metadata = dcp_io.read_metadata_file(fs, str(step_dir))
    return int(metadata.state_dict_metadata[PACK_KEY].size.numel())


def _noting_loads(monkeypatch: pytest.MonkeyPatch) -> list[set[str]]:
    """The keys of every DCP load that restore makes (read ahead or not), in order."""
    loads: list[set[str]] = []
    real = dcp_io.load_tensors

    def noting(tensors: dict[str, torch.Tensor], *args: Any) -> None:
        loads.append(set(tensors))
        real(tensors, *args)

    monkeypatch.setattr(dcp_io, "load_tensors", noting)
    return loads


def _noting_chunk_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes of every stored chunk read from a data file (by the read ahead or by DCP's
    load), in order."""
    reads: list[int] = []
    real = tensor_bytes.read_chunk

    def noting(source: Any, offset: int, length: int, *args: Any) -> torch.Tensor:
        reads.append(length)
        return real(source, offset, length, *args)

    monkeypatch.setattr(tensor_bytes, "read_chunk", noting)
    return reads


def _packed_bytes(root: Path) -> torch.Tensor:
    """The bytes of the one data file of the one step under ``root``."""
    (data_file,) = root.glob("*/*.distcp")
    return torch.frombuffer(bytearray(data_file.read_bytes()), dtype=torch.uint8)


def test_pack_size_is_the_end_of_the_last_packed_tensor() -> None:
    table = TensorTable(
        ["a", "big", "b", "c", "d"],
        ["float32", "float32", "int64", "bfloat16", "float32"],
        [[3], [10**6], [2, 2], [5], [0]],
        [0, None, 16, 48, 58],  # (a float32 of no items where the bfloat16 run ends)
    )
    assert pack_size(table) == 58
    table.pack_offsets[4] = 48  # the empty one where the last one starts
    assert pack_size(table) == 58
    assert pack_size(TensorTable.empty()) is None
    assert pack_size(TensorTable(["x"], ["float32"], [[4]], [None])) is None
    assert pack_size(TensorTable(["x"], ["nonsense"], [[4]], [0])) is None


def test_pack_size_matches_the_stored_pack(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, _state())
        record = mgr._storage.read_record(1)
    (step_dir,) = (path for path in tmp_path.iterdir() if path.is_dir())
    assert pack_size(record.tensor_table) == _stored_pack_bytes(step_dir) > 0


def test_restore_reads_the_pack_ahead_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pack is read once, by the read ahead (straight from its data file, not through a
    DCP load), and restore has nothing left to load; every tensor round-trips bit-exact."""
    state = _state()
    target = {key: torch.zeros_like(value) for key, value in state.items()}
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, state)
        pack_bytes = pack_size(mgr._storage.read_record(1).tensor_table)
        loads = _noting_loads(monkeypatch)
        reads = _noting_chunk_reads(monkeypatch)
        mgr.restore(1, target)
    assert loads == []
    assert reads == [pack_bytes]
    for key, value in state.items():
        assert torch.equal(target[key].view(torch.uint8), value.view(torch.uint8)), key
    assert not [t for t in threading.enumerate() if t.name == "ckptmgr-pack-read"]


def test_a_pack_in_one_file_with_large_tensors_is_not_read_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where DCP stored the pack in one file with a large tensor, reading the pack ahead would
    read (and check) that whole file twice: the read ahead skips it, and restore reads the file
    once, as before."""
    state = _state() | {"big": torch.randn(300_000)}  # 1.2 MB, stored on its own
    target = {key: torch.zeros_like(value) for key, value in state.items()}
    skipped: list[bool] = []
    real_wait = PackReadAhead.wait

    def noting_wait(self: PackReadAhead) -> bool:
        done = real_wait(self)
        skipped.append(self.skipped)
        return done

    monkeypatch.setattr(PackReadAhead, "wait", noting_wait)
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, state)
        (step_dir,) = (path for path in tmp_path.iterdir() if path.is_dir())
        metadata = dcp_io.read_metadata_file(fsspec.filesystem("file"), str(step_dir))
        files = {info.relative_path for info in metadata.storage_data.values()}
        assert len(files) == 1  # (the layout this test is about)
        loads = _noting_loads(monkeypatch)
        mgr.restore(1, target)
    assert loads == [{PACK_KEY, "big"}]
    assert skipped and all(skipped)
    assert all(torch.equal(target[key], value) for key, value in state.items())


def _reads_failing_at(monkeypatch: pytest.MonkeyPatch, failing: int, message: str) -> list[int]:
    """Make the ``failing``-th read of tensor bytes from now on raise ``OSError(message)``;
    returns the lengths of the reads, as they are made (the failed one too)."""
    reads: list[int] = []
    real = tensor_bytes.read_chunk

    def failing_read(source: Any, offset: int, length: int, *args: Any) -> torch.Tensor:
        reads.append(length)
        if len(reads) == failing:
            raise OSError(message)
        return real(source, offset, length, *args)

    monkeypatch.setattr(tensor_bytes, "read_chunk", failing_read)
    return reads


def test_a_failed_read_ahead_is_read_again_by_restore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: the read ahead fails (a transient error); restore reads the pack
    itself with DCP's load and succeeds."""
    state = _state()
    target = {key: torch.zeros_like(value) for key, value in state.items()}
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, state)
        pack_bytes = pack_size(mgr._storage.read_record(1).tensor_table)
        loads = _noting_loads(monkeypatch)
        reads = _reads_failing_at(monkeypatch, 1, "injected: connection reset")
        mgr.restore(1, target)
    assert reads == [pack_bytes, pack_bytes]
    assert loads == [{PACK_KEY}]
    assert all(torch.equal(target[key], value) for key, value in state.items())


def test_a_restore_that_wants_no_packed_tensor_drops_the_read_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restoring only a plain value: the pack read ahead is waited for and dropped."""
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, {**_state(), "epoch": 3})
        loads = _noting_loads(monkeypatch)
        reads = _noting_chunk_reads(monkeypatch)
        target: dict[str, Any] = {"epoch": 0}
        mgr.restore(1, target)
    assert len(reads) == 1  # (the read ahead's)
    assert loads == []
    assert target == {"epoch": 3}
    assert not [t for t in threading.enumerate() if t.name == "ckptmgr-pack-read"]


def test_a_restore_that_fails_to_match_waits_for_the_read_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A destination of the wrong shape raises as before, and restore raises only after the
    read ahead (held until restore waits for it) has ended; no destination was written."""
    state = _state()
    release = threading.Event()
    real_read, real_wait = tensor_bytes.read_chunk, PackReadAhead.wait

    def held(*args: Any) -> torch.Tensor:
        assert release.wait(30)
        return real_read(*args)

    def releasing_wait(self: PackReadAhead) -> bool:
        release.set()
        return real_wait(self)

    target = {key: torch.zeros_like(value) for key, value in state.items()}
    target["small/f32/0"] = torch.zeros(4, 4)
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, state)
        monkeypatch.setattr(tensor_bytes, "read_chunk", held)
        monkeypatch.setattr(PackReadAhead, "wait", releasing_wait)
        with pytest.raises(CheckpointError, match="shape"):
            mgr.restore(1, target)
        assert release.is_set()
        assert not [t for t in threading.enumerate() if t.name == "ckptmgr-pack-read"]
    assert all(not value.any() for value in target.values())


def test_no_read_ahead_of_a_pack_larger_than_the_data_files() -> None:
    """A damaged table that places a tensor far outside any data file gets no buffer (the
    restore's own checks then name the damage)."""
    table = TensorTable(["a"], ["float32"], [[4]], [2**50])
    assert PackReadAhead.start(table, None, {"__0_0.distcp": 10**6}) is None
    assert PackReadAhead.start(table, None, {"commit.json": 10**18}) is None


def test_a_reader_of_torch_save_items_gets_no_read_ahead(tmp_path: Path) -> None:
    """Data files of record format 1 hold DCP's ``torch.save`` items, not raw bytes: nothing
    is read ahead."""
    table = TensorTable(["a"], ["float32"], [[4]], [0])
    reader = dcp_io.make_reader(str(tmp_path), local=True, storage_options={}, raw=False)
    assert PackReadAhead.start(table, reader, {"__0_0.distcp": 16}) is None


@pytest.mark.parametrize("local", [True, False], ids=["metadata read first", "on the thread"])
def test_a_pack_stored_otherwise_than_the_record_says_is_not_read_ahead(
    tmp_path: Path, local: bool
) -> None:
    """DCP's metadata must show the pack whole, as one chunk of bytes of the size the record
    gives; a read ahead of another size is skipped (the restore's own load then checks).
    Alike where the metadata is read before the thread starts (a local disk) or on it."""
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, _state())
        record = mgr._storage.read_record(1)
        reader = mgr._restorer.step_reader(1, None, True)
    size = pack_size(record.tensor_table)
    assert size is not None
    file_sizes = {entry.path: entry.size for entry in record.files}
    read = PackReadAhead(size, reader, file_sizes, local=local)
    assert read.wait() and not read.skipped
    assert torch.equal(read.buffer[:16], _packed_bytes(tmp_path)[:16])
    wrong = PackReadAhead(size + 8, reader, file_sizes, local=local)
    assert not wrong.wait() and wrong.skipped


def test_damaged_metadata_fails_the_read_ahead_before_its_thread_starts(tmp_path: Path) -> None:
    """On a local disk the metadata is read before the thread starts: damaged, it fails the
    read ahead (not the restore, whose own load raises what it finds), and no thread runs."""
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, _state())
        record = mgr._storage.read_record(1)
        reader = mgr._restorer.step_reader(1, None, True)
    (metadata_file,) = tmp_path.glob("*/.metadata")
    metadata_file.write_bytes(b"not a pickle")
    size = pack_size(record.tensor_table)
    assert size is not None
    file_sizes = {entry.path: entry.size for entry in record.files}
    read = PackReadAhead(size, reader, file_sizes, local=True)
    assert read._thread is None
    assert not read.wait() and not read.skipped


def _flip_a_byte_of_the_data_file(root: Path, index: int) -> Path:
    """Flip the byte at ``index`` of the one data file under ``root``; returns that file."""
    (data_file,) = root.glob("*/*.distcp")
    damaged = bytearray(data_file.read_bytes())
    damaged[index] ^= 0xFF
    data_file.write_bytes(bytes(damaged))
    return data_file


def test_a_damaged_pack_fails_the_read_ahead_and_restore_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flipped byte in the pack's data file: the read ahead finds it and is dropped, and the
    restore's own load raises ``CorruptCheckpointError`` naming the file, as without it."""
    state = _state()
    target = {key: torch.zeros_like(value) for key, value in state.items()}
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, state)
        data_file = _flip_a_byte_of_the_data_file(tmp_path, 5)
        outcomes: list[bool] = []
        real_wait = PackReadAhead.wait

        def noting_wait(self: PackReadAhead) -> bool:
            outcomes.append(real_wait(self))
            return outcomes[-1]

        monkeypatch.setattr(PackReadAhead, "wait", noting_wait)
        loads = _noting_loads(monkeypatch)
        with pytest.raises(CorruptCheckpointError, match=data_file.name):
            mgr.restore(1, target)
    assert outcomes and not any(outcomes)
    assert loads == [{PACK_KEY}]


def _small_pieces(monkeypatch: pytest.MonkeyPatch, piece_bytes: int = 256) -> None:
    """Read and unpack the pack in pieces of ``piece_bytes`` (the test state's pack is a few
    KB: ten pieces or so)."""
    from ckptmgr import pack_load, pack_read_ahead

    monkeypatch.setattr(pack_read_ahead, "READ_PIECE_BYTES", piece_bytes)
    monkeypatch.setattr(pack_load, "UNPACK_PIECE_BYTES", piece_bytes)


@dataclass
class _HeldLastPiece:
    """What :func:`_hold_the_last_piece_until_a_copy` notes: the pack's ``size``, the lengths
    of the reads, the tensors of each copy out of the pack, and whether each hold of the last
    piece's read ended with a copy made."""

    size: int
    reads: list[int] = field(default_factory=list)
    copies: list[int] = field(default_factory=list)
    held: list[bool] = field(default_factory=list)


def _hold_the_last_piece_until_a_copy(
    monkeypatch: pytest.MonkeyPatch, mgr: CheckpointManager
) -> _HeldLastPiece:
    """Hold the read of the last piece of step 1's pack (read in several pieces) until a first
    copy out of the pack is made (bounded), noting the reads and copies."""
    from ckptmgr import pack_load

    size = pack_size(mgr._storage.read_record(1).tensor_table)
    assert size is not None and size > 4 * 256  # (several pieces)
    noted = _HeldLastPiece(size)
    copied = threading.Event()
    real_read, real_copy = tensor_bytes.read_chunk, pack_load._split_copy

    def held_read(source: Any, offset: int, length: int, *args: Any) -> torch.Tensor:
        noted.reads.append(length)
        if sum(noted.reads) == size and len(noted.reads) > 1:  # the read ahead's last piece
            noted.held.append(copied.wait(10))
        return real_read(source, offset, length, *args)

    def noting_copy(source: torch.Tensor, sizes: list[int], outs: list[torch.Tensor]) -> None:
        noted.copies.append(len(sizes))
        copied.set()
        real_copy(source, sizes, outs)

    monkeypatch.setattr(tensor_bytes, "read_chunk", held_read)
    monkeypatch.setattr(pack_load, "_split_copy", noting_copy)
    return noted


def test_restore_copies_tensors_out_of_the_pack_while_the_rest_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read ahead reads the pack piece by piece, and restore copies the tensors of the
    pieces already read while the rest is still being read: the read of the last piece is held
    until a first copy out of the pack is made (which a restore waiting for the whole read
    never makes). Every tensor round-trips bit-exact; the pack is read once."""
    _small_pieces(monkeypatch)
    state = _state()
    target = {key: torch.zeros_like(value) for key, value in state.items()}
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, state)
        noted = _hold_the_last_piece_until_a_copy(monkeypatch, mgr)
        loads = _noting_loads(monkeypatch)
        mgr.restore(1, target)
    assert noted.held == [True]
    assert sum(noted.reads) == noted.size and loads == []
    for key, value in state.items():
        assert torch.equal(target[key].view(torch.uint8), value.view(torch.uint8)), key


def test_a_read_ahead_failing_after_its_first_piece_is_read_again_by_restore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: the read ahead fails after some tensors were copied out of its first
    pieces; restore loads the pack itself, copies every tensor again, and is bit-exact."""
    _small_pieces(monkeypatch)
    state = _state()
    target = {key: torch.zeros_like(value) for key, value in state.items()}
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, state)
        loads = _noting_loads(monkeypatch)
        reads = _reads_failing_at(monkeypatch, 3, "injected: I/O error")
        mgr.restore(1, target)
    assert len(reads) == 4  # two pieces, the failed one, then the pack whole by DCP's load
    assert loads == [{PACK_KEY}]
    for key, value in state.items():
        assert torch.equal(target[key].view(torch.uint8), value.view(torch.uint8)), key


def test_a_pack_damaged_in_its_last_piece_fails_the_restore_after_copies_began(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flipped byte in the last piece of the pack, found by the file's CRC-32 once the whole
    file is read: tensors of the earlier pieces were copied already, and the restore still
    raises ``CorruptCheckpointError`` naming the file (from its own load of the pack). The read
    of the last piece is held until a first copy is made, so that copying has begun for certain
    (the read of a few small pieces can otherwise end before any copy)."""
    _small_pieces(monkeypatch)
    state = _state()
    target = {key: torch.zeros_like(value) for key, value in state.items()}
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, state)
        data_file = _flip_a_byte_of_the_data_file(tmp_path, -2)
        noted = _hold_the_last_piece_until_a_copy(monkeypatch, mgr)
        loads = _noting_loads(monkeypatch)
        with pytest.raises(CorruptCheckpointError, match=data_file.name):
            mgr.restore(1, target)
    assert noted.held == [True]
    assert noted.copies  # copying had begun before the damage was found
    assert loads == [{PACK_KEY}]
