"""A dishonest peer for tests: `swarm peer` whose forward outputs are perturbed, everything else honest."""

from __future__ import annotations

import torch

from peers.backend import SpanBackend
from swarm.ops.cli import main

_honest_forward = SpanBackend.forward


def _corrupt_forward(self, *args, **kwargs) -> torch.Tensor:
    outputs = _honest_forward(self, *args, **kwargs)
    return outputs + 0.05 * outputs.abs().mean() * torch.randn_like(outputs)


SpanBackend.forward = _corrupt_forward

if __name__ == "__main__":
    main()
