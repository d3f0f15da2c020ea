"""Promise 11, the trainer's link is not the swarm's bus, on a real (namespaced) network: the bytes through the
client's own interface per training step do not grow with the number of spans.

The lab (swarm/testing/netlab.py) has a public host with the bootstraps and every peer of two swarms side by side:
one peer serving every block (1 span), and 4 peers of one block each (4 spans). Three clients train at once, each
alone on a host of its own, counting the bytes through its interface around each step (swarm/testing/linkmeter.py):
on 1 span, on 4 spans chained, on 4 spans with client-driven hops. A step is 4 x 128 tokens of hidden 512 (1 MiB of
fp32 hidden states per tensor), so hidden states dominate what a link carries. Bytes, not times, are compared: a
loaded machine slows the steps, not the bytes.

And the home link of scripts/bench_wan.py's ``--home`` scenario (swarm/testing/homelab.py) is what it says: a delay
on every connection the client opens, its rates capped (lower bounds only, which a slow machine cannot break), and
every byte through.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from swarm.testing.homelab import HomeLab, HomeLinks
from swarm.testing.linkmeter import MeterConfig, collect, start_client
from swarm.testing.localswarm import LocalSwarm
from swarm.testing.tiny import make_tiny_model

HIDDEN, BLOCKS = 512, 4
CONFIG = MeterConfig(steps=2, warmup=1, batch=4, seq=128)  # bytes, not times: one measured step says it
GOAL = 1.5  # bytes with 4 spans / bytes with 1 span, chained
PEER_FLAGS = ["--leave-grace", "0.2"]  # nothing is in flight when the swarms close
PROBE = str(Path(__file__).with_name("link_probe.py"))


def test_the_client_link_carries_no_more_bytes_with_more_spans(lab, tmp_path: Path):
    model = make_tiny_model(
        tmp_path / "model", layers=BLOCKS, hidden=HIDDEN, heads=8, kv_heads=8, intermediate=1024, vocab=256, seed=0
    )
    peers_host = lab.public("swarm")
    with LocalSwarm(tmp_path / "one-span") as one, LocalSwarm(tmp_path / "four-spans") as four:
        for local, spans in ((one, [f"0:{BLOCKS}"]), (four, [f"{b}:{b + 1}" for b in range(BLOCKS)])):
            local.start_dht(host=peers_host.ip, prefix=peers_host.command())
            for index, span in enumerate(spans):
                local.start_peer(
                    model, span, f"peer{index}", PEER_FLAGS, wait=False, host="0.0.0.0", prefix=peers_host.command()
                )
        for process in one.processes[1:] + four.processes[1:]:
            process.wait_for_line("serving blocks", 180)
        hops = dataclasses.replace(CONFIG, adapter="client-driven", chain=False)
        clients = [
            start_client(local, lab.public(name), model, config, name)
            for local, config, name in ((one, CONFIG, "single"), (four, CONFIG, "chained"), (four, hops, "driven"))
        ]
        single, chained, driven = (collect(client, timeout=240).bytes_per_step for client in clients)

    figures = (
        f"client link bytes per step: 1 span {single / 1e6:.2f} MB; 4 spans chained {chained / 1e6:.2f} MB "
        f"({chained / single:.2f}x); 4 spans client-driven {driven / 1e6:.2f} MB ({driven / single:.2f}x)"
    )
    print(figures)
    hidden_states = CONFIG.micro_batches * CONFIG.batch * CONFIG.seq * HIDDEN * 4  # one fp32 tensor per micro-batch
    assert single >= 2 * hidden_states, f"the counters missed the hidden states in and out: {figures}"
    assert driven >= 2 * single, f"client-driven hops must carry every span's hidden states: {figures}"
    assert chained <= GOAL * single, f"chained: the client's link carries every span's hidden states: {figures}"


def test_the_home_link_delays_every_connection_and_caps_both_ways(lab, tmp_path: Path):
    links, size = HomeLinks(up_mbit=20, down_mbit=40, rtt_ms=50), 1_000_000
    with HomeLab(lab, links, peers=1, workdir=tmp_path) as home:
        server = subprocess.Popen(
            home.peers[0].command(sys.executable, PROBE, "serve", "9000"), stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout.readline().strip() == "serving"

            def probe() -> dict[str, float]:
                command = home.client.command(sys.executable, PROBE, "probe", home.peers[0].ip, "9000", str(size))
                done = subprocess.run(command, capture_output=True, text=True, timeout=60)
                assert done.returncode == 0, done.stderr[-2000:]
                return json.loads(done.stdout)

            home.shape(True)
            shaped = probe()
            home.shape(False)
            plain = probe()
        finally:
            server.kill()
            server.wait()
    print(f"home link probe of {size} bytes: shaped {shaped}; links off {plain}")
    for seen in (shaped, plain):
        assert seen["up_bytes"] == seen["down_bytes"] == size, seen
    assert shaped["ping"] >= links.rtt_ms / 1000, shaped
    assert shaped["up"] >= size / (links.up_mbit * 1e6 / 8), shaped
    assert shaped["down"] >= size / (links.down_mbit * 1e6 / 8), shaped
