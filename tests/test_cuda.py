"""Saving and restoring CUDA tensors through the public API (skipped where there is no GPU).

``benchmarks/gpu/run_checks.sh`` runs these on a lent GPU machine. With
``CKPTMGR_TEST_DEVICE=cpu`` the same tests run on the CPU, which checks the tests themselves on a
machine without a GPU; the assertions that only mean something on CUDA (pinned staging memory,
streams) are then skipped.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from ckptmgr import CheckpointManager, CorruptCheckpointError, dcp_io, packing, tensor_bytes

DEVICE = os.environ.get("CKPTMGR_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE == "cuda"

pytestmark = pytest.mark.skipif(
    ON_CUDA and not torch.cuda.is_available(),
    reason="needs a CUDA device (CKPTMGR_TEST_DEVICE=cpu runs these tests on the CPU)",
)

MODES = ["save", "thread", "process"]
"""``save``; ``save_async`` in thread mode; ``save_async`` with ``async_mode="process"``."""


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as raw bytes on the CPU (bit-exact comparison, NaNs included)."""
    tensor = tensor.detach().resolve_conj().resolve_neg().cpu().contiguous()
    return tensor.reshape(-1).view(torch.uint8) if tensor.numel() else tensor


def _assert_exact(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        got = actual[key]
        assert got.dtype == value.dtype and got.shape == value.shape, key
        assert torch.equal(_bits(got), _bits(value)), key


def _random(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=gen).to(dtype)


def _mixed_state(seed: int) -> dict[str, torch.Tensor]:
    """Tensors on ``DEVICE`` of every kind staging and packing treat apart, plus a CPU one."""
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for index in range(300):  # many small tensors: packed
        state[f"small/{index}"] = _random(torch.float32, (64,), gen).to(DEVICE)
    for dtype in (torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool):
        name = str(dtype).removeprefix("torch.")
        state[f"{name}/vector"] = _random(dtype, (33,), gen).to(DEVICE)
        state[f"{name}/scalar"] = _random(dtype, (), gen).to(DEVICE)
        state[f"{name}/big"] = _random(dtype, (300_000,), gen).to(DEVICE)  # > 64 KiB: alone
    state["empty"] = torch.empty(0, 3, device=DEVICE)
    state["large"] = _random(torch.float32, (4 * 2**20,), gen).to(DEVICE)  # 16 MiB
    state["transposed"] = _random(torch.float32, (512, 384), gen).to(DEVICE).t()
    base = _random(torch.float32, (50_000,), gen).to(DEVICE)
    state["view/head"] = base[:30_000]  # two views of one storage, overlapping
    state["view/tail"] = base[20_000:]
    complex_values = _random(torch.complex64, (2_000,), gen).to(DEVICE)
    state["lazy/conj"] = complex_values.conj()
    state["lazy/neg"] = complex_values.conj().imag
    state["small/conj"] = complex_values[:100].conj()
    for index in range(3):  # lazily conjugated / negated small tensors of their own: packed
        state[f"small/conj{index}"] = _random(torch.complex64, (50,), gen).to(DEVICE).conj()
        state[f"small/neg{index}"] = _random(torch.complex64, (40,), gen).to(DEVICE).conj().imag
    state["on_cpu"] = _random(torch.float32, (1000,), gen)
    return state


def _fresh_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Plain destinations on each tensor's own device, every byte 0xFF (so that a value the
    restore does not write, zeros included, shows)."""
    fresh = {}
    for key, value in state.items():
        tensor = torch.empty(value.shape, dtype=value.dtype, device=value.device)
        if tensor.numel():
            tensor.reshape(-1).view(torch.uint8).fill_(255)
        fresh[key] = tensor
    return fresh


def _snapshot(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        key: value.detach().resolve_conj().resolve_neg().clone() for key, value in state.items()
    }


def _manager(root: Path, mode: str, **kwargs: object) -> CheckpointManager:
    if mode == "process":
        kwargs["async_mode"] = "process"
    return CheckpointManager(root, 1, chkpt_on_preemption=False, **kwargs)  # type: ignore[arg-type]


def _save(manager: CheckpointManager, mode: str, step: int, state: dict) -> None:
    if mode == "save":
        assert manager.save(step, state)
    else:
        assert manager.save_async(step, state)


@contextlib.contextmanager
def _side_stream() -> Iterator[None]:
    """A non-default current stream on CUDA (nothing on the CPU), ordered after the work
    queued before it, and the work after it ordered after its own."""
    if not ON_CUDA:
        yield
        return
    outer = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(outer)
    with torch.cuda.stream(side):
        yield
    outer.wait_stream(side)


def _delay() -> None:
    """Queue about a second of GPU work on the current stream (nothing on the CPU), so that
    work queued after it is still pending when the host goes on."""
    if ON_CUDA:
        torch.cuda._sleep(int(2e9))  # about a second of spinning on the GPU


@pytest.mark.parametrize("mode", MODES)
def test_every_kind_of_tensor_round_trips_bit_exact(tmp_path: Path, mode: str) -> None:
    state = _mixed_state(0)
    for name, size in (("zero/small", 10), ("zero/small2", 20), ("zero/big", 300_000)):
        state[name] = torch._efficientzerotensor(size, device=DEVICE)  # forward-mode AD's
    expected = _snapshot(state)
    with _manager(tmp_path, mode) as manager:
        _save(manager, mode, 1, state)
        manager.join()
        target = _fresh_like(expected)
        devices = {key: value.device for key, value in target.items()}
        pointers = {key: value.data_ptr() for key, value in target.items()}
        manager.restore(1, target)
    _assert_exact(target, expected)
    assert {key: value.device for key, value in target.items()} == devices  # in place
    assert {key: value.data_ptr() for key, value in target.items()} == pointers


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_save_async_holds_the_values_of_the_call(tmp_path: Path, mode: str) -> None:
    """Work queued on the current stream before ``save_async`` is in the checkpoint; work queued
    right after it returns, on any stream, is not."""
    state = _mixed_state(1)
    with _manager(tmp_path, mode) as manager:
        for step in (1, 2):  # the first layout, then the reused one
            with _side_stream():
                _delay()  # the updates below stay pending behind it when save_async is called
                for value in state.values():
                    if value.dtype.is_floating_point and not value.is_conj() and not value.is_neg():
                        value.add_(float(step))
                expected = _snapshot(state)  # ordered after the updates on the same stream
                assert manager.save_async(step, state)
            for value in state.values():  # right after the call, on the default stream
                if value.dtype.is_floating_point and not value.is_conj() and not value.is_neg():
                    value.mul_(-3.0)
            manager.join()
            target = _fresh_like(expected)
            manager.restore(step, target)
            _assert_exact(target, expected)


def test_save_sees_work_queued_on_the_callers_stream(tmp_path: Path) -> None:
    """``save`` writes on the background thread, whose current stream is not the caller's:
    work the caller queued on its own stream just before is in the checkpoint."""
    state = {
        "big": torch.zeros(4 * 2**20, device=DEVICE),
        **{f"small/{i}": torch.zeros(16, device=DEVICE) for i in range(50)},
    }
    with _manager(tmp_path, "save") as manager:
        with _side_stream():
            _delay()
            for value in state.values():
                value.fill_(7.0)
            assert manager.save(1, state)
        target = _fresh_like(state)
        manager.restore(1, target)
    for key, value in target.items():
        assert torch.equal(value.cpu(), torch.full(value.shape, 7.0)), key


@pytest.mark.skipif(not ON_CUDA, reason="pinned staging memory is CUDA's")
def test_staging_memory_is_pinned_and_reused_from_save_to_save(tmp_path: Path) -> None:
    state = _mixed_state(2)
    with _manager(tmp_path, "thread", max_pending_async=1) as manager:
        pointers = []
        for step in (1, 2, 3):
            assert manager.save_async(step, state)
            manager.join()
            buffers = manager._staging.acquire(timeout_s=60)  # internal: the one slot's buffers
            try:
                staged = buffers.buffers
                assert staged and all(value.is_pinned() for value in staged.values())
                pointers.append({key: value.data_ptr() for key, value in staged.items()})
            finally:
                manager._staging.release(buffers)
        assert pointers[0] == pointers[1] == pointers[2]


def test_small_device_tensors_are_packed_into_one_item(tmp_path: Path) -> None:
    """Small tensors on the GPU go into the pack like CPU ones: the step's record lists them
    as packed, and the data files hold their bytes about once."""
    state = {f"bias/{i}": torch.randn(256, device=DEVICE) for i in range(2_000)}
    nbytes = sum(value.numel() * value.element_size() for value in state.values())
    for mode in MODES:
        root = tmp_path / mode
        with _manager(root, mode) as manager:
            _save(manager, mode, 1, state)
            manager.join()
            record = manager._storage.read_record(1)  # internal: the commit record
            assert len(record.packed) == len(state), mode
            target = _fresh_like(state)
            manager.restore(1, target)
        _assert_exact(target, state)
        data = sum(p.stat().st_size for p in root.rglob("*.distcp"))
        assert nbytes <= data <= nbytes * 1.05, mode


def test_layout_changes_between_saves(tmp_path: Path) -> None:
    """Keys added and removed, shapes and dtypes changed, a tensor moved between devices:
    every step restores its own values."""
    gen = torch.Generator().manual_seed(3)
    first = {
        "a": _random(torch.float32, (1000,), gen).to(DEVICE),
        "b": _random(torch.float32, (10,), gen).to(DEVICE),
        "c": _random(torch.float32, (10,), gen).to(DEVICE),
        "moves": _random(torch.float32, (10,), gen).to(DEVICE),
    }
    second = {
        "a": _random(torch.float32, (300_000,), gen).to(DEVICE),  # grows past the pack
        "b": _random(torch.bfloat16, (10,), gen).to(DEVICE),
        "d": _random(torch.int64, (7, 3), gen).to(DEVICE),
        "moves": _random(torch.float32, (10,), gen),  # now on the CPU
    }
    third = {key: value.clone() for key, value in first.items()}
    third["a"] = _random(torch.float32, (1000,), gen).to(DEVICE)
    states = {1: first, 2: second, 3: third}
    with _manager(tmp_path, "thread", max_pending_async=1) as manager:  # one slot: relayouts
        for step, state in states.items():
            assert manager.save_async(step, state)
        manager.join()
        for step, state in states.items():
            target = _fresh_like(state)
            manager.restore(step, target)
            _assert_exact(target, state)


def test_model_and_optimizer_round_trip_and_train_on_alike(tmp_path: Path) -> None:
    torch.manual_seed(0)

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 8)).to(
            DEVICE
        )
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        batch = torch.randn(16, 32, generator=gen).to(DEVICE)
        loss = model(batch).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        return {
            f"{index}/{name}": value
            for index, state in enumerate(optimizer.state.values())
            for name, value in state.items()
        }

    model, optimizer = build()
    for seed in range(3):
        train_step(model, optimizer, seed)
    with _manager(tmp_path, "thread") as manager:
        assert manager.save_async(3, {"model": model, "optim": optimizer})
        expected_model = _snapshot(dict(model.state_dict()))
        expected_optimizer = _snapshot(optimizer_tensors(optimizer))
        manager.join()
        fresh_model, fresh_optimizer = build()
        manager.restore(3, {"model": fresh_model, "optim": fresh_optimizer})
    _assert_exact(dict(fresh_model.state_dict()), expected_model)
    restored_optimizer = optimizer_tensors(fresh_optimizer)
    _assert_exact(restored_optimizer, expected_optimizer)
    assert all(p.device.type == DEVICE for p in fresh_model.parameters())
    moments = [value for key, value in restored_optimizer.items() if key.endswith("exp_avg")]
    assert len(moments) == 6 and all(m.device.type == DEVICE for m in moments)
    train_step(model, optimizer, 10)  # the same next step from the same state
    train_step(fresh_model, fresh_optimizer, 10)
    for key, value in fresh_model.state_dict().items():
        torch.testing.assert_close(value, model.state_dict()[key], msg=key)


def test_small_tensors_all_on_the_device_are_restored_without_a_match_per_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Destinations of the stored dtypes all on the device (contiguous, a strided 1-d view, a
    matrix, scalars, a lazily negated view; large ones stored on their own among them) take the
    direct path: no Python step per tensor, one copy of the pack's bytes to the device, and
    every value back bit-exact."""
    from ckptmgr import pack_load

    gen = torch.Generator().manual_seed(9)
    saved: dict[str, torch.Tensor] = {}
    for i in range(200):
        saved[f"{i}/exp_avg"] = _random(torch.float32, (5 + i % 4,), gen).to(DEVICE)
        saved[f"{i}/step"] = _random(torch.float32, (), gen).to(DEVICE)
        saved[f"{i}/weight"] = _random(torch.bfloat16, (3, 4), gen).to(DEVICE)
        if i % 50 == 0:  # (stored on its own)
            saved[f"{i}/big"] = _random(torch.float32, (300, 300), gen).to(DEVICE)
    with _manager(tmp_path, "thread") as manager:
        assert manager.save_async(1, saved)
        manager.join()
        target = {key: torch.zeros_like(value) for key, value in saved.items()}
        strided = torch.zeros(2 * saved["7/exp_avg"].numel(), device=DEVICE)
        target["7/exp_avg"] = strided[::2]
        negated = torch.zeros(3, 4, dtype=torch.bfloat16, device=DEVICE)
        target["8/weight"] = negated._neg_view()

        def not_called(*args: object) -> None:
            raise AssertionError("matched one destination at a time")

        monkeypatch.setattr(pack_load, "_matched_runs", not_called)
        manager.restore(1, target)
    _assert_exact(target, saved)
    assert torch.equal(_bits(strided[::2]), _bits(saved["7/exp_avg"]))
    assert torch.equal(_bits(negated), _bits(-saved["8/weight"]))


@pytest.mark.skipif(not ON_CUDA, reason="asks which CUDA devices hold tensors")
def test_the_cuda_devices_of_tensors_are_found_whatever_their_order() -> None:
    """The devices a restore waits for: those of its CUDA destinations, found with the CPU
    ones first or last, and none for CPU tensors alone."""
    from ckptmgr.device_sync import _cuda_devices

    on_cuda = torch.zeros(3, device=DEVICE)
    on_cpu = [torch.zeros(3) for _ in range(5)]
    found = {on_cuda.device}
    assert _cuda_devices([*on_cpu, on_cuda]) == found
    assert _cuda_devices(iter([on_cuda, *on_cpu])) == found
    assert _cuda_devices(on_cpu) == set()


def test_restore_into_parameters_views_and_another_dtype(tmp_path: Path) -> None:
    """Packed tensors restored into destinations the direct copy cannot take as they are:
    parameters that require grad, non-contiguous views, another dtype (converted), and a mix
    of devices in one pack."""
    gen = torch.Generator().manual_seed(4)
    saved = {f"p/{i}": _random(torch.float32, (6, 5), gen).to(DEVICE) for i in range(20)}
    saved["converted"] = _random(torch.float32, (40,), gen).to(DEVICE)
    saved["cpu/neighbour"] = _random(torch.float32, (40,), gen)
    with _manager(tmp_path, "thread") as manager:
        assert manager.save_async(1, saved)
        manager.join()
        target: dict[str, torch.Tensor] = {}
        for i in range(20):
            key = f"p/{i}"
            if i % 3 == 0:
                target[key] = nn.Parameter(torch.zeros(6, 5, device=DEVICE))
            elif i % 3 == 1:
                target[key] = torch.zeros(5, 6, device=DEVICE).t()  # non-contiguous
            else:
                target[key] = torch.zeros(6, 5, device=DEVICE)
        target["converted"] = torch.zeros(40, dtype=torch.float64, device=DEVICE)
        target["cpu/neighbour"] = torch.zeros(40)
        manager.restore(1, target)
    for key, value in saved.items():
        got = target[key]
        if key == "converted":
            assert got.dtype == torch.float64 and torch.equal(got.cpu(), value.cpu().double())
        else:
            assert torch.equal(_bits(got), _bits(value)), key
    assert isinstance(target["p/0"], nn.Parameter) and target["p/0"].requires_grad


@pytest.mark.parametrize("mode", MODES)
def test_small_device_tensors_flattened_in_bounded_pieces(
    tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small device tensors are flattened on their device in pieces of at most
    FLATTEN_MAX_DEVICE_BYTES (a temporary there) before their copy to the host; with a tiny
    bound the pieces are many, cut at every bound, and the values still round-trip."""
    bound = 3_000
    monkeypatch.setattr(packing, "FLATTEN_MAX_DEVICE_BYTES", bound)
    pieces: list[tuple[int, int]] = []  # (members, bytes) of each flatten of device tensors

    def watched(flatten: Callable[..., object]) -> Callable[..., object]:
        def flatten_and_note(members: list[torch.Tensor], *out: torch.Tensor) -> object:
            if members and not members[0].is_cpu:
                nbytes = sum(m.numel() * m.element_size() for m in members)
                pieces.append((len(members), nbytes))
            return flatten(members, *out)

        return flatten_and_note

    monkeypatch.setattr(packing, "_flatten", watched(packing._flatten))
    monkeypatch.setattr(
        torch._C._nn, "flatten_dense_tensors", watched(torch._C._nn.flatten_dense_tensors)
    )
    gen = torch.Generator().manual_seed(5)
    state = {f"t/{i}": _random(torch.float32, (100 + i,), gen).to(DEVICE) for i in range(60)}
    state.update({f"h/{i}": _random(torch.float16, (7,), gen).to(DEVICE) for i in range(9)})
    with _manager(tmp_path, mode) as manager:
        for step in (1, 2):
            _save(manager, mode, step, state)
        manager.join()
        for step in (1, 2):
            target = _fresh_like(state)
            manager.restore(step, target)
            _assert_exact(target, state)
    if ON_CUDA:  # (on the CPU nothing is flattened on a device)
        assert len(pieces) >= 2 * 60 * 400 // bound, pieces  # many pieces, every save
        assert all(nbytes <= bound or members == 1 for members, nbytes in pieces), pieces


@pytest.mark.skipif(not ON_CUDA, reason="on the CPU every tensor is a CPU tensor")
def test_an_optimizers_cpu_step_scalars_do_not_split_its_device_tensors_in_the_pack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AdamW keeps ``step`` as a float32 scalar on the CPU beside float32 moments on the GPU:
    the pack puts a dtype's CPU tensors first, so the device ones lie together (one gather at
    save, one copy to the device at restore)."""
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)]).to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 16, device=DEVICE)).sum().backward()
    optimizer.step()
    with _manager(tmp_path, "thread") as manager:
        assert manager.save_async(1, {"model": model, "optim": optimizer})
        manager.join()
        record = manager._storage.read_record(1)  # internal: the commit record
    steps = [offset for name, offset in record.packed.items() if name.endswith("step")]
    moments = [offset for name, offset in record.packed.items() if "exp_avg" in name]
    assert len(steps) == 16 and len(moments) == 32
    assert max(steps) < min(moments)
    expected = _snapshot(
        {f"{i}/{k}": v for i, s in enumerate(optimizer.state.values()) for k, v in s.items()}
    )
    fresh = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)]).to(DEVICE)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    splits: list[str] = []
    split = torch.split_with_sizes_copy

    def counting(flat: torch.Tensor, *args: object, **kwargs: object) -> object:
        splits.append(flat.device.type)
        return split(flat, *args, **kwargs)

    monkeypatch.setattr(torch, "split_with_sizes_copy", counting)
    with _manager(tmp_path, "thread") as manager:
        manager.restore(1, {"model": fresh, "optim": fresh_optimizer})
    assert len(splits) <= 4, splits  # a run per device (and dtype), not per pair of moments
    assert len(fresh_optimizer.state) == len(optimizer.state)
    restored = {
        f"{i}/{k}": v for i, s in enumerate(fresh_optimizer.state.values()) for k, v in s.items()
    }
    _assert_exact(restored, expected)


def test_restore_waits_for_work_pending_on_its_destinations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restore called inside the caller's own stream, with work still pending on the
    destinations there: that work is done before the stored values are written (by reader
    threads on their own streams too, with two data files), and the values are there when
    restore returns, a non-contiguous destination's too."""
    gen = torch.Generator().manual_seed(6)
    state = {
        "big/a": _random(torch.float32, (2 * 2**20,), gen).to(DEVICE),
        "big/b": _random(torch.float32, (2 * 2**20,), gen).to(DEVICE),
        **{f"small/{i}": _random(torch.float32, (64,), gen).to(DEVICE) for i in range(20)},
    }
    state["big/transposed"] = _random(torch.float32, (1024, 512), gen).to(DEVICE).t()
    if ON_CUDA:  # a reader thread's copies into the destinations: queued behind 0.1 s there
        real_narrow = dcp_io._narrow

        def slow_device_piece(tensor: torch.Tensor, *where: object) -> torch.Tensor:
            piece = real_narrow(tensor, *where)
            if threading.current_thread().name.startswith("ckptmgr-read"):
                piece = piece.to(DEVICE)
                torch.cuda._sleep(200_000_000)  # on the reader thread's own stream
            return piece

        monkeypatch.setattr(dcp_io, "_narrow", slow_device_piece)
    with _manager(tmp_path, "save", num_of_threads=2) as manager:
        assert manager.save(1, state)
        target = _fresh_like(state)
        # non-contiguous: a reader thread fills it through a device copy on its own stream
        target["big/transposed"] = torch.empty(1024, 512, device=DEVICE).t()
        assert not target["big/transposed"].is_contiguous()
        with _side_stream():
            _delay()
            for value in target.values():
                value.fill_(5.0)  # pending behind the delay when restore starts
            manager.restore(1, target)
            restored = {key: value.clone() for key, value in target.items()}  # same stream
    _assert_exact(restored, state)


@pytest.mark.parametrize("mode", ["save", "thread"])
def test_device_destinations_are_read_through_pinned_pieces(
    tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole stored chunk bound for a CUDA tensor is read in pinned pieces, each copied to
    the device while the next is read (here pieces of 100,003 bytes: many per tensor, items
    split across pieces), with the values in place when restore returns, also from a side
    stream; a flipped byte in the data file is still found."""
    monkeypatch.setattr(tensor_bytes, "DEVICE_READ_PIECE_BYTES", 100_003)
    taken: list[tuple[int, ...]] = []
    real = tensor_bytes.read_chunk_to_device

    def noted(*args: object, **kwargs: object) -> None:
        assert kwargs["pin"] is True
        taken.append(tuple(args[4]))  # type: ignore[arg-type]
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tensor_bytes, "read_chunk_to_device", noted)
    gen = torch.Generator().manual_seed(11)
    state = {
        "big": _random(torch.float32, (1000, 1001), gen).to(DEVICE),
        "half": _random(torch.bfloat16, (500_001,), gen).to(DEVICE),
        "complex": _random(torch.complex64, (70_000,), gen).to(DEVICE),
    }
    with _manager(tmp_path, mode) as manager:
        _save(manager, mode, 1, state)
        manager.join()
        target = _fresh_like(state)
        with _side_stream():
            manager.restore(1, target)
            got = {key: value.cpu() for key, value in target.items()}  # (on the side stream)
        _assert_exact(got, state)
        if ON_CUDA:
            assert sorted(taken) == sorted([(1000, 1001), (500_001,), (70_000,)])
        damaged = max(tmp_path.rglob("*.distcp"), key=lambda path: path.stat().st_size)
        data = bytearray(damaged.read_bytes())
        data[len(data) // 3] ^= 0x10
        damaged.write_bytes(bytes(data))
        with pytest.raises(CorruptCheckpointError):
            manager.restore(1, _fresh_like(state))
