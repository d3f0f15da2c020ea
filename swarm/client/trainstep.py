"""A training step from the model's side: its micro-batches' losses weighed per token (as transformers' Trainer
weighs them), pipelined through the swarm, and the step's gradient clipped over every block of every peer."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sized

import torch

from swarm.client.clipping import clip_factor
from swarm.client.localmodules import LocalModules
from swarm.client.pipeline import run_pipelined
from swarm.client.session import AdapterSession, training_session_of
from swarm.client.stackpath import StackPath
from swarm.net.errors import CommitError

MicroBatches = Iterable[Mapping[str, torch.Tensor]]


def label_tokens(labels: torch.Tensor) -> int:
    """The tokens a causal LM loss counts in ``labels`` (shifted by one, -100 ignored), as transformers' Trainer
    counts ``num_items_in_batch``."""
    return int((labels[..., 1:] != -100).sum())


def _check_micro_batch(batch: Mapping[str, torch.Tensor]) -> None:
    if "input_ids" not in batch or "labels" not in batch:
        raise ValueError(f"a micro-batch needs input_ids and labels, got keys {sorted(batch)}")


def _weighing(
    micro_batches: MicroBatches, accumulation: int | None, num_items_in_batch: int | None
) -> tuple[MicroBatches, int | None]:
    """The micro-batches (a list, where their label tokens were counted here) and the step's label tokens that
    divide each loss (None: ``accumulation`` divides it instead)."""
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
    return micro_batches, num_items_in_batch


class TrainStep:
    """``train_step`` and ``clip_grad_norm_`` of a model: micro-batches through ``path``, scored by ``local``'s head,
    their gradients held by ``session``'s peers."""

    def __init__(self, session: AdapterSession, path: StackPath, local: LocalModules):
        self.session, self.path, self.local = session, path, local

    def run(
        self,
        micro_batches: MicroBatches,
        accumulation: int | None,
        max_in_flight: int | None,
        num_items_in_batch: int | None,
    ) -> torch.Tensor:
        """Forward and backward of the step's micro-batches, pipelined (``SwarmModelForCausalLM.train_step``)."""
        micro_batches, num_items_in_batch = _weighing(micro_batches, accumulation, num_items_in_batch)
        session = training_session_of(self.session)
        ledger = session.ledger  # the step's: micro-batch ids come from it in order

        def start(batch: Mapping[str, torch.Tensor]) -> Callable[[], torch.Tensor]:
            _check_micro_batch(batch)
            hidden, mask = self.path.inputs(batch["input_ids"], batch.get("attention_mask"))
            micro_batch = session.new_micro_batch()  # here, in order: the canonical order of the sum

            def run() -> torch.Tensor:
                with torch.enable_grad():
                    last = self.path.through(hidden, mask, ledger, micro_batch)
                    out = self.local.output(last, batch["labels"], num_items_in_batch)
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
            max_in_flight = self.session.router.in_flight(tokens)
        return torch.stack(run_pipelined(micro_batches, start, max_in_flight)).sum()

    def clip(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """The step's gradient norm over every peer, and its clipping factor recorded for the commit
        (``SwarmModelForCausalLM.clip_grad_norm_``); a non-finite norm discards the step."""
        max_norm, norm_type = float(max_norm), float(norm_type)
        if not max_norm >= 0 or not norm_type > 0:
            raise ValueError(f"need max_norm >= 0 and norm_type > 0, got {max_norm} and {norm_type}")
        session = training_session_of(self.session)
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
