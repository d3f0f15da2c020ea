"""One training recipe for every fault test: same data, same LoRA, a reference from local peft, digest checks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import peft
import torch
from safetensors.torch import load_file

import swarm
from swarm.testing.localswarm import LocalSwarm, Process

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "up_proj"])
HPARAMS = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
STEPS, MICRO_BATCHES = 4, 2


def batches_for_step(step: int, vocab: int = 256) -> list[dict[str, torch.Tensor]]:
    """Deterministic data for step ``step``: a restarted client gets the same batches for the same step."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(MICRO_BATCHES):
        ids = torch.randint(0, vocab, (2, 12), generator=g)
        out.append(dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids))
    return out


def start_swarm(
    local: LocalSwarm, model_dir: Path, spans: dict[str, str], extra: list[str] | None = None
) -> dict[str, Process]:
    """Bootstrap + one peer per name -> START:END, started in parallel; returns once all serve."""
    local.start_dht()
    peers = {
        name: local.start_peer(model_dir, blocks, name=name, extra=extra, wait=False) for name, blocks in spans.items()
    }
    for peer in peers.values():
        peer.wait_for_line("serving blocks", 180)
    return peers


def start_replicated_swarm(local: LocalSwarm, model_dir: Path) -> dict[str, Process]:
    """Two replicas of each half of the tiny model's 4 blocks."""
    return start_swarm(local, model_dir, {"a1": "0:2", "a2": "0:2", "b1": "2:4", "b2": "2:4"})


def start_client(
    local: LocalSwarm, model_dir: Path, out: Path, name: str, adapter: str, *extra: str, prefix: list[str] = ()
) -> subprocess.Popen:
    """tests/train_client.py as its own process (so it can be SIGKILLed), training ``adapter`` to step 4; after
    ``prefix`` if given (``ip netns exec NS``)."""
    log = open(out / f"{name}.log", "wb")
    args = [
        *prefix,
        sys.executable,
        str(Path(__file__).with_name("train_client.py")),
        "--model",
        str(model_dir),
        "--initial-peers",
        *local.initial_peers,
        "--adapter",
        adapter,
        "--steps",
        "4",
        "--out",
        str(out),
        *extra,
    ]
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish_client(client: subprocess.Popen, log: Path, timeout: float = 240) -> str:
    """Wait for a client to exit 0 (killing it if it does not) and return its log."""
    try:
        assert client.wait(timeout) == 0, log.read_text()[-3000:]
    finally:
        if client.poll() is None:
            os.killpg(client.pid, signal.SIGKILL)
    return log.read_text()


def wait_for_text(log: Path, needle: str, process: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while needle not in (log.read_text() if log.exists() else ""):
        assert process.poll() is None, f"client exited early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"client never printed {needle!r}:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def connect(local: LocalSwarm, model_dir: Path, adapter: str, **kwargs) -> swarm.SwarmModelForCausalLM:
    return swarm.SwarmModelForCausalLM.from_pretrained(
        model_dir,
        initial_peers=local.initial_peers,
        adapter=adapter,
        lora_config=peft.LoraConfig(**LORA),
        seed=11,
        **kwargs,
    )


Hook = Callable[[str, str, int], None]


def instrument(model: swarm.SwarmModelForCausalLM, hook: Hook) -> None:
    """Call ``hook(method, peer_id, step)`` just before each request the client sends (to time a fault)."""
    original = model.session.calls.call

    def call(peer, meta, tensors, *args, **kwargs):
        hook(meta["method"], peer.to_base58(), model.step)
        return original(peer, meta, tensors, *args, **kwargs)

    model.session.calls.call = call


def assert_replicas_identical(model: swarm.SwarmModelForCausalLM) -> None:
    digests = model.replica_digests()
    assert sorted(digests) == list(range(model.spec.num_blocks)), digests
    for block, by_peer in digests.items():
        assert len(set(by_peer.values())) == 1, f"replicas of block {block} differ after step {model.step}: {by_peer}"


def train(
    model: swarm.SwarmModelForCausalLM, steps: int = STEPS, check_replicas: bool = True, pipelined: bool = False
) -> list[float]:
    """The training loop of every fault test: accumulate MICRO_BATCHES (one after the other, or all in flight at
    once with ``pipelined``), commit, check replicas agree."""
    optimizer = swarm.RemoteOptimizer(model, **HPARAMS)
    losses = []
    while model.step < steps:
        if pipelined:
            losses.append(model.train_step(batches_for_step(model.step), max_in_flight=MICRO_BATCHES).item())
        for batch in [] if pipelined else batches_for_step(model.step):
            out = model(**batch)
            (out.loss / MICRO_BATCHES).backward()
            losses.append(out.loss.item())
        optimizer.step()
        optimizer.zero_grad()
        if check_replicas:
            assert_replicas_identical(model)
    return losses


def reference_adapter(model_dir: Path, initial_adapter: Path, out: Path, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The failure-free result: the same recipe trained locally with transformers + peft (parity is tested)."""
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model = peft.PeftModel.from_pretrained(base, initial_adapter, is_trainable=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **HPARAMS)
    for step in range(steps):
        for batch in batches_for_step(step):
            (model(**batch).loss / MICRO_BATCHES).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out)
    return load_file(out / "adapter_model.safetensors")


def assert_matches_local_peft(model_dir: Path, tmp_path: Path, steps: int = STEPS) -> None:
    """``tmp_path/final`` (the swarm's adapter) equals local peft trained from ``tmp_path/initial``."""
    reference = reference_adapter(model_dir, tmp_path / "initial", tmp_path / "reference", steps)
    state = load_file(tmp_path / "final" / "adapter_model.safetensors")
    assert state.keys() == reference.keys()
    for key in state:
        torch.testing.assert_close(state[key], reference[key], rtol=1e-4, atol=1e-5, msg=key)


def moved_to(*peers: Process, span: str, timeout: float = 30) -> list[Process]:
    """The peers that finished moving to ``span`` (a move completes a grace period after it is announced)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        movers = [p for p in peers if f"now serving blocks {span}" in p.log.read_text()]
        if movers:
            return movers
        time.sleep(0.2)
    return []


def swarm_status(local: LocalSwarm, prefix: list[str] = ()) -> str:
    """What `swarm status` prints for this swarm, run as a user runs it (after ``prefix``: elsewhere)."""
    status = subprocess.run(
        [*prefix, sys.executable, "-m", "swarm", "status", "--initial-peers", *local.initial_peers],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert status.returncode == 0, status.stderr
    return status.stdout
