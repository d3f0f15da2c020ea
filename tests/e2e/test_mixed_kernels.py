"""Promise 13, honest hardware is not a liar: replicas whose torch runs other CPU kernels (``ATEN_CPU_CAPABILITY=
default``, as on an older CPU; a GPU beside a CPU differs the same way) serve beside native ones and stay bit-identical,
so the replicas' exact vote never stops training and nobody is named dishonest; a standby copy brought forward on the
other kernel set resumes its span, and the adapter equals local peft within fp32 rounding; on a wire of changes since a
sample's last pass, both kernel sets reconstruct the same references, so no change is refused."""

from __future__ import annotations

import math
import signal

import torch
from failover_helpers import (
    HPARAMS,
    STEPS,
    assert_matches_local_peft,
    connect,
    train,
)
from test_takeover import wait_standby_current

import swarm
from swarm.testing.localswarm import LocalSwarm

OTHER_KERNELS = {"ATEN_CPU_CAPABILITY": "default"}
PINNED = ["--balance-interval", "1", "--no-rebalance"]  # spans stay put: a relief move would change the roles
NO_COPIES = [*PINNED, "--standby-blocks", "0"]


def test_replicas_on_other_kernels_agree_and_a_copy_brought_forward_on_them_resumes_the_span(tiny_models, tmp_path):
    """0:2 on a native and a default-kernel replica; 2:4 on three replicas, the middle one on default kernels and the
    only peer keeping standby copies of 0:2, which it brings forward itself from each commit's update. The client
    connects while the peers load. After two steps both servers of 0:2 are SIGKILLed and a fresh native peer starts
    on 0:2: the only state left is the default-kernel copy, the fresh peer resumes from it, and training goes on to
    the end with nothing lost, every step's replicas equal to the bit, nobody dishonest, equal to local peft."""
    model_dir = tiny_models["llama"]
    with LocalSwarm(tmp_path / "swarm") as local:
        local.start_dht()
        spans = {"a-native": ("0:2", PINNED, None), "a-default": ("0:2", PINNED, OTHER_KERNELS)}
        spans |= {"b-native": ("2:4", NO_COPIES, None), "b-default": ("2:4", PINNED, OTHER_KERNELS)}
        spans |= {"b-native-2": ("2:4", NO_COPIES, None)}
        peers = {
            name: local.start_peer(model_dir, span, name=name, extra=extra, wait=False, env=env)
            for name, (span, extra, env) in spans.items()
        }
        model = connect(local, model_dir, adapter="mixed-kernels", patience=180)
        try:
            native = torch.backends.cpu.get_cpu_capability()
            for name, peer in peers.items():
                kernels = "DEFAULT" if "default" in name else native
                assert f"{kernels} CPU kernels" in peer.wait_for_line("tokens/s (torch", 60), peer.tail()
            model.save_adapter(tmp_path / "initial")
            train(model, steps=2)  # every step: each block's replicas vote, and must agree to the bit
            for peer in peers.values():  # a peer measured its speed before it took its state and served (CI: later)
                peer.wait_for_line("serving blocks", 120)
            wait_standby_current(model, [peers["b-default"]], [0, 1])
            for name in ("a-native", "a-default"):
                peers[name].signal(signal.SIGKILL)
            local.start_peer(model_dir, "0:2", name="a-fresh", extra=PINNED, wait=False)
            train(model, steps=STEPS)
            assert model.steps_lost == []
            assert model.dishonest == []
            model.save_adapter(tmp_path / "final")
        finally:
            model.shutdown()
    assert_matches_local_peft(model_dir, tmp_path)


def test_a_delta_wire_across_replicas_on_other_kernels_refuses_no_change_and_outlives_a_sigkill(tiny_models, tmp_path):
    """compression="hadamard4d3" (hidden states as changes since a sample's last pass): 2:4 served by a native and a
    default-kernel replica, the client connected while the peers load, the same two micro-batches every step (epochs).
    Both kernel sets reconstruct every change to the same bits, so no change is ever refused, whichever replica the
    routes take; after the native replica is SIGKILLed the steps go on through the other, still sending changes, with
    nothing lost and nobody dishonest."""
    model_dir = tiny_models["llama"]
    g = torch.Generator().manual_seed(21)
    batches = [dict(input_ids=ids, labels=ids) for ids in (torch.randint(0, 256, (2, 16), generator=g) for _ in "xy")]
    with LocalSwarm(tmp_path / "swarm") as local:
        local.start_dht()
        spans = {"a": ("0:2", NO_COPIES, None), "b-native": ("2:4", NO_COPIES, None)}
        spans |= {"b-default": ("2:4", NO_COPIES, OTHER_KERNELS)}
        peers = {
            name: local.start_peer(model_dir, span, name=name, extra=extra, wait=False, env=env)
            for name, (span, extra, env) in spans.items()
        }
        sent: list = []

        def call(peer, message, send):
            if message.meta.get("method") == "forward":
                sent.append(message.meta.get("delta"))
            return send(message)

        model = connect(
            local,
            model_dir,
            adapter="delta-kernels",
            patience=180,
            wire_dtype="bfloat16",
            compression="hadamard4d3",
            call_hook=call,
        )
        try:
            optimizer = swarm.RemoteOptimizer(model, **HPARAMS)
            losses = []
            for step in range(6):
                if step == 3:
                    peers["b-native"].signal(signal.SIGKILL)
                losses.append(model.train_step(batches).item())
                optimizer.step()
            assert model.step == 6 and all(math.isfinite(loss) for loss in losses)
            assert model.steps_lost == [] and model.dishonest == []
        finally:
            model.shutdown()
    changes = [header for header in sent if header is not None and header[0] is not None]
    assert len(changes) >= 2 * 4, f"every pass after a sample's first sends a change: {sent}"
    for name, peer in peers.items():
        log = peer.log.read_text(errors="replace")
        assert "a change of activations from a reference" not in log, f"{name} refused a change:\n{peer.tail()}"
