"""Mistakes a newcomer makes on the command line get one clear line on stderr and exit status 2, no traceback,
before anything slow starts."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from swarm.net.security import Identity


def swarm_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "swarm", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def nobody() -> str:
    """A well-formed multiaddr of a peer that does not exist (nothing listens on port 1)."""
    return f"/ip4/127.0.0.1/tcp/1/p2p/{Identity.load_or_create(None).peer_id.to_base58()}"


def assert_clear_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("swarm ")]
    assert len(errors) == 1, result.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_a_missing_model_folder(nobody, tmp_path):
    result = swarm_cli("peer", "--model", str(tmp_path / "nonexistent"), "--initial-peers", nobody)
    assert_clear_error(result, "swarm peer:", str(tmp_path / "nonexistent"))


def test_a_malformed_multiaddr(tiny_models):
    result = swarm_cli("peer", "--model", str(tiny_models["llama"]), "--initial-peers", "garbage")
    assert_clear_error(result, "'garbage' is not a peer's multiaddr")
    assert_clear_error(swarm_cli("status", "--initial-peers", "/ip4/1.2.3.4/tcp/5"), "is not a peer's multiaddr")


def test_blocks_outside_the_model(nobody, tiny_models):
    result = swarm_cli("peer", "--model", str(tiny_models["llama"]), "--initial-peers", nobody, "--blocks", "0:99")
    assert_clear_error(result, "--blocks 0:99", "0:4")


def test_a_bad_swarm_key_file(nobody, tiny_models, tmp_path):
    key = tmp_path / "swarm.key"
    key.write_text("not a key\n")
    result = swarm_cli("peer", "--model", str(tiny_models["llama"]), "--initial-peers", nobody, "--swarm-key", str(key))
    assert_clear_error(result, str(key), "swarm keygen")


def test_unreachable_initial_peers(nobody, tiny_models):
    model = str(tiny_models["llama"])
    result = swarm_cli("peer", "--model", model, "--initial-peers", nobody, "--blocks", "0:2", "--join-timeout", "0")
    assert_clear_error(result, "none of the initial peers answered", nobody, "swarm dht")


def test_bad_announce_addresses_and_a_port_in_use(nobody, tiny_models):
    model = str(tiny_models["llama"])
    result = swarm_cli("peer", "--model", model, "--initial-peers", nobody, "--announce-maddrs", "not-a-maddr")
    assert_clear_error(result, "--announce-maddrs 'not-a-maddr' is not a TCP multiaddr")
    result = swarm_cli("dht", "--announce-maddrs", "/ip4/203.0.113.5/tcp/0")
    assert_clear_error(result, "needs an explicit TCP port")
    assert_clear_error(swarm_cli("dht", "--public-ip", "203.0.113.5"), "--public-ip needs a fixed --port")
    assert_clear_error(swarm_cli("dht", "--public-ip", "home", "--port", "31337"), "'home' is not an IPv4 or IPv6")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = swarm_cli("peer", "--model", model, "--initial-peers", nobody, "--host", "127.0.0.1", "--port", port)
        assert_clear_error(result, f"cannot listen on 127.0.0.1:{port}", "pick another --port")


def test_convert_gguf_refuses_what_it_cannot_convert(tiny_models, tmp_path):
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip, not a gguf")
    assert_clear_error(swarm_cli("convert-gguf", str(not_gguf), str(tmp_path / "out")), "is not a GGUF file")
    assert_clear_error(swarm_cli("convert-gguf", str(tmp_path / "missing.gguf"), str(tmp_path / "out")), "not exist")
    gguf = tmp_path / "real.gguf"
    gguf.write_bytes(b"GGUF")
    taken = swarm_cli("convert-gguf", str(gguf), str(tiny_models["llama"]))
    assert_clear_error(taken, "already holds a model")


def test_the_commands_that_serve_no_blocks_do_not_import_the_model_stack():
    """``swarm dht``, ``status``, ``monitor`` and ``keygen`` need hivemind, not peft and transformers: importing them
    from the command line took a bootstrap node 7 s to start instead of 3 here (every restart of a bootstrap node,
    every ``swarm status``)."""
    probe = "import sys, swarm.ops.cli; print(sorted(m for m in ('peft', 'transformers') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
