"""The two commands a user runs: `swarm dht` prints its addresses; `swarm peer` announces, serves and leaves."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import psutil

from peers.announcer import Announcer
from peers.config import PeerConfig
from peers.movelog import MoveLog
from peers.standing import Standing
from swarm.net.network import join_dht
from swarm.net.records import ServerState, read_servers
from swarm.net.security import Identity
from swarm.spec import load_spec
from swarm.testing.localswarm import LEAVING, LocalSwarm


def test_dht_prints_multiaddrs_and_peer_announces_then_leaves_cleanly(tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    name = load_spec(model_dir).name
    with LocalSwarm(tmp_path, forks=None) as local:  # `python -m swarm` exec'd, as a user starts it (no fork server)
        dht_process = local.start_dht()
        lines = [ln for ln in dht_process.log.read_text().splitlines() if ln.startswith("/")]
        assert lines and all(ln.startswith(("/ip4/", "/ip6/")) and "/p2p/" in ln for ln in lines)
        peer = local.start_peer(model_dir, "1:3")
        observer = join_dht(local.initial_peers, Identity.load_or_create(None), None, client_mode=True)
        try:
            servers = read_servers(observer, name, 4)
            assert [len(servers[b]) for b in range(4)] == [0, 1, 1, 0]
            assert servers[1][0].state == ServerState.ONLINE and servers[1][0].throughput > 0
            peer.signal(signal.SIGTERM)
            states = set()
            deadline = time.monotonic() + 30
            while peer.popen.poll() is None and time.monotonic() < deadline:
                states.update(r.state for r in read_servers(observer, name, 4)[1])
                time.sleep(0.2)
            assert peer.popen.wait(30) == 0
            assert ServerState.LEAVING in states, "the peer did not announce that it was leaving"
            assert "left the swarm" in peer.log.read_text()
        finally:
            observer.shutdown()


def test_a_peer_that_gives_up_blocks_it_announced_as_joining_withdraws_them(tiny_models, tmp_path):
    """Chaos finding: a peer that switched spans while choosing (or aborted a move) left its joining records on the
    blocks it gave up; until they expired they counted as a server to come, and the balancer moved real servers
    away from blocks nobody would serve."""
    model_dir = tiny_models["llama"]
    name = load_spec(model_dir).name
    with LocalSwarm(tmp_path) as local:
        local.start_dht()
        config = PeerConfig(model=str(model_dir), initial_peers=local.initial_peers, num_blocks=2)
        identity, now = Identity.load_or_create(None), Standing()
        dht = join_dht(local.initial_peers, identity, None, host="127.0.0.1")
        announcer = Announcer(dht, config, load_spec(model_dir), identity, now, max_blocks=2, moves=MoveLog())
        observer = join_dht(local.initial_peers, Identity.load_or_create(None), None, client_mode=True)
        try:

            def states() -> dict[int, set[ServerState]]:
                servers = read_servers(observer, name, 4)
                return {b: {r.state for r in servers[b] if r.peer_id == identity.peer_id} for b in range(4)}

            now.joining = range(1, 3)
            asyncio.run(announcer.announce())
            assert states() == {0: set(), 1: {ServerState.JOINING}, 2: {ServerState.JOINING}, 3: set()}
            asyncio.run(announcer.withdraw([1]))  # what Mover.choose_span does when it switches to 2:4
            now.joining = range(2, 4)
            asyncio.run(announcer.announce())
            assert states() == {0: set(), 1: {ServerState.LEAVING}, 2: {ServerState.JOINING}, 3: {ServerState.JOINING}}
        finally:
            observer.shutdown()
            dht.shutdown()


SIGNALS = [(sig, target) for sig in (signal.SIGTERM, signal.SIGINT) for target in ("process-group", "process")]


def test_a_peer_exits_on_sigterm_or_sigint_to_it_or_to_its_whole_process_group(tiny_models, tmp_path):
    """Sent to the group (systemd's stop, ``kill -- -PGID``), the signal stops the peer's P2P daemon and DHT
    process too: the peer must exit anyway, within its leave grace plus a bound. One peer per signal and target,
    started and signalled together (one swarm for the four cases: each peer costs its imports, not a swarm). Exec'd
    as a user starts them, not forked: what a signal does to a process group is what this test is about. A fifth,
    told twice (Ctrl-C again while it leaves), skips the rest of a grace longer than the test waits."""
    with LocalSwarm(tmp_path, forks=None) as local:
        local.start_dht()
        names = {f"{sig.name.lower()}-{target}": (sig, target) for sig, target in SIGNALS}
        twice = local.start_peer(tiny_models["llama"], "0:2", name="twice", extra=["--leave-grace", "300"], wait=False)
        peers = local.start_peers(tiny_models["llama"], dict.fromkeys(names, "0:2"), extra=["--leave-grace", "1"])
        twice.wait_for_line("serving blocks", 120)
        twice.signal(signal.SIGTERM)
        twice.wait_for_line(LEAVING, 30)
        twice.signal(signal.SIGINT)
        for name, (sig, target) in names.items():
            (os.killpg if target == "process-group" else os.kill)(peers[name].pid, sig)
        for name, (sig, target) in names.items():
            peer = peers[name]
            try:
                code = peer.popen.wait(40)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the peer did not exit after {sig!r} to its {target}:\n{peer.tail()}") from None
            assert code in (0, -sig), (name, peer.tail())
            if target == "process":
                assert code == 0 and "left the swarm" in peer.log.read_text(), (name, peer.tail())
        assert twice.popen.wait(60) == 0, twice.tail()
        assert "told again: leaving without waiting out the grace" in twice.log.read_text(), twice.tail()


def test_a_peer_killed_alone_leaves_nothing_behind_and_restarts_under_its_identity(tiny_models, tmp_path):
    """The OOM killer SIGKILLs the peer's own process, not its group. The DHT process and p2pd it started must end
    too: left running, they kept its identity alive in the swarm and every restart was refused as a second process
    with that identity."""
    extra = ["--identity", str(tmp_path / "peer.key"), "--leave-grace", "1"]
    with LocalSwarm(tmp_path) as local:
        local.start_dht()
        peer = local.start_peer(tiny_models["llama"], "0:4", name="first", extra=extra)
        children = psutil.Process(peer.pid).children(recursive=True)
        assert any("p2pd" in c.name() for c in children), [c.name() for c in children]
        os.kill(peer.pid, signal.SIGKILL)
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"left running after the peer was killed: {[(c.pid, c.name()) for c in alive]}"
        local.start_peer(tiny_models["llama"], "0:4", name="restarted", extra=extra, timeout=120)
