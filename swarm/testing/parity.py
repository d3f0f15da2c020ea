"""The recipe of the parity tests (promise 1): LoRA on every projection, AdamW with weight decay, padded batches, the
plain accumulation loop, local transformers + peft as the reference, and a record of what backwards carried."""

from __future__ import annotations

from pathlib import Path

import peft
import torch
import transformers
from hivemind.p2p import PeerID

from swarm.client.calls import Send
from swarm.net.message import Message
from swarm.net.protocol import Method, method_of
from swarm.spec import attention_implementation
from swarm.testing.faults import CallTap

LORA = dict(
    r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
)
HPARAMS = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
STEPS, MICRO_BATCHES = 5, 2


def make_batches(vocab: int, seed: int = 0) -> list[list[dict[str, torch.Tensor]]]:
    """The same MICRO_BATCHES batches at each of STEPS steps (so the loss must fall), with right padding in one row."""
    g = torch.Generator().manual_seed(seed)
    micro = []
    for _ in range(MICRO_BATCHES):
        ids = torch.randint(0, vocab, (2, 12), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 9:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        micro.append(dict(input_ids=ids, attention_mask=mask, labels=labels))
    return [micro] * STEPS


def train(model, optimizer, batches: list[list[dict]], accumulation: int = MICRO_BATCHES) -> list[float]:
    """Accumulate each step's micro-batches (loss / ``accumulation``), then step; a swarm model or a local one."""
    losses = []
    for micro in batches:
        for batch in micro:
            out = model(**batch)
            (out.loss / accumulation).backward()
            losses.append(out.loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def local_peft(model_dir: str | Path, adapter_dir: str | Path) -> peft.PeftModel:
    """The reference: the base model in fp32 (sdpa, or eager where the family has no sdpa, as the peers run it) with
    the adapter in ``adapter_dir``, trainable."""
    attention = attention_implementation(transformers.AutoConfig.from_pretrained(model_dir).model_type)
    base = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attention
    )
    return peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)


def client_requests(tap: CallTap) -> list[dict]:
    """Every request's meta the client sends from now on (``tap``: its call hook)."""
    sent = []

    def record(peer: PeerID, message: Message, send: Send) -> Message:
        sent.append(message.meta)
        return send(message)

    tap.arm(record)
    return sent


def record_backwards(tap: CallTap) -> list[dict]:
    """What each backward request carried and got back (its meta, tensors sent, tensors returned); ``tap``: the
    client's call hook."""
    calls = []

    def record(peer: PeerID, message: Message, send: Send) -> Message:
        reply = send(message)
        if method_of(message.meta) == Method.BACKWARD:
            calls.append(dict(meta=message.meta, sent=len(message.tensors), returned=len(reply.tensors)))
        return reply

    tap.arm(record)
    return calls
