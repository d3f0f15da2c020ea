"""Memory that does not grow: a loopback swarm in every role a peer can have (only server and chain head, replicas and
chain tails, standby holders, a relayed peer and its relay) trains 1000 steps of one micro-batch while every process
tree is sampled; from the middle of the run to its end no tree may gain more than a small fixed slack of resident
memory, nor open files or threads. The first half is the allocators' warm-up: peers' processes grow a few MB over
their first ~500 steps, then stay within 3 MB (docs/benchmarks/memory.md, "Memory over thousands of steps").
``scripts/bench_soak.py`` runs it for thousands of steps at two widths."""

from __future__ import annotations

import pytest

from swarm.testing.soak import SoakConfig, run_soak

STEPS = 1000
# What an allocator may still take between the middle and the end (fragmentation, an arena added): up to 2.9 MB was
# measured there. A forward graph's input branch kept per micro-batch, as peers once kept it, is ~33 KB at these
# shapes: 16 MB over the second half.
# Slower leaks (the DHT's heap entry per rewrite of the committed step was ~1 KB a step) need the bench's thousands
# of steps to show; tests/unit/test_dht_storage.py holds that one.
RSS_SLACK = 10 << 20
FILES_SLACK = 8  # connections come and go (the relay's, the DHT's)
THREADS_SLACK = 4


@pytest.mark.slow
@pytest.mark.timeout(1200)  # ~3.5 minutes alone on 2 cores; beside busy processes, twice that
def test_no_process_grows_over_1000_steps(tiny_models, tmp_path):
    config = SoakConfig(steps=STEPS, sample_every=50, micro_batches=1)
    result = run_soak(tiny_models["llama"], tmp_path, config, progress=False)
    print(result.table())  # shown with -rA or on failure: the figures behind the verdict
    middle, end = result.at_middle(), result.samples[-1]
    assert end.step == STEPS and middle.step == STEPS // 2
    for name in result.roles:
        grown = result.growth_per_1000(name) * (end.step - middle.step) / 1000
        assert grown <= RSS_SLACK, f"{name} grew {grown / 2**20:.1f} MiB from step {middle.step}:\n{result.table()}"
        before, after = middle.usage[name], end.usage[name]
        assert after.fds - before.fds <= FILES_SLACK, f"{name} keeps files open:\n{result.table()}"
        assert after.threads - before.threads <= THREADS_SLACK, f"{name} keeps threads:\n{result.table()}"
    for name, size in end.checkpoint_bytes.items():
        assert size <= 2 * middle.checkpoint_bytes[name], f"{name}'s checkpoints grow:\n{result.table()}"
