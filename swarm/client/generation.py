"""Generation through the swarm: each span keeps the keys and values of the tokens so far in a session on its peer,
so a new token costs one small request per span. A span whose peer dies (or drops the session) is reopened on
another replica by replaying the prefix it had seen; the spans before it keep their sessions.

The arguments and the result follow transformers' ``generate`` (greedy or sampling with temperature / top-k /
top-p, stopping at the end-of-sequence token, finished rows padded), and greedy output equals local
``PeftModel.generate`` token for token (tested). ``Generator`` is the model's ``generate``: prompts checked, the
folder's generation config updated with the caller's arguments, the chain opened and ended around the loop.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from swarm.client.calls import PeerFailure
from swarm.client.localmodules import LocalModules, autocast_dtype
from swarm.client.remote import RemoteStack
from swarm.client.routing import Hop
from swarm.client.session import AdapterSession, TrainingSession
from swarm.net.errors import RemoteError
from swarm.net.protocol import EndSessionRequest, InferRequest, Method
from swarm.spec import ModelSpec

logger = logging.getLogger(__name__)

# transformers' values for what neither the caller nor the model folder's generation_config.json sets
DEFAULTS = {"max_length": 20, "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}
SUPPORTED = {
    "max_new_tokens",
    "max_length",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "eos_token_id",
    "pad_token_id",
    "bos_token_id",
}


@dataclass
class HopSession:
    """One span's session: where it runs, how many tokens it holds, and (hop by hop) every input it has been sent, to
    replay it elsewhere."""

    hop: Hop
    key: str
    inputs: torch.Tensor | None = None
    length: int = 0


class SessionChain:
    """Sessions through every block for one ``generate`` call: a chain of peers passing each token's hidden states
    on (the stack's default: one client round trip per token), or one request per span from the client."""

    def __init__(self, stack: RemoteStack, max_length: int, adapter: str | None, step: Callable[[], int]):
        self.stack, self.max_length, self.adapter, self.step = stack, max_length, adapter, step
        self.hops: list[HopSession] = []
        self.tokens: torch.Tensor | None = None  # a chain's: the first block's inputs of every token so far

    def __call__(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The output of the last block for the new tokens ``hidden`` (after everything sent before); ``mask``
        (padded prompts) covers every token so far."""
        if self.stack.chain:
            return self._chained(hidden, mask)
        new, index, block = hidden.shape[1], 0, 0
        attempts = self.stack.calls.attempts("generation")
        while block < self.stack.router.num_blocks:
            if index == len(self.hops):
                hop = self.stack.wait_route(block)[0]
                self.hops.append(HopSession(hop, uuid.uuid4().hex))
            session = self.hops[index]
            try:
                outputs = self._send(session, hidden, mask)
            except PeerFailure as e:
                attempts.failed(e, session.hop)
                # everything this block has seen goes to the replacement; the spans after it start over too
                hidden = hidden if session.inputs is None else torch.cat([session.inputs, hidden], dim=1)
                logger.warning("generation: replaying %d tokens from block %d elsewhere", hidden.shape[1], block)
                self.end(self.hops[index:])
                del self.hops[index:]
                continue
            session.inputs = hidden if session.inputs is None else torch.cat([session.inputs, hidden], dim=1)
            session.length = session.inputs.shape[1]
            hidden, block, index = outputs, session.hop.end, index + 1
        attempts.succeeded(self.step())
        return hidden[:, -new:]

    def _chained(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The new tokens through one chain of sessions. Where it breaks, its sessions end and a new chain replays
        every token so far from the first block (the client holds the first block's inputs only)."""
        new = hidden.shape[1]
        attempts = self.stack.calls.attempts("generation")
        while True:
            if not self.hops:
                key = uuid.uuid4().hex
                self.hops = [HopSession(hop, key) for hop in self.stack.wait_route(0)]
            fresh = self.hops[0].length == 0 and self.tokens is not None
            sent = torch.cat([self.tokens, hidden], dim=1) if fresh else hidden
            first, wire = self.hops[0], self.stack.wire
            request = InferRequest(
                session=first.key,
                start=first.hop.start,
                end=first.hop.end,
                position=first.length,
                max_length=self.max_length,
                hidden=wire.cast(sent),
                mask=mask,
                adapter=self.adapter,
                step=self.step(),
                compression=wire.compression,
                route=self.stack.route_of([h.hop for h in self.hops[1:]], Method.INFER, sent),
                autocast=self.stack.autocast,
            )
            try:
                reply, ran = self.stack.chain_ask([h.hop for h in self.hops], request, sent)
                if reply.failure is not None:
                    self.stack.chain_failed(reply.failure, attempts, self.hops[len(ran)].hop)
                else:
                    outputs = self.stack.output_of(reply, first.hop.peer_id)
            except PeerFailure as e:
                attempts.failed(e, first.hop)
                reply = None
            if reply is None or reply.failure is not None:
                logger.warning("generation: the chain broke; replaying %d tokens on a new one", sent.shape[1])
                self.end(self.hops)
                self.hops = []
                continue
            for session in self.hops:
                session.length += sent.shape[1]
            self.tokens = hidden if self.tokens is None else torch.cat([self.tokens, hidden], dim=1)
            attempts.succeeded(self.step())
            return outputs.to(hidden.dtype)[:, -new:]

    def _send(self, session: HopSession, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        hop, wire = session.hop, self.stack.wire
        request = InferRequest(
            session=session.key,
            start=hop.start,
            end=hop.end,
            position=session.length,
            max_length=self.max_length,
            hidden=wire.cast(hidden),
            mask=mask,
            adapter=self.adapter,
            step=self.step(),
            compression=wire.compression,
            autocast=self.stack.autocast,
        )
        units = hidden.shape[0] * hidden.shape[1] * (hop.end - hop.start)
        return self.stack.output_of(self.stack.calls.ask(hop.peer_id, request, units), hop.peer_id).to(hidden.dtype)

    def end(self, sessions: list[HopSession] | None = None) -> None:
        """Free the sessions' keys and values on their peers, all at once (best effort: an idle one expires
        anyway)."""
        opened = [s for s in (self.hops if sessions is None else sessions) if s.length > 0]
        if opened:
            with ThreadPoolExecutor(max_workers=len(opened), thread_name_prefix="swarm-end-session") as pool:
                list(pool.map(self._end_one, opened))

    def _end_one(self, session: HopSession) -> None:
        try:
            self.stack.calls.ask(session.hop.peer_id, EndSessionRequest(session=session.key))
        except (PeerFailure, RemoteError) as e:  # the peer is gone or busy: its timeout frees the session
            logger.debug("could not end generation session on %s: %s", session.hop.peer_id, e)


def resolve_config(base: GenerationConfig, prompt_length: int, kwargs: dict) -> GenerationConfig:
    """The model folder's generation config, updated with the caller's arguments, unset fields at transformers'
    defaults. Arguments this loop does not implement are refused rather than ignored."""
    unknown = sorted(k for k, v in kwargs.items() if k not in SUPPORTED and v is not None)
    if unknown:
        raise ValueError(
            f"generate() through the swarm does not support {unknown}; it supports {sorted(SUPPORTED)} "
            "(greedy or sampling, one sequence per prompt)"
        )
    config = GenerationConfig(**{**base.to_dict(), **{k: v for k, v in kwargs.items() if v is not None}})
    for key, value in DEFAULTS.items():
        if getattr(config, key, None) is None:
            setattr(config, key, value)
    if config.max_new_tokens is None:
        config.max_new_tokens = max(0, config.max_length - prompt_length)
    if (config.num_beams or 1) > 1 or (config.num_return_sequences or 1) > 1:
        raise ValueError("generate() through the swarm does not support beam search or several sequences per prompt")
    return config


def logits_warpers(config: GenerationConfig) -> LogitsProcessorList:
    """Sampling's warpers in transformers' order: temperature, top-k, top-p."""
    warpers = LogitsProcessorList()
    if config.temperature is not None and config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k is not None and config.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
    return warpers


def eos_ids(config: GenerationConfig) -> list[int]:
    eos = config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


@torch.no_grad()
def generate_tokens(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    config: GenerationConfig,
    embed: Callable[[torch.Tensor], torch.Tensor],
    chain: SessionChain,
    head: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The decoding loop: the prompt once, then one token per round; rows that ended get the pad token. A mask
    (left-padded prompts) grows by one real token per round, as in transformers."""
    eos = eos_ids(config)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    warpers = logits_warpers(config) if config.do_sample else None
    sequences = input_ids
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    step_input = input_ids
    for _ in range(config.max_new_tokens):
        logits = head(chain(embed(step_input), attention_mask)[:, -1:]).float()[:, -1]
        if warpers is not None:
            scores = warpers(sequences, logits)
            tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            tokens = logits.argmax(dim=-1)
        tokens = torch.where(unfinished, tokens, torch.full_like(tokens, pad))
        sequences = torch.cat([sequences, tokens[:, None]], dim=1)
        if eos:
            unfinished &= ~torch.isin(tokens, torch.tensor(eos, device=tokens.device))
        if not unfinished.any():
            break
        step_input = tokens[:, None]
        if attention_mask is not None:
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=1)
    return sequences


def folder_generation_config(spec: ModelSpec) -> GenerationConfig:
    """The folder's generation_config.json, else what transformers derives from the model config."""
    if (spec.path / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(spec.path)
    return GenerationConfig.from_model_config(spec.config)


def prompt_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The mask the sessions take: None where every prompt is whole; refused unless padded on the left."""
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, prompt length >= 1], got shape {list(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have the shape of input_ids {list(input_ids.shape)}")
    if attention_mask is not None and not bool(attention_mask[:, -1].bool().all()):
        raise ValueError(
            "prompts of different lengths must be padded on the left for generation (tokenizer.padding_side = "
            '"left"): every prompt must end with a real token'
        )
    return None if attention_mask is None or bool(attention_mask.bool().all()) else attention_mask.long().cpu()


class Generator:
    """A model's ``generate``: tokens decoded through span sessions on ``session``'s peers, embedded and scored by
    ``local``, with the adapter's newest step or (``adapter_off``) the base model."""

    def __init__(self, session: AdapterSession, local: LocalModules):
        self.session, self.local = session, local
        self.adapter_on = True

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        base: GenerationConfig,
        kwargs: dict,
    ) -> torch.Tensor:
        """``input_ids`` continued as ``base`` updated with ``kwargs`` says (``SwarmModelForCausalLM.generate``)."""
        mask = prompt_mask(input_ids, attention_mask)
        config = resolve_config(base, input_ids.shape[1], kwargs)
        session = self.session
        if not isinstance(session, TrainingSession):
            session.catch_up()  # a reader generates with the newest committed step
        session.hops.autocast = autocast_dtype(self.local.device)  # the peers decode under the caller's autocast too
        adapter = session.adapter.name if self.adapter_on else None
        chain = SessionChain(session.hops, input_ids.shape[1] + config.max_new_tokens, adapter, lambda: session.step)
        try:
            return generate_tokens(
                input_ids.to(self.local.device),
                mask,
                config,
                lambda ids: self.local.embed(ids).cpu(),
                chain,
                self.local.logits,
            )
        finally:
            chain.end()

    @contextlib.contextmanager
    def adapter_off(self) -> Iterator[None]:
        """Inside, generation runs the base model (LoRA off on the peers)."""
        self.adapter_on = False
        try:
            yield
        finally:
            self.adapter_on = True
