"""Saves and restores on object stores, against raw fsspec transfers of the same bytes.

Runs the GCS emulator (``gcp-storage-emulator``) and moto's S3 server as processes on
127.0.0.1 and, for each store, in one process and in shuffled order each round:

* ``raw upload``: ``fs.pipe_file`` of one object of the state's bytes (the floor of a save);
* ``raw download``: ``fs.cat_file`` of that object, one GET (the floor of a restore);
* ``ckptmgr save``: ``save()``, to the commit;
* ``ckptmgr save_async``: time blocked, and to the commit;
* ``ckptmgr restore``: in place, of the step the last save wrote.

The state is ``--mib`` MiB in ``--tensors`` float32 tensors, plus ``--small`` tensors of 1 KiB;
``--num-of-threads`` is the manager's (data files per save). ``--rtt-ms`` puts a proxy in
front of the server that delays every byte by half that in each direction
(`benchmarks/_latency_proxy.py`): requests made one after another then cost what they would
against a bucket that far away, raw transfers included.
The servers are Python processes on the same machine as the client: their own cost per request
and per byte is in every number, so the ratios compare how ckptmgr moves the bytes (requests,
ranges, local copies) with the simplest transfer, not the speed of a real bucket.

Usage::

    python benchmarks/bench_cloud.py --mib 256 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # before gcsfs is imported
for _name in [n for n in os.environ if n.startswith("AWS_")]:
    del os.environ[_name]  # never a developer's real AWS profile
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fsspec  # noqa: E402
from _latency_proxy import latency_proxy  # noqa: E402  (this script's folder is on sys.path)

from ckptmgr import CheckpointManager  # noqa: E402

BUCKET = "bench-bucket"
START_TIMEOUT_S = 60.0
KINDS = ("raw upload", "raw download", "ckptmgr save", "ckptmgr save_async", "ckptmgr restore")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_until_answers(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # any HTTP answer: the server is up
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the server at {url} did not start")


@contextmanager
def object_store(kind: str, rtt_s: float) -> Iterator[tuple[str, dict[str, Any]]]:
    """A running server, ``rtt_s`` away: (the bench's root URL, the fsspec options that
    reach it)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    if kind == "gcs":
        command = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1"]
        command += ["--port", str(port), "--in-memory", "-q", "--default-bucket", BUCKET]
        probe = f"{url}/storage/v1/b/{BUCKET}"
        os.environ["STORAGE_EMULATOR_HOST"] = url
    else:
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
        probe = f"{url}/moto-api/"
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_until_answers(probe, process)
        with latency_proxy(url, rtt_s / 2) if rtt_s > 0 else nullcontext(url) as endpoint:
            if kind == "gcs":
                options: dict[str, Any] = {"token": "anon", "project": "bench"}
                options["endpoint_url"] = endpoint
            else:
                options = {"key": "testing", "secret": "testing", "endpoint_url": endpoint}
                fsspec.filesystem("s3", **options).mkdir(BUCKET)
            scheme = "gs" if kind == "gcs" else "s3"
            yield f"{scheme}://{BUCKET}/run", options
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def make_state(mib: int, tensors: int, small: int) -> dict[str, torch.Tensor]:
    """``tensors`` float32 tensors of ``mib`` MiB in all, and ``small`` tensors of 1 KiB."""
    generator = torch.Generator().manual_seed(0)
    each = mib * 2**20 // 4 // max(tensors, 1)
    state = {f"large{i}": torch.randn(each, generator=generator) for i in range(tensors)}
    state.update({f"small{i}": torch.randn(256, generator=generator) for i in range(small)})
    return state


def run_store(kind: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds of each kind of call on one store, ``args.rounds`` rounds."""
    state = make_state(args.mib, args.tensors, args.small)
    blob = b"".join(bytes(t.numpy().tobytes()) for t in state.values())
    times: dict[str, list[float]] = {name: [] for name in (*KINDS, "save_async blocking")}
    with object_store(kind, args.rtt_ms / 1000) as (root, options):
        fs = fsspec.filesystem(root.split(":")[0], **options)
        raw_path = f"{BUCKET}/raw/blob"
        target = {name: torch.zeros_like(value) for name, value in state.items()}
        with CheckpointManager(
            root,
            1,
            max_to_keep=2,
            num_of_threads=args.num_of_threads,
            storage_options=options,
        ) as manager:
            step = 0

            def raw_upload() -> None:
                fs.pipe_file(raw_path, blob)

            def raw_download() -> None:
                assert len(fs.cat_file(raw_path)) == len(blob)

            def save() -> None:
                nonlocal step
                step += 1
                assert manager.save(step, state)

            def save_async() -> None:
                nonlocal step
                step += 1
                began = time.perf_counter()
                assert manager.save_async(step, state)
                times["save_async blocking"].append(time.perf_counter() - began)
                manager.join()

            def restore() -> None:
                manager.restore(step, target)

            calls: dict[str, Callable[[], None]] = {
                "raw upload": raw_upload,
                "raw download": raw_download,
                "ckptmgr save": save,
                "ckptmgr save_async": save_async,
                "ckptmgr restore": restore,
            }
            raw_upload()
            save()  # the first of each: connections opened, staging allocated
            save_async()
            times["save_async blocking"].clear()
            for _ in range(args.rounds):
                order = list(KINDS)
                random.shuffle(order)
                order.sort(key=lambda name: name == "ckptmgr restore")  # after a save
                for name in order:
                    began = time.perf_counter()
                    calls[name]()
                    times[name].append(time.perf_counter() - began)
            assert all(torch.equal(target[name], value) for name, value in state.items())
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--small", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--stores", default="gcs,s3")
    parser.add_argument("--num-of-threads", type=int, default=1, help="data files per save")
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="added round trip")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {}
    for kind in args.stores.split(","):
        times = run_store(kind, args)
        median = {name: statistics.median(values) for name, values in times.items()}
        results[kind] = {"median_s": median, "all_s": times}
        upload, download = median["raw upload"], median["raw download"]
        print(
            f"{kind}: {args.mib} MiB in {args.tensors} tensors + {args.small} of 1 KiB, "
            f"num_of_threads={args.num_of_threads}, round trip +{args.rtt_ms:g} ms"
        )
        for name, seconds in median.items():
            if name == "save_async blocking":
                print(f"  {name:22s} {seconds:8.3f} s")
                continue
            floor = download if "restore" in name or "download" in name else upload
            print(f"  {name:22s} {seconds:8.3f} s  {seconds / floor:5.2f}x the raw transfer")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
