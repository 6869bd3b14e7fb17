"""ckptmgr.write_results: a rank's write results pickle as flat rows and come back the same."""

from __future__ import annotations

import pickle

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from ckptmgr.write_results import WriteResults


def regular(count: int) -> list[WriteResult]:
    """Results as ckptmgr's writer makes them: two data files, shard offsets, index hints."""
    return [
        WriteResult(
            index=MetadataIndex(f"layers.{i}.weight", torch.Size([64 * (i % 3), 0]), i % 4 or None),
            size_in_bytes=512 + i,
            storage_data=_StorageInfo(f"__1_{i % 2}.distcp", i * 1024, 512 + i),
        )
        for i in range(count)
    ]


def assert_same(got: list[WriteResult], expected: list[WriteResult]) -> None:
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        assert mine == theirs
        assert mine.index.index == theirs.index.index  # (not compared by ==: a hint)
        assert type(mine.index.offset) is type(theirs.index.offset)  # (a torch.Size)
        assert type(mine.storage_data) is type(theirs.storage_data)
        if isinstance(theirs.storage_data, _StorageInfo):
            assert vars(mine.storage_data) == vars(theirs.storage_data)


def test_regular_results_pickle_without_an_object_per_result_and_come_back_the_same() -> None:
    results = regular(300)
    data = pickle.dumps(WriteResults(results))
    for name in (b"MetadataIndex", b"_StorageInfo", b"WriteResult\n", b"Size"):
        assert name not in data  # (only the function that rebuilds them is named)
    assert len(data) < len(pickle.dumps(results)) / 2
    back = pickle.loads(data)
    assert type(back) is WriteResults
    assert_same(back, results)


def test_results_of_other_shapes_pickle_as_they_are_in_their_places() -> None:
    results = regular(5)
    checksums = WriteResult(
        index=MetadataIndex("\x00ckptmgr-checksums/__1_"),  # (no offset)
        size_in_bytes=0,
        storage_data={"__1_0.distcp": (10, 1234)},
    )
    transformed = WriteResult(
        index=MetadataIndex("t", [0]),
        size_in_bytes=4,
        storage_data=_StorageInfo("__1_0.distcp", 0, 4, transform_descriptors=["zstd"]),
    )
    mixed = [checksums, *results[:2], transformed, *results[2:], checksums]
    back = pickle.loads(pickle.dumps(WriteResults(mixed)))
    assert_same(back, mixed)
    assert pickle.loads(pickle.dumps(WriteResults([]))) == []
