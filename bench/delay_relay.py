"""A TCP relay that delays every byte by a fixed time in each direction: a slow link for
benchmarks where the kernel has no netem (this machine's kernel lacks sch_netem).

    python bench/delay_relay.py --listen HOST:PORT --to HOST:PORT --delay-ms 0.5

Order is kept (one FIFO per direction), throughput is not limited (shape it with tbf if
needed), and Nagle is off on both legs so a small gRPC message is not held back.
Runs until killed; prints "relaying" once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    queue: asyncio.Queue = asyncio.Queue()

    async def deliver():
        while True:
            due, data = await queue.get()
            if data is None:
                break
            wait = due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.create_task(deliver())
    try:
        while data := await reader.read(65536):
            queue.put_nowait((time.perf_counter() + delay_s, data))
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


async def serve(listen: str, target: str, delay_s: float) -> None:
    to_host, to_port = target.rsplit(":", 1)

    async def handle(client_reader, client_writer):
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(to_host, int(to_port))
        except OSError:
            client_writer.close()
            return
        _no_delay(client_writer)
        _no_delay(upstream_writer)
        await asyncio.gather(pump(client_reader, upstream_writer, delay_s),
                             pump(upstream_reader, client_writer, delay_s))

    host, port = listen.rsplit(":", 1)
    server = await asyncio.start_server(handle, host, int(port))
    print("relaying", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", required=True)
    parser.add_argument("--to", required=True)
    parser.add_argument("--delay-ms", type=float, required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.listen, args.to, args.delay_ms / 1000))


if __name__ == "__main__":
    main()
