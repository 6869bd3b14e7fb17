"""Reading DCP's ``.metadata`` of a sharded state: ckptmgr's restricted unpickler against pickle.

Every rank unpickles the whole ``.metadata`` on every restore, and DCP's metadata holds an
object per chunk: a state of ``--tensors`` tensors each sharded over ``--ranks`` ranks has
tensors x ranks chunks. This builds such metadata (the classes and fields DCP writes for a
``Shard(0)`` DTensor; or reads a real file with ``--file``), pickles it as DCP does, and times,
interleaved in ``--rounds`` rounds of shuffled order in one process:

* ``pickle.loads``: the C unpickler, unrestricted (what DCP itself does; the floor);
* ``pickle._loads``: the pure-Python unpickler, unrestricted (the kind of unpickler ckptmgr used
  until it could refuse BUILD with the C one);
* ``load_metadata_safely``: ckptmgr's (the C unpickler with stand-ins, ckptmgr.safe_metadata).

It prints median milliseconds, microseconds per chunk and the ratio to ``pickle.loads``.

Usage::

    python benchmarks/bench_metadata_load.py --tensors 5000 --ranks 2 --rounds 7
"""

from __future__ import annotations

import argparse
import io
import pickle
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckptmgr.safe_metadata import load_metadata_safely


def sharded_metadata(tensors: int, ranks: int, rows: int = 4) -> dcp_metadata.Metadata:
    """What DCP writes for ``tensors`` float32 DTensors of ``rows * ranks`` x 256 items, each
    ``Shard(0)`` over ``ranks`` ranks (one data file per rank)."""
    items: dict[str, dcp_metadata.TensorStorageMetadata] = {}
    storage: dict[dcp_metadata.MetadataIndex, _StorageInfo] = {}
    chunk_bytes = rows * 256 * 4
    for index in range(tensors):
        fqn = f"model.layers.{index // 9}.param{index % 9}"
        chunks = [
            dcp_metadata.ChunkStorageMetadata(
                offsets=torch.Size([rank * rows, 0]), sizes=torch.Size([rows, 256])
            )
            for rank in range(ranks)
        ]
        props = dcp_metadata.TensorProperties(dtype=torch.float32)
        items[fqn] = dcp_metadata.TensorStorageMetadata(
            props, torch.Size([rows * ranks, 256]), chunks
        )
        for rank, chunk in enumerate(chunks):
            key = dcp_metadata.MetadataIndex(fqn, chunk.offsets, rank)
            storage[key] = _StorageInfo(f"__{rank}_0.distcp", index * chunk_bytes, chunk_bytes)
    return dcp_metadata.Metadata(
        state_dict_metadata=items,
        planner_data={},
        storage_data=storage,
        storage_meta=dcp_metadata.StorageMeta(checkpoint_id="/ckpt/step_000000000001"),
    )


def main() -> None:
    """Time the three unpicklers on one ``.metadata``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=5000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--file", type=Path, default=None, help="a real .metadata to read")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    if args.file is not None:
        data = args.file.read_bytes()
    else:
        data = pickle.dumps(sharded_metadata(args.tensors, args.ranks))
    reference = pickle.loads(data)
    chunks = len(reference.storage_data)
    methods: dict[str, Callable[[], object]] = {
        "pickle.loads (C, unrestricted)": lambda: pickle.loads(data),
        "pickle._loads (pure Python, unrestricted)": lambda: pickle._loads(data),  # type: ignore[attr-defined]
        "ckptmgr load_metadata_safely": lambda: load_metadata_safely(io.BytesIO(data)),
    }
    assert load_metadata_safely(io.BytesIO(data)) == reference
    times: dict[str, list[float]] = {name: [] for name in methods}
    shuffler = random.Random(args.seed)
    for _ in range(args.rounds):
        for name in shuffler.sample(list(methods), len(methods)):
            started = time.perf_counter()
            methods[name]()
            times[name].append(time.perf_counter() - started)

    print(
        f"torch {torch.__version__}; {len(data) / 1e6:.2f} MB of metadata, "
        f"{len(reference.state_dict_metadata)} items, {chunks} chunks; {args.rounds} rounds"
    )
    floor = statistics.median(times["pickle.loads (C, unrestricted)"])
    print("\n| unpickler | median ms | µs per chunk | / pickle.loads |")
    print("|---|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(
            f"| {name} | {median * 1e3:.1f} | {median / chunks * 1e6:.1f} | {median / floor:.2f}x |"
        )


if __name__ == "__main__":
    main()
