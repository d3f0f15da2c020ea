"""The remote decoder stack as one autograd op: forward through a chain of peers, backward in reverse."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from swarm.client.ledger import StepLedger
from swarm.routing import Hop, Router
from swarm.transport import Transport
from swarm.wire import Message

logger = logging.getLogger(__name__)


@dataclass
class HopInput:
    """What the client keeps per hop until the step commits: enough to redo the hop anywhere."""

    hop: Hop
    hidden: torch.Tensor


class RemoteStack:
    """Runs blocks [0, n) of one adapter through the swarm and records backward acknowledgements."""

    def __init__(self, transport: Transport, router: Router, adapter: str, timeout: float):
        self.transport, self.router, self.adapter, self.timeout = transport, router, adapter, timeout

    def _tensors(self, hidden: torch.Tensor, mask: torch.Tensor | None, *extra: torch.Tensor) -> list[torch.Tensor]:
        return [hidden, *extra] + ([mask] if mask is not None else [])

    def forward(
        self, hidden: torch.Tensor, mask: torch.Tensor | None, ledger: StepLedger | None, micro_batch: str | None
    ) -> tuple[torch.Tensor, list[HopInput]]:
        inputs = []
        for hop in self.router.route():
            meta = {
                "method": "forward",
                "adapter": self.adapter,
                "start": hop.start,
                "end": hop.end,
                "has_mask": mask is not None,
            }
            if micro_batch is not None:
                meta.update(train=True, step=ledger.step, micro_batch=micro_batch)
            reply = self.transport.call(hop.peer_id, Message(meta, self._tensors(hidden, mask)), self.timeout)
            inputs.append(HopInput(hop, hidden))
            hidden = reply.tensors[0]
        return hidden, inputs

    def backward(
        self,
        inputs: list[HopInput],
        grad_outputs: torch.Tensor,
        mask: torch.Tensor | None,
        ledger: StepLedger,
        micro_batch: str,
    ) -> torch.Tensor:
        for item in reversed(inputs):
            meta = {
                "method": "backward",
                "adapter": self.adapter,
                "start": item.hop.start,
                "end": item.hop.end,
                "step": ledger.step,
                "micro_batch": micro_batch,
                "has_mask": mask is not None,
            }
            message = Message(meta, self._tensors(item.hidden, mask, grad_outputs))
            reply = self.transport.call(item.hop.peer_id, message, self.timeout)
            ledger.acknowledge(micro_batch, item.hop.blocks, item.hop.peer_id)
            grad_outputs = reply.tensors[0]
        return grad_outputs


class RemoteStackFunction(torch.autograd.Function):
    """Autograd glue: the peers compute, this op only moves hidden states and their gradients."""

    @staticmethod
    def forward(ctx, hidden, mask, stack: RemoteStack, ledger: StepLedger, micro_batch: str):
        outputs, inputs = stack.forward(hidden.detach(), mask, ledger, micro_batch)
        ctx.stack, ctx.ledger, ctx.micro_batch, ctx.mask, ctx.inputs = stack, ledger, micro_batch, mask, inputs
        return outputs

    @staticmethod
    def backward(ctx, grad_outputs):
        grad_inputs = ctx.stack.backward(ctx.inputs, grad_outputs.contiguous(), ctx.mask, ctx.ledger, ctx.micro_batch)
        return grad_inputs, None, None, None, None
