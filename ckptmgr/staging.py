"""Copying a state's tensors into reusable host buffers before a background write.

Each in-flight async save owns one :class:`StagingBuffers`. Buffers are allocated on the first
save and reused by later saves of tensors with the same shape and dtype, so steady-state staging
is one bulk copy (``torch._foreach_copy_``) with no allocation and no page faults.
"""

from __future__ import annotations

import logging
import queue
import time

import torch

log = logging.getLogger(__name__)

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = None  # type: ignore[assignment,misc]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    if DTensor is not None and isinstance(tensor, DTensor):
        return tensor.to_local()
    return tensor


class StagingBuffers:
    """Host copies of one state's tensors, reused from save to save."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` into the buffers and return the copies, keyed like ``tensors``.

        The copies are plain contiguous CPU tensors. A DTensor's local shard is copied (never the
        global tensor) and re-wrapped as a DTensor with the same mesh and placements, whose local
        tensor stays in host memory. When this returns, the caller may modify the originals freely.
        """
        if self._buffers.keys() - tensors.keys():
            self._buffers = {k: v for k, v in self._buffers.items() if k in tensors}
        host_dst: list[torch.Tensor] = []
        host_src: list[torch.Tensor] = []
        device_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        staged: dict[str, torch.Tensor] = {}
        for key, tensor in tensors.items():
            source = _local(tensor).detach()
            buffer = self._buffer_for(key, source)
            if source.device.type == "cpu":
                host_dst.append(buffer)
                host_src.append(source)
            else:
                device_pairs.append((buffer, source))
            staged[key] = self._rewrap(tensor, buffer)
        if host_dst:
            torch._foreach_copy_(host_dst, host_src)
        if device_pairs:
            for buffer, source in device_pairs:
                buffer.copy_(source, non_blocking=buffer.is_pinned())
            for device in {source.device for _, source in device_pairs}:
                torch.get_device_module(device).synchronize(device)
        return staged

    def _buffer_for(self, key: str, source: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            pin = source.device.type == "cuda" and torch.cuda.is_available()
            buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buffer
        return buffer

    @staticmethod
    def _rewrap(original: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        """``buffer`` (a staged local shard) as a DTensor laid out like ``original``.

        Built from ``original``'s spec (mesh, placements, global shape and stride), not with
        ``DTensor.from_local``, which would move a host buffer back to the mesh's device (CUDA).
        """
        if DTensor is not None and isinstance(original, DTensor):
            return DTensor(buffer, original._spec, requires_grad=False)
        return buffer


class StagingPool:
    """``slots`` sets of staging buffers; taking one is what bounds in-flight async saves."""

    def __init__(self, slots: int) -> None:
        self._free: queue.SimpleQueue[StagingBuffers] = queue.SimpleQueue()
        for _ in range(slots):
            self._free.put(StagingBuffers())

    def acquire(self, on_wait: str = "") -> StagingBuffers:
        """A free buffer set, waiting (and logging how long) if all are in flight."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        started = time.perf_counter()
        buffers = self._free.get()
        log.info(
            "waited %.3f s for a free async save slot%s", time.perf_counter() - started, on_wait
        )
        return buffers

    def release(self, buffers: StagingBuffers) -> None:
        """Return a buffer set once its write has finished."""
        self._free.put(buffers)
