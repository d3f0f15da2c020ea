"""The model a user trains: local embeddings, norm and LM head around a remote stack of LoRA'd blocks."""

from __future__ import annotations

import getpass
import logging
import socket
import time
from pathlib import Path

import peft
import torch
from hivemind import DHT
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.p2p import PeerID
from safetensors import safe_open
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_outputs import CausalLMOutputWithPast

from swarm.blocks import lora_config_from_wire, lora_config_to_wire
from swarm.checkpoint import save_peft_adapter
from swarm.client.commit import ReplicaSet, StepsLost, commit
from swarm.client.lease import AdapterLease
from swarm.client.ledger import StepLedger
from swarm.client.remote import PeerFailure, RemoteStack, RemoteStackFunction
from swarm.network import check_access, initial_peers_or_env, join_dht, load_swarm_key
from swarm.routing import Router
from swarm.security import Identity, SwarmKey
from swarm.spec import ModelSpec, load_spec
from swarm.transport import Transport

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
        patience: float,
        trainer: str,
        identity: Identity,
        swarm_key: SwarmKey | None,
        initial_peers: list[str],
        spot_check: float = 0.0,
    ):
        super().__init__()
        self.spec, self.dht, self.adapter = spec, dht, adapter
        self.lora_wire = lora_config_to_wire(lora_config)
        self.lora_config = lora_config_from_wire(self.lora_wire)
        self.seed, self.dtype, self.device = seed, dtype, device
        self._load_local_modules(dtype, device)
        self.transport = Transport.for_dht(dht, swarm_key)
        RemoteExpertWorker.run_coroutine(check_access(self.transport, initial_peers))
        self.router = Router(dht, spec.name, spec.num_blocks)
        self.stack = RemoteStack(self.transport, self.router, adapter, patience, spot_check)
        self.replicas = ReplicaSet(self.stack, self._open_on)
        self.router.on_wait = lambda: self.replicas.refresh(self.ledger.step)
        self.ledger = StepLedger(step=0)
        self.lease = AdapterLease(dht, spec.name, adapter, identity.owner, trainer, self.ledger.session)
        self.lease.acquire(patience)
        self.router.refresh()
        self.ledger = StepLedger(step=self._resume_step(), session=self.ledger.session)
        self.replicas.refresh(self.ledger.step)
        self.router.start()
        logger.info("adapter %r at step %d", adapter, self.ledger.step)

    def _load_local_modules(self, dtype: torch.dtype, device: torch.device) -> None:
        """Embeddings, final norm and LM head: the only tensors of the model the client reads."""
        config = self.spec.config
        names = [EMBEDDINGS, FINAL_NORM] + ([] if config.tie_word_embeddings else [LM_HEAD])
        tensors = _read_tensors(self.spec, names)
        self.embed_tokens = nn.Embedding.from_pretrained(tensors[EMBEDDINGS].to(dtype), freeze=True)
        self.norm = self.spec.family_class("RMSNorm")(config.hidden_size, eps=config.rms_norm_eps).to(dtype)
        self.norm.weight = nn.Parameter(tensors[FINAL_NORM].to(dtype), requires_grad=False)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.lm_head.weight = (
            self.embed_tokens.weight
            if config.tie_word_embeddings
            else nn.Parameter(tensors[LM_HEAD].to(dtype), requires_grad=False)
        )
        self.to(device)

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
        patience: float = 60.0,
        trainer: str | None = None,
        swarm_key: str | Path | None = None,
        spot_check: float = 0.0,
    ) -> SwarmModelForCausalLM:
        """Join the swarm as a client and open (or resume) ``adapter`` on the peers serving ``model_dir``.

        ``patience``: seconds to wait when some blocks have no live server before raising.
        ``trainer``: who trains this adapter (default: user@host); the same trainer takes its lease back at once
        after a restart, another one waits for the lease to expire.
        ``swarm_key``: the key file of a private swarm (``swarm keygen``).
        ``spot_check``: fraction of hops also computed on other replicas; a peer outvoted by two agreeing
        replicas is banned for good and listed in ``model.dishonest``.
        """
        if lora_config is None:
            raise ValueError("pass lora_config=peft.LoraConfig(r=..., lora_alpha=..., target_modules=[...])")
        spec = load_spec(model_dir)
        peers = initial_peers_or_env(initial_peers)
        if not peers:
            raise ValueError("pass initial_peers=[...] (multiaddrs printed by `swarm dht`) or set SWARM_INITIAL_PEERS")
        key = load_swarm_key(swarm_key)
        identity = Identity.load_or_create(None)
        dht = join_dht(peers, identity, key, client_mode=True)
        trainer = trainer or f"{getpass.getuser()}@{socket.gethostname()}"
        try:
            return cls(
                spec,
                dht,
                adapter,
                lora_config,
                dtype,
                torch.device(device),
                seed,
                patience,
                trainer,
                identity,
                key,
                peers,
                spot_check,
            )
        except BaseException:
            dht.shutdown()
            raise

    def _open_on(self, peer_id: PeerID) -> dict[int, int]:
        """Open (or claim) the adapter on a peer; returns its committed step per block."""
        meta = {
            "method": "open",
            "adapter": self.adapter,
            "lora": self.lora_wire,
            "seed": self.seed,
            "session": self.ledger.session,
        }
        reply = self.stack.call(peer_id, meta, [])
        return {int(b): s for b, s in reply.meta["steps"].items()}

    def _resume_step(self) -> int:
        """The adapter's last committed step: the newest step any live peer holds for any block. Blocks behind it
        are brought up to it by ``ReplicaSet.refresh`` (synced, or reported as steps lost)."""
        self.router.wait_covered(self.stack.patience)
        newest = 0
        for peer in self.router.live_servers(eligible_only=False):
            try:
                steps = self._open_on(peer)
            except PeerFailure:
                continue
            newest = max([newest, *steps.values()])
        return newest

    @property
    def step(self) -> int:
        """The number of committed optimizer steps of this adapter."""
        return self.ledger.step

    @property
    def dishonest(self) -> list[PeerID]:
        """Peers caught returning results that their replicas disagree with."""
        return self.stack.dishonest

    @property
    def steps_lost(self) -> list[StepsLost]:
        """Blocks that lost every current copy of their state and resumed from an older one (empty: none lost)."""
        return self.replicas.lost

    @property
    def recoveries(self):
        """Failures routed around so far (peer, during what, at which step, how long the retry took)."""
        return self.stack.recoveries

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
    ) -> CausalLMOutputWithPast:
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {list(input_ids.shape)}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must have the shape of input_ids {list(input_ids.shape)}")
        hidden = self.embed_tokens(input_ids.to(self.device)).cpu()
        mask = None if attention_mask is None else attention_mask.to(torch.int64).cpu()
        if torch.is_grad_enabled():
            micro_batch = self.ledger.new_micro_batch()
            hidden = RemoteStackFunction.apply(hidden.requires_grad_(True), mask, self.stack, self.ledger, micro_batch)
        else:
            hidden, _ = self.stack.forward(hidden, mask, self.ledger.step, None)
        logits = self.lm_head(self.norm(hidden.to(self.device)))
        loss = None
        if labels is not None:
            loss = ForCausalLMLoss(logits, labels.to(self.device), vocab_size=self.spec.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def commit(self, hparams: dict) -> int:
        """Commit the step in progress on every live replica of every block; returns the new step."""
        if self.ledger.empty:
            logger.warning("optimizer step with no backward since the last step: nothing to commit")
            return self.step
        commit(self.stack, self.replicas, self.ledger, hparams)
        self.ledger = self.ledger.next()
        return self.step

    def discard_step(self) -> None:
        """Forget the micro-batches of the step in progress (their gradients are never committed)."""
        self.ledger = self.ledger.discarded()

    def _each_block(self, method: str) -> list[tuple[PeerID, range, dict, list[torch.Tensor]]]:
        """Ask every current replica (used for exports and checks), waiting up to ``patience`` for every block
        to have answered at least once: a replica banned a moment ago may be back in seconds."""
        deadline = time.monotonic() + self.stack.patience
        answers: dict[PeerID, tuple[PeerID, range, dict, list[torch.Tensor]]] = {}
        while True:
            self.replicas.refresh(self.step)
            for peer, span in self.replicas.peers(self.step).items():
                if peer in answers:
                    continue
                try:
                    reply = self.stack.call(peer, {"method": method, "adapter": self.adapter}, [])
                except PeerFailure:
                    continue
                answers[peer] = (peer, span, reply.meta, reply.tensors)
            covered = {b for _, span, _, _ in answers.values() for b in span}
            if len(covered) == self.spec.num_blocks or time.monotonic() > deadline:
                return list(answers.values())
            time.sleep(1.0)

    def adapter_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """LoRA tensors of every block, from live replicas at the current step."""
        state: dict[int, dict[str, torch.Tensor]] = {}
        for _, span, meta, tensors in self._each_block("state"):
            for (block, name), tensor in zip(meta["names"], tensors, strict=True):
                if block in span:  # a peer handing blocks over may still hold them, not current any more
                    state.setdefault(block, {})[name] = tensor
        missing = [b for b in range(self.spec.num_blocks) if b not in state]
        if missing:
            raise RuntimeError(f"no live replica holds blocks {missing} of adapter {self.adapter!r}")
        return state

    def replica_digests(self) -> dict[int, dict[PeerID, str]]:
        """Per block, the state digest each live replica reports: equal digests mean identical replicas."""
        digests: dict[int, dict[PeerID, str]] = {}
        for peer, span, meta, _ in self._each_block("digest"):
            for block, digest in meta["digests"].items():
                if int(block) in span:
                    digests.setdefault(int(block), {})[peer] = digest
        return digests

    def save_adapter(self, out_dir: str | Path) -> Path:
        """Write a standard peft adapter folder for this model."""
        return save_peft_adapter(out_dir, self.lora_config, str(self.spec.path.resolve()), self.adapter_state())

    def shutdown(self) -> None:
        """Leave the swarm: release the adapter's lease, close this client's P2P connection and DHT node."""
        self.router.stop()
        self.lease.release()
        RemoteExpertWorker.run_coroutine(self.transport.shutdown())
        self.dht.shutdown()
