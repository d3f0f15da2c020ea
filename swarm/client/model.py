"""The model a user trains: local embeddings, norm and LM head around a remote stack of LoRA'd blocks."""

from __future__ import annotations

import contextlib
import getpass
import logging
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from pathlib import Path

import peft
import torch
from hivemind import DHT
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.p2p import PeerID
from safetensors import safe_open
from torch import nn
from transformers import GenerationConfig
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_outputs import CausalLMOutputWithPast

from swarm.blocks import lora_config_from_wire, lora_config_to_wire, spans_text
from swarm.client.commit import ReplicaSet, StepsLost, commit, take_back_abandoned
from swarm.client.copies import CopyKeeper
from swarm.client.export import save_peft_adapter
from swarm.client.generation import SessionChain, generate_tokens, resolve_config
from swarm.client.lease import AdapterLease
from swarm.client.ledger import StepLedger
from swarm.client.pipeline import run_pipelined
from swarm.client.remote import PeerFailure, RemoteStack, RemoteStackFunction
from swarm.client.routing import Router
from swarm.net.compression import WireFormat
from swarm.net.errors import AdapterConfigError, AdapterStateLostError, RequestError, SwarmUnavailableError
from swarm.net.network import check_access, initial_peers_or_env, join_dht, load_swarm_key
from swarm.net.protocol import (
    DigestRequest,
    OpenRequest,
    OptimizerHParams,
    Reply,
    Request,
    StateRequest,
    check_adapter_name,
)
from swarm.net.records import RECOVERIES_KEPT, CommittedRecord, announce_committed, read_committed
from swarm.net.security import Identity, SwarmKey
from swarm.net.transport import Transport
from swarm.spec import ModelSpec, load_spec

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


RESUME_MODES = ("committed", "latest")


def _committed_or_raise(dht: DHT, spec: ModelSpec, adapter: str) -> CommittedRecord:
    """The adapter's committed record, which a reader (``is_trainable=False``) needs: there is nothing to read
    without one."""
    recorded = read_committed(dht, spec.name, adapter)
    if recorded is None:
        raise AdapterStateLostError(
            f"adapter {adapter!r} has no committed step in this swarm: there is nothing to read yet. Train it first "
            "(is_trainable=True), or check its name"
        )
    return recorded


def _generation_config(spec: ModelSpec) -> GenerationConfig:
    """The folder's generation_config.json, else what transformers derives from the model config."""
    if (spec.path / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(spec.path)
    return GenerationConfig.from_model_config(spec.config)


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
        min_copies: int = 2,
        resume: str = "committed",
        unreachable_wait: float = 30.0,
        wire: WireFormat | None = None,
        is_trainable: bool = True,
    ):
        super().__init__()
        self.is_trainable = is_trainable
        self.spec, self.dht, self.adapter, self.trainer = spec, dht, adapter, trainer
        self.lora_wire = lora_config_to_wire(lora_config)
        self.lora_config = lora_config_from_wire(self.lora_wire)
        self.seed, self.dtype, self.device, self.owner = seed, dtype, device, identity.owner
        self.session = uuid.uuid4().hex[:16]
        self.generation_config = _generation_config(spec)
        self._adapter_on = True
        try:
            self._load_local_modules(dtype, device)
            self.transport = Transport.for_dht(dht, swarm_key)
            RemoteExpertWorker.run_coroutine(check_access(self.transport, initial_peers))
            self.router = Router(
                dht,
                self.transport,
                spec.name,
                spec.num_blocks,
                unreachable_wait=unreachable_wait,
                eligible=self._is_current,
                on_wait=self._track,
            )
            self.stack = RemoteStack(self.transport, self.router, adapter, patience, spot_check, wire=wire)
            self.replicas = ReplicaSet(self.stack, self._open_on, lost_grace=patience / 2)
            self.copies_keeper = CopyKeeper(self.stack, self.replicas, min_copies, self.lora_wire, seed)
            if is_trainable:
                self.lease = AdapterLease(dht, spec.name, adapter, identity.owner, trainer, self.session)
                self.lease.acquire(patience)
                self.ledger = StepLedger(step=self._resume_step(resume), session=self.session)
                self.replicas.refresh(self.ledger.step, accept_losses=resume == "latest")
                self.copies_keeper.ensure(self.ledger.step, self.replicas.peers(self.ledger.step))
            else:
                _committed_or_raise(dht, spec, adapter)
                self.ledger = StepLedger(step=self._resume_step("committed"), session=self.session)
                self.replicas.follow(self.ledger.step)
            self.router.start()
        except BaseException:
            self.shutdown()
            raise
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
        min_copies: int = 2,
        resume: str = "committed",
        unreachable_wait: float = 30.0,
        wire_dtype: str | None = None,
        compression: str = "none",
        is_trainable: bool = True,
    ) -> SwarmModelForCausalLM:
        """Join the swarm as a client and open (or resume) ``adapter`` on the peers serving ``model_dir``.

        ``patience``: seconds to wait when some blocks have no live server (or, on resume, no peer holding the
        adapter's committed step) before raising.
        ``min_copies``: ``opt.step()`` returns only once every block's new state is held by this many peers (live
        replicas plus standby copies), whenever the swarm has that many; fewer is warned about, never an error.
        ``resume``: ``"committed"`` waits for peers holding the adapter's committed step (as recorded in the swarm)
        and raises ``AdapterStateLostError`` if it is gone; ``"latest"`` accepts the newest state the peers still
        hold, and the steps lost are reported in ``model.steps_lost``.
        ``unreachable_wait``: how long a peer that stopped answering but may be alive (frozen, cut off) is waited
        for as the possible holder of the only current state of a block; a peer whose process is gone is not.
        ``trainer``: who trains this adapter (default: user@host); the same trainer takes its lease back at once
        after a restart, another one waits for the lease to expire.
        ``swarm_key``: the key file of a private swarm (``swarm keygen``).
        ``spot_check``: fraction of hops also computed on other replicas; a peer outvoted by two agreeing
        replicas is banned for good and listed in ``model.dishonest``.
        ``wire_dtype`` (``"bfloat16"``, ``"float16"``) and ``compression`` (``"blockwise8"``): how hidden states and
        their gradients travel; both off by default (exact parity with local training). They cut the bytes per step
        by 2x / ~4x at the cost of rounding the activations (see BENCHMARKS.md for what that does to the loss).
        ``is_trainable=False`` (as in ``peft.PeftModel.from_pretrained``): a reader of an adapter that has committed
        steps, to ``generate`` or evaluate with its newest committed step while its trainer goes on training; it
        takes no lease and changes nothing on any peer. ``lora_config`` and ``seed`` then default to the adapter's.
        """
        if lora_config is None and is_trainable:
            raise ValueError("pass lora_config=peft.LoraConfig(r=..., lora_alpha=..., target_modules=[...])")
        try:
            check_adapter_name(adapter)
        except RequestError as e:
            raise AdapterConfigError(str(e)) from None
        if resume not in RESUME_MODES:
            raise ValueError(f"resume must be one of {RESUME_MODES}, got {resume!r}")
        if min_copies < 1:
            raise ValueError(f"min_copies must be at least 1, got {min_copies}")
        wire = WireFormat(wire_dtype, compression)
        spec = load_spec(model_dir)
        peers = initial_peers_or_env(initial_peers)
        if not peers:
            raise ValueError("pass initial_peers=[...] (multiaddrs printed by `swarm dht`) or set SWARM_INITIAL_PEERS")
        key = load_swarm_key(swarm_key)
        identity = Identity.load_or_create(None)
        dht = join_dht(peers, identity, key, client_mode=True)
        trainer = trainer or f"{getpass.getuser()}@{socket.gethostname()}"
        if lora_config is None:
            try:
                recorded = _committed_or_raise(dht, spec, adapter)
            except AdapterStateLostError:
                dht.shutdown()
                raise
            lora_config, seed = lora_config_from_wire(recorded.lora), recorded.seed
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
            min_copies,
            resume,
            unreachable_wait,
            wire,
            is_trainable,
        )

    def _is_current(self, peer: PeerID) -> bool:
        """Whether a peer may serve this client: at the trainer's step, or (a reader) at that step or later."""
        step = self.replicas.current.get(peer)
        return step == self.ledger.step if self.is_trainable else step is not None and step >= self.ledger.step

    def _track(self) -> None:
        """Bring the replicas up to date: the trainer's refresh (opens new peers, syncs laggards), or a reader's
        look at the newest committed step and the peers holding it (it changes nothing on any peer)."""
        if self.is_trainable:
            self.replicas.refresh(self.ledger.step)
            return
        recorded = read_committed(self.dht, self.spec.name, self.adapter)
        if recorded is not None and recorded.step > self.ledger.step:
            self.ledger = StepLedger(step=recorded.step, session=self.session)
        self.replicas.follow(self.ledger.step)

    def _current_peers(self) -> dict[PeerID, range]:
        return {p: span for p, span in self.router.live_servers().items() if self._is_current(p)}

    def _must_train(self, what: str) -> None:
        if not self.is_trainable:
            raise ValueError(
                f"{what} needs a trainer: this client opened adapter {self.adapter!r} with is_trainable=False "
                "(it reads the adapter and generates, while its trainer trains)"
            )

    def _open_on(self, peer_id: PeerID) -> tuple[dict[int, int], dict[int, int]]:
        """Open (or claim) the adapter on a peer; returns its committed step per served block and per standby copy.
        A reader opens without a session: it claims nothing."""
        request = OpenRequest(self.adapter, self.lora_wire, self.seed, self.session if self.is_trainable else None)
        reply = self.stack.ask(peer_id, request)
        return reply.steps, reply.standby

    def _resume_step(self, resume: str) -> int:
        """The adapter's last committed step, and wait (up to ``patience``) until the swarm can serve it.

        The trainer records the committed step in the DHT at every commit; peers hold their blocks' steps. The step
        to resume at is the newest of both: a restarted client never starts over on an adapter that has committed
        steps, and waits for peers that still load. It goes once every block has a live server and a live copy at
        that step (laggards sync from it), or, with nothing recorded (a new swarm), once every block has a server.
        """
        recorded = read_committed(self.dht, self.spec.name, self.adapter)
        if recorded is not None and (recorded.lora != self.lora_wire or recorded.seed != self.seed):
            raise ValueError(
                f"adapter {self.adapter!r} was trained with another LoRA config or seed (by {recorded.trainer!r}); "
                "pass the same lora_config and seed to resume it, or pick another adapter name"
            )
        deadline = time.monotonic() + self.stack.patience
        while True:
            self.router.refresh()
            served = self.replicas.open_many(list(self.router.live_servers(eligible_only=False)))
            held: dict[int, set[int]] = {}
            for steps in [*served.values(), *self.replicas.standby.values()]:
                for block, step in steps.items():
                    held.setdefault(block, set()).add(step)
            newest = max([recorded.step if recorded else 0, *(s for steps in held.values() for s in steps)])
            covered = {block for steps in served.values() for block in steps}
            uncovered = [b for b in range(self.spec.num_blocks) if b not in covered]
            missing = [b for b in range(self.spec.num_blocks) if newest not in held.get(b, ())]
            unanswered = {p for peers in self.router.announced().values() for p in peers} - set(served)
            give_up = time.monotonic() > deadline  # on peers that never answered, with resume="latest"
            if not uncovered and (
                not missing or recorded is None or (resume == "latest" and (give_up or not unanswered))
            ):
                if missing:
                    logger.warning("resuming adapter %r without step %d on blocks %s", self.adapter, newest, missing)
                return newest
            if give_up:
                if uncovered:
                    raise SwarmUnavailableError(
                        f"blocks {uncovered} have had no live server for {self.stack.patience:.0f}s; start peers "
                        "serving them (swarm peer --model ...) or raise the client's patience"
                    )
                newest_held = {b: max(held[b]) for b in missing if b in held}
                raise AdapterStateLostError(
                    f"adapter {self.adapter!r} is at step {newest}, but no live peer holds blocks {missing} at that "
                    f"step (the newest they hold: {newest_held or 'none'}). Restart the peers that held them with "
                    'their --checkpoint-dir, or pass resume="latest" to continue from the newest state they hold '
                    "(the steps in between are lost and listed in model.steps_lost)"
                )
            logger.info(
                "waiting for peers holding adapter %r at step %d (blocks without a server yet: %s; not at that "
                "step: %s)",
                self.adapter,
                newest,
                spans_text(uncovered),
                spans_text(missing),
            )
            time.sleep(1.0)

    @property
    def step(self) -> int:
        """The number of committed optimizer steps of this adapter."""
        return self.ledger.step

    @property
    def dishonest(self) -> list[PeerID]:
        """Peers caught returning results that their replicas disagree with."""
        return self.stack.dishonest

    @property
    def copies(self) -> dict[int, int]:
        """Per block, how many peers hold the state of the last committed step (live replicas + standby copies)."""
        return dict(self.copies_keeper.copies)

    @property
    def steps_lost(self) -> list[StepsLost]:
        """Blocks that lost every current copy of their state and resumed from an older one (empty: none lost)."""
        return self.replicas.lost

    @property
    def recoveries(self):
        """Failures routed around so far (peer, during what, at which step, how long the retry took)."""
        return self.stack.recoveries

    def _inputs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stack's input hidden states and mask, on the CPU where the wire takes them."""
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {list(input_ids.shape)}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must have the shape of input_ids {list(input_ids.shape)}")
        hidden = self.embed_tokens(input_ids.to(self.device)).cpu()
        mask = None if attention_mask is None else attention_mask.to(torch.int64).cpu()
        return hidden, mask

    def _head(self, hidden: torch.Tensor, labels: torch.Tensor | None) -> CausalLMOutputWithPast:
        logits = self.lm_head(self.norm(hidden.to(self.device)))
        loss = None
        if labels is not None:
            loss = ForCausalLMLoss(logits, labels.to(self.device), vocab_size=self.spec.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
    ) -> CausalLMOutputWithPast:
        hidden, mask = self._inputs(input_ids, attention_mask)
        if torch.is_grad_enabled():
            self._must_train("a forward with gradients")
            micro_batch = self.ledger.new_micro_batch()
            # The embeddings are frozen: the stack's input gradient would be thrown away, so it is not asked for.
            # (The input is marked as needing one only so that autograd runs the stack's backward at all.)
            hidden = RemoteStackFunction.apply(
                hidden.requires_grad_(True),
                mask,
                self.stack,
                self.ledger,
                micro_batch,
                self.embed_tokens.weight.requires_grad,
            )
        else:
            hidden, _ = self.stack.forward(hidden, mask, self.ledger.step, None)
        return self._head(hidden, labels)

    @contextlib.contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """Inside, ``generate`` runs the base model (LoRA off on the peers), as ``PeftModel.disable_adapter`` does."""
        self._adapter_on = False
        try:
            yield
        finally:
            self._adapter_on = True

    def generate(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        **kwargs,
    ) -> torch.LongTensor:
        """Continue ``input_ids`` [batch, prompt] through the swarm with the adapter's last committed step; returns
        [batch, prompt + new] like transformers' ``generate``. Takes ``max_new_tokens`` (or ``max_length``),
        ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``eos_token_id`` and ``pad_token_id``; unset ones
        come from the model folder's generation_config.json, then transformers' defaults.

        Each span keeps the tokens' keys and values on its peer, so a new token is one small request per span; a
        peer that fails mid-generation is replaced by a replica that replays the prefix. Adapter state is never
        changed, so generating between training steps is safe. Prompts of different lengths are padded on the left,
        with their ``attention_mask``, as for transformers."""
        if input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [batch, prompt length >= 1], got shape {list(input_ids.shape)}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must have the shape of input_ids {list(input_ids.shape)}")
        if attention_mask is not None and not bool(attention_mask[:, -1].bool().all()):
            raise ValueError(
                "prompts of different lengths must be padded on the left for generation (tokenizer.padding_side = "
                '"left"): every prompt must end with a real token'
            )
        mask = None if attention_mask is None or bool(attention_mask.bool().all()) else attention_mask.long().cpu()
        config = resolve_config(generation_config or self.generation_config, input_ids.shape[1], kwargs)
        if not self.is_trainable:
            self._track()  # a reader generates with the newest committed step
        chain = SessionChain(
            self.stack,
            input_ids.shape[1] + config.max_new_tokens,
            self.adapter if self._adapter_on else None,
            lambda: self.ledger.step,
        )
        try:
            return generate_tokens(
                input_ids.to(self.device),
                mask,
                config,
                lambda ids: self.embed_tokens(ids).cpu(),
                chain,
                lambda hidden: self.lm_head(self.norm(hidden.to(self.device))),
            )
        finally:
            chain.end()

    def train_step(
        self,
        micro_batches: Iterable[Mapping[str, torch.Tensor]],
        accumulation: int | None = None,
        max_in_flight: int = 4,
    ) -> torch.Tensor:
        """Forward and backward of the micro-batches of a step, up to ``max_in_flight`` of them in the swarm at once
        (a pipeline: each span works on one micro-batch while the next span works on another). The gradients are
        exactly those of ``for b in micro_batches: (model(**b).loss / accumulation).backward()``: the peers sum them
        in the order given. Commit with ``optimizer.step()`` as usual.

        ``micro_batches``: dicts with ``input_ids``, ``labels`` and optionally ``attention_mask``; a list, or any
        iterable (a generator is read as the pipeline has room). ``accumulation``: what each micro-batch's loss is
        divided by; defaults to ``len(micro_batches)``, needed for an iterable without a length.
        Returns the sum of the divided losses (the mean loss of the step, with the default).
        """
        if accumulation is None:
            if not isinstance(micro_batches, Sized):
                raise TypeError("pass accumulation=N (what each micro-batch's loss is divided by) for an iterable")
            accumulation = len(micro_batches)
        if accumulation < 1:
            raise ValueError(f"accumulation must be at least 1, got {accumulation}")
        ledger = self.ledger

        def start(batch: Mapping[str, torch.Tensor]) -> Callable[[], torch.Tensor]:
            if "input_ids" not in batch or "labels" not in batch:
                raise ValueError(f"a micro-batch needs input_ids and labels, got keys {sorted(batch)}")
            hidden, mask = self._inputs(batch["input_ids"], batch.get("attention_mask"))
            micro_batch = ledger.new_micro_batch()  # here, in order: the canonical order of the sum

            def run() -> torch.Tensor:
                outputs, inputs = self.stack.forward(hidden, mask, ledger.step, micro_batch)
                outputs.requires_grad_(True)
                loss = self._head(outputs, batch["labels"]).loss / accumulation
                loss.backward()
                self.stack.backward(inputs, outputs.grad.contiguous(), mask, ledger, micro_batch, input_grad=False)
                return loss.detach()

            return run

        return torch.stack(run_pipelined(micro_batches, start, max_in_flight)).sum()

    def commit(self, hparams: OptimizerHParams) -> int:
        """Commit the step in progress on every live replica of every block; returns the new step."""
        self._must_train("opt.step()")
        if self.ledger.empty:
            logger.warning("optimizer step with no backward since the last step: nothing to commit")
            return self.step
        self.router.wait_fresh(timeout=self.router.refresh_every)
        applied = commit(self.stack, self.replicas, self.ledger, hparams)
        self.ledger = self.ledger.next()
        self.copies_keeper.ensure(self.step, applied)
        recent = [
            {"peer": r.peer.to_base58(), "during": r.during, "step": r.step, "seconds": round(r.seconds, 2)}
            for r in self.recoveries[-RECOVERIES_KEPT:]
        ]
        lost = sum(e.steps for e in self.steps_lost)
        record = CommittedRecord(self.step, self.lora_wire, self.seed, self.trainer, recent, lost)
        announce_committed(self.dht, self.spec.name, self.adapter, self.owner, record)
        self.router.refresh_soon()  # peers that joined or moved meanwhile are brought in at the next step
        return self.step

    def discard_step(self) -> None:
        """Forget the micro-batches of the step in progress (their gradients are never committed)."""
        if self.ledger.committing:
            take_back_abandoned(self.stack, self.replicas, self.ledger.step)
        self.ledger = self.ledger.discarded()

    def _each_block(self, request: Request) -> list[tuple[PeerID, range, Reply]]:
        """Ask every current replica (used for exports and checks), waiting up to ``patience`` for every block
        to have answered at least once: a replica banned a moment ago may be back in seconds."""
        deadline = time.monotonic() + self.stack.patience
        answers: dict[PeerID, tuple[PeerID, range, Reply]] = {}
        while True:
            self._track()
            for peer, span in self._current_peers().items():
                if peer in answers:
                    continue
                try:
                    answers[peer] = (peer, span, self.stack.ask(peer, request))
                except PeerFailure:
                    continue
            covered = {b for _, span, _ in answers.values() for b in span}
            if len(covered) == self.spec.num_blocks or time.monotonic() > deadline:
                return list(answers.values())
            time.sleep(1.0)

    def adapter_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """LoRA tensors of every block, from live replicas at the current step."""
        state: dict[int, dict[str, torch.Tensor]] = {}
        for _, span, reply in self._each_block(StateRequest(self.adapter)):
            for block, tensors in reply.state.items():
                if block in span:  # a peer handing blocks over may still hold them, not current any more
                    state.setdefault(block, {}).update(tensors)
        missing = [b for b in range(self.spec.num_blocks) if b not in state]
        if missing:
            raise RuntimeError(f"no live replica holds blocks {missing} of adapter {self.adapter!r}")
        return state

    def replica_digests(self) -> dict[int, dict[PeerID, str]]:
        """Per block, the state digest each live replica reports: equal digests mean identical replicas."""
        digests: dict[int, dict[PeerID, str]] = {}
        for peer, span, reply in self._each_block(DigestRequest(self.adapter)):
            for block, digest in reply.digests.items():
                if block in span:
                    digests.setdefault(block, {})[peer] = digest
        return digests

    def save_adapter(self, out_dir: str | Path) -> Path:
        """Write a standard peft adapter folder for this model."""
        return save_peft_adapter(out_dir, self.lora_config, str(self.spec.path.resolve()), self.adapter_state())

    def __enter__(self) -> SwarmModelForCausalLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Leave the swarm: release the adapter's lease, close this client's P2P connection and DHT node. Safe to
        call on a model whose construction failed half-way (it releases what was started)."""
        if hasattr(self, "router"):
            self.router.stop()
        for part in ("copies_keeper", "replicas"):
            if hasattr(self, part):
                getattr(self, part).close()
        if getattr(self, "lease", None) is not None:
            self.lease.release()
        if hasattr(self, "transport"):
            RemoteExpertWorker.run_coroutine(self.transport.shutdown())
        self.dht.shutdown()
