"""The on-disk tensor encoding (format_version 2 and 3): raw tensor bytes in DCP's data files.

Pins what the format changes promise: new commits say ``format_version`` 3; the ``*.distcp``
files of a step hold exactly the tensors' bytes and nothing else (no torch.save zip per tensor);
the commit record still lists every logical key with its dtype and shape when small tensors are
packed together (in one column-wise ``tensor_table`` since format 3); round trips are bit-exact
for every dtype, shape and layout; a destination that does not match the checkpoint is refused;
steps written by earlier ckptmgrs (format 1, ``tests/data/format_v1``, and format 2,
``tests/data/format_v2``) still restore; and a damaged data file is noticed.

Everything is real: the local disk, DCP, torch's optimizers. States are filled with random
*bits*, so that NaN payloads, subnormals and -0.0 are part of every comparison.
"""

from __future__ import annotations

import copy
import io
import json
import pickle
import shutil
import threading
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import in_forked_child, packed_names, tensor_rows
from torch import nn

from ckptmgr import (
    CheckpointError,
    CheckpointManager,
    CommitRecord,
    CorruptCheckpointError,
    ordered_hash,
    tensor_bytes,
)
from ckptmgr.record import TensorEntry, TensorTable, record_bytes
from ckptmgr.remote_read import RemoteRangeSource

DATA = Path(__file__).resolve().parent / "data"
KIB = 1024
MIB = 1024 * KIB

DTYPES: list[torch.dtype] = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]
SHAPES: dict[str, tuple[int, ...]] = {
    "scalar": (),
    "empty": (0, 3),
    "vector": (7,),
    "4d": (2, 3, 1, 4),
}
MODES = ["save", "save_async"]


# -- states and bit-exact comparison ---------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    """The dtype as the commit record writes it (``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A contiguous tensor of random bits (any bit pattern for floats: NaNs, -0.0, subnormals)."""
    numel = 1
    for size in shape:
        numel *= size
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``tensor``'s values, in logical order."""
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_bit_equal(actual: Any, expected: Any, where: str = "state") -> None:
    """Same structure, same dtypes and shapes, same bits (NaN payloads and -0.0 included)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual)}"
        assert actual.dtype == expected.dtype, f"{where}: {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: {actual.shape} != {expected.shape}"
        assert torch.equal(bits(actual), bits(expected)), f"{where}: values differ"
    elif isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), f"{where}: {type(actual)}"
        assert set(actual) == set(expected), f"{where}: {sorted(actual)} != {sorted(expected)}"
        for key in expected:
            assert_bit_equal(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
        assert len(actual) == len(expected), where
        for index, (got, want) in enumerate(zip(actual, expected, strict=True)):
            assert_bit_equal(got, want, f"{where}[{index}]")
    else:
        assert type(actual) is type(expected) and actual == expected, f"{where}: {actual!r}"


def snapshot(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Clones of ``tensors`` (what a save must hold, whatever happens to the sources later)."""
    return {key: value.detach().clone() for key, value in tensors.items()}


def zeros_like_state(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Freshly allocated zero tensors of the same shapes and dtypes (contiguous, unshared)."""
    return {key: torch.zeros(value.shape, dtype=value.dtype) for key, value in tensors.items()}


def scribble(tensors: Mapping[str, torch.Tensor]) -> None:
    """Overwrite every source tensor in place (views and tied tensors included)."""
    for value in tensors.values():
        value.fill_(1)


def layout_state(dtype: torch.dtype, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Every shape and source layout for one dtype: 0-d, empty, 1-d, 4-d, transposed, strided,
    overlapping views of one storage, and one tensor under two keys (tied)."""
    name = dtype_name(dtype)
    state = {f"{name}_{label}": random_tensor(dtype, shape, gen) for label, shape in SHAPES.items()}
    shared = random_tensor(dtype, (64,), gen)
    tied = random_tensor(dtype, (4, 5), gen)
    state.update(
        {
            f"{name}_transposed": random_tensor(dtype, (5, 3), gen).t(),
            f"{name}_strided": random_tensor(dtype, (10,), gen)[::2],
            f"{name}_view_a": shared[:40],
            f"{name}_view_b": shared[24:].view(8, 5),  # overlaps view_a
            f"{name}_tied": tied,
            f"{name}_tied_again": tied,
        }
    )
    assert not state[f"{name}_transposed"].is_contiguous()
    assert not state[f"{name}_strided"].is_contiguous()
    return state


def everything_state(seed: int) -> dict[str, torch.Tensor]:
    """Every dtype and layout in one state, plus tensors bigger than 4 MiB next to the small
    ones (a contiguous one and a transposed one)."""
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for dtype in DTYPES:
        state.update(layout_state(dtype, gen))
    state["big_f32"] = random_tensor(torch.float32, (5 * MIB // 4,), gen)
    state["big_bf16_transposed"] = random_tensor(torch.bfloat16, (1600, 1400), gen).t()
    assert state["big_f32"].nbytes > 4 * MIB and state["big_bf16_transposed"].nbytes > 4 * MIB
    return state


def save_with(mgr: CheckpointManager, mode: str, step: int, state: Mapping[str, Any]) -> None:
    """Save ``state`` at ``step`` with ``save`` or ``save_async`` (the caller joins)."""
    method: Callable[..., bool] = getattr(mgr, mode)
    assert method(step, state, force=True)


def manager(path: Path, **kwargs: Any) -> CheckpointManager:
    """A manager for ``path`` with preemption handling off (tests never install handlers)."""
    kwargs.setdefault("chkpt_on_preemption", False)
    return CheckpointManager(path, 1, **kwargs)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:012d}"


def read_record(root: Path, step: int) -> dict[str, Any]:
    record: dict[str, Any] = json.loads((step_dir(root, step) / "commit.json").read_text())
    return record


def distcp_files(root: Path, step: int) -> list[Path]:
    """The DCP data files of a step, ``__<rank>_<n>.distcp``."""
    files = sorted(step_dir(root, step).glob("*.distcp"))
    assert files, f"no .distcp files in step {step}"
    return files


# -- the data files of a step: raw tensor bytes, nothing else --------------------------------------
def many_small_state() -> dict[str, Any]:
    """2,000 tensors of 1 KiB and three of 1 MiB."""
    gen = torch.Generator().manual_seed(11)
    state: dict[str, Any] = {
        f"small_{index:04d}": random_tensor(torch.float32, (KIB // 4,), gen)
        for index in range(2000)
    }
    for index in range(3):
        state[f"large_{index}"] = random_tensor(torch.float32, (MIB // 4,), gen)
    return state


def mixed_dtype_state() -> dict[str, Any]:
    """Every dtype at odd byte counts, a module, slices of bigger storages, and plain values."""
    gen = torch.Generator().manual_seed(12)
    state: dict[str, Any] = {}
    for index, dtype in enumerate(DTYPES):
        name = dtype_name(dtype)
        state[f"{name}_odd"] = random_tensor(dtype, (2 * index + 3,), gen)
        state[f"{name}_scalar"] = random_tensor(dtype, (), gen)
        state[f"{name}_empty"] = random_tensor(dtype, (0, 2), gen)
        state[f"{name}_medium"] = random_tensor(dtype, (300 + index, 7), gen)
    base = random_tensor(torch.float64, (1000,), gen)
    state["slice_of_bigger_storage"] = base[100:110]  # only 10 of 1000 elements are saved
    state["strided_slice"] = base[::50]
    state["transposed"] = random_tensor(torch.int16, (33, 17), gen).t()
    module = nn.Linear(16, 8).to(torch.bfloat16)
    state["module"] = module
    state["epoch"] = 4  # a plain value: not in the data files
    return state


def logical_tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Stored path -> tensor for a flat state whose values are tensors, modules or plain values."""
    found: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            found[key] = value
        elif isinstance(value, nn.Module):
            for name, tensor in value.state_dict().items():
                found[f"{key}/{name}"] = tensor
    return found


STATES: dict[str, Callable[[], dict[str, Any]]] = {
    "many_small": many_small_state,
    "mixed_dtypes": mixed_dtype_state,
}


@dataclass(frozen=True)
class SavedStep:
    """One committed step on disk and the tensors it was saved from, by stored path."""

    root: Path
    step: int
    state_name: str
    tensors: dict[str, torch.Tensor]


@pytest.fixture(
    scope="module",
    params=[(state, mode, threads) for state in STATES for mode in MODES for threads in (1, 3)],
    ids=lambda p: f"{p[0]}-{p[1]}-threads{p[2]}",
)
def saved_step(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> SavedStep:
    """A state saved once per (state, save mode, num_of_threads), shared by the tests below."""
    state_name, mode, threads = request.param
    state = STATES[state_name]()
    root = tmp_path_factory.mktemp(f"{state_name}-{mode}-{threads}") / "ckpts"
    with manager(root, num_of_threads=threads) as mgr:
        save_with(mgr, mode, 7, state)
        mgr.join()
        assert mgr.all_steps() == [7]
    return SavedStep(root, 7, state_name, snapshot(logical_tensors(state)))


def test_data_files_hold_exactly_the_raw_tensor_bytes(saved_step: SavedStep) -> None:
    """The ``*.distcp`` files add up to the sum of the tensors' ``numel * element_size``."""
    files = distcp_files(saved_step.root, saved_step.step)
    on_disk = sum(path.stat().st_size for path in files)
    raw = sum(t.numel() * t.element_size() for t in saved_step.tensors.values())
    assert on_disk == raw, (
        f"{len(files)} data files hold {on_disk} bytes; the tensors are {raw} bytes "
        f"({on_disk - raw:+d})"
    )


def test_record_lists_every_logical_key_with_dtype_and_shape(saved_step: SavedStep) -> None:
    """Packed or not, ``tensor_table`` in commit.json has one row per key of the state (no
    more), with its dtype and shape."""
    record = read_record(saved_step.root, saved_step.step)
    expected = {
        key: {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}
        for key, t in saved_step.tensors.items()
    }
    names = record["tensor_table"]["names"]
    rows = tensor_rows(record)
    assert len(names) == len(rows) == len(expected)
    assert set(rows) == set(expected)
    for key, entry in expected.items():
        assert {"dtype": rows[key]["dtype"], "shape": rows[key]["shape"]} == entry, key
    files = {entry["path"] for entry in record["files"]}
    assert {p.name for p in distcp_files(saved_step.root, saved_step.step)} <= files


def test_record_table_is_serialised_once_and_follows_later_changes() -> None:
    """A record given a TensorTable writes the same JSON content as one given format 2's
    ``tensors`` and ``packed``; the table's text is made once; a table set afterwards is what
    gets written."""
    from ckptmgr.record import utc_now

    entries = {
        "a/b": TensorEntry(dtype="float32", shape=[2, 3]),
        "c": TensorEntry(dtype="int8", shape=[]),
        "d": TensorEntry(dtype="int64", shape=[1000]),
    }
    offsets = {"a/b": 0, "c": 24}
    fields = dict(step=3, save_id="s", committed_at=utc_now(), world_size=1, metrics={"loss": 1.5})
    from_objects = CommitRecord(**fields, tensors=entries, packed=offsets)
    table = TensorTable(
        ["a/b", "c", "d"], ["float32", "int8", "int64"], [[2, 3], [], [1000]], [0, 24, None]
    )
    from_table = CommitRecord(**fields, tensor_table=table)
    assert from_table.tensor_table is table
    assert json.loads(from_table.to_json()) == json.loads(from_objects.to_json())
    assert CommitRecord.from_json(from_table.to_json()) == from_objects
    assert table.to_json() is table.to_json()
    assert dict(from_table.tensors) == entries and dict(from_table.packed) == offsets
    from_table.tensor_table = TensorTable(["z"], ["bool"], [[1]], [None])
    written = json.loads(from_table.to_json())
    assert written["tensor_table"] == {
        "names": ["z"],
        "dtypes": ["bool"],
        "shapes": [[1]],
        "pack_offsets": [None],
    }


def test_trusted_entries_equal_validated_ones_and_serialise_alike() -> None:
    from ckptmgr.record import _TENSORS_JSON

    trusted = {"a": TensorEntry.trusted("bfloat16", [4, 1]), "b": TensorEntry.trusted("int8", [])}
    validated = {"a": TensorEntry(dtype="bfloat16", shape=[4, 1]), "b": TensorEntry("int8", [])}
    assert trusted == validated
    assert _TENSORS_JSON.dump_json(trusted) == _TENSORS_JSON.dump_json(validated)
    assert _TENSORS_JSON.validate_json(_TENSORS_JSON.dump_json(trusted)) == validated


def test_a_record_that_packs_an_undescribed_tensor_does_not_validate() -> None:
    from ckptmgr.record import utc_now

    record = CommitRecord(step=1, save_id="s", committed_at=utc_now(), world_size=1)
    data = json.loads(record.to_json())
    del data["tensor_table"]
    data.update(format_version=2, tensors={"real": {"dtype": "int8", "shape": [2]}})
    data["packed"] = {"real": 0, "ghost": 2}
    with pytest.raises(ValueError, match="ghost"):
        CommitRecord.from_json(json.dumps(data))
    del data["packed"]["ghost"]
    assert dict(CommitRecord.from_json(json.dumps(data)).packed) == {"real": 0}
    data["tensor_table"] = record.tensor_table.to_columns()  # both forms at once
    with pytest.raises(ValueError, match="a record of format 2 holds no tensor_table"):
        CommitRecord.from_json(json.dumps(data))
    data["format_version"] = 3
    with pytest.raises(ValueError, match="not both"):
        CommitRecord.from_json(record_bytes(data))


def test_saves_of_one_layout_share_a_record_table_and_a_new_layout_gets_its_own(
    tmp_path: Path,
) -> None:
    """While the staging layout holds, each record reuses one table (serialised once); after a
    shape change the record describes the new shapes."""
    state = {f"t{i}": torch.full((4,), float(i)) for i in range(10)}
    with manager(tmp_path) as mgr:
        tables = []
        for step in (1, 2):
            assert mgr.save_async(step, state)
            mgr.join()
            tables.append(mgr._record_tables._last[2])  # internal: the cached table
        assert tables[0] is tables[1]
        state["t3"] = torch.zeros(2, 3)
        assert mgr.save_async(3, state)
        mgr.join()
        assert mgr._record_tables._last[2] is not tables[0]
        for step in (1, 2, 3):
            record = read_record(tmp_path, step)
            expected = [2, 3] if step == 3 else [4]
            assert tensor_rows(record)["t3"]["shape"] == expected
            assert packed_names(record) == set(state)
            target = {k: torch.empty_like(v) for k, v in state.items()}
            if step < 3:
                target["t3"] = torch.empty(4)
            mgr.restore(step, target)
            assert torch.equal(target["t5"], state["t5"])


@pytest.mark.parametrize("mode", ["save", "save_async"])
def test_small_views_of_one_flat_buffer_are_packed_by_both_saves(tmp_path: Path, mode: str) -> None:
    """Parameters that are slices of one flat buffer (a contiguous parameter buffer), a tied
    copy and one large slice: ``save`` and ``save_async`` store the small slices in the pack
    (not as 300 items of their own, each with DCP's per-item work at write and restore), and
    the step restores bit-exact into slices of another buffer and into tensors of their own."""
    generator = torch.Generator().manual_seed(11)
    flat = torch.randn(300 * 64 + 40_000, generator=generator)
    state = {f"p{i}": flat[i * 64 : (i + 1) * 64].view(8, 8) for i in range(300)}
    state["tied"] = state["p7"]
    state["large"] = flat[300 * 64 :]
    with manager(tmp_path) as mgr:
        save_with(mgr, mode, 1, state)
        mgr.join()
        assert packed_names(read_record(tmp_path, 1)) == set(state) - {"large"}
        other = torch.zeros_like(flat)
        into_views = {f"p{i}": other[i * 64 : (i + 1) * 64].view(8, 8) for i in range(300)}
        into_views["tied"] = torch.zeros(8, 8)
        into_views["large"] = other[300 * 64 :]
        mgr.restore(1, into_views)
        assert torch.equal(other, flat)
        apart = {key: torch.zeros_like(value) for key, value in state.items()}
        mgr.restore(1, apart)
        for key, value in state.items():
            assert torch.equal(apart[key], value), key


def test_saved_step_restores_bit_exact_into_zeros(saved_step: SavedStep) -> None:
    """The same step restores into zero tensors and a zeroed module, bit-exact."""
    target = STATES[saved_step.state_name]()
    for key, value in target.items():
        if isinstance(value, torch.Tensor):
            target[key] = torch.zeros(value.shape, dtype=value.dtype)
        elif isinstance(value, nn.Module):
            with torch.no_grad():
                for tensor in value.state_dict().values():
                    tensor.zero_()
        else:
            target[key] = None
    with manager(saved_step.root, read_only=True) as mgr:
        mgr.restore(saved_step.step, target)
    assert_bit_equal(logical_tensors(target), saved_step.tensors)
    assert target.get("epoch", 4) == 4


@pytest.mark.parametrize("mode", MODES)
def test_new_commits_have_format_version_4(tmp_path: Path, mode: str) -> None:
    """commit.json of a new step says format 4, with a ``tensor_table`` and no ``tensors`` or
    ``packed``, and CommitRecord reads it back."""
    with manager(tmp_path) as mgr:
        save_with(mgr, mode, 1, {"w": torch.arange(10.0), "epoch": 1})
        mgr.join()
    raw = read_record(tmp_path, 1)
    assert raw["format_version"] == 4
    assert "tensors" not in raw and "packed" not in raw
    assert tensor_rows(raw) == {"w": {"dtype": "float32", "shape": [10], "offset": None}}
    record = CommitRecord.from_json((step_dir(tmp_path, 1) / "commit.json").read_bytes())
    assert record.format_version == 4
    assert dict(record.tensors) == {"w": TensorEntry(dtype="float32", shape=[10])}


# -- bit-exact round trips -------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_round_trip_of_one_dtype_in_every_layout(
    tmp_path: Path, dtype: torch.dtype, mode: str
) -> None:
    """0-d, empty, 1-d, 4-d, non-contiguous, shared-storage and tied sources come back bit-exact
    into fresh zero tensors."""
    state = layout_state(dtype, torch.Generator().manual_seed(3))
    expected = snapshot(state)
    with manager(tmp_path) as mgr:
        save_with(mgr, mode, 1, state)
        scribble(state)  # the checkpoint holds the values of the call
        mgr.join()
        target = zeros_like_state(expected)
        mgr.restore(1, target)
    assert_bit_equal(target, expected)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("mode", MODES)
def test_round_trip_of_every_dtype_small_and_big_in_one_state(
    tmp_path: Path, mode: str, threads: int
) -> None:
    """All dtypes and layouts in one state (small tensors packed together), next to tensors of
    more than 4 MiB; the sources are left untouched by the save."""
    state = everything_state(5)
    expected = snapshot(state)
    with manager(tmp_path, num_of_threads=threads) as mgr:
        save_with(mgr, mode, 1, state)
        mgr.join()
        assert_bit_equal(state, expected, "source after save")
        scribble(state)
        target = zeros_like_state(expected)
        mgr.restore(1, target)
    assert_bit_equal(target, expected)


def test_restoring_a_subset_of_packed_keys(tmp_path: Path) -> None:
    """A state with only some of the saved keys gets exactly those, bit-exact."""
    state = everything_state(6)
    expected = snapshot(state)
    chosen = ["int8_vector", "bool_scalar", "complex64_4d", "bfloat16_view_b", "big_f32"]
    with manager(tmp_path) as mgr:
        assert mgr.save(1, state)
        target = zeros_like_state({key: expected[key] for key in chosen})
        mgr.restore(1, target)
    assert_bit_equal(target, {key: expected[key] for key in chosen})


def make_model(seed: int) -> nn.Sequential:
    """A small MLP whose parameters are random in ``seed``."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    return model


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One deterministic AdamW step on a batch drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    inputs, targets = torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()


@pytest.mark.parametrize("mode", MODES)
def test_module_and_adamw_round_trip_and_train_on_identically(tmp_path: Path, mode: str) -> None:
    """A fresh model and optimizer restored from a step continue exactly as the originals."""
    model = make_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_step(model, optimizer, seed=100)
    saved_model = snapshot(model.state_dict())
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    with manager(tmp_path) as mgr:
        save_with(mgr, mode, 1, {"model": model, "optim": optimizer, "epoch": 1})
        train_step(model, optimizer, seed=101)  # the original trains on (maybe during the write)
        mgr.join()

        fresh_model = make_model(1)
        fresh_optimizer = torch.optim.AdamW(fresh_model.parameters(), lr=0.01)
        state: dict[str, Any] = {"model": fresh_model, "optim": fresh_optimizer, "epoch": 0}
        mgr.restore(1, state)
    assert state["epoch"] == 1
    assert_bit_equal(fresh_model.state_dict(), saved_model, "model")
    assert_bit_equal(fresh_optimizer.state_dict(), saved_optimizer, "optim")

    before = snapshot(fresh_model.state_dict())
    train_step(fresh_model, fresh_optimizer, seed=101)
    assert not torch.equal(fresh_model[0].weight, before["0.weight"])  # the step did something
    assert_bit_equal(fresh_model.state_dict(), model.state_dict(), "model after one more step")
    assert_bit_equal(fresh_optimizer.state_dict(), optimizer.state_dict(), "optim after a step")


# -- shapes that change between saves --------------------------------------------------------------
def shaped_state(
    shapes: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], seed: int
) -> dict[str, torch.Tensor]:
    """Random tensors of the given dtypes and shapes."""
    gen = torch.Generator().manual_seed(seed)
    return {key: random_tensor(dtype, shape, gen) for key, (dtype, shape) in shapes.items()}


SHAPES_A: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
    "w": (torch.float32, (64, 32)),
    "b": (torch.bfloat16, (32,)),
    "ids": (torch.int64, (5,)),
    "mask": (torch.bool, (9,)),
    "step": (torch.float32, ()),
    "gone_later": (torch.float16, (3, 3)),
    "big": (torch.float32, (5 * MIB // 4,)),
    **{f"tiny_{i}": (torch.int32, (i + 1,)) for i in range(20)},
}
SHAPES_B: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
    **{key: spec for key, spec in SHAPES_A.items() if key != "gone_later"},
    "w": (torch.float32, (16, 8)),
    "b": (torch.bfloat16, (100,)),
    "ids": (torch.int64, (2, 2)),
    "mask": (torch.bool, (0,)),
    "step": (torch.float32, (1,)),
    "big": (torch.float32, (1000,)),  # big becomes small
    "tiny_3": (torch.int32, (3 * MIB,)),  # a small one becomes big
    "added": (torch.int16, (7,)),
}


def assert_each_step_restores(
    mgr: CheckpointManager, root: Path, saved: dict[int, dict[str, torch.Tensor]]
) -> None:
    """Each step's record describes the shapes saved at that step, and the step restores to
    those values bit-exact (newest first)."""
    for step in sorted(saved, reverse=True):
        record = read_record(root, step)
        assert {key: row["shape"] for key, row in tensor_rows(record).items()} == {
            key: list(t.shape) for key, t in saved[step].items()
        }
        target = zeros_like_state(saved[step])
        mgr.restore(step, target)
        assert_bit_equal(target, saved[step], f"step {step}")


@pytest.mark.parametrize("max_pending_async", [1, 2])
def test_shape_changes_between_async_saves_restore_bit_exact(
    tmp_path: Path, max_pending_async: int
) -> None:
    """Steps 1 (A), 2 (other shapes, a key added and one removed) and 3 (A's shapes again) of one
    manager each restore to what was saved at that step, oldest last."""
    saved: dict[int, dict[str, torch.Tensor]] = {}
    with manager(tmp_path, max_pending_async=max_pending_async) as mgr:
        for step, shapes in ((1, SHAPES_A), (2, SHAPES_B), (3, SHAPES_A)):
            state = shaped_state(shapes, seed=step)
            saved[step] = snapshot(state)
            assert mgr.save_async(step, state)
            scribble(state)
        mgr.join()
        assert mgr.all_steps() == [1, 2, 3]
        assert_each_step_restores(mgr, tmp_path, saved)


def test_shape_changes_between_saves_restore_bit_exact(tmp_path: Path) -> None:
    """save() reuses its pack layout (and so the record's tensor table) while the state keeps its
    layout, and lays the pack out anew when it changes: steps 1 (A), 2 (the same tensors, all
    overwritten since), 3 (B) and 4 (A again) each restore to what was saved at that step."""
    saved: dict[int, dict[str, torch.Tensor]] = {}
    tables = {}
    with manager(tmp_path) as mgr:
        state = shaped_state(SHAPES_A, seed=1)
        for step, shapes in ((1, None), (2, None), (3, SHAPES_B), (4, SHAPES_A)):
            if shapes is not None:
                state = shaped_state(shapes, seed=step)
            saved[step] = snapshot(state)
            assert mgr.save(step, state)
            tables[step] = mgr._record_tables._last[2]  # internal: the cached table
            scribble(state)
        assert tables[1] is tables[2] and len({id(tables[n]) for n in (2, 3, 4)}) == 3
        assert_each_step_restores(mgr, tmp_path, saved)


# -- destinations that do not match ----------------------------------------------------------------
def packed_state() -> dict[str, torch.Tensor]:
    """Many small tensors (packed together) and one big one."""
    gen = torch.Generator().manual_seed(9)
    state = {f"small_{i:02d}": random_tensor(torch.float32, (16,), gen) for i in range(30)}
    state["packed_key_under_test"] = random_tensor(torch.float32, (4, 4), gen)
    state["big"] = random_tensor(torch.float32, (MIB,), gen)
    return state


SHAPE_MISMATCHES: dict[str, torch.Tensor] = {
    "shape_same_numel": torch.zeros(16, dtype=torch.float32),
    "shape_other_numel": torch.zeros(4, 5, dtype=torch.float32),
}


@pytest.mark.parametrize("kind", list(SHAPE_MISMATCHES))
def test_a_destination_of_another_shape_is_refused(tmp_path: Path, kind: str) -> None:
    """Another shape raises CheckpointError naming the key, and leaves it unfilled."""
    destination = SHAPE_MISMATCHES[kind].clone()
    with manager(tmp_path) as mgr:
        assert mgr.save(1, packed_state())
        with pytest.raises(CheckpointError) as caught:
            mgr.restore(1, {"small_00": torch.zeros(16), "packed_key_under_test": destination})
    assert "packed_key_under_test" in str(caught.value)
    assert not isinstance(caught.value, CorruptCheckpointError)  # the checkpoint is fine
    assert torch.count_nonzero(destination) == 0


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.bfloat16])
def test_a_destination_of_another_dtype_gets_converted_values(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """Like ``load_state_dict`` and DCP, a restore converts to the destination's dtype: packed
    small tensors and tensors stored on their own alike."""
    saved = packed_state()
    saved["packed_key_under_test"] = torch.randn(4, 4) * 100  # finite: convertible to ints
    saved["big"] = torch.randn(MIB) * 100
    with manager(tmp_path) as mgr:
        assert mgr.save(1, saved)
        target = {
            "packed_key_under_test": torch.zeros(4, 4, dtype=dtype),
            "big": torch.zeros(MIB, dtype=dtype),
        }
        mgr.restore(1, target)
    for key in target:
        assert target[key].dtype == dtype
        assert torch.equal(target[key], saved[key].to(dtype)), key


@pytest.mark.parametrize("numel", [3, 20_000], ids=["packed", "alone"])
def test_lazily_conjugated_and_negated_destinations_get_the_stored_values(
    tmp_path: Path, numel: int
) -> None:
    """Destinations that are ``conj()`` views of complex tensors, or carry the negative bit
    (``conj().imag``), read as the stored values after a restore; small ones come out of the
    pack, which copies them with ``torch.split_with_sizes_copy``, whose ``out=`` refuses such
    views."""
    generator = torch.Generator().manual_seed(numel)
    stored = {
        "c": torch.randn(numel, dtype=torch.complex64, generator=generator),
        "r": torch.randn(numel, generator=generator),
        "other": torch.randn(numel, generator=generator),
    }
    with manager(tmp_path) as mgr:
        assert mgr.save(1, stored)
        complex_base = torch.zeros(numel, dtype=torch.complex64)
        negated_base = torch.zeros(numel, dtype=torch.complex64)
        other = torch.zeros(numel)
        targets = {"c": complex_base.conj(), "r": negated_base.conj().imag, "other": other}
        assert targets["r"].is_neg()
        mgr.restore(1, targets)
    assert torch.equal(targets["c"].resolve_conj(), stored["c"])
    assert torch.equal(targets["r"].resolve_neg(), stored["r"])
    assert torch.equal(other, stored["other"])


def _inference_zeros(shape: torch.Size) -> torch.Tensor:
    with torch.inference_mode():
        return torch.zeros(shape)


UNWRITABLE_DESTINATIONS: dict[str, tuple[Callable[[torch.Size], torch.Tensor], str]] = {
    # immutable, no memory: torch's "ZeroTensors are immutable" (packed), DCP's "Bad address"
    # from reading into address 0 (alone)
    "efficient_zero": (torch._efficientzerotensor, "it is an efficient zero tensor"),
    "expanded": (
        lambda shape: torch.zeros([1] * len(shape)).expand(shape),
        "several of its elements share memory",
    ),
    "sparse": (lambda shape: torch.zeros(shape).to_sparse(), "it is a sparse_coo tensor"),
    "inference": (_inference_zeros, "it is an inference tensor"),
}


@pytest.mark.parametrize("key", ["packed_key_under_test", "big"], ids=["packed", "alone"])
@pytest.mark.parametrize("kind", list(UNWRITABLE_DESTINATIONS))
def test_a_destination_that_cannot_be_written_in_place_is_refused_by_name(
    tmp_path: Path, key: str, kind: str
) -> None:
    """A destination torch cannot fill in place (an efficient zero tensor, what forward-mode AD
    makes; elements sharing memory; no dense memory; an inference tensor outside inference
    mode) failed with torch's message naming no key ("more
    than one element of the written-to tensor refers to a single memory location", "nbytes is
    not defined for sparse tensors"...), a sparse one as a bare RuntimeError. It raises
    CheckpointError naming the key, and the same step then restores into an ordinary tensor.
    (An inference tensor stored alone is read into straight, without torch's check: it is
    filled.)"""
    make, reason = UNWRITABLE_DESTINATIONS[kind]
    saved = packed_state()
    with manager(tmp_path) as mgr:
        assert mgr.save(1, saved)
        target = zeros_like_state(saved)
        target[key] = make(saved[key].shape)
        if kind == "inference" and key == "big":
            mgr.restore(1, target)
            assert_bit_equal(target, saved)
            return
        with pytest.raises(CheckpointError) as caught:
            mgr.restore(1, target)
        assert f"cannot restore into '{key}': {reason}" in str(caught.value)
        assert not isinstance(caught.value, CorruptCheckpointError)  # the checkpoint is fine
        target[key] = torch.ones(saved[key].shape)
        mgr.restore(1, target)
    assert_bit_equal(target, saved)


def test_bytes_of_an_efficient_zero_tensor_are_written_as_zeros_and_never_read_at_0() -> None:
    """A tensor with no memory (an efficient zero tensor: ``data_ptr()`` is 0) had its bytes
    read from address 0 when written to a stream, and a stream read into it there: both
    crashed the process (SIGSEGV). Its zeros are written; a read into it raises."""

    def work() -> bytes:
        zero = torch._efficientzerotensor(1000, dtype=torch.float64)
        stream = io.BytesIO()
        assert tensor_bytes.write_tensor(tensor_bytes.StreamSink(stream), zero) == (0, 8000)
        written = stream.getvalue() == bytes(8000)
        ones = b"\x01" * 8000
        with RemoteRangeSource(lambda start, end: ones[start:end], 8000, "data", None) as source:
            try:
                tensor_bytes.read_chunk(source, 0, 8000, torch.float64, (1000,), zero)
            except ValueError:
                return b"zeros written, read refused" if written else b"wrong bytes written"
        return b"read into a tensor with no memory"

    assert in_forked_child(work) == b"zeros written, read refused"


@pytest.mark.parametrize("run_bytes", [tensor_bytes.RUN_BYTES, 1000])
def test_tensors_written_in_runs_land_as_each_written_on_its_own(
    run_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``write_tensors`` joins runs of small plain CPU tensors into one write: the bytes and
    places of every tensor are those of ``write_tensor`` on each in turn, whichever tensors end
    a run (a big one, a lazy view, one without memory, a strided one, none at all) and where a
    run is cut for its size."""
    monkeypatch.setattr(tensor_bytes, "RUN_BYTES", run_bytes)
    gen = torch.Generator().manual_seed(7)
    parameter = nn.Parameter(random_tensor(torch.float32, (3, 5), gen))
    complex_values = random_tensor(torch.complex64, (6,), gen)
    tensors = [
        random_tensor(torch.float32, (100,), gen),
        random_tensor(torch.bfloat16, (7, 3), gen),
        random_tensor(torch.bool, (9,), gen),
        random_tensor(torch.complex128, (4,), gen),
        random_tensor(torch.float64, (), gen),
        parameter,  # (requires grad)
        random_tensor(torch.uint8, (0, 4), gen),  # (no bytes)
        random_tensor(torch.int64, (300,), gen),
        complex_values.conj(),  # a lazy conjugate: written as its value
        random_tensor(torch.float16, (33,), gen),
        -random_tensor(torch.float32, (8,), gen),
        random_tensor(torch.float32, (2, 10), gen).t(),  # strided
        random_tensor(torch.int8, (5,), gen),
        random_tensor(torch.float32, (20_000,), gen),  # above SMALL_TENSOR_BYTES
        random_tensor(torch.int16, (17,), gen),
        complex_values.imag,  # a strided view
        random_tensor(torch.float8_e4m3fn, (11,), gen),
        torch._efficientzerotensor(12, dtype=torch.float32),  # no memory
        random_tensor(torch.int32, (64,), gen),
        random_tensor(torch.float32, (250,), gen),
    ]
    one_by_one, joined = io.BytesIO(), io.BytesIO()
    alone = tensor_bytes.StreamSink(one_by_one)
    expected = [tensor_bytes.write_tensor(alone, tensor) for tensor in tensors]
    writes: list[int] = []

    class CountingSink(tensor_bytes.StreamSink):
        def write_piece(self, piece: memoryview, owner: Any) -> None:
            writes.append(piece.nbytes)
            super().write_piece(piece, owner)

    spans = tensor_bytes.write_tensors(CountingSink(joined), tensors)
    assert spans == expected
    assert joined.getvalue() == one_by_one.getvalue()
    if run_bytes > 100_000:  # one write per run (0-5, 9-10, 18-19) and per other tensor
        assert writes == [583, 2400, 48, 98, 80, 5, 80_000, 34, 24, 11, 48, 1256], writes


def test_a_run_of_a_dtype_torch_cannot_concatenate_is_joined_as_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fault injection: ``torch.cat`` refuses float16 (as it might a dtype of a later torch);
    the run is written all the same, its float16 tensors joined as their bytes."""
    cat = torch.cat

    def refusing_float16(tensors: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if any(tensor.dtype == torch.float16 for tensor in tensors):
            raise RuntimeError("\"cat_cpu\" not implemented for 'Half' (injected)")
        return cat(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "cat", refusing_float16)
    gen = torch.Generator().manual_seed(8)
    tensors = [
        random_tensor(torch.float32, (10,), gen),
        random_tensor(torch.float16, (3, 4), gen),
        random_tensor(torch.float16, (5,), gen),
        random_tensor(torch.int32, (6,), gen),
    ]
    one_by_one, joined = io.BytesIO(), io.BytesIO()
    alone = tensor_bytes.StreamSink(one_by_one)
    expected = [tensor_bytes.write_tensor(alone, tensor) for tensor in tensors]
    assert tensor_bytes.write_tensors(tensor_bytes.StreamSink(joined), tensors) == expected
    assert joined.getvalue() == one_by_one.getvalue()
    assert tensor_bytes.write_tensors(tensor_bytes.StreamSink(io.BytesIO()), []) == []


def test_a_key_missing_from_the_checkpoint_is_refused(tmp_path: Path) -> None:
    """A key the checkpoint lacks raises CheckpointError naming it."""
    with manager(tmp_path) as mgr:
        assert mgr.save(1, packed_state())
        with pytest.raises(CheckpointError, match="never_saved_key"):
            mgr.restore(1, {"small_00": torch.zeros(16), "never_saved_key": torch.zeros(16)})


# -- other format versions: 1 (the previous ckptmgr) and newer ones --------------------------------
def format_v1_state(stepped: bool = False) -> dict[str, Any]:
    """A state shaped like the one tests/data/format_v1 was saved from (see below), holding
    other values: the model Sequential(Linear(4, 3), ReLU, Linear(3, 2)) and AdamW(lr=0.1),
    plain tensors of several dtypes and shapes, and an int. With ``stepped``, the optimizer has
    taken one step (from other parameters and another batch than the saved ones), else it has no
    state yet; the parameters and tensors are zeros otherwise.

    tests/data/format_v1 was written by the previous ckptmgr, in essence::

        g = torch.Generator().manual_seed(7)
        model = Sequential(Linear(4, 3), ReLU(), Linear(3, 2))  # params: torch.randn(..., g)
        opt = AdamW(model.parameters(), lr=0.1)
        model(torch.randn(5, 4, generator=g)).sum().backward(); opt.step()
        state = {"model": model, "optim": opt,
                 "f16": torch.arange(6, dtype=torch.float16).reshape(2, 3),
                 "bf16": torch.linspace(-1, 1, 5).to(torch.bfloat16),
                 "i64": torch.tensor([1, -2, 3]), "flag": torch.tensor([True, False]),
                 "scalar": torch.tensor(3.5), "empty": torch.empty(0, 4), "epoch": 3}
        CheckpointManager(root, save_interval=1, max_to_keep=1).save(5, state)
        torch.save({k: v.state_dict() if hasattr(v, "state_dict") else v ...},
                   "format_v1_expected.pt")
    """
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    if stepped:
        gen = torch.Generator().manual_seed(70)
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(torch.randn(param.shape, generator=gen))
        model(torch.randn(5, 4, generator=gen)).sum().backward()
        optimizer.step()
    return {
        "model": model,
        "optim": optimizer,
        "f16": torch.zeros(2, 3, dtype=torch.float16),
        "bf16": torch.zeros(5, dtype=torch.bfloat16),
        "i64": torch.zeros(3, dtype=torch.int64),
        "flag": torch.zeros(2, dtype=torch.bool),
        "scalar": torch.zeros(()),
        "empty": torch.zeros(0, 4),
        "epoch": 0,
    }


def as_saved(state: Mapping[str, Any]) -> dict[str, Any]:
    """The state as format_v1_expected.pt holds it: state dicts of modules and optimizers."""
    return {
        key: value.state_dict() if hasattr(value, "state_dict") else value
        for key, value in state.items()
    }


def copy_of_old_format(tmp_path: Path, version: int) -> Path:
    """A copy of tests/data/format_v<version>, whose step 5 holds format_v1_expected.pt:
    format 1 (torch.save-encoded DCP items), or format 2 (raw bytes; ``tensors`` and
    ``packed`` as objects), written by ckptmgr 8e76c99 from that state (restored from
    tests/data/format_v1 into :func:`format_v1_state`, then saved as step 5)."""
    root = tmp_path / f"format_v{version}"
    shutil.copytree(DATA / f"format_v{version}", root)
    record = read_record(root, 5)
    assert record["format_version"] == version
    if version == 2:  # packed and unpacked tensors
        assert record["packed"] and set(record["packed"]) < set(record["tensors"])
    return root


@pytest.fixture
def format_v1_root(tmp_path: Path) -> Path:
    """A copy of tests/data/format_v1 (format_version 1, torch.save-encoded DCP items)."""
    return copy_of_old_format(tmp_path, 1)


@pytest.fixture(params=[1, 2], ids=["format_1", "format_2"])
def old_format_root(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A copy of tests/data/format_v1 or tests/data/format_v2."""
    return copy_of_old_format(tmp_path, request.param)


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh_optimizer", "stepped_optimizer"])
def test_an_older_format_step_restores_bit_exact_read_only(
    old_format_root: Path, stepped: bool
) -> None:
    """A step of an earlier format restores into a fresh state exactly as it was saved."""
    expected = torch.load(DATA / "format_v1_expected.pt", weights_only=True)
    state = format_v1_state(stepped)
    before = as_saved(state)
    for key in ("model", "f16", "scalar"):  # the restore has something to do
        with pytest.raises(AssertionError):
            assert_bit_equal(before[key], expected[key])
    with manager(old_format_root, read_only=True) as mgr:
        assert mgr.all_steps() == [5]
        mgr.verify(5, deep=True)
        mgr.restore(5, state)
    assert_bit_equal(as_saved(state), expected)


class _Payload:
    """Unpickling this would create the file at ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.path),))


def test_a_crafted_pickle_in_a_format_1_data_file_runs_nothing(
    format_v1_root: Path, tmp_path: Path
) -> None:
    """Format 1 data files are torch.save records, read with torch's weights-only unpickler: a
    pickle that would run code (its size and checksum fixed in the record) is refused as
    damage, and nothing runs."""
    proof = tmp_path / "code-ran"
    step_dir = format_v1_root / "step_000000000005"
    data = step_dir / "__0_0.distcp"
    evil = pickle.dumps(_Payload(str(proof)))
    data.write_bytes(evil + b"\0" * (data.stat().st_size - len(evil)))
    record = read_record(format_v1_root, 5)
    for entry in record["files"]:
        if entry["path"] == data.name:
            entry["crc32"] = zlib.crc32(data.read_bytes())
    (step_dir / "commit.json").write_text(json.dumps(record))
    with manager(format_v1_root, read_only=True) as mgr:
        with pytest.raises(CorruptCheckpointError):
            mgr.restore(5, format_v1_state())
    assert not proof.exists()


def test_older_format_and_new_steps_live_side_by_side(old_format_root: Path) -> None:
    """A writing manager over an old root adds new steps; old and new both restore."""
    expected = torch.load(DATA / "format_v1_expected.pt", weights_only=True)
    with manager(old_format_root) as mgr:
        state = format_v1_state()
        mgr.restore(5, state)
        state["epoch"] = 4
        assert mgr.save(6, state)
        assert mgr.all_steps() == [5, 6]
        old, new = format_v1_state(), format_v1_state()
        mgr.restore(5, old)
        assert mgr.restore_latest(new) == 6
    assert_bit_equal(as_saved(old), expected)
    assert_bit_equal(as_saved(new), {**expected, "epoch": 4})
    versions = [read_record(old_format_root, step)["format_version"] for step in (5, 6)]
    assert versions == [int(old_format_root.name.removeprefix("format_v")), 4]  # 5 left as it was


def test_a_record_of_a_newer_format_is_refused_and_never_quarantined(tmp_path: Path) -> None:
    """A step of a format newer than this ckptmgr (with fields it does not know, inside the
    tensor table too) is refused with "upgrade", not mistaken for damage and quarantined."""
    with manager(tmp_path) as mgr:
        assert mgr.save(1, {"w": torch.ones(3)})
        assert mgr.save(2, {"w": torch.full((3,), 2.0)})
    path = step_dir(tmp_path, 2) / "commit.json"
    record = read_record(tmp_path, 2)
    record["format_version"] = 99
    record["added_later"] = {"x": 1}
    record["tensor_table"]["added_later"] = [1] * len(record["tensor_table"]["names"])
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="upgrade"):
        CommitRecord.from_json(path.read_bytes())
    with manager(tmp_path) as mgr:
        with pytest.raises(CheckpointError, match="upgrade") as caught:
            mgr.restore_latest({"w": torch.zeros(3)})
        assert not isinstance(caught.value, CorruptCheckpointError)
        assert mgr.all_steps() == [1, 2]
    assert not (step_dir(tmp_path, 2) / "quarantined.json").exists()


def test_a_record_whose_version_a_flipped_bit_raised_is_damage_not_a_newer_format(
    tmp_path: Path,
) -> None:
    """A flipped bit that makes ``"format_version": 4`` a 5 leaves a record that ends with a
    checksum its bytes no longer match: damage, quarantined, and ``restore_latest`` goes on to
    the step before (it was refused with "upgrade ckptmgr", and restore_latest raised). A record
    of a newer format with its checksum intact is still refused with "upgrade"."""
    with manager(tmp_path) as mgr:
        assert mgr.save(1, {"w": torch.ones(3)})
        assert mgr.save(2, {"w": torch.full((3,), 2.0)})
    path = step_dir(tmp_path, 2) / "commit.json"
    data = bytearray(path.read_bytes())
    at = data.index(b'"format_version": 4') + len(b'"format_version": ')
    data[at] ^= 1  # "4" -> "5"
    with pytest.raises(ValueError, match="CRC-32") as caught:
        CommitRecord.from_json(bytes(data))
    assert "upgrade" not in str(caught.value)
    path.write_bytes(bytes(data))
    with manager(tmp_path) as mgr:
        restored = {"w": torch.zeros(3)}
        assert mgr.restore_latest(restored) == 1
        assert torch.equal(restored["w"], torch.ones(3))
        assert mgr.all_steps() == [1]
    assert (step_dir(tmp_path, 2) / "quarantined.json").exists()

    newer = read_record(tmp_path, 1)
    newer["format_version"] = 5
    with pytest.raises(ValueError, match="upgrade"):
        CommitRecord.from_json(record_bytes(newer))


# -- damaged data files ----------------------------------------------------------------------------
def flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


class HashingAtTheEnd(ordered_hash.OrderedHasher):
    """Fault injection: a hashing thread that runs as late as it may, hashing nothing before
    ``result()``."""

    def __init__(self, max_backlog_bytes: int | None = None, *, inline: bool = False) -> None:
        super().__init__(max_backlog_bytes, inline=inline)
        self._held: list[tuple[memoryview, Any]] = []

    def add(self, piece: memoryview, owner: Any = None) -> None:
        self._held.append((piece, owner))

    def result(self) -> int:
        for piece, owner in self._held:
            super().add(piece, owner)
        self._held = []
        return super().result()


@pytest.mark.parametrize("threads", [1, 2])
def test_destinations_sharing_memory_restore_without_a_false_crc_error(
    tmp_path: Path, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two tensors stored apart, restored into one tensor under both keys (weights tied in the
    model but not in the checkpoint): the restore succeeds with one of the stored values, and
    restore_latest quarantines nothing. A file's CRC is computed from the bytes a read put into
    the destination; a later read into the same memory once changed them before the hashing
    thread got there, so an intact step failed its check and was quarantined."""
    monkeypatch.setattr(tensor_bytes, "OrderedHasher", HashingAtTheEnd)
    stored = {"a": torch.randn(1 << 18), "b": torch.randn(1 << 18)}  # 1 MiB each: not packed
    with manager(tmp_path, num_of_threads=threads) as mgr:
        assert mgr.save(1, stored)
        tied = torch.zeros(1 << 18)
        mgr.restore(1, {"a": tied, "b": tied})
        assert torch.equal(tied, stored["a"]) or torch.equal(tied, stored["b"])
        tied.zero_()
        assert mgr.restore_latest({"a": tied, "b": tied}) == 1
        assert mgr.all_steps() == [1]
    assert not (step_dir(tmp_path, 1) / "quarantined.json").exists()
    assert torch.equal(tied, stored["a"]) or torch.equal(tied, stored["b"])


def test_parallel_reads_copy_into_one_shared_destination_one_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two stored tensors in two data files, restored into one tensor under both keys: the two
    files are read on two threads, and their copies into that memory must not interleave (the
    destination held the head of one stored value and the tail of the other, which CI caught).
    Fault injection: the first copy into the shared memory waits, bounded, for a second one to
    start; without the ordering it does, and the test sees the overlap."""
    stored = {"a": torch.randn(1 << 18), "b": torch.randn(1 << 18)}
    tied = torch.zeros(1 << 18)
    original_copy = torch.Tensor.copy_
    guard = threading.Lock()
    second_started = threading.Event()
    copies = {"active": 0, "most_at_once": 0, "count": 0}

    def watching_copy(self: torch.Tensor, src: torch.Tensor, *args: Any, **kw: Any) -> Any:
        if self.data_ptr() != tied.data_ptr() or threading.current_thread().name == "MainThread":
            return original_copy(self, src, *args, **kw)
        with guard:
            copies["active"] += 1
            copies["count"] += 1
            copies["most_at_once"] = max(copies["most_at_once"], copies["active"])
            first = copies["count"] % 2 == 1
        if first:
            second_started.wait(1.0)  # bounded: with the ordering, no second copy can start
        else:
            second_started.set()
        try:
            return original_copy(self, src, *args, **kw)
        finally:
            with guard:
                copies["active"] -= 1

    with manager(tmp_path, num_of_threads=2) as mgr:
        assert mgr.save(1, stored)
        data_files = [p for p in step_dir(tmp_path, 1).iterdir() if p.suffix == ".distcp"]
        assert len(data_files) == 2  # one per writer thread: read on two threads
        monkeypatch.setattr(torch.Tensor, "copy_", watching_copy)
        mgr.restore(1, {"a": tied, "b": tied})
        monkeypatch.undo()
    assert copies["count"] == 2
    assert copies["most_at_once"] == 1
    assert torch.equal(tied, stored["a"]) or torch.equal(tied, stored["b"])


def test_a_hasher_with_a_backlog_limit_waits_for_the_hashing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading a file to hash it (the bytes a partial restore skips) stays this far ahead of
    the hashing thread instead of piling up buffers: add() waits while more than the limit is
    queued, and the CRC is still that of every piece in order."""
    bound_s = 60.0
    gate, hashing = threading.Event(), threading.Event()

    def gated_crc32(data: Any, value: int = 0) -> int:
        # fault injection: the hashing thread stalls until the gate opens
        hashing.set()
        assert gate.wait(bound_s), "the test never opened the gate"
        return zlib.crc32(data, value)

    monkeypatch.setattr(ordered_hash, "crc32", gated_crc32)
    hasher = ordered_hash.OrderedHasher(max_backlog_bytes=2 * MIB)
    pieces = [bytes([n]) * MIB for n in range(8)]
    added: list[int] = []

    def add_all() -> None:
        for piece in pieces:
            hasher.add(memoryview(piece), piece)
            added.append(len(piece))

    adder = threading.Thread(target=add_all)
    adder.start()
    try:
        assert hashing.wait(bound_s), "the hashing thread never started"
        adder.join(0.5)  # negative check, bounded: add() must be waiting for the hashing
        assert adder.is_alive()
        assert 2 * MIB <= sum(added) <= 4 * MIB
    finally:
        gate.set()
        adder.join(bound_s)
    assert not adder.is_alive()
    assert hasher.result() == zlib.crc32(b"".join(pieces))


def test_overlapping_finds_the_cpu_tensors_that_share_memory() -> None:
    """Views of disjoint parts of one buffer do not overlap (each is still read into
    directly); views that share bytes do, as does a tensor under two keys."""
    flat = torch.zeros(100)
    other = torch.zeros(10)
    tensors = [
        flat[0:10],  # 0
        flat[10:20],  # 1: disjoint from 0
        flat[15:30],  # 2: overlaps 1
        flat[40:60:2],  # 3: strided, reaches 40..58
        flat[59:61],  # 4: overlaps nothing (3 ends at element 58)
        flat[50:52],  # 5: inside 3's extent
        other,  # 6
        other,  # 7: the same tensor again
        torch.zeros(0),  # 8: empty, ignored
        flat[70:70],  # 9: empty view, ignored
    ]
    assert tensor_bytes.overlapping(tensors) == {1, 2, 3, 5, 6, 7}
    assert tensor_bytes.overlapping([flat[0:50], flat[50:]]) == set()


@pytest.mark.parametrize("threads", [1, 3])
def test_a_flipped_byte_in_a_data_file_is_corruption(tmp_path: Path, threads: int) -> None:
    """restore of the damaged step raises CorruptCheckpointError; restore_latest falls back to the
    older intact step and returns it."""
    older, newer = everything_state(7), everything_state(8)  # same keys: restore_latest fits both
    older_expected = snapshot(older)
    with manager(tmp_path, num_of_threads=threads) as mgr:
        assert mgr.save(1, older)
        assert mgr.save(2, newer)
        damaged = max(distcp_files(tmp_path, 2), key=lambda path: path.stat().st_size)
        flip_middle_byte(damaged)
        with pytest.raises(CorruptCheckpointError) as caught:
            mgr.restore(2, zeros_like_state(newer))
        assert caught.value.step == 2
        assert caught.value.path == damaged.name

        target = zeros_like_state(older_expected)
        assert mgr.restore_latest(target) == 1
        assert mgr.all_steps() == [1]
    assert_bit_equal(target, older_expected)
    assert (step_dir(tmp_path, 2) / "quarantined.json").exists()


@pytest.mark.parametrize("mode", MODES)
def test_the_pack_name_is_reserved(tmp_path: Path, mode: str) -> None:
    """A state key equal to the pack's stored name is refused before anything is written (it
    would otherwise be overwritten by the pack)."""
    from ckptmgr.packing import PACK_KEY

    state = {PACK_KEY: torch.ones(3), "a": torch.zeros(2), "b": torch.zeros(2)}
    with manager(tmp_path) as mgr:
        with pytest.raises(CheckpointError, match="reserved"):
            getattr(mgr, mode)(1, state)
        assert mgr.all_steps() == []
        state["renamed"] = state.pop(PACK_KEY)
        assert getattr(mgr, mode)(1, state)
        mgr.join()
        assert mgr.all_steps() == [1]
