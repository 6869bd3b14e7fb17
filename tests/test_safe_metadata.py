"""The restricted unpickler of DCP's ``.metadata`` (ckptmgr.safe_metadata).

Metadata of every kind DCP writes reads back equal, as objects of DCP's own classes; crafted
pickles that name anything else, or whose BUILD would set attributes of anything the unpickler
hands out (a class, an enum member, a dtype), are refused and change nothing in this process.
End-to-end refusals (a crafted ``.metadata`` in a real step) are in test_integrity.py.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ckptmgr import CheckpointManager, CorruptCheckpointError
from ckptmgr.safe_metadata import load_metadata_safely

MODULE = "torch.distributed.checkpoint.metadata"
ENCODING = dcp_metadata._MEM_FORMAT_ENCODING


def load(data: bytes) -> dcp_metadata.Metadata:
    return load_metadata_safely(io.BytesIO(data))


def properties(**changes: Any) -> dcp_metadata.TensorProperties:
    fields: dict[str, Any] = {
        "dtype": torch.float32,
        "layout": torch.strided,
        "requires_grad": False,
        "memory_format": torch.contiguous_format,
        "pin_memory": False,
    }
    fields.update(changes)
    return dcp_metadata.TensorProperties(**fields)


def metadata_of_every_kind() -> dcp_metadata.Metadata:
    """Metadata using every class, memory format and field the unpickler must build."""
    tensors: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    variants = [
        properties(),
        properties(memory_format=torch.channels_last, dtype=torch.bfloat16),
        properties(memory_format=torch.preserve_format, requires_grad=True, pin_memory=True),
        properties(layout=torch.sparse_coo, dtype=torch.int64),
    ]
    for index, props in enumerate(variants):
        fqn = f"layer.{index}.weight"
        chunks = [
            dcp_metadata.ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 4])),
            dcp_metadata.ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([2, 4])),
        ]
        tensors[fqn] = dcp_metadata.TensorStorageMetadata(props, torch.Size([4, 4]), chunks)
        for rank, chunk in enumerate(chunks):
            key = dcp_metadata.MetadataIndex(fqn, chunk.offsets, rank)
            storage[key] = _StorageInfo(f"__{rank}_0.distcp", 100 * index, 32)
    tensors["extra"] = dcp_metadata.BytesStorageMetadata()
    storage[dcp_metadata.MetadataIndex("extra")] = _StorageInfo("__0_0.distcp", 500, 9)
    return dcp_metadata.Metadata(
        state_dict_metadata=tensors,
        planner_data={"layer.0.weight": ("layer", "0", "weight")},
        storage_data=storage,
        storage_meta=dcp_metadata.StorageMeta(
            checkpoint_id=pathlib.PurePosixPath("/ckpt/step_1"), save_id="s", load_id="l"
        ),
        version="1.0.0",
    )


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_metadata_of_every_kind_reads_back_equal(protocol: int) -> None:
    metadata = metadata_of_every_kind()
    loaded = load(pickle.dumps(metadata, protocol=protocol))
    assert loaded == metadata
    assert loaded == pickle.loads(pickle.dumps(metadata, protocol=protocol))
    assert type(loaded) is dcp_metadata.Metadata
    assert type(loaded.storage_meta) is dcp_metadata.StorageMeta
    assert type(loaded.storage_meta.checkpoint_id) is pathlib.PurePosixPath
    for fqn, item in loaded.state_dict_metadata.items():
        if fqn == "extra":
            assert type(item) is dcp_metadata.BytesStorageMetadata
            continue
        assert type(item) is dcp_metadata.TensorStorageMetadata
        assert type(item.properties) is dcp_metadata.TensorProperties
        assert type(item.size) is torch.Size
        assert {type(chunk) for chunk in item.chunks} == {dcp_metadata.ChunkStorageMetadata}
    formats = [
        loaded.state_dict_metadata[f"layer.{i}.weight"].properties.memory_format for i in (0, 1, 2)
    ]
    assert formats == [torch.contiguous_format, torch.channels_last, torch.preserve_format]
    for key, info in loaded.storage_data.items():
        assert type(key) is dcp_metadata.MetadataIndex
        assert type(info) is _StorageInfo
        assert metadata.storage_data[key] == info  # (keys hash and compare as DCP's own)


def test_the_metadata_of_a_real_save_reads_back_equal(tmp_path: Path) -> None:
    state = {"w": torch.randn(64, 8), "b": torch.arange(5), "h": torch.ones(3, dtype=torch.half)}
    dcp.save(state, checkpoint_id=tmp_path / "dcp")
    data = (tmp_path / "dcp" / ".metadata").read_bytes()
    assert load(data) == pickle.loads(data)
    with CheckpointManager(tmp_path / "ckpt", 1, chkpt_on_preemption=False) as manager:
        manager.save(1, {"w": torch.randn(3000, 5), "small": [torch.ones(2) for _ in range(40)]})
    data = next((tmp_path / "ckpt").glob("*/.metadata")).read_bytes()
    assert load(data) == pickle.loads(data)


def global_of(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


SLOT_STATE = b"(N}(Vx\nI1\nutb."  # BUILD with state (None, {"x": 1}): setattr(target, "x", 1)
DICT_STATE = b"}(Vx\nI1\nub."  # BUILD with state {"x": 1}: target.__dict__["x"] = 1

HANDED_OUT: dict[str, tuple[bytes, Any]] = {
    "a DCP class": (global_of(MODULE, "TensorProperties"), dcp_metadata.TensorProperties),
    "Metadata": (global_of(MODULE, "Metadata"), dcp_metadata.Metadata),
    "_StorageInfo": (
        global_of("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        _StorageInfo,
    ),
    "a path class": (global_of("pathlib", "PurePosixPath"), pathlib.PurePosixPath),
    "the memory format enum": (global_of(MODULE, "_MEM_FORMAT_ENCODING"), ENCODING),
    "a member of the memory format enum": (
        global_of(MODULE, "_MEM_FORMAT_ENCODING") + b"(I0\ntR",
        ENCODING.TORCH_CONTIGUOUS_FORMAT,
    ),
    "torch.Size": (global_of("torch", "Size"), torch.Size),
    "OrderedDict": (global_of("collections", "OrderedDict"), collections.OrderedDict),
    "a dtype": (global_of("torch", "float32"), torch.float32),
    "a memory format": (global_of("torch", "channels_last"), torch.channels_last),
    "the layout function": (global_of("torch.serialization", "_get_layout"), None),
    "a layout it returns": (
        global_of("torch.serialization", "_get_layout") + b"(Vtorch.strided\ntR",
        torch.strided,
    ),
}


@pytest.mark.parametrize("state", [SLOT_STATE, DICT_STATE], ids=["slot state", "dict state"])
@pytest.mark.parametrize("target", list(HANDED_OUT))
def test_build_on_anything_handed_out_is_refused_and_changes_nothing(
    target: str, state: bytes
) -> None:
    """The old pure-Python unpickler refused BUILD on classes but let it set attributes of a
    member of DCP's memory-format enum (shared by the whole process)."""
    prefix, shared = HANDED_OUT[target]
    with pytest.raises(CorruptCheckpointError, match="not plain DCP metadata"):
        load(prefix + state)
    if shared is not None:
        assert not hasattr(shared, "x")
        assert "x" not in getattr(shared, "__dict__", {})
    assert ENCODING(0) is ENCODING.TORCH_CONTIGUOUS_FORMAT
    assert not hasattr(ENCODING.TORCH_CONTIGUOUS_FORMAT, "x")


def test_the_message_names_the_refused_attribute_setting() -> None:
    with pytest.raises(CorruptCheckpointError, match="refusing to set attributes"):
        load(global_of(MODULE, "Metadata") + SLOT_STATE)


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("os", "system"),
        ("builtins", "eval"),
        ("pathlib", "Path"),
        ("torch", "load"),
        ("torch", "tensor"),
        (MODULE, "json"),
        (MODULE, "Enum"),
        ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),
    ],
)
def test_any_other_global_is_refused(module: str, name: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=f"refusing to load {module}.{name}"):
        load(global_of(module, name) + b".")


@pytest.mark.parametrize(
    "data",
    [
        global_of(MODULE, "_MEM_FORMAT_ENCODING") + b"(I7\ntR.",
        global_of("torch.serialization", "_get_layout") + b"(Vtorch.float32\ntR.",
        global_of("torch.serialization", "_get_layout") + b"(Vsparse\ntR.",
    ],
    ids=["memory format 7", "a dtype as a layout", "no such layout"],
)
def test_unknown_enum_values_are_refused(data: bytes) -> None:
    with pytest.raises(CorruptCheckpointError, match="unknown"):
        load(data)


@pytest.mark.parametrize(
    "data",
    [
        global_of(MODULE, "Metadata") + b".",
        global_of("torch", "Size") + b"((I1\ntR.",
        b"(dp0\n.",
        b"",
        b"\x80\x04garbage",
    ],
    ids=["a class", "a Size", "a dict", "nothing", "garbage"],
)
def test_anything_but_a_metadata_object_is_refused(data: bytes) -> None:
    with pytest.raises(CorruptCheckpointError):
        load(data)


def test_a_stand_in_builds_an_object_of_the_real_class_only() -> None:
    """NEWOBJ of a stand-in gives DCP's own class; the stand-in itself is never in the result,
    and two loads get stand-ins of their own."""
    metadata = load(pickle.dumps(metadata_of_every_kind()))
    seen: list[Any] = [metadata]
    kinds: set[type] = set()
    while seen:
        item = seen.pop()
        kinds.add(type(item))
        if isinstance(item, dict):
            seen.extend(item.keys())
            seen.extend(item.values())
        elif isinstance(item, (list, tuple)):
            seen.extend(item)
        elif hasattr(item, "__dataclass_fields__"):
            seen.extend(getattr(item, name) for name in item.__dataclass_fields__)
    assert all(kind.__module__ != "ckptmgr.safe_metadata" for kind in kinds), kinds


def storage_metadata(storage_data: dict[Any, Any]) -> bytes:
    return pickle.dumps(
        dcp_metadata.Metadata(state_dict_metadata={}, storage_data=storage_data), protocol=4
    )


def test_every_file_a_chunk_names_is_checked_once_each() -> None:
    """The storage records of a sharded state name a file per rank, each thousands of times:
    the names are checked once each (a set of them), so one bad name among many still fails,
    and so does a record without a name, or with a name that is not text."""
    good = {
        dcp_metadata.MetadataIndex(f"t{i}", torch.Size([0]), 0): _StorageInfo(
            f"__{i % 3}_0.distcp", 8 * i, 8
        )
        for i in range(3000)
    }
    assert load(storage_metadata(good)).storage_data == good
    index = dcp_metadata.MetadataIndex("bad", torch.Size([0]), 0)
    for bad_path in ("../outside.distcp", "/etc/passwd", ""):
        with pytest.raises(CorruptCheckpointError, match="not inside its step directory"):
            load(storage_metadata({**good, index: _StorageInfo(bad_path, 0, 8)}))
    for record in (_StorageInfo(7, 0, 8), 42, _StorageInfo(["a"], 0, 8)):  # type: ignore[arg-type]
        with pytest.raises(CorruptCheckpointError, match="malformed"):
            load(storage_metadata({**good, index: record}))


def test_an_ordered_dict_whose_methods_are_shadowed_is_refused() -> None:
    """An OrderedDict takes attributes: BUILD set ``values`` on storage_data to ``torch.Size``
    (``values()`` then gave no record), hiding ``../../etc/passwd`` from the check of the
    paths. OrderedDicts are read as dicts, which take none."""
    index = dcp_metadata.MetadataIndex("t", torch.Size([0]), 0)
    shadowed = collections.OrderedDict({index: _StorageInfo("../../etc/passwd", 0, 8)})
    shadowed.values = torch.Size  # type: ignore[method-assign]
    with pytest.raises(CorruptCheckpointError, match="not plain DCP metadata"):
        load(storage_metadata(shadowed))
    plain = collections.OrderedDict({index: _StorageInfo("__0_0.distcp", 0, 8)})
    loaded = load(storage_metadata(plain))
    assert type(loaded.storage_data) is dict and loaded.storage_data == plain


def test_chunks_shared_through_the_memo_beyond_the_files_size_are_refused() -> None:
    """A small file whose tensors share one list of chunks (pickle's memo): DCP's load went
    through every tensor's chunks, N x M of them, for minutes (a 250 KB file: 20,000 x 20,000).
    Metadata naming more chunks than the file has bytes is refused; DCP's own is far below."""
    chunk = dcp_metadata.ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4]))
    item = dcp_metadata.TensorStorageMetadata(
        properties=properties(), size=torch.Size([4]), chunks=[chunk] * 2000
    )
    bomb = pickle.dumps(
        dcp_metadata.Metadata(state_dict_metadata={f"t{i}": item for i in range(200)}),
        protocol=4,
    )
    assert len(bomb) < 20_000
    with pytest.raises(CorruptCheckpointError, match="names 400000 chunks in"):
        load(bomb)
