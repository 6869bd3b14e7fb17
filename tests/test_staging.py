"""Staging buffers: bit-exact copies through every path (reuse, relayout, shared storages,
dtype changes, zero-element tensors), the memory budget and back-pressure, and round trips of
those states through a real CheckpointManager."""

from __future__ import annotations

import gc
import mmap
import os
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
from conftest import in_forked_child, run_on_one_gloo_rank

from ckptmgr import CheckpointManager, staging
from ckptmgr.errors import CheckpointError
from ckptmgr.packing import PACK_KEY, PackedTensor, PackFilter, any_name, pack_layout
from ckptmgr.staging import (
    SHARED_MEMORY_DIR,
    STALE_AFTER_TAKEN,
    StagingBuffers,
    StagingPool,
    _Arena,
    _gathers,
    check_shared_memory,
)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as raw bytes (bit-exact comparison, NaNs included)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8) if tensor.numel() else tensor


def _assert_exact(staged: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert staged.keys() == expected.keys()
    for key, value in expected.items():
        got = staged[key]
        assert got.device.type == "cpu", key
        assert got.dtype == value.dtype and got.shape == value.shape, key
        assert torch.equal(_bits(got), _bits(value)), key


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    flat = torch.randn(1000, generator=generator)
    return {
        "w": torch.randn(64, 32, generator=generator),
        "b": torch.randn(32, generator=generator).to(torch.bfloat16),
        "mask": torch.rand(17, generator=generator) > 0.5,
        "step": torch.tensor(7, dtype=torch.int64),
        "nan": torch.tensor([float("nan"), -0.0, float("inf")]),
        "transposed": torch.randn(8, 5, generator=generator).t(),
        "empty": torch.empty(0, 3),
        "flat/a": flat[:100].view(10, 10),
        "flat/b": flat[100:400],
        "flat/c": flat[400:].view(torch.int32),
        "tied/1": flat[:100].view(10, 10),
    }


def test_stage_is_a_bit_exact_snapshot_and_reuses_the_arena() -> None:
    state = _state()
    expected = {k: v.clone() for k, v in state.items()}
    buffers = StagingBuffers()
    staged = buffers.stage(state)
    _assert_exact(staged, expected)
    pointers = {k: v.data_ptr() for k, v in staged.items()}
    for tensor in state.values():
        if tensor.dtype.is_floating_point and tensor.numel():
            tensor.add_(1)
    _assert_exact(staged, expected)  # the snapshot does not follow the originals
    again = buffers.stage(state)
    _assert_exact(again, state)
    assert {k: v.data_ptr() for k, v in again.items()} == pointers  # same memory, no relayout


def test_views_of_one_storage_share_one_region() -> None:
    state = _state()
    staged = StagingBuffers().stage(state)
    shared = {staged[k].untyped_storage().data_ptr() for k in ("flat/a", "flat/b", "flat/c")}
    assert len(shared) == 1
    assert staged["tied/1"].data_ptr() == staged["flat/a"].data_ptr()
    # tensors that share nothing get a storage of exactly their own size (DCP writes no clone)
    assert staged["w"].untyped_storage().nbytes() == staged["w"].nbytes


def test_shape_dtype_and_key_changes_between_saves() -> None:
    buffers = StagingBuffers()
    _assert_exact(buffers.stage(_state(0)), _state(0))
    first = buffers.nbytes
    changed = _state(1)
    changed["w"] = torch.randn(64, 33)  # shape change
    changed["b"] = changed["b"].to(torch.float64)  # dtype change
    del changed["mask"]  # key removed
    changed["new"] = torch.arange(5, dtype=torch.int16)  # key added
    _assert_exact(buffers.stage(changed), changed)
    assert buffers.nbytes >= first
    small = {"only": torch.arange(10.0)}
    _assert_exact(buffers.stage(small), small)
    assert buffers.nbytes < first // 2  # shrunk: the big arena was freed
    grown = {"big": torch.randn(100_000)}
    _assert_exact(buffers.stage(grown), grown)
    assert buffers.nbytes >= grown["big"].nbytes


def test_new_tensors_with_the_same_structure_are_copied_from_the_new_storages() -> None:
    buffers = StagingBuffers()
    buffers.stage(_state(0))
    fresh = _state(5)  # same structure, different tensor objects and storages
    _assert_exact(buffers.stage(fresh), fresh)


def test_sharing_pattern_change_is_a_new_layout() -> None:
    buffers = StagingBuffers()
    base = torch.arange(20.0)
    shared = {"a": base[:10], "b": base[10:]}
    _assert_exact(buffers.stage(shared), shared)
    separate = {"a": torch.arange(10.0) + 1, "b": torch.arange(10.0) + 2}
    _assert_exact(buffers.stage(separate), separate)


def test_tensors_that_come_to_share_a_storage_are_each_copied_right() -> None:
    buffers = StagingBuffers()
    _assert_exact(
        buffers.stage({"a": torch.arange(10.0), "b": torch.arange(10.0) + 5}),
        {
            "a": torch.arange(10.0),
            "b": torch.arange(10.0) + 5,
        },
    )
    base = torch.arange(15.0)
    overlapping = {"a": base[:10], "b": base[5:]}  # same shapes, now one storage, overlapping
    _assert_exact(buffers.stage(overlapping), overlapping)
    tied = torch.randn(10)
    same = {"a": tied, "b": tied}
    _assert_exact(buffers.stage(same), same)


def test_shared_views_that_move_within_their_storage_are_a_new_layout() -> None:
    buffers = StagingBuffers()
    base = torch.arange(20.0)
    _assert_exact(buffers.stage({"a": base[:10], "b": base[10:]}), {"a": base[:10], "b": base[10:]})
    swapped = {"a": base[10:], "b": base[:10]}  # same shapes and sharing, other offsets
    _assert_exact(buffers.stage(swapped), swapped)
    other = torch.arange(20.0) * 3  # the same views, of another storage
    moved = {"a": other[:10], "b": other[10:]}
    _assert_exact(buffers.stage(moved), moved)


def _resolved(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a lazily conjugated or negated view reads as, materialised."""
    return {key: value.resolve_conj().resolve_neg().clone() for key, value in tensors.items()}


def test_conjugated_and_negated_views_of_a_shared_storage_keep_their_values() -> None:
    """``z.conj()`` beside ``z``, and ``z.conj().imag`` (negative bit) beside ``z.real``: the
    shared region is rebuilt from dtype, shape, strides and offset only, so such views are
    staged apart (their bits once went missing: the conjugate was stored as ``z``)."""
    buffers = StagingBuffers()
    z = torch.randn(6, dtype=torch.complex64)
    state = {"z": z, "z.conj": z.conj(), "re": z.real, "neg_im": z.conj().imag}
    assert state["neg_im"].is_neg()
    staged = buffers.stage(state)
    _assert_exact(_resolved(staged), _resolved(state))
    plain = {"z": z, "z.conj": z.conj().resolve_conj(), "re": z.real, "neg_im": z.imag}
    _assert_exact(_resolved(buffers.stage(plain)), _resolved(plain))  # the same shapes: reused
    _assert_exact(_resolved(buffers.stage(state)), _resolved(state))  # and back


def test_distinct_storages_at_one_address_are_copied_through_the_largest() -> None:
    """Tensors made from NumPy views of one array have storages of their own that start at the
    same address; the shorter one first must not cut the copy short (it once raised
    'Trying to resize storage that is not resizable')."""
    numpy = pytest.importorskip("numpy")
    array = numpy.arange(100, dtype=numpy.float32)
    for state in (
        {"head": torch.from_numpy(array[:10]), "full": torch.from_numpy(array)},
        {"full": torch.from_numpy(array), "head": torch.from_numpy(array[:10])},
    ):
        _assert_exact(StagingBuffers().stage(state), {k: v.clone() for k, v in state.items()})


def test_free_lets_the_arena_go_when_a_pack_was_staged() -> None:
    """free() drops every view of the arena, the pack's too: an idle slot freed for the budget
    gives its memory back instead of keeping it mapped."""
    buffers = StagingBuffers()
    state = {"small/a": torch.ones(3), "small/b": torch.zeros(2), "big": torch.ones(1 << 16)}
    staged = buffers.stage(state, pack=any_name)
    assert PACK_KEY in staged
    arena = weakref.ref(buffers._arena._map)  # internal: the arena's private mapping
    del staged
    buffers.free()
    gc.collect()
    assert arena() is None
    assert buffers.nbytes == 0


def test_strides_and_parameters_changing_under_one_layout() -> None:
    buffers = StagingBuffers()
    first = {"m": torch.randn(5, 8), "v": torch.randn(3)}
    staged = buffers.stage(first)
    _assert_exact(staged, first)
    pointers = {k: v.data_ptr() for k, v in staged.items()}
    transposed = {"m": torch.randn(8, 5).t(), "v": torch.randn(6)[::2]}  # same shapes, strided
    staged = buffers.stage(transposed)
    _assert_exact(staged, transposed)
    params = {k: torch.nn.Parameter(v.clone()) for k, v in first.items()}  # requires grad
    staged = buffers.stage(params)
    _assert_exact(staged, params)
    assert not any(v.requires_grad for v in staged.values())
    assert {k: v.data_ptr() for k, v in staged.items()} == pointers  # one layout throughout


def _unpacked(staged: dict[str, torch.Tensor], placed: dict[str, PackedTensor]) -> dict:
    """The staged tensors with the pack cut back into the tensors it holds."""
    result = {k: v for k, v in staged.items() if k != PACK_KEY}
    pack = staged[PACK_KEY]
    for key, where in placed.items():
        piece = pack[where.offset : where.offset + where.nbytes]
        result[key] = piece.view(where.dtype).view(where.shape)
    return result


def test_packed_staging_puts_small_plain_tensors_back_to_back() -> None:
    state = _state()
    buffers = StagingBuffers()
    staged = buffers.stage(state, pack=any_name)
    placed = buffers.packed
    # every small tensor is packed, views of a shared storage too (as save() packs them: an
    # item of its own costs DCP's per-item work at every write and restore); empty ones are not
    small = {"w", "b", "mask", "step", "nan", "transposed", "flat/a", "flat/b", "flat/c", "tied/1"}
    assert placed.keys() == small
    assert placed.keys().isdisjoint(staged)
    pack = staged[PACK_KEY]
    assert pack.dtype == torch.uint8
    assert pack.numel() == sum(where.nbytes for where in placed.values())  # no padding
    for where in placed.values():
        assert where.offset % where.dtype.itemsize == 0
    _assert_exact(_unpacked(staged, placed), state)
    state["nan"].add_(1)
    again = buffers.stage(state, pack=any_name)
    assert buffers.packed is placed  # same layout object: nothing recomputed
    assert again[PACK_KEY].data_ptr() == pack.data_ptr()
    _assert_exact(_unpacked(again, placed), state)
    unpacked = buffers.stage(state)  # pack=False: a new layout without a pack
    assert PACK_KEY not in unpacked and not buffers.packed
    _assert_exact(unpacked, state)


def test_small_views_of_a_shared_storage_are_packed_and_large_ones_share_a_region() -> None:
    """With a pack, the small views of a storage (slices of a flat buffer, a tied copy,
    conjugated and negated views) go into the pack, each copied on its own; the large views of
    the same storage are staged over their covered range, one region. Bit-exact, the layout
    kept for the next save."""
    generator = torch.Generator().manual_seed(5)
    base = torch.randn(100_000, generator=generator)
    z = torch.randn(600, dtype=torch.complex64, generator=generator)
    state = {
        "big/a": base[:40_000],
        "big/b": base[30_000:],
        "small/x": base[10:20],
        "small/y": base[50_000:50_100].view(10, 10),
        "small/tied": base[10:20],
        "z": z,
        "z.conj": z.conj(),
        "neg_im": z.conj().imag,
    }
    buffers = StagingBuffers()
    staged = buffers.stage(state, pack=any_name)
    assert set(buffers.packed) == {"small/x", "small/y", "small/tied", "z", "z.conj", "neg_im"}
    assert (
        staged["big/a"].untyped_storage().data_ptr() == staged["big/b"].untyped_storage().data_ptr()
    )
    expected = _resolved(state)
    _assert_exact(_resolved(_unpacked(staged, buffers.packed)), expected)
    base.mul_(2)
    z.mul_(3)
    placed = buffers.packed
    again = buffers.stage(state, pack=any_name)
    assert buffers.packed is placed
    _assert_exact(_resolved(_unpacked(again, placed)), _resolved(state))


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared-memory"])
def test_large_regions_start_on_a_page_boundary_after_a_pack(shared: bool) -> None:
    # A data file written directly takes a tensor's bytes from where they lie only when they
    # start on a block boundary (ckptmgr.direct_write): large regions are page-aligned, even
    # after a pack (or another region) whose size is not a multiple of a page.
    if shared and not os.path.isdir(SHARED_MEMORY_DIR):
        pytest.skip("no shared memory directory")
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(70_001, generator=generator)
    state = {
        "small": torch.randn(1001, generator=generator),  # packed: 4004 bytes
        "odd": torch.randn(70_003, generator=generator),  # 280,012 bytes
        "big": torch.randn(256, 1024, generator=generator),
        "view/a": base[:40_000],  # two views of one storage: one shared region
        "view/b": base[30_000:],
        "tiny_after": torch.randn(3, generator=generator),
    }
    buffers = StagingBuffers(shared=shared)
    staged = buffers.stage(state, pack=any_name)
    assert "small" in buffers.packed and "tiny_after" in buffers.packed
    for key in ("odd", "big", "view/a"):
        assert staged[key].data_ptr() % 4096 == 0, key
    _assert_exact(_unpacked(staged, buffers.packed), state)


def _runs_state(seed: int) -> dict[str, torch.Tensor]:
    """Small tensors whose pack order (by dtype, then as here) makes runs of every kind: 1-D of
    different lengths with strided, negated and parameter sources; 2-D with equal trailing
    sizes; conjugated complex; and what ends or breaks a run: a 0-dim tensor, other trailing
    sizes, a run too short (two bools), a dtype alone."""
    generator = torch.Generator().manual_seed(seed)
    z = torch.randn(6, dtype=torch.complex64, generator=generator)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    return {
        "a": randn(7),
        "b": randn(300),
        "c": randn(20)[::2],  # strided
        "p": torch.nn.Parameter(randn(5)),
        "neg": torch.randn(9, dtype=torch.complex64, generator=generator).conj().imag,
        "scalar": torch.tensor(2.5 + seed),
        "m1": randn(4, 3),
        "m2": randn(3, 2).t(),  # strided 2-D
        "m4": randn(5, 3),
        "m5": randn(1, 3),
        "m3": randn(3, 4),
        "z": z,
        "zc": z.clone().conj(),
        "zd": torch.randn(2, dtype=torch.complex64, generator=generator),
        "ze": torch.randn(3, dtype=torch.complex64, generator=generator),
        "mask": torch.rand(11, generator=generator) > 0.5,
        "mask2": torch.rand(5, generator=generator) > 0.5,
        "h": randn(6).to(torch.float16),
    }


def test_packed_runs_copied_in_one_call_each_stay_bit_exact() -> None:
    """Packed tensors back to back of one dtype and trailing shape are copied with one
    ``torch.cat`` per run: every kind of source comes out bit-exact, on the first save and
    when the layout is reused with new values and new strides."""
    buffers = StagingBuffers()
    state = _runs_state(0)
    assert state["neg"].is_neg() and state["zc"].is_conj()
    staged = buffers.stage(state, pack=any_name)
    placed = buffers.packed
    assert placed.keys() == state.keys()
    runs = [tuple(keys) for keys, _ in buffers._cat_runs]  # internal: the runs it found
    assert runs == [("z", "zc", "zd", "ze"), ("a", "b", "c", "p", "neg"), ("m1", "m2", "m4", "m5")]
    _assert_exact(_resolved(_unpacked(staged, placed)), _resolved(state))
    fresh = _runs_state(1)
    fresh["c"] = fresh["c"].clone()  # contiguous now: the same layout still fits
    fresh["m2"] = fresh["m2"].contiguous()
    again = buffers.stage(fresh, pack=any_name)
    assert buffers.packed is placed
    _assert_exact(_resolved(_unpacked(again, placed)), _resolved(fresh))
    with torch.no_grad():
        for value in state.values():
            value.copy_(torch.zeros_like(value))  # (conj/neg views write through to their base)
    _assert_exact(
        _resolved(_unpacked(buffers.stage(state, pack=any_name), placed)), _resolved(state)
    )


def _mapped_here(address: int) -> bool:
    """True when ``address`` lies in a mapping of this process (from /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            low, high = (int(part, 16) for part in line.split()[0].split("-"))
            if low <= address < high:
                return True
    return False


@pytest.mark.skipif(not hasattr(os, "fork") or not Path("/proc/self/maps").exists(), reason="Linux")
def test_a_forked_child_does_not_inherit_the_arena_and_stages_into_its_own() -> None:
    """A DataLoader forks its workers, each epoch by default: an arena they inherited would be
    shared copy-on-write, so the next save would copy every page of it (and keep the old
    ones while a worker lives). A child gets no arena; staging there makes a new one."""
    buffers = StagingBuffers()
    state = _state()
    address = buffers.stage(state)["w"].data_ptr()
    assert _mapped_here(address)

    def arena_in_child() -> bytes:
        return b"mapped" if _mapped_here(address) else b"not mapped"

    assert in_forked_child(arena_in_child) == b"not mapped"
    arena = buffers._arena  # internal: the parent's arena object

    def stage_in_child() -> bytes:
        fresh = _state(seed=1)
        staged = buffers.stage(fresh)
        _assert_exact(staged, fresh)
        return b"ok, new arena" if buffers._arena is not arena else b"old arena"

    assert in_forked_child(stage_in_child) == b"ok, new arena"
    _assert_exact(buffers.stage(state), state)  # the parent's arena is as it was
    assert buffers.stage(state)["w"].data_ptr() == address


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_child_forked_while_the_arenas_are_listed_makes_arenas() -> None:
    """The lock that guards the list of arenas (the writer thread lists them for the checkpoint
    daemon while the training thread may make one) is held by another thread at the fork: the
    child has a lock of its own, or its first arena would wait forever."""
    shared = StagingBuffers(shared=True)
    shared.stage(_state())
    staging._ARENAS_LOCK.acquire()  # as another thread of this process could hold it
    try:

        def arenas_in_child() -> bytes:
            fresh = StagingBuffers(shared=True)
            fresh.stage(_state(seed=2))
            return b"%d" % len(staging.shared_arenas())  # the parent's is not the child's

        assert in_forked_child(arenas_in_child) == b"1"
    finally:
        staging._ARENAS_LOCK.release()
    assert len(staging.shared_arenas()) >= 1


@pytest.mark.skipif(not hasattr(os, "fork") or not Path("/proc/self/maps").exists(), reason="Linux")
def test_memory_a_forked_child_maps_where_the_arena_was_stays_mapped() -> None:
    """The child's copy of the arena's mmap object would munmap the arena's address range when
    dropped, and the kernel hands that range out again in the child (a DataLoader worker's
    batches): a child's save once unmapped such memory under it (SIGSEGV, or zeros read)."""
    mib = 2**20
    buffers = StagingBuffers()
    buffers.stage({"w": torch.ones(16 * mib // 4)})
    low = buffers.stage({"w": torch.ones(16 * mib // 4)})["w"].data_ptr()
    high = low + 16 * mib

    def map_into_the_hole_then_stage() -> bytes:
        kept = []
        for _ in range(256):
            mapping = mmap.mmap(-1, 4 * mib)
            kept.append(mapping)
            batch = torch.frombuffer(mapping, dtype=torch.uint8)
            if low <= batch.data_ptr() and batch.data_ptr() + 4 * mib <= high:
                break
        else:
            return b"no mapping landed where the arena was"
        batch.fill_(7)
        inherited = weakref.ref(buffers._arena)
        buffers.stage({"w": torch.ones(1024)})  # drops the inherited arena
        # Dropped by its last reference, checked here: no gc.collect(), which in a forked child
        # also ran the finalizers of what the parent's libraries let go at the fork (fsspec
        # clears its instance cache there; each s3fs session's close then waited 1 s for an
        # event-loop thread the child does not have: 53 s after the cloud tests).
        if inherited() is not None:
            return b"the inherited arena is still referenced"
        return b"intact" if int(batch.sum()) == 7 * 4 * mib else b"changed"

    answer = in_forked_child(map_into_the_hole_then_stage)
    if answer == b"no mapping landed where the arena was":
        pytest.skip(answer.decode())
    assert answer == b"intact"


def test_budget_waits_for_in_flight_slot_and_frees_idle_ones() -> None:
    nbytes = 4 * 2**20
    pool = StagingPool(2, budget_bytes=nbytes + 2**16)
    state = {"x": torch.ones(nbytes // 4)}
    first = pool.acquire()
    first.stage(state)
    first_arena = first._arena
    released = threading.Event()

    def release_later() -> None:
        time.sleep(0.3)
        released.set()
        pool.release(first)

    thread = threading.Thread(target=release_later)
    thread.start()
    second = pool.acquire(timeout_s=5)  # a slot is free, but the budget is taken by `first`
    started = time.perf_counter()
    staged = second.stage({"x": torch.full((nbytes // 4,), 2.0)})
    waited = time.perf_counter() - started
    thread.join(timeout=5)
    assert released.is_set() and waited >= 0.2  # back-pressure, not a second copy
    assert torch.equal(staged["x"], torch.full((nbytes // 4,), 2.0))
    assert first.nbytes == 0  # the idle slot's arena was freed for the budget ...
    assert second._arena is first_arena  # ... and, as it fits, staged into (not made anew)
    assert pool.nbytes <= nbytes + 2**16
    pool.release(second)


def test_state_bigger_than_the_budget_is_staged_when_nothing_else_holds_memory() -> None:
    pool = StagingPool(1, budget_bytes=1024)
    slot = pool.acquire(timeout_s=1)
    state = {"x": torch.randn(10_000)}
    _assert_exact(slot.stage(state), state)
    pool.release(slot)


def test_acquire_times_out_when_every_slot_is_in_flight() -> None:
    pool = StagingPool(1)
    slot = pool.acquire(timeout_s=1)
    with pytest.raises(TimeoutError):
        pool.acquire(timeout_s=0.1)
    pool.release(slot)


def test_round_trip_through_the_manager_with_shape_changes_and_views(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False) as manager:
        history = {}
        for step, seed in enumerate([0, 0, 1, 2]):
            state = _state(seed)
            if step == 2:
                state["w"] = torch.randn(3, 3)
                state.pop("nan")
            state.pop("empty")  # DCP does not restore zero-element tensors into shapes (0, 3)
            history[step] = {k: v.clone() for k, v in state.items()}
            assert manager.save_async(step, state)
            for tensor in state.values():  # mutate right away: the snapshot must hold
                if tensor.dtype.is_floating_point:
                    tensor.mul_(3)
        manager.join()
        for step, expected in history.items():
            target = {k: torch.empty_like(v) for k, v in expected.items()}
            manager.restore(step, target)
            _assert_exact(target, expected)


def _zero(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An efficient zero tensor, what forward-mode AD makes: no memory (``data_ptr()`` is 0)."""
    zero = torch._efficientzerotensor(shape, dtype=dtype)
    assert zero._is_zerotensor() and zero.data_ptr() == 0
    return zero


def _zeros_state(seed: int) -> dict[str, torch.Tensor]:
    """Small tensors (packed; one ``torch.cat`` copies the run of the float32 ones) and a big
    one, with efficient zero tensors among both: in the run, of other dtypes, transposed, a
    parameter, and big (staged on its own)."""
    generator = torch.Generator().manual_seed(seed)
    state = {f"small/{i}": torch.randn(4, generator=generator) for i in range(12)}
    state["small/5"] = _zero(4)
    state["zero_int"] = _zero(3, dtype=torch.int64)
    state["zero_bool"] = _zero(5, dtype=torch.bool)
    state["zero_bf16_t"] = _zero(3, 5, dtype=torch.bfloat16).t()
    state["zero_param"] = torch.nn.Parameter(_zero(6))
    state["big"] = torch.randn(300_000, generator=generator)
    state["zero_big"] = _zero(300_000)
    return state


def _values(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What ``state`` holds, as ordinary tensors (an efficient zero tensor: its zeros)."""
    return {
        key: torch.zeros(value.shape, dtype=value.dtype)
        if value._is_zerotensor()
        else value.detach().clone()
        for key, value in state.items()
    }


def _ones_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Ordinary tensors of ``state``'s shapes and dtypes, all ones (nonzero bytes)."""
    return {key: torch.ones(value.shape, dtype=value.dtype) for key, value in state.items()}


@pytest.mark.parametrize("pack", [None, any_name], ids=["unpacked", "packed"])
def test_efficient_zero_tensors_are_staged_as_zeros(pack: PackFilter | None) -> None:
    """An efficient zero tensor (forward-mode AD's; no storage) failed save_async's staging
    with torch's "Attempted to access the data pointer on an invalid python storage" (the
    layout signature groups tensors by storage address). It is staged as the zeros it stands
    for, into an ordinary tensor: over memory that held ones, under a reused layout, in a run
    copied by one ``torch.cat``, on its own when big, in place of a view of a shared storage,
    and the other way round."""
    buffers = StagingBuffers()
    state = _zeros_state(0)

    def staged(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = buffers.stage(tensors, pack=pack)
        result = _unpacked(out, buffers.packed) if PACK_KEY in out else out
        assert not any(value._is_zerotensor() for value in result.values())
        return result

    _assert_exact(staged(_ones_like(state)), _ones_like(state))  # the arena holds ones
    _assert_exact(staged(state), _values(state))  # one layout: zeros over the ones
    if pack is not None:
        runs = [keys for keys, _ in buffers._cat_runs]  # internal: the runs it found
        assert any("small/5" in keys for keys in runs)
    _assert_exact(staged(state), _values(state))  # the layout's quick path
    _assert_exact(staged(_ones_like(state)), _ones_like(state))  # and back
    fresh = StagingBuffers()  # a first save
    _assert_exact(fresh.stage(state), _values(state))
    base = torch.arange(1.0, 9.0)
    _assert_exact(staged({"a": base[:4], "b": base[4:]}), {"a": base[:4], "b": base[4:]})
    tied_gone = {"a": _zero(4), "b": base[4:]}  # same quick signature, no storage to share
    _assert_exact(staged(tied_gone), _values(tied_gone))
    _assert_exact(staged({"a": base[:4], "b": base[4:]}), {"a": base[:4], "b": base[4:]})


@pytest.mark.parametrize(
    ("call", "mode"),
    [("save", "thread"), ("save_async", "thread"), ("save_async", "process")],
    ids=["save", "save_async", "save_async_process"],
)
def test_efficient_zero_tensors_round_trip_as_zeros_through_the_manager(
    tmp_path: Path, call: str, mode: str
) -> None:
    """save_async (both modes) raised torch's RuntimeError on an efficient zero tensor, and
    save failed with "OSError: [Errno 14] Bad address" on one not packed (it wrote the bytes
    at address 0). Both store its zeros, restored bit-exact into ordinary tensors: alone,
    among others, on a first save and on later saves of one layout, and after zeros became
    ordinary tensors under one layout."""
    alone = {"z": _zero(8)}
    states = [alone, alone, _zeros_state(0), _zeros_state(1), _ones_like(_zeros_state(2))]
    states.append(_zeros_state(3))
    with CheckpointManager(tmp_path, 1, chkpt_on_preemption=False, async_mode=mode) as manager:
        for step, state in enumerate(states):
            assert getattr(manager, call)(step, state)
        manager.join()
        for step, state in enumerate(states):
            target = _ones_like(state)
            manager.restore(step, target)
            _assert_exact(target, _values(state))


def test_process_mode_arena_larger_than_free_shared_memory_is_refused(tmp_path: Path) -> None:
    """Shared memory beyond the tmpfs' size would kill the process with SIGBUS when touched:
    a shared arena that does not fit is refused with CheckpointError before it is allocated."""
    stats = os.statvfs(tmp_path)
    free = stats.f_bavail * stats.f_frsize
    with pytest.raises(CheckpointError, match="shared memory") as refused:
        check_shared_memory(free + 2**30, str(tmp_path))
    assert "async_mode='thread'" in str(refused.value)
    check_shared_memory(1, str(tmp_path))  # what fits passes
    if os.path.isdir(SHARED_MEMORY_DIR):
        shm = os.statvfs(SHARED_MEMORY_DIR)
        with pytest.raises(CheckpointError, match="shared memory"):
            _Arena(shm.f_bavail * shm.f_frsize + 2**30, pin=False, shared=True)


def test_a_slot_released_during_a_budget_wait_lets_the_waiting_slot_go_on() -> None:
    """Three slots, a budget for two and a half states, two slots in flight: the third waits.
    Once one of the two is released its arena can be freed, so the third goes on at once; it
    used to wait for every slot in flight to be released."""
    nbytes = 4 * 2**20
    pool = StagingPool(3, budget_bytes=int(2.5 * nbytes))
    first, second = pool.acquire(timeout_s=1), pool.acquire(timeout_s=1)
    first.stage({"x": torch.full((nbytes // 4,), 1.0)})
    second.stage({"x": torch.full((nbytes // 4,), 2.0)})
    first_arena = first._arena
    third = pool.acquire(timeout_s=1)
    staged: dict[str, torch.Tensor] = {}
    thread = threading.Thread(
        target=lambda: staged.update(third.stage({"x": torch.full((nbytes // 4,), 3.0)}))
    )
    thread.start()
    deadline = time.monotonic() + 10
    while not pool._cond._waiters:  # type: ignore[attr-defined]  # bounded poll: it waits
        assert time.monotonic() < deadline, "the third slot never waited for the budget"
        time.sleep(0.001)
    assert not staged
    pool.release(first)
    thread.join(timeout=10)
    try:
        assert not thread.is_alive(), "the third slot still waits, with `second` in flight"
        assert torch.equal(staged["x"], torch.full((nbytes // 4,), 3.0))
        assert first.nbytes == 0  # the released slot's arena was freed for the budget ...
        assert third._arena is first_arena  # ... and, as it fits, staged into
        assert pool.nbytes <= 2.5 * nbytes
    finally:
        pool.release(second)
        thread.join(timeout=10)
    pool.release(third)


def test_a_zero_byte_arena_for_pinned_staging_is_allowed() -> None:
    """A rank whose CUDA tensors are all empty (its shards of a small tensor, say) stages
    nothing: a zero-byte arena asked to be pinned is simply not pinned (it raised ValueError)."""
    arena = _Arena(0, pin=True)
    assert arena.size == 0 and not arena.pinned


STAGING_IMPORTS = r"""
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from ckptmgr.staging import StagingBuffers
"""


def _run_on_one_gloo_rank(tmp_path: Path, name: str, body: str) -> None:
    """``body`` with the staging tests' imports, on a process group of one gloo rank."""
    run_on_one_gloo_rank(tmp_path, name, STAGING_IMPORTS + body)


PLAIN_THEN_DTENSOR = r"""
try:
    mesh = init_device_mesh("cpu", (1,))
    buffers = StagingBuffers()
    plain = {"w": torch.randn(8, 4), "v": torch.randn(100)}
    buffers.stage(plain)
    for save in range(2):  # the same local layout as the plain tensors had
        sharded = {
            "w": distribute_tensor(torch.randn(8, 4) + save, mesh, [Shard(0)]),
            "v": distribute_tensor(torch.randn(100) + save, mesh, [Replicate()]),
        }
        staged = buffers.stage(sharded)
        for key, value in sharded.items():
            got = staged[key]
            assert isinstance(got, DTensor), (save, key, type(got))
            assert got.placements == value.placements, (save, key)
            assert torch.equal(got.to_local(), value.to_local()), (save, key)
    staged = buffers.stage(plain)  # and back
    assert not any(isinstance(v, DTensor) for v in staged.values())
    assert all(torch.equal(staged[k], v) for k, v in plain.items())
    print("ok")
finally:
    dist.destroy_process_group()
"""


def test_dtensors_laid_out_like_the_plain_tensors_before_them_stay_dtensors(
    tmp_path: Path,
) -> None:
    """DTensors whose local shards have the layout of the plain tensors the slot staged before
    are staged as DTensors (one gloo rank). The reused layout kept saying "no DTensor": they
    came back as plain tensors (a sharded tensor stored as a replicated one), and the next save
    raised in the copy."""
    _run_on_one_gloo_rank(tmp_path, "plain_then_dtensor", PLAIN_THEN_DTENSOR)


DTENSORS_STAGED_AGAIN = r"""


def check(staged, state, where):
    assert list(staged) == list(state), where
    for key, value in state.items():
        got = staged[key]
        assert type(got) is type(value), (where, key, type(got))
        if isinstance(value, DTensor):
            assert got.placements == value.placements, (where, key, got.placements)
            assert got.shape == value.shape and got.dtype == value.dtype, (where, key)
            got, value = got.to_local(), value.to_local()
        assert got.dtype == value.dtype and got.shape == value.shape, (where, key)
        assert torch.equal(got, value), (where, key)


try:
    mesh = init_device_mesh("cpu", (1,))
    state = {
        "w": distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]),
        "plain": torch.randn(6),
        "v": distribute_tensor(torch.randn(100), mesh, [Replicate()]),
    }
    buffers = StagingBuffers()
    first = buffers.stage(state)
    check(first, state, "first save")
    for save in range(2):  # the same objects, changed in place: the staged DTensors kept
        with torch.no_grad():
            state["w"].to_local().add_(1.0)
            state["v"].to_local().mul_(-1.0)
            state["plain"].add_(2.0)
        staged = buffers.stage(state)
        check(staged, state, f"in place {save}")
        assert staged["w"] is first["w"] and staged["v"] is first["v"], save
    # The same global shape, another placement (its local shape the same on one rank)
    state["w"] = distribute_tensor(torch.randn(8, 4), mesh, [Replicate()])
    check(buffers.stage(state), state, "placement changed")
    # Another dtype of the same shape
    state["v"] = distribute_tensor(torch.randn(100, dtype=torch.float64), mesh, [Replicate()])
    check(buffers.stage(state), state, "dtype changed")
    # A plain tensor of another shape beside the DTensors
    state["plain"] = torch.randn(7)
    check(buffers.stage(state), state, "plain shape changed")
    # A plain tensor where a DTensor was, of the same shape, and back
    dtensor = state["w"]
    state["w"] = torch.randn(8, 4)
    check(buffers.stage(state), state, "plain in a DTensor's place")
    state["w"] = dtensor
    check(buffers.stage(state), state, "DTensor back")
    # The keys in another order
    state = {key: state[key] for key in reversed(list(state))}
    check(buffers.stage(state), state, "keys reordered")
    # A DTensor whose local tensor was replaced by one of another shape under the same spec
    # (not a valid DTensor, but never staged as if it had its old shape: a copy of one item
    # into the old region would fill it by broadcasting)
    state["v"]._local_tensor = torch.randn(1, dtype=torch.float64)
    staged = buffers.stage(state)
    assert staged["v"].to_local().shape == (1,), staged["v"].to_local().shape
    assert torch.equal(staged["v"].to_local(), state["v"]._local_tensor)
    print("ok")
finally:
    dist.destroy_process_group()
"""


def test_dtensors_staged_again_are_copied_into_the_same_staged_dtensors(tmp_path: Path) -> None:
    """A state of DTensors staged again with the same specs, local shapes and keys reuses the
    staged DTensors (no full look at the state on the training thread); anything else that
    changed is staged anew: a placement or dtype under the same global shape, a plain tensor's
    shape, a plain tensor in a DTensor's place, the keys' order, a local tensor's shape (one
    gloo rank)."""
    _run_on_one_gloo_rank(tmp_path, "dtensors_staged_again", DTENSORS_STAGED_AGAIN)


def test_small_cuda_tensors_are_gathered_by_stretches_of_one_dtype_and_device() -> None:
    """Which packed tensors staging flattens on their GPU and copies to the host in one piece:
    stretches of two or more, back to back, of one dtype, on one CUDA device (only device
    objects are needed for this, no GPU)."""
    cpu, gpu0, gpu1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    placed = list(
        pack_layout(
            {
                f"t{i}": torch.empty(3, dtype=torch.float32 if i < 9 else torch.int16)
                for i in range(12)
            },
            [f"t{i}" for i in range(12)],
        ).values()
    )
    devices = [gpu0, gpu0, gpu0, cpu, gpu0, gpu1, gpu1, gpu0, cpu, gpu0, gpu0, gpu0]
    # float32: t0-t2 on gpu0, t3 cpu, t4 alone, t5-t6 on gpu1, t7 alone, t8 cpu;
    # int16: t9-t11 on gpu0 (a new dtype cuts the stretch even on the same device)
    assert _gathers(placed, devices, 2**20) == [(0, 3), (5, 7), (9, 12)]
    assert _gathers(placed, [cpu] * 12, 2**20) == []
    # at most 2 float32 tensors of 3 (24 bytes) per piece: t0-t1, then t2 alone (not gathered)
    assert _gathers(placed, devices, 24) == [(0, 2), (5, 7), (9, 12)]
    assert _gathers(placed, [gpu0] * 12, 0) == []  # (each tensor alone: copied as it is)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("pack", [None, any_name], ids=["unpacked", "packed"])
def test_cuda_conjugated_and_negated_sources_are_staged_with_their_values(
    pack: PackFilter | None,
) -> None:
    """Lazily conjugated or negated device tensors are staged with the values they stand for:
    contiguous or not (torch's copy across devices of a non-contiguous one applies the bit
    twice), copied one by one or flattened on the device with neighbours of their dtype
    (packed), on the first save and when the layout is reused. (A non-blocking copy of such a
    view would also apply the bit to the host buffer before the bytes arrive,
    pytorch/pytorch#146286.)"""
    z = torch.randn(1000, dtype=torch.complex64, device="cuda")
    m = torch.randn(40, 30, dtype=torch.complex64, device="cuda")
    state = {
        "conj": z.conj(),  # contiguous
        "conj/strided": z[::2].conj(),
        "conj/transposed": m.t().conj(),
        "complex/plain": torch.randn(64, dtype=torch.complex64, device="cuda"),
        "neg": z.conj().imag,  # stride 2
        "neg/2d": m.conj().imag.t(),
        "plain": torch.randn(1000, device="cuda"),
        "plain/2": torch.randn(7, 3, device="cuda"),
    }
    assert not state["neg"].is_contiguous() and state["neg"].is_neg()
    assert not state["conj/strided"].is_contiguous() and state["conj/strided"].is_conj()
    expected = {key: value.resolve_conj().resolve_neg().cpu() for key, value in state.items()}
    buffers = StagingBuffers()
    for _ in range(2):  # the first layout, then the reused one
        staged = buffers.stage(state, pack=pack)
        got = _unpacked(staged, buffers.packed) if PACK_KEY in staged else staged
        _assert_exact(got, expected)
    if pack is not None:
        assert buffers.packed.keys() == state.keys()


@cuda
def test_cuda_parameters_are_staged_without_an_autograd_graph() -> None:
    params = {"w": torch.nn.Parameter(torch.randn(64, 8, device="cuda"))}
    buffers = StagingBuffers()
    for _ in range(3):
        staged = buffers.stage(params)
        assert not staged["w"].requires_grad and staged["w"].grad_fn is None
        assert torch.equal(staged["w"], params["w"].detach().cpu())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_sources_on_another_device_are_synchronised_before_stage_returns() -> None:
    """A source on a GPU other than the current one is copied on a side stream of its own
    device, which is synchronised: the values are there when stage() returns."""
    with torch.cuda.device(0):
        big = torch.randn(64 * 2**20 // 4, device="cuda:1")
        for _ in range(5):
            big.mul_(1.0001)  # queued work on cuda:1's stream
        state = {"x": big}
        staged = StagingBuffers().stage(state)
        torch.cuda.synchronize(1)
        assert torch.equal(staged["x"], big.cpu())


@cuda
def test_cuda_a_freed_arena_is_unpinned_at_once() -> None:
    """free() unpins the arena itself, while it is surely mapped: left to the mmap's
    finalizer, cudaHostUnregister ran after Python had unmapped the memory."""
    buffers = StagingBuffers()
    staged = buffers.stage({"x": torch.randn(2**20, device="cuda")})
    pointer = staged["x"].data_ptr()  # the arena's first region; `staged` keeps it mapped
    assert staged["x"].is_pinned()
    buffers.free()
    # Registered no longer: unregistering again fails (cudaErrorHostMemoryNotRegistered).
    assert int(torch.cuda.cudart().cudaHostUnregister(pointer)) != 0
    assert not staged["x"].is_pinned()


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_close_frees_the_staging_memory_of_a_manager_still_referenced(
    tmp_path: Path, mode: str
) -> None:
    """A closed manager kept its staging arena (a copy of the state, in shared memory in process
    mode) for as long as it was referenced: a script that kept its variable after training held
    that memory through its evaluation."""
    manager = CheckpointManager(tmp_path / "ckpts", 1, chkpt_on_preemption=False, async_mode=mode)
    assert manager.save_async(1, {"w": torch.ones(1 << 20)})
    manager.join()
    arena = weakref.ref(manager._staging._all[0]._arena)  # internal: the slot's memory
    assert arena() is not None
    manager.close()
    gc.collect()
    assert arena() is None and manager._staging.nbytes == 0
    assert manager.all_steps() == [1]


def test_an_idle_slots_arena_that_the_latest_layout_would_not_keep_is_freed_in_time() -> None:
    """Two slots staged a large state; the state shrank to a quarter: the slot in use was
    shrunk, but the idle one kept the large arena until close (with no budget), and with three
    slots memory stayed at nine times the state. It is freed once it went unused for
    STALE_AFTER_TAKEN takings per slot (not at once: a state saved in turn with a larger one
    would make and fault in a new arena at each turn)."""
    nbytes = 4 * 2**20
    pool = StagingPool(2)
    first, second = pool.acquire(timeout_s=1), pool.acquire(timeout_s=1)
    first.stage({"x": torch.full((nbytes // 4,), 1.0)})
    second.stage({"x": torch.full((nbytes // 4,), 2.0)})
    pool.release(first)
    pool.release(second)
    small = torch.arange(nbytes // 16, dtype=torch.float32)
    used = set()
    for turn in range(STALE_AFTER_TAKEN * 2 + 1):
        slot = pool.acquire(timeout_s=1)
        used.add(id(slot))
        if turn < STALE_AFTER_TAKEN * 2 - 1:
            assert first.nbytes == nbytes, turn  # (idle, kept for now)
        assert torch.equal(slot.stage({"x": small + turn})["x"], small + turn)
        pool.release(slot)
    assert used == {id(second)}  # (the most recently released each time)
    assert second.nbytes < nbytes / 2  # (shrunk at once, as before)
    assert first.nbytes == 0  # freed, unused for long
    assert pool.nbytes == second.nbytes


def test_idle_arenas_are_judged_by_the_state_staged_last_and_aged_from_their_release() -> None:
    """The latest layout was recorded only when a slot laid a state out anew, not when it
    staged one with its cached layout: after a large state saved once among small ones, its
    arena stayed for good. And a slot's idle age counted from when it was taken: the arena of a
    large save whose write was slow was freed at the first save after its release."""
    mib = 2**20
    large = {"w": torch.ones(16 * mib // 4)}
    small = {"w": torch.ones(mib // 4)}
    pool = StagingPool(2)

    def save(state: dict[str, torch.Tensor]) -> StagingBuffers:
        slot = pool.acquire(timeout_s=1)
        slot.stage(state)
        return slot

    first, second = save(small), save(small)  # two small saves at once: both laid out
    pool.release(first)
    pool.release(second)
    large_save, small_save = save(large), save(small)  # cached layout: nothing laid out anew
    pool.release(large_save)
    pool.release(small_save)
    for _ in range(STALE_AFTER_TAKEN * 2 + 2):  # then small ones alone, one at a time
        pool.release(save(small))
    assert large_save.nbytes == 0  # judged by the small state: freed
    assert pool.nbytes == mib

    pool = StagingPool(3)
    slow = save(large)  # written slowly: small saves go through the other slots meanwhile
    for _ in range(STALE_AFTER_TAKEN * 3 + 1):
        pool.release(save(small))
    in_flight = save(small)
    pool.release(slow)
    pool.release(in_flight)
    pool.release(save(small))  # (into the slot released last)
    assert slow.nbytes == 16 * mib  # idle since its release only: kept for now
