"""The span of blocks a peer holds and what it computes on them: forward, backward (the LoRA gradients go to the
adapters' store, peers/adapters.py), generation, and this peer's numerics."""

from __future__ import annotations

import contextlib
import logging

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from tqdm.auto import tqdm
from transformers import DynamicCache

from peers.adapters import AdapterStore
from peers.behaviour import Behaviour
from peers.calibration import block_error, exact
from peers.inference import InferenceSession, InferenceSessions
from peers.layers import run_layers
from peers.state import BlockAdapter
from swarm.blocks import load_block, spans_text, stored_tensors
from swarm.dropout import dropout_masks
from swarm.net import hostsync
from swarm.net.errors import MissingForwardError, NotServedError, RequestError, SessionLostError
from swarm.net.numerics import Numerics
from swarm.net.protocol import InferRequest
from swarm.spec import ModelSpec

logger = logging.getLogger(__name__)


class SpanBackend:
    """The blocks a peer serves and what it computes on them; the LoRA it runs and the gradients it leaves are the
    ``adapters`` store's. Not thread-safe: one caller at a time (the service's compute thread); only ``load_layers``
    is safe to run elsewhere, since it touches nothing shared."""

    def __init__(
        self,
        spec: ModelSpec,
        blocks: range,
        device: torch.device,
        dtype: torch.dtype,
        quant: str,
        adapters: AdapterStore,
        max_tokens: int = 1 << 16,
        inference_bytes: int = 1 << 30,
        inference_timeout: float = 300.0,
        behaviour: Behaviour | None = None,
    ):
        self.spec, self.device, self.dtype, self.quant, self.max_tokens = spec, device, dtype, quant, max_tokens
        self.adapters = adapters
        self.behaviour = behaviour  # what it does to its outputs (peers/behaviour.py): None, nothing
        self.layers: dict[int, nn.Module] = {}
        self.errors: dict[int, float] = {}  # block -> its error against exact fp32 (peers/calibration.py)
        self.rotary = spec.family_class("RotaryEmbedding")(config=spec.config).to(device)
        self.sessions = InferenceSessions(inference_bytes, inference_timeout)
        self.install(self.load_layers(blocks))

    @property
    def blocks(self) -> list[int]:
        return sorted(self.layers)

    # --- which blocks ---------------------------------------------------------------------------------------

    def load_layers(self, blocks: range) -> dict[int, nn.Module]:
        """Read and build blocks from the model folder, and measure each one's error in this peer's numerics (slow;
        runs beside serving, shares nothing but the errors it records)."""
        if not 0 <= blocks.start < blocks.stop <= self.spec.num_blocks:
            raise ValueError(
                f"blocks {blocks.start}:{blocks.stop} are outside the model's blocks 0:{self.spec.num_blocks}"
            )
        wanted = [block for block in blocks if block not in self.layers]
        layers = {}
        for block in tqdm(wanted, desc=f"loading blocks {blocks.start}:{blocks.stop}", unit="block"):
            stored = stored_tensors(self.spec, block)  # read once: for the block, and for its measurement
            layers[block] = load_block(self.spec, block, self.device, self.dtype, self.quant, stored)
            if not exact(self.quant, self.dtype):
                self.errors[block] = block_error(self.spec, block, layers[block], self.device, self.dtype, stored)
        if wanted and not exact(self.quant, self.dtype):
            measured = ", ".join(f"{block}: {self.errors[block]:.3g}" for block in wanted)
            logger.info("error against exact fp32 per block (what spot checks across numerics allow): %s", measured)
        return layers

    def install(self, layers: dict[int, nn.Module]) -> None:
        """Start serving loaded blocks (with every adapter's LoRA on them)."""
        self.layers.update(layers)
        self.adapters.serve(layers)

    def remove(self, blocks: list[int]) -> None:
        """Stop serving blocks; their adapter state stays as standby copies (a peer that moves keeps them)."""
        for block in blocks:
            self.layers.pop(block, None)
        self.adapters.unserve(blocks)

    def numerics(self, blocks: range) -> Numerics:
        """How this peer computes ``blocks``, as it announces it (swarm/net/numerics.py)."""
        errors = {block: self.errors[block] for block in blocks if block in self.errors}  # not yet measured: the cap
        return Numerics(self.quant, str(self.dtype).removeprefix("torch."), self.device.type, errors)

    def store_use(self) -> dict[str, int]:
        """Bytes in use, and bounds, of the stores that requests fill: what a peer reports of its memory."""
        kept, cache = self.adapters.kept, self.adapters.cache
        return dict(
            kept_inputs=kept.bytes,
            kept_inputs_max=kept.max_bytes,
            activation_cache=cache.bytes,
            activation_cache_max=cache.max_bytes,
            inference=self.sessions.reserved,
            inference_max=self.sessions.budget,
            tokens_in_flight=self.adapters.in_flight_tokens.tokens,
            tokens_in_flight_max=self.adapters.in_flight_tokens.bound,
        )

    # --- compute --------------------------------------------------------------------------------------------

    def _activate(self, name: str) -> None:
        for layer in self.layers.values():
            for module in layer.modules():
                if isinstance(module, BaseTunerLayer):
                    module.set_adapter(name)

    def _check_range(self, start: int, end: int) -> range:
        if start >= end:
            raise RequestError(f"empty block range {start}:{end}")
        if not all(block in self.layers for block in range(start, end)):
            raise NotServedError(
                f"blocks {start}:{end} are not all served here (this peer serves {spans_text(self.blocks)})"
            )
        return range(start, end)

    def run(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        blocks: range,
        cache: DynamicCache | None = None,
        position: int = 0,
    ) -> torch.Tensor:
        """The span's forward, with masks and rotary embeddings built exactly as the family's model builds them
        (``cache``, ``position``: see ``run_layers``)."""
        return run_layers(self.spec, self.layers, self.rotary, hidden, attention_mask, blocks, cache, position)

    # --- generation -----------------------------------------------------------------------------------------

    def kv_bytes(self, blocks: range, batch: int, length: int) -> int:
        """Keys and values of ``batch`` x ``length`` tokens in ``blocks``, in this peer's compute dtype."""
        config = self.spec.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        per_token = 2 * config.num_key_value_heads * head_dim * torch.finfo(self.dtype).bits // 8
        return per_token * batch * length * len(blocks)

    def infer(self, request: InferRequest, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """New tokens through the span in a generation session (opened at position 0); never changes any state but
        the session's keys and values. Runs the adapter's last committed step, or the base model. A request that
        fails half-way ends its session: the client replays the prefix."""
        blocks = request.blocks
        if not blocks or any(block not in self.layers for block in blocks):
            self.sessions.end(request.session)
            raise SessionLostError(
                f"blocks {spans_text(blocks)} are not all served here (this peer serves {spans_text(self.blocks)})"
            )
        self._check_hidden(hidden, None)
        batch, length = hidden.shape[:2]
        if attention_mask is not None and attention_mask.shape != (batch, request.position + length):
            raise RequestError(
                f"a generation request's attention_mask covers every token so far: [{batch}, "
                f"{request.position + length}], got {list(attention_mask.shape)}"
            )
        if request.adapter is None:
            lora = self._lora_off()
        else:
            self.adapters.states(self.adapters.adapter(request.adapter), blocks, request.step, or_later=True)
            self._activate(request.adapter)
            lora = contextlib.nullcontext()
        session = self._session(request, batch, length)
        try:
            with torch.no_grad(), lora, self._autocast(request.autocast):
                mask = None if attention_mask is None else attention_mask.to(self.device)
                outputs = self.run(hidden.to(self.device, self.dtype), mask, blocks, session.cache, session.length)
        except BaseException:
            self.sessions.end(request.session)
            raise
        session.length += length
        return hostsync.one_to_host(outputs.to(hidden.dtype))

    def _session(self, request: InferRequest, batch: int, length: int) -> InferenceSession:
        """The request's session: opened (position 0) with room for ``max_length`` tokens, or continued."""
        if request.position == 0:
            if batch * request.max_length > self.max_tokens or length > request.max_length:
                raise RequestError(
                    f"a generation of {batch}x{request.max_length} tokens (prompt + max_new_tokens, times the batch) "
                    f"exceeds this peer's --max-tokens of {self.max_tokens}; shorten the prompt or max_new_tokens"
                )
            reserve = self.kv_bytes(request.blocks, batch, request.max_length)
            cache = DynamicCache(config=self.spec.config)
            return self.sessions.open(request.session, request.blocks, batch, request.max_length, reserve, cache)
        session = self.sessions.get(request.session)
        if session.blocks != request.blocks or session.batch != batch or session.length != request.position:
            raise RequestError(
                f"generation session {request.session} holds blocks {spans_text(session.blocks)}, a batch of "
                f"{session.batch} and {session.length} tokens; the request does not continue it"
            )
        if session.length + length > session.max_length:
            raise RequestError(
                f"generation session {request.session} was opened for {session.max_length} tokens; open a longer one"
            )
        return session

    def _autocast(self, dtype: str | None) -> contextlib.AbstractContextManager:
        """The client's autocast (a Trainer's ``bf16=True``), on this peer's device: the span computes what it would
        inside the client's own model."""
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, dtype))

    @contextlib.contextmanager
    def _lora_off(self):
        """The base model: every LoRA layer bypassed while inside (peft's own switch)."""
        tuners = [m for layer in self.layers.values() for m in layer.modules() if isinstance(m, BaseTunerLayer)]
        for module in tuners:
            module.enable_adapters(False)
        try:
            yield
        finally:
            for module in tuners:
                module.enable_adapters(True)

    def _check_hidden(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        if hidden.ndim != 3 or hidden.shape[-1] != self.spec.hidden_size:
            raise RequestError(f"hidden states must be [batch, seq, {self.spec.hidden_size}], got {list(hidden.shape)}")
        if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise RequestError(f"hidden states must be float32, bfloat16 or float16, got {hidden.dtype}")
        if hidden.shape[0] * hidden.shape[1] > self.max_tokens:
            raise RequestError(
                f"{hidden.shape[0]}x{hidden.shape[1]} tokens exceed this peer's limit of {self.max_tokens} "
                "(--max-tokens); send smaller micro-batches"
            )
        if attention_mask is not None and attention_mask.shape != hidden.shape[:2]:
            raise RequestError(f"attention_mask must be {list(hidden.shape[:2])}, got {list(attention_mask.shape)}")
        if not torch.isfinite(hidden).all():
            raise RequestError("hidden states contain NaN or Inf")

    def forward(
        self,
        name: str,
        blocks: range,
        step: int,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        micro_batch: str | None = None,
        autocast: str | None = None,
    ) -> torch.Tensor:
        """Run the span at ``step`` (under the client's ``autocast`` dtype, if it runs one). For a training
        micro-batch, keep its input until the step commits (a chained backward brings none), and each block's input
        in the activation cache, so that the backward recomputes one block at a time (``_block_inputs``)."""
        blocks = self._check_range(blocks.start, blocks.stop)
        self._check_hidden(hidden, attention_mask)
        store = self.adapters
        adapter = store.adapter(name) if micro_batch is None else store.trained(name, micro_batch)
        store.states(adapter, blocks, step, or_later=micro_batch is None)
        self._activate(name)
        inputs = hidden.to(self.device, self.dtype)
        mask = None if attention_mask is None else attention_mask.to(self.device)
        if micro_batch is None:
            with torch.no_grad(), self._autocast(autocast):
                return self._hand_on(hostsync.one_to_host(self.run(inputs, mask, blocks).to(hidden.dtype)))
        key = (name, micro_batch, blocks.start, blocks.stop)
        store.in_flight_tokens.admit(key, hidden.shape[0] * hidden.shape[1])
        try:
            store.kept.put(key, hidden, attention_mask)
            with torch.no_grad(), dropout_masks(adapter.seed, micro_batch), self._autocast(autocast):
                block_inputs, outputs = self._block_inputs(inputs, mask, blocks)
        except BaseException:
            store.in_flight_tokens.end(key)
            raise
        store.cache.put(key, block_inputs, mask)
        return self._hand_on(hostsync.one_to_host(outputs.to(hidden.dtype)))

    def _block_inputs(
        self, inputs: torch.Tensor, mask: torch.Tensor | None, blocks: range
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The span's forward one block at a time, without a graph: each block's input, and the span's output. A
        training forward keeps no graph, only these: a backward recomputes one block at a time with grad, so a peer's
        activation memory is one block's graph plus one hidden-sized tensor per block, whatever the span's length
        (a whole-span graph kept about 22 hidden-sized tensors per block: 33 GiB for 27 blocks of a 70B model at
        2048 tokens). The inputs stay on the compute device, where the backward needs them: they are a 22nd of a
        graph, and keeping them in pinned host memory would cost two copies across the bus per block and micro-batch
        to save little. Bit for bit the whole span's forward: ``run`` builds the same masks and rotary embeddings
        for one block as for the span."""
        kept = []
        hidden = inputs
        for block in blocks:
            kept.append(hidden)
            hidden = self.run(hidden, mask, range(block, block + 1))
        return kept, hidden

    def _hand_on(self, outputs: torch.Tensor) -> torch.Tensor:
        """A forward's outputs as the caller gets them: as computed, unless this peer's behaviour changes them."""
        return outputs if self.behaviour is None else self.behaviour.forward(outputs)

    def backward(
        self,
        name: str,
        blocks: range,
        step: int,
        micro_batch: str,
        hidden: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        grad_outputs: torch.Tensor,
        input_grad: bool = True,
        autocast: str | None = None,
    ) -> torch.Tensor | None:
        """Gradient w.r.t. the span input (None unless ``input_grad``); LoRA gradients are kept per (micro-batch,
        block), counted once. Without ``hidden`` the forward this peer ran for the micro-batch is used: its blocks'
        inputs if still cached, else its kept input, run again without a graph to rebuild them. Then one block at a
        time, last to first: the block recomputed with grad (the forward's dropout masks and autocast), its graph
        back-propagated with its output's gradient and freed; the gradient of its input is the previous block's
        output gradient. The same bits as a backward through the whole span's graph, at one block's graph."""
        blocks = self._check_range(blocks.start, blocks.stop)
        self._check_hidden(grad_outputs if hidden is None else hidden, attention_mask)
        if hidden is not None and grad_outputs.shape != hidden.shape:
            raise RequestError(f"output gradients must be {list(hidden.shape)}, got {list(grad_outputs.shape)}")
        if not torch.isfinite(grad_outputs).all():
            raise RequestError("output gradients contain NaN or Inf")
        store = self.adapters
        adapter = store.trained(name, micro_batch)
        states = store.states(adapter, blocks, step)
        self._activate(name)
        key = (name, micro_batch, blocks.start, blocks.stop)
        block_inputs, mask = self._inputs_for_backward(key, adapter.seed, hidden, attention_mask, autocast)
        if grad_outputs.shape != block_inputs[0].shape:
            raise RequestError(
                f"output gradients must be {list(block_inputs[0].shape)}, got {list(grad_outputs.shape)}"
            )
        seeded = (adapter.seed, micro_batch, autocast)
        gradient, grads_of = self._backward_blocks(blocks, states, block_inputs, mask, grad_outputs, input_grad, seeded)
        store.hold_grads(states, micro_batch, [g for block in states for g in grads_of[block]])
        store.in_flight_tokens.end(key)
        return None if not input_grad else hostsync.one_to_host(gradient.to(grad_outputs.dtype))

    def _inputs_for_backward(
        self,
        key: tuple[str, str, int, int],
        seed: int,
        hidden: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        autocast: str | None,
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Each block's input and the mask: from the activation cache, else the forward again from ``hidden`` or
        the kept span input, without a graph."""
        _, micro_batch, start, stop = key
        store = self.adapters
        cached = store.cache.pop(key)
        if cached is not None:
            return cached
        kept = store.kept.get(key)
        if hidden is None and kept is None:
            raise MissingForwardError(f"no forward of micro-batch {micro_batch} kept here; send its input")
        if hidden is None:
            hidden, attention_mask = kept
        inputs = hidden.to(self.device, self.dtype)
        mask = None if attention_mask is None else attention_mask.to(self.device)
        # the forward again, without a graph, up to the last block's input: its dropout masks, its autocast
        with torch.no_grad(), dropout_masks(seed, micro_batch), self._autocast(autocast):
            before_last, last_input = self._block_inputs(inputs, mask, range(start, stop - 1))
        return [*before_last, last_input], mask

    def _backward_blocks(
        self,
        blocks: range,
        states: dict[int, BlockAdapter],
        block_inputs: list[torch.Tensor],
        mask: torch.Tensor | None,
        grad_outputs: torch.Tensor,
        input_grad: bool,
        seeded: tuple[int, str, str | None],
    ) -> tuple[torch.Tensor | None, dict[int, list[torch.Tensor]]]:
        """One block at a time, last to first, recomputed with grad (``seeded``: the forward's dropout seed,
        micro-batch and autocast) and back-propagated: the span input's gradient and each block's LoRA gradients."""
        seed, micro_batch, autocast = seeded
        grads_of: dict[int, list[torch.Tensor]] = {}
        gradient = grad_outputs
        for block in reversed(blocks):
            block_input = block_inputs.pop().detach()  # each block's input freed once its backward ran
            params = [lp.param for lp in states[block].params]
            wants_input = input_grad or block > blocks.start
            wanted = [block_input.requires_grad_(True), *params] if wants_input else params
            if not wanted:  # the span's first block, without LoRA, and no input gradient asked for
                grads_of[block] = []
                continue
            # the block again, with grad: the forward's dropout masks (drawn per block) and autocast
            with torch.enable_grad(), dropout_masks(seed, micro_batch), self._autocast(autocast):
                outputs = self.run(block_input, mask, range(block, block + 1))
            gradient = gradient.to(outputs.device, outputs.dtype)
            grads = list(torch.autograd.grad(outputs, wanted, gradient))
            del outputs  # the block's graph: autograd.grad has freed its saved tensors
            gradient = grads.pop(0) if wants_input else None
            grads_of[block] = grads
        return gradient, grads_of
