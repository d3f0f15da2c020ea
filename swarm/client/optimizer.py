"""AdamW whose state lives on the peers: ``step()`` commits the step's gradients there."""

from __future__ import annotations

import torch

from swarm.client.model import SwarmModelForCausalLM
from swarm.net.protocol import OptimizerHParams


class RemoteOptimizer(torch.optim.Optimizer):
    """torch.optim.AdamW semantics, applied by every peer to its blocks' LoRA at commit time.

    It is a real ``torch.optim.Optimizer`` (over one placeholder tensor) so that LR schedulers can drive
    ``param_groups[0]["lr"]``; the values in effect at ``step()`` are sent with the commit.
    """

    def __init__(
        self,
        model: SwarmModelForCausalLM,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError("need lr >= 0, eps >= 0, weight_decay >= 0 and 0 <= betas < 1")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__([torch.zeros(1, requires_grad=True)], defaults)
        self.model = model

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        group = self.param_groups[0]
        hparams = OptimizerHParams(
            lr=float(group["lr"]),
            betas=(float(group["betas"][0]), float(group["betas"][1])),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
        )
        self.model.commit(hparams)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are committed (and cleared) by ``step()``; a zero_grad without a step discards them."""
        if not self.model.ledger.empty:
            self.model.discard_step()
