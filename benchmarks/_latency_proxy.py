"""A TCP proxy on 127.0.0.1 that delays every byte by a fixed time in each direction.

Loopback servers answer in microseconds; a real bucket is tens of milliseconds away. Behind
this proxy each request pays ``2 * one_way_s`` more, as on a network with that round trip,
while transfers keep their throughput (bytes are delayed, not slowed): the cost of requests
made one after another shows as it would against a real store.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

CHUNK_BYTES = 256 * 1024


async def _delayed_copy(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, one_way_s: float
) -> None:
    """Copy ``reader`` to ``writer``, each chunk sent ``one_way_s`` after it arrived."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def receive() -> None:
        while True:
            data = await reader.read(CHUNK_BYTES)
            queue.put_nowait((loop.time() + one_way_s, data))
            if not data:
                return

    receiving = asyncio.ensure_future(receive())
    try:
        while True:
            due, data = await queue.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        receiving.cancel()
        writer.close()


@contextmanager
def latency_proxy(upstream: str, one_way_s: float) -> Iterator[str]:
    """A proxy to ``upstream`` (``http://127.0.0.1:PORT``) that adds ``one_way_s`` each way;
    yields its own ``http://127.0.0.1:PORT``."""
    host, port = upstream.removeprefix("http://").rstrip("/").split(":")
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    bound: list[int] = []

    async def connect(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter):
        try:
            server_reader, server_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            client_writer.close()
            return
        try:
            await asyncio.gather(
                _delayed_copy(client_reader, server_writer, one_way_s),
                _delayed_copy(server_reader, client_writer, one_way_s),
            )
        except asyncio.CancelledError:  # the proxy shuts down
            pass

    async def serve() -> asyncio.base_events.Server:
        server = await asyncio.start_server(connect, "127.0.0.1", 0)
        bound.append(server.sockets[0].getsockname()[1])
        ready.set()
        return server

    async def shut_down(server: asyncio.base_events.Server) -> None:
        server.close()
        others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    thread = threading.Thread(target=loop.run_forever, name="latency-proxy", daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(serve(), loop).result(timeout=10)
    ready.wait(10)
    try:
        yield f"http://127.0.0.1:{bound[0]}"
    finally:
        asyncio.run_coroutine_threadsafe(shut_down(server), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
