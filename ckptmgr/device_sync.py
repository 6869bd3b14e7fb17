"""Handing device tensors to another thread: wait for the work queued on them first.

CUDA orders work per stream, and a stream chosen with ``torch.cuda.stream(...)`` is current only
in the thread that chose it. ``save()`` writes the state on the background writer thread, whose
reads run on that thread's current stream; work the caller queued on its own current stream
just before the call could still be running then, and the checkpoint would hold values from
before it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch

_IS_CUDA = operator.attrgetter("is_cuda")


def _cuda_devices(tensors: Iterable[torch.Tensor]) -> set[torch.device]:
    """The CUDA devices that hold one of ``tensors``; none, without a look at them, when CUDA
    was never used in this process. With one visible device, the look stops at the first CUDA
    tensor (a restore of 20,000 device tensors otherwise made a ``torch.device`` of each)."""
    if not torch.cuda.is_initialized():
        return set()
    if torch.cuda.device_count() == 1:
        return {torch.device("cuda", 0)} if any(map(_IS_CUDA, tensors)) else set()
    devices = {tensor.device for tensor in tensors if not tensor.is_cpu}
    return {device for device in devices if device.type == "cuda"}


def wait_for_queued_work(tensors: Iterable[torch.Tensor]) -> None:
    """Block until the work queued so far on the calling thread's current stream of every CUDA
    device that holds one of ``tensors`` is done. Costs nothing when CUDA was never used in
    this process."""
    for device in _cuda_devices(tensors):
        torch.cuda.current_stream(device).synchronize()


def wait_for_devices(tensors: Iterable[torch.Tensor]) -> None:
    """Block until all work queued so far on every stream of every CUDA device that holds one
    of ``tensors`` is done. A restore calls it before it writes into its destinations (the
    caller's work still pending on them, on any stream, would otherwise overwrite what is read:
    DCP's reader threads copy on streams of their own) and after DCP's load (a reader thread
    fills a non-contiguous device destination with a device copy on its own stream). Costs
    nothing when CUDA was never used in this process."""
    for device in _cuda_devices(tensors):
        torch.cuda.synchronize(device)
