"""One training recipe for tests of failures: the same data, LoRA, global gradient clipping and AdamW, a reference
from local peft, and a check that replicas agree. Whatever the swarm (real processes or in-process peers), a run with
faults must end equal to local peft trained on the same data: exactly once, nothing lost, nothing applied twice."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import peft
import torch
from safetensors.torch import load_file

import swarm

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "up_proj"])
HPARAMS = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
STEPS, MICRO_BATCHES = 4, 2
MAX_GRAD_NORM = 0.5  # global clipping, as Trainer's recipes do (max_grad_norm); it engages on this data


class Joinable(Protocol):
    """A swarm a client can join (LocalSwarm, InProcessSwarm)."""

    initial_peers: list[str]


def batches_for_step(step: int, vocab: int = 256) -> list[dict[str, torch.Tensor]]:
    """Deterministic data for step ``step``: a restarted client gets the same batches for the same step."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(MICRO_BATCHES):
        ids = torch.randint(0, vocab, (2, 12), generator=g)
        out.append(dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids))
    return out


def connect(local: Joinable, model_dir: Path, adapter: str, **kwargs) -> swarm.SwarmModelForCausalLM:
    return swarm.SwarmModelForCausalLM.from_pretrained(
        model_dir,
        initial_peers=local.initial_peers,
        adapter=adapter,
        lora_config=peft.LoraConfig(**LORA),
        seed=11,
        **kwargs,
    )


def assert_replicas_identical(model: swarm.SwarmModelForCausalLM) -> None:
    digests = model.replica_digests()
    assert sorted(digests) == list(range(model.spec.num_blocks)), digests
    for block, by_peer in digests.items():
        assert len(set(by_peer.values())) == 1, f"replicas of block {block} differ after step {model.step}: {by_peer}"


def train(
    model: swarm.SwarmModelForCausalLM, steps: int = STEPS, check_replicas: bool = True, pipelined: bool = False
) -> list[float]:
    """The training loop of every fault test: accumulate MICRO_BATCHES (one after the other, or all in flight at
    once with ``pipelined``), clip, commit, check replicas agree."""
    optimizer = swarm.RemoteOptimizer(model, **HPARAMS)
    losses = []
    while model.step < steps:
        if pipelined:
            batches = batches_for_step(model.step)
            losses.append(model.train_step(batches, MICRO_BATCHES, max_in_flight=MICRO_BATCHES).item())
        for batch in [] if pipelined else batches_for_step(model.step):
            out = model(**batch)
            (out.loss / MICRO_BATCHES).backward()
            losses.append(out.loss.item())
        model.clip_grad_norm_(MAX_GRAD_NORM)
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
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, **HPARAMS)
    for step in range(steps):
        for batch in batches_for_step(step):
            (model(**batch).loss / MICRO_BATCHES).backward()
        torch.nn.utils.clip_grad_norm_(trainable, MAX_GRAD_NORM)
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
