"""Both ends of a probe of an emulated link, as processes of their own (each runs in a lab host's namespace). No
half-closed connections: the relay of swarm.testing.wanlink closes a connection once either side has finished.

    python link_probe.py serve PORT             # "p": one byte back; "u" + size + bytes: their count; "d" + size
    python link_probe.py probe HOST PORT BYTES  # one JSON line: seconds for a ping, an upload, a download
"""

from __future__ import annotations

import json
import socket
import sys
import time

PING, UP, DOWN = b"p", b"u", b"d"
SIZE_DIGITS = 12


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    parts, left = [], size
    while left and (data := conn.recv(min(left, 1 << 16))):
        parts.append(data)
        left -= len(data)
    return b"".join(parts)


def serve(port: int) -> None:
    with socket.create_server(("0.0.0.0", port)) as server:
        print("serving", flush=True)
        while True:
            conn, _ = server.accept()
            with conn:
                kind = _read_exactly(conn, 1)
                if kind == PING:
                    conn.sendall(b"x")
                    continue
                size = int(_read_exactly(conn, SIZE_DIGITS))
                if kind == UP:
                    conn.sendall(str(len(_read_exactly(conn, size))).encode())
                elif kind == DOWN:
                    conn.sendall(b"y" * size)


def _timed(host: str, port: int, request: bytes, reply_size: int) -> tuple[float, bytes]:
    """Seconds from sending ``request`` to the last of ``reply_size`` bytes back (fewer if the server closes)."""
    with socket.create_connection((host, port)) as conn:
        started = time.monotonic()
        conn.sendall(request)
        reply = _read_exactly(conn, reply_size)
        return time.monotonic() - started, reply


def probe(host: str, port: int, size: int) -> None:
    header = str(size).zfill(SIZE_DIGITS).encode()
    ping, _ = _timed(host, port, PING, 1)
    up, counted = _timed(host, port, UP + header + b"z" * size, len(str(size)))
    down, received = _timed(host, port, DOWN + header, size)
    print(json.dumps({"ping": ping, "up": up, "down": down, "up_bytes": int(counted), "down_bytes": len(received)}))


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    else:
        probe(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
