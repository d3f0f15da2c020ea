"""Dishonest peers for the trust tests: each class is the behaviour (``peers.behaviour.Behaviour``) of a liar of one
kind, given to one real in-process peer when it is built (``InProcessSwarm.start_peers(..., behaviours=...)``); it
changes one result and leaves everything else honest. Noise comes from a generator of the liar's own, so that no
other peer's or the client's random numbers change."""

from __future__ import annotations

import torch

from peers.behaviour import Behaviour
from peers.state import BlockAdapter, GradsByBlock
from swarm.net import sketch
from swarm.net.protocol import SKETCH, SUM


class Liar(Behaviour):
    """A behaviour with noise of its own."""

    def __init__(self) -> None:
        self.noise = torch.Generator().manual_seed(0)

    def perturbed(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """New tensors: each plus noise of 5% of its mean magnitude."""
        return [t + 0.05 * t.abs().mean() * torch.randn(t.shape, generator=self.noise, dtype=t.dtype) for t in tensors]

    def perturbed_by_block(self, found: GradsByBlock) -> GradsByBlock:
        return {block: {key: self.perturbed(g) for key, g in by_key.items()} for block, by_key in found.items()}


class CorruptForwards(Liar):
    """Wrong activations: forward outputs perturbed by ``scale`` of their mean magnitude."""

    def __init__(self, scale: float = 0.05) -> None:
        super().__init__()
        self.scale = scale
        self.told = 0  # forwards it answered wrongly: a test knows the router sent it work

    def forward(self, outputs: torch.Tensor) -> torch.Tensor:
        self.told += 1
        perturbation = torch.randn(outputs.shape, generator=self.noise, dtype=outputs.dtype).to(outputs.device)
        return outputs + self.scale * outputs.abs().mean() * perturbation


class CorruptBackwardGrads(Liar):
    """Wrong LoRA gradients: those it accumulates in its backward are perturbed (then reported, hashed and handed
    on consistently); its input gradients are honest."""

    def held_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.perturbed(grads)


class CorruptServedGrads(Liar):
    """Swapped gradients at commit: those it hands other replicas (``grads``, and the partial sums made of them) are
    perturbed, those it holds and applies itself are honest."""

    def served_grads(self, found: GradsByBlock) -> GradsByBlock:
        return self.perturbed_by_block(found)


class CorruptPartialSums(Liar):
    """A wrong partial sum at commit: the one it hands other replicas is perturbed; the micro-batch gradients it
    hands on, and what it applies itself, are honest."""

    def partial_sums(self, sums: GradsByBlock) -> GradsByBlock:
        return self.perturbed_by_block(sums)


class ForgedSketches(Liar):
    """A wrong partial sum handed on with its micro-batches' sketches forged to add up to it (each carries an equal
    share of the change, swarm/net/sketch.py): the sketches agree with the sum, and only an audit of a micro-batch
    (its gradient fetched, hashed and projected again) tells. Its micro-batch gradients, and what it applies itself,
    are honest."""

    def partial_sums(self, sums: GradsByBlock) -> GradsByBlock:
        return self.perturbed_by_block(sums)

    def sketched(self, sums: GradsByBlock) -> GradsByBlock:
        for by_key in sums.values():
            summed, (reported,) = by_key[SUM], by_key[SKETCH]
            own = sketch.sketches([sketch.flat(summed)], sketch.seed_of(summed))[0]
            by_key[SKETCH] = [reported + (own - reported.sum(0)) / len(reported)]
        return sums


class CorruptReducedChunks(Liar):
    """A wrong chunk of a reduced gradient (peers/reduction/scatter.py): the one it hands the block's other replicas is
    perturbed; its partial sums, and what it applies itself, are honest."""

    def reduced_chunks(self, found: GradsByBlock) -> GradsByBlock:
        return self.perturbed_by_block(found)


class FrameHolders(Liar):
    """A false accuser at commit: it perturbs the gradients it fetches from their honest holders, so that they fail
    its hash check and it refuses the commit naming those holders (``bad_gradients``)."""

    def fetched_grads(self, found: GradsByBlock) -> GradsByBlock:
        return self.perturbed_by_block(found)


class CorruptUpdates(Liar):
    """A wrong update at commit: after each honest one, noise (1% of the LoRA tensors' mean magnitude) added to the
    tensors of the blocks it moved; forwards and backwards stay honest."""

    def updated(self, states: list[BlockAdapter]) -> None:
        with torch.no_grad():
            for state in states:
                for lp in state.params:
                    perturbation = torch.randn(lp.param.shape, generator=self.noise, dtype=lp.param.dtype)
                    lp.param.add_(0.01 * lp.param.abs().mean() * perturbation.to(lp.param.device))
