"""The error a block shows in a peer's numerics against exact fp32 from the same stored weights, measured when the
peer loads it and announced with it (swarm/net/numerics.py): what a spot check across numerics classes allows.

The probe is a seeded input with outlier channels (as LLM residual streams have), a seeded output gradient and a
seeded LoRA on every linear layer (B not zero, so that every LoRA gradient is live); the error is the largest
relative difference of the output, the input gradient and each LoRA gradient. Everything is seeded, so every peer
of one class measures the same error for a block."""

from __future__ import annotations

import copy
import logging

import peft
import torch
from torch import nn

from peers.layers import run_layers
from swarm.blocks import add_lora, load_block
from swarm.spec import ModelSpec

logger = logging.getLogger(__name__)

PROBE_TOKENS = 32
OUTLIER_CHANNELS, OUTLIER_SCALE = 4, 20.0
PROBE_LORA = "calibration-probe"
PROBE_RANK, PROBE_B_SCALE = 8, 0.02


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference over the larger of the two largest magnitudes (what spot checks compare)."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    scale = max(a.abs().max().item(), b.abs().max().item(), 1e-12)
    return (a - b).abs().max().item() / scale


def exact(quant: str, dtype: torch.dtype) -> bool:
    """Numerics with nothing to measure: fp32 from the stored weights is the reference itself."""
    return quant == "none" and dtype == torch.float32


def block_error(
    spec: ModelSpec,
    block: int,
    served: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    stored: dict[str, torch.Tensor] | None = None,
) -> float:
    """The largest relative difference between ``served`` (a loaded block, untouched: the probe runs on a copy) and
    the same block in exact fp32, on the seeded probe (``stored``: the block's tensors, if read already). The fp32
    reference is built and run in host memory, never on the serving device: a 70B block in fp32 is 3.4 GB, which a
    GPU serving a span (or loading a move beside it) does not have to spare."""
    host = torch.device("cpu")
    generator = torch.Generator().manual_seed(block)
    shape = (1, PROBE_TOKENS, spec.config.hidden_size)
    hidden = torch.randn(shape, generator=generator)
    hidden[..., :OUTLIER_CHANNELS] *= OUTLIER_SCALE
    grad = torch.randn(shape, generator=generator)
    reference = load_block(spec, block, host, torch.float32, "none", stored)
    reference_rotary = spec.family_class("RotaryEmbedding")(config=spec.config)
    out_a, grad_a, lora_a = _probe(spec, block, reference, reference_rotary, hidden, grad, host, torch.float32)
    del reference
    probe = copy.deepcopy(served)
    rotary = spec.family_class("RotaryEmbedding")(config=spec.config).to(device)
    out_b, grad_b, lora_b = _probe(spec, block, probe, rotary, hidden, grad, device, dtype)
    pairs = [(out_a, out_b), (grad_a, grad_b), *zip(lora_a, lora_b, strict=True)]
    return max(relative_difference(a, b) for a, b in pairs)


def _probe(
    spec: ModelSpec,
    block: int,
    layer: nn.Module,
    rotary: nn.Module,
    hidden: torch.Tensor,
    grad: torch.Tensor,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The block's output, input gradient and LoRA gradients on the probe, with the probe's LoRA added."""
    targets = sorted({name.rsplit(".", 1)[-1] for name, m in layer.named_modules() if "Linear" in type(m).__name__})
    config = peft.LoraConfig(r=PROBE_RANK, lora_alpha=2 * PROBE_RANK, target_modules=targets)
    params = add_lora(layer, spec, block, PROBE_LORA, config, seed=0)
    b_values = torch.Generator().manual_seed(block)
    with torch.no_grad():
        for lp in params:
            if "lora_B" in lp.name:
                lp.param.copy_(torch.randn(lp.param.shape, generator=b_values) * PROBE_B_SCALE)
    inputs = hidden.to(device, dtype).detach().requires_grad_(True)
    outputs = run_layers(spec, {block: layer}, rotary, inputs, None, range(block, block + 1))
    outputs.backward(grad.to(device, outputs.dtype))
    return outputs.detach(), inputs.grad, [lp.param.grad for lp in params]
