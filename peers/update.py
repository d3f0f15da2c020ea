"""The update every holder of a block applies: AdamW built from correctly rounded elementwise operations only.

Replicas vote with exact digests, so every holder must turn the same gradient bits into the same state bits, on any
device, kernel set and torch version. torch's AdamW does not: its fused and vectorized paths (lerp, addcmul, addcdiv,
foreach and fused kernels) contract multiplies and adds into fused multiply-adds where the hardware has them, and so
round differently on AVX2 than under ``ATEN_CPU_CAPABILITY=default``, and on a GPU than on a CPU. Here each step is
one operation rounded once, in its own kernel, in a fixed order: multiply, add, divide by a tensor, and a square root
taken through float64 (torch's float32 root on CPU is not correctly rounded). Never a division by a scalar (torch
multiplies by a reciprocal it computes itself); scalars are computed in float64 from multiplications and one square
root (no ``pow``, whose last bit differs between math libraries). Within fp32 rounding it is torch's AdamW (decoupled
weight decay, bias corrections); the state keeps torch's keys, so checkpoints and copies read the same.
"""

from __future__ import annotations

import math

import torch

from swarm.net import hostsync
from swarm.net.protocol import OptimizerHParams

MOMENTS = ("step", "exp_avg", "exp_avg_sq")


def one_minus_power(beta: float, step: int) -> float:
    """``1 - beta ** step`` by repeated squaring: multiplications only, so the same double on every platform."""
    result, base, exponent = 1.0, beta, step
    while exponent:
        if exponent & 1:
            result *= base
        base *= base
        exponent >>= 1
    return 1.0 - result


def correctly_rounded_sqrt(tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The square root rounded once, as IEEE asks and CUDA does: torch's CPU kernels for float32 are off by an ulp on
    about one value in 150. Through float64, whose root is at worst one float64 ulp off, it rounds correctly: the root
    of a float32 is never that close to a point halfway between two float32s."""
    root = tensor.double().sqrt_()
    return root.to(tensor.dtype) if out is None else out.copy_(root)


def new_moments(param: torch.Tensor) -> dict[str, torch.Tensor]:
    """The state of a tensor not yet updated: step 0 and zero moments, as torch's AdamW starts."""
    return {
        "step": torch.tensor(0.0),
        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
    }


@torch.no_grad()
def adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    moments: dict[str, torch.Tensor],
    hp: OptimizerHParams,
    done: int | None = None,
) -> None:
    """One AdamW step of ``param`` with ``grad``, in place, and of its ``moments`` (``new_moments`` at first). One
    scratch tensor holds each intermediate in turn. ``done``: the steps the moments had, where the caller read them
    already (``steps_done``)."""
    step = (int(moments["step"].item()) if done is None else done) + 1
    beta1, beta2 = (float(b) for b in hp.betas)
    grad = grad.to(param.dtype)
    exp_avg, exp_avg_sq = moments["exp_avg"], moments["exp_avg_sq"]
    if hp.weight_decay:
        param.mul_(1.0 - hp.lr * hp.weight_decay)
    scratch = torch.mul(grad, 1.0 - beta1)
    exp_avg.mul_(beta1).add_(scratch)
    torch.mul(grad, grad, out=scratch).mul_(1.0 - beta2)
    exp_avg_sq.mul_(beta2).add_(scratch)
    correctly_rounded_sqrt(exp_avg_sq, out=scratch)
    scratch.mul_(1.0 / math.sqrt(one_minus_power(beta2, step))).add_(hp.eps)
    torch.div(exp_avg, scratch, out=scratch).mul_(hp.lr / one_minus_power(beta1, step))
    param.sub_(scratch)
    moments["step"].fill_(step)


class BlockOptimizer:
    """A block's AdamW state: per LoRA tensor its moments under torch's keys, created at its first update."""

    def __init__(self) -> None:
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def step(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        hp: OptimizerHParams,
        done: list[int | None] | None = None,
    ) -> None:
        """One AdamW step of each of ``params``, whose moments had ``done`` steps (``steps_done``; None: read here,
        one each)."""
        for param, grad, steps in zip(params, grads, done or [None] * len(params), strict=True):
            adamw_(param, grad, self.state.setdefault(param, new_moments(param)), hp, steps)


def steps_done(blocks: list[tuple[BlockOptimizer, list[torch.Tensor]]]) -> list[list[int]]:
    """Per block (its optimizer and LoRA tensors), the steps each tensor's moments had (0 before the first): read
    for a whole span at once, where one read per tensor was a sync each once the counts were loaded onto a GPU."""
    counts = [opt.state[p]["step"] if p in opt.state else torch.tensor(0.0) for opt, params in blocks for p in params]
    read = iter(hostsync.values(torch.stack([c.double() for c in counts])) if counts else [])
    return [[int(next(read)) for _ in params] for _, params in blocks]


class ExactAdamW(torch.optim.Optimizer):
    """The peers' update behind torch's optimizer interface: local training (a parity reference, a single-machine
    run) that applies the same bits as the swarm's holders given the same gradients."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            hp = OptimizerHParams(group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"])
            for param in group["params"]:
                if param.grad is not None:
                    state = self.state[param]
                    if not state:
                        state.update(new_moments(param))
                    adamw_(param, param.grad, state, hp)
        return loss
