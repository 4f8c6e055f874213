"""A TCP relay that delays every byte by a fixed time in each direction.

This kernel has no `netem`, so tests and benchmarks (bench/spec_two_machines.py) add link
latency with this instead:
    python tests/pipeline/delay_relay.py LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT DELAY_MS
It prints "relay ready" once listening and runs until killed. Order is kept (one FIFO per
direction), throughput is not limited (shape it with tbf), and Nagle is off on both legs so a
small gRPC message is not held back beyond the delay.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    queue: asyncio.Queue = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if data is None:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.create_task(deliver())
    try:
        while data := await reader.read(1 << 16):
            queue.put_nowait((time.monotonic() + delay_s, data))
    except ConnectionError:
        pass
    queue.put_nowait((0.0, None))
    try:
        await sender
    except ConnectionError:
        pass


def _no_delay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def main(listen_host: str, listen_port: int, target_host: str, target_port: int, delay_ms: float) -> None:
    delay_s = delay_ms / 1000.0

    async def handle(client_reader, client_writer):
        try:
            server_reader, server_writer = await asyncio.open_connection(target_host, target_port)
        except OSError:
            client_writer.close()
            return
        _no_delay(client_writer)
        _no_delay(server_writer)
        await asyncio.gather(_pipe(client_reader, server_writer, delay_s), _pipe(server_reader, client_writer, delay_s),
                             return_exceptions=True)

    server = await asyncio.start_server(handle, listen_host, listen_port)
    print("relay ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    host, port, target_host, target_port, delay = sys.argv[1:6]
    asyncio.run(main(host, int(port), target_host, int(target_port), float(delay)))
