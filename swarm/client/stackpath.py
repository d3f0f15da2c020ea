"""The path of a forward through the swarm's blocks: the tokens embedded here, the remote stack, the last block's
hidden states back. With gradients, the stack is one autograd op of a micro-batch of the step in progress, whose id
fixes its place in the peers' sum."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from swarm.client.ledger import StepLedger
from swarm.client.localmodules import LocalModules, autocast_dtype
from swarm.client.remote import RemoteStackFunction
from swarm.client.session import AdapterSession, training_session_of


class StackPath:
    """Forwards through ``session``'s remote stack from ``local``'s embeddings; micro-batch ids reserved per thread."""

    def __init__(self, session: AdapterSession, local: LocalModules):
        self.session, self.local = session, local
        self._reserved = threading.local()  # a micro-batch id taken in data order for a forward in this thread
        self._ids = threading.Lock()  # forwards in threads (Trainer's pipelined accumulation) take distinct ids

    def inputs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stack's input hidden states and mask, on the CPU where the wire takes them; the stack takes the
        caller's autocast too, for the peers to compute under."""
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {list(input_ids.shape)}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must have the shape of input_ids {list(input_ids.shape)}")
        hidden = self.local.embed(input_ids.to(self.local.device)).cpu()
        mask = None if attention_mask is None else attention_mask.to(torch.int64).cpu()
        self.session.hops.autocast = autocast_dtype(self.local.device)
        return hidden, mask

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The last block's hidden states: through the swarm without gradients, or, with them, as one autograd op
        whose micro-batch id is the one reserved for this thread (``in_micro_batch``) or a fresh one."""
        hidden, mask = self.inputs(input_ids, attention_mask)
        if not torch.is_grad_enabled():
            hidden, _ = self.session.hops.forward(hidden, mask, self.session.step, None)
            return hidden
        ledger = training_session_of(self.session).ledger
        micro_batch = getattr(self._reserved, "micro_batch", None)
        self._reserved.micro_batch = None  # one forward per reserved id; another one in the thread takes a new id
        return self.through(hidden, mask, ledger, micro_batch or self.reserve_micro_batch())

    def through(
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
            self.local.embed_tokens.weight.requires_grad,
        )

    def reserve_micro_batch(self) -> str:
        """A micro-batch id of the step in progress, taken now (``SwarmModelForCausalLM.reserve_micro_batch``)."""
        with self._ids:
            return training_session_of(self.session).new_micro_batch()

    @contextlib.contextmanager
    def in_micro_batch(self, micro_batch: str) -> Iterator[None]:
        """The next forward with gradients in this thread is ``micro_batch`` (from ``reserve_micro_batch``)."""
        self._reserved.micro_batch = micro_batch
        try:
            yield
        finally:
            self._reserved.micro_batch = None
