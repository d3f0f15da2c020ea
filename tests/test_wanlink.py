"""The emulated WAN link of the benchmarks: bytes arrive intact, in order, no sooner than the link allows."""

from __future__ import annotations

import asyncio
import os
import time

from swarm.wanlink import Link, serve


def test_the_link_delays_and_limits_both_ways_and_keeps_every_byte():
    async def scenario() -> tuple[bytes, bytes, float]:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.close()

        target = await asyncio.start_server(echo, "127.0.0.1", 0)
        target_port = target.sockets[0].getsockname()[1]
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        listen = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        ready = asyncio.Event()
        link = asyncio.ensure_future(serve([(listen, target_port)], Link.of(rtt_ms=100, mbit=8), ready))
        await ready.wait()
        payload = os.urandom(300_000)
        started = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", listen)
        writer.write(payload)
        await writer.drain()
        received = await reader.readexactly(len(payload))
        elapsed = time.monotonic() - started
        writer.close()
        link.cancel()
        target.close()
        return payload, received, elapsed

    sent, received, elapsed = asyncio.run(scenario())
    assert received == sent
    # 300 kB at 1 MB/s each way (pipelined: at least once) plus one round trip of 100 ms
    assert elapsed >= 0.3 + 0.1, elapsed
