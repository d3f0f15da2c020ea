"""Speed over real links: the emulated WAN link of the benchmarks, and lanes (large messages over parallel calls)."""

from __future__ import annotations

import asyncio
import os
import time

from swarm.testing.wanlink import Link, serve


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


def test_a_message_spread_over_lanes_comes_back_whole():
    """swarm.net.lanes: a large message in chunks over parallel calls, reassembled in order whatever order the lanes
    arrive in; lanes that disagree are refused."""
    import pytest
    import torch

    from swarm.net import lanes
    from swarm.net.wire import Message, WireError, decode, encode

    tensors = [torch.randn(4, 64, 256), torch.ones(4, 64, dtype=torch.int64)]
    parts = encode(Message({"method": "forward"}, tensors), chunk_bytes=lanes.chunk_bytes(300_000))
    packed = lanes.pack(parts, len(parts) - 1, "id")
    assert len(packed) >= 2 and all(lane.ByteSize() <= lanes.LANE_BYTES + 4096 for lane in packed)
    back = decode(lanes.unpack(list(reversed(packed))))
    assert back.meta == {"method": "forward"} and all(
        torch.equal(a, b) for a, b in zip(back.tensors, tensors, strict=True)
    )
    few = lanes.pack(encode(Message({"x": 1}, [])), 3)  # a short reply over three lanes: two carry nothing
    assert decode(lanes.unpack(few)).meta == {"x": 1}
    with pytest.raises(WireError):
        lanes.unpack(packed[:-1])
