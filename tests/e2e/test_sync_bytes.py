"""Promise 12, sync traffic bounded by the adapter, on a real (namespaced) network: per training step, each peer's
link carries about one span's LoRA gradient (G) each way for the step's reduction, whatever the number of
micro-batches, not M(R-1)/R times it, with the audits on (issue 59).

Two spans of four blocks, the first of three replicas (its gradient reduced in chunks: 2(R-1)/R = 1.33 G each way,
peers/reduction/scatter.py), the second of two (a direct exchange: G each way), every peer alone on a host of its own
(its own network namespace and interface), no standby copies (copies are another promise's bytes); the client trains 16
micro-batches a step with LoRA r=32 on all seven projections (G = 2.5 MB per span, the micro-batches' hidden states
0.26 MB a hop), and reads every peer's interface counters around each step (swarm/testing/linkmeter.py). Bytes, not
times, are compared.

Audits are on at the peers' default rate (peers/reduction/audit.py): every fetched partial sum comes with 512 bytes of
sketch per micro-batch, and an audit, a quarter of the fetched sums, costs one micro-batch gradient of one block (G/4
here), whatever M. Before sketches an audit fetched the holder's micro-batch gradients of a block (up to 16 x G/4 here).
The median over seven steps is compared, with the hidden states' bytes allowed on top; one audit in the median step
fits.
"""

from __future__ import annotations

from pathlib import Path

from swarm.testing.linkmeter import MeterConfig, collect, start_client
from swarm.testing.localswarm import LocalSwarm
from swarm.testing.tiny import make_tiny_model

HIDDEN, INTERMEDIATE, BLOCKS, SPAN = 256, 688, 8, 4
CONFIG = MeterConfig(adapter="reduced", steps=7, warmup=1, batch=1, seq=16, micro_batches=16, lora_rank=32)
GOAL = 1.5  # Gs each way per peer and step
PEER_FLAGS = ["--leave-grace", "0.2", "--standby-blocks", "0", "--no-rebalance"]


def span_gradient_bytes() -> int:
    """G: one span's fp32 LoRA gradient, rank r on q, k, v, o (hidden -> hidden) and gate, up, down."""
    per_block = 4 * (HIDDEN + HIDDEN) + 3 * (HIDDEN + INTERMEDIATE)
    return SPAN * CONFIG.lora_rank * per_block * 4


def test_a_peers_link_carries_one_reduced_gradient_per_step_whatever_the_micro_batches(lab, tmp_path: Path):
    model = make_tiny_model(
        tmp_path / "model",
        layers=BLOCKS,
        hidden=HIDDEN,
        heads=4,
        kv_heads=4,
        intermediate=INTERMEDIATE,
        vocab=256,
        seed=0,
    )
    spans = {"a1": "0:4", "a2": "0:4", "a3": "0:4", "b1": "4:8", "b2": "4:8"}
    with LocalSwarm(tmp_path / "swarm") as local:
        bootstrap = lab.public("bootstrap")
        local.start_dht(host=bootstrap.ip, prefix=bootstrap.command())
        peers = {}
        for name, span in spans.items():
            host = lab.public(name)
            peers[name] = local.start_peer(
                model, span, name, PEER_FLAGS, wait=False, host="0.0.0.0", prefix=host.command()
            )
        for process in peers.values():
            process.wait_for_line("serving blocks", 180)
        watch = {name: process.pid for name, process in peers.items()}
        report = collect(start_client(local, lab.public("client"), model, CONFIG, "client", watch), timeout=300)

    g = span_gradient_bytes()
    hops = CONFIG.micro_batches * CONFIG.batch * CONFIG.seq * HIDDEN * 4 * 4  # hidden states and gradients, in + out
    rows = {name: report.median(name) for name in spans}
    figures = "; ".join(f"{name} in {c.rx / g:.2f} G, out {c.tx / g:.2f} G" for name, c in rows.items())
    means = {name: report.mean(name) for name in spans}
    figures += " (means: " + "; ".join(f"{n} {c.rx / g:.2f}/{c.tx / g:.2f}" for n, c in means.items()) + ")"
    print(f"G = {g / 1e6:.2f} MB, hidden states {hops / 1e6:.2f} MB per peer and step at most: {figures}")
    assert max(max(c.rx, c.tx) for c in rows.values()) >= 0.5 * g, f"no reduction seen on any link: {figures}"
    for name, counters in rows.items():
        assert counters.rx <= GOAL * g + hops, f"{name} received more than {GOAL} G a step: {figures}"
        assert counters.tx <= GOAL * g + hops, f"{name} sent more than {GOAL} G a step: {figures}"
