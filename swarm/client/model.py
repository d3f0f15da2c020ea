"""The model a user trains: local embeddings, norm and LM head around a remote stack of LoRA'd blocks. It computes;
everything about the adapter in the swarm (lease, ledger, replicas, commits, copies) is its session's."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from pathlib import Path

import peft
import torch
import transformers
from hivemind.p2p import PeerID
from safetensors import safe_open
from torch import nn
from transformers import GenerationConfig
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutputWithPast

from swarm.blocks import lora_config_from_wire, lora_config_to_wire
from swarm.client.calls import CallHook, Recovery
from swarm.client.clipping import clip_factor
from swarm.client.commit import LOST_GRACE, StepsLost
from swarm.client.config import OPTIONS, SwarmConfig
from swarm.client.export import save_peft_adapter
from swarm.client.generation import SessionChain, generate_tokens, resolve_config
from swarm.client.ledger import StepLedger
from swarm.client.pipeline import run_pipelined
from swarm.client.remote import RemoteStackFunction
from swarm.client.session import AdapterIdentity, AdapterSession, TrainingSession, committed_or_raise, open_session
from swarm.hub import ModelSource, resolve_model
from swarm.lora_options import resolve_lora_config
from swarm.net.errors import AdapterStateLostError, CommitError
from swarm.net.network import initial_peers_or_env, join_dht, load_swarm_key
from swarm.net.protocol import OptimizerHParams
from swarm.net.security import Identity
from swarm.spec import ModelSpec, load_spec

logger = logging.getLogger(__name__)

NumItems = int | torch.Tensor | None
# Arguments transformers' Trainer and TRL pass that change nothing here (no cache, the output as a dataclass): with
# these values they are accepted; any other argument is refused rather than ignored.
HARMLESS_KWARGS = {"use_cache": None, "return_dict": True, "output_attentions": False, "output_hidden_states": False}


def check_forward_kwargs(kwargs: dict) -> None:
    for name, value in kwargs.items():
        if name not in HARMLESS_KWARGS:
            raise TypeError(
                f"SwarmModelForCausalLM.forward does not take {name!r}: it takes input_ids, attention_mask, labels "
                "and num_items_in_batch (packed sequences with position_ids are not supported: pad instead)"
            )
        harmless = HARMLESS_KWARGS[name]
        if harmless is not None and value not in (None, harmless):
            raise TypeError(f"SwarmModelForCausalLM.forward supports only {name}={harmless!r}, got {value!r}")


def label_tokens(labels: torch.Tensor) -> int:
    """The tokens a causal LM loss counts in ``labels`` (shifted by one, -100 ignored), as transformers' Trainer
    counts ``num_items_in_batch``."""
    return int((labels[..., 1:] != -100).sum())


def _check_micro_batch(batch: Mapping[str, torch.Tensor]) -> None:
    if "input_ids" not in batch or "labels" not in batch:
        raise ValueError(f"a micro-batch needs input_ids and labels, got keys {sorted(batch)}")


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


def _generation_config(spec: ModelSpec) -> GenerationConfig:
    """The folder's generation_config.json, else what transformers derives from the model config."""
    if (spec.path / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(spec.path)
    return GenerationConfig.from_model_config(spec.config)


def autocast_dtype(device: torch.device | str) -> str | None:
    """The dtype the caller's autocast computes in on ``device`` (a Trainer's ``bf16``/``fp16`` turn it on around
    the forward), or None: the peers compute the blocks under the same autocast, as the local model would."""
    kind = torch.device(device).type
    if not torch.is_autocast_enabled(kind):
        return None
    return str(torch.get_autocast_dtype(kind)).removeprefix("torch.")


class SwarmModelForCausalLM(nn.Module):
    """A causal LM whose decoder blocks (and their LoRA adapter) live on swarm peers."""

    accepts_loss_kwargs = True  # transformers' Trainer passes num_items_in_batch and leaves the loss as it is

    def __init__(
        self,
        spec: ModelSpec,
        session: AdapterSession,
        dtype: torch.dtype,
        device: torch.device,
        source: ModelSource | None = None,
    ):
        super().__init__()
        self.spec, self.session, self.dtype, self.device = spec, session, dtype, device
        self.source = source or ModelSource(spec.path)  # where the base model came from: what a saved adapter names
        self.adapter = session.adapter.name
        self.lora_config = lora_config_from_wire(session.adapter.lora)
        self.generation_config = _generation_config(spec)
        self._adapter_on = True
        self._reserved = threading.local()  # a micro-batch id taken in data order for a forward in this thread
        self._ids = threading.Lock()  # forwards in threads (Trainer's pipelined accumulation) take distinct ids
        self._load_local_modules(dtype, device)

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
        # Gemma's scaled embeddings: a float32 scalar cast to the embeddings' dtype at each forward, as its model does
        scale = self.spec.embed_scale
        self.register_buffer("embed_scale", None if scale is None else torch.tensor(scale), persistent=False)
        self.to(device)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings as the family's model computes them (Gemma: scaled by sqrt(hidden_size))."""
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale.to(self.embed_tokens.weight.dtype)
        return hidden

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of the last block's hidden states: final norm, LM head, and (Gemma) the final soft-capping."""
        logits = self.lm_head(self.norm(hidden.to(self.device)))
        cap = self.spec.logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

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
        spot_check: float | None = None,
        min_copies: int = 2,
        resume: str = "committed",
        unreachable_wait: float = 30.0,
        lost_grace: float = LOST_GRACE,
        wire_dtype: str | None = None,
        compression: str = "none",
        grad_compression: str | None = None,
        is_trainable: bool = True,
        chain: bool = True,
        revision: str | None = None,
        token: str | None = None,
        call_hook: CallHook | None = None,
        config: SwarmConfig | None = None,
    ) -> SwarmModelForCausalLM:
        """Join the swarm as a client and open (or resume) ``adapter`` on the peers serving ``model_dir``.

        ``model_dir``: a model folder, or a hub id ``"ORG/NAME"`` (``"ORG/NAME@REVISION"``, or ``revision=``): its
        config and tokenizer are fetched into the Hugging Face cache, and of its weights only the shards holding the
        embeddings, the final norm and the LM head (the blocks are the peers'); ``token`` (else ``HF_TOKEN``) for a
        gated or private repository. Peers must serve the same revision (docs/models-by-name.md).

        ``patience``: seconds to wait when some blocks have no live server (or, on resume, no peer holding the
        adapter's committed step), or when no initial peer answers yet, before raising.
        ``min_copies``: ``opt.step()`` returns only once every block's new state is held by this many peers (live
        replicas plus standby copies), whenever the swarm has that many; fewer is warned about, never an error.
        ``resume``: ``"committed"`` waits for peers holding the adapter's committed step (as recorded in the swarm)
        and raises ``AdapterStateLostError`` if it is gone; ``"latest"`` accepts the newest state the peers still
        hold, and the steps lost are reported in ``model.steps_lost``.
        ``unreachable_wait``: how long a peer that stopped answering but may be alive (frozen, cut off) is waited
        for as the possible holder of the only current state of a block; a peer whose process is gone is not.
        ``lost_grace``: how long a block whose every current copy died (its peers' processes gone, no standby copy
        at the step) waits for them to restart from their checkpoints before its newest surviving copy, one step
        behind, is declared current; that step is lost and listed in ``model.steps_lost`` (a pause of the whole
        swarm costs more than one step of one span's updates). A survivor further behind is waited for up to half
        the ``patience``: restarting holders would bring those steps back.
        ``trainer``: who trains this adapter (default: user@host); the same trainer takes its lease back at once
        after a restart, another one waits for the lease to expire.
        ``swarm_key``: the key file of a private swarm (``swarm keygen``).
        ``spot_check``: fraction of micro-batches whose every hop is also computed on other replicas; a peer
        outvoted by two agreeing replicas is banned for good and listed in ``model.dishonest``. By default a public
        swarm (no ``swarm_key``) checks ``PUBLIC_SPOT_CHECK`` (3 %) of them wherever a span has three replicas, and a
        private one none; a rate given checks wherever a hop has another replica.
        ``wire_dtype`` (``"bfloat16"``, ``"float16"``) and ``compression`` (``"blockwise8"``, ``"hadamard4"``,
        ``"hadamard3"``, and ``"hadamard4sr"`` / ``"hadamard3sr"`` with stochastic rounding): how hidden states and
        their gradients travel; ``grad_compression``: the gradients' own, if they should differ (default: the same).
        All off by default (exact parity with local training), but a bf16 model's hidden states travel in bf16 (they
        are bf16 already). They cut the bytes per step by 2x / ~4x / ~7.5x / ~9.8x at the cost of rounding the
        activations (see BENCHMARKS.md for what that does to the loss). ``"hadamard4d3"`` (``...d4``, ``...d2``):
        for runs that see each sample more than once, a chained forward's hidden states travel as their change since
        the sample's last pass at 3 (4, 2) bits, a first pass at 4; client and peers keep each sample's last hidden
        states for that (at most 1 GiB each, ``swarm peer --delta-references-mb``); everything else goes as hadamard4.
        ``is_trainable=False`` (as in ``peft.PeftModel.from_pretrained``): a reader of an adapter that has committed
        steps, to ``generate`` or evaluate with its newest committed step while its trainer goes on training; it
        takes no lease and changes nothing on any peer. ``lora_config`` and ``seed`` then default to the adapter's.
        ``chain`` (default): hidden states pass from peer to peer, so the client sends a micro-batch in and gets the
        last span's output back, and its own link carries the same bytes whatever the number of spans; ``False``:
        every hop is a round trip from the client (client-driven hops).
        ``call_hook(peer, message, send)``: sees each request the client makes and returns its reply,
        ``send(message)``, with code before or after it (a test recording requests, or killing a peer at one:
        ``swarm.testing.faults.CallTap``); none by default.
        ``config``: all of the options above as one ``swarm.SwarmConfig`` (the keywords then stay at their defaults:
        passing an option both ways is refused).

        size: long for its signature and this documentation, which are the public contract (23 keywords, kept equal
        to ``SwarmConfig``'s fields by a test); what it does is the 30 lines below.
        """
        # every keyword but model_dir and initial_peers is an option of the config (a test keeps both lists equal)
        config = SwarmConfig.given(config, {name: value for name, value in locals().items() if name in OPTIONS})
        source = resolve_model(model_dir, config.revision, config.token)
        spec = load_spec(source.folder, name=source.name)
        source.fetch_client(spec.weight_files)
        lora_config, seed = config.lora_config, config.seed
        if lora_config is not None:
            lora_config = resolve_lora_config(lora_config, spec)  # refused options fail here, before joining
        peers = initial_peers_or_env(initial_peers)
        if not peers:
            raise ValueError("pass initial_peers=[...] (multiaddrs printed by `swarm dht`) or set SWARM_INITIAL_PEERS")
        key = load_swarm_key(config.swarm_key)
        identity = Identity.load_or_create(None)
        dht = join_dht(peers, identity, key, client_mode=True, join_timeout=config.patience)
        if lora_config is None:
            try:
                recorded = committed_or_raise(dht, spec, config.adapter)
            except AdapterStateLostError:
                dht.shutdown()
                raise
            lora_config, seed = lora_config_from_wire(recorded.lora), recorded.seed
        identity_of_adapter = AdapterIdentity(config.adapter, lora_config_to_wire(lora_config), seed)
        session = open_session(spec, dht, identity, key, peers, identity_of_adapter, config)
        try:
            return cls(spec, session, config.dtype, torch.device(config.device), source)
        except BaseException:
            session.close()
            raise

    @property
    def training_session(self) -> TrainingSession:
        """The training session; a reader has none."""
        if not isinstance(self.session, TrainingSession):
            raise ValueError(
                f"training needs a trainer: this client opened adapter {self.adapter!r} with is_trainable=False "
                "(it reads the adapter and generates, while its trainer trains)"
            )
        return self.session

    @property
    def is_trainable(self) -> bool:
        return isinstance(self.session, TrainingSession)

    @property
    def ledger(self) -> StepLedger:
        """The step in progress: which micro-batches were sent, who holds their gradients."""
        return self.training_session.ledger

    @property
    def step(self) -> int:
        """The number of committed optimizer steps of this adapter."""
        return self.session.step

    @property
    def dishonest(self) -> list[PeerID]:
        """Peers caught returning results that their replicas disagree with."""
        return self.session.hops.trust.dishonest

    @property
    def copies(self) -> dict[int, int]:
        """Per block, how many peers hold the state of the last committed step (live replicas + standby copies)."""
        return dict(self.training_session.copies.copies)

    @property
    def steps_lost(self) -> list[StepsLost]:
        """Blocks that lost every current copy of their state and resumed from an older one (empty: none lost)."""
        return self.session.replicas.lost

    @property
    def recoveries(self) -> list[Recovery]:
        """Failures routed around so far (peer, during what, at which step, how long the retry took)."""
        return self.session.recoveries

    def _inputs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stack's input hidden states and mask, on the CPU where the wire takes them; the stack takes the
        caller's autocast too, for the peers to compute under."""
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {list(input_ids.shape)}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must have the shape of input_ids {list(input_ids.shape)}")
        hidden = self._embed(input_ids.to(self.device)).cpu()
        mask = None if attention_mask is None else attention_mask.to(torch.int64).cpu()
        self.session.hops.autocast = autocast_dtype(self.device)
        return hidden, mask

    def _head(
        self, hidden: torch.Tensor, labels: torch.Tensor | None, num_items_in_batch: NumItems = None
    ) -> CausalLMOutputWithPast:
        logits = self._logits(hidden)
        loss = None
        if labels is not None:
            loss = ForCausalLMLoss(
                logits,
                labels.to(self.device),
                vocab_size=self.spec.config.vocab_size,
                num_items_in_batch=num_items_in_batch,
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        num_items_in_batch: NumItems = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """As a transformers causal LM's forward. With ``num_items_in_batch`` (the number of label tokens in the
        whole step, as transformers' Trainer counts them), the loss is the micro-batch's summed token loss divided
        by it, so that ``loss.backward()`` per micro-batch adds up to the gradient of the step's token mean."""
        check_forward_kwargs(kwargs)
        return self._head(self._stack(input_ids, attention_mask), labels, num_items_in_batch)

    def _stack(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The last block's hidden states: through the swarm without gradients, or, with them, as one autograd op
        whose micro-batch id is the one reserved for this thread (``in_micro_batch``) or a fresh one."""
        hidden, mask = self._inputs(input_ids, attention_mask)
        if not torch.is_grad_enabled():
            hidden, _ = self.session.hops.forward(hidden, mask, self.step, None)
            return hidden
        ledger = self.ledger
        micro_batch = getattr(self._reserved, "micro_batch", None)
        self._reserved.micro_batch = None  # one forward per reserved id; another one in the thread takes a new id
        return self._through_stack(hidden, mask, ledger, micro_batch or self.reserve_micro_batch())

    def reserve_micro_batch(self) -> str:
        """A micro-batch id of the step in progress, taken now: ids fix the order in which the peers sum gradients,
        so a caller running micro-batches in threads takes them in data order, then runs each forward inside
        ``in_micro_batch(id)`` (transformers' Trainer glue, swarm/client/trainer.py)."""
        with self._ids:
            return self.training_session.new_micro_batch()

    @contextlib.contextmanager
    def in_micro_batch(self, micro_batch: str) -> Iterator[None]:
        """The next forward with gradients in this thread is ``micro_batch`` (from ``reserve_micro_batch``)."""
        self._reserved.micro_batch = micro_batch
        try:
            yield
        finally:
            self._reserved.micro_batch = None

    def _through_stack(
        self, hidden: torch.Tensor, mask: torch.Tensor | None, ledger: StepLedger, micro_batch: str
    ) -> torch.Tensor:
        """A forward with gradients through the swarm, as one autograd op: ``backward()`` runs the peers'
        backward and records who holds the micro-batch's gradients in the ledger."""
        # The embeddings are frozen: the stack's input gradient would be thrown away, so it is not asked for.
        # (The input is marked as needing one only so that autograd runs the stack's backward at all.)
        return RemoteStackFunction.apply(
            hidden.requires_grad_(True),
            mask,
            self.session.hops,
            ledger,
            micro_batch,
            self.embed_tokens.weight.requires_grad,
        )

    def _trained(
        self,
        hidden: torch.Tensor,
        mask: torch.Tensor | None,
        labels: torch.Tensor | None,
        ledger: StepLedger,
        micro_batch: str,
        num_items_in_batch: NumItems = None,
    ) -> CausalLMOutputWithPast:
        return self._head(self._through_stack(hidden, mask, ledger, micro_batch), labels, num_items_in_batch)

    # What TRL's ``add_fused_lm_head`` (SFTTrainer's loss) and transformers' Trainer read of a causal LM: the config,
    # the backbone (embeddings, the swarm's blocks, the final norm) and the LM head. TRL patches ``forward`` with its
    # fused head, which calls the backbone and scores the labels with ``lm_head.weight``: TRL's own loss, unchanged.

    @property
    def config(self) -> transformers.PretrainedConfig:
        return self.spec.config

    @property
    def base_model(self) -> Callable[..., BaseModelOutput]:
        """The backbone, called as ``model.base_model(input_ids, attention_mask)`` of a transformers causal LM."""

        def backbone(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> BaseModelOutput:
            check_forward_kwargs(kwargs)
            return BaseModelOutput(last_hidden_state=self.norm(self._stack(input_ids, attention_mask).to(self.device)))

        return backbone

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def add_model_tags(self, tags: list[str] | str) -> None:
        """Tags for a model card, as ``PreTrainedModel.add_model_tags`` (TRL's trainers add theirs)."""
        self.model_tags = sorted({*getattr(self, "model_tags", []), *([tags] if isinstance(tags, str) else tags)})

    def activation_checkpointing_enable(self, **kwargs) -> None:
        """Trainer's ``activation_checkpointing=True`` (``gradient_checkpointing``, TRL's default): the activations of
        the blocks are the peers' to keep; the client holds none worth recomputing, so there is nothing to do."""
        logger.info("activation checkpointing: nothing to do on the client, the blocks run on the peers")

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
            self.session.catch_up()  # a reader generates with the newest committed step
        self.session.hops.autocast = autocast_dtype(self.device)  # the peers decode under the caller's autocast too
        chain = SessionChain(
            self.session.hops,
            input_ids.shape[1] + config.max_new_tokens,
            self.adapter if self._adapter_on else None,
            lambda: self.step,
        )
        try:
            return generate_tokens(
                input_ids.to(self.device),
                mask,
                config,
                lambda ids: self._embed(ids).cpu(),
                chain,
                self._logits,
            )
        finally:
            chain.end()

    def train_step(
        self,
        micro_batches: Iterable[Mapping[str, torch.Tensor]],
        accumulation: int | None = None,
        max_in_flight: int | None = None,
        num_items_in_batch: int | None = None,
    ) -> torch.Tensor:
        """Forward and backward of the micro-batches of a step, up to ``max_in_flight`` of them in the swarm at once
        (a pipeline: each span works on one micro-batch while the next span works on another; None: two per live
        server, 4 to 32, so that replicas added make the step faster). Commit with ``optimizer.step()`` as usual.

        The loss is weighted per token, as transformers' Trainer does: the gradients are exactly those of
        ``for b in micro_batches: model(**b, num_items_in_batch=N).loss.backward()``, with ``N`` the label tokens of
        the whole step (counted here for a list; pass ``num_items_in_batch`` for an iterable without a length). With
        ``accumulation``, each micro-batch's mean loss is divided by it instead (every micro-batch weighs the same,
        however many tokens it has). The peers sum the gradients in the order given.

        ``micro_batches``: dicts with ``input_ids``, ``labels`` and optionally ``attention_mask``; a list, or any
        iterable (a generator is read as the pipeline has room).
        Returns the sum of the weighted losses: the step's token-mean loss (or the mean of the micro-batches' mean
        losses, with ``accumulation=len(micro_batches)``).
        """
        if accumulation is not None and num_items_in_batch is not None:
            raise ValueError("pass accumulation or num_items_in_batch, not both")
        if accumulation is not None and accumulation < 1:
            raise ValueError(f"accumulation must be at least 1, got {accumulation}")
        if accumulation is None and num_items_in_batch is None:
            if not isinstance(micro_batches, Sized):
                raise TypeError("pass num_items_in_batch=N (the step's label tokens) or accumulation=N for an iterable")
            micro_batches = list(micro_batches)
            for batch in micro_batches:
                _check_micro_batch(batch)
            num_items_in_batch = sum(label_tokens(batch["labels"]) for batch in micro_batches)
        if num_items_in_batch is not None and num_items_in_batch < 1:
            raise ValueError("the step's micro-batches have no label tokens (every label is -100): nothing to train")
        ledger = self.ledger  # the step's: micro-batch ids come from it in order

        def start(batch: Mapping[str, torch.Tensor]) -> Callable[[], torch.Tensor]:
            _check_micro_batch(batch)
            hidden, mask = self._inputs(batch["input_ids"], batch.get("attention_mask"))
            micro_batch = self.training_session.new_micro_batch()  # here, in order: the canonical order of the sum

            def run() -> torch.Tensor:
                with torch.enable_grad():
                    out = self._trained(hidden, mask, batch["labels"], ledger, micro_batch, num_items_in_batch)
                    loss = out.loss if accumulation is None else out.loss / accumulation
                    loss.backward()
                return loss.detach()

            return run

        if max_in_flight is None:
            tokens = (
                max((b["input_ids"].numel() for b in micro_batches), default=None)
                if isinstance(micro_batches, list)
                else None
            )
            max_in_flight = self.in_flight(tokens)
        return torch.stack(run_pipelined(micro_batches, start, max_in_flight)).sum()

    def in_flight(self, tokens: int | None = None) -> int:
        """How many micro-batches ``train_step`` (and ``SwarmTrainer``) keep in the swarm at once unless told: two
        per live server, 4 to 32, and (for micro-batches of ``tokens``, batch x length) no more than the peers'
        announced bounds on tokens in flight admit."""
        return self.session.router.in_flight(tokens)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the adapter's LoRA gradients on every peer: returns the total norm
        of the step's gradient so far (every block's, as the commit will sum it) and has every replica scale it by
        ``min(1, max_norm / (norm + 1e-6))`` when it commits. Call it after the step's last backward, before
        ``optimizer.step()``. torch's own clips nothing here: the LoRA weights live on the peers.

        A non-finite norm discards the step (nothing is applied) and raises CommitError."""
        max_norm, norm_type = float(max_norm), float(norm_type)
        if not max_norm >= 0 or not norm_type > 0:
            raise ValueError(f"need max_norm >= 0 and norm_type > 0, got {max_norm} and {norm_type}")
        session = self.training_session
        ledger = session.ledger
        if ledger.empty:
            return torch.tensor(0.0)
        norm = session.grad_norm(norm_type)
        if not math.isfinite(norm):
            session.discard_step()
            raise CommitError(
                f"the gradient norm of step {ledger.step} is {norm}: the step is discarded, nothing was applied. "
                "Lower the learning rate, check the data for empty or broken examples, or train in float32"
            )
        ledger.grad_scale *= clip_factor(norm, max_norm)
        return torch.tensor(norm)

    def commit(self, hparams: OptimizerHParams) -> int:
        """Commit the step in progress on every live replica of every block; returns the new step."""
        return self.training_session.commit(hparams)

    def discard_step(self) -> None:
        """Forget the micro-batches of the step in progress (their gradients are never committed)."""
        self.training_session.discard_step()

    def adapter_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """LoRA tensors of every block, from live replicas at the current step."""
        return self.session.adapter_state()

    def replica_digests(self) -> dict[int, dict[PeerID, str]]:
        """Per block, the state digest each live replica reports: equal digests mean identical replicas."""
        return self.session.replica_digests()

    def save_adapter(self, out_dir: str | Path) -> Path:
        """Write a standard peft adapter folder for this model: its base model is the hub id and commit it came from
        (what ``PeftModel.from_pretrained`` and the hub's model cards read), else the model folder's path."""
        base = self.source.repo_id or str(self.spec.path.resolve())
        return save_peft_adapter(out_dir, self.lora_config, base, self.adapter_state(), self.source.commit)

    def __enter__(self) -> SwarmModelForCausalLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Leave the swarm: release the adapter's lease, close this client's P2P connection and DHT node."""
        self.session.close()
