"""The model a user trains: local embeddings, norm and LM head around a remote stack of LoRA'd blocks."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import peft
import torch
from hivemind import DHT
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from safetensors import safe_open
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_outputs import CausalLMOutputWithPast

from swarm.blocks import lora_config_from_wire, lora_config_to_wire
from swarm.checkpoint import save_peft_adapter
from swarm.client.ledger import StepLedger
from swarm.client.remote import RemoteStack, RemoteStackFunction
from swarm.routing import Router
from swarm.spec import ModelSpec, load_spec
from swarm.transport import Transport
from swarm.wire import Message

logger = logging.getLogger(__name__)

EMBEDDINGS = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def _read_tensors(spec: ModelSpec, names: list[str]) -> dict[str, torch.Tensor]:
    tensors = {}
    for path, group in spec.files_for(names).items():
        with safe_open(str(path), framework="pt") as f:
            for name in group:
                tensors[name] = f.get_tensor(name)
    return tensors


def initial_peers_from_env(initial_peers: list[str] | None) -> list[str]:
    if initial_peers:
        return list(initial_peers)
    env = os.environ.get("SWARM_INITIAL_PEERS", "")
    peers = [p for p in env.replace(",", " ").split() if p]
    if not peers:
        raise ValueError("pass initial_peers=[...] (multiaddrs printed by `swarm dht`) or set SWARM_INITIAL_PEERS")
    return peers


class SwarmModelForCausalLM(nn.Module):
    """A causal LM whose decoder blocks (and their LoRA adapter) live on swarm peers."""

    def __init__(
        self,
        spec: ModelSpec,
        dht: DHT,
        adapter: str,
        lora_config: peft.LoraConfig,
        dtype: torch.dtype,
        device: torch.device,
        seed: int,
        request_timeout: float,
    ):
        super().__init__()
        self.spec, self.dht, self.adapter = spec, dht, adapter
        self.lora_wire = lora_config_to_wire(lora_config)
        self.lora_config = lora_config_from_wire(self.lora_wire)
        self.seed, self.dtype, self.device = seed, dtype, device
        config = spec.config
        names = [EMBEDDINGS, FINAL_NORM] + ([] if config.tie_word_embeddings else [LM_HEAD])
        tensors = _read_tensors(spec, names)
        self.embed_tokens = nn.Embedding.from_pretrained(tensors[EMBEDDINGS].to(dtype), freeze=True)
        self.norm = spec.family_class("RMSNorm")(config.hidden_size, eps=config.rms_norm_eps).to(dtype)
        self.norm.weight = nn.Parameter(tensors[FINAL_NORM].to(dtype), requires_grad=False)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.lm_head.weight = (
            self.embed_tokens.weight
            if config.tie_word_embeddings
            else nn.Parameter(tensors[LM_HEAD].to(dtype), requires_grad=False)
        )
        self.to(device)
        self.transport = Transport(dht)
        self.router = Router(dht, spec.name, spec.num_blocks)
        self.stack = RemoteStack(self.transport, self.router, adapter, request_timeout)
        self.opened: set = set()
        self.ledger = StepLedger(step=self._open_adapter())

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        initial_peers: list[str] | None = None,
        adapter: str = "default",
        lora_config: peft.LoraConfig | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        seed: int = 0,
        request_timeout: float = 300.0,
    ) -> SwarmModelForCausalLM:
        """Join the swarm as a client and open (or resume) ``adapter`` on the peers serving ``model_dir``."""
        if lora_config is None:
            raise ValueError("pass lora_config=peft.LoraConfig(r=..., lora_alpha=..., target_modules=[...])")
        spec = load_spec(model_dir)
        dht = DHT(initial_peers=initial_peers_from_env(initial_peers), client_mode=True, start=True)
        return cls(spec, dht, adapter, lora_config, dtype, torch.device(device), seed, request_timeout)

    def _open_adapter(self) -> int:
        """Open the adapter on every peer of the route; they must all be at the same committed step."""
        self.router.refresh()
        steps: set[int] = set()
        for hop in self.router.route():
            steps.update(self._open_on(hop.peer_id).values())
        if len(steps) != 1:
            raise RuntimeError(f"peers hold adapter {self.adapter!r} at different steps {sorted(steps)}")
        return steps.pop()

    def _open_on(self, peer_id) -> dict[int, int]:
        meta = {"method": "open", "adapter": self.adapter, "lora": self.lora_wire, "seed": self.seed}
        reply = self.transport.call(peer_id, Message(meta, []), self.stack.timeout)
        self.opened.add(peer_id)
        return {int(b): s for b, s in reply.meta["steps"].items()}

    @property
    def step(self) -> int:
        """The number of committed optimizer steps of this adapter."""
        return self.ledger.step

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
    ) -> CausalLMOutputWithPast:
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {list(input_ids.shape)}")
        input_ids = input_ids.to(self.device)
        hidden = self.embed_tokens(input_ids)
        mask = None if attention_mask is None else attention_mask.to(torch.int64).cpu()
        if torch.is_grad_enabled():
            hidden = hidden.detach().requires_grad_(True)
            micro_batch = self.ledger.new_micro_batch()
            hidden = RemoteStackFunction.apply(hidden.cpu(), mask, self.stack, self.ledger, micro_batch)
        else:
            hidden, _ = self.stack.forward(hidden.cpu(), mask, None, None)
        logits = self.lm_head(self.norm(hidden.to(self.device)))
        loss = None
        if labels is not None:
            loss = ForCausalLMLoss(logits, labels.to(self.device), vocab_size=self.spec.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def commit(self, hparams: dict) -> int:
        """Commit the step in progress on every peer that holds the adapter; returns the new step."""
        if self.ledger.empty:
            logger.warning("optimizer step with no backward since the last step: nothing to commit")
            return self.step
        for peer_id in sorted(self.opened, key=str):
            record_blocks = self._blocks_of(peer_id)
            meta = {
                "method": "commit",
                "adapter": self.adapter,
                "step": self.ledger.step,
                "hparams": hparams,
                "ledger": {str(b): mbs for b, mbs in self.ledger.micro_batches(record_blocks).items()},
            }
            self.transport.call(peer_id, Message(meta, []), self.stack.timeout)
        self.ledger = self.ledger.next()
        return self.step

    def discard_step(self) -> None:
        """Forget the micro-batches of the step in progress (their gradients are never committed)."""
        self.ledger = StepLedger(step=self.ledger.step, session=self.ledger.session, counter=self.ledger.counter)

    def _blocks_of(self, peer_id) -> range:
        spans = [(r.start, r.end) for records in self.router.servers.values() for r in records if r.peer_id == peer_id]
        if not spans:
            raise RuntimeError(f"peer {peer_id} holds adapter {self.adapter!r} but is not announced any more")
        start, end = spans[0]
        return range(start, end)

    def adapter_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """LoRA tensors of every block, gathered from the route's peers."""
        state: dict[int, dict[str, torch.Tensor]] = {}
        for hop in self.router.route():
            reply = self.transport.call(hop.peer_id, Message({"method": "state", "adapter": self.adapter}, []))
            for (block, name), tensor in zip(reply.meta["names"], reply.tensors, strict=True):
                if hop.start <= block < hop.end:
                    state.setdefault(block, {})[name] = tensor
        return state

    def save_adapter(self, out_dir: str | Path) -> Path:
        """Write a standard peft adapter folder for this model."""
        return save_peft_adapter(out_dir, self.lora_config, str(self.spec.path.resolve()), self.adapter_state())

    def shutdown(self) -> None:
        """Leave the swarm: close this client's P2P connection and DHT node."""
        RemoteExpertWorker.run_coroutine(self.transport.p2p.shutdown())
        self.dht.shutdown()
