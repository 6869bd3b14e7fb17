"""Requests that a save and a restore make one after another, on GCS and on S3.

A bucket is tens of milliseconds away: a save or restore of a small state costs about one round
trip per request made in turn. Against the GCS emulator and moto's S3 server on 127.0.0.1,
through the counting proxy, holding some requests to show what is sent while they wait: the
objects file goes up beside the data file, a new step's directory is listed in one request,
and a restore reads ``.metadata`` and the plain values by one ranged read each, beside the
listing that checks the step's files (and the pack of small tensors, into a buffer of its own),
and nothing of the data into the state before that listing's check. Opening a manager and
``verify`` list the root once.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _cloud_servers import (  # noqa: F401  (the *_fixture functions are fixtures)
    FaultProxy,
    Server,
    is_data_upload,
    is_listing,
    proxy_fixture,
    require_cloud_modules,
    root_fixture,
    server_fixture,
)

require_cloud_modules()

from conftest import checked_torch_only  # noqa: E402

from ckptmgr import CheckpointManager, CorruptCheckpointError, cli, remote_read  # noqa: E402
from ckptmgr.storage import CheckpointStorage  # noqa: E402

pytestmark = [pytest.mark.cloud, pytest.mark.timeout(240)]
WAIT_S = 60.0


def manager(root: str, options: dict[str, Any]) -> CheckpointManager:
    return CheckpointManager(root, 1, storage_options=options, chkpt_on_preemption=False)


def small_tensors(seed: int) -> dict[str, Any]:
    """A state of many small tensors (stored as one pack) and a plain value."""
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {f"t{i}": torch.randn(64, generator=generator) for i in range(300)}
    state["epoch"] = seed
    return state


def blank(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in state.items()}


def same(actual: dict[str, Any], expected: dict[str, Any]) -> bool:
    return actual.keys() == expected.keys() and all(
        torch.equal(value, expected[key])
        if isinstance(value, torch.Tensor)
        else value == expected[key]
        for key, value in actual.items()
    )


def is_objects_upload(method: str, path: str) -> bool:
    return method in ("POST", "PUT") and "objects-rank" in path


def is_data_read(method: str, path: str) -> bool:
    return method == "GET" and ".distcp" in path


def is_small_file_read(method: str, path: str) -> bool:
    """A read of ``.metadata`` or of a plain-values file."""
    return method == "GET" and (".metadata" in path or "objects-rank" in path)


def large_tensors(seed: int) -> dict[str, Any]:
    """A state of a few large tensors (no pack) and a plain value."""
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {f"w{i}": torch.randn(50_000, generator=generator) for i in range(3)}
    state["epoch"] = seed
    return state


def test_the_objects_file_is_sent_while_the_data_file_is_uploaded(
    server: Server, root: str, proxy: FaultProxy
) -> None:
    state = small_tensors(1)
    with manager(root, server.storage_options(proxy.url)) as mgr:
        proxy.hold(is_objects_upload)
        try:
            assert mgr.save_async(1, state)
            # the objects file's upload is not answered, and the data file goes up meanwhile
            assert proxy.wait_for(is_objects_upload, 1, timeout=WAIT_S)
            assert proxy.wait_for(is_data_upload, 1, timeout=WAIT_S)
        finally:
            proxy.release()
        mgr.join()
        assert mgr.all_steps() == [1]
        target = blank(state)
        mgr.restore(1, target)
        assert same(target, state)


@checked_torch_only
def test_a_new_step_is_listed_with_one_request(
    server: Server, root: str, proxy: FaultProxy
) -> None:
    with manager(root, server.storage_options(proxy.url)) as mgr:
        assert mgr.save(1, small_tensors(1))
        proxy.clear()
        assert mgr.save(2, small_tensors(2))
        heads = [s.path for s in proxy.seen if s.method == "HEAD"]
        step_listings = [
            s.path
            for s in proxy.seen
            if is_listing(s.method, s.path) and "step_000000000002" in s.path
        ]
    assert heads == []
    # one before writing (nothing there yet), one before the commit (the files' sizes)
    assert len(step_listings) == 2, step_listings


@pytest.mark.parametrize("make", [small_tensors, large_tensors], ids=["pack", "no-pack"])
def test_a_restore_reads_metadata_and_plain_values_in_one_request_each(
    server: Server, root: str, proxy: FaultProxy, make: Any
) -> None:
    state = make(3)
    with manager(root, server.storage_options(proxy.url)) as mgr:
        assert mgr.save(1, state)
        target = blank(state)
        proxy.clear()
        mgr.restore(1, target)
        assert same(target, state)
        asked = sorted(
            (s.method, s.path) for s in proxy.seen if is_small_file_read(s.method, s.path)
        )
        assert len(asked) == 2, asked
        assert [s.path for s in proxy.seen if s.method == "HEAD"] == []


@pytest.mark.parametrize("make", [small_tensors, large_tensors], ids=["pack", "no-pack"])
def test_the_step_is_listed_while_its_small_files_are_read_and_nothing_reaches_the_state(
    server: Server, root: str, proxy: FaultProxy, make: Any
) -> None:
    """The listing that checks every file's size, the reads of ``.metadata`` and the plain
    values, and the read of a pack into a buffer of its own, are at the store together; no
    other data is read, and nothing reaches the state, before the listing's check passed."""
    state = make(4)
    packed = make is small_tensors
    with manager(root, server.storage_options(proxy.url)) as mgr:
        assert mgr.save(1, state)
        target = blank(state)
        errors: list[BaseException] = []

        def restore() -> None:
            try:
                mgr.restore(1, target)
            except BaseException as exc:  # (asserted on below)
                errors.append(exc)

        proxy.clear()
        proxy.hold(is_listing)
        thread = threading.Thread(target=restore)
        thread.start()
        try:
            assert proxy.wait_for(is_listing, 1, timeout=WAIT_S)
            assert proxy.wait_for(is_small_file_read, 2, timeout=WAIT_S)
            if packed:
                assert proxy.wait_for(is_data_read, 1, timeout=WAIT_S)
            else:
                assert proxy.count(is_data_read) == 0
            assert same(target, blank(state))  # the listing is not answered: nothing copied
        finally:
            proxy.release()
            thread.join(WAIT_S)
        assert not thread.is_alive() and errors == []
        assert same(target, state)


@pytest.mark.parametrize("name", [".metadata", "objects-rank00000.json"])
def test_a_small_file_with_a_flipped_bit_fails_the_restore(
    server: Server, root: str, name: str
) -> None:
    """``.metadata`` and the plain values, each read ahead by one ranged read, are checked
    against the record's CRC-32 before anything of them is used."""
    state = small_tensors(5)
    with manager(root, server.storage_options()) as mgr:
        assert mgr.save(1, state)
        storage = CheckpointStorage(root, server.storage_options())
        path = f"{storage.step_path(1)}/{name}"
        damaged = bytearray(storage.fs.cat_file(path))
        damaged[len(damaged) // 2] ^= 0x01
        storage.fs.pipe_file(path, bytes(damaged))
        target = blank(state)
        with pytest.raises(CorruptCheckpointError, match=re.escape(name)):
            mgr.restore(1, target)
        assert same(target, blank(state))


def is_root_listing(root: str) -> Callable[[str, str], bool]:
    """A matcher: a listing of everything under ``root`` (not of one step)."""
    key = root.split("://", 1)[1].split("/", 1)[1]

    def match(method: str, path: str) -> bool:
        return is_listing(method, path) and (
            f"prefix={key}/&" in path or f"prefix={key}%2F&" in path
        )

    return match


def test_opening_a_manager_lists_the_root_once_unless_it_removes_leftovers(
    server: Server, root: str, proxy: FaultProxy
) -> None:
    options = server.storage_options(proxy.url)
    with manager(root, options) as mgr:
        assert mgr.save(1, small_tensors(1))
    proxy.clear()
    with manager(root, options) as mgr:  # nothing left over: one listing for both
        assert mgr.all_steps() == [1]
        assert proxy.count(is_root_listing(root)) == 1
    storage = CheckpointStorage(root, server.storage_options())
    storage.fs.pipe_file(f"{storage.step_path(2)}/__0_0.distcp", b"an interrupted save")
    proxy.clear()
    with CheckpointManager(
        root, 1, storage_options=options, chkpt_on_preemption=False, leftover_grace_s=0
    ) as mgr:  # a leftover: removed, and the root listed again
        assert mgr.all_steps() == [1]
        assert proxy.count(is_root_listing(root)) == 2
    assert storage.leftovers() == []


def test_verify_lists_the_root_once(
    server: Server,
    root: str,
    proxy: FaultProxy,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``verify`` and ``ckptmgr verify`` take the committed and the quarantined steps from one
    listing (the command's check that the root exists, which lists it too, left out here)."""
    monkeypatch.setattr(cli, "open_storage", lambda url, pairs: CheckpointStorage(url, dict(pairs)))
    options = server.storage_options(proxy.url)
    with manager(root, options) as mgr:
        assert mgr.save(1, small_tensors(1))
        proxy.clear()
        mgr.verify(1)
        assert proxy.count(is_root_listing(root)) == 1
    flags = [f"-o{key}={value}" for key, value in options.items()]
    for step in ([], ["1"]):  # ckptmgr verify: every step, and one
        proxy.clear()
        assert cli.main(["verify", root, *step, "--json", *flags]) == 0
        assert json.loads(capsys.readouterr().out)["steps"][0]["ok"]
        assert proxy.count(is_root_listing(root)) == 1


def test_a_metadata_file_of_several_windows_is_read_by_ranged_reads(
    server: Server, root: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``.metadata`` larger than one read's worth is not read ahead: it is read when DCP asks
    for it, in windows, each a ranged read, and checked whole."""
    monkeypatch.setattr(remote_read, "WINDOW_BYTES", 256)  # (also the most that is read ahead)
    state = small_tensors(6)
    with manager(root, server.storage_options(proxy.url)) as mgr:
        assert mgr.save(1, state)
        size = next(
            entry.size
            for entry in CheckpointStorage(root, server.storage_options()).read_record(1).files
            if entry.path == ".metadata"
        )
        assert size > 3 * 256
        target = blank(state)
        proxy.clear()
        mgr.restore(1, target)
        assert same(target, state)
        reads = proxy.count(lambda method, path: method == "GET" and ".metadata" in path)
        assert reads == -(-size // 256), (reads, size)


def test_s3_uploads_of_small_bodies_do_not_wait_for_continue(
    server: Server, root: str, proxy: FaultProxy
) -> None:
    """botocore asks for ``100 Continue`` before every streamed body: a round trip more per
    PUT. Bodies up to ``PROMPT_BODY_BYTES`` (here the objects file, ``.metadata`` and the
    commit record) go with their headers; a larger one (here a data file of 9 MiB) still asks."""
    if server.kind != "s3":
        pytest.skip("gcsfs sends no Expect header")
    state = small_tensors(7)
    state["large"] = torch.zeros(9 * 2**20 // 4)
    with manager(root, server.storage_options(proxy.url)) as mgr:
        proxy.clear()
        assert mgr.save(1, state)
        puts = {s.path.split("?")[0].rsplit("/", 1)[-1]: s for s in proxy.seen if s.method == "PUT"}
        target = blank(state)
        mgr.restore(1, target)
        assert same(target, state)
    assert puts.keys() == {"objects-rank00000.json", "__0_0.distcp", ".metadata", "commit.json"}
    assert [name for name, s in puts.items() if s.expect_continue] == ["__0_0.distcp"]


@pytest.mark.parametrize(
    "name", [pytest.param(".metadata", marks=checked_torch_only), "objects-rank00000.json"]
)
def test_a_read_ahead_is_retried_on_its_own(
    server: Server, root: str, proxy: FaultProxy, name: str
) -> None:
    """Transient errors on the read ahead of ``.metadata`` or of the plain values, more than
    the request-level tries, re-send that one read (the operation's retries); the restore goes
    on."""
    state = small_tensors(8)

    def reads_it(method: str, path: str) -> bool:
        return method == "GET" and name in path

    with manager(root, server.storage_options(proxy.url)) as mgr:
        assert mgr.save(1, state)
        target = blank(state)
        proxy.set_faults(sequence=("503",) * 4, match=reads_it)  # 3 tries per request
        mgr.restore(1, target)
        assert same(target, state)
        assert proxy.count(reads_it, "503") == 4
        assert proxy.count(reads_it, "forwarded") == 1


@checked_torch_only
def test_s3_owner_lease_reads_ask_no_head(server: Server, root: str, proxy: FaultProxy) -> None:
    """The owner lease is read when a manager opens and closes and before retention deletes: on
    S3 each read is one GET (s3fs' plain ``cat_file`` asks a HEAD first)."""
    if server.kind != "s3":
        pytest.skip("gcsfs reads a whole file in one request")
    options = server.storage_options(proxy.url)
    proxy.clear()
    with CheckpointManager(
        root, 1, storage_options=options, chkpt_on_preemption=False, max_to_keep=1
    ) as mgr:
        for step in (1, 2):  # the second save deletes the first
            assert mgr.save(step, small_tensors(step))
        assert mgr.all_steps() == [2]
    lease_reads = [s for s in proxy.seen if "owner.json" in s.path and s.method in ("GET", "HEAD")]
    assert [s.method for s in lease_reads] == ["GET", "GET", "GET"]  # open, deletion, close
    objects_asked = [s.path for s in proxy.seen if s.method == "HEAD" and s.path.count("/") > 1]
    assert objects_asked == []  # (the bucket's, when the root is made, aside)


def test_an_empty_s3_owner_record_reads_as_damaged_and_is_taken_over(
    server: Server, root: str
) -> None:
    """No server can satisfy a range of an empty object (HTTP 416): an empty record reads as
    empty, so as damaged, as it does elsewhere."""
    if server.kind != "s3":
        pytest.skip("an S3 ranged read")
    storage = CheckpointStorage(root, server.storage_options())
    storage.fs.pipe_file(f"{storage.root}/owner.json", b"")
    with manager(root, server.storage_options()) as mgr:
        assert mgr.save(1, small_tensors(1))
    assert storage.committed_steps() == [1]
