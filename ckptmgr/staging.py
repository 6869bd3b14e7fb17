"""Copying a state's tensors into reusable host buffers before a background write.

Each in-flight async save owns one :class:`StagingBuffers` (a *slot*). A slot keeps one host
**arena**: a single anonymous memory mapping that holds every staged tensor at a 64-byte aligned
offset. Each staged tensor is a ``torch.frombuffer`` slice of the arena, so it owns a storage of
exactly its own size (DCP's writer then writes it as it is, with no extra clone), while the whole
state costs one allocation.

* **Reuse.** The arena is allocated on the first save and reused by later saves; steady-state
  staging is one bulk copy (``torch._foreach_copy_``) into memory whose pages are already touched,
  with no allocation, no page faults and no per-tensor Python work beyond collecting the sources.
  Small tensors packed back to back are copied with one ``torch.cat`` per run of one dtype and
  trailing shape instead (about twice as fast per tensor).
  The layout (the views into the arena) is cached and rebuilt only when the state's structure
  (keys, shapes, dtypes, devices, storage sharing) changes.
* **Shape changes.** A new layout reuses the arena when it fits and uses at least half of it;
  otherwise the arena is replaced (grown or shrunk) and the old one is freed. An idle slot's
  arena that the latest layout would not keep is freed once it went unused for a few saves.
* **Views of one storage** (tied weights, slices of one flat parameter) are staged once: the
  covered byte range of the storage is copied into one arena region and every view is rebuilt on
  top of it with its own offset and strides. Small ones go into the pack instead, each copied
  on its own, as ``save()`` packs them: a view stored as an item of its own costs DCP's per-item
  work at every write and restore (20,000 views of 1 KiB of one flat buffer: 0.9 s to write,
  1.6 s to restore; 0.09 s and 0.07 s packed).
* **CUDA.** When a source is on CUDA the arena is pinned (``cudaHostRegister``); device tensors
  are copied with ``non_blocking`` copies on a side stream that waits for the current stream,
  followed by one synchronisation.
* **DTensor.** Only the local shard is copied; the staged value is a DTensor with the original
  spec whose local tensor lives in host memory.
* **Budget.** :class:`StagingPool` bounds the host memory of all slots together
  (``budget_bytes``). A save that would exceed it first frees idle slots' arenas, then waits for
  in-flight saves to release theirs (back-pressure instead of running out of memory).
"""

from __future__ import annotations

import itertools
import logging
import mmap
import operator
import os
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch

from ckptmgr import packing
from ckptmgr.direct_write import DIRECT_ALIGN
from ckptmgr.errors import CheckpointError
from ckptmgr.packing import (
    PACK_KEY,
    PackedTensor,
    PackFilter,
    candidates,
    fingerprint,
    pack_layout,
)
from ckptmgr.tensor_bytes import byte_extent, check_all_storable, check_storable

log = logging.getLogger(__name__)

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = None  # type: ignore[assignment,misc]

ALIGN = 64
"""Byte alignment of every region in an arena (a multiple of every dtype's item size)."""
PAGE_ALIGNED_BYTES = 64 * 2**10
"""A region of at least this many bytes (larger than any packed tensor) starts on a
``DIRECT_ALIGN`` boundary of the arena, so that a data file written directly takes its bytes
from where they lie (:mod:`ckptmgr.direct_write`) rather than through a copy."""

_WAIT_LOG_S = 10.0  # while waiting for budget, log again after this many seconds


def _local(tensor: torch.Tensor) -> torch.Tensor:
    if DTensor is not None and isinstance(tensor, DTensor):
        return tensor.to_local()
    return tensor


_ARENAS: weakref.WeakSet[_Arena] = weakref.WeakSet()  # every arena alive in this process
_ARENAS_LOCK = threading.Lock()  # held to add to _ARENAS, or to list it from another thread
_ARENA_TOKENS = itertools.count(1)  # names each arena made in this process, never reused
_INHERITED_MAPS: list[mmap.mmap] = []  # in a forked child: the parent's private arenas' maps


def _keep_inherited_maps() -> None:
    """In a forked child, keep every private arena's ``mmap`` object alive for good. The arena
    is not mapped here (``MADV_DONTFORK``), but the object would ``munmap`` its address range
    when dropped, and the child may have mapped memory of its own there since."""
    _INHERITED_MAPS.extend(arena._map for arena in list(_ARENAS) if arena._map is not None)


def _new_arenas_lock() -> None:
    """In a forked child: a lock of its own (a thread of the parent may have held it at the
    fork, and would never release it here)."""
    global _ARENAS_LOCK
    _ARENAS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_keep_inherited_maps)
    os.register_at_fork(after_in_child=_new_arenas_lock)


def _aligned(size: int) -> int:
    return (size + ALIGN - 1) // ALIGN * ALIGN


def _placed(offset: int, size: int) -> int:
    """Where in the arena a region of ``size`` bytes that could start at ``offset`` starts."""
    if size < PAGE_ALIGNED_BYTES:
        return offset
    return (offset + DIRECT_ALIGN - 1) // DIRECT_ALIGN * DIRECT_ALIGN


def _arena_fits(arena: _Arena, needed: int, pin: bool) -> bool:
    """True where ``needed`` bytes fit ``arena`` and use at least half of it, and its pinning is
    the one asked for: an arena to keep for them."""
    if arena.inherited or arena.pinned != (pin and torch.cuda.is_available()):
        return False
    return needed <= arena.size and needed * 2 >= arena.size


class _Arena:
    """``size`` bytes of host memory, pinned for CUDA when asked: one anonymous private mapping,
    or with ``shared`` one shared-memory storage (another process can map it: process mode).

    A private arena is not inherited by a forked child (``MADV_DONTFORK``). Otherwise every
    child alive (a DataLoader's workers, forked each epoch) would share its pages copy-on-write:
    the next staging copy would fault and copy every page (a 512 MiB arena: 0.79 s instead of
    0.03 s, and 512 MiB more memory while the child lives), and a pinned page copied so would
    no longer be the page the GPU writes to. In a child, :attr:`inherited` is then True and
    the arena must not be touched (nor a shared arena, whose memory the parent still uses).
    """

    def __init__(self, size: int, pin: bool, shared: bool = False) -> None:
        self.size = size
        self.token = next(_ARENA_TOKENS)  # this arena's name: unique in the process's life
        self.pinned = False
        self._pid = os.getpid()
        self._unpin: weakref.finalize | None = None  # undoes the pinning, once
        self._map: mmap.mmap | None = None
        self._storage: torch.UntypedStorage | None = None
        if shared:
            check_shared_memory(size)
            self._storage = torch.UntypedStorage._new_shared(max(size, 1))
            owner: object = self._storage
        else:
            self._map = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_DONTFORK"):  # Linux
                self._map.madvise(mmap.MADV_DONTFORK)
            owner = self._map
        if pin and size:  # (frombuffer refuses a zero-length region)
            self._unpin = _register_pinned(owner, self.region(0, size).data_ptr(), size)
            self.pinned = self._unpin is not None
        with _ARENAS_LOCK:
            _ARENAS.add(self)

    @property
    def inherited(self) -> bool:
        """True in a forked child of the process that made the arena (a private one is not
        mapped there; a shared one is the parent's)."""
        return os.getpid() != self._pid

    def unpin(self) -> None:
        """Undo the pinning now, while the memory is surely mapped (for a private arena,
        Python unmaps an mmap before it runs the finalizers that would do it otherwise)."""
        if self._unpin is not None:
            self._unpin()  # a weakref.finalize runs at most once

    @property
    def shared_storage(self) -> torch.UntypedStorage | None:
        """The one shared-memory storage of a shared arena (None for a private one)."""
        return self._storage

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over ``nbytes`` bytes at ``offset``: with a storage of its own in a
        private arena, a view of the one shared storage in a shared arena."""
        if self._storage is not None:
            view = torch.empty(0, dtype=torch.uint8)
            view.set_(self._storage, offset, (nbytes,))
            return view
        return torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=offset)

    def touch(self) -> None:
        """Fault every page in now (one write per page), so the first copy runs at full speed."""
        if self.size:
            whole = self.region(0, self.size)
            whole[:: mmap.PAGESIZE].zero_()


SHARED_MEMORY_DIR = "/dev/shm"
"""Where torch's shared memory lives on Linux (a tmpfs; 64 MiB by default in Docker)."""


def check_shared_memory(size: int, directory: str = SHARED_MEMORY_DIR) -> None:
    """Raise ``CheckpointError`` when ``directory`` has less than ``size`` bytes free: touching
    shared memory beyond the tmpfs' size kills the process with SIGBUS, so ask first."""
    try:
        stats = os.statvfs(directory)
    except OSError:  # not Linux, or no such tmpfs: torch will report what it finds
        return
    free = stats.f_bavail * stats.f_frsize
    if size > free:
        raise CheckpointError(
            f"async_mode='process' stages {size} bytes in shared memory, but {directory} has "
            f"only {free} bytes free; give the job more shared memory (Docker: --shm-size, "
            f"Kubernetes: an emptyDir with medium: Memory at /dev/shm) or use async_mode='thread'"
        )


def _register_pinned(owner: object, pointer: int, size: int) -> weakref.finalize | None:
    """Page-lock ``size`` bytes at ``pointer`` (memory of ``owner``) with ``cudaHostRegister``
    until ``owner`` is freed or the returned finalizer is called; None (unpinned) if that
    fails."""
    if size == 0 or not torch.cuda.is_available():
        return None
    try:
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(pointer, size, 0)) != 0:
            log.warning("cudaHostRegister of %d bytes failed; staging unpinned", size)
            return None
    except Exception as exc:  # pragma: no cover - depends on the CUDA runtime
        log.warning("could not pin %d staging bytes (%s); staging unpinned", size, exc)
        return None
    return weakref.finalize(owner, _unregister_pinned, pointer)


def _unregister_pinned(pointer: int) -> None:  # pragma: no cover - CUDA only
    try:
        torch.cuda.cudart().cudaHostUnregister(pointer)
    except Exception:
        pass


@dataclass
class _Layout:
    """Where each staged tensor lives in an arena, for one state structure."""

    signature: Hashable
    nbytes: int
    pin: bool
    # (region offset, region bytes, source byte start) per copy unit; a unit is one tensor or
    # the covered byte range of a storage shared by several tensors.
    units: list[tuple[int, int, int]]
    # per key: (unit index, None) for a tensor copied on its own, or (unit index, view spec) for
    # a view rebuilt on a shared region: (dtype, shape, stride, element offset in the region).
    entries: dict[str, tuple[int, tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int]]]
    shared: list[bool]  # per unit: True when it is a shared-storage byte range
    unit_keys: list[str]  # per unit: the key whose source storage the unit is copied from
    packed: dict[str, PackedTensor]  # small tensors staged back to back at the arena's start
    pack_bytes: int
    quick: tuple[object, ...]  # _quick_signature of the state it was made for
    plain: bool  # no DTensor: the quick signature and _views_still_share decide reuse
    # per shared unit: (unit index, the (key, storage offset, stride) of every view on it)
    share_groups: list[tuple[int, list[tuple[str, int, tuple[int, ...]]]]]
    on_cpu: bool  # every source is a CPU tensor: one host copy call
    pack_fingerprint: str | None = None  # packing.fingerprint(packed), once asked for


def shared_arenas() -> dict[int, tuple[int, torch.UntypedStorage]]:
    """Every shared-memory arena alive in this process (none inherited from a parent), by the
    address of its memory: (its token, its storage). A staged tensor of process mode is a view
    of one of them (its ``untyped_storage().data_ptr()`` is the key); the token names the arena
    for as long as the process lives, so that a daemon can keep it mapped from save to save."""
    found: dict[int, tuple[int, torch.UntypedStorage]] = {}
    with _ARENAS_LOCK:  # (the training thread may be making an arena for its next save)
        arenas = list(_ARENAS)
    for arena in arenas:
        storage = arena.shared_storage
        if storage is not None and not arena.inherited:
            found[storage.data_ptr()] = (arena.token, storage)
    return found


class StagingBuffers:
    """Host copies of one state's tensors, reused from save to save (one slot of the pool)."""

    def __init__(self, pool: StagingPool | None = None, *, shared: bool = False) -> None:
        self._pool = pool
        self._layout_bytes: tuple[int, bool] | None = None  # (bytes, pinned) of the layout
        self._shared = shared  # arenas in shared memory (async_mode="process")
        self._arena: _Arena | None = None
        self._layout: _Layout | None = None
        self._staged: dict[str, torch.Tensor] = {}  # cached views into the arena, per key
        self._unit_dst: list[torch.Tensor] = []  # destination region of each unit
        self._empty: dict[str, torch.Tensor] = {}  # zero-element tensors (no arena bytes)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # side streams, per device
        self._pack_view = torch.empty(0, dtype=torch.uint8)  # the pack region of the arena
        self._copy_dst: list[torch.Tensor] = []  # per unit not in a run: where it is copied to
        self._copy_keys: list[str] = []  # per unit not in a run: the key it is copied from
        self._share_positions: list[int] = []  # per share group: its unit's index in the above
        self._cat_runs: list[tuple[list[str], torch.Tensor]] = []  # (keys, pack region) per run
        self._gathers: list[tuple[list[str], torch.Tensor]] = []  # the same, of a CUDA stretch
        self._out: dict[str, torch.Tensor] = {}  # what stage() returns (before DTensor rewrap)
        # A state with DTensors: per DTensor key, the spec and local tensor's shape, dtype and
        # device of the DTensor last staged under it; and what stage() returned then (the
        # staged DTensors made once per layout and specs, then handed out by every save that
        # _same_dtensors finds alike)
        self._dtensor_specs: dict[str, tuple[Any, Any]] = {}
        self._dtensor_out: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Host bytes this slot holds (its arena's size)."""
        return self._arena.size if self._arena is not None else 0

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The staged host tensors of the last save, keyed like its state (local shards)."""
        return dict(self._staged)

    def free(self) -> None:
        """Drop the arena and the cached layout (the memory goes once no staged view is left;
        its pinning at once: a slot is freed only when no copy into it is in flight)."""
        if self._arena is not None and not self._arena.inherited:
            self._arena.unpin()
        self._arena = None
        self._layout = None
        self._staged = {}
        self._unit_dst = []
        self._empty = {}
        self._copy_dst = []
        self._copy_keys = []
        self._share_positions = []
        self._cat_runs = []
        self._gathers = []
        self._out = {}
        self._dtensor_specs = {}
        self._dtensor_out = {}
        self._pack_view = torch.empty(0, dtype=torch.uint8)  # a view keeps the arena mapped

    @property
    def pack_fingerprint(self) -> str:
        """:func:`ckptmgr.packing.fingerprint` of the pack of the last :meth:`stage` (computed
        once per layout)."""
        layout = self._layout
        if layout is None:
            return fingerprint({})
        if layout.pack_fingerprint is None:
            layout.pack_fingerprint = fingerprint(layout.packed)
        return layout.pack_fingerprint

    @property
    def packed(self) -> dict[str, PackedTensor]:
        """Where each packed tensor of the last :meth:`stage` lies in its pack (the same dict
        object from save to save while the layout is unchanged)."""
        return self._layout.packed if self._layout is not None else {}

    def stage(
        self, tensors: dict[str, torch.Tensor], *, pack: PackFilter | None = None
    ) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` into the arena and return the copies, keyed like ``tensors``.

        With ``pack``, small plain tensors whose names it accepts (see :mod:`ckptmgr.packing`;
        :func:`~ckptmgr.packing.any_name` for all) are staged back to back
        at the start of the arena and returned as one ``uint8`` tensor under ``PACK_KEY``
        instead of one by one; :attr:`packed` says where each lies. The pack then costs no
        copy beyond the staging copy itself.

        The copies are CPU tensors (each with a storage of its own, except views that shared a
        storage in ``tensors``, which share one region here too; in a shared-memory arena all
        are views of its one storage). A DTensor's local shard is
        copied (never the global tensor) and re-wrapped as a DTensor with the same mesh and
        placements, whose local tensor stays in host memory. When this returns, the caller may
        modify the originals freely.
        """
        if self._arena is not None and self._arena.inherited:
            self.free()  # a forked child: the parent's arena is not mapped or not its own
        layout = self._layout
        sources: Mapping[str, torch.Tensor] | None = None
        same_dtensors = False  # DTensors staged as before: the same staged DTensors returned
        if layout is not None and not layout.plain:
            sources = self._same_dtensors(layout, tensors, pack)
            same_dtensors = sources is not None
        if sources is None:
            try:
                quick = _quick_signature(tensors, pack)
            except Exception:  # (a nested tensor has no shape: say so, not torch's error)
                check_all_storable(tensors)
                raise
            if (
                layout is not None
                and layout.plain
                and layout.quick == quick
                and _views_still_share(layout, tensors)
            ):
                sources = tensors  # plain tensors laid out as before: copied as they are
        if sources is None:
            self._dtensor_specs, self._dtensor_out = {}, {}  # (until staged anew below)
            sources = {key: _local(tensor).detach() for key, tensor in tensors.items()}
            signature = (_signature(sources), pack)
            if layout is None or layout.signature != signature:
                pack_keys = candidates(tensors, pack) if pack is not None else []
                self._relayout(signature, quick, sources, pack_keys)
            else:  # same layout (e.g. tensors became parameters): recognise them quickly next
                layout.quick = quick  # (and plain tensors may have become DTensors, or back)
                layout.plain = _is_plain(quick)
            layout = self._layout
        assert layout is not None
        try:
            self._copy(layout, sources)
        except Exception:  # (a tensor turned sparse keeps the quick signature: say so
            check_all_storable(sources)  # rather than torch's error)
            raise
        if self._pool is not None:  # (what the idle slots' arenas are judged by)
            self._pool.latest_layout = self._layout_bytes
        if layout.plain:
            return dict(self._out)
        if not same_dtensors:
            self._dtensor_out = {
                key: buffer if key == PACK_KEY else self._rewrap(tensors[key], buffer)
                for key, buffer in self._out.items()
            }
            self._dtensor_specs = _dtensor_specs(tensors)
        return dict(self._dtensor_out)

    def _same_dtensors(
        self, layout: _Layout, tensors: Mapping[str, torch.Tensor], pack: bool
    ) -> dict[str, torch.Tensor] | None:
        """The sources to copy for ``tensors`` when they are staged as the last time, in a
        layout with DTensors: the same keys in the same order and ``pack``; every DTensor
        (exactly ``DTensor``) with the spec (mesh, placements, global shape, stride and dtype)
        of the one last staged under its key and a local tensor of the same shape, dtype and
        device; every other tensor of the type, dtype, shape and device of the quick signature;
        and views sharing as they did. Then each DTensor's local tensor, every other tensor as
        it is; None otherwise (for :meth:`stage` to look at the whole state).

        Such a state fits the layout without the full signature (the local tensors, a
        ``to_local()`` and a ``detach()`` per DTensor, a look at every storage, and a staged
        DTensor made for each: about 30 µs a DTensor, 0.15 s a save of 5,000 on the training
        thread). The copy runs without autograd, so the local tensors are copied as they
        are."""
        kept = self._dtensor_specs
        was_pack, keys, kinds = layout.quick
        if not kept or was_pack != pack or list(tensors) != keys:  # (no kept: DTensor subclass)
            return None
        sources: dict[str, torch.Tensor] = {}
        for (key, tensor), kind in zip(tensors.items(), cast(list, kinds), strict=True):
            held = kept.get(key)
            if held is None:
                if (tensor.__class__, tensor.dtype, tensor.shape, tensor.device) != kind:
                    return None
                sources[key] = tensor
                continue
            if type(tensor) is not DTensor:
                return None
            spec, local_meta = held
            found = tensor._spec
            local = tensor._local_tensor
            if (found is not spec and found != spec) or _LOCAL_META(local) != local_meta:
                return None
            sources[key] = local
        if not _views_still_share(layout, sources):
            return None
        return sources

    # -- layout ----------------------------------------------------------------------------------
    def _relayout(
        self,
        signature: Hashable,
        quick: tuple[object, ...],
        sources: dict[str, torch.Tensor],
        pack_keys: list[str],
    ) -> None:
        by_storage: dict[Hashable, list[str]] = {}
        for key, source in sources.items():
            check_storable(key, source)  # once per layout (a quantized or meta tensor changes
            if source.numel() == 0:  # its dtype or device, so the layout is made anew)
                continue
            by_storage.setdefault(_storage_id(key, source), []).append(key)
        units: list[tuple[int, int, int]] = []
        shared: list[bool] = []
        unit_keys: list[str] = []
        entries: dict[str, tuple[int, tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int]]]
        entries = {}
        offset = 0
        # The pack first, laid out as packing.pack_layout says: every small tensor, views of a
        # storage other keys share too (each copied on its own, as save() packs them: the
        # storage's other views are staged over its covered range below).
        packed = pack_layout(sources, pack_keys)
        for key, entry in packed.items():
            entries[key] = (len(units), (entry.dtype, entry.shape, (), -1))
            units.append((entry.offset, entry.nbytes, 0))
            shared.append(False)
            unit_keys.append(key)
            offset = entry.offset + entry.nbytes
        pack_bytes = offset
        offset = _aligned(offset)
        for keys in by_storage.values():
            keys = [key for key in keys if key not in packed]
            if not keys:
                continue
            if len(keys) == 1:
                source = sources[keys[0]]
                size = source.numel() * source.element_size()
                offset = _placed(offset, size)
                entries[keys[0]] = (len(units), (source.dtype, tuple(source.shape), (), -1))
                units.append((offset, size, 0))
                shared.append(False)
                unit_keys.append(keys[0])
                offset += _aligned(size)
                continue
            lows, highs = [], []
            for key in keys:
                low, high = byte_extent(sources[key])
                lows.append(low)
                highs.append(high)
            start = min(lows) // 16 * 16  # keeps every view's offset a multiple of its item size
            size = max(highs) - start
            offset = _placed(offset, size)
            for key in keys:
                source = sources[key]
                element = (source.storage_offset() * source.element_size() - start) // (
                    source.element_size()
                )
                spec = (source.dtype, tuple(source.shape), tuple(source.stride()), element)
                entries[key] = (len(units), spec)
            units.append((offset, size, start))
            shared.append(True)
            unit_keys.append(keys[0])
            offset += _aligned(size)
        pin = any(source.device.type == "cuda" for source in sources.values())
        self._ensure_arena(offset, pin)
        arena = self._arena
        assert arena is not None
        unit_dst = [arena.region(off, size) for off, size, _ in units]
        staged: dict[str, torch.Tensor] = {}
        for key, (unit, (dtype, shape, stride, element)) in entries.items():
            region = unit_dst[unit]
            if not shared[unit]:
                staged[key] = region.view(dtype).view(shape)
            else:
                view = torch.empty(0, dtype=dtype)
                base = region.storage_offset() // dtype.itemsize  # 0 unless the arena is shared
                view.set_(region.untyped_storage(), base + element, shape, stride)
                staged[key] = view
        self._empty = {
            key: torch.empty(source.shape, dtype=source.dtype)
            for key, source in sources.items()
            if source.numel() == 0
        }
        members: dict[int, list[tuple[str, int, tuple[int, ...]]]] = {}
        for key, (unit, _) in entries.items():
            if shared[unit]:
                source = sources[key]
                view = (key, source.storage_offset(), tuple(source.stride()))
                members.setdefault(unit, []).append(view)
        plain = _is_plain(quick)
        self._layout = _Layout(
            signature,
            offset,
            pin,
            units,
            entries,
            shared,
            unit_keys,
            packed,
            pack_bytes,
            quick,
            plain,
            list(members.items()),
            all(source.device.type == "cpu" for source in sources.values()),
        )
        self._unit_dst = unit_dst
        self._staged = staged
        copy_dst = [
            unit_dst[unit] if shared[unit] else staged[key] for unit, key in enumerate(unit_keys)
        ]
        runs = _cat_runs(
            list(packed.values()), [sources[key].device.type == "cpu" for key in packed]
        )
        gathers = _gathers(
            list(packed.values()),
            [sources[key].device for key in packed],
            packing.FLATTEN_MAX_DEVICE_BYTES,
        )
        in_runs = {unit for first, end in runs + gathers for unit in range(first, end)}
        rest = [unit for unit in range(len(units)) if unit not in in_runs]
        position = {unit: index for index, unit in enumerate(rest)}
        self._copy_dst = [copy_dst[unit] for unit in rest]
        self._copy_keys = [unit_keys[unit] for unit in rest]
        self._share_positions = [position[unit] for unit, _ in self._layout.share_groups]
        self._cat_runs = []
        for first, end in runs:  # packed units are the first units, in pack order
            head, tail = units[first], units[end - 1]
            entry = packed[unit_keys[first]]
            region = arena.region(head[0], tail[0] + tail[1] - head[0])
            out = region.view(entry.dtype).view(-1, *entry.shape[1:])
            self._cat_runs.append((unit_keys[first:end], out))
        self._gathers = []
        for first, end in gathers:
            head, tail = units[first], units[end - 1]
            region = arena.region(head[0], tail[0] + tail[1] - head[0])
            self._gathers.append(
                (unit_keys[first:end], region.view(packed[unit_keys[first]].dtype))
            )
        self._pack_view = (
            arena.region(0, pack_bytes) if pack_bytes else torch.empty(0, dtype=torch.uint8)
        )
        out = {key: staged.get(key, self._empty.get(key)) for key in sources if key not in packed}
        if packed:
            out[PACK_KEY] = self._pack_view
        self._out = out  # type: ignore[assignment]

    def _ensure_arena(self, needed: int, pin: bool) -> None:
        """Keep the arena if ``needed`` fits and uses at least half of it, else replace it (with
        an idle slot's that fits, where the budget would free that one: see ``_reserve``)."""
        self._layout_bytes = (needed, pin)
        if self._arena is not None and _arena_fits(self._arena, needed, pin):
            return
        old = self.nbytes
        self.free()
        if self._pool is not None:
            adopted = self._pool._reserve(self, needed, old, pin)
            if adopted is not None:
                self._arena = adopted
                return
        arena = _Arena(needed, pin, self._shared)
        if not arena.pinned:
            arena.touch()  # cudaHostRegister already faulted a pinned arena in
        self._arena = arena

    # -- copying ---------------------------------------------------------------------------------
    def _copy(self, layout: _Layout, sources: Mapping[str, torch.Tensor]) -> None:
        srcs = [sources[key] for key in self._copy_keys]
        # a shared storage's covered bytes, once
        shared = zip(self._share_positions, layout.share_groups, strict=True)
        for position, (unit, members) in shared:
            _, size, start = layout.units[unit]
            # Distinct storages can start at one address (tensors from NumPy views of one
            # array): copy through the largest, which holds every view's bytes.
            source = max((sources[key] for key, _, _ in members), key=_storage_bytes)
            src = torch.empty(0, dtype=torch.uint8, device=source.device)
            src.set_(source.untyped_storage(), start, (size,), (1,))
            srcs[position] = src
        dsts = self._copy_dst
        with torch.no_grad():  # sources may be parameters: no autograd graph on the copies
            for keys, out in self._cat_runs:  # packed runs: CPU sources, back to back in ``out``
                torch.cat([sources[key] for key in keys], out=out)
            if not layout.on_cpu:
                host = [i for i, src in enumerate(srcs) if src.device.type == "cpu"]
                others = [i for i, src in enumerate(srcs) if src.device.type != "cpu"]
                gathers = [([sources[key] for key in keys], out) for keys, out in self._gathers]
                self._copy_from_devices([(dsts[i], srcs[i]) for i in others], gathers)
                dsts, srcs = [dsts[i] for i in host], [srcs[i] for i in host]
            if dsts:
                torch._foreach_copy_(dsts, srcs)

    def _copy_from_devices(
        self,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        gathers: list[tuple[list[torch.Tensor], torch.Tensor]],
    ) -> None:
        """Device-to-host copies: non-blocking on a side stream of each source's device (a
        CUDA copy runs on the current stream of its source's device), each ordered after that
        device's current stream, then one synchronisation per device.

        ``gathers`` are (sources on one CUDA device, host region): the sources are flattened
        back to back on their device in one call, then copied to the region in one piece,
        instead of one copy per (small) tensor.
        """
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        gathers_by_device: dict[torch.device, list[tuple[list[torch.Tensor], torch.Tensor]]] = {}
        other_pairs = []
        for dst, src in pairs:
            if src.device.type == "cuda":
                by_device.setdefault(src.device, []).append((dst, src))
            else:
                other_pairs.append((dst, src))
        for gather in gathers:
            device = gather[0][0].device
            by_device.setdefault(device, [])
            gathers_by_device.setdefault(device, []).append(gather)
        used = []
        # every destination is a region of the arena: pinned exactly when the arena is (asking
        # each with is_pinned() costs a driver call per tensor per save)
        pinned = self._arena is not None and self._arena.pinned
        for device, cuda_pairs in by_device.items():
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # (also makes ``device`` the current device)
                for members, out in gathers_by_device.get(device, ()):
                    # (a temporary of this stream: the allocator reuses it only in stream order)
                    flat = torch._C._nn.flatten_dense_tensors(members)
                    out.copy_(flat, non_blocking=pinned)
                for dst, src in cuda_pairs:
                    dst.copy_(_resolved_if_lazy(src), non_blocking=pinned)
            used.append(stream)
        for stream in used:
            stream.synchronize()
        for dst, src in other_pairs:
            dst.copy_(_resolved_if_lazy(src))
        for device in {s.device for _, s in other_pairs}:
            torch.get_device_module(device).synchronize(device)

    @staticmethod
    def _rewrap(original: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        """``buffer`` (a staged local shard) as a DTensor laid out like ``original``.

        Built from ``original``'s spec (mesh, placements, global shape and stride), not with
        ``DTensor.from_local``, which would move a host buffer back to the mesh's device (CUDA).
        """
        if DTensor is not None and isinstance(original, DTensor):
            return DTensor(buffer, original._spec, requires_grad=False)
        return buffer


_LOCAL_META = operator.attrgetter("shape", "dtype", "device")


def _dtensor_specs(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[Any, Any]]:
    """(spec, local tensor's shape, dtype and device) of every value of ``tensors`` that is
    exactly a ``DTensor``, by key (none when a value is a subclass of DTensor:
    :meth:`StagingBuffers._same_dtensors` then never matches, and such a state is looked at
    whole on every save)."""
    if DTensor is None:
        return {}
    specs: dict[str, tuple[Any, Any]] = {}
    for key, tensor in tensors.items():
        if type(tensor) is DTensor:
            specs[key] = (tensor._spec, _LOCAL_META(tensor._local_tensor))
        elif isinstance(tensor, DTensor):
            return {}
    return specs


def _resolved_if_lazy(source: torch.Tensor) -> torch.Tensor:
    """``source``, or where it is a lazily conjugated or negated view (``z.conj()``,
    ``z.conj().imag``) a plain copy of it on its own device, for a copy to the host.

    torch's copy across devices applies such a bit wrongly: from a non-contiguous view it makes
    a contiguous temporary (which resolves the bit) and then marks the temporary with the bit
    again, so the bit is applied twice (``copy_kernel_cuda``; seen on an H200 with torch 2.11,
    where a strided negated view came back with its sign flipped). A non-blocking copy of such a
    view applies the bit to the host buffer before the bytes arrive, which then overwrite it
    (pytorch/pytorch#146286). A resolved copy has neither bit: it is copied like any tensor,
    non-blocking too (the temporary belongs to the copy's stream, whose later work alone may
    reuse its memory).
    """
    if source.is_conj() or source.is_neg():
        return source.resolve_conj().resolve_neg()
    return source


_MIN_CAT_RUN = 4
"""Shorter runs are copied by ``_foreach_copy_``: one ``torch.cat`` per pair of tensors (Adam's
two moments between 0-dim steps) was measured slower, four tensors about even."""


def _stretches(
    packed: list[PackedTensor],
    joins: Callable[[int, int], bool],
    keeps: Callable[[int, int], bool],
) -> list[tuple[int, int]]:
    """(first, end) indices into ``packed`` (in pack order) of every stretch of tensors back to
    back, of one dtype, whose every entry ``joins(first, index)`` the stretch begun at
    ``first``, and that ``keeps(first, end)``."""
    stretches: list[tuple[int, int]] = []
    first = 0
    for index in range(1, len(packed) + 1):
        if index < len(packed):
            before, entry = packed[index - 1], packed[index]
            if (
                entry.dtype == before.dtype
                and entry.offset == before.offset + before.nbytes
                and joins(first, index)
            ):
                continue
        if keeps(first, index):
            stretches.append((first, index))
        first = index
    return stretches


def _cat_runs(packed: list[PackedTensor], on_cpu: list[bool]) -> list[tuple[int, int]]:
    """(first, end) indices into ``packed`` (in pack order) of every run of ``_MIN_CAT_RUN`` or
    more tensors that one ``torch.cat`` along dimension 0 copies: back to back, of one dtype,
    with at least one dimension and the same sizes after the first, and CPU sources (``on_cpu``,
    per entry: a device's tensors are copied to the host one by one)."""

    def joins(first: int, index: int) -> bool:
        shape, head = packed[index].shape, packed[first].shape
        return (
            on_cpu[index]
            and on_cpu[first]
            and len(shape) == len(head) > 0
            and shape[1:] == head[1:]
        )

    return _stretches(
        packed, joins, lambda first, end: end - first >= _MIN_CAT_RUN and bool(packed[first].shape)
    )


def _gathers(
    packed: list[PackedTensor], devices: list[torch.device], max_bytes: int
) -> list[tuple[int, int]]:
    """(first, end) indices into ``packed`` (in pack order) of every stretch of two or more
    tensors back to back, of one dtype, on one CUDA device (``devices``, per entry), of at most
    ``max_bytes`` together (or one tensor): flattened on the device and copied to the host in
    one piece."""

    def joins(first: int, index: int) -> bool:
        entry = packed[index]
        within = entry.offset + entry.nbytes - packed[first].offset <= max_bytes
        return devices[index] == devices[first] and within

    return _stretches(
        packed, joins, lambda first, end: end - first >= 2 and devices[first].type == "cuda"
    )


def _storage_bytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()


def _storage_id(key: str, tensor: torch.Tensor) -> Hashable:
    """Identifies the storage ``tensor`` (stored under ``key``) views: device and base address.

    A lazily conjugated or negated view (``z.conj()``, ``z.conj().imag``) is a group of its own:
    views of a shared region are rebuilt from dtype, shape, strides and offset, which would
    drop those bits; alone it is copied with ``copy_``, which resolves them. So is an efficient
    zero tensor (``torch._efficientzerotensor``, from forward-mode AD), which has no storage to
    share: ``copy_`` and ``torch.cat`` write the zeros it stands for.
    """
    if tensor.is_conj() or tensor.is_neg():
        return ("resolved", key)
    try:
        return (str(tensor.device), tensor.untyped_storage().data_ptr())
    except RuntimeError:  # (asked only here: ordinary tensors cost no check)
        if tensor._is_zerotensor():  # "invalid python storage"
            return ("resolved", key)
        raise


def _quick_signature(tensors: Mapping[str, torch.Tensor], pack: bool) -> tuple[object, ...]:
    """What decides, for plain tensors, whether a layout still fits: keys in order, and each
    tensor's type, dtype, shape and device. Strides and storage offsets do not matter for a
    tensor staged on its own (it is copied into a contiguous region); views that shared a
    storage are checked apart (:func:`_views_still_share`). Tensors that came to share a
    storage since are still each copied on their own, which is correct."""
    return (
        pack,
        list(tensors),
        [(t.__class__, t.dtype, t.shape, t.device) for t in tensors.values()],
    )


def _is_plain(quick: tuple[object, ...]) -> bool:
    """True when the state of this :func:`_quick_signature` holds no DTensor."""
    kinds = quick[2]
    assert isinstance(kinds, list)
    return DTensor is None or not any(issubclass(kind, DTensor) for kind, *_ in kinds)


def _views_still_share(layout: _Layout, tensors: Mapping[str, torch.Tensor]) -> bool:
    """True when every group of views staged on one shared region still views one storage at
    the same offsets and strides (what the staged views were rebuilt with). False too when one
    of them has no storage now (an efficient zero tensor: the new layout stages it alone)."""
    try:
        for _, members in layout.share_groups:
            first = tensors[members[0][0]].untyped_storage().data_ptr()
            for key, storage_offset, stride in members:
                tensor = tensors[key]
                if (
                    tensor.untyped_storage().data_ptr() != first
                    or tensor.storage_offset() != storage_offset
                    or tensor.stride() != stride
                    or tensor.is_conj()
                    or tensor.is_neg()
                ):
                    return False
    except Exception:  # ("invalid python storage"): the full signature says what it is
        return False
    return True


def _signature(sources: dict[str, torch.Tensor]) -> Hashable:
    """Everything the layout depends on: keys, dtypes, shapes, devices and storage sharing."""
    storages: dict[Hashable, int] = {}
    parts = []
    for key, source in sources.items():
        try:
            group = storages.setdefault(_storage_id(key, source), len(storages))
        except Exception:
            check_storable(key, source)  # (a sparse tensor has no storage: say so)
            raise
        parts.append(
            (key, source.dtype, source.shape, source.stride(), source.storage_offset(), group)
        )
        parts.append(source.device)
    return tuple(parts)


STALE_AFTER_TAKEN = 4
"""An idle slot's arena that the latest layout would not keep is freed once the slots were
taken this many times per slot without it (see :meth:`StagingPool._free_stale_arenas`)."""


class StagingPool:
    """``slots`` staging buffer sets whose host memory together stays within ``budget_bytes``.

    Taking a slot is what bounds the async saves whose data is not yet written.
    ``budget_bytes=None`` puts no bound beyond the slots (``slots`` copies of the state; one with
    the default single slot). With a budget, a slot that must grow its arena first frees idle
    slots, then waits until in-flight saves have released enough; a state bigger than the budget
    on its own is staged anyway once nothing else holds memory (with a warning), since waiting
    longer could not help.
    """

    def __init__(
        self, slots: int, budget_bytes: int | None = None, *, shared: bool = False
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0 or None, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._all = [StagingBuffers(self, shared=shared) for _ in range(slots)]
        self._free: list[StagingBuffers] = list(self._all)
        self._cond = threading.Condition()
        self._freeing = False  # free_all() was called: released slots are freed
        self._taken = 0  # slots taken so far (acquire), for the idle age of each slot
        self._last_used = {id(slot): 0 for slot in self._all}  # (at its release)
        self.latest_layout: tuple[int, bool] | None = None
        """The bytes and pinning of the layout staged last (set by the slots)."""

    @property
    def nbytes(self) -> int:
        """Host bytes held by all slots together."""
        with self._cond:
            return sum(slot.nbytes for slot in self._all)

    def acquire(
        self,
        on_wait: str = "",
        timeout_s: float | None = None,
        into: list[StagingBuffers] | None = None,
    ) -> StagingBuffers:
        """A free buffer set, waiting (and logging how long) if all are in flight; also added
        to ``into`` as it is taken, for a caller that releases what ``into`` holds whatever
        happens (a Ctrl-C as this call returned lost the slot, and later saves waited for it).

        Raises ``TimeoutError`` after ``timeout_s`` seconds (None: wait as long as it takes,
        which is until a background save's data is written: every save releases its slot then,
        or when it fails).
        """
        started = time.perf_counter()
        with self._cond:
            if not self._wait_for(lambda: bool(self._free), timeout_s, "a free slot" + on_wait):
                raise TimeoutError(f"no free staging slot within {timeout_s} s{on_wait}")
            # The most recently released slot first: its arena is likeliest to fit this state.
            # (Taken without a call, then handed over: Python raises a Ctrl-C after calls.)
            slot = self._free[-1]
            del self._free[-1]
            if into is not None:
                into.append(slot)
            self._taken += 1
            self._free_stale_arenas()
        waited = time.perf_counter() - started
        if waited > 0.001:
            log.info("waited %.3f s for a free async save slot%s", waited, on_wait)
        return slot

    def _free_stale_arenas(self) -> None:
        """Free the arenas of idle slots that the layout staged last would not keep (too small,
        or more than twice as large) and that stayed idle (since their release) for
        ``STALE_AFTER_TAKEN`` takings of a slot per slot: with no budget, an idle slot held the
        size of an older, larger state until close (nine times the state after it shrank to a
        ninth, with three slots). Not at once: a slot unused for a few saves may be the one a
        state saved in turn with another one (a model alone, then with its optimizer) fits.
        (The condition is held.)"""
        if self.latest_layout is None:
            return
        needed, pin = self.latest_layout
        unused_for = STALE_AFTER_TAKEN * len(self._all)
        for idle in self._free:
            arena = idle._arena
            if (
                arena is not None
                and self._taken - self._last_used[id(idle)] > unused_for
                and not _arena_fits(arena, needed, pin)
            ):
                idle.free()

    def free_all(self) -> None:
        """Free every slot's memory (a closed manager's: its saves are done), and from now on
        each slot's as it is released (a save refused by the closing manager after it had
        staged)."""
        with self._cond:
            self._freeing = True
            for slot in self._free:
                slot.free()

    def release(self, buffers: StagingBuffers) -> None:
        """Return a buffer set once its write has finished."""
        with self._cond:
            if self._freeing:
                buffers.free()
            self._free.append(buffers)
            self._last_used[id(buffers)] = self._taken  # (idle from here)
            self._cond.notify_all()

    def _reserve(self, slot: StagingBuffers, needed: int, old: int, pin: bool) -> _Arena | None:
        """Called by ``slot`` (in flight, its old arena of ``old`` bytes dropped) before it
        allocates ``needed`` bytes: keep all slots within the budget. Where an idle slot's arena
        is freed for the budget and fits ``needed`` (as ``_ensure_arena`` keeps one), it is
        returned instead, for ``slot`` to stage into: with saves overlapping and a budget for
        fewer arenas than slots, every save made (and faulted in) a new one."""
        if self.budget_bytes is None:
            return None
        budget = self.budget_bytes
        adopted: _Arena | None = None
        with self._cond:

            def others() -> int:
                return sum(s.nbytes for s in self._all if s is not slot)

            def free_idle(idle: StagingBuffers) -> None:
                nonlocal adopted
                arena = idle._arena
                if adopted is None and arena is not None and _arena_fits(arena, needed, pin):
                    idle._arena = None  # (taken: not unpinned by free())
                    adopted = slot._arena = arena  # (counted as the slot's while it waits)
                idle.free()

            if others() + needed > budget:
                for idle in self._free:  # idle arenas go first: they only save a reallocation
                    if idle is not slot and idle.nbytes:
                        free_idle(idle)
                    if others() + needed <= budget:
                        break

            def fits_or_alone() -> bool:  # idle slots' arenas count as freed (they are below)
                busy = sum(s.nbytes for s in self._all if s is not slot and s not in self._free)
                return busy + needed <= budget or busy == 0

            if not fits_or_alone():
                started = time.perf_counter()
                self._wait_for(fits_or_alone, None, "staging memory budget")
                log.info(
                    "waited %.3f s for %d bytes of staging memory (budget %d)",
                    time.perf_counter() - started,
                    needed,
                    budget,
                )
                for idle in self._free:
                    if idle is not slot and others() + needed > budget:
                        free_idle(idle)
            if needed > budget:
                log.warning(
                    "staging needs %d bytes, more than staging_budget_bytes=%d; staging anyway "
                    "(nothing else holds staging memory)",
                    needed,
                    budget,
                )
        return adopted

    def _wait_for(self, ready: Callable[[], bool], timeout_s: float | None, what: str) -> bool:
        """Wait on the condition (held) until ``ready()``; False on timeout. Logs long waits."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        logged = time.monotonic()
        while not ready():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            step = _WAIT_LOG_S if deadline is None else min(_WAIT_LOG_S, deadline - now)
            self._cond.wait(step)
            if time.monotonic() - logged >= _WAIT_LOG_S and not ready():
                log.info("still waiting for %s", what)
                logged = time.monotonic()
        return True
