"""Dishonest peers for the trust tests: each function turns one real in-process peer into a liar of one kind by
wrapping one method of its backend, adapter store or peer client, leaving everything else honest. Noise comes from a
generator of the liar's own, so that no other peer's or the client's random numbers change."""

from __future__ import annotations

import torch

from peers.adapters import AdapterStore
from peers.backend import SpanBackend
from swarm.testing.inprocess import InProcessPeer


def perturbed(tensors: list[torch.Tensor], noise: torch.Generator) -> list[torch.Tensor]:
    """New tensors: each plus noise of 5% of its mean magnitude."""
    return [t + 0.05 * t.abs().mean() * torch.randn(t.shape, generator=noise, dtype=t.dtype) for t in tensors]


def corrupt_forwards(backend: SpanBackend, scale: float = 0.05) -> None:
    """Wrong activations: forward outputs perturbed by ``scale`` of their mean magnitude."""
    honest, noise = backend.forward, torch.Generator().manual_seed(0)

    def forward(*args, **kwargs) -> torch.Tensor:
        outputs = honest(*args, **kwargs)
        perturbation = torch.randn(outputs.shape, generator=noise, dtype=outputs.dtype).to(outputs.device)
        return outputs + scale * outputs.abs().mean() * perturbation

    backend.forward = forward


def corrupt_backward_grads(backend: SpanBackend) -> None:
    """Wrong LoRA gradients: those it accumulates in its backward are perturbed (then reported, hashed and handed
    on consistently); its input gradients are honest."""
    honest, noise = backend.backward, torch.Generator().manual_seed(0)

    def backward(name: str, blocks: range, step: int, micro_batch: str, *args, **kwargs):
        states = {block: backend.adapters.adapter(name).blocks[block] for block in blocks}
        new = [block for block, state in states.items() if micro_batch not in state.grads]
        grad_inputs = honest(name, blocks, step, micro_batch, *args, **kwargs)
        for block in new:
            states[block].grads[micro_batch] = perturbed(states[block].grads[micro_batch], noise)
        return grad_inputs

    backend.backward = backward


def corrupt_served_grads(adapters: AdapterStore) -> None:
    """Swapped gradients at commit: those it hands other replicas (``grads``) are perturbed, those it holds and
    applies itself are honest."""
    honest, noise = adapters.micro_batch_grads, torch.Generator().manual_seed(0)

    def micro_batch_grads(*args, **kwargs):
        found = honest(*args, **kwargs)
        return {block: {mb: perturbed(g, noise) for mb, g in by_mb.items()} for block, by_mb in found.items()}

    adapters.micro_batch_grads = micro_batch_grads


def corrupt_partial_sums(adapters: AdapterStore) -> None:
    """A wrong partial sum at commit: the one it hands other replicas is perturbed; the micro-batch gradients it
    hands on, and what it applies itself, are honest."""
    honest, noise = adapters.partial_sums, torch.Generator().manual_seed(0)

    def partial_sums(*args, **kwargs):
        found = honest(*args, **kwargs)
        return {block: {key: perturbed(g, noise) for key, g in by_key.items()} for block, by_key in found.items()}

    adapters.partial_sums = partial_sums


def frame_holders(peer: InProcessPeer) -> None:
    """A false accuser at commit: it perturbs the gradients it fetches from their honest holders, so that they fail
    its hash check and it refuses the commit naming those holders (``bad_gradients``)."""
    client = peer.daemon.parts.peers
    honest, noise = client.fetch_grads, torch.Generator().manual_seed(0)

    async def fetch_grads(*args, **kwargs):
        found = await honest(*args, **kwargs)
        return {block: {mb: perturbed(g, noise) for mb, g in by_mb.items()} for block, by_mb in found.items()}

    client.fetch_grads = fetch_grads


def corrupt_updates(adapters: AdapterStore) -> None:
    """A wrong update at commit: after each honest one, noise (1% of the LoRA tensors' mean magnitude) added to the
    tensors of the blocks it moved; forwards and backwards stay honest."""
    honest, noise = adapters.apply, torch.Generator().manual_seed(0)

    def apply(name: str, step: int, *args, **kwargs) -> dict[int, int]:
        before = adapters.adapter(name).steps()
        steps = honest(name, step, *args, **kwargs)
        with torch.no_grad():
            for block, state in adapters.adapter(name).blocks.items():
                if before.get(block) == step and steps.get(block) == step + 1:
                    for lp in state.params:
                        perturbation = torch.randn(lp.param.shape, generator=noise, dtype=lp.param.dtype)
                        lp.param.add_(0.01 * lp.param.abs().mean() * perturbation.to(lp.param.device))
        return steps

    adapters.apply = apply
