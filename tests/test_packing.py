"""ckptmgr.packing.SavePacker: save()'s pack, its layout reused from save to save while the
state keeps it, and its bytes those of every packed tensor's value (views, lazily conjugated or
negated tensors, parameters, 0-d and n-d tensors alike)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ckptmgr import packing


def _tricky_state() -> dict[str, torch.Tensor]:
    """Small tensors of two dtypes in every source layout the pack copies from, and a big one."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(8, 6, generator=gen)
    shared = torch.randn(40, generator=gen)
    return {
        "vector": torch.randn(7, generator=gen),
        "scalar": torch.tensor(2.5),
        "matrix": torch.randn(3, 4, generator=gen),
        "transposed": base.t(),
        "strided": shared[::3],
        "view_a": shared[:10],
        "view_b": shared[5:25],  # overlaps view_a
        "negated": torch.randn(5, generator=gen)._neg_view(),
        "param": nn.Parameter(torch.randn(6, generator=gen)),
        "conj": torch.randn(4, dtype=torch.complex64, generator=gen).conj(),
        "ints": torch.arange(9, dtype=torch.int64).view(3, 3),
        "big": torch.randn(64 * 1024, generator=gen),  # 256 KiB: stored on its own
    }


def _described(placed: dict[str, packing.PackedTensor]) -> list[tuple[object, ...]]:
    return [(key, where.offset, where.dtype, where.shape) for key, where in placed.items()]


def _expected_pack(
    state: dict[str, torch.Tensor], placed: dict[str, packing.PackedTensor]
) -> torch.Tensor:
    """Each packed tensor's value, resolved and flattened, at its offset."""
    size = max(where.offset + where.nbytes for where in placed.values())
    expected = torch.zeros(size, dtype=torch.uint8)
    for key, where in placed.items():
        value = state[key].detach().resolve_conj().resolve_neg().reshape(-1).contiguous()
        expected[where.offset : where.offset + where.nbytes] = value.view(torch.uint8)
    return expected


def test_the_pack_holds_every_packed_tensors_value_and_the_big_one_is_stored_as_it_is() -> None:
    state = _tricky_state()
    stored, placed = packing.SavePacker().pack(state)
    assert set(placed) == set(state) - {"big"}
    assert stored["big"] is state["big"]
    assert set(stored) == {"big", packing.PACK_KEY}
    pack = stored[packing.PACK_KEY]
    assert not pack.requires_grad
    assert torch.equal(pack, _expected_pack(state, placed))


def test_a_second_pack_of_the_same_layout_reuses_it_and_holds_the_new_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = _tricky_state()
    packer = packing.SavePacker()
    _, placed = packer.pack(state)
    fingerprint = packer.fingerprint
    layouts: list[object] = []
    real_layout = packing.pack_layout
    monkeypatch.setattr(
        packing, "pack_layout", lambda *args: layouts.append(args) or real_layout(*args)
    )
    with torch.no_grad():
        for value in state.values():
            value.add_(1)
    stored, placed_again = packer.pack(state)
    assert layouts == []  # not laid out again
    assert placed_again is placed and packer.fingerprint == fingerprint
    assert torch.equal(stored[packing.PACK_KEY], _expected_pack(state, placed))


@pytest.mark.parametrize(
    "change",
    ["shape", "dtype", "tensor becomes parameter", "key order", "key added", "becomes big"],
)
def test_a_changed_state_gets_a_new_layout(change: str) -> None:
    state = _tricky_state()
    packer = packing.SavePacker()
    _, placed = packer.pack(state)
    fingerprint = packer.fingerprint
    if change == "shape":
        state["vector"] = torch.randn(8)
    elif change == "dtype":
        state["vector"] = state["vector"].double()
    elif change == "tensor becomes parameter":
        state["vector"] = nn.Parameter(state["vector"])
    elif change == "key order":
        state = dict(reversed(list(state.items())))
    elif change == "key added":
        state["added"] = torch.ones(3, dtype=torch.int16)
    else:
        state["vector"] = torch.randn(32 * 1024)
    stored, placed_again = packer.pack(state)
    assert placed_again is not placed
    fresh = packing.pack_layout(state, packing.candidates(state, packing.any_name))
    assert _described(placed_again) == _described(fresh)
    if change != "tensor becomes parameter":  # (the layout itself is the same then)
        assert packer.fingerprint != fingerprint
    assert torch.equal(stored[packing.PACK_KEY], _expected_pack(state, placed_again))
    assert set(stored) == {packing.PACK_KEY, *(set(state) - set(placed_again))}


def test_fewer_small_tensors_than_the_minimum_are_stored_as_they_are() -> None:
    state = {"one": torch.ones(3), "big": torch.randn(64 * 1024)}
    packer = packing.SavePacker()
    for _ in range(2):
        stored, placed = packer.pack(state)
        assert placed == {} and stored == state and stored is not state


def test_record_table_lists_stored_then_packed_tensors_each_name_once() -> None:
    """DCP's own entries (less the pack) come first, then the packed tensors with their
    offsets; a name both stored and packed gets one row, its packed one, so that the record
    reads back (a reader refuses a name twice)."""
    from ckptmgr.record import CommitRecord, TensorEntry, TensorTable, utc_now

    stored = {
        "big": TensorEntry.trusted("float32", [100_000]),
        packing.PACK_KEY: TensorEntry.trusted("uint8", [48]),
        "both": TensorEntry.trusted("float32", [3]),
    }
    placed = {
        "a": packing.PackedTensor(0, torch.float64, (2, 2)),
        "both": packing.PackedTensor(32, torch.float32, (3,)),
    }
    table = packing.record_table(stored, placed)
    assert table == TensorTable(
        ["big", "a", "both"],
        ["float32", "float64", "float32"],
        [[100_000], [2, 2], [3]],
        [None, 0, 32],
    )
    record = CommitRecord(
        step=1, save_id="s", committed_at=utc_now(), world_size=1, tensor_table=table
    )
    assert CommitRecord.from_json(record.to_json()).tensor_table == table


def test_each_run_is_flattened_straight_into_the_pack(monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed bytes are copied once: each run of one dtype is flattened into its place in
    the pack buffer, with no flattened temporary copied into the pack again (which held every
    packed byte twice at once during a save() of many small tensors). Counted: the bytes that
    ``torch.cat`` writes during a pack, and the pack's bytes, equal."""
    state = _tricky_state()
    written: list[int] = []
    real_cat = torch.cat

    def counting_cat(*args: object, **kwargs: object) -> torch.Tensor:
        result = real_cat(*args, **kwargs)  # type: ignore[call-overload]
        written.append(result.numel() * result.element_size())
        return result

    packer = packing.SavePacker()
    for _ in range(2):  # the layout made, then reused
        written.clear()
        monkeypatch.setattr(torch, "cat", counting_cat)
        stored, placed = packer.pack(state)
        monkeypatch.undo()
        pack = stored[packing.PACK_KEY]
        assert len(written) == len({where.dtype for where in placed.values()})  # one per run
        assert sum(written) == pack.numel()
        assert torch.equal(pack, _expected_pack(state, placed))
