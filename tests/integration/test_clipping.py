"""Global gradient clipping and token-weighted accumulation on real peers in this process (issue 23, points 1-2):
``model.clip_grad_norm_`` returns the norm torch computes for a local peft model and every replica applies the same
factor, so the adapter equals local peft clipped with torch; the shares of the norm come with the backward replies
(no extra request) unless a failure spread a block's micro-batches over replicas, and a failure between clipping and
the commit changes nothing."""

from __future__ import annotations

import math
from collections.abc import Callable

import peft
import pytest
import torch
from safetensors.torch import load_file

import swarm
from swarm.client.trainstep import label_tokens
from swarm.net.errors import CommitError
from swarm.net.protocol import Method, method_of
from swarm.testing.faults import CallTap
from swarm.testing.parity import client_requests, local_peft
from swarm.testing.recipe import HPARAMS, LORA

MAX_NORM = 0.02  # below every step's norm here: clipping engages at every step


def token_batches(step: int, vocab: int = 256) -> list[dict[str, torch.Tensor]]:
    """Three micro-batches of different token counts: full rows, a padded row with a masked prompt, a short one."""
    g = torch.Generator().manual_seed(500 + step)
    full = torch.randint(0, vocab, (2, 12), generator=g)
    padded = torch.randint(0, vocab, (2, 12), generator=g)
    mask = torch.ones_like(padded)
    mask[1, 7:] = 0
    labels = padded.masked_fill(mask == 0, -100)
    labels[:, :4] = -100  # the prompt: no loss on it
    short = torch.randint(0, vocab, (1, 5), generator=g)
    return [
        dict(input_ids=full, attention_mask=torch.ones_like(full), labels=full),
        dict(input_ids=padded, attention_mask=mask, labels=labels),
        dict(input_ids=short, attention_mask=torch.ones_like(short), labels=short),
    ]


Hook = Callable[[int, int], None]


def train_clipped(
    model,
    optimizer,
    clip: Callable[[float], torch.Tensor],
    norm_types: list[float],
    after_backward: Hook = lambda step, index: None,
    after_clip: Callable[[int], None] = lambda step: None,
) -> tuple[list[float], list[float]]:
    """transformers' Trainer's loop: per step, every micro-batch's summed token loss over the step's label tokens,
    backward, clip, step. Returns the losses and the norms before clipping."""
    losses, norms = [], []
    for step, norm_type in enumerate(norm_types):
        micro = token_batches(step)
        items = sum(label_tokens(batch["labels"]) for batch in micro)
        for index, batch in enumerate(micro):
            out = model(**batch, num_items_in_batch=items)
            out.loss.backward()
            losses.append(out.loss.item())
            after_backward(step, index)
        norms.append(float(clip(norm_type)))
        after_clip(step)
        optimizer.step()
        optimizer.zero_grad()
    return losses, norms


def local_reference(model_dir, initial, out, norm_types: list[float]) -> tuple[list[float], list[float], dict]:
    reference = local_peft(model_dir, initial)
    trainable = [p for p in reference.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, **HPARAMS)
    losses, norms = train_clipped(
        reference, optimizer, lambda p: torch.nn.utils.clip_grad_norm_(trainable, MAX_NORM, p), norm_types
    )
    reference.save_pretrained(out)
    return losses, norms, load_file(out / "adapter_model.safetensors")


def connect(swarm_, model_dir, adapter: str, **client) -> swarm.SwarmModelForCausalLM:
    return swarm.SwarmModelForCausalLM.from_pretrained(
        model_dir,
        initial_peers=swarm_.initial_peers,
        adapter=adapter,
        lora_config=peft.LoraConfig(**LORA),
        seed=5,
        **client,
    )


def assert_same_adapter(final_dir, reference: dict) -> None:
    state = load_file(final_dir / "adapter_model.safetensors")
    assert state.keys() == reference.keys()
    for key in state:
        torch.testing.assert_close(state[key], reference[key], rtol=1e-4, atol=1e-6, msg=key)


def test_clipping_and_token_weighting_equal_local_peft_with_torch_clipping(llama_pair, tiny_models, tmp_path):
    """Four steps of three micro-batches of different token counts, weighted per token, clipped with the 2-norm (the
    shares from the backward replies: no norms request), the inf-norm (the same), and the 1-norm (asked for: one
    request per replica). Norms, losses and the adapter equal local peft with torch's clip_grad_norm_."""
    model_dir, norm_types = tiny_models["llama"], [2.0, 2.0, math.inf, 1.0]
    tap = CallTap()
    model = connect(llama_pair, model_dir, "clipped", call_hook=tap)
    try:
        model.save_adapter(tmp_path / "initial")
        sent = client_requests(tap)
        optimizer = swarm.RemoteOptimizer(model, **HPARAMS)
        losses, norms = train_clipped(model, optimizer, lambda p: model.clip_grad_norm_(MAX_NORM, p), norm_types)
        model.save_adapter(tmp_path / "final")
    finally:
        model.shutdown()
    local_losses, local_norms, reference = local_reference(model_dir, tmp_path / "initial", tmp_path / "r", norm_types)
    assert all(n > MAX_NORM for n in local_norms), local_norms  # clipping engaged at every step
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(local_norms), rtol=1e-4, atol=0)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(local_losses), rtol=1e-4, atol=1e-6)
    assert_same_adapter(tmp_path / "final", reference)
    norm_requests = [meta for meta in sent if method_of(meta) == Method.NORMS]
    assert {meta["norm_type"] for meta in norm_requests} == {1.0}, norm_requests  # only the 1-norm was asked for
    assert len(norm_requests) == 2  # one per replica (two spans), once


def test_train_step_weights_tokens_and_clips_like_the_loop(llama_pair, tiny_models, tmp_path):
    """``train_step`` (pipelined) weights micro-batches by their label tokens by default: the same gradients as the
    Trainer-style loop, so with clipping the adapter equals local peft's."""
    model_dir, norm_types = tiny_models["llama"], [2.0, 2.0]
    model = connect(llama_pair, model_dir, "clipped-pipelined")
    try:
        model.save_adapter(tmp_path / "initial")
        optimizer = swarm.RemoteOptimizer(model, **HPARAMS)
        losses, norms = [], []
        for step in range(len(norm_types)):
            losses.append(model.train_step(token_batches(step)).item())
            norms.append(float(model.clip_grad_norm_(MAX_NORM)))
            optimizer.step()
        model.save_adapter(tmp_path / "final")
    finally:
        model.shutdown()
    local_losses, local_norms, reference = local_reference(model_dir, tmp_path / "initial", tmp_path / "r", norm_types)
    per_step = [sum(local_losses[3 * s : 3 * s + 3]) for s in range(len(norm_types))]  # each: the step's token mean
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(per_step), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(local_norms), rtol=1e-4, atol=0)
    assert_same_adapter(tmp_path / "final", reference)


def test_a_non_finite_norm_discards_the_step_with_a_clear_error(llama_pair, tiny_models):
    """A gradient that became Inf on a peer: clipping says so, nothing is applied, and the next step trains."""
    model = connect(llama_pair, tiny_models["llama"], "non-finite")
    try:
        before = model.adapter_state()
        for batch in token_batches(0):
            model(**batch).loss.backward()
        peer = next(p for p in llama_pair.peers.values() if 0 in p.backend.blocks)
        state = peer.adapters.adapter("non-finite").blocks[0]
        next(iter(state.grads.values()))[0].fill_(math.inf)  # as an overflow in the peer's backward would
        with pytest.raises(CommitError, match="step 0 is inf: the step is discarded"):
            model.clip_grad_norm_(1.0, norm_type=1.0)
        assert model.step == 0 and model.ledger.empty
        swarm.RemoteOptimizer(model, **HPARAMS).step()  # nothing to commit
        after = model.adapter_state()
        assert all(torch.equal(before[b][n], after[b][n]) for b in before for n in before[b])
        for batch in token_batches(1):
            model(**batch).loss.backward()
        assert math.isfinite(float(model.clip_grad_norm_(1.0)))
        swarm.RemoteOptimizer(model, **HPARAMS).step()
        assert model.step == 1
    finally:
        model.shutdown()


def test_failures_before_and_after_clipping_change_neither_the_norm_nor_the_adapter(
    inprocess_swarm, tiny_models, tmp_path
):
    """b, c and d serve 2:4. In step 1 the holder of the first micro-batch's gradients on 2:4 is killed before the
    others run: its gradients are replayed before the norm counts (asked of the replicas, which find them gone, or
    reported whole by the one replica that holds all of the step's micro-batches after the replay). (Replicas share a
    step's micro-batches anyway, whenever the routes differ; then the norm is asked for.) In step 2 the holder is
    killed after clipping, before the commit: the commit replays them with the factor already computed. Norms and
    adapter equal local peft's."""
    model_dir, norm_types = tiny_models["llama"], [2.0, 2.0, 2.0]
    swarm_ = inprocess_swarm()
    peers = swarm_.start_peers({"a": "0:2", "b": "2:4", "c": "2:4", "d": "2:4"})
    tap = CallTap()
    model = connect(swarm_, model_dir, "clip-failures", call_hook=tap)
    killed = []

    def kill_holder(step: int) -> None:
        holder = next(iter(model.ledger.holders[2].values()))
        victim = next(p for p in peers.values() if p.alive and p.peer_id == holder)
        victim.kill()
        killed.append((step, victim.name))

    try:
        model.save_adapter(tmp_path / "initial")
        sent = client_requests(tap)
        optimizer = swarm.RemoteOptimizer(model, **HPARAMS)
        losses, norms = train_clipped(
            model,
            optimizer,
            lambda p: model.clip_grad_norm_(MAX_NORM, p),
            norm_types,
            after_backward=lambda step, index: kill_holder(step) if (step, index) == (1, 0) else None,
            after_clip=lambda step: kill_holder(step) if step == 2 else None,
        )
        model.save_adapter(tmp_path / "final")
    finally:
        model.shutdown()
    assert len(killed) == 2, killed
    # step 1: the first micro-batch's gradients died with their holder and were computed again before the norm that
    # counted: either a replica found them gone when the norm was asked for, they were replayed and the norm asked
    # for again; or the client already knew the holder dead (a later forward or its collect found it gone) and
    # replayed them before clipping. Then, where one replica came to hold all of 2:4's micro-batches, its backward
    # replies reported the norm and nothing was asked: the norm that counted came before the commit. A replay is a
    # forward and backward of that micro-batch along a chain when the client kept it as one segment, or a backward
    # alone (the peer recomputes its forward from the kept input) when a failure had split its forward into hops.
    step1 = [(method_of(m), m.get("micro_batch")) for m in sent if m.get("step") == 1]
    first = next(mb for method, mb in step1 if method == Method.FORWARD)
    asked = [i for i, (method, _) in enumerate(step1) if method == Method.NORMS]
    counted = asked[-1] if asked else next(i for i, (method, _) in enumerate(step1) if method == Method.COMMIT)
    assert step1[:counted].count((Method.BACKWARD, first)) >= 2, step1
    local_losses, local_norms, reference = local_reference(model_dir, tmp_path / "initial", tmp_path / "r", norm_types)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(local_norms), rtol=1e-4, atol=0)
    assert_same_adapter(tmp_path / "final", reference)
