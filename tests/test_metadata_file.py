"""ckptmgr.metadata_file: DCP's ``.metadata`` pickled anew only from the first field that changed.

Every file it writes must unpickle, with pickle's own unpickler and with ckptmgr's restricted
one, into metadata equal to what DCP's ``pickle.dump`` wrote for the same object, objects shared
between fields still shared; the fields before the first that changed must not be pickled
again. The manager's saves through it are checked against DCP's own ``finish`` in
test_write_items.py and the 2-rank ``plans`` scenario of test_distributed.py.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ckptmgr.metadata_file import MetadataFile
from ckptmgr.safe_metadata import load_metadata_safely


@pytest.fixture
def pickled(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often the tensors' properties (in ``state_dict_metadata``, one object shared by all)
    and the items' storage records (in ``storage_data``) are pickled: their ``__getstate__``
    counted."""
    counts = {"state_dict_metadata": 0, "storage_data": 0}
    for cls, field in (
        (dcp_metadata.TensorProperties, "state_dict_metadata"),
        (_StorageInfo, "storage_data"),
    ):
        getstate = cls.__getstate__

        def counted(self: Any, getstate: Any = getstate, field: str = field) -> Any:
            counts[field] += 1
            return getstate(self)

        monkeypatch.setattr(cls, "__getstate__", counted)
    return counts


def state_dict_metadata(count: int, rows: int = 8) -> dict[str, Any]:
    chunks = [
        dcp_metadata.ChunkStorageMetadata(torch.Size([0]), torch.Size([rows // 2])),
        dcp_metadata.ChunkStorageMetadata(torch.Size([rows // 2]), torch.Size([rows // 2])),
    ]
    properties = dcp_metadata.TensorProperties(dtype=torch.float32)
    return {
        f"layers.{i}.weight": dcp_metadata.TensorStorageMetadata(
            properties, torch.Size([rows]), list(chunks)
        )
        for i in range(count)
    }


def storage_data(names: list[str], length: int = 16) -> dict[Any, Any]:
    return {
        dcp_metadata.MetadataIndex(name, torch.Size([half * 4]), 0): _StorageInfo(
            f"__{half}_0.distcp", position * length, length
        )
        for position, name in enumerate(names)
        for half in (0, 1)
    }


def metadata_of(count: int = 50, *, step: int = 1) -> dcp_metadata.Metadata:
    tensors = state_dict_metadata(count)
    return dcp_metadata.Metadata(
        state_dict_metadata=tensors,
        planner_data={name: (name,) for name in tensors},
        storage_data=storage_data(list(tensors)),
        storage_meta=dcp_metadata.StorageMeta(
            checkpoint_id=f"/ckpt/step_{step}", save_id=f"{step}"
        ),
        version="1.0.0",
    )


def next_save(metadata: dcp_metadata.Metadata, step: int) -> None:
    """What DCP's cached plan does to the metadata of the next save of the same structure: the
    very same object, a new ``storage_meta``."""
    metadata.storage_meta = dcp_metadata.StorageMeta(
        checkpoint_id=f"/ckpt/step_{step}", save_id=f"{step}"
    )


def check_reads_back(data: bytes, metadata: dcp_metadata.Metadata) -> None:
    for loaded in (pickle.loads(data), load_metadata_safely(io.BytesIO(data))):
        assert type(loaded) is dcp_metadata.Metadata
        assert vars(loaded) == vars(metadata)
        assert list(vars(loaded)) == list(vars(metadata))
    assert data.startswith(b"\x80\x04\x95")  # protocol 4, framed as DCP's
    list(pickletools.genops(data))  # (every opcode well formed, up to its STOP)


def test_saves_of_one_structure_pickle_only_storage_meta_and_version_again(
    pickled: dict[str, int],
) -> None:
    metadata_file = MetadataFile()
    metadata = metadata_of()
    data = metadata_file.dumps(metadata)
    check_reads_back(data, metadata)
    once = {"state_dict_metadata": 1, "storage_data": 100}
    assert metadata_file.reused == 0 and pickled == once
    for step in (2, 3, 4):
        next_save(metadata, step)
        data = metadata_file.dumps(metadata)
        check_reads_back(data, metadata)
        assert pickle.loads(data).storage_meta.save_id == str(step)
        assert metadata_file.reused == 3 and pickled == once, step


def test_a_field_made_anew_is_pickled_again_from_there(pickled: dict[str, int]) -> None:
    metadata_file = MetadataFile()
    metadata = metadata_of()
    metadata_file.dumps(metadata)
    next_save(metadata, 2)
    metadata.storage_data = storage_data(list(metadata.state_dict_metadata), length=32)
    data = metadata_file.dumps(metadata)  # (the memo was kept at storage_meta: from the start)
    check_reads_back(data, metadata)
    assert metadata_file.reused == 0
    assert pickled == {"state_dict_metadata": 2, "storage_data": 200}
    next_save(metadata, 3)
    metadata.storage_data = storage_data(list(metadata.state_dict_metadata), length=48)
    data = metadata_file.dumps(metadata)  # from storage_data: the last call's first change
    check_reads_back(data, metadata)
    assert metadata_file.reused == 2
    assert pickled == {"state_dict_metadata": 2, "storage_data": 300}
    next_save(metadata, 4)
    metadata.state_dict_metadata = state_dict_metadata(60)
    data = metadata_file.dumps(metadata)
    check_reads_back(data, metadata)
    assert metadata_file.reused == 0
    assert pickled == {"state_dict_metadata": 3, "storage_data": 400}


def test_objects_shared_between_kept_and_new_fields_stay_shared() -> None:
    """The fields pickled again refer to objects of the kept ones through the memo kept: the
    unpickled objects are shared as in DCP's file (a wrong memo would break this, or the
    stream)."""
    metadata_file = MetadataFile()
    metadata = metadata_of()
    shared = ["shared", "list"]
    metadata.planner_data["modules"] = shared
    for step in (1, 2, 3):
        metadata.storage_meta = dcp_metadata.StorageMeta(
            checkpoint_id=f"/ckpt/step_{step}", save_id=str(step), modules=shared
        )
        data = metadata_file.dumps(metadata)
        check_reads_back(data, metadata)
        loaded = pickle.loads(data)
        assert loaded.storage_meta.modules is loaded.planner_data["modules"], step
        safe = load_metadata_safely(io.BytesIO(data))
        assert safe.storage_meta.modules is safe.planner_data["modules"], step
    assert metadata_file.reused == 3


def test_other_attributes_are_written_in_their_order() -> None:
    metadata_file = MetadataFile()
    metadata = metadata_of()
    metadata.extra = {"note": "kept"}  # type: ignore[attr-defined]
    for step in (1, 2):
        next_save(metadata, step)
        check_reads_back(metadata_file.dumps(metadata), metadata)
    del metadata.version
    check_reads_back(metadata_file.dumps(metadata), metadata)


def test_a_payload_pickle_writes_outside_its_frames_falls_back_to_dcps_pickle() -> None:
    metadata_file = MetadataFile()
    metadata = metadata_of()
    metadata_file.dumps(metadata)
    next_save(metadata, 2)
    metadata.storage_meta.save_id = "x" * 100_000  # (64 KiB and more: written unframed)
    data = metadata_file.dumps(metadata)
    assert data == pickle.dumps(metadata, 4)
    next_save(metadata, 3)
    data = metadata_file.dumps(metadata)
    check_reads_back(data, metadata)
    assert metadata_file.reused == 0  # (everything was dropped)


def test_forget_drops_what_is_kept(pickled: dict[str, int]) -> None:
    metadata_file = MetadataFile()
    metadata = metadata_of()
    metadata_file.dumps(metadata)
    metadata_file.forget()
    next_save(metadata, 2)
    check_reads_back(metadata_file.dumps(metadata), metadata)
    assert metadata_file.reused == 0
    assert pickled == {"state_dict_metadata": 2, "storage_data": 200}


@pytest.mark.parametrize("key", [("same",), None])
def test_storage_data_is_the_last_dict_where_the_write_results_are_the_same(key: Any) -> None:
    metadata_file = MetadataFile()
    made: list[dict[str, int]] = []

    def make() -> dict[str, int]:
        made.append({"made": len(made)})
        return made[-1]

    first = metadata_file.storage_data(key, make)
    second = metadata_file.storage_data(key, make)
    if key is None:  # not known: made each time
        assert first is made[0] and second is made[1]
    else:
        assert first is second is made[0] and len(made) == 1
        third = metadata_file.storage_data(("other",), make)
        assert third is made[1]
        metadata_file.forget()
        assert metadata_file.storage_data(("other",), make) is made[2]
