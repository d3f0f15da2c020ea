"""The model a user trains: local embeddings, norm and LM head around a remote stack of LoRA'd blocks. It is the
user's contract (transformers' and peft's names included); the work is its collaborators': the local modules
(swarm/client/localmodules.py), the path through the remote stack (swarm/client/stackpath.py), the training step
(swarm/client/trainstep.py), generation (swarm/client/generation.py), and everything about the adapter in the swarm
(lease, ledger, replicas, commits, copies) its session's."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import peft
import torch
import transformers
from hivemind.p2p import PeerID
from torch import nn
from transformers import GenerationConfig
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutputWithPast

from swarm.blocks import lora_config_from_wire
from swarm.client.calls import CallHook, Recovery
from swarm.client.commit import LOST_GRACE, StepsLost
from swarm.client.config import OPTIONS, SwarmConfig
from swarm.client.export import save_peft_adapter
from swarm.client.generation import Generator, folder_generation_config
from swarm.client.ledger import StepLedger
from swarm.client.localmodules import LocalModules, NumItems
from swarm.client.opening import model_folder, open_adapter
from swarm.client.session import AdapterSession, TrainingSession, training_session_of
from swarm.client.stackpath import StackPath
from swarm.client.trainstep import TrainStep
from swarm.hub import ModelSource
from swarm.net.protocol import OptimizerHParams
from swarm.spec import ModelSpec

logger = logging.getLogger(__name__)

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


class SwarmModelForCausalLM(nn.Module):
    """A causal LM whose decoder blocks (and their LoRA adapter) live on swarm peers.

    size: its methods are the user's contract, documented in README.md and docs/client-api.md and scripted against:
    ``from_pretrained``, ``forward``, ``generate``, ``train_step``, ``clip_grad_norm_``, ``commit``,
    ``discard_step``, ``save_adapter``, ``adapter_state``, ``replica_digests``, ``in_flight``,
    ``reserve_micro_batch`` / ``in_micro_batch`` (SwarmTrainer's), ``shutdown`` and the context manager; the
    properties ``training_session``, ``is_trainable``, ``ledger``, ``step``, ``dishonest``, ``copies``,
    ``steps_lost``, ``recoveries``; and what transformers' Trainer, TRL and peft read of a causal LM (``config``,
    ``base_model``, ``get_output_embeddings``, ``add_model_tags``, ``activation_checkpointing_enable``,
    ``disable_adapter``). Each is a thin delegation to the session or a collaborator given or made at construction:
    the local modules, the stack path, the training step, the generator.
    """

    accepts_loss_kwargs = True  # transformers' Trainer passes num_items_in_batch and leaves the loss as it is

    def __init__(
        self, spec: ModelSpec, session: AdapterSession, local: LocalModules, source: ModelSource | None = None
    ):
        super().__init__()
        self.spec, self.session, self.local = spec, session, local  # local: the only tensors of the model read here
        self.dtype, self.device = local.dtype, local.device
        self.source = source or ModelSource(spec.path)  # where the base model came from: what a saved adapter names
        self.adapter = session.adapter.name
        self.lora_config = lora_config_from_wire(session.adapter.lora)
        self.generation_config = folder_generation_config(spec)
        self.path = StackPath(session, local)
        self.steps = TrainStep(session, self.path, local)
        self.generator = Generator(session, local)

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
        Every other keyword is an option of ``swarm.SwarmConfig``, under the same name and default, documented there
        and in docs/client-api.md. ``config``: all of them as one ``swarm.SwarmConfig`` (the keywords then stay at
        their defaults: passing an option both ways is refused).
        """
        # every keyword but model_dir and initial_peers is an option of the config (a test keeps both lists equal)
        config = SwarmConfig.given(config, {name: value for name, value in locals().items() if name in OPTIONS})
        source, spec = model_folder(model_dir, config)
        session = open_adapter(spec, initial_peers, config)
        try:
            return cls(spec, session, LocalModules(spec, config.dtype, torch.device(config.device)), source)
        except BaseException:
            session.close()
            raise

    @property
    def training_session(self) -> TrainingSession:
        """The training session; a reader has none."""
        return training_session_of(self.session)

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
        return self.local.output(self.path.hidden(input_ids, attention_mask), labels, num_items_in_batch)

    def reserve_micro_batch(self) -> str:
        """A micro-batch id of the step in progress, taken now: ids fix the order in which the peers sum gradients,
        so a caller running micro-batches in threads takes them in data order, then runs each forward inside
        ``in_micro_batch(id)`` (transformers' Trainer glue, swarm/client/trainer.py)."""
        return self.path.reserve_micro_batch()

    def in_micro_batch(self, micro_batch: str) -> contextlib.AbstractContextManager[None]:
        """The next forward with gradients in this thread is ``micro_batch`` (from ``reserve_micro_batch``)."""
        return self.path.in_micro_batch(micro_batch)

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
            return BaseModelOutput(last_hidden_state=self.local.norm(self.path.hidden(input_ids, attention_mask)))

        return backbone

    def get_output_embeddings(self) -> nn.Linear:
        return self.local.lm_head

    def add_model_tags(self, tags: list[str] | str) -> None:
        """Tags for a model card, as ``PreTrainedModel.add_model_tags`` (TRL's trainers add theirs)."""
        self.model_tags = sorted({*getattr(self, "model_tags", []), *([tags] if isinstance(tags, str) else tags)})

    def activation_checkpointing_enable(self, **kwargs) -> None:
        """Trainer's ``activation_checkpointing=True`` (``gradient_checkpointing``, TRL's default): the activations of
        the blocks are the peers' to keep; the client holds none worth recomputing, so there is nothing to do."""
        logger.info("activation checkpointing: nothing to do on the client, the blocks run on the peers")

    def disable_adapter(self) -> contextlib.AbstractContextManager[None]:
        """Inside, ``generate`` runs the base model (LoRA off on the peers), as ``PeftModel.disable_adapter`` does."""
        return self.generator.adapter_off()

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
        return self.generator(input_ids, attention_mask, generation_config or self.generation_config, kwargs)

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
        return self.steps.run(micro_batches, accumulation, max_in_flight, num_items_in_batch)

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
        return self.steps.clip(max_norm, norm_type)

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
