"""Reading and writing tensors with torch.distributed.checkpoint, without running pickled code.

DCP stores its global ``.metadata`` with pickle and loads non-tensor items with
``torch.load(weights_only=False)``. ckptmgr stores only tensors through DCP and reads the
metadata with an unpickler restricted to DCP's own metadata classes
(:mod:`ckptmgr.safe_metadata`).

Every file DCP writes is checksummed (CRC-32) while its bytes stream out, into the writer's
``checksums`` (:class:`~ckptmgr.integrity.ChecksumLog`), and every file a reader opens is checked
against the sizes and checksums of the commit record before DCP sees a byte of it (see
:mod:`ckptmgr.integrity`). Paths named by DCP's metadata never leave the step directory.

On remote stores DCP's files go through
:class:`~ckptmgr.remote_filesystem.RetryingFileSystem`: every request retried, and
``.metadata`` written directly instead of as ``.metadata.tmp`` plus a rename (a rename is a copy
and a delete on object stores).
"""

from __future__ import annotations

import inspect
import io
import logging
import os
import pickle
import threading
import warnings
import zipfile
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any, TypeVar

import fsspec
import fsspec.core
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import known_implementations as fsspec_known_implementations
from fsspec.registry import registry as fsspec_registered
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckptmgr import tensor_bytes
from ckptmgr.collective_load import load_over_group
from ckptmgr.collective_save import save_over_group
from ckptmgr.direct_write import DIRECT_ALIGN
from ckptmgr.errors import CheckpointError, CorruptCheckpointError
from ckptmgr.integrity import (
    ChecksumLog,
    Expected,
    HashingWriter,
    check_content,
    check_relative_path,
    crc32,
    crc32_of_stream,
    relative_name,
)
from ckptmgr.kept_results import KeptResults
from ckptmgr.load_chunks import chunk_stand_ins
from ckptmgr.local_files import open_step_file
from ckptmgr.metadata_file import MetadataFile
from ckptmgr.remote_filesystem import RetryingFileSystem
from ckptmgr.retry import Retrier, RetryConfig
from ckptmgr.safe_metadata import load_metadata_safely
from ckptmgr.save_process import CHECKSUMS_ATTRIBUTE, COMMITTED_ATTRIBUTE, LISTING_ATTRIBUTE
from ckptmgr.stand_in_planning import plan_with_stand_ins
from ckptmgr.state_lookup import find_item_tensor
from ckptmgr.storage import is_object_store, local_file_sizes, open_filesystem, write_synced
from ckptmgr.torch_versions import checked_torch
from ckptmgr.write_results import WriteResults

T = TypeVar("T")

try:  # the version DCP's writer puts on the metadata it writes
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
except ImportError:  # pragma: no cover
    CURRENT_DCP_VERSION = None  # type: ignore[assignment]

try:  # _StorageInfo (an item's file, offset and length) is private; stable since torch 2.0
    from torch.distributed.checkpoint.filesystem import _StorageInfo
except ImportError:  # pragma: no cover
    _StorageInfo = None  # type: ignore[assignment,misc]

try:  # DCP's save after its conversion of Stateful items (private; stable since torch 2.2)
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict
except ImportError:  # pragma: no cover
    _save_state_dict = None  # type: ignore[assignment]

_SAVE_ARGUMENTS = ("state_dict", "storage_writer", "process_group", "no_dist", "planner")
_SAVE_WITHOUT_STATEFUL_PASS = (
    _save_state_dict
    if _save_state_dict is not None
    and set(_SAVE_ARGUMENTS) <= set(inspect.signature(_save_state_dict).parameters)
    else None
)
"""``dcp.save`` less the pass that calls ``state_dict()`` on each ``Stateful`` item of the state,
where this torch has it: that pass wraps every item in DCP's method logger (about 50 µs each:
a quarter of a save of 5,000 small DTensors, on the writer thread holding the GIL), and what
ckptmgr hands DCP is tensors only, never a ``Stateful``."""

try:  # FsspecReader/Writer live in a private module; the import path has been stable since 2.2.
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
except ImportError:  # pragma: no cover - very old torch
    from torch.distributed.checkpoint import FsspecReader, FsspecWriter  # type: ignore

# A plain single process is a supported mode, not a mistake: keep DCP from warning on every call.
warnings.filterwarnings(
    "ignore",
    message=r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent "
    r"is to (save|load) in a single process",
    category=UserWarning,
)


def _not_ckptmgrs_refusal(record: logging.LogRecord) -> bool:
    """False for DCP's warnings that it falls back to rank-local metadata when the error is
    ckptmgr's refusal of a ``.metadata`` (ckptmgr writes none, and raises the refusal itself):
    two full tracebacks on standard error for every damaged step ``restore_latest`` passed.
    DCP's loader logs them on the root logger: every other record passes."""
    if record.module != "state_dict_loader" or not record.exc_info:
        return True
    if _DCP_SOURCES not in os.path.normpath(record.pathname):  # (a module of the user's so named)
        return True
    return not isinstance(record.exc_info[1], CorruptCheckpointError)


_DCP_SOURCES = os.path.join("torch", "distributed", "checkpoint")


logging.getLogger().addFilter(_not_ckptmgrs_refusal)  # (where DCP's loader logs them)


def read_metadata_file(
    fs: Any, step_path: str, listed: Collection[str] | None = None
) -> dcp_metadata.Metadata:
    """Read ``<step_path>/.metadata`` from the fsspec file system ``fs`` with the restricted
    unpickler (``CorruptCheckpointError`` when it is missing or refused, or names a data file
    that ``listed``, the commit record's files, lacks: a restore refuses to read one)."""
    path = f"{step_path.rstrip('/')}/.metadata"
    try:
        if isinstance(fs, LocalFileSystem):  # a FIFO, a device: refused, not waited on
            with open_step_file(path, ".metadata") as stream:
                metadata = load_metadata_safely(stream)
        else:
            with fs.open(path, "rb") as stream:
                metadata = load_metadata_safely(stream)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError("checkpoint metadata is missing", path=".metadata") from exc
    if listed is not None:
        named = {info.relative_path for info in dict.values(metadata.storage_data or {})}
        for name in sorted(named - set(listed)):
            raise CorruptCheckpointError(
                f"{name}, named by .metadata, is not listed in the commit record", path=name
            )
    return metadata


class _SafeMetadataMixin:
    """Replaces DCP's ``pickle.load`` of ``.metadata`` with :func:`load_metadata_safely`."""

    fs: Any
    load_id: Any
    path: Any
    metadata_error: CorruptCheckpointError | None = None
    """Why ``.metadata`` was refused (DCP replaces the error with an AssertionError of its own)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None and self.metadata_error is not None:
            raise self.metadata_error  # ckptmgr writes no rank-local metadata: no fallback
        get_path = getattr(self, "_get_metadata_path", None)
        path = (
            get_path(kwargs.get("rank"))
            if get_path
            else self.fs.concat_path(self.path, ".metadata")
        )
        try:
            with self.fs.create_stream(path, "rb") as stream:
                metadata = load_metadata_safely(stream)
        except CorruptCheckpointError as exc:
            self.metadata_error = exc
            raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class ChecksummingFileSystem(FileSystem):
    """DCP's local file system: writes are checksummed as they stream out, reads are checked
    against the commit record, and paths never leave the step directory."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        checksums: ChecksumLog | None = None,
        expected: Mapping[str, Expected] | None = None,
    ) -> None:
        super().__init__()
        self.root = os.fspath(Path(root))  # normalised like the Paths DCP passes in
        self.checksums = checksums
        self.expected = expected

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        name = relative_name(self.root, path)
        if "r" in mode:
            with open_step_file(path, name) as stream:
                if self.expected is not None:
                    size, crc = crc32_of_stream(stream)
                    check_content(name, self.expected, size, crc)
                    stream.seek(0)
                yield stream  # type: ignore[misc]
            return
        with open(path, mode) as target:
            hashing = HashingWriter(target)
            yield hashing
            hashing.close()
        if self.checksums is not None:
            self.checksums.add(name, hashing.size, hashing.crc)

    def write_small_file(self, path: str | os.PathLike[str], data: bytes) -> None:
        """Write ``data`` to a new file at ``path`` and fsync it; its checksum is logged."""
        write_synced(os.fspath(path), data)
        if self.checksums is not None:
            self.checksums.add(relative_name(self.root, path), len(data), crc32(data))

    @contextmanager
    def open_data_file(self, path: str | os.PathLike[str]) -> Iterator[tensor_bytes.TensorSink]:
        """A data file written with raw tensor bytes: fsynced, its checksum logged on close."""
        sink = tensor_bytes.LocalDataFile(path, fsync=True)
        try:
            yield sink
        except BaseException:
            sink.abort()
            raise
        size, crc = sink.close()
        if self.checksums is not None:
            self.checksums.add(relative_name(self.root, path), size, crc)

    def write_data_file(
        self, path: str | os.PathLike[str], write: Callable[[tensor_bytes.TensorSink], T]
    ) -> T:
        """``write(sink)`` into a new data file (:meth:`open_data_file`); returns its result."""
        with self.open_data_file(path) as sink:
            return write(sink)

    @contextmanager
    def open_data_source(
        self, path: str | os.PathLike[str], *, hash_inline: bool = False
    ) -> Iterator[tensor_bytes.TensorSource]:
        """A data file read in place, hashed as it is read (``hash_inline``: on the reading
        thread, see :class:`ckptmgr.tensor_bytes.VerifyingLocalFile`) and checked by
        ``finish()``."""
        name = relative_name(self.root, path)
        check = None
        if self.expected is not None:
            expected = self.expected

            def check(size: int, crc: int) -> None:
                check_content(name, expected, size, crc)

        try:
            source = tensor_bytes.VerifyingLocalFile(path, name, check, hash_inline=hash_inline)
        except FileNotFoundError as exc:
            raise CorruptCheckpointError("a data file is missing", path=name) from exc
        try:
            yield source
        finally:
            source.close()

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str | os.PathLike[str]:
        check_relative_path(suffix)
        return super().concat_path(path, suffix)

    def replace(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        """Rename ``path`` to ``new_path``, removing a file there first (as DCP's finish)."""
        if self.exists(new_path):
            self.rm_file(new_path)
        self.rename(path, new_path)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        if self.checksums is not None:
            self.checksums.rename(
                relative_name(self.root, path), relative_name(self.root, new_path)
            )

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        super().rm_file(path)
        if self.checksums is not None:
            self.checksums.discard(relative_name(self.root, path))


DATA_SUFFIX = ".distcp"
_CHECKSUMS_FQN = "\x00ckptmgr-checksums/"  # a write result that carries a rank's checksums


_METADATA_FILE = ".metadata"  # (DCP's name for it)


def _results_key(results: list[list[WriteResult]]) -> object | None:
    """Every rank's write results as plain values, equal exactly where the results are (less the
    ranks' checksum reports, which do not go into ``.metadata``); None where some rank's are
    not :class:`WriteResults`, or hold others than of written items and checksum reports."""
    key = []
    for rank_results in results:
        if not isinstance(rank_results, WriteResults):
            return None
        files, rows, others = rank_results.flattened()
        if any(not result.index.fqn.startswith(_CHECKSUMS_FQN) for _, result in others):
            return None
        key.append((files, rows))
    return key


def _balanced(bins: int, items: list[WriteItem]) -> list[list[WriteItem]]:
    """``items`` split into at most ``bins`` lists of similar byte size. In each list, the
    items of whole ``DIRECT_ALIGN`` blocks come first, largest first, then the others, largest
    first: every item of the first kind starts on a block boundary of its data file, where a
    direct write can take it from its (page-aligned, see ``staging.PAGE_ALIGNED_BYTES``) staged
    memory without a copy (:mod:`ckptmgr.direct_write`). No more lists than items are made,
    whatever ``bins`` (``num_of_threads``) is."""
    buckets: list[list[tuple[int, WriteItem]]] = [[] for _ in range(max(1, min(bins, len(items))))]
    loads = [0] * len(buckets)
    sized = sorted(((_item_bytes(item), item) for item in items), key=_size, reverse=True)
    for nbytes, item in sized:
        lightest = loads.index(min(loads))
        buckets[lightest].append((nbytes, item))
        loads[lightest] += nbytes
    for bucket in buckets:
        bucket.sort(key=lambda pair: pair[0] % DIRECT_ALIGN != 0)  # (a stable sort)
    return [[item for _, item in bucket] for bucket in buckets if bucket]


def _size(pair: tuple[int, WriteItem]) -> int:
    return pair[0]


def _item_bytes(item: WriteItem) -> int:
    data = item.tensor_data
    if data is None:
        return 0
    numel = 1
    for size in data.chunk.sizes:
        numel *= size
    return numel * data.properties.dtype.itemsize


_ATTRIBUTES_OF_A_SAVE = (CHECKSUMS_ATTRIBUTE, LISTING_ATTRIBUTE, COMMITTED_ATTRIBUTE)
"""What :meth:`_RawTensorWriter.finish` puts on DCP's metadata after writing ``.metadata``."""


class _RawTensorWriter:
    """Replaces DCP's ``write_data``: each tensor item is written as its raw bytes (see
    :mod:`ckptmgr.tensor_bytes`), one data file per writer thread (``thread_count``)."""

    fs: Any
    path: Any
    thread_count: int
    checksums: ChecksumLog | None = None
    small_files: Mapping[str, bytes] = MappingProxyType({})
    """Files of this rank that the writer writes beside its data files (name -> bytes: the
    objects file; from the checkpoint daemon in process mode): on an object store at the same
    time as the data files, elsewhere before them."""
    commit: Callable[[dcp_metadata.Metadata], Any] | None = None
    """Called by :meth:`finish` with the finished metadata (listing and checksums on it) to
    commit the step where it was written; what it returns goes on the metadata as
    ``COMMITTED_ATTRIBUTE`` (a :class:`ckptmgr.daemon_commit.DaemonCommit`: local, single
    process saves in the checkpoint daemon)."""
    metadata_file: MetadataFile | None = None
    """The last save's ``.metadata`` pickled field by field (:mod:`ckptmgr.metadata_file`; a
    manager's, handed to each of its writers): :meth:`finish` pickles only what changed since.
    None: DCP's own ``finish`` pickles it whole."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix
        pickled = [item.index.fqn for item in plan.items if item.type == WriteItemType.BYTE_IO]
        if pickled:
            raise CheckpointError(f"ckptmgr stores only tensors through DCP, not {pickled}")
        jobs = [
            (f"{prefix}{number}{DATA_SUFFIX}", bucket)
            for number, bucket in enumerate(_balanced(self.thread_count, plan.items))
        ]
        results: list[WriteResult] = []
        # On an object store each small file is a request, a round trip: sent beside the data
        # files. On a disk, written first, here (no thread for a write of milliseconds).
        beside = bool(self.small_files) and getattr(self.fs, "object_store", False)
        if self.small_files and not beside:
            self._write_small_files()
        workers = len(jobs) + (1 if beside else 0)
        if workers <= 1:
            for name, items in jobs:
                results.extend(self._write_file(planner, name, items))
        else:  # (a failure waits for every other write to end: none goes on after it)
            with ThreadPoolExecutor(workers, thread_name_prefix="ckptmgr-write") as pool:
                small = pool.submit(self._write_small_files) if beside else None
                futures = [pool.submit(self._write_file, planner, *job) for job in jobs]
                for future in futures:
                    results.extend(future.result())
                if small is not None:
                    small.result()
        if self.checksums is not None:  # this rank's files, for finish() on the coordinator
            names = {name for name, _ in jobs} | set(self.small_files)
            written = {n: v for n, v in self.checksums.snapshot().items() if n in names}
            index = dcp_metadata.MetadataIndex(f"{_CHECKSUMS_FQN}{prefix}")
            results.append(WriteResult(index=index, size_in_bytes=0, storage_data=written))
        done: Future[list[WriteResult]] = Future()
        done.set_result(WriteResults(results))  # (sent to the coordinator: pickled compactly)
        return done

    def finish(self, metadata: dcp_metadata.Metadata, results: list[list[WriteResult]]) -> None:
        """DCP's finish (``.metadata``) on the coordinator; the sizes and CRC-32s of every
        rank's files (reported in their write results) go on ``metadata`` as
        ``CHECKSUMS_ATTRIBUTE``, which DCP hands back to every rank, even from a checkpoint
        daemon process; on a local disk, so does the listing of the write directory
        (``LISTING_ATTRIBUTE``), which the commit record's file list is made from."""
        for name in _ATTRIBUTES_OF_A_SAVE:  # left by the last save on metadata DCP kept
            vars(metadata).pop(name, None)  # (ckptmgr.save_plans): not written in .metadata
        reported: dict[str, tuple[int, int]] = {}
        stored: list[list[WriteResult]] = []
        for rank_results in results:
            stored.append([])
            for result in rank_results:
                if result.index.fqn.startswith(_CHECKSUMS_FQN):
                    reported.update(result.storage_data)
                else:
                    stored[-1].append(result)
        if self.metadata_file is not None and self._writes_one_metadata_file():
            self._write_metadata(metadata, results, stored, self.metadata_file)
        else:
            super().finish(metadata, stored)  # type: ignore[misc]
        if self.checksums is not None:
            reported.update(self.checksums.snapshot())
        setattr(metadata, CHECKSUMS_ATTRIBUTE, reported)
        if isinstance(self, ChecksummingFileSystemWriter):  # every file is written by now
            setattr(metadata, LISTING_ATTRIBUTE, local_file_sizes(str(self.path)))
        if self.commit is not None:
            setattr(metadata, COMMITTED_ATTRIBUTE, self.commit(metadata))

    def _writes_one_metadata_file(self) -> bool:
        """True where DCP's ``finish`` writes the step's one ``.metadata`` as
        :meth:`_write_metadata` does: a torch whose ``FileSystemWriter.finish`` was checked
        against it, and a save with collectives (not a ``.metadata`` per rank)."""
        return (
            checked_torch()
            and CURRENT_DCP_VERSION is not None
            and (getattr(self, "use_collectives", True) or getattr(self, "rank", None) is None)
        )

    def _write_metadata(
        self,
        metadata: dcp_metadata.Metadata,
        results: list[list[WriteResult]],
        stored: list[list[WriteResult]],
        metadata_file: MetadataFile,
    ) -> None:
        """DCP's ``FileSystemWriter.finish`` (torch 2.10-2.14), with ``.metadata`` pickled by
        ``metadata_file``, and the last save's ``storage_data`` kept where every rank's write
        results (``results``; ``stored``: those that go into it) are the same as then."""
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = metadata_file.storage_data(
            _results_key(results),
            lambda: {result.index: result.storage_data for each in stored for result in each},
        )
        metadata.storage_meta = self.storage_meta()  # type: ignore[attr-defined]
        data = metadata_file.dumps(metadata)
        temporary = self.fs.concat_path(self.path, f"{_METADATA_FILE}.tmp")
        with self.fs.create_stream(temporary, "wb") as stream:
            stream.write(data)
            if getattr(self, "sync_files", True):
                try:
                    os.fsync(stream.fileno())
                except (AttributeError, io.UnsupportedOperation):
                    os.sync()  # (as DCP: a stream without a descriptor)
        self.fs.replace(temporary, self.fs.concat_path(self.path, _METADATA_FILE))

    def _write_small_files(self) -> None:
        """Write :attr:`small_files` (the directory exists by now)."""
        for name, data in self.small_files.items():
            self.fs.write_small_file(self.fs.concat_path(self.path, name), data)

    def _write_file(
        self, planner: SavePlanner, name: str, items: list[WriteItem]
    ) -> list[WriteResult]:
        tensors = []
        for item in items:
            data = planner.resolve_data(item)
            tensor_bytes.check_storable(item.index.fqn, data)
            tensors.append(data)
        spans = self.fs.write_data_file(
            self.fs.concat_path(self.path, name),
            lambda sink: tensor_bytes.write_tensors(sink, tensors),
        )
        return [
            WriteResult(
                index=item.index,
                size_in_bytes=length,
                storage_data=_StorageInfo(name, offset, length),
            )
            for item, (offset, length) in zip(items, spans, strict=True)
        ]


class _RawTensorReader:
    """Replaces DCP's ``read_data`` for checkpoints of raw tensor bytes (record format 2):
    bytes go straight into the destination tensors where they can, files are read in parallel
    (one thread per data file, up to ``READ_THREADS``), and every file is checked."""

    fs: Any
    path: Any
    storage_data: dict[Any, Any]
    raw: bool = False
    _chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]]
    _shared: set[int]  # ids of the read items whose destinations overlap another's
    _shared_copy: threading.Lock  # held while copying into such a destination

    def set_up_storage_reader(
        self, metadata: dcp_metadata.Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)  # type: ignore[misc]
        self._chunks = {}
        for fqn, item in metadata.state_dict_metadata.items():
            if isinstance(item, dcp_metadata.TensorStorageMetadata):
                for chunk in item.chunks:
                    key = (fqn, tuple(chunk.offsets))
                    self._chunks[key] = (item.properties.dtype, tuple(chunk.sizes))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not self.raw:
            return super().read_data(plan, planner)  # type: ignore[misc]
        # Destinations whose memory overlaps another's get no direct read: the CRC of a file is
        # computed from the bytes in the destination after the read, which a later read into
        # an overlapping destination (even one of another file) would change first.
        targets = [planner.resolve_tensor(request) for request in plan.items]
        self._shared = {id(plan.items[i]) for i in tensor_bytes.overlapping(targets)}
        self._shared_copy = threading.Lock()
        del targets
        per_file: dict[str, list[ReadItem]] = {}
        for request in plan.items:
            info = self.storage_data[request.storage_index]
            per_file.setdefault(info.relative_path, []).append(request)
        jobs = list(per_file.items())
        if len(jobs) <= 1:
            for name, requests in jobs:
                self._read_file(planner, name, requests)
        else:
            workers = min(len(jobs), READ_THREADS)
            with ThreadPoolExecutor(workers, thread_name_prefix="ckptmgr-read") as pool:
                for future in [pool.submit(self._read_file, planner, *job) for job in jobs]:
                    future.result()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_file(self, planner: LoadPlanner, name: str, requests: list[ReadItem]) -> None:
        by_chunk: dict[tuple[str, tuple[int, ...]], list[ReadItem]] = {}
        for request in requests:
            index = request.storage_index
            by_chunk.setdefault((index.fqn, tuple(index.offset or ())), []).append(request)
        ordered = sorted(
            by_chunk.items(), key=lambda pair: self.storage_data[pair[1][0].storage_index].offset
        )
        loaded: list[tuple[list[ReadItem], torch.Tensor, torch.Tensor | None]] = []
        devices: set[torch.device] = set()  # CUDA devices with copies in flight
        try:
            with self.fs.open_data_source(self.fs.concat_path(self.path, name)) as source:
                for key, chunk_requests in ordered:
                    found = self._chunks.get(key)
                    if found is None:
                        raise CorruptCheckpointError(
                            f"no stored chunk {key} in the checkpoint metadata", path=name
                        )
                    dtype, sizes = found
                    info = self.storage_data[chunk_requests[0].storage_index]
                    direct = None
                    alone = len(chunk_requests) == 1 and id(chunk_requests[0]) not in self._shared
                    if alone and _whole(chunk_requests[0], sizes):
                        target = planner.resolve_tensor(chunk_requests[0]).detach()
                        if tensor_bytes.reads_directly_into(target, dtype, sizes):
                            direct = target
                        elif tensor_bytes.streams_to_device(target, dtype, sizes):
                            # (a whole CUDA destination: through pinned pieces, no host copy)
                            if target.is_cuda:
                                devices.add(target.device)
                            tensor_bytes.read_chunk_to_device(
                                source,
                                info.offset,
                                info.length,
                                dtype,
                                sizes,
                                target,
                                pin=target.is_cuda,
                            )
                            loaded.append((chunk_requests, target, target))
                            continue
                    data = tensor_bytes.read_chunk(
                        source, info.offset, info.length, dtype, sizes, direct
                    )
                    loaded.append((chunk_requests, data, direct))
                source.finish()
        finally:  # no copy into a destination goes on after this (even on an error)
            for device in devices:
                torch.cuda.current_stream(device).synchronize()
        for chunk_requests, data, direct in loaded:
            for request in chunk_requests:
                if direct is not None:
                    planner.commit_tensor(request, direct)
                    continue
                piece = _narrow(data, request.storage_offsets, request.lengths)
                target = planner.resolve_tensor(request).detach()
                if target.size() != piece.size():
                    raise CheckpointError(
                        f"{request.storage_index.fqn!r}: stored piece {list(piece.size())} does "
                        f"not fit the destination {list(target.size())}"
                    )
                if id(request) in self._shared:  # files are read in parallel: one whole
                    with self._shared_copy:  # copy into overlapping memory at a time
                        target.copy_(piece)
                else:
                    target.copy_(piece)
                planner.commit_tensor(request, target)


READ_THREADS = 8
"""Data files read at the same time by one rank during a restore."""


def _whole(request: ReadItem, sizes: tuple[int, ...]) -> bool:
    """True when ``request`` wants the whole stored chunk of ``sizes``."""
    return all(offset == 0 for offset in request.storage_offsets) and tuple(
        request.lengths
    ) == tuple(sizes)


def _narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        if start != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    return tensor


class ChecksummingFileSystemWriter(_RawTensorWriter, FileSystemWriter):
    """DCP's local writer (fsynced files) that checksums every file while writing it; the
    sizes and CRC-32s end up in ``checksums``."""

    def __init__(self, path: str, *, thread_count: int) -> None:
        super().__init__(
            path, single_file_per_rank=True, sync_files=True, thread_count=thread_count
        )
        self.checksums = ChecksumLog()
        self.fs = ChecksummingFileSystem(path, checksums=self.checksums)


class SafeFileSystemReader(_RawTensorReader, _SafeMetadataMixin, FileSystemReader):
    """DCP's local reader with a restricted metadata unpickler; with ``expected`` (the commit
    record's files), every file is checked against its size and CRC-32. ``raw``: the data files
    hold raw tensor bytes (record format 2), else DCP's ``torch.save`` items (format 1)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        expected: Mapping[str, Expected] | None = None,
        raw: bool = True,
    ) -> None:
        super().__init__(path)
        self.fs = ChecksummingFileSystem(path, expected=expected)
        self.raw = raw


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """Loads tensors in place; refuses pickled (BYTE_IO) items instead of unpickling them.
    Plans with each DTensor layout's chunk worked out once (:mod:`ckptmgr.load_chunks`)."""

    def __init__(self) -> None:
        super().__init__(allow_partial_load=False)

    def create_local_plan(self) -> LoadPlan:
        planned, used = chunk_stand_ins(self.state_dict)
        if not used:
            return super().create_local_plan()
        return plan_with_stand_ins(self, planned, used, super().create_local_plan)

    def lookup_tensor(self, index: dcp_metadata.MetadataIndex) -> torch.Tensor:
        """The destination of an item: a DTensor's local tensor itself (see
        :mod:`ckptmgr.state_lookup`)."""
        return find_item_tensor(self.state_dict, index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"checkpoint item {read_item.dest_index.fqn!r} is a pickled object; ckptmgr never "
            "unpickles checkpoint data"
        )


class RetryingFsspecWriter(_RawTensorWriter, FsspecWriter):
    """DCP's fsspec writer over :class:`RetryingFileSystem`: retried uploads, no ``os.sync()``,
    ``.metadata`` written directly, and never into a directory that holds a checkpoint.

    ``prepared``: the caller listed the directory and cleared it for this save before any rank
    plans (the manager's ``prepare_write_dir`` on rank 0, whose outcome every rank waits for):
    DCP's own check for a ``.metadata`` there, made by every rank (on GCS a read and two
    listings each), is then left out.
    """

    def __init__(
        self, path: str, fs: Any, retrier: Retrier, *, thread_count: int, prepared: bool = False
    ) -> None:
        self.prepared = prepared
        self.checksums = ChecksumLog()
        FileSystemWriter.__init__(  # not FsspecWriter's: it would open a file system of its own
            self,
            path,
            single_file_per_rank=True,
            sync_files=False,  # fsspec streams have no fileno(): DCP would fall back to os.sync()
            thread_count=thread_count,
            overwrite=False,
        )
        self.fs = RetryingFileSystem(
            fs,
            retrier,
            object_store=is_object_store(fs),
            root=path,
            checksums=self.checksums,
        )
        self.path = path

    def _metadata_exists(self) -> bool:
        return False if self.prepared else super()._metadata_exists()


class SafeRetryingFsspecReader(_RawTensorReader, _SafeMetadataMixin, FsspecReader):
    """DCP's fsspec reader over :class:`RetryingFileSystem`, with the restricted unpickler
    (``raw`` as for :class:`SafeFileSystemReader`)."""

    def __init__(
        self,
        path: str,
        fs: Any,
        retrier: Retrier,
        *,
        expected: Mapping[str, Expected] | None = None,
        raw: bool = True,
        file_system: RetryingFileSystem | None = None,
    ) -> None:
        FileSystemReader.__init__(self, path)
        self.fs = file_system or RetryingFileSystem(
            fs, retrier, object_store=is_object_store(fs), root=path, expected=expected
        )
        self.path = path
        self.raw = raw


def make_writer(
    url_or_path: str,
    *,
    local: bool,
    thread_count: int,
    storage_options: dict[str, Any],
    retry: RetryConfig | None = None,
    prepared: bool = False,
) -> ChecksummingFileSystemWriter | RetryingFsspecWriter:
    """A DCP writer for one step directory: fsynced files locally; on other stores retried
    uploads without ``os.sync()`` (see :class:`RetryingFsspecWriter`; ``prepared``: the
    directory was listed and cleared for this save). Either way, the writer's ``checksums``
    holds the size and CRC-32 of every file it wrote."""
    if local:
        return ChecksummingFileSystemWriter(url_or_path, thread_count=thread_count)
    config = retry or RetryConfig()
    fs, _ = open_filesystem(url_or_path, storage_options, config)
    writer = RetryingFsspecWriter(
        url_or_path, fs, Retrier(config), thread_count=thread_count, prepared=prepared
    )
    writer.fs.reopen = (url_or_path, dict(storage_options), config)
    return writer


class WriterRecipe:
    """A DCP writer on its way to the checkpoint daemon: pickled as the arguments of
    :func:`make_writer` (and its ``small_files``), made in the daemon as it reads the request.
    The training process never builds the writer it does not write with.

    A file system registered with fsspec at run time (``fsspec.register_implementation``) is
    unknown in the daemon, a fresh process: its class goes along (pickled by its module and
    name) and is registered there before the writer is made."""

    __slots__ = ("arguments", "commit", "registered", "small_files", "url_or_path")

    def __init__(self, url_or_path: str, **arguments: Any) -> None:
        self.url_or_path = url_or_path
        self.arguments = arguments
        self.small_files: Mapping[str, bytes] = {}
        self.commit: Callable[[dcp_metadata.Metadata], Any] | None = None
        self.registered = _registered_at_run_time(url_or_path)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        arguments = (
            self.url_or_path,
            self.arguments,
            dict(self.small_files),
            self.commit,
            self.registered,
        )
        return (_writer_from_recipe, arguments)


def _registered_at_run_time(url: str) -> tuple[str, type] | None:
    """(protocol, class) of ``url``'s file system where fsspec knows it only from a
    registration at run time (not by name, as it knows its own and those of installed
    packages); None for the others and for local paths."""
    protocol, _ = fsspec.core.split_protocol(url)
    if protocol is None or protocol in fsspec_known_implementations:
        return None
    found = fsspec_registered.get(protocol)
    return None if found is None else (protocol, found)


def _writer_from_recipe(
    url_or_path: str,
    arguments: dict[str, Any],
    small_files: dict[str, bytes],
    commit: Callable[[dcp_metadata.Metadata], Any] | None,
    registered: tuple[str, type] | None = None,
) -> ChecksummingFileSystemWriter | RetryingFsspecWriter:
    """In the daemon: the writer a :class:`WriterRecipe` describes."""
    if registered is not None and registered[0] not in fsspec_registered:
        fsspec.register_implementation(*registered)
    writer = make_writer(url_or_path, **arguments)
    writer.small_files = small_files
    writer.commit = commit
    return writer


def make_reader(
    url_or_path: str,
    *,
    local: bool,
    storage_options: dict[str, Any],
    retry: RetryConfig | None = None,
    expected: Mapping[str, Expected] | None = None,
    raw: bool = True,
    beside: Any = None,
) -> SafeFileSystemReader | SafeRetryingFsspecReader:
    """A DCP reader for one committed step directory (retried reads on remote stores).

    ``expected`` (name -> size and CRC-32, from the commit record) makes every file be checked:
    a mismatch raises ``CorruptCheckpointError`` naming the file. A local data file is checked
    as it is read into the destination tensors (after such an error they may hold part of the
    step); a remote one is downloaded and checked before any of it is used. ``raw``: the step's
    data files hold raw tensor bytes (record format 2; see :func:`ckptmgr.record.is_raw`).
    ``beside``: another reader of the step, whose remote file system (and the files it reads
    ahead, :func:`read_metadata_ahead`) this one shares.
    """
    if local:
        return SafeFileSystemReader(url_or_path, expected=expected, raw=raw)
    config = retry or RetryConfig()
    fs, _ = open_filesystem(url_or_path, storage_options, config)
    shared = beside.fs if isinstance(beside, SafeRetryingFsspecReader) else None
    return SafeRetryingFsspecReader(
        url_or_path, fs, Retrier(config), expected=expected, raw=raw, file_system=shared
    )


def read_metadata_ahead(reader: Any) -> None:
    """Start reading the step's ``.metadata`` for ``reader`` (made by :func:`make_reader`) on a
    remote store, where it is a round trip that need not wait for the restore's other requests
    (a local read is left to the load)."""
    if isinstance(reader, SafeRetryingFsspecReader):
        reader.fs.read_ahead(reader.fs.concat_path(reader.path, _METADATA_FILE))


def save_tensors(
    tensors: dict[str, torch.Tensor],
    writer: Any,
    group: dist.ProcessGroup | None,
    planner: SavePlanner | None = None,
    kept_results: KeptResults | None = None,
    *,
    no_dist: bool | None = None,
) -> dcp_metadata.Metadata | None:
    """Write ``tensors`` with DCP; collective over ``group`` when distributed
    (:mod:`ckptmgr.collective_save`: the metadata is returned on the group's rank 0 only, None
    elsewhere); ``planner``: DCP's default planner when None (see :mod:`ckptmgr.save_plans` for
    one that keeps its plans; ``kept_results``, the write results kept between saves over the
    group, :mod:`ckptmgr.kept_results`). Without a group, ``no_dist`` tells DCP whether to
    save without collectives (None: when torch.distributed is not initialised; a torch whose
    ``_save_state_dict`` lacks the argument decides for itself). A
    tensor of a kind that cannot be stored (see :func:`tensor_bytes.check_storable`) that DCP
    fails on before writing it (a nested tensor, in planning) raises ``CheckpointError`` naming
    it."""
    if no_dist is None:
        no_dist = not (dist.is_available() and dist.is_initialized())
    try:
        if group is not None:
            planner = planner or DefaultSavePlanner()
            return save_over_group(tensors, writer, planner, group, kept_results)
        if _SAVE_WITHOUT_STATEFUL_PASS is None:
            return dcp.save(tensors, storage_writer=writer, process_group=group, planner=planner)
        return _SAVE_WITHOUT_STATEFUL_PASS(
            state_dict=tensors,
            storage_writer=writer,
            process_group=group,
            no_dist=no_dist,
            planner=planner,
        )
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # DCP's CheckpointException is a BaseException
        tensor_bytes.check_all_storable(tensors)
        raise


def load_tensors(
    tensors: dict[str, torch.Tensor],
    reader: Any,
    group: dist.ProcessGroup | None,
    planner: TensorOnlyLoadPlanner | None = None,
) -> None:
    """Fill ``tensors`` in place from a checkpoint with DCP; collective over ``group`` when
    distributed (:mod:`ckptmgr.collective_load`); ``planner``: a new
    :class:`TensorOnlyLoadPlanner` when None.

    Damage found while reading (a file that fails its check, metadata that is refused, a tensor
    record that cannot be decoded, a missing file) raises ``CorruptCheckpointError``, whichever
    rank found it; DCP's own ``CheckpointException`` is unwrapped. A destination that cannot be
    written to (see :func:`tensor_bytes.check_all_restorable`) raises ``CheckpointError``
    naming it.
    """
    planner = planner or TensorOnlyLoadPlanner()
    try:
        if group is not None:
            load_over_group(tensors, reader, planner, group)
        else:
            dcp.load(tensors, storage_reader=reader, planner=planner)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        raise_interruption(exc)
        corrupt = damage_in(exc) or getattr(reader, "metadata_error", None)
        if corrupt is not None:
            raise corrupt from exc
        tensor_bytes.check_all_restorable(tensors)
        raise


def original_error(error: BaseException) -> BaseException:
    """The original exception inside DCP's ``CheckpointException`` (first failing rank), whose
    own text is every failing rank's whole traceback.

    When that exception is not an ``OSError`` but was raised from or while handling one, the
    ``OSError`` is returned: torch.save's zip writer turns a failed write (``ENOSPC`` included)
    into ``RuntimeError("[enforce fail ...] unexpected pos ...")``, which says nothing useful.
    """
    if isinstance(error, CheckpointError):  # ckptmgr's own: it already says what happened
        return error
    return _os_error_behind(_first_failure(error))


def raise_interruption(error: BaseException) -> None:
    """Raise the ``KeyboardInterrupt`` (or ``SystemExit``) inside DCP's ``CheckpointException``,
    if that is what ``error`` holds: DCP catches every ``BaseException`` of a save's or load's
    steps, and Ctrl-C during a write or read would otherwise end as a failed save or restore
    (``CheckpointError``), which a training script may well catch and carry on after."""
    first = _first_failure(error)
    if first is not error and isinstance(first, (KeyboardInterrupt, SystemExit)):
        raise first from None  # (not DCP's exception around it: 100 lines for one Ctrl-C)


def _first_failure(error: BaseException) -> BaseException:
    """The exception of the first failing rank inside DCP's ``CheckpointException``, else
    ``error`` itself."""
    failures = getattr(error, "failures", None)
    if isinstance(error, CheckpointException) and isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        if isinstance(first, tuple) and first and isinstance(first[0], BaseException):
            return first[0]
        if isinstance(first, BaseException):
            return first
    return error


def _os_error_behind(error: BaseException) -> BaseException:
    """The first ``OSError`` in the cause/context chain of ``error``, else ``error`` itself."""
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and all(current is not other for other in seen):
        if isinstance(current, OSError):
            return current
        seen.append(current)
        current = current.__cause__ or current.__context__
    return error


_DAMAGE_TYPES: tuple[type[BaseException], ...] = (
    pickle.UnpicklingError,
    EOFError,
    zipfile.BadZipFile,
)


def damage_in(error: BaseException) -> CorruptCheckpointError | None:
    """The ``CorruptCheckpointError`` that ``error`` (possibly DCP's ``CheckpointException``,
    which holds the errors of every failing rank) stands for, or None when it is no damage."""
    causes: list[BaseException] = [error]
    failures = getattr(error, "failures", None)
    if isinstance(error, CheckpointException) and isinstance(failures, dict):
        for failure in failures.values():
            first = failure[0] if isinstance(failure, tuple) and failure else failure
            if isinstance(first, BaseException):
                causes.append(first)
    seen: set[int] = set()
    while causes:
        cause = causes.pop(0)
        if id(cause) in seen:
            continue
        seen.add(id(cause))
        if isinstance(cause, CorruptCheckpointError):
            return cause
        if isinstance(cause, FileNotFoundError):  # (gone while read: a remote read finds out late)
            missing = cause.filename or (cause.args[0] if cause.args else None)
            name = PurePosixPath(missing).name if isinstance(missing, str) else None
            return CorruptCheckpointError(f"a data file is missing: {cause!r}", path=name)
        if isinstance(cause, _DAMAGE_TYPES) or (
            isinstance(cause, RuntimeError) and "PytorchStreamReader" in str(cause)
        ):
            return CorruptCheckpointError(f"a tensor file cannot be decoded: {cause!r}")
        for nested in (cause.__cause__, cause.__context__):
            if nested is not None:
                causes.append(nested)
    return None
