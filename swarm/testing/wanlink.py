"""An emulated wide-area link for benchmarks: a TCP relay that delays every byte by half a round trip each way and
passes at most a set bandwidth per direction. netem is not available on every kernel (not on ours); this needs
nothing but a port. A peer announces the relay's port (``--announce-maddrs``), so every connection to it crosses
the link. Or, ``--transparent PORT``: it takes the connections that nftables redirected to PORT (on a home host's
router, swarm.testing.netlab's ``detour``) and carries each on to where it was going, so one relay adds the delay
to every connection a host opens.

    python -m swarm.testing.wanlink --rtt-ms 100 --mbit 100 LISTEN_PORT:TARGET_PORT [...]
    python -m swarm.testing.wanlink --rtt-ms 50 --mbit 0 --transparent PORT
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import struct
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

CHUNK = 64 * 1024
SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h: where a redirected connection was going


@dataclass(frozen=True)
class Link:
    """One way of a link: a delay in seconds, and a rate in bytes per second (0: unlimited)."""

    delay: float
    rate: float

    @classmethod
    def of(cls, rtt_ms: float, mbit: float) -> Link:
        return cls(delay=rtt_ms / 2000, rate=mbit * 1e6 / 8)


async def _carry(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link) -> None:
    """Copy one direction: each chunk leaves once the link has had the time to send it (bandwidth), and arrives
    ``delay`` later, in order."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            arrive_at, data = await queue.get()
            if not data:
                break
            await asyncio.sleep(max(0.0, arrive_at - time.monotonic()))
            writer.write(data)
            await writer.drain()
        writer.close()

    delivery = asyncio.ensure_future(deliver())
    free_at = 0.0  # when the link has sent everything queued so far
    try:
        while data := await reader.read(CHUNK):
            now = time.monotonic()
            free_at = max(now, free_at) + (len(data) / link.rate if link.rate else 0.0)
            queue.put_nowait((free_at + link.delay, data))
    except ConnectionError:
        pass
    finally:
        queue.put_nowait((0.0, b""))
        try:
            await delivery
        except ConnectionError:
            pass


async def _relay(host: str, port: int, link: Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        target_reader, target_writer = await asyncio.open_connection(host, port)
    except OSError:
        writer.close()
        return
    await asyncio.gather(_carry(reader, target_writer, link), _carry(target_reader, writer, link))


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """The address a connection redirected by nftables (``redirect to``) was opened to."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)  # a struct sockaddr_in
    port, address = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(address), port


async def _relay_redirected(link: Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        host, port = original_destination(writer.get_extra_info("socket"))
    except OSError:  # not a redirected connection
        writer.close()
        return
    await _relay(host, port, link, reader, writer)


async def serve(ports: list[tuple[int, int]], link: Link, ready: asyncio.Event | None = None) -> None:
    """Relay each LISTEN port on 127.0.0.1 to its TARGET port, through ``link`` both ways, until cancelled."""
    servers = []
    for listen, target in ports:
        servers.append(
            await asyncio.start_server(lambda r, w, t=target: _relay("127.0.0.1", t, link, r, w), "127.0.0.1", listen)
        )
    await _serve_all(servers, ready)


async def serve_transparent(port: int, link: Link, ready: asyncio.Event | None = None) -> None:
    """Carry every connection redirected to ``port`` (any address) on to its original destination, through
    ``link`` both ways, until cancelled."""
    server = await asyncio.start_server(lambda r, w: _relay_redirected(link, r, w), "0.0.0.0", port)
    await _serve_all([server], ready)


async def _serve_all(servers: list[asyncio.Server], ready: asyncio.Event | None) -> None:
    logger.info("relaying on %s", ", ".join(str(s.sockets[0].getsockname()[1]) for s in servers))
    if ready is not None:
        ready.set()
    try:
        await asyncio.gather(*(server.serve_forever() for server in servers))
    finally:
        for server in servers:
            server.close()


def _port_pair(text: str) -> tuple[int, int]:
    listen, _, target = text.partition(":")
    try:
        return int(listen), int(target)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LISTEN_PORT:TARGET_PORT, got {text!r}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rtt-ms", type=float, default=100.0, help="round-trip time added (ms)")
    parser.add_argument("--mbit", type=float, default=100.0, help="bandwidth per direction (Mbit/s; 0: unlimited)")
    parser.add_argument("--transparent", type=int, metavar="PORT", help="relay connections redirected to PORT")
    parser.add_argument("ports", nargs="*", type=_port_pair, metavar="LISTEN_PORT:TARGET_PORT")
    args = parser.parse_args()
    if bool(args.ports) == (args.transparent is not None):
        parser.error("give LISTEN_PORT:TARGET_PORT pairs, or --transparent PORT")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    link = Link.of(args.rtt_ms, args.mbit)
    logger.info("link: rtt %.0f ms, %.0f Mbit/s, ports %s", args.rtt_ms, args.mbit, args.ports or args.transparent)
    try:
        asyncio.run(serve(args.ports, link) if args.ports else serve_transparent(args.transparent, link))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
