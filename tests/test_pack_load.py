"""Restoring packed small tensors into destinations of every kind (ckptmgr.pack_load): straight
into plain CPU tensors of the stored dtype, through a copy into anything else, and refusing a
record that describes the pack wrongly."""

from __future__ import annotations

import gc
import json
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import packed_names, set_tensor_rows, tensor_rows
from torch import nn

from ckptmgr import CheckpointError, CheckpointManager, CorruptCheckpointError, pack_load
from ckptmgr.dtypes import dtype_named
from ckptmgr.record import CommitRecord, record_bytes

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.complex64]


def _random(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0, 100, shape, generator=gen).to(dtype)


def _saved_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    state: dict[str, torch.Tensor] = {}
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        state[f"{name}/vector"] = _random(dtype, (7,), gen)
        state[f"{name}/scalar"] = _random(dtype, (), gen)
        state[f"{name}/matrix"] = _random(dtype, (3, 5), gen)
        state[f"{name}/cube"] = _random(dtype, (2, 3, 4), gen)
    return state


def _bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    if actual.dtype.is_floating_point or actual.dtype.is_complex:
        actual, expected = actual.reshape(-1), expected.reshape(-1)  # views need >= 1 dim
        return actual.dtype == expected.dtype and bool(
            torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))
        )
    return actual.dtype == expected.dtype and torch.equal(actual, expected)


def _destinations(saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Zeroed destinations in every layout the direct copy has to handle or avoid: contiguous,
    non-contiguous 1-d and n-d, views of one shared buffer, parameters that require grad; in the
    reverse of the saved order, so the runs of the pack are cut into pieces."""
    out: dict[str, torch.Tensor] = {}
    for index, (key, value) in enumerate(reversed(list(saved.items()))):
        kind = index % 4
        if kind == 0 or value.dim() == 0:
            out[key] = torch.zeros_like(value)
        elif kind == 1:  # non-contiguous: every other element of a bigger buffer
            buffer = torch.zeros(value.numel() * 2, dtype=value.dtype)
            out[key] = buffer[::2].view(value.shape) if value.dim() == 1 else buffer[::2]
            if value.dim() > 1:
                out[key] = torch.zeros(tuple(reversed(value.shape)), dtype=value.dtype).t()
        elif kind == 2:  # two destinations that are views of one storage
            buffer = torch.zeros(value.numel() * 2 + 3, dtype=value.dtype)
            out[key] = buffer[3 : 3 + value.numel()].view(value.shape)
            out[key + "#"] = buffer[3 + value.numel() :].view(value.shape)
        else:
            tensor = torch.zeros_like(value)
            grad_ok = value.dtype.is_floating_point or value.dtype.is_complex
            out[key] = nn.Parameter(tensor, requires_grad=grad_ok)
    return out


def test_every_destination_layout_gets_the_exact_bits(tmp_path: Path) -> None:
    saved = _saved_state()
    for key in [k for k in saved if k.endswith(("/matrix", "/cube"))]:
        saved[key + "#"] = saved[key].flip(0).contiguous()  # the partner view's own value
    with CheckpointManager(tmp_path, save_interval=1) as manager:
        assert manager.save(1, saved)
        target = {key: value for key, value in _destinations(saved).items() if key in saved}
        assert any(not value.is_contiguous() for value in target.values())
        assert any(isinstance(value, nn.Parameter) for value in target.values())
        manager.restore(1, target)
    for key, value in target.items():
        assert _bits_equal(value.detach(), saved[key]), key


def test_destinations_on_another_dtype_and_a_subset_in_any_order(tmp_path: Path) -> None:
    saved = _saved_state()
    with CheckpointManager(tmp_path, save_interval=1) as manager:
        assert manager.save(1, saved)
        keys = [key for key in saved if key.startswith(("float32", "int64"))][::-1]
        target = {key: torch.zeros(saved[key].shape, dtype=torch.float64) for key in keys}
        manager.restore(1, target)
    for key in keys:
        assert torch.equal(target[key], saved[key].to(torch.float64)), key


def _edit_record(root: Path, edit: callable) -> None:  # type: ignore[valid-type]
    (record_path,) = root.rglob("commit.json")
    record = json.loads(record_path.read_text())
    edit(record)
    record_path.write_bytes(record_bytes(record))


def _set_row(record: dict, name: str, **fields: object) -> None:
    """Set ``fields`` (dtype, shape, offset) of ``name``'s row of the record's tensor table."""
    rows = tensor_rows(record)
    rows[name].update(fields)
    set_tensor_rows(record, rows)


@pytest.mark.parametrize("reverse", [False, True], ids=["saved_order", "reversed"])
@pytest.mark.parametrize(
    "damage",
    [
        "undescribed",
        "named_twice",
        "outside",
        "negative",
        "misaligned",
        "unknown_dtype",
        "not_a_shape",
        "offset_not_an_int",
    ],
)
def test_a_record_that_describes_the_pack_wrongly_is_corruption(
    tmp_path: Path, damage: str, reverse: bool
) -> None:
    saved = {f"t{i}": torch.rand(8) for i in range(20)}

    def edit(record: dict) -> None:
        rows = tensor_rows(record)
        assert packed_names(record) == set(saved)
        table = record["tensor_table"]  # (every column a list now: see tensor_rows)
        if damage == "undescribed":  # an offset without its name, dtype and shape
            for column in ("names", "dtypes", "shapes"):
                del table[column][5]
            return
        if damage == "named_twice":
            table["names"][5] = table["names"][4]
            return
        row = rows["t5"]
        if damage == "outside":
            row["offset"] = 10_000
        elif damage == "negative":
            row["offset"] = -32
        elif damage == "misaligned":
            row["offset"] += 2
        elif damage == "unknown_dtype":
            row["dtype"] = "no_such_dtype"
        elif damage == "not_a_shape":
            row["shape"] = "8"
        else:
            row["offset"] = 32.0
        set_tensor_rows(record, rows)

    with CheckpointManager(tmp_path, save_interval=1) as manager:
        assert manager.save(1, saved)
        _edit_record(tmp_path, edit)
        keys = list(saved)[::-1] if reverse else list(saved)
        target = {key: torch.zeros(8) for key in keys}
        with pytest.raises(CorruptCheckpointError):
            manager.restore(1, target)
    assert all(torch.count_nonzero(value) == 0 for value in target.values())


def test_dtype_named_knows_every_dtype_by_its_stored_name_and_nothing_else() -> None:
    dtypes = {value for value in vars(torch).values() if isinstance(value, torch.dtype)}
    assert torch.float8_e4m3fn in dtypes and torch.bfloat16 in dtypes
    for dtype in dtypes:
        assert dtype_named(str(dtype).removeprefix("torch.")) is dtype
    for name in ("_inductor", "onnx", "has_cudnn", "Tensor", "load", "dtype", "no_such_dtype"):
        assert dtype_named(name) is None, name


A_CHECKPOINTS_DTYPE_NAMES = r"""
import contextlib, io, json, sys, warnings

import torch

from ckptmgr import CheckpointManager, CorruptCheckpointError
from ckptmgr.cli import main

root = sys.argv[1]
results = {}
with warnings.catch_warnings(record=True) as caught, CheckpointManager(root, 1) as manager:
    warnings.simplefilter("always")
    for name, keys in (("restore", ("a", "b", "c")), ("partial", ("a",))):
        try:
            manager.restore(1, {key: torch.zeros(8) for key in keys})
            results[name] = "returned"
        except CorruptCheckpointError as error:
            results[name] = str(error)
with contextlib.redirect_stdout(io.StringIO()) as out:
    results["inspect_rc"] = main(["inspect", root, "1", "--json"])
results["bytes"] = {row["name"]: row["bytes"] for row in json.loads(out.getvalue())["tensors"]}
results["imported"] = sorted(
    name for name in ("torch._inductor", "torch._dynamo", "torch.onnx") if name in sys.modules
)
results["warnings"] = [str(warning.message) for warning in caught]
print(json.dumps(results))
"""


def test_a_dtype_name_that_is_a_module_or_function_of_torch_is_refused_without_using_it(
    tmp_path: Path,
) -> None:
    """A record's dtype names are looked up among torch's dtypes only: ``getattr(torch,
    name)`` imports a module of torch for some names (``_inductor``: seconds) and calls a
    deprecated function for others (``has_cudnn``), which a checkpoint must not make a restore
    or ``ckptmgr inspect`` do. In a fresh interpreter, where neither module was imported."""
    from conftest import run_python

    saved = {key: torch.rand(8) for key in ("a", "b", "c")}
    with CheckpointManager(tmp_path, save_interval=1) as manager:
        assert manager.save(1, saved)

    def edit(record: dict) -> None:
        rows = tensor_rows(record)
        assert packed_names(record) == set(saved)
        rows["b"]["dtype"] = "_inductor"
        rows["c"]["dtype"] = "has_cudnn"
        set_tensor_rows(record, rows)

    _edit_record(tmp_path, edit)
    result = run_python(A_CHECKPOINTS_DTYPE_NAMES, str(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert "unknown dtype '_inductor'" in report["restore"]
    assert "unknown dtype '_inductor'" in report["partial"]  # (the pack sized by all rows)
    assert report["inspect_rc"] == 0
    assert report["bytes"] == {"a": 32, "b": None, "c": None}
    assert report["imported"] == [], "a name from the checkpoint imported a module of torch"
    assert not [w for w in report["warnings"] if "has_cudnn" in w], report["warnings"]


def test_a_packed_byte_tensor_at_offset_minus_one_is_corruption_not_skipped(
    tmp_path: Path,
) -> None:
    """Offset -1 was where the first run of the copy-out plan began as a placeholder: a uint8
    tensor placed there joined it and was never copied, and restore returned normally."""
    saved = {"a": torch.arange(4, dtype=torch.uint8), "b": torch.arange(4, dtype=torch.uint8)}
    with CheckpointManager(tmp_path, save_interval=1) as manager:
        assert manager.save(1, saved)
        _edit_record(tmp_path, lambda record: _set_row(record, "a", offset=-1))
        target = {"a": torch.zeros(4, dtype=torch.uint8), "b": torch.zeros(4, dtype=torch.uint8)}
        with pytest.raises(CorruptCheckpointError):
            manager.restore(1, target)


@pytest.mark.parametrize("shape", [[2**33], [10**20], [9]])
def test_a_record_describing_a_pack_bigger_than_its_data_is_corruption_before_allocating(
    tmp_path: Path, shape: list[int]
) -> None:
    """A partial restore sizes the pack from the record's shapes of the tensors it does not
    restore: a shape edited up is refused before a buffer of that size is allocated (it tried
    to allocate 34 GB, or raised TypeError, or a plain CheckpointError after reading)."""
    saved = {"a": torch.rand(8), "b": torch.rand(8)}
    with CheckpointManager(tmp_path, save_interval=1) as manager:
        assert manager.save(1, saved)
        _edit_record(tmp_path, lambda record: _set_row(record, "b", shape=shape))
        with pytest.raises(CorruptCheckpointError, match="more than any data file"):
            manager.restore(1, {"a": torch.zeros(8)})


def test_a_record_nested_too_deep_for_json_is_damaged_and_an_older_step_is_restored(
    tmp_path: Path,
) -> None:
    """A record nested deeper than Python's json parses raised RecursionError, which neither
    quarantined the step nor let restore_latest fall back to the step before."""
    with CheckpointManager(tmp_path, save_interval=1) as manager:
        assert manager.save(1, {"w": torch.ones(4)})
        assert manager.save(2, {"w": torch.full((4,), 2.0)})
        (record_path,) = (p for p in tmp_path.rglob("commit.json") if "000002" in str(p))
        depth = 200_000
        record_path.write_text('{"metadata": ' + "[" * depth + "]" * depth + "}")
        with pytest.raises(CorruptCheckpointError):
            manager.restore(2, {"w": torch.zeros(4)})
        target = {"w": torch.zeros(4)}
        assert manager.restore_latest(target) == 1
        assert torch.equal(target["w"], torch.ones(4))


def test_a_shape_mismatch_late_in_the_state_leaves_every_destination_untouched(
    tmp_path: Path,
) -> None:
    saved = {f"t{i:02d}": torch.rand(8) for i in range(40)}
    with CheckpointManager(tmp_path, save_interval=1) as manager:
        assert manager.save(1, saved)
        target = {key: torch.zeros(8) for key in saved}
        target["t39"] = torch.zeros(9)
        with pytest.raises(CheckpointError, match="t39"):
            manager.restore(1, target)
    assert all(torch.count_nonzero(value) == 0 for value in target.values())


def test_a_failed_copy_out_of_the_pack_raises_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """restore raises CheckpointError (the documented type) when copying out of the pack fails,
    with the original error as its cause (fault injection: the one copy call refuses)."""
    saved = _saved_state()
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, saved)

        def refusing_copy(*args: object, **kwargs: object) -> None:
            raise RuntimeError("injected: the copy out of the pack failed")

        monkeypatch.setattr(torch, "split_with_sizes_copy", refusing_copy)
        with pytest.raises(CheckpointError, match="restore of step 1 failed: injected") as caught:
            mgr.restore(1, _destinations(saved))
    assert isinstance(caught.value.__cause__, RuntimeError)


@pytest.fixture
def meta_as_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let destinations on the meta device through a restore, where ``meta`` stands in for a
    GPU (its runs take the device path on a machine without one). A restore refuses them
    otherwise: they hold no data (tests/test_save_restore.py tests that)."""
    monkeypatch.setattr(pack_load, "check_none_on_meta", lambda tensors: None)


def test_destinations_on_another_device_get_runs_of_their_own(
    tmp_path: Path, meta_as_a_device: None
) -> None:
    """A plain destination off the CPU is filled from the pack by a run of its own (one copy of
    the run's bytes to its device, then one split there), cut from its CPU neighbours' runs.
    ``meta`` stands in for CUDA here: its runs take the device path without a GPU, and the CPU
    destinations between them must still get their own bytes."""
    saved = _saved_state()
    target: dict[str, torch.Tensor] = {}
    for index, (key, value) in enumerate(saved.items()):
        on_meta = index % 3 == 1 or key.startswith("int64/")  # single ones and a whole stretch
        target[key] = torch.empty_like(value, device="meta") if on_meta else torch.zeros_like(value)
    assert {value.device.type for value in target.values()} == {"cpu", "meta"}
    with CheckpointManager(tmp_path, save_interval=1) as manager:
        assert manager.save(1, saved)
        manager.restore(1, target)
    for key, value in saved.items():
        if target[key].is_cpu:
            assert _bits_equal(target[key], value), key
        else:
            assert target[key].device.type == "meta" and target[key].shape == value.shape, key


def test_a_devices_destinations_form_one_run_across_cpu_ones_between_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, meta_as_a_device: None
) -> None:
    """An optimizer's CPU step scalars lie between each parameter's GPU moments in key order,
    but not in a pack saved from a GPU (a dtype's CPU tensors first): a restore makes one run
    per device, not a run per pair. ``meta`` stands in for the GPU."""
    count = 16
    saved = {f"state/{i}/step": torch.tensor(float(i)) for i in range(count)}
    for i in range(count):
        saved[f"state/{i}/exp_avg"] = torch.randn(8)
        saved[f"state/{i}/exp_avg_sq"] = torch.randn(8)
    target: dict[str, torch.Tensor] = {}
    for i in range(count):  # key order, as an optimizer's state dict has it
        target[f"state/{i}/step"] = torch.zeros(())
        target[f"state/{i}/exp_avg"] = torch.empty(8, device="meta")
        target[f"state/{i}/exp_avg_sq"] = torch.empty(8, device="meta")
    calls: list[str] = []
    split = torch.split_with_sizes_copy

    def counting(flat: torch.Tensor, *args: object, **kwargs: object) -> object:
        calls.append(flat.device.type)
        return split(flat, *args, **kwargs)

    with CheckpointManager(tmp_path, save_interval=1) as manager:
        assert manager.save(1, saved)
        monkeypatch.setattr(torch, "split_with_sizes_copy", counting)
        manager.restore(1, target)
    assert sorted(calls) == ["cpu", "meta"]
    for i in range(count):
        assert target[f"state/{i}/step"].item() == float(i)


def test_runs_on_a_device_get_their_bytes_in_pieces_that_skip_long_gaps() -> None:
    """The pack's bytes go to a device in one piece per stretch of its runs (a gap is bridged
    up to 64 KiB, or up to the bytes already in the piece), each piece from a 16-byte boundary."""
    meta = torch.device("meta")
    buffer = torch.empty(10_000_000, dtype=torch.uint8)

    def run(start: int, nbytes: int, device: torch.device | None = meta) -> pack_load._Run:
        made = pack_load._Run(start, torch.float32, device)
        made.end = start + nbytes
        return made

    near = [run(20, 48), run(1_000, 48), run(60_000, 400)]  # gaps under 64 KiB: one piece
    far = run(9_000_000, 64)  # a long gap: a piece of its own
    on_cpu = run(500, 100, None)  # no copy
    pack_load._copy_to_devices(buffer, [far, on_cpu, *near])
    assert on_cpu.on_device is None
    start, there = near[0].on_device  # type: ignore[misc]
    assert start == 16 and there.device == meta and there.numel() == 60_400 - 16
    assert all(r.on_device is not None and r.on_device[1] is there for r in near)
    assert far.on_device is not None and far.on_device[0] == 9_000_000
    assert far.on_device[1].numel() == 64


def test_the_device_copies_of_the_pack_are_let_go_when_unpacking_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The runs hold their device's copy of the pack only while they are copied out: after
    unpacking (and after a failed one) none is left to hold device memory through the rest of
    the restore (optimizers' load_state_dict, the ranks' agreement)."""
    meta = torch.device("meta")
    buffer = torch.arange(64, dtype=torch.uint8)
    runs = [pack_load._Run(0, torch.float32, meta), pack_load._Run(16, torch.float32, meta)]
    for run in runs:
        run.end = run.start + 16
        run.sizes = [4]
        run.outs = [torch.empty(4, device=meta)]
    copies: list[weakref.ref[torch.Tensor]] = []
    real_copy = pack_load._copy_to_devices

    def noting_copies(buffer: torch.Tensor, runs: list[pack_load._Run]) -> None:
        real_copy(buffer, runs)
        copies.extend(weakref.ref(run.on_device[1]) for run in runs if run.on_device)

    monkeypatch.setattr(pack_load, "_copy_to_devices", noting_copies)
    pack_load._unpack(buffer, runs, [], {})
    assert all(run.on_device is None for run in runs)
    assert copies and all(copy() is None for copy in copies)
    copies.clear()
    runs[1].outs = [torch.empty(4, dtype=torch.int64, device=meta)]  # another dtype: fails
    with pytest.raises(RuntimeError) as failure:
        pack_load._unpack(buffer, runs, [], {})
    assert all(run.on_device is None for run in runs)
    gc.collect()
    assert failure.value.__traceback__ is not None  # the traceback is still held here
    assert copies and all(copy() is None for copy in copies)


def test_a_device_copy_made_before_a_failed_one_is_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy to one device succeeds, the copy to the next fails (here: CUDA, absent from this
    torch build, or out of its memory): while the exception is held, the first copy is not
    kept alive by the failed frames' locals (meta stands in for the first device)."""
    buffer = torch.arange(64, dtype=torch.uint8)
    runs = [
        pack_load._Run(0, torch.float32, torch.device("meta")),
        pack_load._Run(16, torch.float32, torch.device("cuda", 0)),
    ]
    for run in runs:
        run.end = run.start + 16
        run.sizes = [4]
        run.outs = [torch.empty(4, device="meta")]
    copies: list[weakref.ref[torch.Tensor]] = []
    real_to = torch.Tensor.to

    def noting_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args and torch.device(args[0]).type == "cuda":
            raise RuntimeError("injected: CUDA out of memory")
        copy = real_to(self, *args, **kwargs)
        copies.append(weakref.ref(copy))
        return copy

    monkeypatch.setattr(torch.Tensor, "to", noting_to)
    with pytest.raises(RuntimeError, match="injected") as failure:
        pack_load._unpack(buffer, runs, [], {})
    gc.collect()
    assert failure.value.__traceback__ is not None  # the traceback is still held here
    assert len(copies) == 1 and copies[0]() is None


# -- the direct path: every destination a plain CPU tensor of its stored dtype and shape --------
def _record_of(root: Path) -> CommitRecord:
    (record_path,) = root.rglob("commit.json")
    return CommitRecord.from_json(record_path.read_bytes())


def _runs_described(runs: list[pack_load._Run]) -> list[tuple[Any, ...]]:
    """What a run copies where: its bytes, dtype, device, sizes and each output's memory."""
    return [
        (
            run.start,
            run.end,
            run.dtype,
            run.device,
            run.sizes,
            [(out.data_ptr(), tuple(out.shape), out.stride()) for out in run.outs],
        )
        for run in runs
    ]


def _assert_alike(direct: Any, matched: Any) -> None:
    """The direct path's (to load, runs, bytes, count) are the matching's, which also gives
    the pieces copied later (none here)."""
    to_load, runs, wanted_bytes, wanted_count = direct
    assert matched[2] == []
    assert list(to_load) == list(matched[0])
    assert all(to_load[key] is value for key, value in matched[0].items())
    assert _runs_described(runs) == _runs_described(matched[1])
    assert (wanted_bytes, wanted_count) == (matched[3], matched[4])


def _restore_matching_none_one_by_one(
    root: Path, target: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restore step 1 of ``root`` into ``target``, failing if any destination is matched in
    a Python step of its own (``_matched_runs``)."""

    def not_called(*args: object) -> None:
        raise AssertionError("matched one destination at a time")

    monkeypatch.setattr(pack_load, "_matched_runs", not_called)
    with CheckpointManager(root, save_interval=1) as manager:
        manager.restore(1, target)


def _direct_state() -> dict[str, torch.Tensor]:
    """Small tensors of four dtypes, interleaved in key order: 1-d, 0-d and n-d (keys with no
    "/", stored as they are)."""
    gen = torch.Generator().manual_seed(5)
    state: dict[str, torch.Tensor] = {}
    for i in range(30):
        state[f"p{i}.exp_avg"] = torch.randn(4 + i % 3, generator=gen)
        state[f"p{i}.step"] = torch.tensor(float(i))
        state[f"p{i}.weight"] = torch.randn(2, 3, generator=gen).to(torch.bfloat16)
        state[f"p{i}.count"] = torch.randint(0, 9, (5,), generator=gen)
    return state


@pytest.mark.parametrize(
    "layout", ["saved order", "reversed", "subset", "one dtype", "1-d only", "one dtype, 1-d"]
)
def test_the_direct_path_makes_the_runs_that_matching_one_by_one_makes(
    tmp_path: Path, layout: str
) -> None:
    """For destinations it takes, the direct path's runs copy the same bytes into the same
    memory as the matching of one destination at a time."""
    saved = _direct_state()
    with CheckpointManager(tmp_path, save_interval=1) as manager:
        assert manager.save(1, saved)
    record = _record_of(tmp_path)
    keys = list(saved)
    if layout == "reversed":
        keys.reverse()
    elif layout == "subset":
        keys = keys[3:-7:2]
    elif layout == "one dtype":
        keys = [key for key in keys if saved[key].dtype == torch.float32]
    elif layout == "1-d only":
        keys = [key for key in keys if saved[key].dim() == 1]
    elif layout == "one dtype, 1-d":
        keys = [key for key in keys if saved[key].dtype == torch.float32 and saved[key].dim() == 1]
    destinations = {key: torch.zeros_like(saved[key]) for key in keys}
    direct = pack_load._direct_runs(destinations, record.tensor_table, {})
    assert direct is not None
    matched = pack_load._matched_runs(destinations, record.tensor_table, {})
    assert matched[0] == {} and matched[2] == []  # (nothing loaded alone, nothing copied later)
    _assert_alike(direct, matched)
    if layout == "one dtype":  # float32 tensors lie back to back in the pack: one run
        assert len(direct[1]) == 1 and len(direct[1][0].outs) == len(keys)
    manager_target = {key: torch.zeros_like(saved[key]) for key in keys}
    with CheckpointManager(tmp_path, save_interval=1) as manager:
        manager.restore(1, manager_target)
    for key, value in manager_target.items():
        assert value.shape == saved[key].shape and _bits_equal(value, saved[key]), key


@pytest.mark.parametrize("order", ["saved order", "reversed"])
def test_destinations_all_on_one_device_take_the_direct_path(
    tmp_path: Path, order: str, monkeypatch: pytest.MonkeyPatch, meta_as_a_device: None
) -> None:
    """Destinations all on one device other than the CPU (``meta`` stands in for a GPU) take
    the direct path too: its runs are on that device and are the runs of matching one by one,
    and the restore makes one copy of the pack's bytes there and no match one at a time."""
    saved = _direct_state()
    with CheckpointManager(tmp_path, save_interval=1) as manager:
        assert manager.save(1, saved)
    record = _record_of(tmp_path)
    keys = list(saved) if order == "saved order" else list(reversed(saved))
    target = {key: torch.empty_like(saved[key], device="meta") for key in keys}
    direct = pack_load._direct_runs(target, record.tensor_table, {})
    assert direct is not None
    assert {run.device for run in direct[1]} == {torch.device("meta")}
    _assert_alike(direct, pack_load._matched_runs(target, record.tensor_table, {}))
    _restore_matching_none_one_by_one(tmp_path, target, monkeypatch)
    assert all(target[key].shape == value.shape for key, value in saved.items())


@pytest.mark.parametrize("order", ["saved order", "reversed", "subset"])
def test_tensors_stored_on_their_own_are_loaded_apart_and_the_packed_ones_directly(
    tmp_path: Path, order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state of large tensors (stored on their own) among small ones, as a model's is: the
    direct path gives the large ones to the load and makes the packed ones' runs, as matching
    one by one does; the restore matches no destination one at a time and gets every value."""
    gen = torch.Generator().manual_seed(3)
    saved: dict[str, torch.Tensor] = {}
    for i in range(12):
        saved[f"layer{i}.weight"] = torch.randn(64 * 1024 + i, generator=gen)  # on its own
        saved[f"layer{i}.bias"] = torch.randn(16, generator=gen)
        saved[f"layer{i}.step"] = torch.tensor(float(i))
    with CheckpointManager(tmp_path, save_interval=1) as manager:
        assert manager.save(1, saved)
    record = _record_of(tmp_path)
    keys = list(saved)
    if order == "reversed":
        keys.reverse()
    elif order == "subset":
        keys = keys[1::2]
    target = {key: torch.zeros_like(saved[key]) for key in keys}
    direct = pack_load._direct_runs(target, record.tensor_table, {})
    assert direct is not None
    assert set(direct[0]) == {key for key in keys if key.endswith(".weight")}
    _assert_alike(direct, pack_load._matched_runs(target, record.tensor_table, {}))
    _restore_matching_none_one_by_one(tmp_path, target, monkeypatch)
    for key, value in target.items():
        assert _bits_equal(value, saved[key]), key


@pytest.mark.parametrize(
    "odd_one",
    [
        "other dtype",
        "other shape, same size",
        "non-contiguous matrix",
        "on another device",
        "a subclass",
    ],
)
def test_destinations_the_direct_path_leaves_to_matching_one_by_one(
    tmp_path: Path, odd_one: str, meta_as_a_device: None
) -> None:
    """One destination that the direct copy cannot take sends every destination to the
    one-by-one matching, which copies the odd one through a piece or raises what is wrong."""
    saved = _direct_state()
    saved["big"] = torch.randn(64 * 1024)  # 256 KiB: stored on its own, not packed
    with CheckpointManager(tmp_path, save_interval=1) as manager:
        assert manager.save(1, saved)
    record = _record_of(tmp_path)
    target = {key: torch.zeros_like(value) for key, value in saved.items()}
    key = "p7.weight"
    if odd_one == "other dtype":
        target[key] = torch.zeros(2, 3)
    elif odd_one == "other shape, same size":
        target[key] = torch.zeros(3, 2, dtype=torch.bfloat16)
    elif odd_one == "non-contiguous matrix":
        target[key] = torch.zeros(3, 2, dtype=torch.bfloat16).t()
    elif odd_one == "on another device":
        target[key] = torch.empty(2, 3, dtype=torch.bfloat16, device="meta")
    else:

        class Marked(torch.Tensor):
            pass

        target[key] = torch.zeros(2, 3, dtype=torch.bfloat16).as_subclass(Marked)
    assert pack_load._direct_runs(target, record.tensor_table, {}) is None
    with CheckpointManager(tmp_path, save_interval=1) as manager:
        if odd_one == "other shape, same size":
            with pytest.raises(CheckpointError, match=r"p7\.weight"):
                manager.restore(1, target)
            return
        manager.restore(1, target)
    for name, value in target.items():
        if value.device.type != "meta":
            expected = saved[name].to(value.dtype)
            assert torch.equal(value.resolve_neg(), expected), name


@pytest.mark.parametrize("odd_one", ["longer", "shorter", "other dtype", "2-d of the same size"])
def test_one_odd_destination_among_1d_tensors_of_one_dtype_leaves_the_direct_path(
    tmp_path: Path, odd_one: str
) -> None:
    """Where every stored tensor is 1-d and of one dtype (the direct path's quickest checks),
    one destination of another length, dtype or shape sends the restore to the matching one by
    one, which raises for a shape (naming it) and converts another dtype; no destination of a
    failed restore was written."""
    saved = {f"t{i}": torch.randn(4) for i in range(50)}
    with CheckpointManager(tmp_path, save_interval=1) as manager:
        assert manager.save(1, saved)
    record = _record_of(tmp_path)
    target = {key: torch.zeros_like(value) for key, value in saved.items()}
    assert pack_load._direct_runs(target, record.tensor_table, {}) is not None
    target["t31"] = {
        "longer": torch.zeros(5),
        "shorter": torch.zeros(3),
        "other dtype": torch.zeros(4, dtype=torch.float64),
        "2-d of the same size": torch.zeros(2, 2),
    }[odd_one]
    assert pack_load._direct_runs(target, record.tensor_table, {}) is None
    with CheckpointManager(tmp_path, save_interval=1) as manager:
        if odd_one != "other dtype":
            with pytest.raises(CheckpointError, match="t31"):
                manager.restore(1, target)
            assert all(not value.any() for value in target.values())
            return
        manager.restore(1, target)
    for key, value in target.items():
        assert torch.equal(value, saved[key].to(value.dtype)), key


def test_lazy_negative_views_are_filled_by_the_direct_path(tmp_path: Path) -> None:
    """Destinations that are lazy negative views (a 1-d ``z.conj().imag`` of a complex ``z``,
    a contiguous n-d one) stay on the direct path, which does not look for them; the copy that
    refuses them is made again piece by piece, and they read back as saved (their memory holds
    the negated values)."""
    saved = _direct_state()
    saved["p5.weight"] = saved["p5.weight"].float()  # (for a float32 n-d negative view)
    with CheckpointManager(tmp_path, save_interval=1) as manager:
        assert manager.save(1, saved)
    record = _record_of(tmp_path)
    target = {key: torch.zeros_like(value) for key, value in saved.items()}
    vector, matrix = torch.zeros(4 + 7 % 3, dtype=torch.complex64), torch.zeros(2, 3)
    target["p7.exp_avg"], target["p5.weight"] = vector.conj().imag, matrix._neg_view()
    assert target["p7.exp_avg"].is_neg() and target["p5.weight"].is_neg()
    assert pack_load._direct_runs(target, record.tensor_table, {}) is not None
    with CheckpointManager(tmp_path, save_interval=1) as manager:
        manager.restore(1, target)
    for name, value in target.items():
        assert torch.equal(value.resolve_neg(), saved[name]), name
    assert torch.equal(vector.imag, -saved["p7.exp_avg"])
    assert torch.equal(matrix, -saved["p5.weight"])


def test_a_state_of_vectors_and_scalars_keeps_every_destination_shape(tmp_path: Path) -> None:
    """0-d destinations (an optimizer's steps) beside 1-d ones are filled through 1-d views of
    them: each keeps its shape (an ``out=`` of the wrong shape would be resized)."""
    saved: dict[str, torch.Tensor] = {}
    for i in range(50):
        saved[f"{i}/step"] = torch.tensor(float(i))
        saved[f"{i}/exp_avg"] = torch.randn(3)
    with CheckpointManager(tmp_path, save_interval=1) as manager:
        assert manager.save(1, saved)
        target = {key: torch.zeros_like(value) for key, value in saved.items()}
        storages = {key: value.untyped_storage().data_ptr() for key, value in target.items()}
        manager.restore(1, target)
    for key, value in target.items():
        assert value.shape == saved[key].shape, key
        assert value.untyped_storage().data_ptr() == storages[key], key
        assert torch.equal(value, saved[key]), key


def _copies_on_several_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unpack in pieces of 64 bytes on three threads, whatever this machine's core count."""
    monkeypatch.setattr(pack_load, "UNPACK_PIECE_BYTES", 64)
    monkeypatch.setattr(pack_load, "unpack_threads", lambda: 3)


def test_the_pack_is_copied_out_on_several_threads_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pieces of the pack are copied on more than one thread: the restoring thread's first
    copy is held until another thread has made one, and that thread's next copy until the
    restoring thread has made one (so both take part, however the GIL is handed over). Every
    destination,
    parameters that require grad and other layouts among them, gets the exact bits; no copying
    thread is left once restore returns."""
    _copies_on_several_threads(monkeypatch)
    saved = _saved_state()
    saved.update({f"many/{i:02d}": torch.rand(16) for i in range(48)})
    main = threading.get_ident()
    helper_copied, main_copied = threading.Event(), threading.Event()
    threads: list[str] = []
    held: list[bool] = []
    real_copy = pack_load._split_copy

    def noting_copy(source: torch.Tensor, sizes: list[int], outs: list[torch.Tensor]) -> None:
        on_main = threading.get_ident() == main
        if on_main and not main_copied.is_set():
            held.append(helper_copied.wait(10))
        elif not on_main and helper_copied.is_set():
            held.append(main_copied.wait(10))
        threads.append(threading.current_thread().name)
        real_copy(source, sizes, outs)
        (main_copied if on_main else helper_copied).set()

    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as mgr:
        assert mgr.save(1, saved)
        target = _destinations(saved)
        target = {key: value for key, value in target.items() if key in saved}
        target.update({key: nn.Parameter(torch.zeros(16)) for key in saved if "many/" in key})
        monkeypatch.setattr(pack_load, "_split_copy", noting_copy)
        mgr.restore(1, target)
    assert held and all(held)
    assert "ckptmgr-unpack" in threads and threading.current_thread().name in threads
    assert len(threads) >= 10  # (pieces of 64 bytes)
    assert not [t for t in threading.enumerate() if t.name == "ckptmgr-unpack"]
    for key, value in target.items():
        assert _bits_equal(value.detach(), saved[key]), key


def test_a_copy_failing_on_another_thread_fails_the_restore_and_stops_the_copying(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: a copy made by a thread other than the restoring one fails. restore
    raises ``CheckpointError`` with that failure as its cause, and by then every copying thread
    has stopped (nothing is written into the state after restore raised). The restoring
    thread's first copy, if it makes one, is held until another thread has failed one."""
    _copies_on_several_threads(monkeypatch)
    saved = {f"t{i:02d}": torch.rand(16) for i in range(48)}
    main = threading.get_ident()
    failed = threading.Event()
    held: list[bool] = []

    def failing_off_the_main_thread(*args: Any) -> None:
        if threading.get_ident() != main:
            failed.set()
            raise RuntimeError("injected: a copying thread failed")
        if not held:
            held.append(failed.wait(10))
        real_copy(*args)

    real_copy = pack_load._split_copy
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as mgr:
        assert mgr.save(1, saved)
        target = {key: torch.zeros(16) for key in saved}
        monkeypatch.setattr(pack_load, "_split_copy", failing_off_the_main_thread)
        with pytest.raises(CheckpointError, match="injected: a copying thread") as caught:
            mgr.restore(1, target)
        assert not [t for t in threading.enumerate() if t.name == "ckptmgr-unpack"]
        monkeypatch.setattr(pack_load, "_split_copy", real_copy)
        mgr.restore(1, target)  # (the next restore, on several threads again, is whole)
    assert failed.is_set() and all(held)  # (the restoring thread may have copied nothing)
    assert isinstance(caught.value.__cause__, RuntimeError)
    for key, value in target.items():
        assert torch.equal(value, saved[key]), key


def test_a_copy_failing_on_another_thread_after_the_restoring_thread_ran_out_still_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: the other copying thread fails its one piece only once the restoring
    thread has copied every other piece (and so has stopped taking pieces): restore still
    raises ``CheckpointError`` for it, rather than returning with that piece not copied."""
    monkeypatch.setattr(pack_load, "UNPACK_PIECE_BYTES", 64)
    monkeypatch.setattr(pack_load, "unpack_threads", lambda: 2)
    saved = {f"t{i:02d}": torch.rand(16) for i in range(48)}  # 64 bytes each: 48 pieces
    main = threading.get_ident()
    progress = threading.Condition()
    copied_here: list[int] = []
    taken_there = threading.Event()
    held: list[bool] = []

    def failing_last_off_the_main_thread(*args: Any) -> None:
        if threading.get_ident() != main:
            taken_there.set()
            with progress:
                held.append(progress.wait_for(lambda: len(copied_here) == 47, timeout=10))
            raise RuntimeError("injected: the other thread's piece failed last")
        if not copied_here:
            held.append(taken_there.wait(10))
        real_copy(*args)
        with progress:
            copied_here.append(1)
            progress.notify_all()

    real_copy = pack_load._split_copy
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as mgr:
        assert mgr.save(1, saved)
        target = {key: torch.zeros(16) for key in saved}
        monkeypatch.setattr(pack_load, "_split_copy", failing_last_off_the_main_thread)
        with pytest.raises(CheckpointError, match="failed last"):
            mgr.restore(1, target)
    assert held == [True, True] and len(copied_here) == 47


def test_inference_tensors_are_restored_under_inference_mode_on_several_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Destinations made under ``torch.inference_mode`` (a model loaded for serving) are
    restored under it: the other copying threads copy in the calling thread's inference mode
    (it is per thread, and an inference tensor refuses an in-place write outside it)."""
    _copies_on_several_threads(monkeypatch)
    saved = {f"t{i:02d}": torch.rand(16) for i in range(48)}
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as mgr:
        assert mgr.save(1, saved)
        with torch.inference_mode():
            target = {key: torch.zeros(16) for key in saved}
            mgr.restore(1, target)
    assert all(value.is_inference() for value in target.values())
    for key, value in target.items():
        assert torch.equal(value, saved[key]), key
