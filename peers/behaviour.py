"""What a peer does to its own results on their way out: an honest peer, nothing. A behaviour is given at construction
to the span's compute, the adapters' store and the peer client (``PeerDaemon(config, behaviour=...)``), so that the
trust tests' liars (``swarm.testing.dishonest``) run the real code with one result changed, and nothing is patched. A
peer given none (every real one) makes none of these calls."""

from __future__ import annotations

import torch

from peers.state import BlockAdapter, GradsByBlock


class Behaviour:
    """Each method is handed one result and returns what the peer goes on with; here, the result unchanged. A liar
    overrides one of them."""

    def forward(self, outputs: torch.Tensor) -> torch.Tensor:
        """A forward's outputs, as the caller gets them (``SpanBackend.forward``)."""
        return outputs

    def held_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """One block's LoRA gradients of a micro-batch as its backward leaves them (``AdapterStore.hold_grads``): what
        is then reported, hashed, handed on and applied."""
        return grads

    def served_grads(self, found: GradsByBlock) -> GradsByBlock:
        """Micro-batch gradients handed to another replica (``HeldGradients.micro_batch_grads``; this peer's partial
        sums are made of them too)."""
        return found

    def partial_sums(self, sums: GradsByBlock) -> GradsByBlock:
        """Partial sums handed to another replica (``HeldGradients.partial_sums``)."""
        return sums

    def sketched(self, sums: GradsByBlock) -> GradsByBlock:
        """Partial sums with their micro-batches' sketches beside them (``HeldGradients.partial_sums``), as handed
        on."""
        return sums

    def reduced_chunks(self, found: GradsByBlock) -> GradsByBlock:
        """Chunks of reduced gradients handed to another replica (``Reduction.serve``, peers/reduction/exchange.py)."""
        return found

    def fetched_grads(self, found: GradsByBlock) -> GradsByBlock:
        """Gradients fetched from another holder at commit (``PeerClient.fetch_grads``)."""
        return found

    def updated(self, states: list[BlockAdapter]) -> None:
        """After a commit's update: the blocks it took a step on (``Commits.apply``)."""
