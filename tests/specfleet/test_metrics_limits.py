"""The /metrics endpoint against hostile clients: real sockets, the real server (specfleet.metrics.serve)."""

from __future__ import annotations

import asyncio
import socket
import time

from prometheus_client import CollectorRegistry, Counter

from specfleet import metrics


async def _exchange(port: int, data: bytes, read_timeout: float = 10.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout=read_timeout)
    finally:
        writer.close()


def test_metrics_endpoint_bounds_slow_clients_long_lines_and_connections():
    async def run():
        registry = CollectorRegistry()
        Counter("specfleet:probe", "A sample to scrape.", registry=registry).inc()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        server = await metrics.serve(sock, registry, deadline_s=1.0, max_connections=4)
        try:
            scrape = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
            assert b"specfleet:probe_total 1.0" in await _exchange(port, scrape)

            # A header line over 64 KB: a 4xx answer, and the server keeps serving.
            reply = await _exchange(port, b"GET /metrics HTTP/1.1\r\nX-Long: " + b"a" * 70_000 + b"\r\n\r\n")
            assert reply.startswith(b"HTTP/1.1 431"), reply[:80]
            reply = await _exchange(port, b"GET /" + b"b" * 70_000 + b" HTTP/1.1\r\n\r\n")
            assert reply.startswith(b"HTTP/1.1 431"), reply[:80]

            # A client that trickles headers, one line every 0.3 s, is cut off at the request deadline.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            started = time.monotonic()
            writer.write(b"GET /metrics HTTP/1.1\r\n")
            closed = False
            for _ in range(20):
                try:
                    writer.write(b"X-Slow: 1\r\n")
                    await writer.drain()
                except ConnectionError:
                    closed = True
                    break
                if reader.at_eof() or await _eof_within(reader, 0.3):
                    closed = True
                    break
            writer.close()
            assert closed and time.monotonic() - started < 3.0, "a slow client held its connection past the deadline"

            # Idle connections beyond the cap are answered 503 at once; the first ones time out; scrapes work again.
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
            await asyncio.sleep(0.1)
            assert (await _exchange(port, scrape, read_timeout=2.0)).startswith(b"HTTP/1.1 503")
            await asyncio.sleep(1.2)
            assert b"specfleet:probe_total 1.0" in await _exchange(port, scrape)
            for _, w in held:
                w.close()
            await asyncio.sleep(1.2)  # the server's side of them ends at its deadline
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(run())


async def _eof_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), timeout=seconds) == b""
    except asyncio.TimeoutError:
        return False
